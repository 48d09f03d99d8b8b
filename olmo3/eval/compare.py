"""python -m olmo3.eval.compare OURS REFERENCE [--tolerance 0.005] [--metrics REGEX]
                              [--plot FILE.png] [--json] [--per_step]
                              [--ai2_eval_batch_size B [--ai2_eval_epoch E]] [--spike_sigma K]

Compares a run's metrics with a reference, step by step: AI2's released in-loop numbers, a W&B
export, or another run. Each of OURS and REFERENCE is a run workdir (its metrics.jsonl), a
.jsonl file (one object per step, with "step") or a .csv file (a `step`, `Step` or `_step`
column and one column per metric; an empty cell means "not logged at this step").

AI2's names (OLMo-core's trainer: `train/CE loss`, `eval/lm/<set>/CE loss`,
`eval/downstream/<task> (<label>)`) are translated to ours (`ce_loss`, `eval/<set>/ce_loss`,
`downstream/<task>/<key>`); names already in our form pass through, other names are kept and
listed as "not in ours". --metrics (a regex searched in our names) selects what is compared; by
default training CE, held-out CE and downstream metrics (not PPL: it is exp(CE)).

Held-out CE in AI2's names is OLMo-core's definition, not ours (olmo3/eval/ce_definitions.py):
ours is restated in it where that is exact, else the metric's verdict is "not comparable", with
why on a line of its own. Exact needs olmo3's per-set counts (eval/<set>/tokens, documents,
documents_left_out) and OLMo-core's global evaluation batch in documents
(--ai2_eval_batch_size: which documents its last partial batch left out; --ai2_eval_epoch, its
shuffle epoch, 1 unless an OLMo-core before 2.6 evaluated more than once since the job started).
Not comparable metrics are shown but not judged.

Spikes: steps of OURS whose ce_loss or grad_norm exceeds the mean of the previous logged values
in its skip window (128 by default) by more than --spike_sigma (the run's, 6 by default)
standard deviations (its optimizer's skip rule, olmo3/eval/spikes.py), each with the
`python -m olmo3.inspect_step` command that shows and replays the step (for a run workdir).

For each metric in both: the steps both logged and those only one side logged (every step
either logged is in --per_step's table, --json's `points` and the plot, a missing value shown
as missing), the largest |ours - reference| over the common steps and its step, and whether it
is within ±tolerance (the TPU reproduction matched AI2 within ±0.005).

Alarms (every `alarm/<name>` either side logs, e.g. alarm/generalization_gap; not subject to
--metrics): whether and at which steps each side's alarm fired. They agree when both fired or
neither did; one side alone firing is a difference (exit 1). An alarm only one side logs is
reported, not judged.

--plot draws a panel per compared metric on one step axis: both curves, the ±tolerance band
around the reference, a vertical line where each side's alarm first fired; its title names the
two sources. --json prints one JSON document (the summary included; a non-finite number is the
string "nan", "inf" or "-inf"; a missing value is null).
Exit status: 0 all within and alarms agree, 1 any metric outside or an alarm differs, 2
unreadable input or nothing to compare (nothing comparable included: no verdict).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from typing import Any

from etils import epath

from olmo3 import program
from olmo3.eval import ce_definitions, spikes
from olmo3.eval.ce_definitions import OlmoCoreEvaluation
from olmo3.eval import ruler_scores
from olmo3.eval.metric_series import CompareError, Source, load

DEFAULT_TOLERANCE = 0.005
# Not PPL (exp(CE)) nor the held-out counts (eval/<set>/tokens, documents, documents_left_out).
DEFAULT_METRICS = r"^(ce_loss$|eval/(?!.*/(ppl|tokens|documents|documents_left_out)$)|downstream/)"
ALARM_PREFIX = "alarm/"  # the loop's alarms: 1 at an evaluation where it fired, else 0
MAX_PANELS = 12
MAX_LISTED = 10  # names per "not in ..." line of the text report; --json lists all
MISSING = "—"  # a value one side did not log, in the text tables

@dataclasses.dataclass(frozen=True)
class MetricResult:
  metric: str
  steps: int  # steps where both have a value
  ours_only: int  # steps only ours logged (shown, not compared)
  reference_only: int  # steps only the reference logged
  max_abs_delta: float
  step: int  # where max_abs_delta occurs
  ours: float
  reference: float
  within: bool | None  # None: not comparable (not judged)
  outside_steps: int  # steps whose |delta| exceeds the tolerance
  # Every step either side logged, in order: (step, ours or None, reference or None); a
  # held-out metric's olmo3 side as restated in OLMo-core's definition.
  points: tuple[tuple[int, float | None, float | None], ...]
  comparable: bool = True
  note: str = ""  # held-out CE: how the olmo3 side was restated, or why it cannot be


@dataclasses.dataclass(frozen=True)
class AlarmResult:
  alarm: str  # e.g. alarm/generalization_gap
  # Steps where it fired, in order; None when that side never logged the alarm.
  ours_fired: tuple[int, ...] | None
  reference_fired: tuple[int, ...] | None
  ours_evaluations: int  # steps that side logged the alarm (fired or not)
  reference_evaluations: int
  # Both fired, or neither did; None when one side does not log it (nothing to judge).
  agree: bool | None


@dataclasses.dataclass(frozen=True)
class Summary:
  metrics: int
  metrics_outside: int
  comparisons: int  # (metric, step) pairs both logged
  comparisons_outside: int
  alarms: int  # alarms both log
  alarms_differ: int
  not_comparable: int  # metrics shown, not judged
  ok: bool  # exit status 0


@dataclasses.dataclass(frozen=True)
class Comparison:
  metrics: list[MetricResult]
  alarms: list[AlarmResult]
  not_in_ours: list[str]
  not_in_reference: list[str]
  no_common_steps: list[str]
  spikes: list[spikes.Spike] = dataclasses.field(default_factory=list)  # in ours
  # what found them (a lambda: in this class body `spikes` is the field above)
  spike_rule: spikes.Rule = dataclasses.field(default_factory=lambda: spikes.Rule())

  @property
  def summary(self) -> Summary:
    judged = [r for r in self.metrics if r.comparable]
    outside = sum(not r.within for r in judged)
    alarms = [a for a in self.alarms if a.agree is not None]
    differ = sum(not a.agree for a in alarms)
    return Summary(len(judged), outside, sum(r.steps for r in judged),
                   sum(r.outside_steps for r in judged), len(alarms), differ,
                   len(self.metrics) - len(judged), outside == 0 and differ == 0)


def _aligned(a: dict[int, float], b: dict[int, float]
             ) -> tuple[tuple[int, float | None, float | None], ...]:
  return tuple((s, a.get(s), b.get(s)) for s in sorted(set(a) | set(b)))


def _fired(series: dict[int, float] | None) -> tuple[int, ...] | None:
  # NaN is not a firing (`not nan != 0` is False, hence the explicit check).
  return None if series is None else tuple(
      s for s, v in sorted(series.items()) if v != 0 and not math.isnan(v))


def compare_alarms(ours: Source, reference: Source) -> list[AlarmResult]:
  """Every alarm either side logs: where it fired in each, and whether they agree."""
  names = sorted(m for m in {*ours.series, *reference.series} if m.startswith(ALARM_PREFIX))
  results = []
  for name in names:
    a, b = ours.series.get(name), reference.series.get(name)
    fired_a, fired_b = _fired(a), _fired(b)
    agree = None if a is None or b is None else bool(fired_a) == bool(fired_b)
    results.append(AlarmResult(name, fired_a, fired_b, len(a or ()), len(b or ()), agree))
  return results


def _restated(metric: str, ours: Source, reference: Source, steps: list[int],
              evaluation: OlmoCoreEvaluation
              ) -> tuple[dict[int, float], dict[int, float], ce_definitions.Restated | None]:
  """Both sides' values of `metric`, the olmo3 side's in OLMo-core's definition when only the
  other is OLMo-core's (a held-out CE or PPL in AI2's names), and how (None: as logged)."""
  a, b = ours.series[metric], reference.series[metric]
  if (metric in ours.olmo_core) == (metric in reference.olmo_core):
    return a, b, None
  if metric in reference.olmo_core:
    restated = ce_definitions.restate(metric, ours, reference, steps, evaluation, "ours")
    return (a if restated is None else restated.values), b, restated
  restated = ce_definitions.restate(metric, reference, ours, steps, evaluation, "the reference")
  return a, (b if restated is None else restated.values), restated


def compare(ours: Source, reference: Source, tolerance: float,
            metrics: re.Pattern[str] = re.compile(DEFAULT_METRICS),
            evaluation: OlmoCoreEvaluation = OlmoCoreEvaluation(),
            spike_sigma: float | None = None) -> Comparison:
  """Per metric, the largest |ours - reference| over the steps both logged, every step either
  logged aligned (held-out CE in one definition: ce_definitions.restate); the alarms; and the
  spikes of ours."""
  def selected(source: Source) -> set[str]:
    return {m for m in source.series if metrics.search(m) and not m.startswith(ALARM_PREFIX)}

  mine, theirs = selected(ours), selected(reference)
  alarms = compare_alarms(ours, reference)
  results, no_common = [], []
  for metric in sorted(mine & theirs):
    steps = sorted(set(ours.series[metric]) & set(reference.series[metric]))
    if not steps:
      no_common.append(metric)
      continue
    a, b, restated = _restated(metric, ours, reference, steps, evaluation)
    delta = {s: abs(a[s] - b[s]) for s in steps}
    # NaN (OLMo-core logs it for a held-out set it did not reach) is never within tolerance.
    outside = sum(not d <= tolerance for d in delta.values())
    worst = max(steps, key=lambda s: math.inf if math.isnan(delta[s]) else delta[s])
    comparable = restated is None or restated.comparable
    results.append(MetricResult(metric, len(steps), len(set(a) - set(b)), len(set(b) - set(a)),
                                delta[worst], worst, a[worst], b[worst],
                                not outside if comparable else None, outside, _aligned(a, b),
                                comparable, "" if restated is None else restated.note))
  if not results and not any(r.agree is not None for r in alarms):
    if no_common:
      raise CompareError(
          f"{ours.path} and {reference.path} have no steps in common for the {len(no_common)} "
          f"metrics both hold (ours: steps {_span(ours, no_common)}; reference: steps "
          f"{_span(reference, no_common)})")
    raise CompareError(f"{ours.path} and {reference.path} have no metrics in common"
                       f"{'' if metrics.pattern == DEFAULT_METRICS else ' matching --metrics'}"
                       f" (reference: {_listing(sorted(theirs or reference.series))})")
  file = epath.Path(ours.path)
  workdir = str(file.parent) if file.name == "metrics.jsonl" else None
  rule = spikes.run_rule(workdir)
  rule = dataclasses.replace(rule, sigma=spike_sigma or rule.sigma)
  return Comparison(results, alarms, sorted(theirs - mine), sorted(mine - theirs), no_common,
                    spikes.find(ours.series, workdir, rule.sigma, rule.window, rule.min_history),
                    rule)


def _span(source: Source, metrics: list[str]) -> str:
  steps = [s for m in metrics for s in source.series[m]]
  return f"{min(steps)}–{max(steps)}"


def _listing(names: list[str]) -> str:
  more = len(names) - MAX_LISTED
  return ", ".join(names[:MAX_LISTED]) + (f", … ({more} more)" if more > 0 else "")


def _label(path: str) -> str:
  p = epath.Path(path)
  return p.parent.name if p.name == "metrics.jsonl" else p.name


def _steps_text(fired: tuple[int, ...] | None, evaluations: int) -> str:
  if fired is None:
    return "not logged"
  if not fired:
    return f"never ({evaluations} evaluations)"
  shown = ", ".join(map(str, fired[:MAX_LISTED])) + (", …" if len(fired) > MAX_LISTED else "")
  return f"fired at {shown} ({len(fired)} of {evaluations})"


def figure(ours: Source, reference: Source, comparison: Comparison, tolerance: float):
  """The plot as a matplotlib Figure: a panel per compared metric, up to MAX_PANELS (the others
  by name, then the downstream ones: dozens per suite, which would crowd out the loss curves),
  on one step axis spanning every step either side logged; a dashed vertical line where each
  side's alarm first fired, in that side's colour."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  shown = sorted(comparison.metrics,
                 key=lambda r: (r.metric.startswith("downstream/"), r.metric))[:MAX_PANELS]
  all_steps = [s for src in (ours, reference) for series in src.series.values() for s in series]
  first_fired = [(side, color, a.alarm, fired[0])
                 for a in comparison.alarms
                 for side, color, fired in (("ours", "tab:blue", a.ours_fired),
                                            ("reference", "tab:orange", a.reference_fired))
                 if fired]
  cols = max(1, min(3, len(shown)))
  rows = max(1, math.ceil(len(shown) / cols))
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.3 * rows + 0.6), squeeze=False,
                           sharex=True)
  for ax, result in zip(axes.flat, shown):
    ref = [(s, v) for s, _, v in result.points if v is not None]
    mine = [(s, v) for s, v, _ in result.points if v is not None]
    steps, values = zip(*ref)
    ax.fill_between(steps, [v - tolerance for v in values], [v + tolerance for v in values],
                    color="tab:orange", alpha=0.25, linewidth=0, label=f"reference ±{tolerance}")
    ax.plot(steps, values, color="tab:orange", marker="." if len(ref) < 50 else None,
            label=f"reference: {_label(reference.path)}")
    ax.plot(*zip(*mine), color="tab:blue", marker="." if len(mine) < 50 else None,
            label=f"ours: {_label(ours.path)}")
    for side, color, alarm, step in first_fired:
      ax.axvline(step, color=color, linestyle="--", linewidth=1,
                 label=f"{side}: {alarm} fired (step {step})")
    verdict = ("not comparable" if not result.comparable else
               "within" if result.within else "OUTSIDE")
    ax.set_title(f"{result.metric}\nmax |Δ| {result.max_abs_delta:.4g} at step {result.step} "
                 f"({verdict})", fontsize=8,
                 color="tab:red" if result.within is False else "black")
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
  axes.flat[0].set_xlim(min(all_steps), max(all_steps))  # shared: every panel spans both runs
  for ax in axes.flat[len(shown):]:
    ax.set_visible(False)
  if shown:
    axes.flat[0].legend(fontsize=7)
  title = f"ours: {_label(ours.path)}  vs  reference: {_label(reference.path)}"
  if len(comparison.metrics) > len(shown):
    title += (f"\n{len(shown)} of {len(comparison.metrics)} compared metrics (narrow with "
              "--metrics)")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  return fig, len(shown)


