"""Held-out LM loss on named sets (one document per instance, padding masked), sharded on the
training mesh: token-mean cross-entropy and perplexity per set."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from olmo3.data.heldout import HeldoutDocs


def make_eval_step(apply: Callable[[object, jax.Array], jax.Array]):
  """(params, batch) -> (summed token CE, token count), jitted by the caller."""

  def step(params, batch):
    logits = apply(params, batch["input_ids"]).astype(jnp.float32)
    labels = batch["labels"]
    mask = labels >= 0
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(mask, lse - target, 0.0).sum(), mask.sum()

  return step


def make_logprob_step(apply: Callable[[object, jax.Array], jax.Array]):
  """(params, batch) -> each row's summed log-probability of its labels [B] (float32)."""

  def step(params, batch):
    logits = apply(params, batch["input_ids"]).astype(jnp.float32)
    labels = batch["labels"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(labels >= 0, target, 0.0).sum(axis=-1)

  return step


def evaluate(eval_step, params, docs: HeldoutDocs, batch_size: int,
             put: Callable[[dict[str, np.ndarray]], dict[str, jax.Array]],
             max_batches: int | None = None) -> dict[str, float]:
  """Token-mean CE and perplexity over the set (or its first `max_batches` batches)."""
  total, count = 0.0, 0
  for i, batch in enumerate(docs.batches(batch_size)):
    if max_batches is not None and i >= max_batches:
      break
    ce, n = eval_step(params, put(batch))
    total += float(ce)
    count += int(n)
  ce = total / max(count, 1)
  return {"ce_loss": ce, "ppl": math.exp(min(ce, 700.0)), "tokens": float(count)}
