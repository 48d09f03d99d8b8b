"""A logged step trained again: restore a run's checkpoint, run the steps after it with the same
train step, data and mesh the run had, and read step N's loss, gradient norm, skip decision and
each row's (and token's) loss (`python -m olmo3.inspect_step --replay`).

Nothing is written into the run's workdir. The replay takes the experiment revision that
trained step N (olmo3.run.record's rule) and the mesh its launch recorded (the history line's
`layout`, else the layout of a checkpoint that launch wrote), on the first devices of this
machine.

What the replay can promise (`Replayed.expected`, `agreement`): the same compiled program on
the same devices sums in the same order, so it gives the logged values bit for bit, when the
sums *across* devices run in the order the run's did too. Floating-point addition is not
associative, and XLA:CPU has two implementations of its collectives that order a sum of P
devices' parts differently: in one process, its in-process collectives add the parts one after
another in device order, ((x0 + x1) + x2) + x3; across processes, JAX's cross-process
collectives (gloo) run a ring all-reduce, whose partial sum for each segment of the buffer
starts at another device (a rotation of that order). Every gradient element (the all-reduce
over the fsdp shards), the gradient norm's sum of squares and the loss's sum over the batch
cross devices, so a run of 2 processes x 2 devices and one process of 4 differ in the last bits
of some of them, as the data happen to round, on any CPU. A replay of a CPU run of several processes
therefore joins JAX's distributed runtime as a job of its one process (`use_the_runs_collectives`,
before JAX starts): gloo then sums across its devices, one rank per device as in the run, and
a ring's order depends only on the ranks, not on which process holds them. On accelerators
the compiler's reductions are deterministic on TPU and on GPU only with XLA's
`--xla_gpu_deterministic_ops`; a run of several processes there summed across hosts in an
order that one process cannot take, so such a replay (and one whose run recorded no layout)
is expected equal to float rounding, and says so. Bit for bit also takes the run's JAX and
machine kind (neither is in the layout): another CPU's kernels may round a product differently.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import socket
from typing import Any

import jax
import numpy as np
from absl import logging

from olmo3 import sharding
from olmo3.config import InitMode, SpikeWindowOnRestart
from olmo3.data import pipeline
from olmo3.io import checkpoint
from olmo3.io import metrics as metrics_lib
from olmo3.placement import ShardedModel
from olmo3.run import record
from olmo3.run.plan import RunPlan, Start, stage_start
from olmo3.train import logs, optim
from olmo3.train import state as state_lib
from olmo3.train.step import jit_train_step


class ReplayError(ValueError):
  """A replay that cannot be made as asked; the message says why and what to ask instead."""


class Agreement(enum.Enum):
  """What a replay's metrics are expected to be against the logged ones (module docstring)."""
  BIT_FOR_BIT = "bit for bit"
  ROUNDING = "to float rounding"


class LayoutFrom(enum.Enum):
  HISTORY = "the launch's record"
  CHECKPOINT = "a checkpoint the launch wrote"
  THIS_MACHINE = "not recorded: this machine's devices"


@dataclasses.dataclass(frozen=True)
class Origin:
  """Where a replay of step `step` starts, and on what mesh."""

  step: int
  from_step: int  # the checkpoint restored (0: the stage's start)
  launch: record.Launch | None  # the launch that trained `step` (None: no record says)
  layout: dict[str, Any] | None  # olmo3.sharding.layout of its mesh
  layout_from: LayoutFrom
  # the run restarted at `from_step` (a launch started there): the state is restored as that
  # launch restored it (optimizer.spike_window_on_restart); otherwise as the run held it
  restarted: bool
  restarts: tuple[int, ...]  # later launches' start steps within the replay: restarts there


@dataclasses.dataclass(frozen=True)
class Replayed:
  origin: Origin
  metrics: dict[str, float]  # the step's: loss, ce_loss, grad_norm, skipped, ...
  logged: dict[str, float] | None  # metrics.jsonl's row of the step, if the run logged it
  row_nll_sum: np.ndarray  # [B] float64: each row's summed cross-entropy
  row_tokens: np.ndarray  # [B] int64: each row's scored (unmasked) labels
  token_nll: np.ndarray | None  # [B, T] float32 per position (with per_token), 0 where masked
  layout: dict[str, Any]  # where the replay ran
  data_step: int  # the loader's step it read for step `origin.step`
  expected: Agreement  # what `logged` should equal `metrics` to
  why: str  # the reason, one clause: which devices and collectives made the sums

  @property
  def row_loss(self) -> np.ndarray:
    """[B]: each row's mean cross-entropy over its scored labels (NaN: none scored)."""
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.where(self.row_tokens > 0, self.row_nll_sum / self.row_tokens, np.nan)

  def matches_log(self) -> dict[str, bool]:
    """Per metric both have (loss, ce_loss, grad_norm, skipped): replayed == logged, exactly
    (a NaN equals a NaN: a non-finite step replayed as logged is reproduced)."""
    if self.logged is None:
      return {}
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))
    return {k: same(self.metrics[k], self.logged[k])
            for k in ("loss", "ce_loss", "grad_norm", "skipped")
            if k in self.logged and k in self.metrics}


