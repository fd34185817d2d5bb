"""docs/RESULTS.md and its plots from a finished study."""

import dataclasses
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from upcycle.study import claims, precondition, regime, runs as runs_lib
from upcycle.study.curves import Results
from upcycle.train import routing_health

PLOTS = 'results'
UNLEARNED = '†'   # marks an arm with a run whose routers did not learn


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
  return '\n'.join(lines)


def figure(width: float = 6.5):
  """A matplotlib (figure, axes) of the study's plots, drawn off screen."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt.subplots(figsize=(width, 4))


def save(fig, ax, title: str, path: str) -> bool:
  """Titles the axes, adds their legend, writes the figure to `path` and closes it."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def _mean_curve(results: Results, family: str, arm: str, metric: str, axis: str):
  curves = results.curves(family, arm)
  n = min(len(c.steps) for c in curves)
  x = np.mean([getattr(c, axis)[:n] for c in curves], axis=0)
  y = np.array([c.metric(metric)[:n] for c in curves])
  return x, y.mean(0), y.std(0, ddof=1) if len(curves) > 1 else np.zeros(n)


def plot(results: Results, family: str, arms: Dict[str, str], metric: str, axis: str,
         path: str, title: str) -> bool:
  """Mean ± std over seeds of `metric` against `axis` for the arms that ran; False if none."""
  arms = {arm: label for arm, label in arms.items() if results.has(family, arm)}
  if not arms:
    return False
  fig, ax = figure()
  shown = []     # every point but a from-scratch run's first: it would flatten the rest
  for arm, label in arms.items():
    x, mean, std = _mean_curve(results, family, arm, metric, axis)
    line, = ax.plot(x, mean, 'o-' if arm != 'pretrain' else 'k.-', markersize=3, label=label)
    ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.15)
    shown += list(mean[1:] if x[0] == 0 else mean)
  if shown:
    low, high = min(shown), max(shown)
    ax.set_ylim(low - 0.1 * (high - low), high + 0.1 * (high - low))
  ax.set_xlabel({'total_flops': 'training FLOPs (dense pretraining included)',
                 'extra_flops': 'training FLOPs after the upcycling point',
                 'steps': 'step'}[axis])
  ax.set_ylabel(f'validation {metric}')
  return save(fig, ax, title, path)


def ablations(results: Results, family: str, arms: Sequence[str], metric: str) -> List[tuple]:
  """(arm, at the start, final, FLOPs/step, final - moe's final ± s.e., epochs) of the arms
  that ran."""
  rows = []
  base = results.final(family, 'moe', metric) if results.has(family, 'moe') else None
  for arm in arms:
    if not results.has(family, arm):
      continue
    final = results.final(family, arm, metric)
    diff = '—'
    if base is not None and arm != 'moe':
      d = final - base
      diff = f'{d.mean():+.4f} ± {claims.standard_error(d):.4f}'
    rows.append((arm, claims.mean_std(results.start(family, arm, metric)),
                 claims.mean_std(final), f'{results.curves(family, arm)[0].flops_per_step:.3g}',
                 diff, f'{results.epochs(family, arm):.2f}'))
  return rows


def ablation_table(results: Results, family: str, arms: Sequence[str], metric: str, *,
                   labels: Optional[Dict[str, str]] = None,
                   spread: str = '± s.e., paired by seed') -> List[str]:
  """[the table of `ablations` of `arms`, each arm named (with `labels[arm]` after it) and
  marked when a run's routers did not learn, then `unlearned_routers`' footnote if any]; []
  before any arm ran. `spread`: the difference column's words in brackets."""
  rows = ablations(results, family, arms, metric)
  if not rows:
    return []
  marks, footnote = unlearned_routers(results, family, [r[0] for r in rows])
  name = lambda arm: f'`{arm}`{marks[arm]}' + (f' ({labels[arm]})' if labels else '')
  return [table(('arm', 'at the start', 'final', 'training FLOPs / step',
                 f'final − moe ({spread})', 'epochs'),
                [(name(r[0]), *r[1:]) for r in rows])] + ([footnote] if footnote else [])


