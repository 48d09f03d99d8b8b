"""The optimizer's schedule and step skipping, step for step against OLMo-core's own classes."""

import fiddle as fdl
import jax
import numpy as np
import pytest
import torch
from olmo_core.optim import CosWithWarmup, HalfCosWithWarmup, LinearWithWarmup, SkipStepAdamW

from experiments import olmo3_7b
from olmo3.config import OptimizerConfig
from olmo3.train import optim

STAGE1 = fdl.build(olmo3_7b.stage1()).optimizer
STAGE2 = fdl.build(olmo3_7b.stage2()).optimizer
# Updates around every boundary (warmup end, part 2's takeover and midpoint, the epoch's end)
# and spread over both stages.
RNG = np.random.default_rng(0)
STAGE1_UPDATES = sorted({1, 2, 999, 1999, 2000, 2001, 596_046, 596_047, 596_048, 596_500,
                         597_045, 597_046, 597_047, 1_192_092, 1_192_093, 1_413_813, 1_413_814,
                         *RNG.integers(1, 1_413_815, 200).tolist()})
STAGE2_UPDATES = sorted({1, 2, 23_842, 47_683, 47_684, *RNG.integers(1, 47_685, 100).tolist()})


def _ours(cfg, updates):
  return np.asarray(jax.jit(jax.vmap(lambda t: optim.learning_rate(cfg, t)))(np.asarray(updates)))


def test_stage1_lr_is_ai2s_two_scripts_update_for_update():
  """Part 1 (pretrain-1.py): CosWithWarmup over 5T tokens; part 2 (pretrain-2.py, from the
  step-596,047 checkpoint on): HalfCosWithWarmup over 7T tokens. OLMo-core's `current` is the
  update's 1-based index (it advances the step before the update)."""
  part1, part2 = CosWithWarmup(warmup=2000), HalfCosWithWarmup(warmup=597_046)
  theirs = [part1.get_lr(3e-4, t, 1_192_093) if t <= 596_047 else
            part2.get_lr(3e-4, t, 1_668_931) for t in STAGE1_UPDATES]
  np.testing.assert_allclose(_ours(STAGE1, STAGE1_UPDATES), theirs, rtol=2e-6)
  assert theirs[0] > 0  # the first update already moves
  assert _ours(STAGE1, [1_413_814])[0] == pytest.approx(3.93e-5, rel=2e-3)  # where the epoch ends


def test_stage2_lr_is_the_midtraining_scripts():
  theirs = [LinearWithWarmup(warmup=0, alpha_f=0.0).get_lr(STAGE2.peak_lr, t, 47_684)
            for t in STAGE2_UPDATES]
  ours = _ours(STAGE2, STAGE2_UPDATES)
  np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=1e-12)
  assert ours[-1] == 0.0 and ours[0] == pytest.approx(STAGE2.peak_lr * (1 - 1 / 47_684))


def test_single_cosine_variant_is_olmo_cores_cosine():
  cfg = fdl.build(olmo3_7b.single_cosine(olmo3_7b.stage1())).optimizer
  theirs = [CosWithWarmup(warmup=2000).get_lr(3e-4, t, 1_413_814) for t in STAGE1_UPDATES]
  np.testing.assert_allclose(_ours(cfg, STAGE1_UPDATES), theirs, rtol=2e-6)


def _olmo_core_skips(losses, grad_norms, window):
  param = torch.nn.Parameter(torch.zeros(1))
  opt = SkipStepAdamW([param], lr=1e-3, rolling_interval_length=window, sigma_factor=6)
  decisions = []
  for loss, norm in zip(losses, grad_norms):
    opt.latest_loss, opt.latest_grad_norm = torch.tensor(loss), torch.tensor(norm)
    decisions.append(bool(opt.get_step_factor().item() == 0.0))
  return decisions


def _our_skips(cfg, losses, grad_norms, empty_at=None):
  """Our decisions; the window emptied before step index `empty_at` (a restart, EMPTY)."""
  @jax.jit
  def step(stats, values):
    skip = optim.should_skip(cfg, stats, *values)
    return optim.record(cfg, stats, *values, skip), skip

  stats = optim.init_skip_stats(cfg)
  decisions = []
  for i, values in enumerate(zip(losses, grad_norms)):
    if i == empty_at:
      stats = optim.empty_window(cfg, stats)
    stats, skip = step(stats, np.asarray(values, np.float32))
    decisions.append(bool(skip))
  return decisions


