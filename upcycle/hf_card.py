"""The model card (README.md) of a HuggingFace export (`upcycle.hf_export`): what the model
is, where it comes from and how it was made, from what the checkpoint's directories keep.

  ---                                    front matter the Hub reads
  library_name: transformers
  tags: [upcycle, mixture-of-experts]    (the second for an MoE)
  ---
  # <output directory's name>
  Architecture  the HF class, layers, d_model, vocabulary, dtype; an MoE's experts, top k,
                MoE layers and load-balancing weight (`router_aux_loss_coef`)
  Source        the checkpoint exported, its format and step
  Upcycling     the upcycling report's summary (method, source, experts' ratio), where the run
                or `convert` output keeps `upcycling_report.txt`
  Training      steps, and tokens = steps x BATCH_SIZE x TASK_FEATURE_LENGTHS['targets'] (token
                positions, padding included) from the run's config.gin, where it has one
  Checks        what the export verified
"""

import ast
import os
import re
from typing import Any, Mapping, Optional

from etils import epath

from upcycle.upcycling import report_file

CARD = 'README.md'
CONFIG_GIN = 'config.gin'


def _kept(directories, name: str) -> Optional[str]:
  """The text of the first `directory/name` that exists, or None."""
  for directory in directories:
    path = epath.Path(directory) / name
    if path.exists():
      return path.read_text()
  return None


def _macro(config_gin: str, name: str) -> Any:
  """The literal value config.gin binds to macro `name`, or None."""
  m = re.search(rf'^{name} = (.+)$', config_gin, flags=re.MULTILINE)
  try:
    return ast.literal_eval(m.group(1)) if m else None
  except (ValueError, SyntaxError):
    return None


def _architecture(hf: Mapping[str, Any], config: Any) -> str:
  lines = [f'- `{hf["architectures"][0]}`, {hf.get("num_hidden_layers") or hf.get("num_layers")}'
           f' layers, d_model {hf.get("hidden_size") or hf.get("d_model")}, vocabulary '
           f'{hf["vocab_size"]}, weights in {hf.get("dtype")}']
  moe = getattr(config, 'moe', None)
  if moe is not None:
    lines.append(f'- Mixture of experts: {moe.num_experts} experts, top '
                 f'{moe.router.experts_per_token} per token, in layers '
                 f'{list(config.sparse_layers())}; `output_router_logits` true, so transformers '
                 f'adds the load-balancing loss times `router_aux_loss_coef` = '
                 f'{moe.balance.weight:g} when it fine-tunes')
  return '\n'.join(lines)


def _training(config_gin: Optional[str], step: Optional[int]) -> Optional[str]:
  """'- N steps of B x L token positions: T tokens', where a trained run's config.gin binds
  BATCH_SIZE and TASK_FEATURE_LENGTHS (a `convert` output's binds neither)."""
  if config_gin is None or step is None:
    return None
  batch, lengths = _macro(config_gin, 'BATCH_SIZE'), _macro(config_gin, 'TASK_FEATURE_LENGTHS')
  if not isinstance(batch, int) or not isinstance(lengths, dict) or 'targets' not in lengths:
    return None
  return (f'- {step} steps of {batch} x {lengths["targets"]} token positions: '
          f'{step * batch * lengths["targets"]:,} tokens (padding included)')


def text(hf: Mapping[str, Any], config: Any, ckpt: Any, run_dirs, name: str) -> str:
  """README.md for the export named `name` of checkpoint `ckpt` (its `format`, `path`,
  `step`) as the config.json `hf` of model `config`; `run_dirs`: the directories that may keep
  the run's `upcycling_report.txt` and `config.gin` (the run's checkpoints/ and MODEL_DIR)."""
  tags = ['upcycle'] + (['mixture-of-experts'] if getattr(config, 'moe', None) else [])
  sections = [
      '---\nlibrary_name: transformers\ntags:\n' + ''.join(f'- {t}\n' for t in tags) + '---',
      f'# {name}',
      '## Architecture\n\n' + _architecture(hf, config),
      f'## Source\n\n- `{ckpt.path}` ({ckpt.format} checkpoint'
      f'{"" if ckpt.step is None else f", step {ckpt.step}"}), exported by '
      f'`python -m upcycle.export --format=hf`',
  ]
  report = _kept(run_dirs, report_file.REPORT_FILE)
  if report is not None:
    summary = report.split('\n\n', 1)[0]
    sections.append('## Upcycling\n\n```\n' + summary + '\n```')
  training = _training(_kept(run_dirs, CONFIG_GIN), ckpt.step)
  if training is not None:
    sections.append('## Training\n\n' + training)
  sections.append(
      '## Checks\n\n- Every parameter was checked against the model (names, shapes) before '
      'anything was written; the tensors are the checkpoint\'s, renamed and transposed as '
      'transformers names them (MoE experts per expert, as `save_pretrained` writes them).')
  return '\n\n'.join(sections) + '\n'


def run_directories(root: str) -> tuple:
  """Where a run keeps its report and config: `root` (its checkpoints/ or a convert output)
  and the directory above it (MODEL_DIR)."""
  return (root, os.path.dirname(root.rstrip('/')))
