"""`python -m upcycle.study`: the verdict rule, FLOPs matching, the plan, and --quick end to end."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from upcycle.study import claims, runs as runs_lib
from upcycle.study.__main__ import QUICK_ARMS, plan
from upcycle.study.curves import Curve
from upcycle.study.scale import FULL, QUICK

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
  arms = {(r.family, r.arm) for r in plan(FULL, quick=False)}
  for claim_list in claims.CLAIMS.values():
    for c in claim_list:
      assert {(c.family, c.a), (c.family, c.b)} <= arms, c.claim
  assert {(r.family, r.arm) for r in plan(QUICK, quick=True)} == {
      (f, a) for f, arms_of in QUICK_ARMS.items() for a in arms_of}
  for r in plan(FULL, quick=False):
    assert r.arm in runs_lib.DESCRIPTIONS[r.family], r.arm
    for f in r.gin_files:
      assert os.path.exists(os.path.join(REPO, 'configs', f)), f


def test_quick_study_writes_results_and_resumes(tmp_path):
  out, runs_dir = tmp_path / 'docs', tmp_path / 'runs'
  command = [sys.executable, '-m', 'upcycle.study', '--quick', f'--out={out}',
             f'--runs_dir={runs_dir}']
  env = {**os.environ, 'XLA_FLAGS': '--xla_backend_optimization_level=0'}
  done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  text = (out / 'RESULTS.md').read_text()
  assert '## Claims' in text and '| claim | paper\'s number |' in text
  for png in ('t5_flops.png', 'vit_flops.png'):
    assert (out / 'results' / png).stat().st_size > 10_000
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
  again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
  assert again.returncode == 0, again.stderr[-3000:]
  assert 'already finished, 0 to run' in again.stdout
