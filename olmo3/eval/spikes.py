"""Steps of a run whose training loss or gradient norm jumps, for `python -m olmo3.eval.compare`
to point at with the command that shows what the step trained on.

The rule is the optimizer's step-skipping rule (olmo3/train/optim.py `should_skip`, with the run's
own settings, `run_rule`; OptimizerConfig's defaults for a file), applied to the logged values: a
logged `ce_loss` or `grad_norm` is a spike when it exceeds the mean of that metric's previous
`window` logged values (of the steps whose logged values were all finite) by more than `sigma`
unbiased standard deviations, once `min_history` values exist counting it; a non-finite value always
is. With train.log_every = 1 and the default settings, that finds the steps the optimizer skipped
for a spike, and a lower --spike_sigma the smaller jumps too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex

from olmo3.config import Experiment, OptimizerConfig
from olmo3.run import record

METRICS = ("ce_loss", "grad_norm")
_DEFAULTS = OptimizerConfig()
SIGMA = _DEFAULTS.spike_sigma
WINDOW = _DEFAULTS.spike_window
MIN_HISTORY = _DEFAULTS.spike_min_history


@dataclasses.dataclass(frozen=True)
class Spike:
  step: int
  metric: str  # ce_loss or grad_norm
  value: float
  mean: float  # of the previous logged values in the window (NaN before any)
  std: float  # their unbiased standard deviation
  sigmas: float  # (value - mean) / std; inf for a non-finite value or a jump over std 0
  command: str | None  # the inspect command for the step; None when the source is not a run


@dataclasses.dataclass(frozen=True)
class Rule:
  sigma: float = SIGMA
  window: int = WINDOW
  min_history: int = MIN_HISTORY


def run_rule(workdir: str | None) -> Rule:
  """The skip rule of the run in `workdir` (its latest experiment's optimizer settings), so the
  spikes found are those its optimizer judged; the defaults for a file or an unreadable run."""
  if workdir is None:
    return Rule()
  try:
    path = record.experiment_file(workdir, None)
    opt = Experiment.from_dict(json.loads(path.read_text())).optimizer
  except (record.RecordError, OSError, ValueError, TypeError, KeyError):
    return Rule()
  return Rule(opt.spike_sigma, opt.spike_window, opt.spike_min_history)


def inspect_command(workdir: str, step: int) -> str:
  """The command that lists step `step`'s documents and replays it (olmo3/inspect_step.py)."""
  return (f"python -m olmo3.inspect_step --workdir {shlex.quote(workdir)} --step {step} --replay "
          "--top 5")


def find(series: dict[str, dict[int, float]], workdir: str | None, sigma: float = SIGMA,
         window: int = WINDOW, min_history: int = MIN_HISTORY) -> list[Spike]:
  """The spikes of `series` (metric -> step -> value), in step order; `workdir`: the run's, for
  the inspect commands. A step enters the windows when its logged values are all finite, as
  the optimizer records a step."""
  spikes = []
  history: dict[str, list[float]] = {m: [] for m in METRICS}
  for step in sorted(set().union(*(series.get(m, {}) for m in METRICS))):
    logged = {m: series[m][step] for m in METRICS if step in series.get(m, {})}
    for metric, value in logged.items():
      previous = history[metric]
      n = len(previous)
      mean = sum(previous) / n if n else math.nan
      std = math.sqrt(sum((v - mean) ** 2 for v in previous) / max(n - 1, 1)) if n else math.nan
      if not math.isfinite(value):
        jump = math.inf
      elif n + 1 >= min_history and value - mean > sigma * std:
        jump = (value - mean) / std if std else math.inf
      else:
        continue
      spikes.append(Spike(step, metric, value, mean, std, jump,
                          None if workdir is None else inspect_command(workdir, step)))
    if all(math.isfinite(v) for v in logged.values()):
      for metric, value in logged.items():
        history[metric] = [*history[metric], value][-window:]
  return spikes
