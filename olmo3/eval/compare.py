"""python -m olmo3.eval.compare OURS REFERENCE [--tolerance 0.005] [--metrics REGEX]
                              [--plot FILE.png] [--json]

Compares a run's metrics with a reference at matching steps: AI2's released in-loop numbers, a
W&B export, or another run. Each of OURS and REFERENCE is a run workdir (its metrics.jsonl), a
.jsonl file (one object per step, with "step") or a .csv file (a `step`, `Step` or `_step`
column and one column per metric; an empty cell means "not logged at this step").

AI2's names (OLMo-core's trainer: `train/CE loss`, `eval/lm/<set>/CE loss`,
`eval/downstream/<task> (<label>)`) are translated to ours (`ce_loss`, `eval/<set>/ce_loss`,
`downstream/<task>/<key>`); names already in our form pass through, other names are kept and
listed as "not in ours". --metrics (a regex searched in our names) selects what is compared; by
default training CE, held-out CE and downstream metrics (not PPL: it is exp(CE)).

For each metric in both: the steps compared, the largest |ours - reference| and its step, and
whether it is within ±tolerance (the TPU reproduction matched AI2 within ±0.005). --plot draws a
panel per compared metric: both curves and the ±tolerance band around the reference.
Exit status: 0 all within, 1 any metric outside, 2 unreadable input or nothing to compare.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import re
import sys

DEFAULT_TOLERANCE = 0.005
DEFAULT_METRICS = r"^(ce_loss$|eval/(?!.*/ppl$)|downstream/)"
STEP_COLUMNS = ("step", "Step", "_step")  # ours and W&B's panel and history exports
MAX_PANELS = 12
MAX_LISTED = 10  # names per "not in ..." line of the text report; --json lists all

# AI2's metric names (OLMo-core's trainer and evaluator callbacks) -> ours; `{}` is the held-out
# set or task label. The downstream labels are OLMo-core's DownstreamEvaluator.metric_type_to_label
# (tests/test_eval_compare.py checks them against it); the keys are OLMo-core's metric types.
AI2_NAMES = {
    "train/CE loss": "ce_loss",
    "eval/lm/{}/CE loss": "eval/{}/ce_loss",
    "eval/lm/{}/PPL": "eval/{}/ppl",
    "eval/downstream/{} (F1 score)": "downstream/{}/f1_v1",
    "eval/downstream/{} (accuracy)": "downstream/{}/acc_v1",
    "eval/downstream/{} (length-normalized accuracy)": "downstream/{}/len_norm_v1",
    "eval/downstream/{} (PMI-DC accuracy)": "downstream/{}/pmi_dc_v1",
    "eval/downstream/{} (CE loss)": "downstream/{}/ce_loss_v1",
    "eval/downstream/{} (BPB)": "downstream/{}/bpb_v1",
    "eval/downstream/{} (soft loss)": "downstream/{}/soft_v1",
    "eval/downstream/{} (log soft loss)": "downstream/{}/soft_log_v1",
    "eval/downstream/{} (F1 score v2)": "downstream/{}/f1_v2",
    "eval/downstream/{} (accuracy v2)": "downstream/{}/acc_v2",
    "eval/downstream/{} (length-normalized accuracy v2)": "downstream/{}/len_norm_v2",
    "eval/downstream/{} (PMI-DC accuracy v2)": "downstream/{}/pmi_dc_v2",
    "eval/downstream/{} (CE loss v2)": "downstream/{}/ce_loss_v2",
    "eval/downstream/{} (BPB v2)": "downstream/{}/bpb_v2",
    "eval/downstream/{} (soft loss v2)": "downstream/{}/soft_v2",
    "eval/downstream/{} (log soft loss v2)": "downstream/{}/soft_log_v2",
}
_AI2_PATTERNS = [(re.compile("^" + r"(.+)".join(map(re.escape, theirs.split("{}"))) + "$"), ours)
                 for theirs, ours in AI2_NAMES.items()]


class CompareError(Exception):
  """Input that cannot be compared; the message names the file."""


@dataclasses.dataclass
class Source:
  path: str  # the file read
  series: dict[str, dict[int, float]]  # our metric name -> step -> value


@dataclasses.dataclass
class MetricResult:
  metric: str
  steps: int  # steps where both have a value
  max_abs_delta: float
  step: int  # where max_abs_delta occurs
  ours: float
  reference: float
  within: bool
  outside_steps: int  # steps whose |delta| exceeds the tolerance


@dataclasses.dataclass
class Comparison:
  metrics: list[MetricResult]
  not_in_ours: list[str]
  not_in_reference: list[str]
  no_common_steps: list[str]


def to_ours(name: str) -> str:
  """Our name for an AI2 metric name; any other name unchanged."""
  for pattern, ours in _AI2_PATTERNS:
    if match := pattern.match(name):
      return ours.format(*match.groups())
  return name


def _number(text: str, where: str) -> float:
  try:
    return float(text)
  except ValueError:
    raise CompareError(f"{where}: {text!r} is not a number") from None


def _step(value: object, where: str) -> int:
  step = _number(str(value), where)
  if not step.is_integer():
    raise CompareError(f"{where}: step {value!r} is not an integer")
  return int(step)


def _csv_metric(column: str) -> str | None:
  """The metric a CSV column holds, or None for a column that holds none: W&B's bookkeeping
  (`_runtime`, `_timestamp`, a pandas index without a name) and a panel export's `__MIN` /
  `__MAX` columns (the range of the points it merged into one). A panel export's columns are
  `<run name> - <metric>`."""
  if not column or column.startswith("_") or column.endswith(("__MIN", "__MAX")):
    return None
  return column.rsplit(" - ", 1)[-1]


def _read_csv(path: str) -> dict[int, dict[str, float]]:
  with open(path, newline="") as f:
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None:
      raise CompareError(f"{path}: empty file")
    step_column = next((header.index(c) for c in STEP_COLUMNS if c in header), None)
    if step_column is None:
      raise CompareError(f"{path}: no step column (one of {', '.join(STEP_COLUMNS)}) in its "
                         f"header {header[:8]}")
    metrics = {i: m for i, column in enumerate(header)
               if i != step_column and (m := _csv_metric(column)) is not None}
    seen: dict[str, str] = {}
    for i, metric in metrics.items():
      if metric in seen:
        raise CompareError(f"{path}: columns {seen[metric]!r} and {header[i]!r} both hold "
                           f"{metric!r} (export one run)")
      seen[metric] = header[i]
    rows: dict[int, dict[str, float]] = {}
    for row in reader:
      if not any(cell.strip() for cell in row):
        continue
      where = f"{path} line {reader.line_num}"
      if len(row) != len(header):
        raise CompareError(f"{where}: {len(row)} cells, the header has {len(header)}")
      values = rows.setdefault(_step(row[step_column], f"{where} column {header[step_column]!r}"),
                               {})
      for i, metric in metrics.items():
        if row[i].strip():
          values[metric] = _number(row[i], f"{where} column {header[i]!r}")
  return rows


def _read_jsonl(path: str) -> dict[int, dict[str, float]]:
  with open(path) as f:
    lines = f.readlines()
  rows: dict[int, dict[str, float]] = {}
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    where = f"{path} line {number}"
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      if number == len(lines) and not line.endswith("\n"):
        break  # a run writing (or killed while writing) its last line: compare what is complete
      raise CompareError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(record, dict):
      raise CompareError(f"{where}: not a JSON object")
    key = next((k for k in STEP_COLUMNS if k in record), None)
    if key is None:
      raise CompareError(f"{where}: no \"step\"")
    # A resumed run logs the steps after its last checkpoint again: the later values stand.
    values = rows.setdefault(_step(record[key], where), {})
    for name, value in record.items():
      if name in STEP_COLUMNS or name.startswith("_"):  # W&B's `_runtime`, `_timestamp`, ...
        continue
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CompareError(f"{where}: {name} = {json.dumps(value)[:40]} is not a number")
      values[name] = float(value)
  return rows


def load(path: str) -> Source:
  """A workdir's metrics.jsonl, a .jsonl or a .csv file, with AI2's names translated to ours."""
  file = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
  if not os.path.isfile(file):
    raise CompareError(f"{file}: not found")
  try:
    rows = _read_csv(file) if file.lower().endswith(".csv") else _read_jsonl(file)
  except UnicodeDecodeError:
    raise CompareError(f"{file}: not a text file") from None
  translated: dict[str, str] = {}  # ours -> the name in the file
  series: dict[str, dict[int, float]] = {}
  for step in sorted(rows):
    for name, value in rows[step].items():
      ours = to_ours(name)
      if translated.setdefault(ours, name) != name:
        raise CompareError(f"{file}: {translated[ours]!r} and {name!r} are both {ours!r}")
      series.setdefault(ours, {})[step] = value
  if not series:
    raise CompareError(f"{file}: no metrics")
  return Source(file, series)


def compare(ours: Source, reference: Source, tolerance: float,
            metrics: re.Pattern[str] = re.compile(DEFAULT_METRICS)) -> Comparison:
  """Per metric, the largest |ours - reference| over the steps both logged."""
  mine = {m for m in ours.series if metrics.search(m)}
  theirs = {m for m in reference.series if metrics.search(m)}
  results, no_common = [], []
  for metric in sorted(mine & theirs):
    a, b = ours.series[metric], reference.series[metric]
    steps = sorted(set(a) & set(b))
    if not steps:
      no_common.append(metric)
      continue
    delta = {s: abs(a[s] - b[s]) for s in steps}
    # NaN (OLMo-core logs it for a held-out set it did not reach) is never within tolerance.
    outside = sum(not d <= tolerance for d in delta.values())
    worst = max(steps, key=lambda s: math.inf if math.isnan(delta[s]) else delta[s])
    results.append(MetricResult(metric, len(steps), delta[worst], worst, a[worst], b[worst],
                                not outside, outside))
  if not results:
    if no_common:
      raise CompareError(
          f"{ours.path} and {reference.path} have no steps in common for the {len(no_common)} "
          f"metrics both hold (ours: steps {_span(ours, no_common)}; reference: steps "
          f"{_span(reference, no_common)})")
    raise CompareError(f"{ours.path} and {reference.path} have no metrics in common"
                       f"{'' if metrics.pattern == DEFAULT_METRICS else ' matching --metrics'}"
                       f" (reference: {_listing(sorted(theirs or reference.series))})")
  return Comparison(results, sorted(theirs - mine), sorted(mine - theirs), no_common)


def _span(source: Source, metrics: list[str]) -> str:
  steps = [s for m in metrics for s in source.series[m]]
  return f"{min(steps)}–{max(steps)}"


def _listing(names: list[str]) -> str:
  more = len(names) - MAX_LISTED
  return ", ".join(names[:MAX_LISTED]) + (f", … ({more} more)" if more > 0 else "")


def _label(path: str) -> str:
  if os.path.basename(path) == "metrics.jsonl":
    return os.path.basename(os.path.dirname(os.path.abspath(path)))
  return os.path.basename(path)


def plot(path: str, ours: Source, reference: Source, comparison: Comparison, tolerance: float
         ) -> int:
  """One PNG, a panel per compared metric, up to MAX_PANELS: the others by name, then the
  downstream ones (dozens per suite, which would crowd out the loss curves). Returns the count."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  shown = sorted(comparison.metrics,
                 key=lambda r: (r.metric.startswith("downstream/"), r.metric))[:MAX_PANELS]
  cols = min(3, len(shown))
  rows = math.ceil(len(shown) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.3 * rows), squeeze=False)
  for ax, result in zip(axes.flat, shown):
    ref = sorted(reference.series[result.metric].items())
    steps, values = zip(*ref)
    ax.fill_between(steps, [v - tolerance for v in values], [v + tolerance for v in values],
                    color="tab:orange", alpha=0.25, linewidth=0, label=f"reference ±{tolerance}")
    ax.plot(steps, values, color="tab:orange", marker="." if len(ref) < 50 else None,
            label=f"reference: {_label(reference.path)}")
    ax.plot(*zip(*sorted(ours.series[result.metric].items())), color="tab:blue",
            marker="." if len(ours.series[result.metric]) < 50 else None,
            label=f"ours: {_label(ours.path)}")
    verdict = "within" if result.within else "OUTSIDE"
    ax.set_title(f"{result.metric}\nmax |Δ| {result.max_abs_delta:.4g} at step {result.step} "
                 f"({verdict})", fontsize=8, color="black" if result.within else "tab:red")
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
  for ax in axes.flat[len(shown):]:
    ax.set_visible(False)
  axes.flat[0].legend(fontsize=7)
  if len(comparison.metrics) > len(shown):
    fig.suptitle(f"{len(shown)} of {len(comparison.metrics)} compared metrics (narrow with "
                 "--metrics)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return len(shown)


def report(ours: Source, reference: Source, comparison: Comparison, tolerance: float) -> str:
  results = comparison.metrics
  width = max(len("metric"), *(len(r.metric) for r in results))
  lines = [f"ours:      {ours.path}", f"reference: {reference.path}",
           f"{'metric'.ljust(width)}  {'steps':>6}  {'max |Δ|':>9}  {'at step':>8}  "
           f"{'ours':>10}  {'reference':>10}  verdict"]
  for r in results:
    lines.append(f"{r.metric.ljust(width)}  {r.steps:>6}  {r.max_abs_delta:>9.4f}  {r.step:>8}  "
                 f"{r.ours:>10.4f}  {r.reference:>10.4f}  "
                 f"{'within' if r.within else 'OUTSIDE'} ±{tolerance}")
  for title, names in (("not in ours", comparison.not_in_ours),
                       ("not in reference", comparison.not_in_reference),
                       ("no common steps", comparison.no_common_steps)):
    if names:
      lines.append(f"{title} ({len(names)}): {_listing(names)}")
  outside = sum(not r.within for r in results)
  lines.append(f"{outside} of {len(results)} metrics outside ±{tolerance} "
               f"({sum(r.outside_steps for r in results)} of {sum(r.steps for r in results)} "
               f"comparisons differ by more than {tolerance})")
  return "\n".join(lines)


def _regex(text: str) -> re.Pattern[str]:
  try:
    return re.compile(text)
  except re.error as e:
    raise argparse.ArgumentTypeError(f"not a regular expression ({e})") from None


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m olmo3.eval.compare", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("ours", help="run workdir, metrics.jsonl, .jsonl or .csv")
  parser.add_argument("reference", help="run workdir, metrics.jsonl, .jsonl or .csv")
  parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
  parser.add_argument("--metrics", type=_regex, default=DEFAULT_METRICS,
                      help="regex searched in our metric names (default: %(default)s)")
  parser.add_argument("--plot", default=None, help="write a PNG of the compared curves")
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  args = parser.parse_args(argv)
  try:
    ours, reference = load(args.ours), load(args.reference)
    comparison = compare(ours, reference, args.tolerance, args.metrics)
  except (CompareError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps({"ours": ours.path, "reference": reference.path,
                      "tolerance": args.tolerance, **dataclasses.asdict(comparison)}, indent=1))
  else:
    print(report(ours, reference, comparison, args.tolerance))
  if args.plot:
    try:
      shown = plot(args.plot, ours, reference, comparison, args.tolerance)
    except OSError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    total = len(comparison.metrics)
    print(f"wrote {args.plot}" + (f" ({shown} of {total} metrics; narrow with --metrics)"
                                  if shown < total else ""),
          file=sys.stderr if args.json else sys.stdout)
  return 0 if all(r.within for r in comparison.metrics) else 1


if __name__ == "__main__":
  sys.exit(main())