def cross_process_collectives(run_layout: dict[str, Any] | None) -> bool:
  """Whether replaying a step trained on `run_layout` takes JAX's cross-process collectives
  (gloo): the run summed across the devices of several CPU processes (module docstring)."""
  return (run_layout is not None and run_layout.get("device_kind") == "cpu"
          and int(run_layout.get("processes", 1)) > 1)


def use_the_runs_collectives(plan: RunPlan, step: int, from_step: int | None = None) -> bool:
  """Before JAX starts a backend: where step `step` was trained by several CPU processes, joins
  JAX's distributed runtime as a job of this one process, so that XLA:CPU sums across devices
  with gloo (one rank per device) as the run did. True if it did."""
  if not cross_process_collectives(origin(plan, step, from_step).layout):
    return False
  with socket.socket() as s:  # a free port for the job's coordinator, in this process
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
  return True


def agreement(run_layout: dict[str, Any] | None, here: dict[str, Any], platform: str,
              gloo: bool) -> tuple[Agreement, str]:
  """What a replay on `here` (sharding.layout: where it ran, on `platform`, with gloo's
  cross-process collectives if `gloo`) can promise against a run trained on `run_layout`: bit
  for bit only where every sum, within and across devices, runs in the run's order (a CPU run
  of several processes: gloo's, JAX's default there)."""
  if run_layout is None:
    return Agreement.ROUNDING, "the run recorded no layout: replayed on this machine's devices"
  devices = lambda l: (l["mesh"], l["devices"], l["device_kind"])
  if devices(run_layout) != devices(here):
    return Agreement.ROUNDING, (
        f"trained on {run_layout['devices']} {run_layout['device_kind']} device(s), mesh "
        f"{run_layout['mesh']}; replayed on {here['devices']} {here['device_kind']}, mesh "
        f"{here['mesh']}")
  if platform == "gpu" and "--xla_gpu_deterministic_ops=true" not in os.environ.get(
      "XLA_FLAGS", ""):
    return Agreement.ROUNDING, ("GPU reductions run in no fixed order without "
                                "--xla_gpu_deterministic_ops=true")
  processes = int(run_layout.get("processes", 1))
  if processes == here["processes"]:
    return Agreement.BIT_FOR_BIT, "the run's devices and process count"
  if gloo and platform == "cpu":
    return Agreement.BIT_FOR_BIT, (
        f"the run's devices; its {processes} processes' cross-device sums in their order (gloo, "
        "one rank per device)")
  return Agreement.ROUNDING, (
      f"the run's {processes} processes summed across devices in another order than one "
      "process does")


def _layout(workdir: record.Workdir, launch: record.Launch, until: int | None
            ) -> tuple[dict[str, Any] | None, LayoutFrom]:
  """The mesh `launch` (which trained the steps after its start up to `until`) trained on: its
  history line's, else the layout recorded in the first checkpoint it wrote."""
  if launch.plan.get("layout"):
    return launch.plan["layout"], LayoutFrom.HISTORY
  for s in checkpoint.run_steps(workdir.checkpoints):
    if s > launch.start_step and (until is None or s <= until):
      written = checkpoint.load_meta(workdir.checkpoints / str(s)).get("written_on")
      if written:
        return written, LayoutFrom.CHECKPOINT
  return None, LayoutFrom.THIS_MACHINE


def _span(history: list[record.Launch], from_step: int, step: int
          ) -> list[tuple[record.Launch, int | None]]:
  """The launches whose steps from_step + 1..step the run kept, in order, each with the last
  step it kept (None: to the end). A step is the latest launch's that started before it
  (`record.producer`): a later launch redid what an interrupted one logged past its last
  checkpoint, and a launch that fell back to an earlier checkpoint (a damaged newest one)
  redid the steps after it, so the launch before it kept none of them."""
  starts = sorted({h.start_step for h in history})
  kept: list[tuple[record.Launch, int, int | None]] = []  # (launch, first step, last step)
  for i, start in enumerate(starts):
    launch = record.producer(history, start + 1)
    last = starts[i + 1] if i + 1 < len(starts) else None
    if kept and kept[-1][0] is launch:
      kept[-1] = (launch, kept[-1][1], last)
    else:
      kept.append((launch, start + 1, last))
  return [(h, last) for h, first, last in kept
          if first <= step and (last is None or last > from_step)]


