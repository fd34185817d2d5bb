"""Python's cyclic garbage collector at a command's start and exit.

A command (`python -m upcycle.train`, ...) imports a stack (TensorFlow with Keras, JAX, flax,
orbax, transformers) of about 700,000 objects that live as long as the process. With the
collector on, it walks them again and again while they are made (one full walk takes about a
second here), and once more while the interpreter shuts down: seconds of every command's start
and exit (`benchmarks/time_to_first_step.py` measures both, against the collector left on).

  begin()   the first thing a command's `__main__` block does: no collection until `ready()`,
            and what is alive at exit is frozen, so the interpreter's last collections skip
            it (the process ends; the operating system takes its memory back).
  ready()   the command's imports and setup are done: what exists now is frozen (`gc.freeze`:
            kept, never walked again) and collection resumes for what the run makes after.
            Without `begin()` (the package imported as a library, a test calling `main`) it
            does nothing: the collector is the caller's.
"""

import atexit
import gc

_begun = []   # [True] once `begin()` ran in this process


def begin() -> None:
  """No collection until `ready()`; the objects alive at exit are frozen."""
  gc.disable()
  atexit.register(gc.freeze)   # atexit runs the last registered first: this one runs last
  _begun.append(True)


def ready() -> None:
  """After `begin()`: freezes what exists (the imported stack) and turns collection back on."""
  if _begun and not gc.isenabled():
    gc.freeze()
    gc.enable()
