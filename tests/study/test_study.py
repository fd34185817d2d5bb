"""`python -m upcycle.study`: the verdict rule, FLOPs matching, the plan, and --quick end to end."""

import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import REPO
from upcycle import gin_utils, platforms
from upcycle.study import (claims, drop_runs, drop_section, epochs, precondition, recipe,
                           regime, render)
from upcycle.study import runs as runs_lib
from upcycle.study.__main__ import DESCRIPTIONS, QUICK_ARMS, SUITES, plan, suite_of
from upcycle.study.curves import Curve, Results, train_rows_at_end
from upcycle.study.scale import FULL, QUICK


@pytest.mark.parametrize('d, expect, verdict', [
    ([0.10, 0.12, 0.11], 'better', 'yes'),          # mean 0.11, s.e. 0.0058
    ([-0.10, -0.12, -0.11], 'better', 'no'),
    ([0.10, -0.08, 0.01], 'better', 'not resolved'),
    ([0.10, 0.12, 0.11], 'not better', 'no'),
    ([0.01, -0.02, 0.00], 'not better', 'yes'),
    ([-0.10, -0.12, -0.11], 'not better', 'yes'),
    ([0.01, -0.02, 0.00], 'same', 'yes'),
    ([0.10, 0.12, 0.11], 'same', 'no'),
    ([0.3], 'better', 'not resolved (1 seed)'),
])
def test_verdicts_follow_the_two_standard_error_rule(d, expect, verdict):
  assert claims.verdict(np.array(d), expect) == verdict


def test_standard_error_over_seeds_along_an_axis():
  # [1, 2, 3]: sample std 1, so s.e. 1/sqrt(3); equal values: 0; one seed: undefined.
  np.testing.assert_allclose(claims.standard_error([1.0, 2.0, 3.0]), 1 / np.sqrt(3))
  np.testing.assert_allclose(claims.standard_error(np.array([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]]),
                                                   axis=1), [1 / np.sqrt(3), 0.0])
  assert np.isnan(claims.standard_error(np.ones((4, 1)), axis=1)).all()


def test_paired_difference_is_positive_when_the_first_arm_is_better():
  np.testing.assert_allclose(claims.paired(np.array([2.0]), np.array([2.5]), 'loss'), [0.5])
  np.testing.assert_allclose(claims.paired(np.array([0.9]), np.array([0.7]), 'accuracy'), [0.2])


def test_curves_interpolate_in_flops_and_refuse_to_extrapolate():
  curve = Curve(steps=np.array([200, 250, 300]), extra_flops=np.array([0.0, 50.0, 100.0]),
                total_flops=np.array([1000.0, 1050.0, 1100.0]), loss=np.array([3.0, 2.0, 1.0]),
                accuracy=np.zeros(3), flops_per_step=1.0)
  assert curve.at('loss', 1025.0) == 2.5
  assert curve.at('loss', 75.0, axis='extra_flops') == 1.5
  assert np.isnan(curve.at('loss', 1200.0))


def test_the_dense_continuation_gets_the_extra_flops_of_the_upcycled_run(tmp_path):
  run = runs_lib.Run('t5', 'dense', 0, ())
  for arm, rate in (('moe', 5.0e8), ('pretrain', 3.0e8)):
    os.makedirs(run.directory(str(tmp_path), arm))
    with open(os.path.join(run.directory(str(tmp_path), arm), 'metrics.jsonl'), 'w') as f:
      f.write(json.dumps({'split': 'train', 'step': 10, 'train_flops_per_step': rate}) + '\n')
  steps = runs_lib.equal_flops_steps(200, 300, 'moe')(run, str(tmp_path))
  assert steps == 200 + 500      # ceil(300 * 5 / 3)


def test_every_claim_compares_arms_the_full_study_runs():
  arms = {(r.family, r.arm) for r in plan(FULL, quick=False, suites=SUITES)}
  for c in [*[c for cs in claims.CLAIMS.values() for c in cs], *drop_section.CLAIMS]:
    assert {(c.family, c.a), (c.family, c.b)} <= arms, c.claim
  assert {(r.family, r.arm) for r in plan(QUICK, quick=True, suites=SUITES)} == {
      (f, a) for f, arms_of in QUICK_ARMS.items() for a in arms_of}
  for r in plan(FULL, quick=False, suites=SUITES):
    assert r.arm in DESCRIPTIONS[r.family], r.arm
    for f in r.gin_files:
      assert os.path.exists(os.path.join(REPO, 'configs', f)), f


