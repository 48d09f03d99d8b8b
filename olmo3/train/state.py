"""The train state: its layout on the mesh, and where it comes from (resume, fall back,
initialise from another run, or fresh) and goes to (a checkpoint).

Resume order: this run's newest checkpoint that reads back verified (olmo3.io.checkpoint); a
damaged one is named and, with checkpoint.fallback, quarantined for the one before it; then
checkpoint.init_from, as checkpoint.init_mode says: a new stage (parameters and optimizer
moments; step, schedule and data position start at 0) or the same stage continued (also the
step, data position and step-skip statistics); then fresh parameters. Both restarts (a resume,
a continuation) keep the step-skip window or empty it, as optimizer.spike_window_on_restart
says (OLMo-core saves none: AI2's run restarted with it empty). A checkpoint that does not fit
the model (shapes, dtypes, structure) is a config error: it stops the run and nothing on disk
changes. A run that has written checkpoints, all now quarantined, refuses to start over.

init_from may be AI2's OLMo-core checkpoint: converted into the workdir once (the plan's
`Resume.olmo_core`; olmo3.convert.olmo_core_import), after its small facts are checked against
the run (olmo3.train.continuation), so a mismatch is refused before the tensors are read. Its
Adam moments and count become the optimizer's state.

Each checkpoint records the data it was trained on (`DataPosition.identity`: token files and
their sizes, seq_len, global batch, seed, filter, instances). A resume that finds it changed
refuses, naming the change, unless allowed; then it continues at the same instance position
of the epoch, as OLMo-core does for a changed global batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from olmo3.io import checkpoint, pathnames, storage
from olmo3.io.checkpoint import CheckpointDamaged, CheckpointError, check_run_step
from olmo3.config import Experiment, InitMode, SpikeWindowOnRestart
from olmo3.data.tokens import DataError
from olmo3.io.olmo_core_checkpoints import locate
from olmo3.run.plan import Resume, RunPlan, decide_start
from olmo3 import sharding
from olmo3.placement import ShardedModel
from olmo3.train import continuation, optim
from olmo3.train.run_checkpoints import OPT_STATE, RunCheckpoints, restore_train_state

# Data fields whose change changes the instance sequence (the files are compared one by one).
_DATA_FIELDS = ("seq_len", "max_target_seq_len", "global_batch_size", "seed", "max_instances",
                "repetition_filter", "packing", "packed_index")


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar: steps done in this stage
  params: Any  # nested dict of float32 arrays (the checkpoint layout)
  opt_state: Any
  skip: optim.SkipStats  # step-skipping statistics (reset when a stage starts)


def _structs(shapes: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


class StateLayout:
  """The optimizer and the TrainState's shardings and restore targets on a model's mesh."""

  def __init__(self, exp: Experiment, model: ShardedModel):
    self.exp, self.model = exp, model
    self.tx = optim.adamw(exp.optimizer, model.param_shapes)
    opt_shapes = jax.eval_shape(self.tx.init, model.param_shapes)
    # Moments follow their parameters' shardings; scalars (Adam's count) are replicated. Set
    # explicitly: the compiler is free to replicate `zeros_like(params)` (it did on TPU, which
    # put a full copy of both Adam moments on every device).
    opt_shardings = optax.tree_map_params(
        self.tx, lambda _, sharding: sharding, opt_shapes, model.param_shardings,
        transform_non_params=lambda _: model.replicated)
    self.opt_target = _structs(opt_shapes, opt_shardings)
    fresh_skip = optim.init_skip_stats(exp.optimizer)
    self.shardings = TrainState(model.replicated, model.param_shardings, opt_shardings,
                                jax.tree.map(lambda _: model.replicated, fresh_skip))
    self.abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=model.replicated),
                               model.param_target, self.opt_target,
                               _structs(fresh_skip, self.shardings.skip))

  def fresh(self) -> TrainState:
    """Step 0: freshly initialised parameters (train.seed) and zero moments."""
    params = self.model.init_params(self.exp.train.seed)
    with self.model.context():
      opt_state = jax.jit(self.tx.init, out_shardings=self.shardings.opt_state)(params)
    return self.on_mesh(0, params, opt_state)

  def on_mesh(self, step: int, params: Any, opt_state: Any, skip: dict | None = None, *,
              restart: bool = False) -> TrainState:
    """A TrainState from restored parts; `skip` is the step-skipping statistics a checkpoint's
    meta holds (None: fresh, as when a stage starts). `restart`: a run restarts here (a resume,
    or init_mode continue), so its window is what optimizer.spike_window_on_restart says."""
    cfg = self.exp.optimizer
    fresh = optim.init_skip_stats(cfg)
    stats = fresh if skip is None else optim.SkipStats(
        *(np.asarray(skip[f], dtype=getattr(fresh, f).dtype) for f in fresh._fields))
    if restart and skip is not None and cfg.spike_window_on_restart is SpikeWindowOnRestart.EMPTY:
      stats = optim.empty_window(cfg, stats)
      logging.info("the step-skip window starts empty (optimizer.spike_window_on_restart=empty, "
                   "as OLMo-core after a restart): no spike is skipped before step %d",
                   step + cfg.spike_min_history)
    put = lambda x, sh: jax.device_put(jnp.asarray(x), sh)
    return TrainState(put(np.int32(step), self.shardings.step), params, opt_state,
                      jax.tree.map(put, stats, self.shardings.skip))

  def restore(self, step_dir) -> tuple[Any, Any, dict[str, Any]]:
    return restore_train_state(step_dir, self.model.param_target, self.opt_target)

  def restore_init(self, step_dir) -> tuple[Any, Any, dict[str, Any]]:
    """`restore`, or for a checkpoint imported from another trainer (an `adam` item: count, mu,
    nu), the optimizer's state with those in Adam's place (optax's names; every other part of
    the state is stateless); for one of parameters only (`convert import-hf`, `merge`), a fresh
    optimizer state: the moments are loaded when the checkpoint has them, as OLMo-core's
    `load_checkpoint` loads them."""
    items = checkpoint.load_meta(step_dir).get(checkpoint.ARRAYS, {})
    if checkpoint.ADAM not in items and OPT_STATE not in items:
      restored, meta = checkpoint.restore_items(step_dir,
                                                {checkpoint.PARAMS: self.model.param_target})
      with self.model.context():
        opt_state = jax.jit(self.tx.init, out_shardings=self.shardings.opt_state)(
            restored[checkpoint.PARAMS])
      return restored[checkpoint.PARAMS], opt_state, meta
    if checkpoint.ADAM not in items:
      return self.restore(step_dir)
    adam = {"count": jax.ShapeDtypeStruct((), jnp.int32, sharding=self.model.replicated),
            "mu": self.model.param_target, "nu": self.model.param_target}
    items, meta = checkpoint.restore_items(step_dir, {checkpoint.PARAMS: self.model.param_target,
                                                      checkpoint.ADAM: adam})
    opt_state = optax.tree_utils.tree_set(self.opt_target, **items[checkpoint.ADAM])
    return items[checkpoint.PARAMS], opt_state, meta


@dataclasses.dataclass(frozen=True)
class DataPosition:
  """What the run trains on (`identity`, recorded in each checkpoint) and where its data
  stands: the loader's global data step is the train step plus `offset` (0 unless the run
  continued deliberately after a change of global batch or data)."""

  identity: dict[str, Any]
  offset: int = 0

  def data_step(self, step: int) -> int:
    return step + self.offset


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
  """What differs between a checkpoint's data identity and the current one, in words."""
  # Checkpoints from before data.max_target_seq_len shuffled single instances.
  saved = {"max_target_seq_len": saved["seq_len"], **saved}
  # Checkpoints from before packed instances: none were packed.
  saved = {"packing": None, "packed_index": None, **saved}
  changes = [f"data.{f} was {saved[f]!r}, now {now[f]!r}" for f in _DATA_FIELDS
             if saved[f] != now[f]]
  then, current = dict(map(tuple, saved["files"])), dict(map(tuple, now["files"]))
  for path, tokens in then.items():
    if path not in current:
      changes.append(f"token file {path} is no longer in the data")
    elif current[path] != tokens:
      changes.append(f"token file {path} held {tokens} tokens, now {current[path]}")
  changes += [f"token file {path} is new" for path in current if path not in then]
  if not changes and saved["files"] != now["files"]:
    changes.append("the token files are in another order")
  return changes


