"""Per-step metric sources for `python -m olmo3.eval.compare`: a run workdir's metrics.jsonl, a
.jsonl file (one object per step) or a .csv file (a step column and one column per metric: ours,
W&B's history and panel exports), read into one series per metric, with AI2's metric names
(OLMo-core's trainer and evaluators) translated to ours."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re

from etils import epath

STEP_COLUMNS = ("step", "Step", "_step")  # ours and W&B's panel and history exports

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


@dataclasses.dataclass(frozen=True)
class Source:
  path: str  # the file read
  series: dict[str, dict[int, float]]  # our metric name -> step -> value
  # Our names of the metrics the file holds under AI2's (OLMo-core's) names: those are in
  # OLMo-core's definitions (held-out CE: olmo3/eval/ce_definitions.py).
  olmo_core: frozenset[str] = frozenset()


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


def _read_csv(path: str, text: str) -> dict[int, dict[str, float]]:
  reader = csv.reader(io.StringIO(text, newline=""))
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


def _read_jsonl(path: str, text: str) -> dict[int, dict[str, float]]:
  lines = text.splitlines(keepends=True)
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
  """A workdir's metrics.jsonl, a .jsonl or a .csv file (local or a URL epath reads), with
  AI2's names translated to ours."""
  file = epath.Path(path)
  if file.is_dir():
    file = file / "metrics.jsonl"
  if not file.is_file():
    raise CompareError(f"{file}: not found")
  try:
    text = file.read_text()
  except UnicodeDecodeError:
    raise CompareError(f"{file}: not a text file") from None
  rows = (_read_csv if file.name.lower().endswith(".csv") else _read_jsonl)(str(file), text)
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
  return Source(str(file), series,
                frozenset(ours for ours, name in translated.items() if name != ours))
