"""`python -m olmo3.eval.compare`: a run against AI2's in-loop numbers (CSV / JSONL in OLMo-core's
names, W&B exports) or another run, the ±tolerance verdict, exit codes, the plot, and the name
table against OLMo-core's own."""

import csv
import json
import math
import os
import subprocess
import sys

import pytest

from olmo3.eval import compare, metric_sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = "arc_easy_rc_5shot"
SET = "c4_en-validation"
EVAL_STEPS = (100, 200, 300)


def _ours(step: int) -> dict[str, float]:
  """Our run's metrics at `step` (training every 50 steps, evaluations every 100)."""
  row = {"ce_loss": 3.0 - step / 1000, "loss": 3.0 - step / 1000, "lr": 1e-4}
  if step in EVAL_STEPS:
    row.update({f"eval/{SET}/ce_loss": 3.2 - step / 1000, f"eval/{SET}/ppl": 25.0,
                f"downstream/{TASK}/acc_v1": 0.3 + step / 1000,
                f"downstream/{TASK}/len_norm_v2": 0.35 + step / 1000})
  return row


def _ai2(step: int, offset: dict[str, float] | None = None) -> dict[str, float]:
  """The same numbers in AI2's names, each shifted by 0.001 (within ±0.005) plus `offset`."""
  offset = offset or {}
  ours = _ours(step)
  names = {"ce_loss": "train/CE loss", f"eval/{SET}/ce_loss": f"eval/lm/{SET}/CE loss",
           f"downstream/{TASK}/acc_v1": f"eval/downstream/{TASK} (accuracy)",
           f"downstream/{TASK}/len_norm_v2":
               f"eval/downstream/{TASK} (length-normalized accuracy v2)"}
  row = {theirs: ours[mine] + 0.001 + offset.get(theirs, 0.0)
         for mine, theirs in names.items() if mine in ours}
  if step in EVAL_STEPS:
    row[f"eval/lm/{SET}/PPL"] = 99.0  # exp(CE): not compared by default
    row[f"eval/downstream/{TASK} (Brier score)"] = 0.1  # a label OLMo-core does not have
  row["throughput/total tokens"] = step * 1000.0
  return row


def _write_run(workdir, steps=range(50, 301, 50)):
  workdir.mkdir()
  with open(workdir / "metrics.jsonl", "w") as f:
    for step in steps:
      f.write(json.dumps({"step": step, **_ours(step)}) + "\n")
  return workdir


def _write_csv(path, rows: dict[int, dict[str, float]], step_column="step", extra=()):
  columns = sorted({k for r in rows.values() for k in r})
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow([*extra, step_column, *columns])
    for step, row in rows.items():
      writer.writerow([*("1" for _ in extra), step, *(row.get(c, "") for c in columns)])
  return path


def _run(capsys, *args) -> tuple[int, str, str]:
  code = compare.main([str(a) for a in args])
  out, err = capsys.readouterr()
  return code, out, err


def _line(out: str, metric: str) -> str:
  return next(line for line in out.splitlines() if line.startswith(metric + " "))


