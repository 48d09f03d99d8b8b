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


LONG_CONTEXT_METRIC = "alarm/long_context"  # 0 or 1 at each RULER evaluation


@dataclasses.dataclass
class LongContextAlarm:
  """RULER's mean score at the longest length falls while the shortest length holds: a model
  losing its long context (an SFT at 32K collapsing RULER at 64K, a broken RoPE scaling) while
  its loss, dominated by short-range predictions, shows nothing. At each RULER evaluation the
  means per length (ruler/mean/<length>) are compared with the previous evaluation's and with
  the first one's (the run's starting checkpoint, when the loop scored it before its first
  step): the alarm fires when the longest length's mean fell by more than `drop` while the
  shortest's fell by less than half of that (or rose)."""

  drop: float = 0.1
  first: tuple[int, dict[int, float]] | None = None  # (step, means per length)
  last: tuple[int, dict[int, float]] | None = None
  fired_at: int | None = None

  def observe(self, step: int, means: dict[int, float], evals: dict[str, float] | None = None
              ) -> str | None:
    """Records one evaluation's means per length; returns the warning when the alarm fires.
    Writes alarm/long_context (0 or 1) into `evals` when given."""
    if len(means) < 2:  # no short length to hold
      return None
    warnings = []
    for then in {id(x): x for x in (self.first, self.last) if x is not None}.values():
      warning = self._compare(then, step, means)
      if warning:
        warnings.append(warning)
        break  # the same fall, seen twice, is said once
    self.first = self.first or (step, means)
    self.last = (step, means)
    if warnings and self.fired_at is None:
      self.fired_at = step
    if evals is not None:
      evals[LONG_CONTEXT_METRIC] = float(bool(warnings))
    return "\n".join(warnings) or None

  def _compare(self, then: tuple[int, dict[int, float]], step: int, means: dict[int, float]
               ) -> str | None:
    then_step, before = then
    shared = sorted(set(before) & set(means))
    if len(shared) < 2:
      return None
    short, long = shared[0], shared[-1]
    long_drop, short_drop = before[long] - means[long], before[short] - means[short]
    if long_drop > self.drop and short_drop < self.drop / 2:
      return (f"long context lost: from step {then_step} to {step} RULER at {long} tokens fell "
              f"{long_drop:.3f} ({before[long]:.3f} -> {means[long]:.3f}) while at {short} it "
              f"moved {-short_drop:+.3f} ({before[short]:.3f} -> {means[short]:.3f})")
    return None