def unlearned_routers(results: Results, family: str, arms: Sequence[str]
                      ) -> Tuple[Dict[str, str], Optional[str]]:
  """({arm: UNLEARNED or ''}, the footnote naming each run whose routers did not learn, with
  its layers' top-1 router probabilities; None when every run's routers learned or no run says
  (dense runs, runs from before the routing-health row))."""
  flagged = {arm: results.unlearned_routers(family, arm) for arm in arms}
  marks = {arm: UNLEARNED if seeds else '' for arm, seeds in flagged.items()}
  return marks, _unlearned_footnote(
      [(arm, seed, row) for arm, seeds in flagged.items() for seed, row in seeds.items()],
      "from the run's `routing_health` row of metrics.jsonl")


def _unlearned_footnote(runs: Sequence[Tuple[str, int, dict]], source: str) -> Optional[str]:
  """The footnote naming each (arm, seed, routing-health row) of `runs` whose routers did not
  learn, with its layers' top-1 router probabilities (`source`: where the rows come from);
  None when there is none."""
  named = [f'`{arm}` seed {seed}: ' + ', '.join(
      f"{layer} {h['top1_probability']:.3f} (uniform {h['uniform_probability']:.3f})"
      for layer, h in row['layers'].items()) for arm, seed, row in runs
           if not row['routers_learned']]
  if not named:
    return None
  return (f'{UNLEARNED} Routers that did not learn (criterion: {routing_health.CRITERION}; '
          f'{source}), with the top-1 router probability of each MoE layer: '
          f'{"; ".join(named)}. Such a number measures an MoE whose routing stayed near '
          f'uniform.')


def trails(results: Results, scale) -> List[tuple]:
  """(setting, dense, the MoE, d = how much the MoE is better (± s.e.), its FLOPs per step over
  the dense model's) for the settings of the `trails` suite that ran: the main job's recipe
  against the dense model continued for the same steps."""
  p, x = scale.t5_pretrain_steps, scale.t5_extra_steps
  long, late = scale.trail_long_steps, scale.trail_late_upcycling_step
  settings = [
      (f'upcycled at P = {p}, after X = {x} steps (the claims\' horizon)', 'main_dense_long',
       p + x, 'main_moe_long', p + x),
      (f'upcycled at P = {p}, after {long} steps ({long // x}x X)', 'main_dense_long', p + long,
       'main_moe_long', p + long),
      (f'upcycled at step {late} of `main_dense_long`, after X = {x} steps', 'main_dense_long',
       late + x, 'main_moe_late', late + x),
      (f'batch 4x ({4 * scale.t5_batch} sequences), after X = {x} steps',
       'main_dense_batch4x', p + x, 'main_moe_batch4x', p + x),
  ]
  rows = []
  for label, dense_arm, dense_step, other, other_step in settings:
    if not (results.has('t5', dense_arm) and results.has('t5', other)):
      continue
    dense = results.until('t5', dense_arm, 'loss', dense_step)
    moe = results.until('t5', other, 'loss', other_step)
    d = claims.paired(moe, dense, 'loss')
    rate = (results.curves('t5', other)[0].flops_per_step /
            results.curves('t5', dense_arm)[0].flops_per_step)
    read = max(results.epochs('t5', dense_arm), results.epochs('t5', other))
    rows.append((label, claims.mean_std(dense), f'`{other}` {claims.mean_std(moe)}',
                 f'{d.mean():+.4f} ± {claims.standard_error(d):.4f}', f'{rate:.2f}',
                 f'{read:.2f}'))
  return rows


