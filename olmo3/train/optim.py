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
  return final + (peak - final) * 0.5 * (1 + jnp.cos(math.pi * jnp.clip(progress, 0.0, 1.0)))


def learning_rate(cfg: OptimizerConfig, step: jax.Array | int) -> jax.Array:
  """The learning rate at `step` (from 0)."""
  t = jnp.asarray(step, jnp.float32)
  peak, final, warmup = cfg.peak_lr, cfg.final_lr, cfg.warmup_steps
  warm = peak * t / max(warmup, 1)
  match cfg.schedule:
    case Schedule.COSINE:
      after = _cosine((t - warmup) / (cfg.decay_steps - warmup), peak, final)
    case Schedule.LINEAR:
      progress = jnp.clip((t - warmup) / (cfg.decay_steps - warmup), 0.0, 1.0)
      after = peak + (final - peak) * progress
    case Schedule.STITCHED_COSINE:
      # The first cosine (aimed at stitch_first_steps) until stitch_at, where it stands at its
      # midpoint; then the second half of a cosine aimed at stitch_second_steps.
      first = _cosine((t - warmup) / (cfg.stitch_first_steps - warmup), peak, final)
      second = _cosine(0.5 + 0.5 * (t - cfg.stitch_at) / (cfg.stitch_second_steps - cfg.stitch_at),
                       peak, final)
      after = jnp.where(t < cfg.stitch_at, first, second)
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
  """Recent accepted steps' loss and gradient norm, and the skip counters."""

  history: jax.Array  # [2, window] float32 (loss, grad norm), a ring buffer
  recorded: jax.Array  # int32: accepted steps recorded so far
  consecutive: jax.Array  # int32: skipped steps in a row
  skipped: jax.Array  # int32: skipped steps in this stage


def init_skip_stats(cfg: OptimizerConfig) -> SkipStats:
  # Distinct arrays: the train step donates its state, and aliased leaves would be freed twice.
  return SkipStats(np.zeros((2, cfg.spike_window), np.float32), np.zeros((), np.int32),
                   np.zeros((), np.int32), np.zeros((), np.int32))


def should_skip(cfg: OptimizerConfig, stats: SkipStats, loss, grad_norm) -> jax.Array:
  """True for a non-finite loss or gradient, or (skip_spikes) a > spike_sigma·σ spike."""
  values = jnp.stack([loss, grad_norm]).astype(jnp.float32)
  skip = ~jnp.isfinite(values).all()
  if cfg.skip_spikes:
    n = jnp.minimum(stats.recorded, cfg.spike_window)
    valid = jnp.arange(cfg.spike_window) < n
    count = jnp.maximum(n, 1).astype(jnp.float32)
    mean = jnp.where(valid, stats.history, 0.0).sum(-1) / count
    var = jnp.where(valid, jnp.square(stats.history - mean[:, None]), 0.0).sum(-1) / count
    spike = (values > mean + cfg.spike_sigma * jnp.sqrt(var)).any()
    skip |= spike & (n >= cfg.spike_min_history)
  return skip


def record(cfg: OptimizerConfig, stats: SkipStats, loss, grad_norm, skip) -> SkipStats:
  values = jnp.stack([loss, grad_norm]).astype(jnp.float32)
  slot = stats.recorded % cfg.spike_window
  history = jnp.where(skip, stats.history, stats.history.at[:, slot].set(values))
  return SkipStats(history, stats.recorded + jnp.where(skip, 0, 1).astype(jnp.int32),
                   jnp.where(skip, stats.consecutive + 1, 0).astype(jnp.int32),
                   stats.skipped + skip.astype(jnp.int32))
