"""What each checkpoint format implies beyond how it is read: one `Format` per name.

  formats.of(ckpt.format).run_step     # a step our trainer saved: data position, items, digests
  formats.of('hf').hf_directory        # config.json, tokenizer files, HuggingFace's tensor names
"""

import dataclasses
from typing import Dict, Optional

from upcycle.checkpoints.errors import checkpoint_error


@dataclasses.dataclass(frozen=True)
class Format:
  """One checkpoint format.

  Attributes:
    name: as `Checkpoint.format`, `--format` and `load(format=...)` spell it.
    looked_for: what `detect_format` looks for in a path of this format, in words.
    run_step: a step this project's trainer saved (`orbax`): its items, the data position
      and the digests recorded at save; a run's MODEL_DIR is read at its latest step, while
      the run may be writing the next one.
    hf_directory: a HuggingFace model directory: its config.json, its tokenizer files, its
      tensors by HuggingFace's names.
    optimizer_layout: the layout of the optimizer state it can hold for a restore to reuse:
      'optax' (a run of ours: the run's optax state), 't5x' (T5X's Adafactor slots), None
      (the format stores none).
  """

  name: str
  looked_for: str
  run_step: bool = False
  hf_directory: bool = False
  optimizer_layout: Optional[str] = None


FORMATS: Dict[str, Format] = {f.name: f for f in (
    Format('t5x', "a 'checkpoint' msgpack file, or checkpoint_N/ sub-directories holding one",
           optimizer_layout='t5x'),
    Format('t5x_orbax', "'state/_METADATA', or checkpoint_N/state/", optimizer_layout='t5x'),
    Format('orbax', "'_CHECKPOINT_METADATA' with 'params/', or <step>/ sub-directories "
           'holding them', run_step=True, optimizer_layout='optax'),
    Format('hf', "'config.json' beside its weights (safetensors, sharded or not, or a torch "
           '.bin)', hf_directory=True),
    Format('vit_jax', 'a .npz file with ViT array names, as vit_jax saves them'),
    Format('big_vision', 'a .npz file with ViT array names, as big_vision saves them'),
)}


def of(name: str, source: str = 'format') -> Format:
  """The `Format` named `name` (one of `FORMATS`); otherwise a one-line CheckpointError on
  `source` (the checkpoint asked for) naming the known ones."""
  if name not in FORMATS:
    raise checkpoint_error(source, 'unknown format argument', expected=tuple(FORMATS),
                           found=repr(name), fix='Pass one of them, or None to detect it')
  return FORMATS[name]