@pytest.mark.slow(seconds=2)
def test_ai2_csv_within_tolerance(tmp_path):
  run = _write_run(tmp_path / "run")
  # Training CE every 10 steps, evaluations every 100: empty cells elsewhere.
  ref = _write_csv(tmp_path / "ai2.csv", {s: _ai2(s) for s in range(10, 301, 10)})
  done = subprocess.run([sys.executable, "-m", "olmo3.eval.compare", str(run), str(ref)],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr
  out = done.stdout
  # Steps 50..300 every 50 compared; the reference's other 24 steps are counted, not dropped.
  assert _line(out, "ce_loss").split()[1:4] == ["6", "0", "24"]
  assert _line(out, f"eval/{SET}/ce_loss").split()[1] == "3"
  for metric in ("ce_loss", f"eval/{SET}/ce_loss", f"downstream/{TASK}/acc_v1",
                 f"downstream/{TASK}/len_norm_v2"):
    assert _line(out, metric).endswith("within ±0.005")
  assert f"eval/{SET}/ppl " not in out and "throughput" not in out
  assert f"not in ours (1): eval/downstream/{TASK} (Brier score)" in out
  assert out.splitlines()[-1] == ("0 of 4 metrics outside ±0.005 (0 of 15 comparisons differ "
                                  "by more than 0.005)")


def test_one_metric_outside_is_named_and_exits_1(tmp_path, capsys):
  run = _write_run(tmp_path / "run")
  rows = {s: _ai2(s) for s in range(50, 301, 50)}
  rows[200] = _ai2(200, {f"eval/downstream/{TASK} (accuracy)": 0.02})
  code, out, _ = _run(capsys, run / "metrics.jsonl", _write_csv(tmp_path / "ai2.csv", rows))
  assert code == 1
  line = _line(out, f"downstream/{TASK}/acc_v1").split()
  assert line[1:6] == ["3", "0", "0", "0.0210", "200"] and line[-2:] == ["OUTSIDE", "±0.005"]
  assert _line(out, "ce_loss").endswith("within ±0.005")
  assert out.splitlines()[-1].startswith("1 of 4 metrics outside ±0.005 (1 of 15 comparisons")
  # A looser tolerance passes it; --metrics leaves it out.
  assert _run(capsys, run, tmp_path / "ai2.csv", "--tolerance", "0.05")[0] == 0
  code, out, _ = _run(capsys, run, tmp_path / "ai2.csv", "--metrics", "ce_loss$")
  assert code == 0 and "downstream/" not in out and _line(out, f"eval/{SET}/ce_loss")


def test_jsonl_reference_in_ai2_and_our_names(tmp_path, capsys):
  run = _write_run(tmp_path / "run")
  with open(tmp_path / "ref.jsonl", "w") as f:
    for step in EVAL_STEPS:
      row = _ai2(step)
      row[f"downstream/{TASK}/len_norm_v2"] = row.pop(
          f"eval/downstream/{TASK} (length-normalized accuracy v2)")  # ours: passes through
      f.write(json.dumps({"step": step, **row}) + "\n")
  code, out, _ = _run(capsys, run, tmp_path / "ref.jsonl", "--json")
  assert code == 0
  report = json.loads(out)  # the whole of stdout is one document
  assert report["reference"] == str(tmp_path / "ref.jsonl")
  assert {r["metric"]: r["steps"] for r in report["metrics"]} == {
      "ce_loss": 3, f"eval/{SET}/ce_loss": 3, f"downstream/{TASK}/acc_v1": 3,
      f"downstream/{TASK}/len_norm_v2": 3}
  assert all(r["within"] and r["max_abs_delta"] == pytest.approx(0.001)
             for r in report["metrics"])


def test_two_runs_and_a_run_being_written(tmp_path, capsys):
  a = _write_run(tmp_path / "a")
  b = _write_run(tmp_path / "b", steps=range(100, 201, 50))
  with open(b / "metrics.jsonl", "a") as f:
    f.write('{"step": 250, "ce_lo')  # the line a live (or killed) run is writing
  code, out, _ = _run(capsys, a, b)
  assert code == 0 and _line(out, "ce_loss").split()[1:5] == ["3", "3", "0", "0.0000"]
  # Our names need no translation; training metrics beyond CE are selected on request.
  code, out, _ = _run(capsys, a, b, "--metrics", "^(lr|loss)$")
  assert code == 0 and {line.split()[0] for line in out.splitlines()[3:5]} == {"loss", "lr"}


@pytest.mark.parametrize("export", ["history", "panel"])
def test_wandb_exports(tmp_path, capsys, export):
  run = _write_run(tmp_path / "run")
  rows = {s: _ai2(s) for s in range(50, 301, 50)}
  if export == "history":
    # run.history().to_csv(): `_step`, W&B's own `_runtime`/`_timestamp` and pandas' unnamed index.
    for step, row in rows.items():
      row.update({"_runtime": step / 10, "_timestamp": 1.7e9 + step})
    ref = _write_csv(tmp_path / "history.csv", rows, step_column="_step", extra=("",))
  else:
    # A chart's CSV download: `Step`, `<run> - <metric>` and its `__MIN` / `__MAX`.
    ref = _write_csv(tmp_path / "panel.csv", {
        s: {f"OLMo3-7B - {k}{suffix}": v + (0.1 if suffix == "__MAX" else 0)
            for k, v in r.items() if k == "train/CE loss" for suffix in ("", "__MIN", "__MAX")}
        for s, r in rows.items()}, step_column="Step")
  code, out, _ = _run(capsys, run, ref)
  assert code == 0 and _line(out, "ce_loss").split()[1] == "6"
  assert "_runtime" not in out and "__M" not in out


def _bad(tmp_path, case):
  run = _write_run(tmp_path / "run")
  if case == "missing file":
    return run, tmp_path / "nope.csv", tmp_path / "nope.csv"
  if case == "missing metrics.jsonl":
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty", run, tmp_path / "empty" / "metrics.jsonl"
  if case == "no step column":
    path = tmp_path / "ai2.csv"
    path.write_text("iteration,train/CE loss\n100,2.9\n")
    return run, path, path
  if case == "non-numeric cell":
    path = tmp_path / "ai2.csv"
    path.write_text("step,train/CE loss\n100,2.9\n150,two\n")
    return run, path, f"{path} line 3 column 'train/CE loss': 'two' is not a number"
  if case == "bad jsonl line":
    path = tmp_path / "ref.jsonl"
    path.write_text('{"step": 100, "ce_loss": 2.9}\n{"step": 150,\n{"step": 200}\n')
    return run, path, f"{path} line 2: not JSON"
  if case == "two runs in one export":
    path = tmp_path / "panel.csv"
    path.write_text("Step,a - train/CE loss,b - train/CE loss\n100,2.9,2.8\n")
    return run, path, path
  if case == "no steps in common":
    path = _write_csv(tmp_path / "ai2.csv", {s: _ai2(s) for s in (1, 2, 3)})
    return run, path, f"{run / 'metrics.jsonl'} and {path} have no steps in common"
  raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing file", "missing metrics.jsonl", "no step column",
                                  "non-numeric cell", "bad jsonl line", "two runs in one export",
                                  "no steps in common"])
