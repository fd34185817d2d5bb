"""Dense -> MoE upcycling over param trees: the plan, its executors, the initializers; growing
a trained checkpoint with more experts or more layers."""

from upcycle.optimizer_state.carry import carry_optimizer_state
from upcycle.upcycling import capture, experts, router_init
from upcycle.upcycling.depth_growth import grow_depth
from upcycle.upcycling.expert_growth import grow_experts, router_usage
from upcycle.upcycling.plan import Plan
from upcycle.upcycling.report import UpcycleReport
from upcycle.upcycling.surgery import copy_params, make_plan, upcycle, upcycle_from_checkpoints

__all__ = ['capture', 'experts', 'router_init', 'Plan',
           'UpcycleReport', 'carry_optimizer_state', 'copy_params', 'grow_depth', 'grow_experts',
           'make_plan', 'router_usage', 'upcycle', 'upcycle_from_checkpoints']
