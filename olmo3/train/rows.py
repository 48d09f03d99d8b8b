"""The loop's metric rows: each log step's scalars, its interval's per-source losses
(`train/<source>/ce_loss`, the mix's labels) and its speed (step time, tokens/s, TFLOP/s and
MFU per device of the run's mesh), written to the run's metric writers.

A log step's metrics stay on the devices until the loop fetches them: one step late (`write`
after the next step is dispatched, so the devices work while the host waits, formats and
writes) or, where the loop waits for the step anyway, at once. A crash can lose only the
pending row, of a step after the latest checkpoint, which a resumed run logs again.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import logging

from olmo3.io import metrics as metrics_lib
from olmo3.flops import peak_flops_per_device
from olmo3.run.plan import RunPlan
from olmo3.train import logs


def source_losses(names: tuple[str, ...], sums: list) -> dict[str, float]:
  """train/<source>/ce_loss: each source's token-mean CE over the steps whose (ce_sum [S],
  tokens [S]) are in `sums`; a source without tokens in them is left out."""
  ce_S, tokens_S = np.asarray(sums, np.float64).sum(axis=0)
  return {f"train/{name}/ce_loss": ce / n for name, ce, n in zip(names, ce_S, tokens_S) if n}


def open_writer(plan: RunPlan, start: int) -> metrics_lib.MetricWriter:
  """The run's writers: TensorBoard and metrics.jsonl (process 0; a resumed run's rows after
  `start` dropped), W&B beside them when the experiment turns it on."""
  main = jax.process_index() == 0
  writer = metrics_lib.create_writer(plan.workdir.root, main, resumed_at=start)
  wandb = plan.exp.wandb
  if wandb.enabled and main:
    writer = metrics_lib.MultiWriter([writer, metrics_lib.create_wandb_writer(
        plan.workdir.root, mode=wandb.mode.value, project=wandb.project, entity=wandb.entity,
        name=wandb.name, config=plan.exp.to_dict())])
  return writer


class MetricRows:
  def __init__(self, plan: RunPlan, mesh: jax.sharding.Mesh,
               writer: metrics_lib.MetricWriter, start: int):
    exp = plan.exp
    self.writer, self.end = writer, plan.end
    self.names = plan.train_files.source_names
    self.tokens_per_step = exp.tokens_per_step
    self.flops_per_step = exp.model.flops_per_token(exp.data.seq_len) * exp.tokens_per_step
    # The run's own devices: a run on part of a machine's devices is not diluted by the rest.
    self.devices = mesh.devices.size
    self.peak = peak_flops_per_device(mesh.devices.flat[0].device_kind)
    # Each step's per-source (ce_sum [S], tokens [S]) since the last row, on the devices.
    self.per_source: list[tuple[jax.Array, jax.Array]] = []
    # (step, metrics, its interval's per-source sums) of a row not fetched yet.
    self.pending: tuple[int, dict[str, jax.Array], list] | None = None
    self.clock = (time.perf_counter(), start)  # (when, step): the last step timed
    self.last: dict[str, float] = {}  # the last row (and evaluation) written
    self.since_eval: list[dict[str, float]] = []  # rows written since the last evaluation

  def add(self, step: int, step_metrics: dict[str, jax.Array], row: bool) -> None:
    self.per_source.append((step_metrics.pop("source_ce_sum"), step_metrics.pop("source_tokens")))
    if row:
      self.pending, self.per_source = (step, step_metrics, self.per_source), []

  def write(self) -> None:
    """The pending row, if any: waits for its step (only)."""
    if self.pending is None:
      return
    (step, step_metrics, sums), self.pending = self.pending, None
    fetched, sums = jax.device_get((step_metrics, sums))
    # The fetch returned when the step ended: its duration is the devices', the host's reading
    # and dispatching hidden behind it unless they are the slower.
    now = time.perf_counter()
    values = {k: float(v) for k, v in fetched.items()}
    values.update(source_losses(self.names, sums))
    elapsed = (now - self.clock[0]) / (step - self.clock[1])
    per_device = self.flops_per_step / elapsed / self.devices
    values.update({"step_time_s": elapsed, "tokens_per_s": self.tokens_per_step / elapsed,
                   "tflops_per_device": per_device / 1e12})
    if self.peak:
      values["mfu"] = per_device / self.peak
    self.writer.write_scalars(step, values)
    # For people: where the run is and when it ends at this pace (evaluations not counted).
    logging.info("step %d/%d: loss %.4f, %.0f tokens/s, %.3g s/step, ETA %s", step, self.end,
                 values["loss"], values["tokens_per_s"], elapsed,
                 logs.duration(elapsed * (self.end - step)))
    self.last = values
    self.since_eval.append(values)
    self.clock = (now, step)

  def add_evaluation(self, step: int, evals: dict[str, float]) -> None:
    self.writer.write_scalars(step, evals)
    self.last = {**self.last, **evals}
    self.since_eval = []

  def restart_clock(self, step: int) -> None:
    """Time the steps after `step` from now (compiling or evaluating is not a step's time)."""
    self.clock = (time.perf_counter(), step)