@pytest.mark.slow
def test_quick_study_writes_results_and_resumes(tmp_path):
  out, runs_dir = tmp_path / 'docs', tmp_path / 'runs'
  command = [sys.executable, '-m', 'upcycle.study', '--quick', '--suite=all', f'--out={out}',
             f'--runs_dir={runs_dir}']
  env = {**os.environ, 'XLA_FLAGS': '--xla_backend_optimization_level=0'}
  done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  text = (out / 'RESULTS.md').read_text()
  assert '## Claims' in text and '| claim | paper\'s number |' in text
  for png in ('t5_flops.png', 'vit_flops.png'):
    assert (out / 'results' / png).stat().st_size > 10_000
  # Every run's CPU code is capped at SSE4.2 (the same bits on any x86-64 image); its record
  # and log give the command with the flags it ran under.
  pretrain_dir = runs_dir / 't5' / 'pretrain' / 'seed0'
  record = json.loads((pretrain_dir / 'study.json').read_text())
  x86 = platform.machine().lower() in ('x86_64', 'amd64')
  assert record['xla_flags'].split() == ['--xla_backend_optimization_level=0',
                                         *[platforms.PORTABLE_CPU_ISA] * x86]
  first = (pretrain_dir / 'study.log').read_text().splitlines()[0]
  assert shlex.split(first) == [f"XLA_FLAGS={record['xla_flags']}", *record['command']]
  data = json.loads((out / 'results' / 'study.json').read_text())
  moe, dense = data['t5']['moe']['0'], data['t5']['dense']['0']
  # The dense continuation spent the upcycled run's extra FLOPs (to within one dense step).
  step = (dense['extra_flops'][-1] - dense['extra_flops'][0]) / (dense['steps'][-1] -
                                                                dense['steps'][0])
  assert 0 <= dense['extra_flops'][-1] - moe['extra_flops'][-1] < step
  # Both started from the dense checkpoint at P: the same starting loss (copied experts,
  # capacity permitting) and the pretraining's FLOPs counted in their totals.
  pretrain = data['t5']['pretrain']['0']
  assert moe['total_flops'][0] == dense['total_flops'][0] == pretrain['total_flops'][-1]
  assert dense['loss'][0] == pytest.approx(pretrain['loss'][-1], abs=1e-6)
  row = data['claims']['1. Upcycled MoE vs dense continuation at equal extra compute'][0]
  assert row['ours'].startswith('moe ') and 'dense' in row['ours']
  # The regime suite: every arm read on from the pretraining's data position (2P batches by
  # the dense continuation's end), its points at each fraction of the sunk cost, its plot.
  p = QUICK.regime_pretrain_steps
  position = epochs.data_position(str(runs_dir / 't5' / 'regime_dense' / 'seed0'))
  assert (position['epoch'], position['batch_in_epoch']) == (0, 2 * p)
  assert "## The headline claim in the paper's regime" in text
  assert [r['fraction'] for r in data['regime']['rows']] == list(QUICK.regime_fractions)
  assert all(set(r) >= {'regime_dense', 'regime_moe_paper', 'regime_moe_best', 'regime_scratch'}
             for r in data['regime']['rows'])
  ends = {e['arm']: e for e in data['regime']['ends']}
  assert set(ends) == set(runs_lib.REGIME_ARMS)
  assert ends['regime_dense']['epochs'] == pytest.approx(
      2 * p * QUICK.t5_batch / epochs.examples_per_epoch(position['pipeline'], str(runs_dir)))
  assert (out / 'results' / 't5_regime.png').stat().st_size > 10_000
  # The drop suite: a Llama upcycled into a Mixtral, each arm reading on from the dense
  # Llama's data position (P + X batches at its end), its section and plots.
  position = epochs.data_position(str(runs_dir / 'llama' / 'drop_0.5' / 'seed0'))
  assert position['batch_in_epoch'] == QUICK.llama_pretrain_steps + QUICK.llama_extra_steps
  assert '## Drop-Upcycling in its own setting' in text
  assert data['drop']['usage']['moe'].keys() == {f'decoder/layers_{i}/mlp' for i in range(4)}
  for png in ('llama_drop.png', 'llama_expert_usage.png'):
    assert (out / 'results' / png).stat().st_size > 10_000
  # The header's suite lines: the regime suite needs the precondition's T5 runs and the claims
  # suite's, the drop suite the precondition's dense Llama, the precondition the upcycled MoEs
  # whose FLOPs per step it reads.
  lines = {line.split('--suite ')[1].split()[0]: line for line in text.splitlines()
           if line.startswith('- `python -m upcycle.study') and '--suite ' in line}
  assert 'needs runs of the precondition and claims suites' in lines['regime']
  assert 'needs runs of the precondition suite,' in lines['drop']
  assert 'needs runs of the claims and drop suites' in lines['precondition']
  # The precondition opens RESULTS.md: a table per family, its row for the one seed; the
  # Llama MoE from scratch spent the dense pretraining's FLOPs to within one of its steps.
  sections = [line for line in text.splitlines() if line.startswith('## ')]
  assert sections[0] == ('## The precondition: MoE vs dense from scratch at equal FLOPs (the '
                         '`precondition` suite)')
  first = text.split(sections[0])[1].split(sections[1])[0]
  for family in ('### T5\n', '### Llama\n'):
    table = first.split(family)[1].split('**Is the MoE')[0]
    assert [line.split(' | ')[0] for line in table.splitlines()
            if line.startswith('| ')] == ['| seed', '| 0']
  for family in ('t5', 'llama'):
    found = data['precondition'][family]
    assert len(found['d']) == 1 and found['verdict'] == 'not resolved (1 seed)'
    assert found['routing'][0]['split'] == 'routing_health'
  dense, moe = data['llama']['pretrain']['0'], data['llama']['precondition_scratch']['0']
  rate = (moe['total_flops'][-1] - moe['total_flops'][0]) / (moe['steps'][-1] - moe['steps'][0])
  assert moe['total_flops'][0] == 0 and 0 <= moe['total_flops'][-1] - dense['total_flops'][-1] \
      < rate
  # The recipe suite: each sweep run evaluated its last checkpoint after training.
  sweep = runs_lib.final_eval(str(runs_dir / 't5' / recipe.arm(QUICK.recipe_peaks[0]) / 'seed0'))
  assert sweep['step'] == QUICK.regime_pretrain_steps and np.isfinite(sweep['loss'])
  assert [r['peak'] for r in data['recipe']['rows']] == list(QUICK.recipe_peaks)
  assert '## The recipe: a learning rate whose seeds agree' in text
  again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
  assert again.returncode == 0, again.stderr[-3000:]
  assert 'already finished, 0 to run' in again.stdout


def _write_run(runs_dir, arm, seed, source, rate, evals, family='t5'):
  """A finished run: `evals` {step: loss}, `rate` training FLOPs per step."""
  run_dir = os.path.join(runs_dir, family, arm, f'seed{seed}')
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, 'study.json'), 'w') as f:
    json.dump({'command': [], 'source': source}, f)
  with open(os.path.join(run_dir, 'study.done'), 'w') as f:
    f.write('1\n')
  with open(os.path.join(run_dir, 'metrics.jsonl'), 'w') as f:
    for step, loss in evals.items():
      f.write(json.dumps({'split': 'eval', 'step': step, 'loss': loss, 'accuracy': 0.0}) + '\n')
    f.write(json.dumps({'split': 'train', 'step': max(evals), 'train_flops_per_step': rate}) +
            '\n')


def test_final_values_average_the_last_evaluations_and_flops_follow_the_chain(tmp_path):
  runs_dir = str(tmp_path)
  _write_run(runs_dir, 'pretrain', 0, None, 1.0, {0: 9.0, 100: 4.0, 200: 3.0})
  _write_run(runs_dir, 'experts_4', 0, ['pretrain', 200], 2.0,
             {200: 3.0, 250: 2.9, 300: 2.8, 350: 2.7})
  _write_run(runs_dir, 'grown', 0, ['experts_4', 300], 3.0,
             {300: 2.8, 350: 2.6, 400: 2.5, 450: 2.3})
  results = Results(runs_dir, (0,), final_window=3)
  np.testing.assert_allclose(results.final('t5', 'grown', 'loss'), [(2.6 + 2.5 + 2.3) / 3])
  # grown starts where experts_4 was at step 300: 200 dense steps + 100 steps at 2 FLOPs.
  grown = results.curve('t5', 'grown', 0)
  np.testing.assert_allclose(grown.total_flops, [400.0, 550.0, 700.0, 850.0])
  # At common FLOPs: experts_4 is cheaper (ends at 500); both curves at its last 3 points
  # (300, 400, 500 FLOPs), where grown exists only at 500 -> NaN, never extrapolated.
  a, b = results.at_common_flops('t5', 'experts_4', 'grown', 'loss')
  assert np.isnan(b).all() and a == pytest.approx((2.9 + 2.8 + 2.7) / 3)
  with pytest.raises(ValueError, match='final_window'):
    Results(runs_dir, (0,), final_window=0)