def plot(path: str, ours: Source, reference: Source, comparison: Comparison, tolerance: float
         ) -> int:
  """Writes figure(...) as one PNG at `path`; returns the panels drawn."""
  import matplotlib.pyplot as plt

  fig, shown = figure(ours, reference, comparison, tolerance)
  try:
    with epath.Path(path).open("wb") as f:
      fig.savefig(f, dpi=110, format="png")
  finally:
    plt.close(fig)
  return shown


def _value(v: float | None) -> str:
  return MISSING if v is None else f"{v:.4f}"


def _verdict(r: MetricResult, tolerance: float) -> str:
  if not r.comparable:
    return "NOT COMPARABLE"
  return f"{'within' if r.within else 'OUTSIDE'} ±{tolerance}"


def _spike_lines(found: list[spikes.Spike], rule: spikes.Rule) -> list[str]:
  """Ours' spikes, a line per step (the first MAX_LISTED) and its inspect command."""
  steps = sorted({s.step for s in found})
  counted = f"{len(steps)} step{'s' if len(steps) > 1 else ''}"
  lines = [f"spikes in ours ({counted}: ce_loss or grad_norm more than {rule.sigma:g}σ above "
           f"the mean of its previous {rule.window} logged values):"]
  for step in steps[:MAX_LISTED]:
    at = [s for s in found if s.step == step]
    lines.append(f"  step {step}: " + ", ".join(
        f"{s.metric} {s.value:.4g} (mean {s.mean:.4g}, +{s.sigmas:.3g}σ)" for s in at))
    if at[0].command:
      lines.append(f"    {at[0].command}")
  if len(steps) > MAX_LISTED:
    lines.append(f"  … ({len(steps) - MAX_LISTED} more steps: --json lists all)")
  return lines


