"""Models: T5 v1.1 encoder-decoder and ViT, each dense or MoE per block."""

from upcycle.models.abstract import abstract_params, config_from_description
from upcycle.models.t5 import T5, T5Config
from upcycle.models.vit import ViT, ViTConfig

__all__ = ['T5', 'T5Config', 'ViT', 'ViTConfig', 'abstract_params', 'config_from_description']
