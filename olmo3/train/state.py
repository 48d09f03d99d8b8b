"""The train state: its layout on the mesh, and where it comes from (resume, fall back,
initialise from another run, or fresh) and goes to (a checkpoint).

Resume order: this run's newest checkpoint; a damaged one (missing or truncated files) is
named and, with checkpoint.fallback, moved aside for the one before it; then
checkpoint.init_from (parameters and optimizer moments; step, schedule and data position start
at 0); then fresh parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from olmo3.checkpoint import CheckpointError, resolve_step_dir
from olmo3.config import Experiment
from olmo3.sharded import ShardedModel
from olmo3.train import optim
from olmo3.train.checkpoints import RunCheckpoints, restore_train_state


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

  def on_mesh(self, step: int, params: Any, opt_state: Any, skip: dict | None = None
              ) -> TrainState:
    """A TrainState from restored parts; `skip` is the step-skipping statistics a checkpoint's
    meta holds (None: fresh, as when a stage starts)."""
    fresh = optim.init_skip_stats(self.exp.optimizer)
    stats = fresh if skip is None else optim.SkipStats(
        *(np.asarray(skip[f], dtype=getattr(fresh, f).dtype) for f in fresh._fields))
    put = lambda x, sh: jax.device_put(jnp.asarray(x), sh)
    return TrainState(put(np.int32(step), self.shardings.step), params, opt_state,
                      jax.tree.map(put, stats, self.shardings.skip))

  def restore(self, step_dir) -> tuple[Any, Any, dict[str, Any]]:
    return restore_train_state(step_dir, self.model.param_target, self.opt_target)


def restore_or_init(layout: StateLayout, checkpoints: RunCheckpoints) -> TrainState:
  """Resume from this run's newest readable checkpoint, else init_from, else fresh."""
  exp = layout.exp
  steps = checkpoints.steps()
  for step in reversed(steps):
    path = checkpoints.step_dir(step)
    try:
      params, opt_state, meta = layout.restore(path)
    except Exception as e:  # Orbax/TensorStore raise many types for damaged files
      message = f"checkpoint {path} is damaged or unreadable: {type(e).__name__}: {e}"
      if not exp.checkpoint.fallback:
        raise CheckpointError(message + " (checkpoint.fallback is off)") from e
      aside = checkpoints.set_aside(step)  # the step can be redone
      logging.error("%s; moved it to %s and falling back to the previous checkpoint",
                    message, aside)
      continue
    logging.info("resumed from %s (step %d)", path, step)
    return layout.on_mesh(meta["step"], params, opt_state, meta.get("skip"))
  if steps:  # never silently start over a run whose checkpoints all failed
    raise CheckpointError(f"{checkpoints.directory}: no readable checkpoint among steps {steps}")
  if exp.checkpoint.init_from:
    source = resolve_step_dir(exp.checkpoint.init_from)
    params, opt_state, meta = layout.restore(source)
    logging.info("initialised from %s (its step %d): parameters and optimizer moments; "
                 "step, schedule and data position start at 0", source, meta["step"])
    return layout.on_mesh(0, params, opt_state)
  return layout.fresh()


def save(checkpoints: RunCheckpoints, state: TrainState, exp: Experiment, name: str) -> None:
  """A checkpoint of `state`: parameters, moments, and meta (step, data position, skip
  statistics, the model config and the experiment's name)."""
  step = int(state.step)
  skip = {f: np.asarray(v).tolist() for f, v in state.skip._asdict().items()}
  checkpoints.save(step, state.params, state.opt_state, {
      "step": step, "data_step": step, "experiment": name, "skip": skip,
      "model_config": dataclasses.asdict(exp.model)})
