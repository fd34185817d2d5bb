"""What model a parameter tree is, inferred from names and shapes alone (no config needed).

  model_kind(params) -> 't5', 'llama', 'vit' or None
  describe(params) -> 'T5 v1.1: 12+12 layers, d_model 768, 12 heads (d_kv 64), d_ff 2048,
                      vocab 32128, dense'
                   -> 'ViT: depth 12, width 768, 12 heads, mlp 3072, patch 16x16, 196 tokens
                      (14x14), pool token, 1000 classes, MoE at 1,3,5,7,9,11, E=8'
  summary(params) -> 'a T5 model, 1.2M parameters, an MoE with 8 experts in 4 blocks'

A model family's parameter names are its `Describer` in `DESCRIBERS`, keyed by the family's
name (`upcycle.models.families.Family.name`; `tests/test_families.py` checks that every
family has one): checkpoints know names, not model configs.
"""

import dataclasses
import math
import re
from typing import Any, Callable, Dict, List, Optional

from upcycle import tree


def _is_flat(params: Any) -> bool:
  return isinstance(params, dict) and all(not isinstance(v, dict) for v in params.values())


def _starts(flat: Dict[str, Any], prefixes) -> bool:
  return any(p.startswith(prefixes) for p in flat)


_TEXT_STACKS = ('token_embedder/', 'encoder/layers_', 'decoder/layers_')


def _is_t5(flat: Dict[str, Any]) -> bool:
  """A text stack with an encoder or a relative position bias."""
  return _starts(flat, _TEXT_STACKS) and any(
      p.startswith('encoder/') or '/relpos_bias/' in p for p in flat)


def model_kind(params: Any) -> Optional[str]:
  """The name of the first family in `DESCRIBERS` whose names `params` has ('t5', 'llama': a
  decoder stack alone, no relative position bias, 'vit'), or None."""
  flat = params if _is_flat(params) else tree.flatten(params)
  return next((d.name for d in DESCRIBERS if d.matches(flat)), None)


def summary(params: Any) -> str:
  """One phrase for a param tree, as errors quote it: family, size, dense or MoE (how many
  experts, in how many blocks)."""
  flat = params if _is_flat(params) else tree.flatten(params)
  size = sum(math.prod(tree.shape_of(x)) for x in flat.values())
  blocks = tree.moe_layers(flat)
  if blocks:
    expert = next(p for p in flat if tree.classify([p])[p].kind == tree.EXPERT)
    moe = f'an MoE with {tree.shape_of(flat[expert])[0]} experts in {len(blocks)} blocks'
  else:
    moe = 'dense (no expert leaves)'
  count = (f'{size / 1e9:.1f}B' if size >= 1e9 else f'{size / 1e6:.1f}M' if size >= 1e6
           else f'{size:,}')
  kind = model_kind(flat)
  title = 'unknown' if kind is None else _DESCRIBERS[kind].title
  return f'a {title} model, {count} parameters, {moe}'


def _layer_indices(flat: Dict[str, Any], pattern: str) -> List[int]:
  return sorted({int(m.group(1)) for p in flat for m in [re.match(pattern, p)] if m})


def _shape(flat: Dict[str, Any], path: str):
  leaf = flat.get(path)
  return None if leaf is None else tuple(leaf.shape)


def _moe(flat: Dict[str, Any], layer_pattern: str, mlp: str) -> Dict[int, int]:
  """layer index -> number of experts, for the layers whose MLP has an `expert/` subtree."""
  experts = {}
  for path, leaf in flat.items():
    m = re.match(layer_pattern + f'/{mlp}/{tree.EXPERT}/', path)
    if m:
      experts[int(m.group(1))] = leaf.shape[0]
  return experts


def _moe_text(experts: Dict[str, Dict[int, int]]) -> str:
  """'dense' or 'MoE at encoder 1,3; decoder 1,3, E=8' (stack names omitted for ViT)."""
  sparse = {stack: e for stack, e in experts.items() if e}
  if not sparse:
    return 'dense'
  where = '; '.join(f'{stack} ' + ','.join(map(str, sorted(e))) if stack else
                    ','.join(map(str, sorted(e))) for stack, e in sparse.items())
  counts = sorted({n for e in sparse.values() for n in e.values()})
  return f'MoE at {where}, E=' + '/'.join(map(str, counts))


