"""The training loop: sharded init or resume, jitted train step, metrics, evals, checkpoints.

`Trainer(exp, workdir)` builds everything for an Experiment on the current devices;
`Trainer.run()` trains until `exp.train.steps`, resuming from the workdir's latest checkpoint
(or initialising from `exp.checkpoint.init_from`: parameters and optimizer moments, fresh step,
schedule and data position).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from olmo3 import model as model_lib
from olmo3 import sharding as sharding_lib
from olmo3.config import Experiment
from olmo3.data import pipeline
from olmo3.data.heldout import HeldoutDocs
from olmo3.data.tokens import read_mix
from olmo3.eval import heldout as heldout_eval
from olmo3.eval import tasks as tasks_lib
from olmo3.eval.alarm import GapAlarm
from olmo3.perf.flops import peak_flops_per_device
from olmo3.train import checkpoint as ckpt
from olmo3.train import metrics as metrics_lib
from olmo3.train import optim
from olmo3.train.loss import lm_loss


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar: steps done in this stage
  params: Any  # nested dict of float32 arrays (the checkpoint layout)
  opt_state: Any
  skip: optim.SkipStats  # step-skipping statistics (reset when a stage starts)


class TrainingStopped(RuntimeError):
  """The run cannot continue (too many consecutive skipped steps). The message says why."""


def _shardings(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.sharding, tree)


class _Preemption:
  """SIGTERM / SIGINT ask the run to stop; every process agrees on the step to stop at (a
  tiny all-gather of the flag per step when the job spans several processes)."""

  def __init__(self):
    self.signal: int | None = None
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    self.signal = signum

  def agreed(self) -> bool:
    local = np.int32(self.signal is not None)
    if jax.process_count() == 1:
      return bool(local)
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(local)).any())

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


class Trainer:
  def __init__(self, exp: Experiment, workdir: str | None = None, name: str = "",
               devices: list[jax.Device] | None = None):
    """Builds the mesh (over `devices`, default all), shardings, optimizer and jitted steps;
    checkpoints, held-out sets and tasks are opened on first use."""
    self.exp, self.workdir, self.name = exp, workdir, name
    self.mesh = sharding_lib.make_mesh(dict(exp.mesh.shape), devices=devices,
                                       dcn=dict(exp.mesh.dcn))
    self.rules = exp.mesh.rules or sharding_lib.FSDP_RULES
    with sharding_lib.use_mesh(self.mesh, self.rules):
      abstract = model_lib.abstract_model(exp.model)
      self.graphdef, abstract_state = nnx.split(abstract)
      specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))
      shapes = nnx.to_pure_dict(abstract_state)
    self.param_shardings = jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(self.mesh, spec), specs,
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    self.param_target = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
        self.param_shardings)
    self.tx = optim.adamw(exp.optimizer, shapes)
    opt_shapes = jax.eval_shape(self.tx.init, shapes)
    # Moments follow their parameters' shardings; scalars (Adam's count) are replicated. Set
    # explicitly: the compiler is free to replicate `zeros_like(params)` (it did on TPU, which
    # put a full copy of both Adam moments on every device).
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    opt_shardings = optax.tree_map_params(
        self.tx, lambda _, sharding: sharding, opt_shapes, self.param_shardings,
        transform_non_params=lambda _: replicated)
    self.opt_target = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_shapes,
        opt_shardings)
    self.state_shardings = TrainState(replicated, self.param_shardings, opt_shardings,
                                      jax.tree.map(lambda _: replicated,
                                                   optim.init_skip_stats(exp.optimizer)))
    self.batch_sharding = jax.sharding.NamedSharding(
        self.mesh, sharding_lib.logical_to_spec(("batch", "seq"), self.rules))
    pipeline.check_divisible(exp.data, self.batch_sharding, exp.train.microbatches)
    self._train_step = jax.jit(self._step, in_shardings=(self.state_shardings, None),
                               out_shardings=(self.state_shardings, None), donate_argnums=0)
    self._eval_step = jax.jit(heldout_eval.make_eval_step(self._apply))
    self._logprob_step = jax.jit(heldout_eval.make_logprob_step(self._apply))

  @functools.cached_property
  def checkpoints(self) -> ckpt.RunCheckpoints:
    exp = self.exp
    return ckpt.RunCheckpoints(f"{self.workdir}/checkpoints", exp.checkpoint.keep,
                               exp.checkpoint.async_save)

  @functools.cached_property
  def heldout(self) -> dict[str, HeldoutDocs]:
    exp = self.exp
    pipeline.check_divisible(dataclasses.replace(
        exp.data, global_batch_size=exp.eval.batch_size), self.batch_sharding)
    return {name: HeldoutDocs(read_mix(mix), exp.data.seq_len, exp.model.eos_token_id,
                              exp.model.pad_token_id, exp.eval.max_documents)
            for name, mix in exp.eval.heldout}

  @property
  def tasks(self):
    return self._tasks_and_tokenizer[0]

  @functools.cached_property
  def _tasks_and_tokenizer(self):
    cfg = self.exp.eval
    if not cfg.tasks:
      return [], None
    try:
      tasks = [tasks_lib.load_task(spec, cfg.tasks_dir, cfg.task_limit) for spec in cfg.tasks]
    except tasks_lib.TasksUnavailable as e:
      logging.warning("downstream tasks skipped (held-out loss still runs): %s", e)
      return [], None
    return tasks, tasks_lib.load_tokenizer(cfg.tokenizer)

  # --- the model as a function of the parameter tree ---------------------------------------

  def _apply(self, params, tokens_BT):
    # Traced inside `run`'s mesh context: the logical rules there shard the activations.
    return nnx.merge(self.graphdef, params)(tokens_BT)

  def _step(self, state: TrainState, batch: dict[str, jax.Array]):
    exp = self.exp

    (loss, aux), grads = self._loss_and_grads(state.params, batch)
    grad_norm = optax.global_norm(grads)
    lr = optim.learning_rate(exp.optimizer, state.step)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, jax.tree.map(lambda u: lr * u, updates))
    # A skipped step (NaN/Inf, or a loss / gradient-norm spike) leaves parameters and optimizer
    # state exactly as they were; the data moves on, as in OLMo-core.
    skip = optim.should_skip(exp.optimizer, state.skip, loss, grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)
    params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
    stats = optim.record(exp.optimizer, state.skip, loss, grad_norm, skip)
    metrics = {"loss": loss, "ce_loss": aux["ce_loss"], "z_loss": aux["z_loss"],
               "grad_norm": grad_norm, "lr": lr, "tokens": aux["tokens"].astype(jnp.float32),
               "skipped": skip.astype(jnp.float32),
               "skipped_total": stats.skipped.astype(jnp.float32)}
    return TrainState(state.step + 1, params, opt_state, stats), metrics

  def _loss_and_grads(self, params, batch: dict[str, jax.Array]):
    """((loss, metrics), gradients) of the whole global batch; with train.microbatches = k,
    accumulated over k sequential microbatches (each a 1/k slice of every device's rows, so no
    data moves), normalised by the whole batch's token count: the same loss and update."""
    z_loss_weight, k = self.exp.train.z_loss_weight, self.exp.train.microbatches

    def loss_fn(params, tokens_BT, labels_BT, batch_tokens=None):
      return lm_loss(self._apply(params, tokens_BT), labels_BT, z_loss_weight, batch_tokens)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if k == 1:
      return grad_fn(params, batch["input_ids"], batch["labels"])
    batch_tokens = (batch["labels"] >= 0).sum()

    def split(x_BT):  # microbatch i holds rows i, i + k, ...: a slice of every device's rows
      x_KMT = x_BT.reshape(x_BT.shape[0] // k, k, *x_BT.shape[1:]).swapaxes(0, 1)
      return sharding_lib.constrain(x_KMT, (None, "batch", "seq"))

    def accumulate(total, micro):
      out = grad_fn(params, *micro, batch_tokens)
      total = jax.tree.map(jnp.add, total, out)
      return (total[0], jax.lax.with_sharding_constraint(total[1], self.param_shardings)), None

    micro_KMT = (split(batch["input_ids"]), split(batch["labels"]))
    shapes = jax.eval_shape(grad_fn, params, micro_KMT[0][0], micro_KMT[1][0], batch_tokens)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    zeros = (zeros[0], jax.lax.with_sharding_constraint(zeros[1], self.param_shardings))
    total, _ = jax.lax.scan(accumulate, zeros, micro_KMT)
    return total

  # --- state -------------------------------------------------------------------------------

  def init_state(self) -> TrainState:
    """Resume from this run's latest checkpoint, else init_from, else fresh parameters."""
    with self.mesh_context():
      return self._init_state()

  def _init_state(self) -> TrainState:
    # Newest first: a checkpoint found damaged (missing or truncated files) is reported by
    # name, and with checkpoint.fallback the run resumes from the one before it.
    steps = sorted(self.checkpoints.manager.all_steps(), reverse=True)
    for step in steps:
      path = self.checkpoints.directory / str(step)
      try:
        params, opt_state, meta = ckpt.restore_train_state(path, self.param_target,
                                                           self.opt_target)
      except Exception as e:  # Orbax/TensorStore raise many types for damaged files
        message = f"checkpoint {path} is damaged or unreadable: {type(e).__name__}: {e}"
        if not self.exp.checkpoint.fallback:
          raise ckpt.CheckpointError(message + " (checkpoint.fallback is off)") from e
        aside = path.parent / f"{step}.damaged"  # kept for inspection; the step can be redone
        if jax.process_index() == 0:
          path.rename(aside)
        self.checkpoints.manager.reload()
        logging.error("%s; moved it to %s and falling back to the previous checkpoint",
                      message, aside)
        continue
      logging.info("resumed from %s (step %d)", path, step)
      return self._state(meta["step"], params, opt_state, meta.get("skip"))
    if steps:  # never silently start over a run whose checkpoints all failed
      raise ckpt.CheckpointError(f"{self.checkpoints.directory}: no readable checkpoint among "
                                 f"steps {sorted(steps)}")
    if self.exp.checkpoint.init_from:
      source = ckpt.resolve_step_dir(self.exp.checkpoint.init_from)
      params, opt_state, meta = ckpt.restore_train_state(source, self.param_target,
                                                         self.opt_target)
      logging.info("initialised from %s (its step %d): parameters and optimizer moments; "
                   "step, schedule and data position start at 0", source, meta["step"])
      return self._state(0, params, opt_state)
    seed, cfg = self.exp.train.seed, self.exp.model

    def fresh():
      model = model_lib.Transformer(cfg, rngs=nnx.Rngs(seed))
      params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
      return params, self.tx.init(params)

    params, opt_state = jax.jit(fresh, out_shardings=(self.param_shardings,
                                                      self.state_shardings.opt_state))()
    return self._state(0, params, opt_state)

  def abstract_inputs(self) -> tuple[TrainState, dict[str, jax.ShapeDtypeStruct]]:
    """The train step's inputs as sharded ShapeDtypeStructs (ahead-of-time compilation)."""
    skip = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        optim.init_skip_stats(self.exp.optimizer), self.state_shardings.skip)
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=self.state_shardings.step),
                       self.param_target, self.opt_target, skip)
    shape = (self.exp.data.global_batch_size, self.exp.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)
             for k in ("input_ids", "labels")}
    return state, batch

  def lower_train_step(self):
    with self.mesh_context():
      return self._train_step.lower(*self.abstract_inputs())

  def _state(self, step, params, opt_state, skip: dict | None = None) -> TrainState:
    """A TrainState on the mesh; `skip` is the step-skipping statistics saved in a checkpoint's
    meta (None: fresh, as when a stage starts)."""
    fresh = optim.init_skip_stats(self.exp.optimizer)
    stats = fresh if skip is None else optim.SkipStats(
        *(np.asarray(skip[f], dtype=getattr(fresh, f).dtype) for f in fresh._fields))
    put = lambda x, sh: jax.device_put(jnp.asarray(x), sh)
    return TrainState(put(np.int32(step), self.state_shardings.step), params, opt_state,
                      jax.tree.map(put, stats, self.state_shardings.skip))

  def save(self, state: TrainState) -> None:
    step = int(state.step)
    skip = {f: np.asarray(v).tolist() for f, v in state.skip._asdict().items()}
    self.checkpoints.save(step, state.params, state.opt_state, {
        "step": step, "data_step": step, "experiment": self.name, "skip": skip,
        "model_config": dataclasses.asdict(self.exp.model)})

  # --- evaluation ----------------------------------------------------------------------------

  def _put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_callback(v.shape, self.batch_sharding, lambda i, v=v: v[i])
            for k, v in batch.items()}

  def mesh_context(self):
    """Run jitted steps of this trainer inside this context (its mesh and logical rules)."""
    return sharding_lib.use_mesh(self.mesh, self.rules)

  def evaluate_heldout(self, params) -> dict[str, dict[str, float]]:
    return {name: heldout_eval.evaluate(self._eval_step, params, docs, self.exp.eval.batch_size,
                                        self._put, self.exp.train.eval_batches)
            for name, docs in self.heldout.items()}

  def evaluate(self, params) -> dict[str, float]:
    """Held-out CE/PPL per set and downstream task metrics, as flat metric names."""
    out = {}
    for name, result in self.evaluate_heldout(params).items():
      out.update({f"eval/{name}/{k}": v for k, v in result.items() if k != "tokens"})
    for name, result in self.evaluate_tasks(params).items():
      out.update({f"downstream/{name}/{k}": v for k, v in result.items()
                  if k in ("acc_raw", "acc_per_char", "bpb")})
    return out

  def evaluate_tasks(self, params) -> dict[str, dict]:
    if not self.tasks:
      return {}
    logprobs = lambda batch: np.asarray(self._logprob_step(params, self._put(batch)))
    return tasks_lib.evaluate(self.tasks, self._tasks_and_tokenizer[1], self.exp.data.seq_len,
                              self.exp.eval.batch_size, self.exp.model.eos_token_id, logprobs)

  def _check_gap(self, alarm: GapAlarm, step: int, train_losses: list[float],
                 evals: dict[str, float]) -> bool:
    """Updates the alarm (writes alarm/generalization_gap into `evals`); True: stop the run."""
    heldout = [v for k, v in evals.items() if k.startswith("eval/") and k.endswith("/ce_loss")]
    if not heldout or not train_losses:
      return False
    warning = alarm.update(step, float(np.mean(train_losses)), float(np.mean(heldout)))
    evals["alarm/generalization_gap"] = float(warning is not None)
    if warning is None:
      return False
    logging.warning("%s", warning)
    if self.exp.eval.stop_on_alarm:
      logging.warning("stopping at step %d (eval.stop_on_alarm)", step)
      return True
    return False

  # --- the loop ------------------------------------------------------------------------------

  def run(self) -> dict[str, float]:
    """Trains to exp.train.steps; returns the last logged metrics."""
    with self.mesh_context():
      return self._run()

  def _run(self) -> dict[str, float]:
    exp = self.exp
    os.makedirs(self.workdir, exist_ok=True)
    if jax.process_index() == 0:  # plain JSON: tools read it without Fiddle
      with open(f"{self.workdir}/experiment.json", "w") as f:
        json.dump(exp.to_dict(), f, indent=1)
    state = self._init_state()
    start = int(state.step)
    writer = metrics_lib.create_writer(self.workdir, jax.process_index() == 0)
    from clu import periodic_actions

    progress = periodic_actions.ReportProgress(num_train_steps=exp.train.steps, writer=writer,
                                               every_steps=max(exp.train.log_every, 10))
    flops_per_step = exp.model.flops_per_token(exp.data.seq_len) * exp.tokens_per_step
    peak = peak_flops_per_device(jax.devices()[0].device_kind)
    last: dict[str, float] = {}
    if start >= exp.train.steps:
      logging.info("already at step %d of %d: nothing to do", start, exp.train.steps)
      return last
    loader = pipeline.Loader(exp.data, self.batch_sharding, start_step=start,
                             num_steps=exp.train.steps - start, vocab_size=exp.model.vocab_size)
    preemption = _Preemption()
    alarm = GapAlarm(exp.eval.alarm_window, exp.eval.alarm_margin)
    train_losses: list[float] = []  # logged since the last evaluation
    tick = time.perf_counter()
    try:
      for host_batch in loader:
        batch = loader.to_global(host_batch)
        del batch["instance"]
        state, step_metrics = self._train_step(state, batch)
        step = int(state.step)
        progress(step)
        consecutive = int(state.skip.consecutive)
        if consecutive >= exp.train.max_consecutive_skips:
          writer.write_scalars(step, {k: float(v) for k, v in
                                      jax.device_get(step_metrics).items()})
          raise TrainingStopped(
              f"step {step}: {consecutive} consecutive steps skipped (NaN/Inf or loss / "
              f"gradient-norm spikes; the last loss was {float(step_metrics['loss'])}): "
              f"stopping. Parameters are those of step {step - consecutive}; the latest "
              "checkpoint is intact. Lower the LR, check the data, or raise "
              "train.max_consecutive_skips.")
        if step % exp.train.log_every == 0 or step == exp.train.steps:
          values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
          elapsed = (time.perf_counter() - tick) / exp.train.log_every
          values.update({"step_time_s": elapsed,
                         "tokens_per_s": exp.tokens_per_step / elapsed,
                         "tflops_per_device": flops_per_step / elapsed / jax.device_count() / 1e12})
          if peak:
            values["mfu"] = flops_per_step / elapsed / jax.device_count() / peak
          writer.write_scalars(step, values)
          last = values
          train_losses.append(values["ce_loss"])
          tick = time.perf_counter()
        if self.heldout and exp.train.eval_every and (
            step % exp.train.eval_every == 0 or step == exp.train.steps):
          evals = self.evaluate(state.params)
          stop = self._check_gap(alarm, step, train_losses, evals)
          train_losses = []
          writer.write_scalars(step, evals)
          last = {**last, **evals}
          tick = time.perf_counter()
          if stop:
            writer.flush()
            self.save(state)
            break
        if step % exp.checkpoint.every == 0 or step == exp.train.steps:
          writer.flush()  # metrics up to a checkpoint are on disk before it can exist
          self.save(state)
        elif preemption.agreed():
          writer.flush()
          self.save(state)
          logging.warning("preempted (signal %s): saved step %d; rerun the same command to "
                          "resume", preemption.signal, step)
          break
    finally:
      preemption.restore()
      self.checkpoints.wait()
      writer.flush()
    return last