@pytest.mark.parametrize("window", [128, 16])
def test_skip_decisions_equal_skip_step_adamw(window):
  """Recorded-style sequences: noisy decreasing loss and grad norm, isolated spikes in either,
  spikes before the window is long enough, and a lasting upward shift (AI2's window takes the
  skipped values in, so skipping stops once the shift is the new normal)."""
  cfg = OptimizerConfig(spike_window=window, spike_min_history=max(2, window // 2))
  rng = np.random.default_rng(window)
  n = 5 * window
  losses = (3.0 - np.linspace(0, 0.5, n) + 0.01 * rng.standard_normal(n)).astype(np.float32)
  norms = (0.8 + 0.05 * rng.standard_normal(n)).astype(np.float32)
  early, loss_spike, norm_spike, shift = 5, window + 8, 2 * window + 8, 3 * window + 8
  losses[[early, loss_spike]] += 3.0
  norms[norm_spike] *= 10
  losses[shift:] += 1.0  # a lasting shift
  ours = _our_skips(cfg, losses, norms)
  theirs = _olmo_core_skips(losses, norms, window)
  assert ours == theirs
  # The rule is exercised: too early at first, then each spike, then the shift until it is the
  # new normal.
  assert not theirs[early] and theirs[loss_spike] and theirs[norm_spike] and theirs[shift]
  assert not all(theirs[shift:])


def test_an_emptied_window_decides_as_the_skip_step_adamw_of_a_restarted_run():
  """OLMo-core restarted builds a new SkipStepAdamW, whose window (lists on the object, in no
  state dict) starts empty: nothing is skipped until 8 values (window 16) have been seen since
  the restart. Emptied at the restart, ours decides as that new object: the spike 3 steps
  after the restart is trained on, the one 22 steps after skipped; the run that never stopped
  skips both."""
  cfg = OptimizerConfig(spike_window=16, spike_min_history=8)
  rng = np.random.default_rng(1)
  losses = (3.0 - np.linspace(0, 0.3, 80) + 0.01 * rng.standard_normal(80)).astype(np.float32)
  norms = (0.8 + 0.05 * rng.standard_normal(80)).astype(np.float32)
  restart, early, late = 40, 43, 62  # (late: once the early spike has left the window)
  losses[[20, early, late]] += 3.0
  restarted = (_olmo_core_skips(losses[:restart], norms[:restart], 16) +
               _olmo_core_skips(losses[restart:], norms[restart:], 16))
  assert _our_skips(cfg, losses, norms, empty_at=restart) == restarted
  assert [i for i, s in enumerate(restarted) if s] == [20, late]
  assert [i for i, s in enumerate(_olmo_core_skips(losses, norms, 16)) if s] == [20, early, late]
  stats = optim.SkipStats(np.ones((2, 16), np.float32), np.int32(50), np.int32(2), np.int32(5))
  emptied = optim.empty_window(cfg, stats)
  assert int(emptied.recorded) == 0 and not emptied.history.any()
  assert (int(emptied.consecutive), int(emptied.skipped)) == (2, 5)  # the counters carry on


def test_non_finite_steps_are_skipped_and_kept_out_of_the_window():
  cfg = OptimizerConfig(spike_window=16, spike_min_history=8)
  losses = np.full(40, 2.0, np.float32) + np.linspace(0, 0.01, 40, dtype=np.float32)
  norms = np.ones(40, np.float32)
  losses[3], norms[20] = np.nan, np.inf
  ours = _our_skips(cfg, losses, norms)
  assert [i for i, s in enumerate(ours) if s] == [3, 20]  # and nothing after them


def test_updates_are_skipstepadamws_to_float64_rounding():
  """Three updates (clipped, decayed but for the embedding) in float64, beside OLMo-core's
  foreach AdamW kernel and torch's clipping as its train module calls them, with float64 step
  counts: equal to 1e-15, which needs every float32 product OLMo-core's step factor makes (the
  moments' weights, the weight-decay factor) rounded alike (float64 ones are 1e-12 apart)."""
  from olmo_core.optim.adamw import foreach_adamw_step

  cfg = OptimizerConfig(weight_decay=0.1, clip_grad_norm=1.0)
  rng = np.random.default_rng(0)
  shapes = {"embed_tokens": (7, 3), "lm_head": (3, 7), "norm": (3,)}
  start = {k: rng.normal(size=s) for k, s in shapes.items()}
  grads = [{k: rng.normal(size=s) for k, s in shapes.items()} for _ in range(3)]
  lrs = [1e-4, 2e-4, 3e-4]
  with jax.enable_x64(True):
    params = {k: {"w": jax.numpy.asarray(v)} for k, v in start.items()}
    tx = optim.adamw(cfg, params)
    state = tx.init(params)
    update = jax.jit(lambda g, state, params, lr: tx.update(g, state, params, lr=lr))
    for g, lr in zip(grads, lrs):
      updates, state = update({k: {"w": jax.numpy.asarray(v)} for k, v in g.items()}, state,
                              params, jax.numpy.asarray(lr))
      params = jax.tree.map(lambda p, u: p + u, params, updates)
  theirs = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in start.items()}
  moments = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in theirs.items()}
  steps = {k: torch.zeros((), dtype=torch.float64) for k in theirs}
  with torch.no_grad():
    for g, lr in zip(grads, lrs):
      for k, p in theirs.items():
        p.grad = torch.tensor(g[k])
      norm = torch.nn.utils.get_total_norm([p.grad for p in theirs.values()])
      torch.nn.utils.clip_grads_with_norm_(list(theirs.values()), 1.0, norm)
      for group, decay in ((["embed_tokens"], 0.0), (["lm_head", "norm"], 0.1)):
        foreach_adamw_step([theirs[k] for k in group], [theirs[k].grad for k in group],
                           [moments[k][0] for k in group], [moments[k][1] for k in group],
                           [steps[k] for k in group], lr=lr, betas=(0.9, 0.95), eps=1e-8,
                           weight_decay=decay, step_factor=torch.tensor(1.0))
  for k in shapes:
    np.testing.assert_allclose(np.asarray(params[k]["w"]), theirs[k].detach().numpy(), rtol=0,
                               atol=1e-15)