def regime_plot(results: Results, scale, path: str) -> bool:
  """Left: validation loss against extra compute as a percentage of the sunk cost, mean ± std
  over seeds; the scratch MoE at the same total compute. Right: the verdicts' paired
  differences d (> 0 when the upcycled model is better), mean ± s.e. False before a
  continuation ran."""
  labels = {regime.DENSE: 'dense continued', regime.PAPER: "upcycled, the paper's recipe",
            regime.BEST: 'upcycled, the best recipe here', regime.SCRATCH: 'MoE from scratch'}
  labels = {arm: label for arm, label in labels.items() if results.has('t5', arm)}
  if not regime.finished(results) or not labels:
    return False
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  sunk = regime.sunk_flops(results, scale)
  x = np.linspace(0, 100 * max(scale.regime_fractions), 41)
  curves = {arm: np.array([regime.at_fraction(results, scale, arm, f / 100) for f in x])
            for arm in labels}   # [x, seeds]
  colors = dict(zip(labels, plt.rcParams['axes.prop_cycle'].by_key()['color']))
  fig, (ax, diff) = plt.subplots(1, 2, figsize=(12, 4))
  for arm, label in labels.items():
    mean = curves[arm].mean(1)
    std = curves[arm].std(1, ddof=1) if curves[arm].shape[1] > 1 else np.zeros_like(mean)
    ax.plot(x, mean, '-', label=label, color=colors[arm])
    ax.fill_between(x, mean - std, mean + std, color=colors[arm], alpha=0.15)
  pairs = ((regime.PAPER, regime.DENSE, "paper's recipe vs dense continued"),
           (regime.BEST, regime.DENSE, 'best recipe vs dense continued'),
           (regime.BEST, regime.SCRATCH, 'best recipe vs MoE from scratch'))
  for upcycled, other, label in pairs:
    if upcycled in curves and other in curves:
      d = curves[other] - curves[upcycled]   # [x, seeds]
      mean, se = d.mean(1), claims.standard_error(d, axis=1)   # NaN bands with one seed
      color = colors[other if other != regime.DENSE else upcycled]
      diff.plot(x, mean, '-', label=label, color=color)
      diff.fill_between(x, mean - se, mean + se, color=color, alpha=0.15)
  diff.axhline(0, color='black', linewidth=0.8)
  for axis in (ax, diff):
    for f in scale.regime_fractions:
      axis.axvline(100 * f, color='grey', linewidth=0.5, linestyle=':')
    axis.set_xlabel(f'extra training compute, % of the dense pretraining\'s '
                    f'({np.mean(sunk):.3g} FLOPs)')
    axis.legend(fontsize=8)
  ax.set_ylabel('validation loss (mean ± std over seeds)')
  ax.set_title(f'T5, dense pretrained {scale.regime_pretrain_steps} steps, no example read twice',
               fontsize=10)
  diff.set_ylabel('d: loss difference paired by seed (mean ± s.e.)')
  diff.set_title('d > 0: the upcycled model is better', fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def regime_parts(summary, scale, corpus: str, results: Results) -> List[str]:
  """The `regime` section of RESULTS.md from `regime.summary`; an MoE arm with a run whose
  routers did not learn is marked in the table's head, with `unlearned_routers`' footnote."""
  p = scale.regime_pretrain_steps
  inputs, targets = (summary['feature_lengths'][k] for k in ('inputs', 'targets'))
  window, tolerance = scale.plateau_window, scale.plateau_tolerance
  held = sum(row['plateaued'] for row in summary['plateau'])
  parts = [
      "## The headline claim in the paper's regime (the `regime` suite)",
      f'The paper upcycles dense checkpoints trained to diminishing returns on data never '
      f'repeated, and states its gains against extra compute as a fraction of that sunk cost. '
      f'Here: the tiny T5 pretrained densely for P = {p} steps on {corpus}; then, from that '
      f'checkpoint and reading the data on from where it stopped (`RESTORE_DATASET=True`), '
      f'continued densely and upcycled (E = {scale.num_experts}) with the paper\'s T5 recipe '
      f'(`regime_moe_paper`: fresh optimizer state, combine weights not normalized) and with '
      f'the best recipe of the claims below (`regime_moe_best`: normalized, dense optimizer '
      f'state reused), each for 100% of the sunk cost\'s FLOPs; and the upcycled models\' '
      f'architecture trained from scratch for the FLOPs of both dense runs together. Each point '
      f'is the mean of the run\'s validation curve (evaluated every {scale.eval_every} steps) at '
      f'the compute of the last {scale.final_window} dense evaluations ending there; d > 0 when '
      f'the upcycled model is better, paired by seed; '
      f'verdicts by the 2 s.e. rule. Tokens per expert per step: each encoder expert takes '
      f'2 x {scale.t5_batch} x {inputs} / {scale.num_experts} = '
      f'{2 * scale.t5_batch * inputs // scale.num_experts} token slots (Expert Choice, C = 2), '
      f'each decoder expert {1.25 * scale.t5_batch * targets / scale.num_experts:.0f} (Top-2, '
      f'C = 1.25); the paper\'s T5 Base with 32 experts gives each encoder expert 32 B slots '
      f'at a batch of B sequences of 512 tokens (4,096 at T5X\'s default pretraining batch of '
      f'128; the summaries this study works from do not state B).',
      f'**Plateau.** Criterion: the last {window:.0%} of the pretraining steps lowered the '
      f'validation loss (at each end the mean of the {scale.final_window} evaluations ending '
      f'there) by less than {tolerance:.0%}; it held for {held} of {len(summary["plateau"])} '
      f'seeds.',
      table(('seed', f'loss at step {summary["plateau"][0]["step_before"]:.0f}',
             f'loss at step {p}', 'relative drop', 'plateaued?'),
            [(r['seed'], f"{r['loss_before']:.4f}", f"{r['loss_at_p']:.4f}",
              f"{r['relative_drop']:.2%}", 'yes' if r['plateaued'] else 'no')
             for r in summary['plateau']]),
  ]
  rows = []
  for row in summary['rows']:
    cell = lambda arm, shown='a': row[arm].cell(shown) if arm in row else claims.NOT_FINISHED
    dense = (claims.mean_std(row[regime.DENSE]) if regime.DENSE in row else
             claims.NOT_FINISHED)
    rows.append((f"{row['fraction']:.0%}", dense,
                 cell(regime.PAPER), cell(regime.BEST), cell(regime.SCRATCH, 'b')))
  moe_arms = [arm for arm in (regime.PAPER, regime.BEST, regime.SCRATCH)
              if results.has('t5', arm)]
  marks, footnote = unlearned_routers(results, 't5', moe_arms)
  mark = lambda arm: marks.get(arm, '')
  parts += ['**Validation loss at extra compute = a fraction of the sunk cost** (mean ± std '
            'over seeds; d ± s.e.: verdict that the upcycled model is better).',
            table(('extra compute', 'dense continued',
                   f"upcycled, paper's recipe{mark(regime.PAPER)} (vs dense)",
                   f'upcycled, best recipe{mark(regime.BEST)} (vs dense)',
                   f'MoE from scratch{mark(regime.SCRATCH)} at equal total compute (best '
                   f'recipe vs it)'),
                  rows)] + ([footnote] if footnote else [])
  parts += ['**Each run at its end**: training loss = the mean logged loss of its last 10% of '
            'steps (every batch is new when its loss is logged), validation loss = its last '
            'evaluation; epochs = training examples read by then, those of the run it '
            'continues included, over the examples in the training split (the most over '
            'seeds).',
            table(('arm', 'last step', 'epochs', 'training loss', 'validation loss',
                   'gap (validation - training)'),
                  [(f"`{e['arm']}`", e['steps'], f"{e['epochs']:.2f}",
                    claims.mean_std(e['train']), claims.mean_std(e['validation']),
                    claims.mean_std(e['gap'])) for e in summary['ends']])]
  return parts


PRECONDITION_FAMILIES = {
    't5': ('T5', lambda scale: (
        f'Dense: `regime_pretrain` continued by `regime_dense`, one run of '
        f'2P = {2 * scale.regime_pretrain_steps} steps (rsqrt schedule, step counter and '
        f'optimizer state carried on, the data read on); MoE: `regime_scratch`, E = '
        f'{scale.num_experts} with the paper\'s T5 routing (`moe/paper_t5.gin`), for the FLOPs '
        f'of those 2P dense steps.')),
    'llama': ('Llama', lambda scale: (
        f'Dense: `pretrain`, P = {scale.llama_pretrain_steps} steps (warmup, cosine over P); '
        f'MoE: `{precondition.PAIRS["llama"][1]}`, the Mixtral of the `drop` suite (E = 8, '
        f'Top-2, every layer) for the FLOPs of those P dense steps (warmup, cosine over its own '
        f'steps).')),
}
NO_MEANS = ("**What a 'no' means.** Where the MoE from scratch loses to the dense model at "
            'equal FLOPs, the MoE architecture itself does not pay at this scale, so no '
            'upcycling claim below can show upcycling helping or hurting: an upcycled MoE that '
            'trails the dense model may trail it because it is an MoE, not because it was '
            "upcycled; 'not resolved' leaves that open.")


CLAIMS_NOT_RUN = ('No claim has both its arms finished for every seed in these runs: '
                  '`python -m upcycle.study` runs them (about 90 minutes).')


def _routing_cell(row: Optional[dict]) -> str:
  if row is None:
    return 'not recorded'
  return 'yes' if row['routers_learned'] else f'no{UNLEARNED}'


def _pair(results: Results, found: dict) -> List[str]:
  """A `precondition.compare`'s table per seed, its verdict, and the footnote on its MoE
  runs whose routers had not learned by the step read."""
  d = found['d']
  spread = f's.e. {claims.standard_error(d):.4f}, {len(d)} seeds' if len(d) > 1 else '1 seed'
  footnote = _unlearned_footnote(
      [(found['moe'], seed, row) for seed, row in zip(results.seeds, found['routing'])
       if row is not None],
      "over the MoE run's training rows up to the step read: its `routing_health` row where "
      'that is its end')
  return [table(('seed', 'dense loss', 'MoE loss', 'd (dense − MoE)', 'at training FLOPs',
                 'MoE routers learned?'),
                [(seed, f'{dense:.4f}', f'{moe:.4f}', f'{d:+.4f}',
                  f"{flops:.3g} (where `{ended}` ended)", _routing_cell(row))
                 for seed, dense, moe, d, flops, ended, row in zip(
                     results.seeds, found['dense_loss'], found['moe_loss'], found['d'],
                     found['flops'], found['ended'], found['routing'])]),
          f"**Is the MoE from scratch better than dense at equal FLOPs: {found['verdict']}** "
          f"(d = {d.mean():+.4f}, {spread})."] + ([footnote] if footnote else [])


def precondition_parts(results: Results, summary, scale) -> List[str]:
  """The precondition section of RESULTS.md from `precondition.summary`: a table per family,
  its verdict and its MoE runs' routing health."""
  parts = [
      '## The precondition: MoE vs dense from scratch at equal FLOPs (the `precondition` '
      'suite)',
      'Upcycling bets that the MoE architecture is worth its FLOPs. Per family, a dense model '
      'and the MoE of the upcycling claims each trained from scratch for the same training '
      'FLOPs, each with one learning-rate schedule over its own length; both read at the '
      'largest training FLOPs both reached (where the run that ended first ended: the FLOPs '
      f'column), the mean of both curves at its last {scale.final_window} '
      f'evaluation{"s" * (scale.final_window > 1)}, '
      'interpolated on the training-FLOPs axis. d = dense − MoE (> 0 when the MoE is better), '
      "paired by seed; the verdict that the MoE is better by the 2 s.e. rule. Routers learned: "
      f'{routing_health.CRITERION} (over the run\'s training rows up to the step read).']
  for family, (name, arms) in PRECONDITION_FAMILIES.items():
    parts += [f'### {name}', arms(scale)]
    found = summary[family]
    if found is None:
      failed = any(results.failed(family, arm) for arm in precondition.ARMS[family])
      parts.append('A run failed (its study.failed).' if failed else
                   'Not finished: `python -m upcycle.study --suite precondition` runs it.')
      continue
    parts += _pair(results, found)
    early = summary['early'].get(family)
    if early is not None:
      parts += [f'Read again at half the budget, where `{early["dense"]}` ended (T5\'s rsqrt '
                f'schedule does not depend on a run\'s length, so each point of both curves is '
                f'a run of that length):', *_pair(results, early)]
  return parts + [NO_MEANS]


def recipe_parts(summary, scale) -> List[str]:
  """The `recipe` section of RESULTS.md from `recipe.summary`."""
  seeds = ', '.join(map(str, scale.seeds))
  peaks = ', '.join(f'{p:g}' for p in scale.recipe_peaks)
  split = ('the whole validation split' if scale.recipe_eval_batches == 0 else
           f'{scale.recipe_eval_batches} batches of {runs_lib.FINAL_EVAL_BATCH_SIZE} sequences '
           f'of the validation split')
  rows = [(f"{r['peak']:g}", *[f'{v:.4f} ± {e:.4f}' for v, e in zip(r['loss'], r['loss_stderr'])],
           f"{r['mean']:.4f}", f"{r['std']:.4f}",
           {True: 'yes', False: 'no', None: '1 seed'}[r['agree']],
           ', '.join(f'{s:.1f}' for s in r['spike'])) for r in summary['rows']]
  if summary['chosen'] is not None:
    verdict = (f"**Chosen: peak {summary['chosen']:g}**, the lowest mean loss among the peaks "
               f"whose seeds agree.")
  elif len(scale.seeds) < 2:
    verdict = '**One seed: agreement is not measured, no peak is chosen.**'
  else:
    verdict = '**No peak swept gives seeds that agree.**'
  if not summary['complete']:
    verdict += ' (Not every peak has finished: the choice may change.)'
  return [
      "## The recipe: a learning rate whose seeds agree (the `recipe` suite)",
      f'The tiny T5 pretrained densely from scratch for P = {scale.regime_pretrain_steps} steps '
      f'(the `regime` suite\'s pretraining) at each peak learning rate of {peaks} (T5X\'s '
      f'rsqrt schedule: the peak for {scale.recipe_warmup_steps} warmup steps, then falling as '
      f'1 / sqrt(step)), seeds {seeds}; each run\'s last checkpoint evaluated on {split} '
      f'(the same sequences for every seed; ± the standard error over its batches). The seeds '
      f'agree when the standard deviation of their losses is at most '
      f'{scale.recipe_seed_std}. Gradient spike: a run\'s largest logged gradient norm after '
      f'the warmup over their median.',
      table(('peak learning rate', *[f'seed {s}' for s in scale.seeds], 'mean', 'std',
             'seeds agree?', 'gradient spike per seed'), rows),
      verdict]


def _jsonable(x):
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (regime.Comparison, claims.Row)):
    return _jsonable(dataclasses.asdict(x))
  return x.tolist() if isinstance(x, (np.ndarray, np.generic)) else x


