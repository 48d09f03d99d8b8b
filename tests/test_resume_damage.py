"""What a run's own files may hold after a crash or a hand edit never blocks its resume: a
committed checkpoint step without its meta (or emptied) is damage, quarantined with the
fallback; metrics.jsonl lines that are no metric rows are reported by file and line and set
aside; and a launch that fails before its first step leaves no history line."""

import json
import logging
import shutil

import pytest

from olmo3.io import metrics as metrics_lib
from olmo3.run import record
from tests import forked
from tests.test_reliability import TINY, _env, _losses, straight  # noqa: F401

BAD_LINES = ["{not json", '{"loss": 1.0}', '{"step": "7", "loss": 1.0}', "[1, 2]"]


def test_metric_lines_that_are_no_rows_are_reported_and_set_aside(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  good = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
  path.write_text("\n".join([good[0], BAD_LINES[0], good[1], *BAD_LINES[1:], good[2]])
                  + "\n" + '{"step": 4, "lo')  # and a torn last line
  with caplog.at_level(logging.WARNING):
    writer = metrics_lib.JsonlWriter(path, resumed_at=2)
  writer.close()
  assert path.read_text() == "".join(line + "\n" for line in good[:2])
  assert (tmp_path / "metrics.jsonl.set-aside").read_text() == "".join(
      line + "\n" for line in BAD_LINES)
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warned[0].startswith(f"{path}:2: not JSON (")
  assert warned[1] == (f"{path}:4: no integer 'step' (step=None); set aside in "
                       f"{path}.set-aside")
  assert warned[2].startswith(f"{path}:5: no integer 'step' (step='7')")


def _launch(workdir, steps):
  return forked.completed("main", [*TINY, f"--fdl_set=train.steps={steps}",
                                   f"--workdir={workdir}", "--force_workdir"], _env(1))


@pytest.mark.slow(seconds=45)
def test_a_step_without_meta_and_bad_metric_lines_never_block_a_resume(tmp_path, straight):
  workdir = tmp_path / "run"
  done = _launch(workdir, 6)  # checkpoints at steps 3 and 6
  assert done.returncode == 0, done.stderr[-3000:]
  shutil.rmtree(workdir / "checkpoints" / "6" / "meta")  # partly deleted
  with open(workdir / "metrics.jsonl", "a") as f:
    f.write("".join(line + "\n" for line in BAD_LINES))
  # A launch that fails before its first step (its metrics file cannot be opened) says so in
  # one line and leaves no history line; the damaged step is set aside on the way.
  (workdir / "metrics.jsonl").rename(workdir / "metrics.kept")
  (workdir / "metrics.jsonl").mkdir()
  failed = _launch(workdir, 9)
  assert failed.returncode == 1, failed.stderr[-3000:]
  assert "Traceback" not in failed.stderr
  assert failed.stderr.strip().splitlines()[-1].startswith("error: IsADirectoryError: ")
  step_dir = workdir / "checkpoints" / "6"
  assert (f"{step_dir} is damaged: ['meta'] in {step_dir / 'meta'}: missing (the step was "
          "committed with it") in failed.stderr
  assert "quarantined it as" in failed.stderr
  assert len(record.read_history(workdir)) == 1
  (workdir / "metrics.jsonl").rmdir()
  (workdir / "metrics.kept").rename(workdir / "metrics.jsonl")
  # The resume goes on from step 3, the bad lines reported and set aside.
  done = _launch(workdir, 9)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "resumed from" in done.stderr and "/checkpoints/3 (step 3" in done.stderr
  assert f"{workdir / 'metrics.jsonl'}:" in done.stderr and "set aside in" in done.stderr
  assert _losses(workdir) == straight
  assert (workdir / "metrics.jsonl.set-aside").read_text().splitlines() == BAD_LINES
  assert [h.start_step for h in record.read_history(workdir)] == [0, 3]
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3", "6", "6.damaged-1",
                                                                         "9"]
