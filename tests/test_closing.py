"""The closing summary reads what a run came to from its workdir alone, and a launch and a dry
run of a finished run print it through one rendering, from the same facts."""

import dataclasses
import json
import os
import shutil

import fiddle as fdl
import pytest

from launch import refs
from olmo3.config import Experiment
from olmo3.run.plan import RunPlan, Start
from olmo3.train import closing, dry_run
from olmo3.train.closing import RunSummary
from tests import forked
from tests import test_reliability as reliability
from tests.test_reliability import straight  # noqa: F401  (the trained run, shared)


def _workdir(tmp_path, rows, launches=2, committed=(4, 8)):
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "history.jsonl").write_text("".join(
      json.dumps({"launch": n + 1, "revision": 0, "start_step": 0, "config": "config.json",
                  "experiment": "experiment.json", "command": [], "time": "t"}) + "\n"
      for n in range(launches)))
  for step in committed:
    (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
  return str(tmp_path)


ROWS = [
    {"step": 4, "loss": 3.0, "ce_loss": 2.9, "step_time_s": 0.5},
    {"step": 4, "eval/web/ce_loss": 3.5, "eval/code/ce_loss": 2.5, "eval/web/ppl": 33.0,
     "alarm/generalization_gap": 0.0, "downstream/arc/acc_v2": 0.25,
     "downstream/arc/bpb_v2": 1.5, "downstream/arc/acc_v1": 0.25, "downstream/lam/bpb_v2": 0.9},
    {"step": 8, "loss": 2.0, "ce_loss": 1.9, "step_time_s": 0.25},
    {"step": 8, "eval/web/ce_loss": 3.6, "eval/code/ce_loss": 2.4, "alarm/generalization_gap": 1.0},
]


def test_the_last_losses_evaluation_tasks_alarm_and_files(tmp_path):
  exp = Experiment()
  exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, steps=8))
  summary = RunSummary.read(_workdir(tmp_path, ROWS), exp)
  assert summary.train_loss == (8, 2.0)
  assert summary.heldout == (8, {"web": 3.6, "code": 2.4})
  assert summary.tasks == (4, {"arc": ("acc_v2", 0.25), "lam": ("bpb_v2", 0.9)})
  assert (summary.evaluations, summary.alarm_fired) == (2, 8)
  assert summary.tokens == 8 * exp.tokens_per_step
  assert summary.step_seconds == 4 * 0.5 + 4 * 0.25  # each row's mean over its interval
  assert summary.checkpoint == f"{tmp_path}/checkpoints/8"
  lines = summary.lines(launch_seconds=75, next_commands=(("evaluate", "python -m olmo3.eval"),))
  assert lines[0] == f"run complete: {tmp_path} (2 launches)"
  assert "  held-out CE     code 2.4000, web 3.6000 (step 8)" in lines
  assert any(line.startswith("  alarm           FIRED at step 8") for line in lines)
  assert "  time            1 min 15 s this launch; training steps 3 s over all launches" in lines
  assert lines[-2:] == ["next:", "  evaluate  python -m olmo3.eval"]


def test_a_run_without_evaluations_says_the_alarm_was_off(tmp_path):
  exp = Experiment()
  exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, steps=100))
  summary = RunSummary.read(_workdir(tmp_path, ROWS[:1], launches=1, committed=()), exp)
  lines = summary.lines()
  assert lines[0] == f"run stopped at step 4 of 100: {tmp_path} (1 launch)"
  assert "  held-out CE     none: the run evaluated no held-out set" in lines
  assert "  alarm           off: without held-out evaluations it cannot fire" in lines
  assert "  checkpoint      none committed" in lines


