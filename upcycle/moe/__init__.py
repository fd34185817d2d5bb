"""Mixture-of-Experts blocks: routing, dispatch, placement."""

from upcycle.moe import balance, capacity, grouping, placement, routers
from upcycle.moe.config import MoeConfig
from upcycle.moe.layer import MoeLayer
from upcycle.moe.placement import sparse_layer_indices
from upcycle.moe.summary import MOE_COLLECTIONS, ROUTER_LOGITS, aux_losses, metrics, router_logits

__all__ = ['MoeConfig', 'MoeLayer', 'balance', 'capacity', 'grouping', 'placement', 'routers',
           'sparse_layer_indices', 'MOE_COLLECTIONS', 'ROUTER_LOGITS', 'aux_losses', 'metrics',
           'router_logits']
