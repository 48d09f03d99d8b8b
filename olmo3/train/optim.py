"""AdamW, clipping and the learning-rate schedules of OLMo 3 (docs/recipe.md).

The learning rate is a function of the run's own step, kept out of the optax state (each update
takes it as an argument): Adam's count (its bias correction) travels with the moments, so stage
2 can load stage 1's moments and keep their bias correction while its step and schedule start
from zero, as OLMo-core does.

The update's arithmetic is OLMo-core's (`SkipStepAdamW` with its default foreach kernels, and
torch's clipping as its train module calls it), scalar by scalar: the moments' weights and the
weight-decay factor are products with its float32 step factor, so float32 numbers whatever the
parameters' dtype; the bias corrections and the step size are in the parameters' dtype (in
OLMo-core its step count's: float32, which its float64 parity run starts in float64,
benchmarks/train_parity_olmo_core.py says why). In float32 that is what any AdamW computes, to
rounding; a float64 run agrees with OLMo-core's far below float32 rounding only because those
scalars are rounded to float32 where OLMo-core rounds them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from olmo3.config import OptimizerConfig, Schedule


def _cosine(progress, peak: float, final: float):
  # (1 + cos(pi p)) / 2 written as cos(pi p / 2)^2: no cancellation near the end in float32.
  return final + (peak - final) * jnp.square(jnp.cos(0.5 * math.pi * jnp.clip(progress, 0.0, 1.0)))


def learning_rate(cfg: OptimizerConfig, update: jax.Array | int) -> jax.Array:
  """The learning rate of the `update`-th update (1 for the first), as OLMo-core's scheduler
  gives it: OLMo-core advances its step counter before each update, so the first update of a
  warmup already uses peak/warmup_steps and a linear decay's last update uses final_lr.
  Float32, or float64 under jax_enable_x64 (OLMo-core computes in float64; in float32 they agree
  to float32 rounding)."""
  t = jnp.asarray(update, jax.dtypes.canonicalize_dtype(jnp.float64))
  peak, final, warmup = cfg.peak_lr, cfg.final_lr, cfg.warmup_steps
  warm = peak * t / max(warmup, 1)
  match cfg.schedule:
    case Schedule.COSINE:
      after = _cosine((t - warmup) / (cfg.decay_steps - warmup), peak, final)
    case Schedule.LINEAR:
      # The fraction still to go, from integers: exact where the LR nears final_lr.
      remaining = jnp.clip((cfg.decay_steps - t) / (cfg.decay_steps - warmup), 0.0, 1.0)
      after = final + (peak - final) * remaining
    case Schedule.STITCHED_COSINE:
      # Part 1 (AI2's first script): the cosine aimed at stitch_first_steps. Part 2 (the second
      # script, from the update after stitch_resumed_at): a linear ramp towards the midpoint
      # LR until stitch_at, then the second half of a cosine aimed at stitch_second_steps.
      first = _cosine((t - warmup) / (cfg.stitch_first_steps - warmup), peak, final)
      midpoint = final + (peak - final) / 2
      ramp = midpoint * t / cfg.stitch_at
      span = cfg.stitch_second_steps - cfg.stitch_at
      second = _cosine((t - cfg.stitch_at + span) / (2 * span), peak, final)
      after = jnp.where(t <= cfg.stitch_resumed_at, first,
                        jnp.where(t < cfg.stitch_at, ramp, second))
    case _:
      raise ValueError(f"unknown schedule {cfg.schedule!r}")
  return jnp.where(t < warmup, warm, after)


def decay_mask(cfg: OptimizerConfig, params: Any) -> Any:
  """True for parameters that get weight decay: all but the top-level groups in `no_decay`."""
  return {k: jax.tree.map(lambda _: k not in cfg.no_decay, v) for k, v in params.items()}


def _f32(x: Any) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """Gradients times min(1, max_norm / (norm + 1e-6)): torch's clip_grads_with_norm_, which
  OLMo-core's train module calls (optax's clip divides by the norm alone, ~1e-6/norm apart)."""

  def update(grads, state, params=None):
    del params
    factor = jnp.minimum(max_norm / (optax.global_norm(grads) + 1e-6), 1.0)
    return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def _scale_by_adam(cfg: OptimizerConfig) -> optax.GradientTransformationExtraArgs:
  """lr / (1 - b1^t) · m / (sqrt(v) / sqrt(1 - b2^t) + eps) at t = count + 1, as SkipStepAdamW's
  foreach kernel computes it: m ← m·(1 - w1) + g·w1 with w1 = 1 - b1 in float32 (so 1 - w1 is
  b1 rounded to float32), likewise v; the bias corrections and the step size 1/(1 - b1^t) · lr
  (torch's `lr / tensor` is `tensor.reciprocal() * lr`) in the parameters' dtype."""
  w1, w2 = _f32(1 - cfg.b1), _f32(1 - cfg.b2)

  def step(m: jax.Array, v: jax.Array, count: jax.Array, lr: jax.Array) -> jax.Array:
    t = (count + 1).astype(m.dtype)
    step_size = (1 / (1 - cfg.b1 ** t)) * jnp.asarray(lr, m.dtype)
    return step_size * (m / (jnp.sqrt(v) / jnp.sqrt(1 - cfg.b2 ** t) + cfg.eps))

  def init(params):
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                  mu=optax.tree_utils.tree_zeros_like(params),
                                  nu=optax.tree_utils.tree_zeros_like(params))

  def update(grads, state, params=None, *, lr, **extra_args):
    del params, extra_args
    mu = jax.tree.map(lambda m, g: m * (1 - w1) + g * w1, state.mu, grads)
    nu = jax.tree.map(lambda v, g: v * (1 - w2) + g * g * w2, state.nu, grads)
    steps = jax.tree.map(lambda m, v: step(m, v, state.count, lr), mu, nu)
    return steps, optax.ScaleByAdamState(optax.safe_increment(state.count), mu, nu)

  return optax.GradientTransformationExtraArgs(init, update)


def _decay(weight_decay: float) -> optax.GradientTransformationExtraArgs:
  """Adds p·(1 - f), f = 1 - lr·wd in float32: SkipStepAdamW's p ← p·f (1 - f is exact)."""

  def update(updates, state, params, *, lr, **extra_args):
    del extra_args
    shrink = 1 - (1 - _f32(lr * weight_decay))
    return jax.tree.map(lambda u, p: u + p * shrink, updates, params), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def adamw(cfg: OptimizerConfig, params: Any) -> optax.GradientTransformationExtraArgs:
  """Clip by global norm, Adam, decoupled weight decay, minus: `tx.update(grads, state, params,
  lr=lr)` gives the parameters' change. The state's layout is optax's chain of clip_by_global_norm,
  scale_by_adam, masked add_decayed_weights and scale (checkpoints hold it)."""
  return optax.chain(
      clip_by_global_norm(cfg.clip_grad_norm),
      _scale_by_adam(cfg),
      optax.masked(_decay(cfg.weight_decay), decay_mask(cfg, params)),
      optax.scale(-1.0),
  )


class SkipStats(NamedTuple):
  """The last spike_window steps' CE loss and gradient norm, and the skip counters."""

  history: jax.Array  # [2, window] float32 (CE loss, grad norm), a ring buffer
  recorded: jax.Array  # int32: values recorded so far (every finite step, skipped or not)
  consecutive: jax.Array  # int32: skipped steps in a row
  skipped: jax.Array  # int32: skipped steps in this stage


def init_skip_stats(cfg: OptimizerConfig) -> SkipStats:
  # Distinct arrays: the train step donates its state, and aliased leaves would be freed twice.
  return SkipStats(np.zeros((2, cfg.spike_window), np.float32), np.zeros((), np.int32),
                   np.zeros((), np.int32), np.zeros((), np.int32))


def empty_window(cfg: OptimizerConfig, stats: SkipStats) -> SkipStats:
  """`stats` with the window emptied and the skip counters kept: a restart as OLMo-core's
  SkipStepAdamW makes one (OptimizerConfig.spike_window_on_restart=EMPTY). Its window is a list
  on the optimizer object, in no state dict, and the history its rule waits for counts the
  values since the object was built."""
  empty = init_skip_stats(cfg)
  return stats._replace(history=empty.history, recorded=empty.recorded)


def should_skip(cfg: OptimizerConfig, stats: SkipStats, ce_loss, grad_norm) -> jax.Array:
  """True for a non-finite loss or gradient norm, or (skip_spikes) when either exceeds the
  mean of the previous values in the window by more than spike_sigma unbiased standard
  deviations, once spike_min_history values exist counting this one (OLMo-core's rule)."""
  values = jnp.stack([ce_loss, grad_norm]).astype(jnp.float32)
  skip = ~jnp.isfinite(values).all()
  if cfg.skip_spikes:
    n = jnp.minimum(stats.recorded, cfg.spike_window)
    valid = jnp.arange(cfg.spike_window) < n
    mean = jnp.where(valid, stats.history, 0.0).sum(-1) / jnp.maximum(n, 1)
    var = jnp.where(valid, jnp.square(stats.history - mean[:, None]), 0.0).sum(-1) / jnp.maximum(
        n - 1, 1)
    spike = ((values - mean) > cfg.spike_sigma * jnp.sqrt(var)).any()
    skip |= spike & (n + 1 >= cfg.spike_min_history)
  return skip


def all_finite(tree: Any) -> jax.Array:
  """True when no floating-point array of `tree` holds NaN/Inf."""
  return jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)
                    if jnp.issubdtype(x.dtype, jnp.inexact)]).all()


def record(cfg: OptimizerConfig, stats: SkipStats, ce_loss, grad_norm, skip) -> SkipStats:
  """Adds this step's values to the window (skipped steps too, as OLMo-core; non-finite values
  never) and counts the skip."""
  values = jnp.stack([ce_loss, grad_norm]).astype(jnp.float32)
  finite = jnp.isfinite(values).all()
  slot = stats.recorded % cfg.spike_window
  history = jnp.where(finite, stats.history.at[:, slot].set(values), stats.history)
  return SkipStats(history, stats.recorded + finite.astype(jnp.int32),
                   jnp.where(skip, stats.consecutive + 1, 0).astype(jnp.int32),
                   stats.skipped + skip.astype(jnp.int32))
