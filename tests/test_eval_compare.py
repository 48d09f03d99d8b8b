"""`python -m olmo3.eval.compare`: a run against AI2's in-loop numbers (CSV / JSONL in OLMo-core's
names, W&B exports) or another run, the ±tolerance verdict, exit codes, the plot, the name
table against OLMo-core's own, held-out CE in OLMo-core's definition against its own evaluator,
and the spikes of a run."""

import csv
import json
import math
import os

import numpy as np
import pytest

from olmo3.eval import compare, metric_series, spikes

from harness import heldout_ce_olmo_core
from tests import forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = "arc_easy_rc_5shot"
SET = "c4_en-validation"
EVAL_STEPS = (100, 200, 300)
# Our held-out set's counts: OLMo-core's batches of 8 documents keep all 40.
TOKENS, DOCUMENTS, OLMO_CORE_BATCH = 10_000.0, 40.0, ("--ai2_eval_batch_size", "8")


def _ours(step: int) -> dict[str, float]:
  """Our run's metrics at `step` (training every 50 steps, evaluations every 100)."""
  row = {"ce_loss": 3.0 - step / 1000, "loss": 3.0 - step / 1000, "lr": 1e-4}
  if step in EVAL_STEPS:
    row.update({f"eval/{SET}/ce_loss": 3.2 - step / 1000, f"eval/{SET}/ppl": 25.0,
                f"eval/{SET}/tokens": TOKENS, f"eval/{SET}/documents": DOCUMENTS,
                f"eval/{SET}/documents_left_out": 0.0,
                f"downstream/{TASK}/acc_v1": 0.3 + step / 1000,
                f"downstream/{TASK}/len_norm_v2": 0.35 + step / 1000})
  return row


def _ai2(step: int, offset: dict[str, float] | None = None) -> dict[str, float]:
  """The same numbers in AI2's names and OLMo-core's definitions (held-out CE: ours x tokens /
  (tokens + documents)), each shifted by 0.001 (within ±0.005) plus `offset`."""
  offset = offset or {}
  ours = _ours(step)
  if step in EVAL_STEPS:
    ours[f"eval/{SET}/ce_loss"] *= TOKENS / (TOKENS + DOCUMENTS)
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
  done = forked.completed("olmo3.eval.compare", [str(run), str(ref), *OLMO_CORE_BATCH],
                          dict(os.environ), timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr
  out = done.stdout
  # Steps 50..300 every 50 compared; the reference's other 24 steps are counted, not dropped.
  assert _line(out, "ce_loss").split()[1:4] == ["6", "0", "24"]
  assert _line(out, f"eval/{SET}/ce_loss").split()[1] == "3"
  for metric in ("ce_loss", f"eval/{SET}/ce_loss", f"downstream/{TASK}/acc_v1",
                 f"downstream/{TASK}/len_norm_v2"):
    assert _line(out, metric).endswith("within ±0.005")
  assert f"eval/{SET}/ppl " not in out and "throughput" not in out
  assert f"eval/{SET}/tokens " not in out and f"eval/{SET}/documents " not in out
  assert f"  eval/{SET}/ce_loss: ours × tokens / (tokens + documents), exact: OLMo-core left " \
         "out none of this set's documents (its 40 documents of 1 set in batches of 8, " \
         "shuffle epoch 1)" in out
  assert f"not in ours (1): eval/downstream/{TASK} (Brier score)" in out
  assert out.splitlines()[-1] == ("0 of 4 metrics outside ±0.005 (0 of 15 comparisons differ "
                                  "by more than 0.005)")


def test_one_metric_outside_is_named_and_exits_1(tmp_path, capsys):
  run = _write_run(tmp_path / "run")
  rows = {s: _ai2(s) for s in range(50, 301, 50)}
  rows[200] = _ai2(200, {f"eval/downstream/{TASK} (accuracy)": 0.02})
  code, out, _ = _run(capsys, run / "metrics.jsonl", _write_csv(tmp_path / "ai2.csv", rows),
                      *OLMO_CORE_BATCH)
  assert code == 1
  line = _line(out, f"downstream/{TASK}/acc_v1").split()
  assert line[1:6] == ["3", "0", "0", "0.0210", "200"] and line[-2:] == ["OUTSIDE", "±0.005"]
  assert _line(out, "ce_loss").endswith("within ±0.005")
  assert out.splitlines()[-1].startswith("1 of 4 metrics outside ±0.005 (1 of 15 comparisons")
  # A looser tolerance passes it; --metrics leaves it out.
  assert _run(capsys, run, tmp_path / "ai2.csv", "--tolerance", "0.05", *OLMO_CORE_BATCH)[0] == 0
  code, out, _ = _run(capsys, run, tmp_path / "ai2.csv", "--metrics", "ce_loss$",
                      *OLMO_CORE_BATCH)
  assert code == 0 and "downstream/" not in out and _line(out, f"eval/{SET}/ce_loss")


def test_jsonl_reference_in_ai2_and_our_names(tmp_path, capsys):
  run = _write_run(tmp_path / "run")
  with open(tmp_path / "ref.jsonl", "w") as f:
    for step in EVAL_STEPS:
      row = _ai2(step)
      row[f"downstream/{TASK}/len_norm_v2"] = row.pop(
          f"eval/downstream/{TASK} (length-normalized accuracy v2)")  # ours: passes through
      f.write(json.dumps({"step": step, **row}) + "\n")
  code, out, _ = _run(capsys, run, tmp_path / "ref.jsonl", "--json", *OLMO_CORE_BATCH)
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
                                 "not_comparable": 0, "ok": False}
  assert document["spikes"] == []
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
  downstream = {k: v for k, v in metric_series.AI2_NAMES.items()
                if k.startswith("eval/downstream/")}
  assert len(downstream) == len(labels)
  for key, label in labels.items():
    assert metric_series.to_ours(f"eval/downstream/{TASK} ({label})") == f"downstream/{TASK}/{key}"
  assert metric_series.to_ours(TRAIN_CE_LOSS_METRIC) == "ce_loss"
  # OLMo-core's LMEvaluator logs `<label>/CE loss` and `<label>/PPL` under the evaluator "lm".
  assert metric_series.to_ours(f"eval/lm/{SET}/CE loss") == f"eval/{SET}/ce_loss"
  assert metric_series.to_ours(f"eval/lm/{SET}/PPL") == f"eval/{SET}/ppl"
  assert metric_series.to_ours(f"downstream/{TASK}/acc_v1") == f"downstream/{TASK}/acc_v1"
  assert metric_series.to_ours("optim/LR (group 0)") == "optim/LR (group 0)"


