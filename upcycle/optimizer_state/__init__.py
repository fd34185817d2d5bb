"""Optimizer state, apart from any checkpoint format: one per-parameter form of an optax state
(`units.py`; Adafactor's moments as T5X's slots, `adafactor.py`), carried through a plan's
leaf ops (`carry.py`, a plan's params' state included), its step counts under
a step policy (`counts.py`), sharded like the parameters, stored states too (`shardings.py`),
and read from what a checkpoint stores (`stored.py`: our orbax states, T5X's Adafactor
state)."""

from upcycle.optimizer_state.stored import as_optax, from_t5x_adafactor

__all__ = ['as_optax', 'from_t5x_adafactor']
