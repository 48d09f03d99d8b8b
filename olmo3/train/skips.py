"""train.max_consecutive_skips: the run stops when too many steps in a row were skipped (NaN/Inf
or loss / gradient-norm spikes: olmo3.train.optim), counted on the host from each step's
`skipped` flag.

The flags stay on the devices until `check`, which the loop calls where it waits anyway (with a
row, before evaluating or saving): a run of skips between two checks is still seen, and no
checkpoint is written after the limit was reached.
"""

from __future__ import annotations

import jax


class TrainingStopped(RuntimeError):
  """The run cannot continue (too many consecutive skipped steps). The message says why."""


class SkipLimit:
  def __init__(self, limit: int, consecutive: int):
    self.limit, self.consecutive = limit, consecutive
    self.steps: list[tuple[int, jax.Array, jax.Array]] = []  # (step, skipped, loss) unchecked

  def add(self, step: int, step_metrics: dict[str, jax.Array]) -> None:
    self.steps.append((step, step_metrics["skipped"], step_metrics["loss"]))

  def check(self) -> None:
    steps, self.steps = jax.device_get(self.steps), []
    for step, skipped, loss in steps:
      self.consecutive = self.consecutive + 1 if skipped else 0
      if self.consecutive >= self.limit:
        raise TrainingStopped(
            f"step {step}: {self.consecutive} consecutive steps skipped (NaN/Inf or loss / "
            f"gradient-norm spikes; the last loss was {float(loss)}): stopping. Parameters "
            f"at step {step} were those of step {step - self.consecutive}; the latest "
            f"checkpoint, from before step {step}, is intact. Lower the LR, check the data, or "
            "raise train.max_consecutive_skips.")
