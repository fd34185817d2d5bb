"""Dense -> MoE upcycling over param trees: surgery, initializers, optimizer state."""

from upcycle.upcycling import capture
from upcycle.upcycling import experts
from upcycle.upcycling import routers
from upcycle.upcycling.optimizer import from_t5x_adafactor, upcycle_optimizer_state
from upcycle.upcycling.report import UpcycleReport
from upcycle.upcycling.surgery import copy_params, upcycle, upcycle_from_checkpoints

__all__ = ['capture', 'experts', 'routers', 'UpcycleReport', 'copy_params', 'upcycle',
           'upcycle_from_checkpoints',
           'upcycle_optimizer_state', 'from_t5x_adafactor']
