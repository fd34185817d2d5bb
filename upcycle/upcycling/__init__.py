"""Dense -> MoE upcycling over param trees: the plan, its executors, the initializers; growing
a trained checkpoint with more experts or more layers."""

from upcycle.upcycling import capture, data_selection, experts, router_training, routers
from upcycle.upcycling.depth_growth import grow_depth
from upcycle.upcycling.expert_growth import grow_experts, router_usage
from upcycle.upcycling.optimizer import upcycle_optimizer_state
from upcycle.upcycling.plan import Plan
from upcycle.upcycling.remap import Remap
from upcycle.upcycling.remap_optimizer import remap_optimizer_state
from upcycle.upcycling.report import UpcycleReport
from upcycle.upcycling.surgery import copy_params, make_plan, upcycle, upcycle_from_checkpoints

__all__ = ['capture', 'data_selection', 'experts', 'router_training', 'routers', 'Plan', 'Remap',
           'UpcycleReport', 'copy_params', 'grow_depth', 'grow_experts', 'make_plan',
           'remap_optimizer_state', 'router_usage', 'upcycle', 'upcycle_from_checkpoints',
           'upcycle_optimizer_state']
