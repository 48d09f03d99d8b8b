"""The repetition filter: instances that repeat a short pattern many times
(docs/data.md#repetition-filter).

Same decisions as OLMo-core's `find_periodic_sequences` instance filter. For each period p,
the instance is cut into rows of p tokens (the last row padded with a sentinel) and each row is
compared with the one before it; a run of whole equal rows, extended by the equal tokens at the
end of the row before it and at the start of the row after it, is a repetition of
(extent // p) times. Runs of fewer than 3 are not reported (the row alignment cannot measure
them). An instance with any run of >= max_count repetitions gets all its labels masked; it
keeps its place in the batch so the order is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from olmo3.config import RepetitionFilter


class Repetition(NamedTuple):
  start: int
  end: int  # exclusive
  period: int
  times: int


def _leading_true(row: np.ndarray) -> int:
  """Number of True values at the start of `row`."""
  return len(row) if row.all() else int(np.argmin(row))


def repetitions(tokens: np.ndarray, max_period: int, min_period: int = 1
                ) -> Iterator[Repetition]:
  """Every periodic run of >= 3 repetitions with a period in [min_period, max_period]."""
  tokens = np.asarray(tokens, np.int64)
  n = len(tokens)
  for period in range(min_period, min(max_period, n // 3) + 1):
    rows = np.concatenate([tokens, np.full(period - n % period, -1)]).reshape(-1, period)
    same = rows == np.roll(rows, 1, axis=0)  # same[k]: row k vs row k-1 (row 0 vs the pad row)
    full = np.flatnonzero(same.all(axis=1))
    if not len(full):
      continue
    breaks = np.flatnonzero(np.diff(full) != 1) + 1
    for run in np.split(full, breaks):
      first, last = int(run[0]), int(run[-1])
      before = _leading_true(same[first - 1][::-1])  # equal tokens ending the row before
      before = before if before < period else 0
      after = _leading_true(same[last + 1])
      start = (first - 1) * period - before
      end = (last + 1) * period + after
      times = (end - start) // period
      if times > 2:
        yield Repetition(start, end, period, times)


def is_repetitive(tokens: np.ndarray, cfg: RepetitionFilter) -> bool:
  """True when the instance should have all its labels masked."""
  return any(r.times >= cfg.max_count
             for r in repetitions(tokens, cfg.max_period, cfg.min_period))
