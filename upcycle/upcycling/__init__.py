"""Dense -> MoE upcycling over param trees: the plan, its executors, the initializers."""

from upcycle.upcycling import capture, data_selection, experts, router_training, routers
from upcycle.upcycling.optimizer import upcycle_optimizer_state
from upcycle.upcycling.plan import Plan
from upcycle.upcycling.report import UpcycleReport
from upcycle.upcycling.surgery import copy_params, make_plan, upcycle, upcycle_from_checkpoints

__all__ = ['capture', 'data_selection', 'experts', 'router_training', 'routers', 'Plan',
           'UpcycleReport', 'copy_params', 'make_plan', 'upcycle', 'upcycle_from_checkpoints', 'upcycle_optimizer_state']