def report(ours: Source, reference: Source, comparison: Comparison, tolerance: float,
           per_step: bool = False) -> str:
  results = comparison.metrics
  lines = [f"ours:      {ours.path}", f"reference: {reference.path}"]
  if results:
    width = max(len("metric"), *(len(r.metric) for r in results))
    lines.append(f"{'metric'.ljust(width)}  {'steps':>6}  {'ours only':>9}  {'ref only':>8}  "
                 f"{'max |Δ|':>9}  {'at step':>8}  {'ours':>10}  {'reference':>10}  verdict")
    for r in results:
      lines.append(f"{r.metric.ljust(width)}  {r.steps:>6}  {r.ours_only:>9}  "
                   f"{r.reference_only:>8}  {r.max_abs_delta:>9.4f}  {r.step:>8}  "
                   f"{r.ours:>10.4f}  {r.reference:>10.4f}  {_verdict(r, tolerance)}")
  if noted := [r for r in results if r.note]:
    lines.append("held-out CE in OLMo-core's definition (docs/evaluation.md#held-out-ce-olmo3-"
                 "and-olmo-core):")
    lines.extend(f"  {r.metric}: {'' if r.comparable else 'not comparable: '}{r.note}"
                 for r in noted)
  if comparison.alarms:
    width = max(len("alarm"), *(len(a.alarm) for a in comparison.alarms))
    lines.append(f"{'alarm'.ljust(width)}  ours: ... | reference: ... | verdict")
    for a in comparison.alarms:
      verdict = {True: "agree", False: "DIFFERS", None: "not compared"}[a.agree]
      lines.append(f"{a.alarm.ljust(width)}  ours: {_steps_text(a.ours_fired, a.ours_evaluations)}"
                   f" | reference: "
                   f"{_steps_text(a.reference_fired, a.reference_evaluations)} | {verdict}")
  if comparison.spikes:
    lines.extend(_spike_lines(comparison.spikes, comparison.spike_rule))
  lines.extend(ruler_scores.comparison_lines(ours.series, reference.series))
  for title, names in (("not in ours", comparison.not_in_ours),
                       ("not in reference", comparison.not_in_reference),
                       ("no common steps", comparison.no_common_steps)):
    if names:
      lines.append(f"{title} ({len(names)}): {_listing(names)}")
  if per_step:
    for r in results:
      lines.append(f"{r.metric}: {'step':>8}  {'ours':>10}  {'reference':>10}  {'|Δ|':>9}")
      pad = " " * (len(r.metric) + 2)
      for step, a, b in r.points:
        delta = MISSING if a is None or b is None else f"{abs(a - b):.4f}"
        lines.append(f"{pad}{step:>8}  {_value(a):>10}  {_value(b):>10}  {delta:>9}")
  s = comparison.summary
  line = (f"{s.metrics_outside} of {s.metrics} metrics outside ±{tolerance} "
          f"({s.comparisons_outside} of {s.comparisons} comparisons differ by more than "
          f"{tolerance})")
  if s.alarms:
    line += f"; {s.alarms_differ} of {s.alarms} alarms fired in one run only"
  if s.not_comparable:
    line += f"; {s.not_comparable} not comparable (not judged)"
  lines.append(line)
  return "\n".join(lines)


