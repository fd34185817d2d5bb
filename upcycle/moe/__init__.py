"""Mixture-of-Experts blocks: routing, dispatch, placement."""

from upcycle.moe.config import MoeConfig
from upcycle.moe.layer import MoeLayer
from upcycle.moe.placement import sparse_layer_indices
from upcycle.moe.summary import MOE_COLLECTIONS, aux_losses, metrics

__all__ = ['MoeConfig', 'MoeLayer', 'sparse_layer_indices', 'MOE_COLLECTIONS', 'aux_losses',
           'metrics']
