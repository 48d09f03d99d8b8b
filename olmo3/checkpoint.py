"""Model checkpoints in and out: a directory with a `params` item (the parameter tree) and a
`meta` item (JSON: the model config and provenance). Used by training, evaluation and
conversion alike, so it sits below all three.

Training checkpoints (olmo3.train.checkpoints) add items beside these (optimizer state, data
position) in the same layout, so a converted checkpoint and a training step directory restore
the same way. Orbax writes into a temporary directory and renames it when complete, so a crash
never leaves a checkpoint that looks complete.
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


def run_steps(directory: str | os.PathLike) -> list[int]:
  """The committed steps of a run's checkpoints directory, oldest first (Orbax names a step's
  directory by its number only once it is complete)."""
  directory = epath.Path(directory).absolute()
  return sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit()) if (
      directory.exists()) else []


def resolve_step_dir(path: str | os.PathLike) -> epath.Path:
  """A checkpoint step directory from a step directory, a run's checkpoints directory or a run
  workdir (their latest step)."""
  path = epath.Path(path).absolute()
  if (path / PARAMS).exists():
    return path
  directory = path / "checkpoints" if (path / "checkpoints").exists() else path
  steps = run_steps(directory)
  if not steps:
    raise CheckpointError(f"{path}: no checkpoint (expected a step directory holding "
                          f"'{PARAMS}', or a directory of numbered steps)")
  return directory / str(steps[-1])
