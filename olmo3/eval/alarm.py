"""The generalization-gap alarm: train loss keeps improving while held-out loss does not.

The signature of memorisation or duplicated data (the TPU reproduction's train loss fell 0.25
below AI2's while held-out evals did not move). At every held-out evaluation the alarm compares
the mean training loss since the previous evaluation and the held-out loss with their values
`window` evaluations earlier. It fires when training loss fell by more than `margin` while
held-out loss fell by less than `margin / 4` (stalled) or rose.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class GapAlarm:
  window: int = 2  # evaluations to look back
  margin: float = 0.05  # nats of training-loss improvement that count as "improving"
  history: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)
  fired_at: int | None = None

  def update(self, step: int, train_loss: float, heldout_loss: float) -> str | None:
    """Records an evaluation; returns the warning text when the alarm fires, else None."""
    self.history.append((step, train_loss, heldout_loss))
    if len(self.history) <= self.window:
      return None
    then_step, then_train, then_heldout = self.history[-1 - self.window]
    train_drop = then_train - train_loss
    heldout_drop = then_heldout - heldout_loss
    if train_drop > self.margin and heldout_drop < self.margin / 4:
      if self.fired_at is None:
        self.fired_at = step
      return (f"generalization gap: from step {then_step} to {step} train loss fell "
              f"{train_drop:.3f} ({then_train:.3f} -> {train_loss:.3f}) while held-out loss "
              f"{'rose' if heldout_drop < 0 else 'fell only'} {abs(heldout_drop):.3f} "
              f"({then_heldout:.3f} -> {heldout_loss:.3f}): memorisation or duplicated data?")
    return None

  def observe(self, step: int, train_losses: list[float], evals: dict[str, float]) -> str | None:
    """At an evaluation: the mean training CE logged since the previous one and the mean
    held-out CE over the sets in `evals` (eval/<set>/ce_loss). Writes
    alarm/generalization_gap (0 or 1) into `evals`; returns the warning when the alarm fires."""
    heldout = [v for k, v in evals.items() if k.startswith("eval/") and k.endswith("/ce_loss")]
    if not heldout or not train_losses:
      return None
    warning = self.update(step, sum(train_losses) / len(train_losses),
                          sum(heldout) / len(heldout))
    evals["alarm/generalization_gap"] = float(warning is not None)
    return warning
