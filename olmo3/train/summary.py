"""What a run came to, in a dozen lines: printed when a run ends, when a finished run is
launched again, and by `--dry_run` of a finished run.

Everything comes from the workdir (metrics.jsonl, history.jsonl, the committed checkpoints),
so the summary of a run is the same whichever launch prints it: the last training loss, the
last evaluation's held-out CE per set and each task's headline metric, the generalization-gap
alarm's state, the tokens trained on, the time spent, where the files are, and the commands a
user runs next (olmo3.train.closing supplies those, from the stages the launcher found).
"""

from __future__ import annotations

import dataclasses

from olmo3.config import Experiment
from olmo3.eval.alarm import METRIC as ALARM
from olmo3.eval.tasks import headline_of
from olmo3.io import checkpoint, metrics, pathnames
from olmo3.run.record import Workdir, read_history
from olmo3.train.logs import duration


@dataclasses.dataclass(frozen=True)
class RunSummary:
  workdir: str
  step: int  # the run's last logged step
  end: int  # the stage's last step
  launches: int
  train_loss: tuple[int, float] | None  # (step, loss) of the last row with a loss
  heldout: tuple[int, dict[str, float]] | None  # (step, {set: CE}) of the last evaluation
  # {set: {band: CE}} of that evaluation, per band of positions (eval.position_band)
  bands: dict[str, dict[str, float]]
  tasks: tuple[int, dict[str, tuple[str, float]]] | None  # (step, {task: (metric, value)})
  evaluations: int  # held-out evaluations the alarm watched
  alarm_fired: int | None  # the first step it fired at
  tokens: int
  step_seconds: float  # the logged steps' time, every launch (evaluations, compiles excluded)
  checkpoint: str | None  # the newest committed step's directory

  @classmethod
  def read(cls, workdir: str, exp: Experiment) -> RunSummary:
    """The summary of the run in `workdir`, trained by `exp` (its stage end, batch, cadence)."""
    files = Workdir(workdir)
    rows = metrics.read_jsonl(files.metrics) if files.metrics.exists() else []
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    scored = [r for r in rows if any(k.startswith("downstream/") for k in r)]
    step_seconds, previous = 0.0, 0
    for r in train:  # a row's step time is the mean over the steps since the row before it
      step_seconds += r.get("step_time_s", 0.0) * max(1, r["step"] - previous)
      previous = r["step"]
    fired = [r["step"] for r in rows if r.get(ALARM)]
    committed = checkpoint.run_steps(files.checkpoints)
    step = max((r["step"] for r in rows), default=0)
    return cls(
        workdir=workdir, step=step, end=exp.train.steps, launches=len(read_history(workdir)),
        train_loss=(train[-1]["step"], train[-1]["loss"]) if train else None,
        heldout=(evals[-1]["step"], {k[5:-8]: v for k, v in evals[-1].items()
                                     if k.startswith("eval/") and k.endswith("/ce_loss")}
                 ) if evals else None,
        bands=_bands(evals[-1]) if evals else {},
        tasks=(scored[-1]["step"], _headlines(scored[-1])) if scored else None,
        evaluations=sum(ALARM in r for r in rows), alarm_fired=fired[0] if fired else None,
        tokens=step * exp.tokens_per_step, step_seconds=step_seconds,
        checkpoint=(pathnames.join(str(files.checkpoints), str(committed[-1]))
                    if committed else None))

  def lines(self, *, launch_seconds: float | None = None,
            next_commands: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """The summary as lines for people; `launch_seconds`: this launch's wall time, when it
    trained; `next_commands`: (what, command) pairs."""
    state = "complete" if self.step >= self.end else f"stopped at step {self.step} of {self.end}"
    out = [f"run {state}: {self.workdir} ({self.launches} launch"
           f"{'es' * (self.launches != 1)})"]
    if self.train_loss:
      out.append(f"  train loss      {self.train_loss[1]:.4f} (step {self.train_loss[0]})")
    if self.heldout:
      step, sets = self.heldout
      shown = ", ".join(f"{name} {ce:.4f}" for name, ce in sorted(sets.items()))
      out.append(f"  held-out CE     {shown} (step {step})")
      for name, bands in sorted(self.bands.items()):
        out.append(f"  by position     {name}: " + ", ".join(
            f"{band} {ce:.4f}" for band, ce in bands.items()))
    else:
      out.append("  held-out CE     none: the run evaluated no held-out set")
    if self.tasks:
      step, tasks = self.tasks
      shown = [f"{name} {metric} {value:.4f}" for name, (metric, value) in sorted(tasks.items())]
      shown[-1] += f" (step {step})"
      lines = [[]]  # a task per item, as many as fit in 100 characters per line
      for item in shown:
        if lines[-1] and len(", ".join(lines[-1] + [item])) > 100 - 18:
          lines.append([])
        lines[-1].append(item)
      out += [("  tasks           " if i == 0 else " " * 18) + ", ".join(items)
              + ("," if i < len(lines) - 1 else "") for i, items in enumerate(lines)]
    if self.alarm_fired is not None:
      out.append(f"  alarm           FIRED at step {self.alarm_fired}: train loss fell while "
                 "held-out loss did not (the log and metrics.jsonl say on what)")
    elif self.evaluations:
      out.append(f"  alarm           quiet over {self.evaluations} evaluation"
                 f"{'s' * (self.evaluations != 1)}")
    else:
      out.append("  alarm           off: without held-out evaluations it cannot fire")
    out.append(f"  tokens          {self.tokens:,} ({self.step:,} steps)")
    spent = f"training steps {duration(self.step_seconds)}"
    if launch_seconds is not None:
      spent = f"{duration(launch_seconds)} this launch; {spent} over all launches"
    out.append(f"  time            {spent}")
    out.append(f"  checkpoint      {self.checkpoint or 'none committed'}")
    files = Workdir(self.workdir)
    out.append(f"  metrics         {files.metrics} (TensorBoard: "
               f"{pathnames.join(self.workdir, metrics.TENSORBOARD)})")
    if next_commands:
      out.append("next:")
      width = max(len(what) for what, _ in next_commands)
      out += [f"  {what.ljust(width)}  {command}" for what, command in next_commands]
    return out


def _headlines(row: dict[str, float]) -> dict[str, tuple[str, float]]:
  by_task: dict[str, dict[str, float]] = {}
  for key, value in row.items():
    if key.startswith("downstream/"):
      _, task, name = key.split("/", 2)
      by_task.setdefault(task, {})[name] = value
  out = {}
  for task, values in by_task.items():
    name = headline_of(set(values))
    if name is not None:
      out[task] = (name, values[name])
  return out


def _bands(row: dict) -> dict[str, dict[str, float]]:
  """{set: {"a-b": CE}} of an evaluation row's per-position-band CE (eval/<set>/ce_loss_posA_B),
  in position order."""
  out: dict[str, dict[str, float]] = {}
  for key, value in row.items():
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "eval" and parts[2].startswith("ce_loss_pos"):
      start, end = parts[2][len("ce_loss_pos"):].split("_")
      out.setdefault(parts[1], {})[(int(start), int(end))] = value
  return {name: {f"{a}-{b}": ce for (a, b), ce in sorted(bands.items())}
          for name, bands in out.items()}
