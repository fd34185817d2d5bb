"""HuggingFace `Qwen2MoeForCausalLM` <- Llama names: how `upcycle.hf_export` writes an MoE
Llama that Mixtral cannot express (`llama_hf.hf_model_type`).

The names are `hf_llama`'s (attention, norms, and the dense layers' `mlp.{gate,up,down}_proj`);
an MoE layer's block is
  mlp.gate.weight                                [E, d_model]  <- mlp/router/router_weights/w
  mlp.experts.{j}.{gate,up,down}_proj.weight                   <- mlp/expert/{wi_0,wi_1,wo}
                                                                  (expert j of the first axis)
  mlp.shared_expert.{gate,up,down}_proj.weight                 <- mlp/shared_expert/{wi_0,...}
  mlp.shared_expert_gate.weight                  [1, d_model]  (none of ours)
per expert, as `save_pretrained` writes them (transformers 5 fuses the experts on load).

Qwen2-MoE always has a shared expert, and gates it: sigmoid(shared_expert_gate . x) *
shared_expert(x). Ours is ungated (routed MoE(x) + shared_expert(x)), written exactly as a
gate of zeros (sigmoid(0) = 1/2) and the shared expert's down projection times 2 (exact in
binary floating point); a block without one gets a shared expert of 0 units
(`shared_expert_intermediate_size` 0, which transformers builds), whose output is 0.

`convert` reads such a directory back (`llama_hf.config_fields` its config.json): the gate
must be zeros, and is dropped, the down projection halved, a shared expert of 0 units dropped.
A learned gate (Qwen1.5-MoE's) is refused: this model's shared expert is ungated.
"""

from typing import Any, Dict, List, Mapping, Tuple

import numpy as np

from upcycle import tree
from upcycle.checkpoints import hf_llama
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import LazyArray

MODEL = 'Qwen2MoeForCausalLM'
GATE = 'shared_expert_gate'   # our name for their gate, only here: the model has none
TABLE = hf_llama.name_table({
    'mlp.gate.weight': 'mlp/router/router_weights/w/kernel',
    **{f'mlp.{group}.{hf}_proj.weight': f'mlp/{ours_group}/{ours}/kernel'
       for group, ours_group in (('experts.{j}', tree.EXPERT),
                                 ('shared_expert', tree.SHARED_EXPERT))
       for hf, ours in (('gate', 'wi_0'), ('up', 'wi_1'), ('down', 'wo'))},
    f'mlp.{GATE}.weight': f'mlp/{GATE}/kernel',
})


def _scaled(leaf: Any, factor: float) -> Any:
  """factor * leaf in its own dtype (exact for 2 and 1/2); lazily for a LazyArray."""
  scale = lambda a: a * np.asarray(factor, a.dtype)
  if isinstance(leaf, LazyArray):
    return leaf.map(scale, leaf.shape)
  return scale(np.asarray(leaf))


def _gated_block(mlp: Mapping[str, Any]) -> Dict[str, Any]:
  """An MoE block's params -> Qwen2-MoE's (module docstring): a zero gate, the shared
  expert's down projection doubled, or a shared expert of 0 units."""
  wo = mlp[tree.EXPERT]['wo']['kernel']                       # [E, d_ff, d_model]
  d_model, dtype = wo.shape[-1], np.dtype(wo.dtype)
  shared = mlp.get(tree.SHARED_EXPERT)
  if shared is None:
    empty = lambda *shape: {'kernel': np.zeros(shape, dtype)}
    shared = {'wi_0': empty(d_model, 0), 'wi_1': empty(d_model, 0), 'wo': empty(0, d_model)}
  else:
    shared = {**shared, 'wo': {**shared['wo'], 'kernel': _scaled(shared['wo']['kernel'], 2)}}
  return {**mlp, tree.SHARED_EXPERT: shared, GATE: {'kernel': np.zeros((d_model, 1), dtype)}}


def to_hf(params: Mapping[str, Any], source: str) -> Dict[str, Any]:
  """Contract params (unrolled layers; MoE blocks where the model has them) -> {HF tensor
  name: leaf} of `Qwen2MoeForCausalLM`, kernels transposed (lazily for LazyArrays); a head
  tied to the embedding writes no lm_head, as `save_pretrained` does."""
  decoder = {name: ({**layer, 'mlp': _gated_block(layer['mlp'])}
                    if isinstance(layer, Mapping) and tree.ROUTER in layer.get('mlp', {})
                    else layer)
             for name, layer in params['decoder'].items()}
  return TABLE.to_theirs({**params, 'decoder': decoder}, source, MODEL)


def convert(tensors: Dict[str, LazyArray], hf: Dict[str, Any], config_path: str,
            weights_path: str) -> Tuple[Dict[str, Any], Dict[str, Any], List[str], Dict[str, str]]:
  """A Qwen2MoeForCausalLM directory -> `hf_llama.convert`'s (params, description, notes,
  names), each MoE block's shared expert ungated (module docstring)."""
  params, description, notes, names = hf_llama.convert(tensors, hf, config_path, weights_path,
                                                       table=TABLE, family='Qwen2-MoE')
  for name, layer in params.get('decoder', {}).items():
    mlp = layer.get('mlp', {}) if isinstance(layer, dict) else {}
    if tree.ROUTER not in mlp:
      continue
    path = f'decoder/{name}/mlp/{GATE}/kernel'
    gate = mlp.pop(GATE, {}).get('kernel')
    if gate is None or np.any(np.asarray(gate)):
      raise checkpoint_error(
          names.get(path, weights_path), 'a shared expert gated by its input, which this '
          "model's ungated shared expert does not compute", param=path,
          expected='a shared_expert_gate.weight of zeros (as upcycle.export writes it)',
          found='none' if gate is None else 'nonzero weights',
          fix='Read only Qwen2-MoE directories written by python -m upcycle.export')
    shared = mlp.get(tree.SHARED_EXPERT)
    if shared is not None and 'kernel' in shared.get('wo', {}):
      if 0 in shared['wo']['kernel'].shape:
        del mlp[tree.SHARED_EXPERT]
      else:
        shared['wo']['kernel'] = _scaled(shared['wo']['kernel'], 0.5)
  return params, description, notes, names
