"""Held-out LM loss on named sets (one document per instance, padding masked): token-mean
cross-entropy and perplexity per set, summed batch by batch on the model's mesh."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from olmo3.data.heldout import HeldoutDocs


def evaluate(summed_nll: Callable[[dict[str, np.ndarray]], tuple[float, int]], docs: HeldoutDocs,
             batch_size: int, max_batches: int | None = None) -> dict[str, float]:
  """Token-mean CE and perplexity over the set (or its first `max_batches` batches);
  `summed_nll(batch)` is a batch's (summed cross-entropy, unmasked tokens)."""
  total, count = 0.0, 0
  for i, batch in enumerate(docs.batches(batch_size)):
    if max_batches is not None and i >= max_batches:
      break
    ce, n = summed_nll(batch)
    total += float(ce)
    count += int(n)
  ce = total / max(count, 1)
  return {"ce_loss": ce, "ppl": math.exp(min(ce, 700.0)), "tokens": float(count)}
