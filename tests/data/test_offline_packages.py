"""The 'packages' offline corpus: the pinned numpy, scipy, scikit-learn and matplotlib sources,
their digest, and what a run records of it."""

import hashlib
import json
import os
import pathlib
import re
import shutil

import gin
import pytest

from tests.helpers import REPO
from upcycle import gin_utils
from upcycle.data import offline_text
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.train import __main__ as train_main

FOLDERS = ('numpy', 'scipy', 'sklearn', 'matplotlib')


def _fake_install(root, versions):
  """A site-packages at `root`: a few modules per package (test suites and vendored code
  among them) and each distribution's `.dist-info/METADATA` at `versions`."""
  files = {'numpy/__init__.py': 'import os\n', 'numpy/linalg/_linalg.py': 'def inv(a):\n  pass\n',
           'numpy/linalg/tests/test_linalg.py': 'def test(): pass\n',
           'numpy/__config__.py': 'CONFIG = {}\n', 'scipy/test/x.py': 'x = 1\n',
           'scipy/stats/_stats_py.py': '"""Statistics."""\n',
           'scipy/_lib/array_api_compat/y.py': 'y = 2\n', 'sklearn/base.py': 'class Base: pass\n',
           'sklearn/externals/_arff.py': 'z = 3\n', 'matplotlib/_cm_listed.py': '_data = [0.1]\n',
           'matplotlib/pyplot.py': 'def plot(): pass\n', 'matplotlib/notes.txt': 'not code\n'}
  for path, text in files.items():
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)
  for name, version in versions.items():
    info = root / f'{name.replace("-", "_")}-{version}.dist-info'
    info.mkdir()
    (info / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n')


def _sha256(root, names, versions):
  """The documented digest, written out with hashlib."""
  h = hashlib.sha256()
  h.update(''.join(f'{n}=={v}\n' for n, v in versions.items()).encode())
  for name in names:
    data = (root / name).read_bytes()
    h.update(name.encode() + b'\0' + str(len(data)).encode() + b'\0' + data)
  return h.hexdigest()


def test_the_digest_is_sha256_over_versions_paths_and_bytes_of_the_kept_modules(tmp_path):
  versions = {'numpy': '2.0.0', 'scipy': '1.0.0', 'scikit-learn': '1.1.0', 'matplotlib': '3.0.0'}
  _fake_install(tmp_path, versions)
  modules = offline_text.package_modules(tmp_path)
  names = [m.relative_to(tmp_path).as_posix() for m in modules]
  assert names == ['matplotlib/pyplot.py', 'numpy/__init__.py', 'numpy/linalg/_linalg.py',
                   'scipy/stats/_stats_py.py', 'sklearn/base.py']
  assert offline_text.package_versions(tmp_path) == versions
  record = offline_text.corpus_record('packages', root=tmp_path)
  assert record['digest'] == _sha256(tmp_path, names, versions)
  assert record['matches'] is False
  assert record['pinned_digest'] == offline_text.PACKAGES_DIGEST
  # Another version, the same bytes: another digest.
  assert offline_text.digest(tmp_path, modules, {**versions, 'numpy': '2.0.1'}) != (
      record['digest'])


def test_the_pins_are_setup_pys_and_this_install_is_the_pinned_corpus():
  setup = (pathlib.Path(REPO) / 'setup.py').read_text()
  assert offline_text.PACKAGE_PINS == {
      name: re.search(rf"'{name}==([0-9.]+)'", setup).group(1)
      for name in offline_text.PACKAGES}
  record = offline_text.corpus_record('packages')
  assert record['versions'] == offline_text.PACKAGE_PINS
  assert record['matches'] is True and offline_text.mismatch_warning(record) is None
  assert record['digest'] == offline_text.PACKAGES_DIGEST


@pytest.mark.slow
def test_the_packages_bpe_trained_on_this_install_is_the_pinned_file_cached_by_corpus_digest(
    tmp_path, monkeypatch):
  """On the pinned corpus the packages BPE trained here (about 6 s) is the file whose sha256 is
  pinned, cached under the tokenizers version and the corpus's digest and read back from
  there; a file that is not the pinned one is named in one line (`pin_warning`)."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv('UPCYCLE_CACHE', str(tmp_path))
  assert offline_text.corpus_record('packages')['matches'] is True
  trained = tokenizer_lib.load(tokenizer_lib.OFFLINE_PACKAGES_BPE)
  assert tokenizer_lib.pin_warning(trained) is None
  cached = tmp_path / (f'offline_packages_bpe-4096-tokenizers{tokenizers.__version__}-'
                       f'{offline_text.PACKAGES_DIGEST}.json')
  assert os.listdir(tmp_path) == [cached.name]
  assert hashlib.sha256(cached.read_bytes()).hexdigest() == (
      tokenizer_lib.OFFLINE_PACKAGES_BPE_SHA256)
  assert trained.files['tokenizer.json'] == cached.read_bytes()
  other = trained.files['tokenizer.json'].replace(b'"ignore_merges":false',
                                                  b'"ignore_merges":true')
  assert other != trained.files['tokenizer.json']
  cached.write_bytes(other)   # read from the cache, not trained again
  reread = tokenizer_lib.load(tokenizer_lib.OFFLINE_PACKAGES_BPE)
  assert reread.files['tokenizer.json'] == other
  assert tokenizer_lib.pin_warning(reread) == (
      f"WARNING: the offline BPE 'offline_packages_bpe' trained here is not the pinned file: "
      f'tokenizer.json sha256 {hashlib.sha256(other).hexdigest()} (pinned '
      f'{tokenizer_lib.OFFLINE_PACKAGES_BPE_SHA256}), by tokenizers {tokenizers.__version__} '
      f"(setup.py pins the one that trains the pinned file). The run's ids are other ids: its "
      f"numbers are not the README's.")
  other_corpus = dict(offline_text.corpus_record('packages'), matches=False)
  assert tokenizer_lib.pin_warning(reread, other_corpus) is None   # the corpus's warning says it


def _copy_install(target):
  """The `.py` files (test suites included) and the dist-info METADATA of this machine's pinned
  packages, copied under `target`."""
  root = offline_text.packages_root()
  not_py = lambda folder, names: [n for n in names if not n.endswith('.py')
                                  and not os.path.isdir(os.path.join(folder, n))]
  for folder in FOLDERS:
    shutil.copytree(root / folder, target / folder, ignore=not_py)
  for name in offline_text.PACKAGES:
    (info,) = root.glob(f'{name.replace("-", "_")}-*.dist-info')
    (target / info.name).mkdir()
    shutil.copy(info / 'METADATA', target / info.name / 'METADATA')


def test_a_copy_of_the_install_is_the_pinned_corpus_until_one_byte_changes(tmp_path):
  _copy_install(tmp_path)
  modules = offline_text.package_modules(tmp_path)
  names = [m.relative_to(tmp_path).as_posix() for m in modules]
  assert names == sorted(names) and len(names) > 1000
  assert 'numpy/linalg/_linalg.py' in names and 'sklearn/base.py' in names
  assert (tmp_path / 'numpy/linalg/tests/test_linalg.py').exists()
  assert not [n for n in names
              if '/tests/' in n or '/test/' in n or n.startswith('sklearn/externals/')]
  assert offline_text.corpus_record('packages', root=tmp_path)['matches'] is True
  module = tmp_path / 'numpy/linalg/_linalg.py'
  data = bytearray(module.read_bytes())
  data[100] ^= 1
  module.write_bytes(bytes(data))
  record = offline_text.corpus_record('packages', root=tmp_path)
  assert record['digest'] == _sha256(tmp_path, names, offline_text.PACKAGE_PINS)
  assert record['matches'] is False
  pins = 'numpy 2.4.6, scipy 1.17.1, scikit-learn 1.9.1, matplotlib 3.11.2'
  assert offline_text.mismatch_warning(record) == (
      f"WARNING: the offline corpus 'packages' here is not the pinned one: sha256 "
      f'{record["digest"]} (pinned {offline_text.PACKAGES_DIGEST}); packages {pins} (pinned '
      f"{pins}). The run trains on this text: its numbers are not the README's.")


def test_validation_is_every_tenth_module_each_whole_in_its_split():
  modules = offline_text.package_modules()
  train, validation = (offline_text.packages_documents(s) for s in offline_text.SPLITS)
  assert max(len(d.encode()) for d in train + validation) <= offline_text.STDLIB_DOCUMENT_BYTES
  joined = {'train': ''.join(train), 'validation': ''.join(validation)}
  for i, module in enumerate(modules[:40]):
    text = module.read_text(encoding='utf-8', errors='replace').strip()
    split, other = ('validation', 'train') if i % 10 == 0 else ('train', 'validation')
    assert text in joined[split], module
    assert len(text) < 200 or text not in joined[other], module
  size = lambda docs: sum(len(d.encode()) for d in docs)
  assert 20e6 < size(train) < 30e6 and 1.5e6 < size(validation) < 4e6   # 24.9 and 2.6 MB


@pytest.mark.slow
def test_a_run_on_another_corpus_warns_in_one_line_and_records_it(tmp_path, monkeypatch, capsys,
                                                                   entry_points):
  """A tiny T5 run on the packages corpus where the pinned digest is another: the warning at
  its start, MODEL_DIR/corpus.json and the summary's corpus line name this machine's."""
  monkeypatch.setattr(offline_text, 'PACKAGES_DIGEST', '0' * 64)
  gin.clear_config(clear_constants=True)
  gin_utils.run(train_main.train, [
      '--gin_file=models/t5_1_1/tiny.gin', '--gin_file=runs/pretrain.gin',
      '--gin_file=data/offline_packages_span_corruption.gin', f"--gin.MODEL_DIR='{tmp_path}'",
      '--gin.TRAIN_STEPS=1', '--gin.BATCH_SIZE=8',
      "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
      '--gin.__main__.train.eval_data=None',
      '--gin.models.T5Config.num_encoder_layers=1', '--gin.models.T5Config.num_decoder_layers=1'],
      'test')
  found = offline_text.corpus_record('packages')
  lines = capsys.readouterr().out.splitlines()
  assert [l for l in lines if l.startswith('WARNING')] == [
      offline_text.mismatch_warning(found)]
  assert json.loads((tmp_path / 'corpus.json').read_text()) == found
  assert found['digest'] == _sha256(offline_text.packages_root(), [
      m.relative_to(offline_text.packages_root()).as_posix()
      for m in offline_text.package_modules()], offline_text.PACKAGE_PINS)
  assert lines[-1] == (f"  corpus:       packages, sha256 {found['digest']} "
                       f"(NOT the pinned {'0' * 64})")