def test_the_end_of_a_run_is_its_last_tenth_of_steps_however_often_it_logged(tmp_path):
  # Logged at steps 210, 220, ..., 400 (a run from step 200): 191 steps, the last 10% are
  # those after step 380.9; an evaluation row in between is not a training row.
  rows = [{'split': 'train', 'step': s, 'loss': s / 100} for s in range(210, 401, 10)]
  rows.insert(5, {'split': 'eval', 'step': 260, 'loss': 0.0})
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  assert [r['step'] for r in train_rows_at_end(str(tmp_path))] == [390, 400]
  assert regime.train_loss_at_end(str(tmp_path)) == pytest.approx(3.95)
  assert [r['step'] for r in train_rows_at_end(str(tmp_path), 0.5)] == list(range(310, 401, 10))


@pytest.mark.parametrize('scale', [FULL, QUICK], ids=['full', 'quick'])
def test_every_run_starts_from_a_checkpoint_its_source_keeps(scale):
  """A source step must be one its run saves (a multiple of checkpoint_every, or its last
  step) and still holds at the end (keep_checkpoints, 3 unless the run binds more)."""
  runs = {r.name: r for r in plan(scale, quick=False, suites=SUITES)}
  assert len(runs) == len(plan(scale, quick=False, suites=SUITES))   # shared runs planned once
  for r in runs.values():
    if not r.source:
      continue
    arm, step = r.source
    source = runs[f'{r.family}/{arm}/seed{r.seed}']
    last = source.steps if isinstance(source.steps, int) else None
    keep = 3
    for b in source.bindings:
      if b.startswith('trainer.TrainConfig.keep_checkpoints='):
        keep = int(b.split('=')[1])
    assert step % scale.checkpoint_every == 0 or step == last, r.name
    if last is not None:
      saved = sorted({s for s in range(scale.checkpoint_every, last + 1, scale.checkpoint_every)}
                     | {last})
      assert step in saved[-keep:], (r.name, step, saved[-keep:])


def test_every_run_s_command_binds_each_key_once_the_run_s_own_winning():
  """The command line refuses two values for one binding: a run's bindings replace its
  family's, which replace the common ones."""
  for r in plan(FULL, quick=False, suites=SUITES):
    if callable(r.steps):   # read from another run's metrics
      continue
    flags = r.command('runs', FULL, 'python')[3:]
    gin_utils.check_repeats(gin_utils.parse_flags(flags, 'study')[1])
    if r.family == 'llama':
      assert f'--gin.trainer.TrainConfig.eval_every={FULL.llama_eval_every}' in flags, r.name
  constant = [r for r in plan(FULL, quick=False, suites=('drop',)) if 'constant_lr' in r.name]
  assert constant and all(f'--gin.MIN_LEARNING_RATE={FULL.llama_learning_rate}' in r.command(
      'runs', FULL, 'python') for r in constant)


