"""The evaluator training and `python -m olmo3.eval` share: held-out loss per set (one document
per instance, padding masked: OLMo's perplexity sets) and downstream task scores of a parameter
tree, on a ShardedModel's mesh.

Tasks are prepared and held-out sets opened when the evaluator is built, so a bad task, a
tokenizer that cannot load or a missing held-out file stops a run at startup.
Evaluation batches are built alike on every process; each process puts its own rows on its
devices through the same path training batches take (`HostRows`), and every result comes back
replicated, so each process computes the same metrics.

Held-out documents and task requests are scored by the same jitted function (each row's summed
log-probability of its labels) at a few padded lengths (`tasks.bucket_lengths`): items are
sorted by length and each batch runs at the shortest length that holds its longest item, so a
short document or request is not padded to seq_len, and the programs compiled for one are
reused by the other. Every batch of an evaluation is dispatched before any result is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from olmo3 import loss
from olmo3.config import Experiment
from olmo3.data import embedded, pipeline, sources
from olmo3.data import tokenizer as tokenizer_lib
from olmo3.data.heldout import HeldoutDocs, scored_sets
from olmo3.eval import tasks as tasks_lib
from olmo3.eval.ruler import Ruler
from olmo3.placement import ShardedModel

# Warnings already given by this process: a program that builds several evaluators (`python -m
# olmo3.eval --all_steps` over checkpoints of several config revisions) says a thing once.
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
  if message not in _WARNED:
    _WARNED.add(message)
    logging.warning("%s", message)


class Stopped(Exception):
  """An evaluation given `stop` was asked to stop before it finished: nothing is scored."""


def _asked(stop: Callable[[], bool] | None) -> None:
  """Raises Stopped when `stop` says so: asked between batches, so a signal does not wait for
  a whole evaluation (every process asks at the same batches)."""
  if stop is not None and stop():
    raise Stopped


def scoring_functions(model: ShardedModel) -> tuple[Callable, Callable]:
  """The two programs every evaluation runs, jitted (ahead-of-time compilation lowers these
  too): (params, batch) -> each row's summed log-probability of its labels [B] (held-out
  documents, cloze continuations), and -> each row's log-probabilities of its choices at one
  position [B, K] (`_fast` multiple choice)."""

  def row_logprob(params, batch):
    return loss.row_logprob(model.token_losses(params, batch["input_ids"], batch["labels"]))

  def choice_logprobs(params, batch):
    return loss.choice_logprobs(
        model.logits_at(params, batch["input_ids"], batch["position"]), batch["choices"])

  # Replicated outputs: every process can read them (a batch-sharded [B] result is not
  # addressable from one process when the job spans several).
  return (jax.jit(row_logprob, out_shardings=model.replicated),
          jax.jit(choice_logprobs, out_shardings=model.replicated))


def token_logprob_function(model: ShardedModel) -> Callable:
  """(params, batch) -> each label's log-probability [B, T] (0 where masked), jitted: held-out
  documents scored per position band (eval.position_band) in place of `row_logprob`."""

  def token_logprob(params, batch):
    return -model.token_losses(params, batch["input_ids"], batch["labels"]).nll_BT

  return jax.jit(token_logprob, out_shardings=model.replicated)


def band_name(start: int, end: int) -> str:
  """The metric suffix of a position band: ce_loss_pos<start>_<end> (predicted tokens at
  positions start..end-1 of their document)."""
  return f"ce_loss_pos{start}_{end}"


class Evaluator:
  def __init__(self, exp: Experiment, model: ShardedModel,
               heldout: Mapping[str, Sequence[str]] | None = None):
    """`heldout`: {set: token files}, as a RunPlan lists them (default: read from the
    experiment's held-out mixes, `sources.heldout_sets`)."""
    self.exp, self.model = exp, model
    cfg = exp.eval
    pipeline.check_divisible(cfg.batch_size, model.batch_sharding, "EvalConfig.batch_size")

    self._row_logprob, self._choice_logprobs = scoring_functions(model)
    if heldout is None:
      heldout = sources.heldout_sets(exp)
    self._token_logprob = token_logprob_function(model) if cfg.position_band else None
    self.heldout = scored_sets(exp, heldout)
    self.tasks = self._load_tasks()
    self.buckets = tasks_lib.bucket_lengths(exp.data.seq_len, exp.model.attention)
    self.ruler = self._load_ruler() if cfg.ruler.enabled else None

  def _load_ruler(self) -> Ruler:
    """RULER's instances, generated with the evaluation's tokenizer; the essay haystacks cut
    from the held-out documents (decoded), else from the embedded corpus."""
    tokenizer = tokenizer_lib.load(sources.tokenizer_file(self.exp.eval.tokenizer),
                                   "the run's EvalConfig.tokenizer")

    def texts():
      for docs in self.heldout.values():
        for i in range(len(docs)):
          yield tokenizer.decode(docs.document(i).tolist(), skip_special_tokens=True)
      yield from (text for _, text in embedded.documents())

    return Ruler(self.exp, self.model, tokenizer, texts)

  def _load_tasks(self) -> list[tasks_lib.Task]:
    """The configured tasks; none (with a warning) when the `eval` extra is not installed. Any
    other problem (an unknown task, a missing file, a tokenizer that cannot load) raises
    TaskError here, at startup."""
    try:
      return tasks_lib.experiment_tasks(self.exp)
    except tasks_lib.TasksUnavailable as e:
      _warn_once(f"downstream tasks skipped (held-out loss still runs): {e}")
      return []

  def shapes(self) -> list[tuple[Callable, dict[str, np.ndarray]]]:
    """Each program an evaluation runs, with a host batch of the shape it runs it at (zeros:
    the shapes are what matter), one per distinct (program, shape): the batches `evaluate`
    builds, planned as it plans them."""
    size, cap = self.exp.eval.batch_size, self.exp.train.eval_batches
    heldout = self._row_logprob if self._token_logprob is None else self._token_logprob
    programs = (heldout, self._row_logprob, self._choice_logprobs)
    shapes = set()  # (program's index, length, choices)
    for docs in self.heldout.values():
      for _, length in tasks_lib.plan(docs.lengths[:None if cap is None else cap * size],
                                      self.buckets, size):
        shapes.add((programs.index(heldout), length, 0))
    requests = [r for task in self.tasks for r in task.requests]
    for fast in (False, True):
      kind = [r for r in requests if (r.choices is not None) == fast]
      k = max((len(r.choices) for r in kind), default=0) if fast else 0
      for _, length in tasks_lib.plan([len(r.query) for r in kind], self.buckets, size):
        shapes.add((2 if fast else programs.index(self._row_logprob), length, k))
    out = []
    for program, length, k in sorted(shapes):
      batch = {"input_ids": np.zeros((size, length), np.int32)}
      if program == 2:
        batch["position"] = np.zeros(size, np.int32)
        batch["choices"] = np.zeros((size, k), np.int32)
      else:
        batch["labels"] = np.zeros((size, length), np.int32)
      out.append((programs[program], batch))
    return out

  def compile_ahead(self, params: Any, stop: Callable[[], bool] | None = None) -> None:
    """Compiles every program an evaluation of parameters shaped and sharded as `params`
    (arrays or jax.ShapeDtypeStruct) runs, each at each of its shapes, so that evaluating
    runs them without compiling (a training loop calls this in a thread while a single-threaded
    phase of its startup leaves a core idle). `stop()` is asked before each compile."""
    with self.model.context():
      for fn, batch in self.shapes():
        if stop is not None and stop():
          return
        fn.lower(params, self._put(batch)).compile()

  def _put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    rows = pipeline.HostRows.of(self.model.batch_sharding, *batch["input_ids"].shape)
    return rows.to_global(rows.take(batch))

  def heldout_metrics(self, params: Any, stop: Callable[[], bool] | None = None
                      ) -> dict[str, dict[str, float]]:
    """{set: {ce_loss, ppl, tokens, documents, documents_left_out}}: token-mean cross-entropy
    and perplexity over each set (or its first train.eval_batches x eval.batch_size
    documents), the tokens predicted (CE's divisor), the documents scored and those of the
    set's files not scored (eval.min_document_tokens, eval.max_documents, train.eval_batches):
    what `compare` needs to restate CE in OLMo-core's definition (ce_definitions.py); with
    eval.position_band, also the CE of each band of positions (`band_name`). Raises Stopped
    when `stop()` says so before a batch."""
    with self.model.context():
      return {name: self._heldout(params, docs, stop) for name, docs in self.heldout.items()}

  def _heldout(self, params: Any, docs: HeldoutDocs, stop: Callable[[], bool] | None
               ) -> dict[str, float]:
    size, cap = self.exp.eval.batch_size, self.exp.train.eval_batches
    # eval_batches caps the documents (the first cap x batch_size), which are then bucketed.
    lengths = docs.lengths[:None if cap is None else cap * size]
    pending, count, masks = [], 0, []
    score = self._row_logprob if self._token_logprob is None else self._token_logprob
    for indices, length in tasks_lib.plan(lengths, self.buckets, size):
      _asked(stop)
      batch = docs.rows(indices, length, size)
      count += int((batch["labels"] >= 0).sum())
      if self._token_logprob is not None:  # the bands count their tokens by position
        masks.append(batch["labels"] >= 0)
      pending.append(score(params, self._put(batch)))
    # Sums added up on the host in float64, whatever the number of batches.
    ce = -sum(np.asarray(p, np.float64).sum() for p in pending) / max(count, 1)
    out = {"ce_loss": ce, "ppl": math.exp(min(ce, 700.0)), "tokens": float(count),
           "documents": float(len(lengths)),
           "documents_left_out": float(docs.file_documents - len(lengths))}
    if self._token_logprob is not None:
      out.update(_banded(pending, masks, self.exp.eval.position_band, self.exp.data.seq_len))
    return out

  def task_metrics(self, params: Any, stop: Callable[[], bool] | None = None
                   ) -> dict[str, dict]:
    """{task: {metric: value (OLMo-core's names), "docs": documents scored}}. Raises Stopped
    when `stop()` says so before a batch."""
    if not self.tasks:
      return {}
    exp = self.exp

    def row_logprob(batch):
      _asked(stop)
      return self._row_logprob(params, self._put(batch))

    def choice_logprobs(batch):
      _asked(stop)
      return self._choice_logprobs(params, self._put(batch))

    with self.model.context():
      return tasks_lib.evaluate(self.tasks, self.buckets, exp.eval.batch_size,
                                exp.model.pad_token_id, row_logprob, choice_logprobs)

  def ruler_metrics(self, params: Any, stop: Callable[[], bool] | None = None
                    ) -> dict[str, float]:
    """RULER's scores (olmo3.eval.ruler: ruler/<task>/<length>, ruler/mean/<length>); {} when
    eval.ruler is off. Raises Stopped when `stop()` says so before a length."""
    if self.ruler is None:
      return {}
    scores = self.ruler.score(params, stop)
    if scores is None:
      raise Stopped
    return scores

  def score(self, params: Any, stop: Callable[[], bool] | None = None) -> dict[str, dict]:
    """{"heldout": {set: metrics}, "tasks": {task: metrics}, "ruler": {name: score},
    "metrics": all under the names a run logs them by (`logged_names`)}: what `python -m
    olmo3.eval` reports for a step."""
    heldout, tasks = self.heldout_metrics(params, stop), self.task_metrics(params, stop)
    ruler = self.ruler_metrics(params, stop)
    return {"heldout": heldout, "tasks": tasks, "ruler": ruler,
            "metrics": {**logged_names(heldout, tasks), **ruler}}

  def evaluate(self, params: Any, stop: Callable[[], bool] | None = None) -> dict[str, float]:
    """Held-out metrics per set and downstream task metrics, as flat metric names
    (eval/<set>/ce_loss, eval/<set>/ppl, eval/<set>/tokens, ..., downstream/<task>/<metric>).
    `stop` is asked before each batch: when it says so, Stopped is raised and nothing is
    scored."""
    out = self.score(params, stop)["metrics"]
    if jax.process_count() > 1:
      _check_same_on_every_process(out)
    return out


def logged_names(heldout: dict[str, dict[str, float]], tasks: dict[str, dict[str, float]]
                 ) -> dict[str, float]:
  """Held-out and task results under the names a run logs them by: eval/<set>/<metric> and
  downstream/<task>/<metric> (a task's document count is not a metric). The one naming: the
  loop logs these and `python -m olmo3.eval`'s report holds them, so the two compare by key."""
  out = {f"eval/{name}/{k}": v for name, result in heldout.items() for k, v in result.items()}
  out.update({f"downstream/{name}/{k}": v for name, result in tasks.items()
              for k, v in result.items() if k != "docs"})
  return out


def _banded(logprobs: list[jax.Array], masks: list[np.ndarray], band: int, seq_len: int
            ) -> dict[str, float]:
  """The CE of each band of `band` positions of the predicted token (the label at column t is
  the token at position t + 1), for the bands up to seq_len that hold any token."""
  bands = -(-seq_len // band)
  sums, counts = np.zeros(bands), np.zeros(bands)
  for logprob, mask in zip(logprobs, masks):
    which = np.minimum((np.arange(mask.shape[1]) + 1) // band, bands - 1)
    np.add.at(sums, which, -np.asarray(logprob, np.float64).sum(axis=0))
    np.add.at(counts, which, mask.sum(axis=0))
  return {band_name(b * band, min((b + 1) * band, seq_len)): sums[b] / counts[b]
          for b in range(bands) if counts[b]}


def _check_same_on_every_process(metrics: dict[str, float]) -> None:
  """Every process computes every metric from the same replicated outputs; a difference means
  a process scored other rows or other parameters, so it stops the run instead of logging
  process 0's view. Bit-exact: the float64 values travel as int32 pairs (JAX would round
  float64 to float32)."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  names = sorted(metrics)
  mine = np.array([metrics[k] for k in names], np.float64)
  first = np.asarray(multihost_utils.broadcast_one_to_all(mine.view(np.int32))).view(np.float64)
  differ = [n for n, a, b in zip(names, mine, first) if not (a == b or (a != a and b != b))]
  if differ:
    raise RuntimeError(f"process {jax.process_index()} evaluated {len(differ)} metrics "
                       f"differently from process 0, e.g. {differ[0]}: "
                       f"{metrics[differ[0]]} vs {first[names.index(differ[0])]}")
