"""A training run's checkpoints: WORKDIR/checkpoints/<step>/{params, opt_state, meta}.

Each step directory is a model checkpoint (olmo3.checkpoint) with the optimizer state beside
the parameters. Orbax commits a step by renaming its temporary directory, so only complete
steps are ever listed; async saves overlap training and are awaited before the next save and
at exit.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from olmo3.checkpoint import META, PARAMS, CheckpointError, restore_params

OPT_STATE = "opt_state"


class RunCheckpoints:
  def __init__(self, directory: str | os.PathLike, keep: int, async_save: bool):
    self.directory = epath.Path(directory).absolute()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                             enable_async_checkpointing=async_save))

  def steps(self) -> list[int]:
    """The committed steps, oldest first."""
    return sorted(self._manager.all_steps())

  def step_dir(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def set_aside(self, step: int) -> epath.Path:
    """Moves a damaged step out of the list (to <step>.damaged, kept for inspection)."""
    aside = self.directory / f"{step}.damaged"
    if jax.process_index() == 0:
      self.step_dir(step).rename(aside)
    self._manager.reload()
    return aside

  def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
    self._manager.save(step, args=ocp.args.Composite(**{
        PARAMS: ocp.args.StandardSave(params),
        OPT_STATE: ocp.args.StandardSave(opt_state),
        META: ocp.args.JsonSave(meta),
    }), force=True)

  def wait(self) -> None:
    self._manager.wait_until_finished()


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