# Held-out CE in two definitions (olmo3/eval/ce_definitions.py), against OLMo-core's own
# evaluator: two sets in one LMEvaluator, as AI2's v3-small sets are.
A, B = "a-validation", "b-validation"
SIZES = {A: 13, B: 12}  # 25 documents: batches of 5 keep all, of 8 leave one out


@pytest.fixture(scope="module")
def same_losses(tmp_path_factory):
  """(what olmo3 logs of two held-out sets, {(batch, epoch): ({set: CE}, {set: documents
  scored}) of OLMo-core's LMEvaluator}), both from the same per-token losses. The documents
  draw their tokens from ranges of their own (each its own mean loss, as real documents), some
  are longer than the sequence (cut), one is a lone EOS (no token predicted)."""
  from olmo3.data.tokens import write_token_file

  heldout = heldout_ce_olmo_core
  vocab, seq_len, eos = 512, 32, 0
  rng = np.random.default_rng(0)
  directory, sets = tmp_path_factory.mktemp("heldout"), {}
  for name, count in SIZES.items():
    docs = []
    for i in range(count):
      length = 0 if (name, i) == (B, 3) else int(rng.integers(1, 60))
      low = int(rng.integers(1, vocab - 64))
      docs.append(np.append(rng.integers(low, low + 64, length), eos))
    write_token_file(directory / f"{name}.npy", np.concatenate(docs))
    sets[name] = [str(directory / f"{name}.npy")]
  loss_V = rng.uniform(0.5, 9.0, vocab)
  theirs = {(batch, epoch): heldout.olmo_core_heldout(sets, seq_len, eos, vocab, loss_V, batch,
                                                      epoch, str(directory))
            for batch, epoch in ((5, 1), (8, 1), (8, 2))}
  return heldout.olmo3_heldout(sets, seq_len, eos, loss_V), theirs


