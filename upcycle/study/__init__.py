"""The reproduction study: the papers' claims re-run at CPU scale (`python -m upcycle.study`).

  runs.py          every arm of every suite as a `python -m upcycle.train` command
  scale.py         step counts and seeds (the full study and --quick)
  execute.py       runs them, two at a time, in dependency order, resumably
  curves.py        validation curves against steps and training FLOPs, over seeds
  epochs.py        how much of its training data a run read
  precondition.py  MoE vs dense from scratch at equal FLOPs, before any upcycling claim
  claims.py        the papers' claims as paired comparisons with verdicts
  regime.py        the headline claim in the paper's regime: plateau, fractions of the sunk cost
  drop_units.py    Drop-Upcycling's untouched-unit statistics on a real dense checkpoint
  render.py        docs/RESULTS.md, its plots and study.json
"""
