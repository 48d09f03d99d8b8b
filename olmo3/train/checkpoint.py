"""Orbax model checkpoints: a directory with a `params` item (the parameter tree) and a `meta`
item (JSON: the model config and provenance).

Training checkpoints add items beside these (optimizer state, data position) in the same
layout, so a converted checkpoint and a training step directory restore the same way. Orbax
writes into a temporary directory and renames it when complete, so a crash never leaves a
checkpoint that looks complete.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from olmo3.config import ModelConfig

PARAMS, META = "params", "meta"


class CheckpointError(ValueError):
  """A checkpoint is missing, incomplete or does not fit the model. The message says which."""


def save_model(path: str | os.PathLike, cfg: ModelConfig, params: Any,
               meta: dict[str, Any] | None = None) -> None:
  """Saves a parameter tree (nested dict of arrays) and its model config; refuses to overwrite."""
  path = epath.Path(path).absolute()
  if path.exists():
    raise CheckpointError(f"{path} already exists; refusing to overwrite")
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  checkpointer.save(path, args=ocp.args.Composite(**{
      PARAMS: ocp.args.StandardSave(params),
      META: ocp.args.JsonSave({"model_config": dataclasses.asdict(cfg), **(meta or {})}),
  }))


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
  path = epath.Path(path).absolute()
  if not (path / META).exists():
    raise CheckpointError(f"{path}: not a model checkpoint (no '{META}' item)")
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  return checkpointer.restore(path, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]


def load_model_config(path: str | os.PathLike) -> ModelConfig:
  return ModelConfig(**load_meta(path)["model_config"])


def restore_params(path: str | os.PathLike, target: Any) -> Any:
  """Restores `params` onto `target`: a tree of jax.ShapeDtypeStruct with the shardings wanted
  (any mesh: Orbax reshards), checked leaf by leaf against the stored shapes first."""
  path = epath.Path(path).absolute()
  if not (path / PARAMS).exists():
    raise CheckpointError(f"{path}: not a model checkpoint (no '{PARAMS}' item)")
  stored = ocp.StandardCheckpointHandler().metadata(path / PARAMS)
  flat_stored = dict(jax.tree_util.tree_flatten_with_path(stored)[0])
  flat_target = dict(jax.tree_util.tree_flatten_with_path(target)[0])
  for key, want in flat_target.items():
    name = jax.tree_util.keystr(key)
    if key not in flat_stored:
      raise CheckpointError(f"{path}: parameter {name} is not in the checkpoint")
    have = tuple(flat_stored[key].shape)
    if have != tuple(want.shape):
      raise CheckpointError(f"{path}: parameter {name} has shape {have} in the checkpoint; "
                            f"the model expects {tuple(want.shape)}")
  extra = set(flat_stored) - set(flat_target)
  if extra:
    names = sorted(jax.tree_util.keystr(k) for k in extra)
    raise CheckpointError(f"{path}: checkpoint has parameters the model lacks: {names[:5]}")
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  restored = checkpointer.restore(path, args=ocp.args.Composite(**{
      PARAMS: ocp.args.StandardRestore(target)}))
  return restored[PARAMS]


def host_target(params_shapes: Any) -> Any:
  """A restore target that puts every leaf on the first local device (CPU tools)."""
  sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.dtype(x.dtype), sharding=sharding),
                      params_shapes)


OPT_STATE = "opt_state"


def resolve_step_dir(path: str | os.PathLike) -> epath.Path:
  """A checkpoint step directory from a step directory, a run's checkpoints directory or a run
  workdir (their latest step)."""
  path = epath.Path(path).absolute()
  if (path / PARAMS).exists():
    return path
  directory = path / "checkpoints" if (path / "checkpoints").exists() else path
  steps = sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit()) if (
      directory.exists()) else []
  if not steps:
    raise CheckpointError(f"{path}: no checkpoint (expected a step directory holding "
                          f"'{PARAMS}', or a directory of numbered steps)")
  return directory / str(steps[-1])


class RunCheckpoints:
  """A run's checkpoints: WORKDIR/checkpoints/<step>/{params, opt_state, meta}.

  Orbax commits a step by renaming its temporary directory, so only complete steps are ever
  listed; async saves overlap training and are awaited before the next save and at exit.
  """

  def __init__(self, directory: str | os.PathLike, keep: int, async_save: bool):
    self.directory = epath.Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                             enable_async_checkpointing=async_save))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
    self.manager.save(step, args=ocp.args.Composite(**{
        PARAMS: ocp.args.StandardSave(params),
        OPT_STATE: ocp.args.StandardSave(opt_state),
        META: ocp.args.JsonSave(meta),
    }), force=True)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def restore_train_state(step_dir: str | os.PathLike, params_target: Any, opt_target: Any
                        ) -> tuple[Any, Any, dict[str, Any]]:
  """(params, opt_state, meta) of a training checkpoint, onto the targets' shardings."""
  step_dir = epath.Path(step_dir).absolute()
  params = restore_params(step_dir, params_target)
  if not (step_dir / OPT_STATE).exists():
    raise CheckpointError(f"{step_dir}: no '{OPT_STATE}' item (a converted model checkpoint "
                          "holds parameters only)")
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  restored = checkpointer.restore(step_dir, args=ocp.args.Composite(**{
      OPT_STATE: ocp.args.StandardRestore(opt_target), META: ocp.args.JsonRestore()}))
  return params, restored[OPT_STATE], restored[META]