def _heldout_run(workdir, ours: dict[str, dict[str, float]], keys=None):
  """A run that logged `ours` ({set: {metric: value}}, its `keys` only) at two evaluations."""
  workdir.mkdir()
  row = {f"eval/{name}/{k}": v for name, result in ours.items() for k, v in result.items()
         if keys is None or k in keys}
  row.update({f"eval/{name}/ppl": math.exp(r["ce_loss"]) for name, r in ours.items()})
  (workdir / "metrics.jsonl").write_text(
      "".join(json.dumps({"step": step, **row}) + "\n" for step in (100, 200)))
  return workdir


def _olmo_core_csv(path, ce: dict[str, float]):
  """OLMo-core's held-out CE and PPL per set, at both evaluations, in AI2's names."""
  return _write_csv(path, {step: {**{f"eval/lm/{n}/CE loss": v for n, v in ce.items()},
                                  **{f"eval/lm/{n}/PPL": math.exp(v) for n, v in ce.items()}}
                           for step in (100, 200)})


def _held_out(capsys, run, ref, *args) -> tuple[int, dict[str, dict]]:
  code, out, _ = _run(capsys, run, ref, "--json", *args)
  return code, {r["metric"]: r for r in json.loads(out)["metrics"]}


@pytest.mark.seconds(6)
def test_heldout_ce_restated_exactly_where_olmo_core_kept_every_document(tmp_path, capsys,
                                                                          same_losses):
  """Ours x tokens / (tokens + documents) is OLMo-core's CE (to its float32 sums) for every set
  its batches kept whole; a set its last partial batch cut is not comparable, and compare
  names how many documents it lost: the number OLMo-core's own loader left out."""
  ours, theirs = same_losses
  run = _heldout_run(tmp_path / "run", ours)
  for batch, cut in ((5, []), (8, [B])):
    ce, scored = theirs[(batch, 1)]
    assert [n for n in SIZES if scored[n] < SIZES[n]] == cut  # what OLMo-core's loader did
    ref = _olmo_core_csv(tmp_path / f"ai2-{batch}.csv", ce)
    code, results = _held_out(capsys, run, ref, "--tolerance", "1e-5", "--metrics", "ce_loss$",
                              "--ai2_eval_batch_size", str(batch))
    assert code == 0
    for name, size in SIZES.items():
      result = results[f"eval/{name}/ce_loss"]
      # The direct comparison this replaced: the definitions alone put them far apart.
      assert abs(ours[name]["ce_loss"] - ce[name]) > 0.05
      if name in cut:
        assert (result["comparable"], result["within"]) == (False, None)
        assert result["note"].startswith(f"OLMo-core left out {size - scored[name]} of this "
                                         f"set's {size} documents (the last partial batch of "
                                         f"its 25 documents of 2 sets in batches of {batch}")
      else:
        assert (result["comparable"], result["within"]) == (True, True), result
        assert result["max_abs_delta"] < 1e-6 and "exact" in result["note"]
  # PPL alike (exp of the restated CE; OLMo-core's float32 CE moves it by ~1e-5).
  code, results = _held_out(capsys, run, _olmo_core_csv(tmp_path / "ai2-5.csv", theirs[5, 1][0]),
                            "--tolerance", "1e-3", "--metrics", "/ppl$",
                            "--ai2_eval_batch_size", "5")
  assert code == 0 and all(results[f"eval/{n}/ppl"]["within"] for n in SIZES)


@pytest.mark.seconds(6)
def test_heldout_ce_shuffle_epoch(tmp_path, capsys, same_losses):
  """OLMo-core before 2.6 reshuffled at each evaluation of a job: its second evaluation cut
  another set. --ai2_eval_epoch 2 says which, as OLMo-core's loader does; epoch 1 would call
  that set exact and find it 0.02 off."""
  ours, theirs = same_losses
  ce, scored = theirs[(8, 2)]
  assert {n: SIZES[n] - scored[n] for n in SIZES} == {A: 1, B: 0}
  run, ref = _heldout_run(tmp_path / "run", ours), _olmo_core_csv(tmp_path / "ai2.csv", ce)
  flags = ("--tolerance", "1e-5", "--metrics", "ce_loss$", "--ai2_eval_batch_size", "8")
  _, results = _held_out(capsys, run, ref, *flags, "--ai2_eval_epoch", "2")
  assert results[f"eval/{A}/ce_loss"]["comparable"] is False
  assert results[f"eval/{B}/ce_loss"]["within"] is True
  code, results = _held_out(capsys, run, ref, *flags)
  assert code == 1 and results[f"eval/{A}/ce_loss"]["within"] is False
  assert results[f"eval/{A}/ce_loss"]["max_abs_delta"] > 0.01


