"""What model a parameter tree is, inferred from names and shapes alone (no config needed).

  model_kind(params) -> 't5', 'llama', 'vit' or None
  describe(params) -> 'T5 v1.1: 12+12 layers, d_model 768, 12 heads (d_kv 64), d_ff 2048,
                      vocab 32128, dense'
                   -> 'ViT: depth 12, width 768, 12 heads, mlp 3072, patch 16x16, 196 tokens
                      (14x14), pool token, 1000 classes, MoE at 1,3,5,7,9,11, E=8'
  summary(params) -> 'a T5 model, 1.2M parameters, an MoE with 8 experts in 4 blocks'
"""

import math
import re
from typing import Any, Dict, List, Optional

from upcycle import tree


FAMILY_NAMES = {'t5': 'T5', 'llama': 'Llama', 'vit': 'ViT', None: 'unknown'}


def model_kind(params: Any) -> Optional[str]:
  """'t5', 'llama' (a decoder stack alone, no relative position bias), 'vit' or None, from the
  parameter names."""
  flat = params if _is_flat(params) else tree.flatten(params)
  if any(p.startswith(('token_embedder/', 'encoder/layers_', 'decoder/layers_')) for p in flat):
    t5 = any(p.startswith('encoder/') or '/relpos_bias/' in p for p in flat)
    return 't5' if t5 else 'llama'
  if any(p.startswith(('Transformer/encoderblock_', 'embedding/kernel')) for p in flat):
    return 'vit'
  return None


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
  return f'a {FAMILY_NAMES[model_kind(flat)]} model, {count} parameters, {moe}'


def _is_flat(params: Any) -> bool:
  return isinstance(params, dict) and all(not isinstance(v, dict) for v in params.values())


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


def describe(params: Any) -> str:
  """One line naming the architecture and its sizes, or why it cannot be told."""
  flat = params if _is_flat(params) else tree.flatten(params)
  kind = model_kind(flat)
  if kind == 't5':
    return _describe_t5(flat)
  if kind == 'vit':
    return _describe_vit(flat)
  if kind == 'llama':
    return _describe_llama(flat)
  return f'unknown model ({len(flat)} parameters, none with T5, ViT or Llama names)'