def origin(plan: RunPlan, step: int, from_step: int | None = None) -> Origin:
  """Where replaying `step` of `plan`'s run starts: `from_step` (a committed checkpoint of the
  run, or 0 for the stage's start), by default the newest checkpoint before `step`. Refuses a
  start from which the run itself did not go to `step` on one mesh and one config (every launch
  in between compared): an earlier launch's steps are replayed from a checkpoint of theirs."""
  workdir = plan.workdir
  steps = checkpoint.run_steps(workdir.checkpoints)
  before = [s for s in steps if s < step]
  if from_step is None:
    from_step = before[-1] if before else 0
  elif from_step and from_step not in steps:
    raise ReplayError(f"--from_step {from_step}: no committed checkpoint there (have {steps}; "
                      "0: the stage's start)")
  elif from_step >= step:
    raise ReplayError(f"--from_step {from_step}: must be before --step {step}")
  history = record.read_history(workdir.root)
  spans = _span(history, from_step, step)
  if not spans:  # no record of the launches: the run's own config, this machine's devices
    return Origin(step, from_step, None, None, LayoutFrom.THIS_MACHINE, False, ())
  span = [h for h, _ in spans]
  launch = span[-1]
  layouts = [_layout(workdir, h, until) for h, until in spans]
  same = [(h.revision, l) == (launch.revision, layouts[-1][0]) for h, (l, _) in zip(span, layouts)]
  if not all(same):
    last_other = max(i for i, ok in enumerate(same) if not ok)
    first_same = span[last_other + 1]
    raise ReplayError(
        f"steps {from_step + 1}..{step} were trained by two launches (launch "
        f"{span[last_other].launch} and launch {first_same.launch}, which started at step "
        f"{first_same.start_step}) on different configs or meshes: replay from step "
        f"{first_same.start_step} or later (--from_step)")
  return Origin(step, from_step, launch, *layouts[-1], span[0].start_step == from_step,
                tuple(h.start_step for h in span[1:]))


def listed_position(plan: RunPlan, step: int) -> state_lib.DataPosition:
  """Where the data stood for `step` as its launch had it, read from checkpoint metas alone
  (for listing a step's rows: nothing is restored, and any step can be listed): the launch's
  own start checkpoint, else the newest checkpoint before the step, else the stage's start."""
  steps = checkpoint.run_steps(plan.workdir.checkpoints)
  launch = record.producer(record.read_history(plan.workdir.root), step)
  if launch is not None and launch.start_step in steps:
    return _position_after(plan, launch.start_step)
  before = [s for s in steps if s < step]
  if (launch is not None and launch.start_step == 0) or not before:
    return _position_after(plan, 0)
  meta = checkpoint.load_meta(plan.workdir.checkpoints / str(before[-1]))
  return state_lib.DataPosition(plan.identity, meta["data_step"] - meta["step"])


def model_on(plan: RunPlan, origin_: Origin) -> ShardedModel:
  """The experiment's model on the mesh step `origin_.step` was trained on (its layout's axes
  over the first devices of this process), or on every device here when none is recorded."""
  exp, layout = plan.exp, origin_.layout
  if layout is None:
    return ShardedModel.for_experiment(exp)
  wanted, here = int(layout["devices"]), jax.local_devices()
  if wanted > len(here):
    raise ReplayError(
        f"step {origin_.step} was trained on {wanted} devices ({layout['mesh']}); this process "
        f"has {len(here)}: run the replay where {wanted} devices are visible (on CPU: "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={wanted})")
  shape = {a: n for a, n in exp.mesh.shape}
  shape = {a: int(layout["mesh"].get(a, 1)) for a in {**shape, **layout["mesh"]}}
  mesh = sharding.make_mesh(shape, devices=here[:wanted])
  return ShardedModel(exp.model, mesh, exp.mesh.rules or sharding.FSDP_RULES)


def _position_after(plan: RunPlan, from_step: int) -> state_lib.DataPosition:
  """Where the data stands after `from_step` (its checkpoint's meta, or the stage's start),
  read without restoring any array (`listed_position`)."""
  if from_step:
    path = plan.workdir.checkpoints / str(from_step)
    meta = checkpoint.load_meta(path)
    return state_lib.resumed_position(path, meta, plan.identity, plan.exp.data.allow_changed_data)
  resume = stage_start(plan.workdir, plan.exp.checkpoint.init_from)
  if resume.start is Start.FRESH or plan.exp.checkpoint.init_mode is not InitMode.CONTINUE:
    return state_lib.DataPosition(plan.identity)
  return state_lib.continued_position(resume, plan)[1]


