"""Training: `python -m upcycle.train` (`__main__`), the `trainer.Trainer` it runs, and its
pieces (objectives, optimizers, partitioning, checkpoint restore and resume, run locks).

Importing this package imports nothing else: the entry point loads what a run needs.
"""