def _jsonable(value: Any) -> Any:
  """JSON has no NaN or infinity: those become strings, so the document stays valid."""
  if isinstance(value, float) and not math.isfinite(value):
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
  if isinstance(value, dict):
    return {k: _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  return value


def as_json(ours: Source, reference: Source, comparison: Comparison, tolerance: float) -> str:
  document = {"ours": ours.path, "reference": reference.path, "tolerance": tolerance,
              **dataclasses.asdict(comparison),
              "summary": dataclasses.asdict(comparison.summary)}
  return json.dumps(_jsonable(document), indent=1, allow_nan=False)


def _regex(text: str) -> re.Pattern[str]:
  try:
    return re.compile(text)
  except re.error as e:
    raise argparse.ArgumentTypeError(f"not a regular expression ({e})") from None


def _positive(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
  return value


def main(argv: list[str] | None = None) -> int:
  parser = program.parser("python -m olmo3.eval.compare", __doc__)
  parser.add_argument("ours", help="run workdir, metrics.jsonl, .jsonl or .csv")
  parser.add_argument("reference", help="run workdir, metrics.jsonl, .jsonl or .csv")
  parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
  parser.add_argument("--metrics", type=_regex, default=DEFAULT_METRICS,
                      help="regex searched in our metric names (default: %(default)s)")
  parser.add_argument("--plot", default=None, help="write a PNG of the compared curves")
  parser.add_argument("--json", action="store_true",
                      help="print the report, summary included, as one JSON document")
  parser.add_argument("--per_step", action="store_true",
                      help="also print each compared metric at every step either side logged")
  parser.add_argument("--ai2_eval_batch_size", type=_positive, default=None,
                      help="documents per evaluation batch of the OLMo-core run, all ranks "
                      "together (AI2's 7B: 2 per GPU): which documents its held-out CE left out")
  parser.add_argument("--ai2_eval_epoch", type=_positive, default=1,
                      help="its evaluation loader's shuffle epoch: 1, or with OLMo-core before "
                      "2.6 the evaluation's ordinal since the job started (default: 1)")
  parser.add_argument("--spike_sigma", type=float, default=None,
                      help="a step of ours whose ce_loss or grad_norm exceeds the mean of the "
                      "previous logged values in the run's skip window by this many standard "
                      f"deviations is a spike (default: the run's optimizer.spike_sigma, else "
                      f"{spikes.SIGMA})")
  args = parser.parse_args(argv)
  if args.spike_sigma is not None and not args.spike_sigma > 0:
    parser.error(f"--spike_sigma {args.spike_sigma}: must be > 0")
  try:
    ours, reference = load(args.ours), load(args.reference)
    comparison = compare(ours, reference, args.tolerance, args.metrics,
                         OlmoCoreEvaluation(args.ai2_eval_batch_size, args.ai2_eval_epoch),
                         args.spike_sigma)
    if args.plot and not comparison.metrics:
      raise CompareError(f"--plot {args.plot}: no metric to draw (the sources share alarms "
                         "only)")
  except (CompareError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(as_json(ours, reference, comparison, args.tolerance))
  else:
    print(report(ours, reference, comparison, args.tolerance, args.per_step))
  if args.plot:
    try:
      shown = plot(args.plot, ours, reference, comparison, args.tolerance)
    except OSError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    total = len(comparison.metrics)
    # With --json, stdout holds the JSON document alone.
    print(f"wrote {args.plot}" + (f" ({shown} of {total} metrics; narrow with --metrics)"
                                  if shown < total else ""),
          file=sys.stderr if args.json else sys.stdout)
  summary = comparison.summary
  if summary.metrics == 0 and summary.alarms == 0:  # all shown, none judged: no verdict
    print(f"error: nothing was judged: {summary.not_comparable} metrics are not comparable "
          "(their notes say why)", file=sys.stderr)
    return 2
  return 0 if summary.ok else 1


if __name__ == "__main__":
  sys.exit(program.reported(main, lambda: ())())  # Ctrl-C and settings: one line
