"""An MoE run's routing health: the router kernels' RMS the train step logs, the experts'
spread, the end-of-run block of metrics.jsonl and the run's closing lines."""

import jax
import numpy as np
import pytest

from upcycle import tree
from upcycle.models import T5Config, scan_layout
from upcycle.moe import MoeConfig, routers
from upcycle.train import routing_health, run_summary
from upcycle.train.step import router_kernel_rms

ENCODER, DECODER = 'encoder/layers_1/mlp', 'decoder/layers_1/mlp'


def rows(top1_decoder):
  """Training rows of steps 1..20 (the last 10%: steps 19 and 20) of an E = 4 encoder layer
  and an E = 8 decoder layer, and an eval row that is not counted."""
  out = []
  for step in range(1, 21):
    out.append({'step': step, 'split': 'train',
                f'moe/{ENCODER}/router_top1_probability': 0.3 + 0.01 * step,
                f'moe/{ENCODER}/fraction_dropped_tokens': 0.1 * (step % 2),
                f'moe/{ENCODER}/effective_experts': 3.0 + 0.05 * step,
                f'moe/{ENCODER}/router_kernel_rms': 0.02 + 0.001 * step,
                f'moe/{DECODER}/router_top1_probability': top1_decoder,
                f'moe/{DECODER}/fraction_dropped_tokens': 0.25,
                f'moe/{DECODER}/effective_experts': 7.0,
                **({f'moe/{ENCODER}/expert_spread': 0.0} if step == 1 else {})})
  return out + [{'step': 20, 'split': 'eval', f'moe/{ENCODER}/router_top1_probability': 1.0}]


def test_health_is_the_mean_of_the_last_tenth_of_the_training_rows():
  row = routing_health.health(rows(0.2), {ENCODER: 4, DECODER: 8})
  encoder, decoder = row['layers'][ENCODER], row['layers'][DECODER]
  assert (row['step'], row['split']) == (20, 'routing_health')
  np.testing.assert_allclose(encoder['top1_probability'], np.mean([0.49, 0.50]), rtol=1e-12)
  np.testing.assert_allclose(encoder['unrouted_fraction'], np.mean([0.1, 0.0]), rtol=1e-12)
  np.testing.assert_allclose(encoder['effective_experts'], np.mean([3.95, 4.0]), rtol=1e-12)
  assert encoder['router_kernel_rms'] == pytest.approx(0.04)            # step 20's
  assert encoder['router_kernel_rms_at_init'] == pytest.approx(0.021)   # step 1's
  assert (encoder['uniform_probability'], decoder['uniform_probability']) == (0.25, 0.125)
  assert encoder['expert_spread_at_init'] == 0.0                        # step 1's
  assert decoder['router_kernel_rms'] is None   # not logged (a run from before it was)
  assert decoder['expert_spread_at_init'] is None
  # 0.495 >= 1.5 / 4 and 0.2 >= 1.5 / 8: learned; 0.18 < 0.1875 in the decoder: not.
  assert row['routers_learned']
  assert not routing_health.health(rows(0.18), {ENCODER: 4, DECODER: 8})['routers_learned']


def test_no_health_without_moe_layers_or_training_rows():
  assert routing_health.health(rows(0.2), {}) is None
  assert routing_health.health([{'step': 0, 'split': 'eval', 'loss': 1.0}], {ENCODER: 4}) is None


def test_the_closing_lines_show_the_verdict_and_every_layer():
  row = routing_health.health(rows(0.18), {ENCODER: 4, DECODER: 8}, spread={ENCODER: 0.0314})
  text = run_summary.text('/runs/r', 20, None, False, 5.0, routing=row)
  lines = text.splitlines()
  assert lines[3].startswith('  routing:      ROUTERS DID NOT LEARN (top-1 router probability '
                             '>= 1.5 x uniform (1/E) in every MoE layer')
  assert lines[4] == (f'    {DECODER}: top-1 0.180 (uniform 0.125), unrouted 25.0%, effective '
                      f'experts 7.00 of 8, router kernel RMS ? (at init ?)')
  assert lines[5] == (f'    {ENCODER}: top-1 0.495 (uniform 0.250), unrouted 5.0%, effective '
                      f'experts 3.98 of 4, router kernel RMS 0.0400 (at init 0.0210), expert '
                      f'spread 0.031 (at init 0.000)')
  assert 'routing' not in run_summary.text('/runs/r', 20, None, False, 5.0)


