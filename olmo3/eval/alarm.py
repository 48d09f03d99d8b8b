"""The generalization-gap alarm: train loss keeps improving while held-out loss does not.

The signature of memorisation or duplicated data (the TPU reproduction's train loss fell 0.25
below AI2's while held-out evals did not move). At every held-out evaluation the alarm compares
a training loss since the previous evaluation and a held-out loss with their values `window`
evaluations earlier. It fires when training loss fell by more than `margin` while held-out loss
fell by less than `margin / 4` (stalled) or rose.

It watches the overall training CE against the mean over the held-out sets, and each data
source's training CE (`train/<source>/ce_loss`) against its counterpart: the held-out set of the
same name when there is one, else the held-out mean. A source duplicated in the mix collapses
below its counterpart even when the mixture's loss, averaged over every source, does not show it.
"""

from __future__ import annotations

import dataclasses

METRIC = "alarm/generalization_gap"  # 0 or 1 at each held-out evaluation


def _mean(values: list[float]) -> float:
  return sum(values) / len(values)


def _losses(metrics: dict[str, float], prefix: str) -> dict[str, float]:
  """{name: value} of the metrics named <prefix><name>/ce_loss."""
  return {k[len(prefix):-len("/ce_loss")]: v for k, v in metrics.items()
          if k.startswith(prefix) and k.endswith("/ce_loss")}


@dataclasses.dataclass
class GapAlarm:
  window: int = 2  # evaluations to look back
  margin: float = 0.05  # nats of training-loss improvement that count as "improving"
  # (step, train, held-out) per check: None is the overall one, else a source's name. A source
  # missing from an evaluation's logs (no tokens) skips it: its window counts its own entries.
  history: dict[str | None, list[tuple[int, float, float]]] = dataclasses.field(
      default_factory=dict)
  fired_at: int | None = None  # the first evaluation any check fired at

  def update(self, step: int, train_loss: float, heldout_loss: float,
             source: str | None = None) -> str | None:
    """Records an evaluation of one check (overall, or `source`); returns the warning text when
    the alarm fires, else None."""
    history = self.history.setdefault(source, [])
    history.append((step, train_loss, heldout_loss))
    if len(history) <= self.window:
      return None
    then_step, then_train, then_heldout = history[-1 - self.window]
    train_drop = then_train - train_loss
    heldout_drop = then_heldout - heldout_loss
    if train_drop > self.margin and heldout_drop < self.margin / 4:
      if self.fired_at is None:
        self.fired_at = step
      what = "" if source is None else f" on source {source!r}"
      return (f"generalization gap{what}: from step {then_step} to {step} train loss fell "
              f"{train_drop:.3f} ({then_train:.3f} -> {train_loss:.3f}) while held-out loss "
              f"{'rose' if heldout_drop < 0 else 'fell only'} {abs(heldout_drop):.3f} "
              f"({then_heldout:.3f} -> {heldout_loss:.3f}): memorisation or duplicated data?")
    return None

  def observe(self, step: int, train_logs: list[dict[str, float]], evals: dict[str, float]
              ) -> str | None:
    """At an evaluation: `train_logs` are the training metrics logged since the previous one
    (each check's train loss is the mean of its logged values: `ce_loss`, and
    `train/<source>/ce_loss`), `evals` the held-out CEs (`eval/<set>/ce_loss`). Writes
    alarm/generalization_gap (0 or 1) into `evals`; returns the warning (one line per check
    that fired) when the alarm fires."""
    heldout = _losses(evals, "eval/")
    if not heldout or not train_logs:
      return None
    heldout_mean = _mean(list(heldout.values()))
    warnings = [self.update(step, _mean([log["ce_loss"] for log in train_logs]), heldout_mean)]
    by_source: dict[str, list[float]] = {}
    for log in train_logs:
      for source, loss in _losses(log, "train/").items():
        by_source.setdefault(source, []).append(loss)
    for source, losses in sorted(by_source.items()) if len(by_source) > 1 else ():
      # (a mix of one source: its check is the overall one)
      warnings.append(self.update(step, _mean(losses), heldout.get(source, heldout_mean),
                                  source))
    warnings = [w for w in warnings if w is not None]
    evals[METRIC] = float(bool(warnings))
    return "\n".join(warnings) or None
