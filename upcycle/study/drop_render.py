"""The `drop` suite's section of RESULTS.md and its plots, from `drop_section.summary`."""

import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from upcycle.study import claims, drop_runs, drop_section, precondition, render
from upcycle.study.curves import Results

FAMILY = drop_section.FAMILY
PAPER_SLOTS = 512 * 4096 * 2 // 8   # Top-2 over 8 experts at Drop-Upcycling's batch


def _usage_plot(usage: Dict[str, Dict[str, np.ndarray]], path: str) -> bool:
  """Effective experts per layer at each arm's end, mean ± std over seeds."""
  if not usage:
    return False
  fig, ax = render.figure()
  for arm, layers in usage.items():
    values = np.array(list(layers.values()))     # [layers, seeds]
    x = np.arange(len(layers))
    std = values.std(1, ddof=1) if values.shape[1] > 1 else np.zeros(len(x))
    ax.errorbar(x, values.mean(1), yerr=std, marker='o', capsize=3, label=arm)
  ax.axhline(2, color='grey', linewidth=0.8, linestyle=':')
  ax.set_xticks(np.arange(len(layers)), [name.split('/')[1] for name in layers])
  ax.set_ylim(1, 8.5)
  ax.set_ylabel('effective experts (of 8; dotted: two)')
  return render.save(fig, ax, 'Experts each layer uses at the end of the run', path)


def _crossover_plot(crossover: Dict, tokens_per_step: int, path: str) -> bool:
  """d = naive's loss - Drop r=0.5's against tokens after the upcycling point, mean ± s.e."""
  if crossover is None:
    return False
  fig, ax = render.figure()
  x = (crossover['steps'] - crossover['steps'][0]) * tokens_per_step / 1e6
  mean, se = crossover['mean'], np.nan_to_num(crossover['se'])
  ax.plot(x, mean, 'o-', markersize=3)
  ax.fill_between(x, mean - 2 * se, mean + 2 * se, alpha=0.2, label='± 2 s.e.')
  ax.axhline(0, color='black', linewidth=0.8)
  ax.set_xlabel('training tokens after the upcycling point (millions)')
  ax.set_ylabel("d = naive's validation loss - Drop r=0.5's")
  return render.save(fig, ax, 'd > 0: Drop-Upcycling is ahead (paired by seed)', path)


def every_arm(results: Results) -> List[str]:
  """The table of every arm that ran (`render.ablation_table`: an arm with a run whose routers
  did not learn marked, the footnote under it); [] before any ran."""
  every = render.ablation_table(results, FAMILY, [a for a in drop_runs.DESCRIPTIONS
                                                  if a not in precondition.ARMS[FAMILY]],
                                'loss', spread='± s.e.')
  return ['**Every arm** (validation loss; final − moe paired by seed).', *every] if every else []