def test_the_per_layer_balance_arm_parses_in_a_new_process(tmp_path):
  """The drop suite's per-layer load-balancing arm, its command's gin files and bindings parsed
  first thing in a new interpreter (as the study starts it): its loss is a Switch per layer at
  mixtral.gin's weight. In this process another test's parse may already have registered
  balance.Switch, which would hide a binding that names it before any file does."""
  [run] = [r for r in plan(FULL, quick=False, suites=('drop',))
           if r.arm == 'moe_layerwise_balance' and r.seed == 0]
  script = ('import json, sys\n'
            'import gin\n'
            'from upcycle import gin_utils\n'
            'from upcycle.train import __main__ as train_main\n'
            "sys.modules['__main__'].train = train_main.train\n"
            "args, bindings = gin_utils.parse_flags(json.loads(sys.argv[1]), 'study')\n"
            'gin_utils.parse_files_and_bindings(args.gin_file, bindings, finalize=False)\n'
            "print(gin.query_parameter('moe.MoeConfig.balance').selector,\n"
            "      gin.query_parameter('ROUTER_AUX_LOSS_COEF/gin.macro.value'),\n"
            "      gin.query_parameter('balance.Switch.scope'))\n")
  flags = run.command(str(tmp_path), FULL, sys.executable)[3:]
  done = subprocess.run([sys.executable, '-c', script, json.dumps(flags)], cwd=REPO,
                        capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split() == ['balance.Switch', '0.02', 'batch']


# Parses each command as a new interpreter would: gin's registry as it was before any gin file
# (what a command-line binding may name is what that command's own files registered; another
# command's parse would otherwise hide a binding that names an object before any file does).
_PARSE_EACH_FRESH = """
import copy, json, sys
import gin
from gin import config as gin_config
from upcycle import gin_utils
from upcycle.train import __main__ as train_main
sys.modules['__main__'].train = train_main.train
registry = gin_config._REGISTRY
before = (copy.copy(registry._selector_tree), dict(registry._selector_map),
          dict(gin_config._INVERSE_REGISTRY))
failed = {}
for name, flags in json.loads(sys.stdin.read()).items():
  registry._selector_tree = copy.deepcopy(before[0])
  registry._selector_map = dict(before[1])
  gin_config._INVERSE_REGISTRY.clear()
  gin_config._INVERSE_REGISTRY.update(before[2])
  gin.clear_config(clear_constants=True)
  try:
    args, bindings = gin_utils.parse_flags(flags, 'study')
    gin_utils.parse_files_and_bindings(args.gin_file, bindings, finalize=False)
  except (Exception, SystemExit) as e:  # pylint: disable=broad-except
    failed[name] = str(e)[:300]
print(json.dumps(failed))
"""


def test_every_study_command_parses_as_its_own_process_starts_it(tmp_path):
  """Every arm of every suite (seed 0), its gin files and command-line bindings parsed with
  gin's registry as a new interpreter has it; and the check itself fails on the binding that
  once made 6 runs fail (balance.Switch bound on the command line before any file named it)."""
  runs = [r for r in plan(FULL, quick=False, suites=SUITES) if r.seed == 0]
  for r in runs:   # what an arm's step count reads of the runs it starts from
    os.makedirs(r.directory(str(tmp_path)))
    with open(os.path.join(r.directory(str(tmp_path)), 'metrics.jsonl'), 'w') as f:
      f.write(json.dumps({'step': 100, 'split': 'train', 'train_flops_per_step': 1e9}) + '\n')
  commands = {r.name: r.command(str(tmp_path), FULL, sys.executable)[3:] for r in runs}
  [layerwise] = [name for name in commands if name.startswith('llama/moe_layerwise_balance/')]
  commands['the former binding'] = [
      f for f in commands[layerwise] if f != '--gin_file=moe/balance_per_layer.gin'] + [
      '--gin.moe.MoeConfig.balance=@balance.Switch()']
  done = subprocess.run([sys.executable, '-c', _PARSE_EACH_FRESH], input=json.dumps(commands),
                        cwd=REPO, capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  failed = json.loads(done.stdout.strip().splitlines()[-1])
  assert list(failed) == ['the former binding'], failed
  assert 'balance.Switch' in failed['the former binding']
  assert len(commands) > 50


def test_suites_split_the_arms_and_plan_each_run_after_the_runs_it_starts_from():
  everything = {r.name for r in plan(FULL, quick=False, suites=SUITES)}
  own = {}
  for suite in SUITES:
    runs = plan(FULL, quick=False, suites=(suite,))
    position = {r.name: i for i, r in enumerate(runs)}
    for r in runs:
      assert all(position[d] < position[r.name] for d in r.dependencies()), r.name
    own[suite] = {r.name for r in runs if suite_of(r) == suite}
  assert sum(len(names) for names in own.values()) == len(everything)
  assert set.union(*own.values()) == everything
  assert {n.split('/')[1] for n in own['beyond']} == set(runs_lib.BEYOND_ARMS)
  assert {n.split('/')[1] for n in own['trails']} == set(runs_lib.TRAIL_ARMS)
  assert {n.split('/')[1] for n in own['drop']} == set(drop_runs.DESCRIPTIONS) - set(
      precondition.ARMS['llama'])
  assert {tuple(n.split('/')[:2]) for n in own['precondition']} == {
      (family, arm) for family, arms in precondition.ARMS.items() for arm in arms}


def test_drop_overtakes_naive_upcycling_where_the_paired_difference_stays_over_2_se(tmp_path):
  """Closed form: naive (moe) starts 0.1 lower on every seed; Drop is level at step 20 and
  ahead from step 40 by 0.1 +- 0.01 -> ahead from 40; d at the start = -0.1 with s.e. 0."""
  runs_dir = str(tmp_path)
  for seed, jitter in enumerate((-0.01, 0.0, 0.01)):
    _write_run(runs_dir, 'moe', seed, None, 1.0, {0: 5.0, 20: 4.8, 40: 4.7, 60: 4.6},
               family='llama')
    _write_run(runs_dir, 'drop_0.5', seed, None, 1.0,
               {0: 5.1, 20: 4.8 + jitter, 40: 4.6 + jitter, 60: 4.5 + jitter}, family='llama')
  cross = drop_section.crossover(Results(runs_dir, (0, 1, 2)))
  np.testing.assert_allclose(cross['mean'], [-0.1, 0.0, 0.1, 0.1], atol=1e-12)
  assert cross['se'][0] == pytest.approx(0.0, abs=1e-12)
  assert cross['ahead_from'] == 40
  # A Drop that falls behind again at the end has not overtaken.
  _write_run(runs_dir, 'drop_0.5', 3, None, 1.0, {0: 5.1, 20: 4.8, 40: 4.6, 60: 4.9},
             family='llama')
  _write_run(runs_dir, 'moe', 3, None, 1.0, {0: 5.0, 20: 4.8, 40: 4.7, 60: 4.6},
             family='llama')
  assert drop_section.crossover(Results(runs_dir, (0, 1, 2, 3)))['ahead_from'] is None


def test_regime_reads_each_arm_at_fractions_of_the_sunk_cost_and_checks_the_plateau(tmp_path):
  """Closed form: the dense pretraining spends 100 FLOPs (100 steps at 1); a continuation is
  read at f x 100 extra FLOPs, the scratch MoE at (1 + f) x 100 total FLOPs."""
  runs_dir = str(tmp_path)
  _write_run(runs_dir, 'regime_pretrain', 0, None, 1.0, {0: 9.0, 80: 3.10, 100: 3.08})
  _write_run(runs_dir, 'regime_dense', 0, ['regime_pretrain', 100], 1.0,
             {100: 3.08, 150: 3.0, 200: 2.9})
  _write_run(runs_dir, 'regime_moe_best', 0, ['regime_pretrain', 100], 2.0,
             {100: 3.2, 125: 2.9, 150: 2.8})
  _write_run(runs_dir, 'regime_scratch', 0, None, 2.0, {0: 9.0, 50: 3.1, 100: 2.7})
  scale = dataclasses.replace(FULL, seeds=(0,), regime_pretrain_steps=100, final_window=1)
  results = Results(runs_dir, (0,))
  np.testing.assert_allclose(regime.sunk_flops(results, scale), [100.0])
  np.testing.assert_allclose(regime.at_fraction(results, scale, 'regime_dense', 0.1),
                             [3.08 - 0.08 * 10 / 50])
  np.testing.assert_allclose(regime.at_fraction(results, scale, 'regime_moe_best', 0.5), [2.9])
  np.testing.assert_allclose(regime.at_fraction(results, scale, 'regime_scratch', 0.5), [2.9])
  best = regime.compare(results, scale, 'regime_moe_best', 'regime_dense', 0.5)
  np.testing.assert_allclose(best.d, [3.0 - 2.9])      # d > 0: the upcycled model is better
  assert best.verdict == 'not resolved (1 seed)'
  [plateau] = regime.plateau(results, scale)     # (3.10 - 3.08) / 3.10 = 0.65% < 1%
  assert plateau['plateaued'] and plateau['relative_drop'] == pytest.approx(0.02 / 3.10)
  late = dataclasses.replace(scale, plateau_tolerance=0.005)
  assert not regime.plateau(results, late)[0]['plateaued']
  # Over a window of 2 evaluation spacings (50 dense steps = 50 FLOPs): the dense continuation
  # at 50% is the mean of its values at 50 and 0 extra FLOPs; the plateau compares the means
  # of the pretraining at steps 30, 80 and at 50, 100 (9.0 -> 3.1 linearly at step 30).
  wide = dataclasses.replace(scale, final_window=2)
  np.testing.assert_allclose(regime.at_fraction(results, wide, 'regime_dense', 0.5),
                             [(3.0 + 3.08) / 2])
  before = (9.0 + (3.10 - 9.0) * 30 / 80 + 3.10) / 2
  after = (9.0 + (3.10 - 9.0) * 50 / 80 + 3.08) / 2
  assert regime.plateau(results, wide)[0]['relative_drop'] == pytest.approx(
      (before - after) / before)


def test_the_regime_table_marks_an_moe_arm_whose_routers_did_not_learn(tmp_path):
  """The paper's recipe upcycled with routers that stayed near uniform (top-1 0.14 < 1.5 / 8 in
  one layer): its column is marked and the footnote under the table names the run; the best
  recipe's and the scratch MoE's routers learned: not marked."""
  from upcycle.study import render  # pylint: disable=g-import-not-at-top
  runs_dir = str(tmp_path)
  for arm, top1 in (('regime_moe_paper', (0.3, 0.14)), ('regime_moe_best', (0.3, 0.25)),
                    ('regime_scratch', (0.3, 0.3))):
    _write_run(runs_dir, arm, 0, None, 2.0, {0: 9.0, 100: 3.0})
    _write_routing(runs_dir, arm, top1)
  summary = {'feature_lengths': {'inputs': 128, 'targets': 32}, 'ends': [],
             'plateau': [{'seed': 0, 'step_before': 80, 'loss_before': 3.1, 'loss_at_p': 3.08,
                          'relative_drop': 0.0065, 'plateaued': True}],
             'rows': [{'fraction': 0.1}]}
  text = '\n\n'.join(render.regime_parts(summary, FULL, 'x', Results(runs_dir, (0,))))
  assert ("| extra compute | dense continued | upcycled, paper's recipe† (vs dense) | upcycled, "
          'best recipe (vs dense) | MoE from scratch at equal total compute (best recipe vs '
          'it) |') in text
  footnote = text.split('† Routers that did not learn')[1]
  assert '`regime_moe_paper` seed 0: decoder/layers_1/mlp 0.140 (uniform 0.125)' in footnote
  assert 'regime_moe_best' not in footnote and 'regime_scratch' not in footnote


def test_the_drop_suites_table_of_every_arm_marks_routers_that_did_not_learn(tmp_path,
                                                                            monkeypatch):
  """Naive upcycling's seed-0 routers stayed near uniform in one layer (0.14 < 1.5 / 8): `moe`
  is marked and the footnote names that run; Drop r=0.5's learned (0.3, 0.25); the dense
  continuation has no routers."""
  from upcycle.study import drop_render  # pylint: disable=g-import-not-at-top
  runs_dir = str(tmp_path)
  for arm, top1 in (('moe', (0.3, 0.14)), ('drop_0.5', (0.3, 0.25)), ('dense', None)):
    _write_run(runs_dir, arm, 0, None, 1.0, {0: 6.0, 200: 5.3}, family='llama')
    if top1:
      _write_routing(runs_dir, arm, top1, family='llama')
  monkeypatch.setattr(Results, 'epochs', lambda self, family, arm: 0.15)
  head, table, footnote = drop_render.every_arm(Results(runs_dir, (0,)))
  rows = {line.split(' |')[0][2:]: line for line in table.splitlines()[2:]}
  assert set(rows) == {'`moe`†', '`drop_0.5`', '`dense`'}
  assert footnote.startswith('† Routers that did not learn') and '`moe` seed 0: ' in footnote
  assert 'drop_0.5' not in footnote and head.startswith('**Every arm**')


def test_the_routing_verdicts_read_the_experts_each_layer_uses():
  """Closed form: naive at 2.1 / 2.3 experts in its two layers (collapsed, <= 2.5), Drop at
  5 +- 0.1 -> Drop uses 2.8 more, s.e. small: yes; one naive layer at 3.0 -> not collapsed."""
  seeds = lambda *v: np.array(v)
  usage = {'moe': {'decoder/layers_0/mlp': seeds(2.1, 2.1, 2.1),
                   'decoder/layers_1/mlp': seeds(2.3, 2.3, 2.3)},
           'drop_0.5': {'decoder/layers_0/mlp': seeds(4.9, 5.0, 5.1),
                        'decoder/layers_1/mlp': seeds(4.9, 5.0, 5.1)}}
  collapse, more = drop_section.routing_rows(usage)
  assert collapse.agrees == 'yes' and collapse.ours == 'per layer 2.10, 2.30'
  assert more.agrees == 'yes' and 'd = +2.8000' in more.ours
  usage['moe']['decoder/layers_1/mlp'] = seeds(3.0, 3.0, 3.0)
  assert drop_section.routing_rows(usage)[0].agrees == 'no'


def test_the_setting_names_the_corpus_the_dense_run_recorded(tmp_path):
  """The T5 setting's corpus words carry the pretraining run's corpus.json: a run whose
  corpus was not the pinned one is named so, with both digests."""
  from upcycle.data import offline_text  # pylint: disable=g-import-not-at-top
  from upcycle.train import run_summary  # pylint: disable=g-import-not-at-top
  record = {**offline_text.corpus_record('packages'), 'digest': 'f' * 64, 'matches': False}
  run_summary.write_corpus(str(tmp_path), record)
  words = epochs.describe('packages', str(tmp_path), str(tmp_path))
  train_bytes = sum(len(d.encode()) for d in offline_text.packages_documents('train'))
  assert words == (f"the `packages` offline corpus (sha256 {'f' * 64} (NOT the pinned "
                   f'{offline_text.PACKAGES_DIGEST}); {train_bytes / 1e6:.1f} MB of training '
                   'text)')


def _write_sweep_run(runs_dir, peak, seed, loss, grad_norms, stderr=0.01):
  """A finished sweep run: its final evaluation's loss, its logged gradient norms (steps 10,
  20, ...)."""
  run_dir = os.path.join(runs_dir, 't5', recipe.arm(peak), f'seed{seed}')
  os.makedirs(os.path.join(run_dir, runs_lib.FINAL_EVAL))
  open(os.path.join(run_dir, 'study.done'), 'w').write('1\n')
  with open(os.path.join(run_dir, runs_lib.FINAL_EVAL, 'eval_results.json'), 'w') as f:
    json.dump({'step': 1500, 'loss': loss, 'loss_stderr': stderr, 'accuracy': 0.4}, f)
  with open(os.path.join(run_dir, 'metrics.jsonl'), 'w') as f:
    for i, norm in enumerate(grad_norms):
      f.write(json.dumps({'split': 'train', 'step': 10 * (i + 1), 'grad_norm': norm}) + '\n')


def test_the_recipe_is_the_agreeing_peak_with_the_lowest_loss(tmp_path):
  """Closed form: peak 0.1's seeds spread (std 0.1308 > 0.05) although its mean is lowest;
  0.032 and 0.01 agree (std 0.01, 0.0) -> 0.032, the lower mean of the two. A gradient spike
  is the largest norm after the warmup over their median: norms 1, 1, 2, 8 after step 10
  -> 8 / 1.5."""
  scale = dataclasses.replace(FULL, recipe_warmup_steps=10)
  losses = {0.1: (2.30, 2.55, 2.40), 0.032: (2.44, 2.45, 2.46), 0.01: (2.60, 2.60, 2.60)}
  for peak, values in losses.items():
    for seed, loss in enumerate(values):
      _write_sweep_run(str(tmp_path), peak, seed, loss, [50.0, 1.0, 1.0, 2.0, 8.0])
  summary = recipe.summary(str(tmp_path), scale)
  by_peak = {r['peak']: r for r in summary['rows']}
  assert by_peak[0.1]['std'] == pytest.approx(np.std([2.30, 2.55, 2.40], ddof=1))
  assert [by_peak[p]['agree'] for p in (0.1, 0.032, 0.01)] == [False, True, True]
  assert summary['chosen'] == 0.032 and summary['complete']
  np.testing.assert_allclose(by_peak[0.1]['spike'], [8.0 / 1.5] * 3)
  text = '\n'.join(render.recipe_parts(summary, scale))
  assert ('| 0.032 | 2.4400 ± 0.0100 | 2.4500 ± 0.0100 | 2.4600 ± 0.0100 | 2.4500 | 0.0100 | yes'
          in text) and '**Chosen: peak 0.032**' in text
  # One peak unfinished: shown as such, and no peak agreeing -> none chosen.
  os.remove(os.path.join(str(tmp_path), 't5', 'lr_0.01', 'seed2', 'study.done'))
  for seed, loss in enumerate((2.44, 2.60, 2.46)):
    _write_sweep_run(str(tmp_path / 'spread'), 0.032, seed, loss, [1.0, 1.0])
  spread = recipe.summary(str(tmp_path / 'spread'), scale)
  assert spread['chosen'] is None and not spread['complete']
  assert '**No peak swept gives seeds that agree.** (Not every peak' in '\n'.join(
      render.recipe_parts(spread, scale))


def test_a_sweep_run_pretrains_at_its_peak_and_evaluates_its_last_checkpoint_on_the_split():
  """The rsqrt schedule's base rate is peak x sqrt(warmup): 0.032 x 10 = 0.32 at warmup 100;
  the final evaluation reads the run's last checkpoint, every validation batch (0), no
  decoding, into the run's final_eval directory."""
  [run] = [r for r in recipe.recipe_runs(FULL, 1) if r.arm == 'lr_0.032']
  flags = run.command('runs', FULL, 'python')
  assert '--gin.optimizers.rsqrt_schedule.base_learning_rate=0.32' in flags
  assert '--gin.WARMUP_STEPS=100' in flags and f'--gin.TRAIN_STEPS={FULL.regime_pretrain_steps}' \
      in flags
  command = run.final_eval_command('runs', 'python')
  assert command[:3] == ['python', '-m', 'upcycle.eval']
  assert (f"--gin.CHECKPOINT_PATH='runs/t5/lr_0.032/seed1/checkpoints/"
          f"{FULL.regime_pretrain_steps}'") in command
  assert '--gin.EVAL_BATCHES=0' in command and '--gin.evaluate.decode_data=None' \
      in command
  gin_utils.check_repeats(gin_utils.parse_flags(command[3:], 'study')[1])


def _write_routing(runs_dir, arm, top1, experts=8, family='t5', seed=0, logged=None):
  """Appends to a `_write_run` run the routing-health row the trainer writes
  (`MetricLogger.record` of `routing_health.health`), from training rows at steps 100 and 200
  whose two MoE layers had top-1 router probabilities `top1`; with `logged` ({step: top1}),
  from those training rows instead, logged too as the trainer logs them."""
  from upcycle.train import routing_health  # pylint: disable=g-import-not-at-top
  from upcycle.train.logger import MetricLogger  # pylint: disable=g-import-not-at-top
  run_dir = os.path.join(runs_dir, family, arm, f'seed{seed}')
  layers = ('encoder/layers_1/mlp', 'decoder/layers_1/mlp')
  train = [{'split': 'train', 'step': s, **{f'moe/{layer}/router_top1_probability': p
                                            for layer, p in zip(layers, values)}}
           for s, values in (logged or {100: top1, 200: top1}).items()]
  logger = MetricLogger(run_dir, 200, 0, tensorboard=False, append=True)
  for row in train if logged else ():
    logger.record(row)
  logger.record(routing_health.health(train, {layer: experts for layer in layers}))
  logger.close()


def test_an_arm_whose_routers_did_not_learn_is_marked_with_a_footnote(tmp_path):
  """`scratch`'s decoder stayed at 0.14 < 1.5 / 8: marked and named; `moe` learned (0.3 and
  0.25 >= 0.1875); `dense` has no MoE layer, so no routing-health row."""
  from upcycle.study import render  # pylint: disable=g-import-not-at-top
  runs_dir = str(tmp_path)
  for arm in ('moe', 'scratch', 'dense'):
    _write_run(runs_dir, arm, 0, None, 1.0, {0: 5.0, 200: 3.0})
  _write_routing(runs_dir, 'moe', (0.3, 0.25))
  _write_routing(runs_dir, 'scratch', (0.3, 0.14))
  results = Results(runs_dir, (0,))
  marks, footnote = render.unlearned_routers(results, 't5', ['moe', 'scratch', 'dense'])
  assert marks == {'moe': '', 'scratch': '†', 'dense': ''}
  assert footnote.startswith('† Routers that did not learn (criterion: top-1 router '
                             'probability >= 1.5 x uniform (1/E) in every MoE layer')
  assert ('`scratch` seed 0: decoder/layers_1/mlp 0.140 (uniform 0.125), encoder/layers_1/mlp '
          '0.300 (uniform 0.125).') in footnote
  assert '`moe`' not in footnote
  assert render.unlearned_routers(results, 't5', ['moe', 'dense']) == (
      {'moe': '', 'dense': ''}, None)


def test_results_md_marks_the_arm_and_adds_the_footnote_under_its_table(tmp_path, monkeypatch):
  from upcycle.study import render  # pylint: disable=g-import-not-at-top
  runs_dir = str(tmp_path / 'runs')
  for arm in ('moe', 'scratch'):
    _write_run(runs_dir, arm, 0, None, 1.0, {0: 5.0, 200: 3.0})
  _write_routing(runs_dir, 'scratch', (0.3, 0.14))
  os.makedirs(os.path.join(runs_dir, 'llama', 'pretrain', 'seed0'))
  open(os.path.join(runs_dir, 'llama', 'pretrain', 'seed0', 'study.failed'), 'w').write('x')
  monkeypatch.setattr(Results, 'epochs', lambda self, family, arm: 0.1)   # no checkpoints here
  path = render.write(str(tmp_path / 'out'), Results(runs_dir, (0,)), '# Results',
                      {'t5': {'moe': 'upcycled', 'scratch': 'from scratch'}}, [], QUICK, 'x')
  # The precondition's runs: T5's not run yet, the dense Llama's failed.
  t5, llama = open(path).read().split('## Claims')[0].split('### T5\n')[1].split('### Llama\n')
  assert 'Not finished: `python -m upcycle.study --suite precondition` runs it.' in t5
  assert 'A run failed (its study.failed).' in llama
  lines = open(path).read().split('### Every T5 arm (validation loss)')[1].splitlines()
  assert lines[4].startswith('| `moe` (upcycled) | 5.0000 | 3.0000 |')
  assert lines[5].startswith('| `scratch`† (from scratch) | 5.0000 | 3.0000 |')
  assert lines[7].startswith('† Routers that did not learn') and '`scratch` seed 0' in lines[7]


def _write_precondition_runs(runs_dir):
  """Closed-form precondition runs of 3 seeds, FLOPs per step as each run logs them.

  T5: the dense run from scratch is `regime_pretrain` (100 steps at 1 FLOP) continued by
  `regime_dense` to step 200 (200 FLOPs); `regime_scratch` (2 FLOPs per step) ran 101 steps, to
  202 FLOPs: the dense run ended first, at 200. Llama: `pretrain` 40 steps at 3 FLOPs (120);
  the MoE 35 steps at 3.5 (122.5): the dense run ended first, at 120."""
  for seed, jitter in enumerate((-0.01, 0.0, 0.01)):
    _write_run(runs_dir, 'regime_pretrain', seed, None, 1.0, {0: 9.0, 50: 4.0, 100: 3.5})
    _write_run(runs_dir, 'regime_dense', seed, ['regime_pretrain', 100], 1.0,
               {100: 3.5, 150: 3.3, 200: 3.2})
    _write_run(runs_dir, 'regime_scratch', seed, None, 2.0, {0: 9.0, 50: 3.4, 101: 3.0 + jitter})
    _write_run(runs_dir, 'pretrain', seed, None, 3.0, {0: 8.0, 20: 6.0, 40: 5.0},
               family='llama')
    _write_run(runs_dir, drop_runs.PRECONDITION_SCRATCH, seed, None, 3.5,
               {0: 8.0, 20: 6.5, 35: 5.4 + jitter}, family='llama')
    # Its routers: near uniform at step 50 (0.14 < 1.5 / 8), learned by step 100 but in seed
    # 1's decoder.
    late = (0.3, 0.14 if seed == 1 else 0.25)
    _write_routing(runs_dir, 'regime_scratch', late, seed=seed,
                   logged={50: (0.14, 0.14), 100: late})
    _write_routing(runs_dir, drop_runs.PRECONDITION_SCRATCH, (0.3, 0.3), family='llama',
                   seed=seed, logged={20: (0.3, 0.3), 35: (0.3, 0.3)})


def test_the_precondition_compares_the_moe_and_dense_from_scratch_at_equal_flops(tmp_path):
  """Both arms are read at the FLOPs where the dense run ended, the mean over its last 2
  evaluations (150 and 200 FLOPs for T5, 60 and 120 for the Llama), the MoE interpolated
  linearly on its total-FLOPs axis between its evaluations at 100 and 202 (T5) or 70 and
  122.5 (Llama) FLOPs."""
  runs_dir = str(tmp_path)
  _write_precondition_runs(runs_dir)
  found = precondition.summary(Results(runs_dir, (0, 1, 2), final_window=2))
  t5, llama = found['t5'], found['llama']
  moe_end = np.array([3.0 - 0.01, 3.0, 3.0 + 0.01])
  t5_moe = ((3.4 + (moe_end - 3.4) * 50 / 102) + (3.4 + (moe_end - 3.4) * 100 / 102)) / 2
  np.testing.assert_allclose(t5['dense_loss'], [(3.3 + 3.2) / 2] * 3)
  np.testing.assert_allclose(t5['moe_loss'], t5_moe)
  np.testing.assert_allclose(t5['d'], (3.3 + 3.2) / 2 - t5_moe)    # ~0.144 > 0: MoE better
  assert t5['verdict'] == 'yes'   # mean 0.1441, s.e. 0.0042
  np.testing.assert_allclose(t5['flops'], [200.0] * 3)
  assert t5['ended'] == ['regime_dense'] * 3
  assert [r['routers_learned'] for r in t5['routing']] == [True, False, True]
  llama_end = 5.4 + np.array([-0.01, 0.0, 0.01])
  llama_moe = ((8.0 + (6.5 - 8.0) * 60 / 70) + (6.5 + (llama_end - 6.5) * 50 / 52.5)) / 2
  np.testing.assert_allclose(llama['dense_loss'], [(6.0 + 5.0) / 2] * 3)
  np.testing.assert_allclose(llama['d'], 5.5 - llama_moe)     # ~-0.583 < 0: dense better
  assert llama['verdict'] == 'no'
  np.testing.assert_allclose(llama['flops'], [120.0] * 3)
  assert llama['ended'] == ['pretrain'] * 3
  # T5 again at half the budget, where `regime_pretrain` ended (its evaluations at 50 and 100
  # FLOPs: 4.0 and 3.5); the MoE interpolated there between (0, 9.0) and (100, 3.4): 6.2, 3.4.
  early = found['early']['t5']
  np.testing.assert_allclose(early['dense_loss'], [3.75] * 3)
  np.testing.assert_allclose(early['moe_loss'], [4.8] * 3)
  np.testing.assert_allclose(early['d'], [-1.05] * 3)
  assert early['verdict'] == 'no' and early['ended'] == ['regime_pretrain'] * 3
  np.testing.assert_allclose(early['flops'], [100.0] * 3)
  # The MoE's routers as of its step 50 there (100 FLOPs at 2 a step), not its end's.
  assert [r['routers_learned'] for r in early['routing']] == [False] * 3
  assert early['routing'][0]['layers']['encoder/layers_1/mlp']['top1_probability'] == 0.14
  assert set(found['early']) == {'t5'}    # the Llama's cosine: a point mid-run is no run
  # An arm not finished for every seed: no comparison yet.
  os.remove(os.path.join(runs_dir, 'llama', 'pretrain', 'seed2', 'study.done'))
  assert precondition.summary(Results(runs_dir, (0, 1, 2)))['llama'] is None


def test_results_md_opens_with_the_precondition(tmp_path, monkeypatch):
  """The section comes first after the header: per family its rows, verdict and routing
  health (seed 1's T5 routers did not learn: marked, with the footnote); study.json has its
  numbers."""
  runs_dir = str(tmp_path / 'runs')
  _write_precondition_runs(runs_dir)
  monkeypatch.setattr(regime, 'summary', lambda results, scale: None)   # no checkpoints here
  scale = dataclasses.replace(QUICK, seeds=(0, 1, 2), final_window=2)
  path = render.write(str(tmp_path / 'out'), Results(runs_dir, (0, 1, 2), final_window=2),
                      '# Results', {'t5': {}, 'llama': {}}, [], scale, 'x')
  text = open(path).read()
  assert text.startswith('# Results\n\n## The precondition: MoE vs dense from scratch at equal '
                         'FLOPs')
  t5, llama = text.split('### T5\n')[1].split('### Llama\n')
  d = (3.3 + 3.2) / 2 - (3.4 + (3.0 - 3.4) * 75 / 102)     # seed 1: the MoE ended at 3.0
  assert f'| 1 | 3.2500 | {3.25 - d:.4f} | {d:+.4f} | 200 (where `regime_dense` ended) | no† |' \
      in t5
  assert '**Is the MoE from scratch better than dense at equal FLOPs: yes** (d = +0.1441, s.e. ' \
      '0.0042, 3 seeds)' in t5
  assert '† Routers that did not learn' in t5 and '`regime_scratch` seed 1' in t5
  early = t5.split('Read again at half the budget, where `regime_pretrain` ended')[1]
  # There the MoE is at its step 50, whose routers had not learned yet.
  assert '| 0 | 3.7500 | 4.8000 | -1.0500 | 100 (where `regime_pretrain` ended) | no† |' in early
  assert '**Is the MoE from scratch better than dense at equal FLOPs: no** (d = -1.0500, s.e. ' \
      '0.0000, 3 seeds)' in early
  assert '**Is the MoE from scratch better than dense at equal FLOPs: no**' in llama
  assert '120 (where `pretrain` ended) | yes |' in llama and '†' not in llama.split('**What')[0]
  assert "**What a 'no' means.**" in llama and text.index('## Claims') > text.index(
      "**What a 'no' means.**")
  # No claim's arms ran: one line instead of tables of 'not finished'.
  assert text.split('## Claims\n\n')[1].startswith(
      'No claim has both its arms finished for every seed in these runs: `python -m '
      'upcycle.study` runs them')
  assert '| claim |' not in text and 'not finished' not in text
  data = json.loads((tmp_path / 'out' / 'results' / 'study.json').read_text())
  np.testing.assert_allclose(data['precondition']['t5']['d'][1], d)
  assert data['precondition']['llama']['verdict'] == 'no'


def test_the_precondition_plans_runs_from_scratch_at_equal_flops_within_one_step(tmp_path):
  """Its arms and no other of its own; each MoE's steps are the fewest whose FLOPs reach its
  dense run's (at the FLOPs per step the runs logged; T5: 2P = 3000 dense steps at 3.0 over
  the MoE's 3.69 -> 2439.02 -> 2440; Llama: P = 400 at 146.8 over 197.66 -> 297.07 -> 298),
  and the Llama's arms run from scratch under the pretraining's one schedule over their own
  steps (no source, no restarted step, SCHEDULE_STEPS = TRAIN_STEPS)."""
  runs = plan(FULL, quick=False, suites=('precondition',))
  own = [r for r in runs if suite_of(r) == 'precondition']
  assert {(r.family, r.arm, r.seed) for r in own} == {
      (f, a, s) for f, arms in precondition.ARMS.items() for a in arms for s in FULL.seeds}
  assert {(r.family, r.arm) for r in runs if r not in own} == {
      ('t5', 'pretrain'), ('t5', 'moe'), ('llama', 'moe')}   # whose FLOPs per step they read
  for family, arm, rate in (('t5', 'regime_pretrain', 3.0), ('t5', 'moe', 3.69),
                            ('llama', 'pretrain', 146.8), ('llama', 'moe', 197.66)):
    run_dir = os.path.join(str(tmp_path), family, arm, 'seed0')
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, 'metrics.jsonl'), 'w') as f:
      f.write(json.dumps({'split': 'train', 'step': 1, 'train_flops_per_step': rate}) + '\n')
  by_arm = {(r.family, r.arm): r for r in own if r.seed == 0}
  p, llama_p = FULL.regime_pretrain_steps, FULL.llama_pretrain_steps
  assert by_arm['t5', 'regime_scratch'].train_steps(str(tmp_path)) == 2440
  assert by_arm['t5', 'regime_dense'].train_steps(str(tmp_path)) == 2 * p == 3000
  assert 0 <= 2440 * 3.69 - 2 * p * 3.0 < 3.69
  moe = by_arm['llama', drop_runs.PRECONDITION_SCRATCH]
  assert moe.train_steps(str(tmp_path)) == 298 and 0 <= 298 * 197.66 - llama_p * 146.8 < 197.66
  for r in (moe, by_arm['llama', 'pretrain']):
    flags = r.command(str(tmp_path), FULL, 'python')
    assert r.source is None and r.gin_files[-1] == 'runs/llm_pretrain.gin'
    assert not any('SCHEDULE_STEPS' in f or 'Restore.step' in f or 'INITIAL_CHECKPOINT' in f
                   for f in flags)
  # The regime suite's section reads the precondition's T5 arms: planned with it.
  assert {('t5', a) for a in precondition.ARMS['t5']} <= {
      (r.family, r.arm) for r in plan(FULL, quick=False, suites=('regime',))}
