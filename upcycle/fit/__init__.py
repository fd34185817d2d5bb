"""Will a run fit a TPU slice: the compile-ahead fit analysis behind `python -m upcycle.aot`.

  aot.py         the run the trainer builds, compiled for a TPU topology on any host: memory
                 per device by share, the verdict, the table and the JSON
  hbm.py         a chip's nominal HBM and what the TPU compiler can use of it
  levers.py      the memory levers a run has set, and those that would shrink it
  batch_fit.py   the largest batch that fits, from two more compiles of the train and eval
                 steps
  step_count.py  a step's FLOPs and bytes with every layer and microbatch counted
  roofline.py    the roofline bound on a step's time and the MFU it allows

It imports the trainer's run (`train/built_run.py`, `partitioning.py`); nothing in
`train/` imports it.
"""