def test_a_dry_run_and_a_launch_close_with_the_same_lines_from_the_same_facts(tmp_path):
  """The next stage's facts are data (`NextSteps`), and the dry run of a finished run ends with
  exactly the closing lines a launch prints (`closing.lines`) from the stage the launcher found."""
  ref = "experiments.olmo3_tiny:stage1"
  exp = fdl.build(refs.resolve(ref, ["train.steps=8"]))
  (tmp_path / "run").mkdir()
  workdir = _workdir(tmp_path / "run", ROWS)  # committed at 4 and 8: complete
  found = closing.NextStage("experiments.olmo3_tiny", "stage1", "stage2",
                            "runs/olmo3_tiny.stage1", exp.data)
  plan = RunPlan.build(exp, workdir, ref)
  assert plan.resume.start is Start.COMPLETE
  steps = closing.NextSteps.of(plan, found)
  assert (steps.stage, steps.init_from, steps.data) == (
      "experiments.olmo3_tiny:stage2", workdir, ())  # not the default workdir: its own
  assert steps.workdir == f"{workdir}.stage2"
  assert [what for what, _ in steps.commands] == [
      "next stage", "evaluate", "sample", "export to HF"]
  assert steps.commands[0][1] == (
      "python launch/main.py --fdl_config=experiments.olmo3_tiny:stage2 "
      f"\"--fdl_set=checkpoint.init_from='{workdir}'\" --workdir={workdir}.stage2")
  launched = closing.lines(plan, found)
  assert launched[0] == f"run complete: {workdir} (2 launches)"
  assert launched[-5:] == ["next:", *(f"  {what.ljust(12)}  {command}"
                                      for what, command in steps.commands)]
  printed = list(dry_run.lines(exp, workdir, ref, next_stage=found))
  assert printed[-len(launched) - 1:] == ["", *launched]
  # Without a next stage (the experiment's module has none) both say only the run's own.
  assert closing.NextSteps.of(plan, None).commands == steps.commands[1:]
  alone = closing.lines(plan, None)
  assert alone == launched[:-4] + launched[-3:]  # the "next stage" line out
  assert list(dry_run.lines(exp, workdir, ref))[-len(alone) - 1:] == ["", *alone]


@pytest.mark.slow(seconds=8)
def test_a_complete_run_with_garbled_metrics_lines_still_prints_its_summary(
    straight, tmp_path_factory, tmp_path):
  """A finished run (the reliability tests' shared 9-step run) whose metrics.jsonl holds lines
  that are no metric rows (a torn write, bytes that are no UTF-8): launching it again and its
  --dry_run print the summary from the other rows, each bad line named by file and line in a
  warning, and the file is left as it was (the readers change nothing)."""
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent  # where the `straight` fixture trained its run
  workdir = tmp_path / "run"
  shutil.copytree(shared / "straight", workdir, ignore=shutil.ignore_patterns("lease.json"))
  metrics = workdir / "metrics.jsonl"
  lines = metrics.read_bytes().splitlines(keepends=True)
  lines[2] = lines[2][:len(lines[2]) // 2] + b"\n"  # a torn write in the middle
  lines.insert(5, b"\xff\xfe not a row\n")
  metrics.write_bytes(b"".join(lines))
  before = metrics.read_bytes()
  args = [*reliability.TINY, "--fdl_set=train.steps=9", f"--workdir={workdir}",
          "--fdl_set=checkpoint.every=100"]
  for extra in ([], ["--dry_run"]):
    done = forked.completed("main", [*args, *extra], reliability._env(1))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"run complete: {workdir} (1 launch)" in done.stdout
    assert "  train loss      " in done.stdout and "(step 9)" in done.stdout
    for number, why in ((3, "not JSON"), (6, "not JSON")):
      assert f"{metrics}:{number}: {why} (" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
  assert metrics.read_bytes() == before


def test_ruler_beside_ai2s_and_the_long_context_alarm(tmp_path):
  """The last RULER evaluation's mean per length, AI2's OLMo 3 7B figures at the lengths they
  share, and where the long-context alarm fired."""
  rows = ROWS + [{"step": 8, "ruler/mean/4096": 0.9, "ruler/mean/8192": 0.5,
                  "ruler/niah_single_1/4096": 1.0, "alarm/long_context": 1.0}]
  summary = RunSummary.read(_workdir(tmp_path, rows), Experiment())
  assert summary.ruler == (8, {4096: 0.9, 8192: 0.5}) and summary.long_context_fired == 8
  lines = summary.lines()
  at = lines.index("  RULER           4096 90.0, 8192 50.0 (mean over its tasks, step 8)")
  assert lines[at + 1] == " " * 18 + "AI2's OLMo 3 7B: 4096 95.8, 8192 89.3"
  assert lines[at + 2].startswith("  long context    alarm FIRED at step 8")
  (tmp_path / "none").mkdir()
  assert not any("RULER" in line for line in RunSummary.read(
      _workdir(tmp_path / "none", ROWS), Experiment()).lines())