def _start_state(layout: state_lib.StateLayout, plan: RunPlan, origin_: Origin
                 ) -> tuple[state_lib.TrainState, state_lib.DataPosition]:
  """The state the run had after `origin_.from_step` (restored and verified)."""
  from_step = origin_.from_step
  if from_step:
    path = plan.workdir.checkpoints / str(from_step)
    checkpoint.check_run_step(path)
    params, opt_state, meta = layout.restore(path)
    position = state_lib.resumed_position(path, meta, plan.identity,
                                          plan.exp.data.allow_changed_data)
    return layout.on_mesh(meta["step"], params, opt_state, meta.get("skip"),
                          restart=origin_.restarted), position
  resume = stage_start(plan.workdir, plan.exp.checkpoint.init_from)
  if resume.start is Start.FRESH:
    return layout.fresh(), state_lib.DataPosition(plan.identity)
  return state_lib.initialised(layout, resume, plan)


def logged_row(plan: RunPlan, step: int) -> dict[str, float] | None:
  path = plan.workdir.metrics
  if not path.exists():
    return None
  rows = [r for r in metrics_lib.read_jsonl(path) if r.get("step") == step and "loss" in r]
  return rows[-1] if rows else None


def replay(plan: RunPlan, origin_: Origin, per_token: bool = False) -> Replayed:
  """Trains `plan`'s run again from `origin_.from_step` to `origin_.step` (nothing written)."""
  if origin_.step > plan.end:
    raise ReplayError(f"--step {origin_.step}: the stage ends at step {plan.end}: a step past "
                      "it can be inspected, not replayed")
  model = model_on(plan, origin_)
  exp = plan.exp
  layout = state_lib.StateLayout(exp, model)
  step = origin_.step
  with model.context():
    start = f"checkpoint {origin_.from_step}" if origin_.from_step else "the stage's start"
    with logs.Heartbeat(f"restoring the train state at {start}"):
      state, position = _start_state(layout, plan, origin_)
    step_fn = jit_train_step(exp, model, layout, len(plan.train_files.source_names))
    token_losses = jax.jit(model.token_losses)
    # The loader in this process alone: its rows are the whole batch; no worker processes.
    data = dataclasses.replace(exp.data, num_workers=0)
    loader = pipeline.Loader(data, model.batch_sharding, start_step=position.data_step(
        origin_.from_step), num_steps=step - origin_.from_step, source=plan.train_files,
        microbatches=exp.train.microbatches)
    metrics = None
    empties = exp.optimizer.spike_window_on_restart is SpikeWindowOnRestart.EMPTY
    for s, host in enumerate(loader.host_batches(), start=origin_.from_step + 1):
      # Said as it runs: the first step compiles (minutes for a large model).
      first = ", compiled first" if s == origin_.from_step + 1 else ""
      with logs.Heartbeat(f"training step {s} again ({s - origin_.from_step} of "
                          f"{step - origin_.from_step}{first})"):
        if empties and s - 1 in origin_.restarts:  # the run restarted here: as its launch did
          state = state._replace(skip=jax.device_put(
              optim.empty_window(exp.optimizer, state.skip), layout.shardings.skip))
        batch = loader.host_rows.to_global({k: host[k] for k in pipeline.STEP_KEYS
                                            if k in host})
        if s == step:  # each row's loss, with the parameters the step starts from
          segments = (batch["segments"],) if "segments" in batch else ()
          nll_BT, _, mask_BT = jax.device_get(token_losses(state.params, batch["input_ids"],
                                                           batch["labels"], *segments))
        state, metrics = jax.block_until_ready(step_fn(state, batch))
  values = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
  here = sharding.layout(model.mesh)
  gloo = (jax.distributed.is_initialized()  # use_the_runs_collectives
          and jax.config.jax_cpu_collectives_implementation == "gloo")
  expected, why = agreement(origin_.layout, here, model.mesh.devices.flat[0].platform, gloo)
  return Replayed(origin_, values, logged_row(plan, step),
                  nll_BT.astype(np.float64).sum(-1), mask_BT.sum(-1).astype(np.int64),
                  nll_BT if per_token else None, here, position.data_step(step - 1),
                  expected, why)


def replay_verified(plan: RunPlan, step: int, from_step: int | None = None,
                    per_token: bool = False) -> Replayed:
  """`replay` of `step` from checkpoint `from_step`, or by default from the newest checkpoint
  before it that reads back verified: a damaged one is named and the one before it tried, as a
  resume falls back (nothing is quarantined: a replay writes nothing)."""
  if from_step is not None:
    return replay(plan, origin(plan, step, from_step), per_token)
  steps = checkpoint.run_steps(plan.workdir.checkpoints)
  for candidate in [s for s in reversed(steps) if s < step]:
    try:
      return replay(plan, origin(plan, step, candidate), per_token)
    except checkpoint.CheckpointDamaged as e:
      logging.warning("%s; replaying from the checkpoint before it", e)
  return replay(plan, origin(plan, step, 0), per_token)