def _describe_t5(flat: Dict[str, Any]) -> str:
  vocab, d_model = _shape(flat, 'token_embedder/embedding') or (None, None)
  enc = _layer_indices(flat, r'encoder/layers_(\d+)/')
  dec = _layer_indices(flat, r'decoder/layers_(\d+)/')
  rel = _shape(flat, 'encoder/relpos_bias/rel_embedding') or _shape(
      flat, 'decoder/relpos_bias/rel_embedding')
  heads = rel[0] if rel else None
  query = _shape(flat, 'encoder/layers_0/attention/query/kernel')
  d_kv = query[-1] // heads if query and heads else None
  d_ff = None
  for path, leaf in flat.items():
    if re.search(r'/mlp/(expert/)?wi_0/kernel$', path):
      d_ff = leaf.shape[-1]
      break
  experts = {'encoder': _moe(flat, r'encoder/layers_(\d+)', 'mlp'),
             'decoder': _moe(flat, r'decoder/layers_(\d+)', 'mlp')}
  head = '' if 'decoder/logits_dense/kernel' in flat else ', logits via embedding'
  return (f'T5 v1.1: {len(enc)}+{len(dec)} layers, d_model {d_model}, {heads} heads '
          f'(d_kv {d_kv}), d_ff {d_ff}, vocab {vocab}{head}, {_moe_text(experts)}')


def _describe_llama(flat: Dict[str, Any]) -> str:
  """Names and shapes do not separate heads from head_dim: the q and k/v widths are given."""
  vocab, d_model = _shape(flat, 'token_embedder/embedding') or (None, None)
  layers = _layer_indices(flat, r'decoder/layers_(\d+)/')
  query = _shape(flat, 'decoder/layers_0/self_attention/query/kernel')
  key = _shape(flat, 'decoder/layers_0/self_attention/key/kernel')
  d_ff = next((leaf.shape[-1] for path, leaf in flat.items()
               if re.search(r'/mlp/(expert/)?wi_0/kernel$', path)), None)
  head = '' if 'decoder/logits_dense/kernel' in flat else ', tied embedding'
  experts = {'decoder': _moe(flat, r'decoder/layers_(\d+)', 'mlp')}
  return (f'Llama: {len(layers)} layers, d_model {d_model}, query width '
          f'{query[-1] if query else None}, key/value width {key[-1] if key else None}, '
          f'd_ff {d_ff}, vocab {vocab}{head}, {_moe_text(experts)}')


def _describe_vit(flat: Dict[str, Any]) -> str:
  kernel = _shape(flat, 'embedding/kernel')
  blocks = _layer_indices(flat, r'Transformer/encoderblock_(\d+)/')
  query = _shape(flat, 'Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel')
  mlp = None
  for path, leaf in flat.items():
    if re.search(r'encoderblock_\d+/MlpBlock_0/(expert/)?Dense_0/kernel$', path):
      mlp = leaf.shape[-1]
      break
  pos = _shape(flat, 'pos_embedding')
  tokens = pos[1] if pos else None
  side = math.isqrt(tokens) if tokens else 0
  grid = f' ({side}x{side})' if tokens and side * side == tokens else ''
  pool = 'map' if any(p.startswith('MAPHead_0/') for p in flat) else (
      'token' if 'cls' in flat else 'gap')
  head = _shape(flat, 'head/kernel')
  experts = {'': _moe(flat, r'Transformer/encoderblock_(\d+)', 'MlpBlock_0')}
  patch = f'{kernel[0]}x{kernel[1]}' if kernel else None
  pre_logits = ', pre_logits' if 'pre_logits/kernel' in flat else ''
  return (f'ViT: depth {len(blocks)}, width {kernel[-1] if kernel else None}, '
          f'{query[1] if query else None} heads, mlp {mlp}, patch {patch}, {tokens} tokens{grid}, '
          f'pool {pool}{pre_logits}, {head[-1] if head else "no"} classes, '
          f'{_moe_text(experts)}')


@dataclasses.dataclass(frozen=True)
class Describer:
  """A model family's parameter names.

  name: the family's (`upcycle.models.families.Family.name`).
  title: what a description calls it ('T5').
  matches: flat params -> whether they have the family's names (tried in `DESCRIBERS` order).
  describe: flat params -> one line of its architecture and sizes.
  """
  name: str
  title: str
  matches: Callable[[Dict[str, Any]], bool]
  describe: Callable[[Dict[str, Any]], str]


# In the order they are tried: a decoder-only Llama has a T5's names less its encoder and
# relative position bias, so T5 is asked first.
DESCRIBERS = (
    Describer(name='t5', title='T5', matches=_is_t5, describe=_describe_t5),
    Describer(name='llama', title='Llama', matches=lambda flat: _starts(flat, _TEXT_STACKS),
              describe=_describe_llama),
    Describer(name='vit', title='ViT',
              matches=lambda flat: _starts(flat, ('Transformer/encoderblock_', 'embedding/kernel')),
              describe=_describe_vit),
)
_DESCRIBERS = {d.name: d for d in DESCRIBERS}


def describe(params: Any) -> str:
  """One line naming the architecture and its sizes, or why it cannot be told."""
  flat = params if _is_flat(params) else tree.flatten(params)
  kind = model_kind(flat)
  if kind is not None:
    return _DESCRIBERS[kind].describe(flat)
  titles = [d.title for d in DESCRIBERS]
  return (f'unknown model ({len(flat)} parameters, none with {", ".join(titles[:-1])} or '
          f'{titles[-1]} names)')
