"""Writes a HuggingFace model directory, as `save_pretrained` lays it out:

  OUTPUT_DIR/config.json
  OUTPUT_DIR/model.safetensors                        when the weights fit in one shard, else
  OUTPUT_DIR/model-00001-of-0000N.safetensors ...     shards of at most `max_shard_bytes`
  OUTPUT_DIR/model.safetensors.index.json             {'metadata': {'total_size'},
                                                       'weight_map': {tensor: shard file}}
  OUTPUT_DIR/<other files>                            e.g. the tokenizer's
  OUTPUT_DIR/digests/process_0.json                   the CRC-32 of every tensor written, by
                                                      name (`digests.py`; transformers ignores it)

Tensors fill the shards in order, a tensor larger than a shard alone in one (transformers'
rule). They may be `LazyArray`s (also transposed ones, `LazyArray.map`): each is read, written
and dropped in turn, so memory holds one tensor. The directory is written whole or not at all
(`atomic_dir`): an existing non-empty OUTPUT_DIR is refused, a second export into it while one
runs is refused, and a failed one leaves nothing.
"""

import json
import os
import re
from typing import Any, Dict, List, Mapping

from upcycle import progress
from upcycle.checkpoints import atomic_dir, digests, safetensors_file
from upcycle.checkpoints.hf import SAFETENSORS, SAFETENSORS_INDEX

# transformers' `convert_file_size_to_int`: KB, MB, GB are powers of 10, KiB, MiB, GiB of 2.
_UNITS = {'': 1, 'B': 1, 'KB': 10**3, 'MB': 10**6, 'GB': 10**9, 'TB': 10**12,
          'KIB': 2**10, 'MIB': 2**20, 'GIB': 2**30, 'TIB': 2**40}


def parse_size(text: str) -> int:
  """'5GB' -> 5 * 10**9, '200KB' -> 200_000, '2GiB' -> 2 * 2**30, '1000' -> 1000 (bytes)."""
  m = re.fullmatch(r'\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*', str(text))
  if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
    raise ValueError(f'{text!r} is not a size: expected a positive number of bytes with an '
                     f'optional unit, e.g. 5GB, 200KB or 2GiB.')
  return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def shards(tensors: Mapping[str, Any], max_shard_bytes: int) -> List[List[str]]:
  """The tensor names grouped, in order, into shards of at most `max_shard_bytes` each; a
  larger tensor is a shard of its own."""
  out: List[List[str]] = []
  size = 0
  for name, leaf in tensors.items():
    nbytes = safetensors_file.nbytes(leaf)
    if not out or size + nbytes > max_shard_bytes:
      out.append([])
      size = 0
    out[-1].append(name)
    size += nbytes
  return out


def _write_weights(directory: str, tensors: Mapping[str, Any], max_shard_bytes: int,
                   done: progress.Progress) -> None:
  groups = shards(tensors, max_shard_bytes)
  metadata = {'format': 'pt'}   # transformers' loader reads only files marked so
  if len(groups) == 1:
    safetensors_file.write(os.path.join(directory, SAFETENSORS), tensors, metadata, done)
    return
  weight_map: Dict[str, str] = {}
  for i, names in enumerate(groups, 1):
    shard = f'model-{i:05d}-of-{len(groups):05d}.safetensors'
    safetensors_file.write(os.path.join(directory, shard), {n: tensors[n] for n in names},
                           metadata, done)
    weight_map.update({name: shard for name in names})
  index = {'metadata': {'total_size': sum(safetensors_file.nbytes(t) for t in tensors.values())},
           'weight_map': weight_map}
  with open(os.path.join(directory, SAFETENSORS_INDEX), 'w') as f:
    json.dump(index, f, indent=2, sort_keys=True)


def write(output_dir: str, config: Mapping[str, Any], tensors: Mapping[str, Any],
          files: Mapping[str, bytes], max_shard_bytes: int) -> str:
  """Writes `output_dir` (module docstring); returns its absolute path.

  Args:
    output_dir: a local directory that does not exist or is empty.
    config: config.json's content.
    tensors: {HF tensor name: array or LazyArray}, in the order they are written.
    files: other files, {name: bytes} (the tokenizer's).
    max_shard_bytes: the largest shard (`parse_size`).

  Raises:
    FileExistsError: `output_dir` exists and is not empty, or another write of it is running.
  """
  final = os.path.abspath(os.fspath(output_dir))
  taken = (f'{final} already exists and is not empty; an export never overwrites. Fix: delete '
           f'it, or pass another --output_dir.')
  done = progress.Progress(os.path.basename(final), 'tensors', total=len(tensors))
  recorded: Dict[str, Any] = {}
  writer = atomic_dir.write_of(final, fix='write into another --output_dir', taken=taken)
  with atomic_dir.create(final, writer) as tmp:
    _write_weights(tmp, digests.recording(dict(tensors), recorded), max_shard_bytes, done)
    digests.write(tmp, {'params': recorded})
    for name, data in files.items():
      with open(os.path.join(tmp, name), 'wb') as f:
        f.write(data)
    with open(os.path.join(tmp, 'config.json'), 'w') as f:
      json.dump(dict(config), f, indent=2, sort_keys=True)
      f.write('\n')
  done.finish()
  return final
