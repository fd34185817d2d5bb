"""Models: T5 v1.1 encoder-decoder, ViT and the Llama decoder-only LM, each dense or MoE per
block.

What the rest of the code knows about each family is registered in `upcycle.models.families`."""

from upcycle.models.llama import Llama, LlamaConfig
from upcycle.models.rope import Llama3RopeScaling
from upcycle.models.t5 import T5, T5Config
from upcycle.models.vit import ViT, ViTConfig

__all__ = ['Llama', 'Llama3RopeScaling', 'LlamaConfig', 'T5', 'T5Config', 'ViT', 'ViTConfig']