def parts(results: Results, scale, out: str) -> Tuple[List[str], Optional[Dict]]:
  """(the section's markdown, its summary for study.json), plots written under out/results/;
  ([], None) before the dense Llama ran."""
  summary = drop_section.summary(results, scale)
  if summary is None:
    return [], None
  os.makedirs(os.path.join(out, render.PLOTS), exist_ok=True)
  p, x = scale.llama_pretrain_steps, scale.llama_extra_steps
  tokens = summary['tokens_per_expert']
  tokens_per_step = tokens['tokens_per_step'] if tokens else 0
  held = sum(row['plateaued'] for row in summary['plateau'])
  text = [
      "## Drop-Upcycling in its own setting: a Llama upcycled into a Mixtral (the `drop` "
      'suite)',
      f'The paper upcycles Llama-architecture models into Mixtral-style MoEs. Here: the tiny '
      f'Llama (`models/llama/tiny.gin`: 4 layers, d_model 64, SwiGLU d_ff 256, the offline '
      f'byte-level BPE of 4,096 pieces) pretrained densely for P = {p} steps on the pinned '
      f'numpy, scipy, scikit-learn and matplotlib source (causal LM, '
      f'`data/offline_packages_lm.gin`, tokenized by `offline_packages_bpe`, the offline BPE '
      f'trained on that source), peak learning rate '
      f'{scale.llama_learning_rate:g} after {scale.llama_warmup_steps} warmup steps (cosine '
      f'to a tenth); then, reading the data on from where it stopped, every arm for X = {x} '
      f'steps with a schedule of its own (warmup {scale.llama_warmup_steps} steps, cosine over '
      f"X, fresh AdamW state) as `moe/mixtral.gin`'s MoE: E = 8 in every layer, Top-2, "
      f"dropless, load-balancing loss 0.02 pooled over the layers (transformers' loss). "
      f'Evaluated every {scale.llama_eval_every} steps on {scale.llama_eval_batches} '
      f'validation batches (the same for every arm of a seed); a final value is the mean of '
      f'the last {scale.final_window} evaluations; verdicts by the 2 s.e. rule, paired by '
      f'seed.',
  ]
  if tokens:
    text.append(
        f"**Tokens per expert per step.** {tokens_per_step:,} tokens per step, Top-2 over 8 "
        f"experts: {tokens['mean']:,.0f} token slots per expert per step on average; over "
        f"naive upcycling's last 10% of steps, per sequence (its routing group, averaged over "
        f"the batch), the fewest any expert of any layer took was {tokens['fewest']:.1f} and "
        f"the most {tokens['most']:.1f} (of {tokens['sequence_length']}"
        f' tokens). Drop-Upcycling\'s batch (`runs/llm_pretrain.gin`): 512 x 4,096 tokens, '
        f'{PAPER_SLOTS:,} slots per expert per step, {PAPER_SLOTS / tokens["mean"]:,.0f}x more.')
  text.append(
      f'**The dense model at the upcycling point.** Plateau criterion (the `regime` suite\'s): '
      f'the last {scale.plateau_window:.0%} of the pretraining steps lowered the validation '
      f'loss by less than {scale.plateau_tolerance:.0%}; it held for {held} of '
      f'{len(summary["plateau"])} seeds.')
  text.append(render.table(
      ('seed', f'loss at step {summary["plateau"][0]["step_before"]:.0f}', f'loss at step {p}',
       'relative drop', 'plateaued?'),
      [(r['seed'], f"{r['loss_before']:.4f}", f"{r['loss_at_p']:.4f}",
        f"{r['relative_drop']:.2%}", 'yes' if r['plateaued'] else 'no')
       for r in summary['plateau']]))
  text += ['**Verdicts.**', render.table(
      ('claim', "paper's number", 'ours (validation loss, mean ± std over seeds)', 'agrees?',
       'epochs'),
      [(r.claim, r.paper, r.ours, r.agrees, r.epochs) for r in summary['claims']])]
  cross = summary['crossover']
  if cross is not None:
    where = ('is at no point of the run ahead by more than 2 s.e. to its end'
             if cross['ahead_from'] is None else
             f"is ahead by more than 2 s.e. from step {cross['ahead_from']} "
             f"({cross['ahead_from'] * tokens_per_step / 1e6:.2f}M tokens) to the end")
    text.append(
        f'**Where the curves cross.** d = naive\'s loss - Drop r=0.5\'s: '
        f"{cross['mean'][0]:+.4f} ± {np.nan_to_num(cross['se'][0]):.4f} at the upcycling "
        f"point, {cross['mean'][-1]:+.4f} ± {np.nan_to_num(cross['se'][-1]):.4f} at the end; "
        f'Drop {where}.')
  if summary['usage']:
    layers = list(next(iter(summary['usage'].values())))
    text += ['**Experts each layer uses** at the run\'s end (effective experts: exp of the '
             'entropy of the experts\' shares of the routed tokens; 8 = even, 2 = two experts '
             'take every token; mean ± std over seeds, the last 10% of steps).',
             render.table(('arm', *[name.split('/')[1] for name in layers]),
                          [(f'`{arm}`', *[claims.mean_std(u[layer]) for layer in layers])
                           for arm, u in summary['usage'].items()])]
  text += every_arm(results)
  plots = os.path.join(out, render.PLOTS)
  drawn = []
  step_note = f'step (x {tokens_per_step:,} tokens)'
  for name, arms, title in (
      ('llama_drop.png', drop_section.CURVE_ARMS,
       f'Llama -> Mixtral: validation loss after the upcycling point; {step_note}'),
      ('llama_constant_lr.png', drop_section.CONTROL_ARMS,
       f'Cosine vs constant learning rate; {step_note}')):
    if render.plot(results, FAMILY, arms, 'loss', 'steps', os.path.join(plots, name), title):
      drawn.append(name)
  if _crossover_plot(cross, tokens_per_step, os.path.join(plots, 'llama_crossover.png')):
    drawn.append('llama_crossover.png')
  if _usage_plot(summary['usage'], os.path.join(plots, 'llama_expert_usage.png')):
    drawn.append('llama_expert_usage.png')
  return text + [f'![{f}]({render.PLOTS}/{f})' for f in drawn], summary