def test_heldout_ce_not_comparable_says_why(tmp_path, capsys):
  """Without OLMo-core's batch size, with a set ours scored in part, without our counts (an
  older run) or with a set only OLMo-core scored: not comparable, each saying why; shown, not
  judged, and counted on the summary line. Nothing judged at all is no verdict (exit 2)."""
  ours = {A: {"ce_loss": 4.0, "tokens": 300.0, "documents": 13.0, "documents_left_out": 0.0},
          B: {"ce_loss": 5.0, "tokens": 200.0, "documents": 10.0, "documents_left_out": 2.0}}
  ref = _olmo_core_csv(tmp_path / "ai2.csv", {A: 3.9, B: 4.8, "c-validation": 3.0})
  run = _heldout_run(tmp_path / "run", ours)
  code, out, err = _run(capsys, run, ref)
  assert code == 2 and _line(out, f"eval/{A}/ce_loss").endswith("NOT COMPARABLE")
  assert err.splitlines()[-1] == ("error: nothing was judged: 2 metrics are not comparable "
                                  "(their notes say why)")
  assert out.splitlines()[-1].endswith("; 2 not comparable (not judged)")
  assert (f"  eval/{A}/ce_loss: not comparable: OLMo-core scores whole evaluation batches "
          "only, leaving out the last partial one of its shuffled documents, so its CE "
          "depends on its evaluation batch size: give --ai2_eval_batch_size; |Δ| is of ours × "
          "tokens / (tokens + documents), as if nothing were left out") in out
  assert (f"  eval/{B}/ce_loss: not comparable: ours scored 10 of the set's 12 documents "
          "(eval.max_documents, eval.min_document_tokens or train.eval_batches); OLMo-core "
          "scores them all") in out
  _, results = _held_out(capsys, run, ref, "--ai2_eval_batch_size", "1")
  assert results[f"eval/{A}/ce_loss"]["note"].startswith(
      "which documents OLMo-core left out depends on every set of its evaluation, and ours did "
      "not score c-validation")
  old = _heldout_run(tmp_path / "old", ours, keys=("ce_loss",))
  _, results = _held_out(capsys, old, ref, "--ai2_eval_batch_size", "1")
  assert results[f"eval/{A}/ce_loss"]["note"] == (
      f"ours logs no eval/{A}/tokens, documents and documents_left_out (runs before olmo3 "
      "logged them): OLMo-core divides by one more token per document, which cannot be "
      "restated without them; |Δ| is of the values as logged")
  assert results[f"eval/{A}/ce_loss"]["max_abs_delta"] == pytest.approx(0.1)


def test_heldout_ce_in_one_definition_is_compared_as_logged(tmp_path, capsys):
  """Two olmo3 runs (or two OLMo-core logs) define held-out CE alike: compared as logged. With
  the roles swapped (AI2's log as OURS), the olmo3 side, the reference, is the one restated."""
  ours = {A: {"ce_loss": 4.0, "tokens": 300.0, "documents": 20.0, "documents_left_out": 0.0}}
  run = _heldout_run(tmp_path / "run", ours)
  other = _heldout_run(tmp_path / "other", {A: {**ours[A], "ce_loss": 4.002}})
  code, results = _held_out(capsys, run, other)
  assert code == 0 and results[f"eval/{A}/ce_loss"]["note"] == ""
  assert results[f"eval/{A}/ce_loss"]["max_abs_delta"] == pytest.approx(0.002)
  ref = _olmo_core_csv(tmp_path / "ai2.csv", {A: 4.0 * 300 / 320})
  code, results = _held_out(capsys, ref, run, "--ai2_eval_batch_size", "4")
  assert code == 0 and results[f"eval/{A}/ce_loss"]["within"]
  assert results[f"eval/{A}/ce_loss"]["note"].startswith(
      "the reference × tokens / (tokens + documents), exact")


def _spiky_run(workdir, values: dict[str, list[float]]):
  workdir.mkdir()
  steps = len(next(iter(values.values())))
  (workdir / "metrics.jsonl").write_text("".join(
      json.dumps({"step": s + 1, **{k: v[s] for k, v in values.items()}}) + "\n"
      for s in range(steps)))
  return workdir