def test_unreadable_input_exits_2_naming_the_file(tmp_path, capsys, case):
  ours, reference, named = _bad(tmp_path, case)
  code, out, err = _run(capsys, ours, reference)
  assert code == 2 and out == ""
  assert err.startswith("error: ") and err.count("\n") == 1 and str(named) in err


def test_plot_is_a_png_of_at_most_12_panels(tmp_path, capsys):
  run = _write_run(tmp_path / "run")
  ref = _write_csv(tmp_path / "ai2.csv", {s: _ai2(s) for s in range(10, 301, 10)})
  code, out, _ = _run(capsys, run, ref, "--plot", tmp_path / "curves.png")
  assert code == 0 and out.splitlines()[-1] == f"wrote {tmp_path / 'curves.png'}"
  assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # Fourteen compared metrics: twelve are drawn, and the output says so.
  with open(run / "metrics.jsonl", "a") as f:
    for step in EVAL_STEPS:
      f.write(json.dumps({"step": step, **{f"downstream/t{i:02}/acc_v1": 0.5 for i in range(10)}})
              + "\n")
  _write_csv(ref, {s: {**_ai2(s), **{f"eval/downstream/t{i:02} (accuracy)": 0.5
                                      for i in range(10)}} for s in EVAL_STEPS})
  code, out, _ = _run(capsys, run, ref, "--plot", tmp_path / "many.png")
  assert code == 0 and "(12 of 14 metrics; narrow with --metrics)" in out
  assert (tmp_path / "many.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _write_alarm_run(workdir, fired=(), evals=(10, 20, 30, 40, 50), extra=None):
  """A memorize-like run: training CE every 5 steps, held-out CE and the gap alarm (0 / 1) at
  each evaluation, as the loop logs them; `extra` adds metrics per step."""
  workdir.mkdir()
  with open(workdir / "metrics.jsonl", "w") as f:
    for step in range(5, max(evals) + 1, 5):
      row = {"step": step, "ce_loss": 4.0 - step / 20, **(extra or {}).get(step, {})}
      if step in evals:
        row.update({"eval/embedded/ce_loss": 7.0 + step / 100,
                    "alarm/generalization_gap": float(step in fired)})
      f.write(json.dumps(row) + "\n")
  return workdir


def test_alarms_are_compared(tmp_path, capsys):
  """When and whether each run's alarms fired; one run alone firing exits 1, whatever the
  curves say; an alarm the reference does not log is shown, not judged."""
  clean = _write_alarm_run(tmp_path / "clean")
  memorize = _write_alarm_run(tmp_path / "memorize", fired=(40, 50))
  code, out, _ = _run(capsys, memorize, clean, "--tolerance", "1")  # curves within
  assert code == 1
  assert _line(out, "alarm/generalization_gap") == (
      "alarm/generalization_gap  ours: fired at 40, 50 (2 of 5) | reference: never "
      "(5 evaluations) | DIFFERS")
  assert out.splitlines()[-1].endswith("; 1 of 1 alarms fired in one run only")
  # Both fired (at other steps): they agree.
  late = _write_alarm_run(tmp_path / "late", fired=(50,))
  code, out, _ = _run(capsys, memorize, late, "--tolerance", "1")
  assert code == 0 and _line(out, "alarm/generalization_gap").endswith(
      "reference: fired at 50 (1 of 5) | agree")
  # Against a reference that logs no alarm (AI2's CSV): reported, not judged.
  ref = _write_csv(tmp_path / "ai2.csv", {s: {"train/CE loss": 4.0 - s / 20}
                                          for s in range(5, 51, 5)})
  code, out, _ = _run(capsys, memorize, ref)
  assert code == 0 and _line(out, "alarm/generalization_gap").endswith(
      "reference: not logged | not compared")
  assert out.splitlines()[-1] == ("0 of 1 metrics outside ±0.005 (0 of 10 comparisons differ "
                                  "by more than 0.005)")
  # Any alarm the runs log, not only the gap alarm; --metrics does not hide alarms.
  other = {40: {"alarm/loss_spike": 1.0}}
  code, out, _ = _run(capsys, _write_alarm_run(tmp_path / "spiky", extra=other), clean,
                      "--metrics", "^ce_loss$", "--tolerance", "1")
  assert code == 0 and _line(out, "alarm/loss_spike").endswith(
      "ours: fired at 40 (1 of 1) | reference: not logged | not compared")


def test_every_step_either_run_logged_is_aligned(tmp_path, capsys):
  """Steps only one run logged are kept (shown missing), in --per_step and in --json."""
  a = _write_run(tmp_path / "a", steps=range(50, 201, 50))
  b = _write_run(tmp_path / "b", steps=range(100, 301, 50))
  code, out, _ = _run(capsys, a, b, "--per_step")
  assert code == 0 and _line(out, "ce_loss").split()[1:4] == ["3", "1", "2"]
  table = out.splitlines()
  start = table.index(next(line for line in table if line.startswith("ce_loss: ")))
  rows = [line.split() for line in table[start + 1:start + 6]]
  assert rows == [["50", "2.9500", "—", "—"], ["100", "2.9000", "2.9000", "0.0000"],
                  ["150", "2.8500", "2.8500", "0.0000"], ["200", "2.8000", "2.8000", "0.0000"],
                  ["250", "—", "2.7500", "—"]]
  code, out, _ = _run(capsys, a, b, "--json")
  (ce,) = [r for r in json.loads(out)["metrics"] if r["metric"] == "ce_loss"]
  assert [p[0] for p in ce["points"]] == [50, 100, 150, 200, 250, 300]
  assert ce["points"][0] == [50, 2.95, None] and ce["points"][-1] == [300, None, 2.7]
  assert (ce["steps"], ce["ours_only"], ce["reference_only"]) == (3, 1, 2)


def test_json_is_one_document_with_the_summary(tmp_path, capsys):
  """Valid JSON even with --plot and a NaN (OLMo-core logs NaN for a set it did not reach):
  json.loads reads the whole of stdout, with the summary and the alarms in it."""
  ours = _write_alarm_run(tmp_path / "ours", fired=(40,))
  ref = tmp_path / "ref.jsonl"
  ref.write_text("".join(  # json.dumps writes NaN as `NaN`, which our reader (and Python's) takes
      json.dumps({"step": s, "ce_loss": 4.0 - s / 20, "alarm/generalization_gap": 0,
                  "eval/embedded/ce_loss": math.nan if s == 30 else 7.0}) + "\n"
      for s in (10, 20, 30)))
  code, out, err = _run(capsys, ours, ref, "--json", "--plot", tmp_path / "p.png")
  assert code == 1 and err.strip() == f"wrote {tmp_path / 'p.png'}"
  document = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
  assert document["summary"] == {"metrics": 2, "metrics_outside": 1, "comparisons": 6,
                                 "comparisons_outside": 3, "alarms": 1, "alarms_differ": 1,
                                 "ok": False}
  held_out = next(r for r in document["metrics"] if r["metric"] == "eval/embedded/ce_loss")
  assert held_out["max_abs_delta"] == "nan" and held_out["step"] == 30
  assert held_out["points"][2] == [30, 7.3, "nan"]
  assert document["alarms"] == [{
      "alarm": "alarm/generalization_gap", "ours_fired": [40], "reference_fired": [],
      "ours_evaluations": 5, "reference_evaluations": 3, "agree": False}]


def test_plot_has_a_title_and_marks_where_alarms_fired(tmp_path):
  """Read back from the figure: the title names both runs, every panel spans every step either
  run logged, and a dashed line stands at the step where each run's alarm first fired."""
  ours = compare.load(str(_write_alarm_run(tmp_path / "memorize", fired=(40, 50))))
  ref = compare.load(str(_write_alarm_run(tmp_path / "stage1", fired=(30,), evals=(10, 20, 30))))
  comparison = compare.compare(ours, ref, 1.0)
  fig, shown = compare.figure(ours, ref, comparison, 1.0)
  try:
    assert shown == 2
    assert fig._suptitle.get_text() == "ours: memorize  vs  reference: stage1"
    for ax in fig.axes[:shown]:
      assert ax.get_xlim() == (5, 50)
      marks = {line.get_label(): tuple(line.get_xdata()) for line in ax.get_lines()
               if line.get_linestyle() == "--"}
      assert marks == {"ours: alarm/generalization_gap fired (step 40)": (40, 40),
                       "reference: alarm/generalization_gap fired (step 30)": (30, 30)}
      curves = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()
                if line.get_linestyle() == "-"}
      if ax.get_title().startswith("ce_loss"):
        assert curves["ours: memorize"] == list(range(5, 51, 5))
        assert curves["reference: stage1"] == list(range(5, 31, 5))
  finally:
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_names_match_olmo_core():
  from olmo_core.train.callbacks.evaluator_callback import DownstreamEvaluator
  from olmo_core.train.common import TRAIN_CE_LOSS_METRIC

  labels = DownstreamEvaluator.metric_type_to_label
  downstream = {k: v for k, v in metric_sources.AI2_NAMES.items()
                if k.startswith("eval/downstream/")}
  assert len(downstream) == len(labels)
  for key, label in labels.items():
    assert metric_sources.to_ours(f"eval/downstream/{TASK} ({label})") == f"downstream/{TASK}/{key}"
  assert metric_sources.to_ours(TRAIN_CE_LOSS_METRIC) == "ce_loss"
  # OLMo-core's LMEvaluator logs `<label>/CE loss` and `<label>/PPL` under the evaluator "lm".
  assert metric_sources.to_ours(f"eval/lm/{SET}/CE loss") == f"eval/{SET}/ce_loss"
  assert metric_sources.to_ours(f"eval/lm/{SET}/PPL") == f"eval/{SET}/ppl"
  assert metric_sources.to_ours(f"downstream/{TASK}/acc_v1") == f"downstream/{TASK}/acc_v1"
  assert metric_sources.to_ours("optim/LR (group 0)") == "optim/LR (group 0)"