def _listed(changes: list[str]) -> str:
  return "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")


def _same_instance(saved: dict[str, Any], now: dict[str, Any], data_step: int) -> int:
  """The data step, in the current data's terms, at the instance position of the epoch that
  `data_step` reached in the saved data's (OLMo-core: tokens processed in the epoch // the new
  batch)."""
  epoch, batch = divmod(data_step, saved["instances"] // saved["global_batch_size"])
  consumed = batch * saved["global_batch_size"]
  return (epoch * (now["instances"] // now["global_batch_size"]) +
          consumed // now["global_batch_size"])


def resumed_position(path, meta: dict[str, Any], identity: dict[str, Any],
                     allow_changed_data: bool) -> DataPosition:
  """Where the data stands for a run (whose data is `identity`) resuming from checkpoint `path`
  (its `meta`): the checkpoint's data step, or with data.allow_changed_data the same instance
  position of the epoch in the changed data. DataError when the data changed unallowed."""
  step, data_step = meta["step"], meta["data_step"]
  saved = meta["data"]
  changes = data_changes(saved, identity)
  if not changes:
    return DataPosition(identity, data_step - step)
  if not allow_changed_data:
    raise DataError(
        f"the training data changed since checkpoint {path} (step {step}, "
        f"{meta['instances_consumed']} instances consumed): {_listed(changes)}. Resuming "
        "would train on another sequence than the run so far. Restore the data and config, or "
        "continue deliberately with data.allow_changed_data=True (at the same instance "
        "position of the epoch).")
  moved = _same_instance(saved, identity, data_step)
  logging.warning("the training data changed since checkpoint %s: %s. Continuing as allowed "
                  "(data.allow_changed_data) at the same instance position: data step %d is "
                  "now %d", path, _listed(changes), data_step, moved)
  return DataPosition(identity, moved - step)


def restore_or_init(layout: StateLayout, checkpoints: RunCheckpoints, plan: RunPlan
                    ) -> tuple[TrainState, DataPosition]:
  """Resume from this run's newest verified checkpoint, else init_from, else fresh (see the
  module docstring), as the plan decided (`plan.resume`) unless the newest checkpoint proves
  damaged. data.allow_changed_data continues when the data differs from the checkpoint's;
  checkpoint.allow_restart_from_scratch starts over when every checkpoint the run wrote is
  damaged."""
  exp = plan.exp
  set_aside = []
  for step in reversed(checkpoints.steps()):
    path = checkpoints.step_dir(step)
    try:
      check_run_step(path)  # emptied or without its meta: damage here, not "no checkpoint"
      params, opt_state, meta = layout.restore(path)
    except CheckpointDamaged as e:
      if not exp.checkpoint.fallback:
        raise CheckpointError(f"{e} (checkpoint.fallback is off)") from e
      aside = checkpoints.quarantine(step)  # the step can be redone
      set_aside.append(aside.name)
      logging.error("%s; quarantined it as %s (kept for inspection) and falling back to the "
                    "previous checkpoint", e, aside)
      continue
    checkpoints.keep_verified(step)
    logging.info("resumed from %s (step %d, verified): %s", path, step,
                 sharding.layout_change(meta.get("written_on"), layout.model.mesh))
    position = resumed_position(path, meta, plan.identity, exp.data.allow_changed_data)
    return layout.on_mesh(meta["step"], params, opt_state, meta.get("skip"),
                          restart=True), position
  quarantined = checkpoints.quarantined()
  if quarantined and exp.checkpoint.allow_restart_from_scratch:
    logging.warning("%s: every checkpoint of this run is damaged (quarantined: %s); starting "
                    "over as checkpoint.allow_restart_from_scratch says", checkpoints.directory,
                    [p.name for p in quarantined])
  elif quarantined:  # never silently start over a run that has written checkpoints
    raise CheckpointError(
        f"{checkpoints.directory}: this run has written checkpoints but none is usable: "
        f"quarantined as damaged (kept for inspection): {[p.name for p in quarantined]}"
        f"{f', this start set aside {set_aside}' if set_aside else ''}. Not starting over "
        "from step 0 silently. To retry a quarantined step, rename it back to its number; to "
        "start over deliberately, set checkpoint.allow_restart_from_scratch=True.")
  resume = plan.resume
  if resume.init_from is None and exp.checkpoint.init_from:  # its own checkpoints all set aside
    resume = decide_start(plan.workdir, exp.checkpoint.init_from, plan.end)
  if resume.init_from:
    return initialised(layout, resume, plan)
  return layout.fresh(), DataPosition(plan.identity)


def initialised(layout: StateLayout, resume: Resume, plan: RunPlan
                ) -> tuple[TrainState, DataPosition]:
  """The state checkpoint.init_from gives, as checkpoint.init_mode says (module docstring)."""
  exp, path = plan.exp, resume.init_from
  if resume.olmo_core is not None:
    _convert_once(resume, plan)
  params, opt_state, meta = layout.restore_init(path)
  source = resume.olmo_core or path
  if resume.olmo_core is None:  # (a converted OLMo-core checkpoint was written by this host)
    logging.info("%s: %s", path, sharding.layout_change(meta.get("written_on"),
                                                        layout.model.mesh))
  if "olmo_core" in meta:
    continuation.check_optimizer(meta["olmo_core"], exp.optimizer, source)
  if exp.checkpoint.init_mode is InitMode.NEW_STAGE:
    logging.info("initialised from %s (its step %s): parameters and %s; step, schedule and "
                 "data position start at 0", source, meta.get("step", "-"),
                 "optimizer moments" if {checkpoint.ADAM, OPT_STATE} & set(meta[checkpoint.ARRAYS])
                 else "fresh optimizer moments (it holds parameters only)")
    return layout.on_mesh(0, params, opt_state), DataPosition(plan.identity)
  step, position = continued_position(resume, plan, meta)
  skip = None if "olmo_core" in meta else meta.get("skip")  # OLMo-core saves no window
  logging.info("continuing %s from its step %d (data step %d): parameters, optimizer moments, "
               "schedule, data position%s", source, step, position.data_step(step),
               " and step-skip statistics" if skip else "; the step-skip window starts empty")
  return layout.on_mesh(step, params, opt_state, skip, restart=True), position


def continued_position(resume: Resume, plan: RunPlan, meta: dict[str, Any] | None = None
                       ) -> tuple[int, DataPosition]:
  """(step, data position) of a run continuing checkpoint.init_from (init_mode continue),
  from the checkpoint's meta alone (default: read from `resume.init_from`)."""
  exp, path = plan.exp, resume.init_from
  meta = checkpoint.load_meta(path) if meta is None else meta
  if "olmo_core" in meta:
    step, data_step = continuation.olmo_core_start(meta["olmo_core"], exp, plan.identity,
                                                   plan.steps_per_epoch, resume.olmo_core or path)
    return step, DataPosition(plan.identity, data_step - step)
  if "step" not in meta:  # import-hf's, merge's: no step, schedule or data to continue
    raise CheckpointError(f"checkpoint.init_from={path!r} holds parameters only (an import or a "
                          "merge): nothing to continue; start a new stage from it "
                          "(checkpoint.init_mode='new_stage')")
  return meta["step"], resumed_position(path, meta, plan.identity, exp.data.allow_changed_data)


def _convert_once(resume: Resume, plan: RunPlan) -> None:
  """Converts the OLMo-core checkpoint `resume` names into the workdir, unless an earlier
  launch did: its facts are checked against the run first, so a mismatch costs no download."""
  from olmo3.convert import hf  # pylint: disable=import-outside-toplevel

  exp, source, path = plan.exp, resume.olmo_core, resume.init_from
  located = locate(source)
  if located is None:  # gone since the plan found it
    raise CheckpointError(f"checkpoint.init_from={source!r}: no OLMo-core checkpoint there now")
  if storage.exists(pathnames.join(path, checkpoint.PARAMS)):
    converted = checkpoint.load_meta(path).get("source")
    if converted != located.root:
      raise CheckpointError(f"{path} holds the conversion of {converted}, not of "
                            f"checkpoint.init_from={source!r}: remove it, or name {converted}")
    return
  if jax.process_count() > 1:
    raise CheckpointError(
        f"checkpoint.init_from={source!r}: a job of {jax.process_count()} processes does not "
        f"convert an OLMo-core checkpoint; convert it first (python -m olmo3.convert "
        f"import-olmo-core --src {source} --out DIR) and set checkpoint.init_from to DIR")

  def check(facts: dict[str, Any]) -> None:
    continuation.check_optimizer(facts, exp.optimizer, source)
    if exp.checkpoint.init_mode is InitMode.CONTINUE:
      continuation.olmo_core_start(facts, exp, plan.identity, plan.steps_per_epoch, source)

  logging.info("converting the OLMo-core checkpoint %s into %s", located.root, path)
  try:
    # Imported here: it imports torch, which only this conversion needs.
    from olmo3.convert import olmo_core_import  # pylint: disable=import-outside-toplevel

    olmo_core_import.import_checkpoint(source, path, exp.model, check=check)
  except hf.ConversionError as e:
    raise CheckpointError(f"checkpoint.init_from={source!r}: {e}") from e


def confirm_complete(plan: RunPlan, model: ShardedModel) -> RunPlan:
  """`plan` when its run is complete (Start.COMPLETE) and the newest checkpoint reads back
  verified, as the trainer would restore it; otherwise the plan to train from where the
  trainer would resume (a damaged final checkpoint is quarantined by the same restore, and
  the run trains again from the one before it). Nothing is written unless one is quarantined."""
  with model.context():
    checkpoints = RunCheckpoints(plan.workdir.checkpoints, plan.exp.checkpoint.keep,
                                 async_save=False)
    state, _ = restore_or_init(StateLayout(plan.exp, model), checkpoints, plan)
  step = int(state.step)
  if step >= plan.end:
    return plan
  return dataclasses.replace(plan, resume=decide_start(plan.workdir, plan.exp.checkpoint.init_from,
                                                       plan.end))


def save(checkpoints: RunCheckpoints, state: TrainState, plan: RunPlan,
         data: DataPosition) -> None:
  """A checkpoint of `state`: parameters, moments, and meta (step, data position and identity,
  skip statistics, the model config and the experiment's name)."""
  step = int(state.step)
  data_step = data.data_step(step)
  skip = {f: np.asarray(v).tolist() for f, v in state.skip._asdict().items()}
  checkpoints.save(step, state.params, state.opt_state, {
      "step": step, "data_step": data_step,
      "instances_consumed": data_step * plan.exp.data.global_batch_size, "data": data.identity,
      "experiment": plan.name, "skip": skip, "model_config": dataclasses.asdict(plan.exp.model),
      "written_on": sharding.layout(jax.tree.leaves(state.params)[0].sharding.mesh)})