def test_spikes_are_the_optimizers_skips(tmp_path):
  """spikes.find over the logged values flags exactly the steps the optimizer's own skip rule
  (optim.should_skip over its window) skips, for the same settings."""
  import jax
  import jax.numpy as jnp

  from olmo3.config import OptimizerConfig
  from olmo3.train import optim

  cfg = OptimizerConfig(spike_sigma=3.0, spike_window=8, spike_min_history=5)
  rng = np.random.default_rng(3)
  ce = [3.0, 3.01] * 2 + [4.0] + list(3.0 + 0.05 * rng.standard_normal(35))  # 5: a spike, just
  # Eight norms of mean 1.05 and unbiased std 0.0535, then 1.205: 2.9 of those (3.1 of the
  # biased std), not a spike.
  norm = [1.0, 1.1] * 4 + [1.205] + list(1.0 + 0.1 * rng.standard_normal(31))
  ce[15], norm[20], norm[21], ce[30], ce[35] = 3.6, 2.5, 2.6, math.nan, 3.6  # one of two, NaN
  stats, skipped = jax.tree.map(jnp.asarray, optim.init_skip_stats(cfg)), []
  for step, (c, g) in enumerate(zip(ce, norm), start=1):
    skip = optim.should_skip(cfg, stats, jnp.float32(c), jnp.float32(g))
    stats = optim.record(cfg, stats, jnp.float32(c), jnp.float32(g), skip)
    if skip:
      skipped.append(step)
  # Values logged as float32, as the loop logs them.
  series = {"ce_loss": {s + 1: float(np.float32(v)) for s, v in enumerate(ce)},
            "grad_norm": {s + 1: float(np.float32(v)) for s, v in enumerate(norm)}}
  found = spikes.find(series, "runs/x", sigma=3.0, window=8, min_history=5)
  assert {5, 16, 21, 31, 36} <= set(skipped) and 9 not in skipped
  assert sorted({s.step for s in found}) == skipped
  assert found[0].command == (f"python -m olmo3.inspect_step --workdir runs/x --step {skipped[0]} "
                              "--replay --top 5")


def test_compare_points_at_the_spikes_of_ours(tmp_path, capsys):
  """The text lists each spike of ours with the inspect command for its step; --json holds
  them; a lower --spike_sigma finds smaller jumps; a source that is not a run gets no
  command."""
  ce = [3.0 + 0.01 * (i % 3) for i in range(100)]
  ce[80] = 3.5
  norm = [1.0 + 0.01 * (i % 5) for i in range(100)]
  norm[90] = 1.06  # 2.8 standard deviations: a spike for --spike_sigma 2 only
  run = _spiky_run(tmp_path / "run", {"ce_loss": ce, "grad_norm": norm})
  code, out, _ = _run(capsys, run, run)
  assert code == 0
  lines = out.splitlines()
  start = lines.index("spikes in ours (1 step: ce_loss or grad_norm more than 6σ above the "
                      "mean of its previous 128 logged values):")
  assert lines[start + 1].startswith("  step 81: ce_loss 3.5 (mean 3.01, +")
  assert lines[start + 2] == (f"    python -m olmo3.inspect_step --workdir {run} --step 81 --replay "
                              "--top 5")
  code, out, _ = _run(capsys, run, run, "--json", "--spike_sigma", "2")
  found = json.loads(out)["spikes"]
  assert [(s["step"], s["metric"]) for s in found] == [(81, "ce_loss"), (91, "grad_norm")]
  assert found[1]["command"].endswith("--step 91 --replay --top 5")
  plain = tmp_path / "ours.jsonl"
  plain.write_text((run / "metrics.jsonl").read_text())
  code, out, _ = _run(capsys, plain, run, "--json")
  assert [s["command"] for s in json.loads(out)["spikes"]] == [None]
  # The run's own skip rule: its experiment's 3σ over 8 steps finds the grad-norm jump too
  from olmo3.config import Experiment, OptimizerConfig
  from olmo3.run import record

  exp = Experiment(optimizer=OptimizerConfig(spike_sigma=3.0, spike_window=8,
                                             spike_min_history=5))
  record.write_experiment(str(run), exp.to_dict())
  code, out, _ = _run(capsys, run, run)
  assert any(line.startswith("spikes in ours (") and line.endswith(
      "more than 3σ above the mean of its previous 8 logged values):")
      for line in out.splitlines()), out
