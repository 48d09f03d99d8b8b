"""The evaluator training and `python -m olmo3.eval` share: held-out loss per set and
downstream task scores of a parameter tree, on a ShardedModel's mesh.

Tasks are loaded when the evaluator is built, so a bad task stops a run at startup; held-out
sets are read on first use.
Evaluation batches are built alike on every process; each process puts its own rows on its
devices through the same path training batches take (`HostRows`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from absl import logging

from olmo3 import loss
from olmo3.config import Experiment
from olmo3.data import pipeline, sources
from olmo3.data.heldout import HeldoutDocs
from olmo3.eval import heldout as heldout_lib
from olmo3.eval import tasks as tasks_lib
from olmo3.sharded import ShardedModel

TASK_METRICS = ("acc_raw", "acc_per_char", "bpb")  # what training logs of each task


class Evaluator:
  def __init__(self, exp: Experiment, model: ShardedModel):
    self.exp, self.model = exp, model
    cfg = exp.eval
    pipeline.check_divisible(cfg.batch_size, model.batch_sharding, "EvalConfig.batch_size")
    self.rows = pipeline.HostRows.of(model.batch_sharding, cfg.batch_size, exp.data.seq_len)

    def summed_nll(params, batch):
      return loss.summed_nll(model.apply(params, batch["input_ids"]), batch["labels"])

    def row_logprob(params, batch):
      return loss.row_logprob(model.apply(params, batch["input_ids"]), batch["labels"])

    # Replicated outputs: every process can read them (a batch-sharded [B] result is not
    # addressable from one process when the job spans several).
    self._summed_nll = jax.jit(summed_nll, out_shardings=model.replicated)
    self._row_logprob = jax.jit(row_logprob, out_shardings=model.replicated)
    if cfg.tasks:  # a misspelt task or a broken file stops the run here, not at the first eval
      _ = self.tasks

  @functools.cached_property
  def heldout(self) -> dict[str, HeldoutDocs]:
    exp = self.exp
    return {name: HeldoutDocs(sources.read_mix(mix), exp.data.seq_len, exp.model.eos_token_id,
                              exp.model.pad_token_id, exp.eval.max_documents)
            for name, mix in exp.eval.heldout}

  @functools.cached_property
  def tasks(self) -> list[tasks_lib.Task]:
    """The configured tasks; none (with a warning) when the `eval` extra is not installed. Any
    other problem (an unknown task, a missing or malformed file) raises TaskError."""
    cfg = self.exp.eval
    try:
      return [tasks_lib.load_task(spec, cfg.tasks_dir, cfg.task_limit) for spec in cfg.tasks]
    except tasks_lib.TasksUnavailable as e:
      logging.warning("downstream tasks skipped (held-out loss still runs): %s", e)
      return []

  @functools.cached_property
  def tokenizer(self):
    return sources.load_tokenizer(self.exp.eval.tokenizer)

  def _put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return self.rows.to_global(self.rows.take(batch))

  def heldout_metrics(self, params: Any) -> dict[str, dict[str, float]]:
    """{set: {ce_loss, ppl, tokens}}."""
    with self.model.context():
      return {name: heldout_lib.evaluate(lambda b: self._summed_nll(params, self._put(b)), docs,
                                         self.exp.eval.batch_size, self.exp.train.eval_batches)
              for name, docs in self.heldout.items()}

  def task_metrics(self, params: Any) -> dict[str, dict]:
    """{task: {metric, value, examples, acc_raw, acc_per_char, bpb}}."""
    if not self.tasks:
      return {}
    exp = self.exp
    with self.model.context():
      return tasks_lib.evaluate(
          self.tasks, self.tokenizer, exp.data.seq_len, exp.eval.batch_size,
          exp.model.eos_token_id, lambda b: np.asarray(self._row_logprob(params, self._put(b))))

  def evaluate(self, params: Any) -> dict[str, float]:
    """Held-out CE/PPL per set and downstream task metrics, as flat metric names
    (eval/<set>/ce_loss, eval/<set>/ppl, downstream/<task>/<metric>)."""
    out = {}
    for name, result in self.heldout_metrics(params).items():
      out.update({f"eval/{name}/{k}": v for k, v in result.items() if k != "tokens"})
    for name, result in self.task_metrics(params).items():
      out.update({f"downstream/{name}/{k}": v for k, v in result.items() if k in TASK_METRICS})
    return out
