"""AdamW, clipping and the learning-rate schedules of OLMo 3 (docs/recipe.md).

The learning rate is a function of the run's own step, applied outside the optax state: Adam's
count (its bias correction) travels with the moments, so stage 2 can load stage 1's moments and
keep their bias correction while its step and schedule start from zero, as OLMo-core does.
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
  Float32 (OLMo-core computes in float64; they agree to float32 rounding)."""
  t = jnp.asarray(update, jnp.float32)
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


def adamw(cfg: OptimizerConfig, params: Any) -> optax.GradientTransformation:
  """Clip by global norm, Adam, decoupled weight decay; the caller multiplies by the LR."""
  return optax.chain(
      optax.clip_by_global_norm(cfg.clip_grad_norm),
      optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
      optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask(cfg, params)),
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