@pytest.mark.parametrize('scan', [False, True])
def test_router_kernel_rms_per_layer_scanned_or_not(scan):
  """numpy's sqrt(mean(w^2)) of each MoE layer's kernel, under the per-layer names whether
  the params are stacked for a scanned model or not."""
  config = T5Config(d_model=8, num_encoder_layers=4, num_decoder_layers=4, scan_layers=scan,
                    encoder_moe=MoeConfig(num_experts=4),
                    decoder_moe=MoeConfig(num_experts=2, router=routers.TopK(k=1)))
  kernels = {'encoder/layers_1/mlp': (8, 4), 'encoder/layers_3/mlp': (8, 4),
             'decoder/layers_1/mlp': (8, 2), 'decoder/layers_3/mlp': (8, 2)}
  rng = np.random.default_rng(0)
  values = {layer: rng.normal(size=shape).astype(np.float32) * (i + 1)
            for i, (layer, shape) in enumerate(kernels.items())}
  params = {f'{layer}/router/router_weights/w/kernel': v for layer, v in values.items()}
  params.update({f'{layer}/expert/wi/kernel': np.ones((4, 8, 16), np.float32)
                 for layer in kernels})   # not a router's
  params = tree.unflatten(params)
  if scan:
    params = scan_layout.stack(params, config)
  got = jax.device_get(router_kernel_rms(params, config))
  assert got.keys() == {f'{layer}/router_kernel_rms' for layer in kernels}
  for layer, v in values.items():
    np.testing.assert_allclose(got[f'{layer}/router_kernel_rms'], np.sqrt(np.mean(v ** 2)),
                               rtol=1e-6)


@pytest.mark.parametrize('scan', [False, True])
def test_expert_spread_per_layer_scanned_or_not(scan):
  """||W - mean_e W|| / ||mean_e W|| over each MoE layer's expert leaves, in closed form:
  experts m * (1 + a_e) with a = (s, -s, s, -s) are s apart whatever m; copies 0; the
  shared expert and the router are not experts."""
  config = T5Config(d_model=8, num_encoder_layers=4, num_decoder_layers=4, scan_layers=scan,
                    encoder_moe=MoeConfig(num_experts=4),
                    decoder_moe=MoeConfig(num_experts=4, router=routers.TopK(k=1)))
  rng = np.random.default_rng(0)
  signs = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
  apart = {'encoder/layers_1/mlp': 0.1, 'encoder/layers_3/mlp': 0.0,
           'decoder/layers_1/mlp': 0.25, 'decoder/layers_3/mlp': 0.5}
  params = {}
  for layer, s in apart.items():
    for name, shape in (('wi/kernel', (8, 16)), ('wo/kernel', (16, 8)), ('wo/bias', (8,))):
      m = rng.normal(size=shape).astype(np.float32)
      params[f'{layer}/expert/{name}'] = m * (1 + s * signs.reshape((4,) + (1,) * len(shape)))
    params[f'{layer}/shared_expert/wi/kernel'] = rng.normal(size=(8, 16)).astype(np.float32)
    params[f'{layer}/router/router_weights/w/kernel'] = rng.normal(size=(8, 4)).astype(
        np.float32)
  params = tree.unflatten(params)
  if scan:
    params = scan_layout.stack(params, config)
  got = jax.device_get(routing_health.expert_spread(params, config))
  assert got.keys() == apart.keys()
  for layer, s in apart.items():
    np.testing.assert_allclose(got[layer], s, atol=1e-6)


def test_independent_experts_are_sqrt_e_minus_1_apart():
  """E experts drawn independently around zero: E[||W - mean||^2] / E[E ||mean||^2] =
  (E - 1) / 1, so sqrt(7) at E = 8 (to the sampling error of 8 x 64 x 256 draws)."""
  config = T5Config(d_model=64, num_encoder_layers=2, num_decoder_layers=2,
                    encoder_moe=MoeConfig(num_experts=8))
  w = np.random.default_rng(0).normal(size=(8, 64, 256)).astype(np.float32)
  got = routing_health.expert_spread({'encoder': {'layers_1': {'mlp': {'expert': {
      'wi': {'kernel': w}}}}}}, config)
  np.testing.assert_allclose(got['encoder/layers_1/mlp'], np.sqrt(7), rtol=0.01)
