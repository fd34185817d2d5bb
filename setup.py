"""upcycle: sparse upcycling of dense T5 / ViT checkpoints into Mixture-of-Experts models."""

import setuptools

setuptools.setup(
    name='upcycle',
    version='0.1.0',
    description='Sparse upcycling of dense T5 and ViT checkpoints into MoE models, in JAX/Flax.',
    python_requires='>=3.11',   # the pins (jax 0.10.2, numpy 2.4.6, scipy, ...) need 3.11
    # configs/ ships inside the package as upcycle/configs/ (gin_utils.CONFIGS_DIR), so a
    # wheel install finds the gin files the README's commands name.
    packages=setuptools.find_packages(include=['upcycle', 'upcycle.*']) + ['upcycle.configs'],
    package_dir={'upcycle.configs': 'configs'},
    package_data={'upcycle.configs': ['**/*.gin']},
    install_requires=[
        'jax==0.10.2',
        'jaxlib==0.10.2',
        'flax==0.12.8',
        'optax==0.2.8',
        'orbax-checkpoint==0.12.8',
        'tensorstore==0.1.86',
        'gin-config==0.5.0',
        'msgpack==1.2.4',
        'ml_dtypes==0.6.0',
        'numpy==2.4.6',
        'scipy==1.17.1',
        # JAX's persistent compilation cache with a size bound (platforms.cache_compilations)
        # locks its directory with it.
        'filelock==4.3.2',
        # Input pipelines (imported only by the training / eval entry points).
        'seqio==0.0.20',
        'tensorflow==2.21.0',
        'tensorflow-text==2.21.1',
        'tensorflow-datasets==4.9.10',
        # TFDS 4.9.10 imports it to prepare any dataset (DatasetBuilder.code_path) but
        # declares it for Python < 3.9 only.
        'importlib_resources==7.1.0',
        'tensorboard==2.21.0',
        'scikit-learn==1.9.1',
        # Decoder-only runs: a checkpoint's own tokenizer (tokenizer.json / tokenizer.model)
        # and the offline byte-level BPE.
        'tokenizers==0.23.3',
        'sentencepiece==0.2.3',
        # Instruction tuning (upcycle/data/sft.py): chat templates (transformers' renderer's
        # version) and Parquet files of samples.
        'jinja2==3.1.6',
        'pyarrow==26.0.1',
        'matplotlib==3.11.2',
    ],
    extras_require={
        # The TPU compiler, for `python -m upcycle.aot` (compile for a TPU topology on any
        # host) and the TPU runtime on a TPU VM: the libtpu that jax[tpu]==0.10.2 pins.
        'tpu': ['libtpu==0.0.42.1'],
        # `python -m upcycle.lm_eval`: lm-evaluation-harness tasks scored on our checkpoints.
        'eval': ['lm-eval==0.4.13'],
        'test': [
            'libtpu==0.0.42.1',   # tests/test_aot.py compiles for TPU v4
            'pytest==9.2.0',
            'pytest-xdist==3.8.0',   # the suite runs on two workers (pytest.ini)
            'torch==2.13.0',
            'transformers==5.24.0',
            'safetensors==0.8.0',
            # tests/test_lm_eval.py: ours against lm-eval's hf backend (which needs accelerate)
            'lm-eval==0.4.13',
            'accelerate==1.16.0',
            # tests/data/test_sft.py: a dataset saved by datasets' save_to_disk (lm-eval's too)
            'datasets==5.2.0',
            # notebooks/ run in a real kernel by tests/test_notebooks.py
            'nbclient==0.11.0',
            'nbformat==5.11.1',
            'ipykernel==7.4.0',
            'jupyter-client==8.10.0',
            # GCS: gcsfs for etils.epath's gs:// backend in tests/train/test_gcs.py, and the
            # local emulator that test runs against.
            'gcsfs==2026.10.1',
            'gcp-storage-emulator==2026.7.19',
        ],
    },
)