def write(out: str, results: Results, header: str, arms: Dict[str, Dict[str, str]],
          drop_units: List[dict], scale, corpus: str,
          drop_suite: Tuple[List[str], Optional[dict]] = ([], None),
          recipe_summary: Optional[dict] = None) -> str:
  """Writes out/RESULTS.md, out/results/*.png and out/results/study.json; returns the path.
  After `header`, RESULTS.md opens with the precondition (`precondition_parts`).
  `corpus`: the T5 training data in words (the `regime` section says what P steps read);
  `drop_suite`: the `drop` suite's section and summary (`drop_render.parts`);
  `recipe_summary`: the `recipe` suite's (`recipe.summary`)."""
  os.makedirs(os.path.join(out, PLOTS), exist_ok=True)
  first = precondition.summary(results)
  parts = [header, *precondition_parts(results, first, scale)]
  if recipe_summary is not None:
    parts += recipe_parts(recipe_summary, scale)
  summary = regime.summary(results, scale)
  if summary is not None:
    parts += regime_parts(summary, scale, corpus, results)
    if regime_plot(results, scale, os.path.join(out, PLOTS, 't5_regime.png')):
      parts.append(f'![t5_regime.png]({PLOTS}/t5_regime.png)')
  parts += drop_suite[0]
  parts.append('## Claims')
  sections = claims.rows(results)
  if all(r.ours == claims.NOT_FINISHED for _, rows in sections for r in rows):
    parts.append(CLAIMS_NOT_RUN)
  else:
    for title, rows in sections:
      parts += [f'### {title}', table(('claim', "paper's number", 'ours (mean ± std over seeds)',
                                       'agrees?', 'epochs'),
                                      [(r.claim, r.paper, r.ours, r.agrees, r.epochs)
                                       for r in rows])]
  if drop_units:
    parts += ['### Drop-Upcycling: untouched units (measured on the seed-0 dense T5, first '
              'encoder MoE block)',
              table(('index sharing', 'r', 'untouched units', 'expected', 'untouched in both of '
                     'two experts', 'expected'),
                    [(d['index_sharing'], d['ratio'], f"{d['untouched']:.4f}",
                      f"{d['untouched_expected']:.4f}", f"{d['shared_by_two']:.4f}",
                      f"{d['shared_by_two_expected']:.4f}") for d in drop_units])]
  trail_rows = trails(results, scale)
  if trail_rows:
    parts += ["### Why the upcycled T5 trails the dense one (the `trails` suite)",
              "The main job's recipe (`moe/paper_t5.gin`, E = "
              f"{scale.num_experts}, combine weights normalized, dense optimizer state reused) "
              'against the dense model continued from the same checkpoint for the same steps, '
              'each the mean of its last evaluations up to the step named; d > 0 when the '
              'second column beats the dense one.',
              table(('setting', 'dense continued', 'the other arm',
                     'd (paired by seed, ± s.e.)', 'its training FLOPs / step vs dense',
                     'epochs (at the runs\' ends)'),
                    trail_rows)]
  for family, metric in (('t5', 'loss'), ('vit', 'accuracy')):
    shown = [a for a in arms.get(family, ())
             if a not in runs_lib.TRAIL_ARMS and a not in runs_lib.REGIME_ARMS]
    every = ablation_table(results, family, shown, metric, labels=arms.get(family))
    if every:
      parts += [f'### Every {family.upper()} arm (validation {metric})', *every]
  batch = scale.t5_batch
  figures = [
      ('t5_flops.png', 't5', {'pretrain': 'dense (pretraining)', 'dense': 'dense (continued)',
                              'moe': 'upcycled MoE', 'moe_from_half': 'upcycled at P/2',
                              'scratch': 'MoE from scratch'}, 'loss', 'total_flops',
       'T5: validation loss against training FLOPs'),
      ('vit_flops.png', 'vit', {'pretrain': 'dense (pretraining)', 'dense': 'dense (continued)',
                                'moe': 'upcycled MoE', 'scratch': 'MoE from scratch'},
       'accuracy', 'total_flops', 'ViT: validation accuracy against training FLOPs'),
      ('t5_drop.png', 't5', {'moe': 'naive upcycling (r=0)', 'drop_0.5': 'Drop r=0.5',
                             'drop_1.0': 'Drop r=1.0'}, 'loss', 'extra_flops',
       'T5: Drop-Upcycling after the upcycling point'),
      ('t5_trails.png', 't5', {'main_dense_long': f'dense continued, batch {batch}',
                               'main_moe_long': f'upcycled MoE, batch {batch}',
                               'main_moe_late': 'upcycled at step '
                                                f'{scale.trail_late_upcycling_step}',
                               'main_dense_batch4x': f'dense continued, batch {4 * batch}',
                               'main_moe_batch4x': f'upcycled MoE, batch {4 * batch}'},
       'loss', 'steps', "T5: the main job's recipe vs dense (the trails suite)"),
      ('t5_routing.png', 't5', {'moe': 'Expert Choice C=2, E=8', 'top2_encoder': 'Top-2 encoder',
                                'capacity_1': 'C=1', 'capacity_3': 'C=3',
                                'experts_4': 'E=4', 'experts_16': 'E=16',
                                'placement_all': 'all layers', 'placement_last_2': 'last 2'},
       'loss', 'extra_flops', 'T5: routing and placement after the upcycling point'),
  ]
  drawn = [f for f, *rest in figures if plot(results, *rest[:4], os.path.join(out, PLOTS, f),
                                              rest[4])]
  if drawn:
    parts += ['### Plots'] + [f'![{f}]({PLOTS}/{f})' for f in drawn]
  text = '\n\n'.join(parts) + '\n'
  path = os.path.join(out, 'RESULTS.md')
  with open(path, 'w') as f:
    f.write(text)
  data = {family: {arm: {str(s): {k: getattr(results.curve(family, arm, s), k).tolist()
                                  for k in ('steps', 'extra_flops', 'total_flops', 'loss',
                                            'accuracy')}
                         for s in results.seeds}
                   for arm in arms[family] if results.has(family, arm)}
          for family in arms}
  data['precondition'] = _jsonable(first)
  data['claims'] = {title: [r.__dict__ for r in rows] for title, rows in sections}
  data['drop_units'] = drop_units
  data['recipe'] = _jsonable(recipe_summary)
  data['regime'] = _jsonable(summary)
  data['drop'] = _jsonable(drop_suite[1])
  with open(os.path.join(out, PLOTS, 'study.json'), 'w') as f:
    json.dump(data, f, indent=1)
  return path
