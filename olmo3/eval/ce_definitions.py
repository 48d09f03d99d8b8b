"""Held-out CE as olmo3 and OLMo-core define it, and when `compare` can state one in the other's
terms (docs/evaluation.md#held-out-ce-olmo3-and-olmo-core).

olmo3's `eval/<set>/ce_loss` is S / T: the summed CE of the set's predicted tokens over their
number. OLMo-core's LMEvaluator (`eval/lm/<set>/CE loss`; read in ai2-olmo-core 2.4.0 and
3.0.0, and run in tests/test_eval_compare.py) differs twice:
- its divisor counts one more token per document: its mask keeps each document's last
  position, whose label is past the document (ignored: a loss of 0);
- it scores only whole batches: its loader shuffles the documents of all its sets together
  (numpy's PCG64 seeded with 0 + epoch; epoch 1 in 2.6 and later, the evaluation's ordinal
  since the job started in 2.4 and earlier) and drops the last N mod B of them (N documents,
  B per evaluation batch, all ranks together).
So OLMo-core's number is S_kept / (T_kept + D_kept) over the documents it kept. olmo3 logs T
and D per set (`eval/<set>/tokens`, `eval/<set>/documents`, and `documents_left_out`, those of
the set's files it did not score), which restate ours exactly as S / (T + D) = CE × T / (T + D)
when OLMo-core kept every document of the set. When it dropped some, their losses are needed
and not logged: the two are then not comparable, and `compare` says so.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence

import numpy as np

from olmo3.eval.metric_series import Source

HELDOUT = re.compile(r"^eval/(?P<set>.+)/(?P<kind>ce_loss|ppl)$")
COUNTS = ("tokens", "documents", "documents_left_out")  # eval/<set>/<count>, olmo3's evaluator
SEED = 0  # LMEvaluator.from_numpy_dataset's default shuffle seed; its callback passes none


@dataclasses.dataclass(frozen=True)
class OlmoCoreEvaluation:
  """What decides which documents OLMo-core's LM evaluation left out."""
  batch_size: int | None = None  # documents per evaluation batch, all ranks together
  epoch: int = 1  # its loader's shuffle epoch


@dataclasses.dataclass(frozen=True)
class Restated:
  """The olmo3 side of a held-out metric, in OLMo-core's definition where that is exact."""
  values: dict[int, float]  # step -> the value to compare with OLMo-core's
  comparable: bool
  note: str  # how it was restated, or why the two are not comparable


@functools.lru_cache(maxsize=64)  # the same sets and batch at every evaluation of a run
def dropped_documents(counts: tuple[int, ...], batch_size: int, epoch: int
                      ) -> tuple[int, ...]:
  """How many documents of each set OLMo-core's LM evaluation leaves out: `counts` are the
  sets' documents in its dataset's order; it shuffles all of them and scores whole batches of
  `batch_size` only."""
  total = sum(counts)
  order = np.arange(total, dtype=np.uint32)
  np.random.Generator(np.random.PCG64(seed=SEED + epoch)).shuffle(order)
  left = order[batch_size * (total // batch_size):]
  return tuple(np.bincount(np.searchsorted(np.cumsum(counts), left, side="right"),
                           minlength=len(counts)).tolist())


def _sets(source: Source, step: int) -> set[str]:
  return {m["set"] for name, series in source.series.items()
          if (m := HELDOUT.match(name)) and step in series}


def _counts(source: Source, name: str, step: int) -> tuple[float, ...] | None:
  values = tuple(source.series.get(f"eval/{name}/{c}", {}).get(step) for c in COUNTS)
  return None if None in values else values


class _Step:
  """One step of a metric: the restated value, and why it is not comparable (None: it is)."""

  def __init__(self, metric: str, olmo3: Source, olmo_core: Source, step: int,
               evaluation: OlmoCoreEvaluation, side: str):
    match = HELDOUT.match(metric)
    name, logged = match["set"], olmo3.series[metric][step]
    counts = _counts(olmo3, name, step)
    self.value, self.why, self.how, self.as_logged = logged, None, "", counts is None
    if counts is None:
      self.why = (f"{side} logs no eval/{name}/tokens, documents and documents_left_out (runs "
                  "before olmo3 logged them): OLMo-core divides by one more token per "
                  "document, which cannot be restated without them")
      return
    tokens, documents, left_out = counts
    ce = logged if match["kind"] == "ce_loss" else math.log(logged)
    ce *= tokens / (tokens + documents)
    self.value = ce if match["kind"] == "ce_loss" else math.exp(ce)
    if left_out:
      self.why = (f"{side} scored {documents:.0f} of the set's {documents + left_out:.0f} "
                  "documents (eval.max_documents, eval.min_document_tokens or "
                  "train.eval_batches); OLMo-core scores them all")
      return
    if evaluation.batch_size is None:
      self.why = ("OLMo-core scores whole evaluation batches only, leaving out the last "
                  "partial one of its shuffled documents, so its CE depends on its evaluation "
                  "batch size: give --ai2_eval_batch_size")
      return
    names = sorted(_sets(olmo3, step) | _sets(olmo_core, step))
    everyone = {n: _counts(olmo3, n, step) for n in names}
    if missing := sorted(n for n, c in everyone.items() if c is None):
      self.why = (f"which documents OLMo-core left out depends on every set of its evaluation, "
                  f"and {side} did not score {', '.join(missing)}")
      return
    sizes = [int(c[1] + c[2]) for c in everyone.values()]
    batch, epoch = evaluation.batch_size, evaluation.epoch
    dropped = dropped_documents(tuple(sizes), batch, epoch)[names.index(name)]
    sets = f"{len(names)} set{'s' if len(names) > 1 else ''}"
    where = f"its {sum(sizes)} documents of {sets} in batches of {batch}, shuffle epoch {epoch}"
    if dropped:
      self.why = (f"OLMo-core left out {dropped} of this set's {documents:.0f} documents (the "
                  f"last partial batch of {where}), whose losses are not logged")
      return
    self.how = (f"{side} × tokens / (tokens + documents), exact: OLMo-core left out none of "
                f"this set's documents ({where})")


def restate(metric: str, olmo3: Source, olmo_core: Source, compared: Sequence[int],
            evaluation: OlmoCoreEvaluation, side: str) -> Restated | None:
  """`olmo3`'s values of `metric` in OLMo-core's definition, judged exact or not at the steps
  `compared` with `olmo_core`'s (`side`: "ours" or "the reference", for the notes); None when
  `metric` is not a held-out CE or PPL. Not comparable: the values are restated as if OLMo-core
  had left out no document (as logged where the counts are missing), and the note says why."""
  if not HELDOUT.match(metric):
    return None
  steps = sorted(olmo3.series[metric])
  every = {s: _Step(metric, olmo3, olmo_core, s, evaluation, side) for s in steps}
  values = {s: d.value for s, d in every.items()}
  done = [every[s] for s in compared]
  failed = [d for d in done if d.why is not None]
  if not failed:
    return Restated(values, True, done[-1].how)
  first = failed[0]
  note = first.why + (f" (at {len(failed)} of {len(done)} steps)" if len(failed) < len(done)
                      else "")
  raw = sum(d.as_logged for d in done)
  restated = f"{side} × tokens / (tokens + documents), as if nothing were left out"
  note += ("; |Δ| is of the values as logged" if raw == len(done) else
           f"; |Δ| is of {restated}" if not raw else
           f"; |Δ| is of the values as logged at the {raw} steps without counts, else of "
           f"{restated}")
  return Restated(values, False, note)
