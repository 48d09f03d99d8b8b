"""A run's record as history: which revision produced each checkpoint, and its writer
(olmo3.run.record), fed the launcher's config files (launch.config_files.revision)."""

import json
import logging
import re

import fiddle as fdl
import pytest

from launch import config_files, refs
from olmo3.run import record


def _begin(run_record, cfg, experiment, argv, start):
  """RunRecord.begin as the launcher calls it: a new revision only when the config changed."""
  previous = config_files.latest_config(run_record.workdir.root)
  return run_record.begin(config_files.revision(previous, cfg), experiment, argv, start)


def _launch(n, revision, start):
  config, _, experiment = record.revision_files(revision)
  return record.Launch(n, revision, start, config, experiment, ("x",), "")


def test_each_checkpoint_belongs_to_the_last_launch_that_started_before_it():
  # Revision 0 trained 0 -> 10; revision 1 resumed at 10 and reached 20; a fallback to 15
  # (after 20 was damaged) rewrote 16..20 with revision 2.
  history = [_launch(1, 0, 0), _launch(2, 1, 10), _launch(3, 2, 15)]
  assert [record.producer(history, s).revision for s in (5, 10, 11, 15, 16, 20)] == [
      0, 0, 1, 1, 2, 2]
  assert record.producer([_launch(1, 0, 10)], 10) is None  # nothing recorded wrote it
  assert record.producer([], 3) is None


def test_a_broken_history_line_is_named_skipped_and_set_aside_by_the_next_launch(tmp_path,
                                                                                caplog):
  """A history line cut short or edited blocked every resume until edited by hand: now it is
  named in a warning and skipped, and the next launch keeps it in history.jsonl.set-aside."""
  cfg = refs.load("experiments.olmo3_tiny:stage1")
  run_record = record.RunRecord(str(tmp_path))
  _begin(run_record, cfg, {"steps": 1}, ["first"], 0)
  history = tmp_path / "history.jsonl"
  history.write_text(history.read_text() + '{"launch": 2}\n')
  with caplog.at_level(logging.WARNING):
    assert [h.launch for h in record.read_history(tmp_path)] == [1]
  assert re.search(r"history\.jsonl:2: not a launch record \(KeyError: .*\); skipped \(the "
                   r"next launch sets it aside in history\.jsonl\.set-aside\)", caplog.text)
  _begin(record.RunRecord(str(tmp_path)), cfg, {"steps": 1}, ["again"], 4)
  assert [h.command for h in record.read_history(tmp_path)] == [("first",), ("again",)]
  assert (tmp_path / "history.jsonl.set-aside").read_text() == '{"launch": 2}\n'


def test_the_record_appends_revisions_never_rewrites_them_and_undo_takes_a_launch_back(
    tmp_path):
  cfg = refs.load("experiments.olmo3_tiny:stage1")
  longer = refs.load("experiments.olmo3_tiny:stage1")
  longer.train.steps = cfg.train.steps + 10
  run_record = record.RunRecord(str(tmp_path))
  _begin(run_record, cfg, {"steps": 1}, ["first"], 0)
  files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
  assert set(files) == {"config.json", "config.txt", "command.txt", "experiment.json",
                        "history.jsonl"}
  _begin(record.RunRecord(str(tmp_path)), cfg, {"steps": 1}, ["same"], 4)  # same: same revision
  _begin(record.RunRecord(str(tmp_path)), longer, {"steps": 2}, ["longer"], 8)
  _begin(record.RunRecord(str(tmp_path)), cfg, {"steps": 1}, ["back"], 12)  # back again: a new one
  history = record.read_history(tmp_path)
  assert [(h.launch, h.revision, h.start_step, h.command) for h in history] == [
      (1, 0, 0, ("first",)), (2, 0, 4, ("same",)), (3, 1, 8, ("longer",)),
      (4, 2, 12, ("back",))]
  for name, data in files.items():
    if name != "history.jsonl":
      assert (tmp_path / name).read_bytes() == data, name
  assert json.loads((tmp_path / "experiment.1.json").read_text()) == {"steps": 2}
  assert fdl.build(config_files.from_workdir(tmp_path, 10)).train.steps == cfg.train.steps + 10
  assert fdl.build(config_files.from_workdir(tmp_path, 13)) == fdl.build(cfg)
  # A launch that stopped before its first step takes back exactly what it wrote.
  history_before = (tmp_path / "history.jsonl").read_bytes()
  again = record.RunRecord(str(tmp_path))
  _begin(again, longer, {"steps": 2}, ["failed"], 12)
  assert (tmp_path / "config.3.json").exists()
  again.undo()
  assert (tmp_path / "history.jsonl").read_bytes() == history_before
  assert not (tmp_path / "config.3.json").exists()
  assert not (tmp_path / "experiment.3.json").exists()


def test_a_workdir_holding_config_json_without_history_is_revision_0(tmp_path):
  """Its config is what a resume is checked against (the launcher refuses an unresumable
  change, or a config.json naming code it may not import, before writing anything)."""
  cfg = refs.load("experiments.olmo3_tiny:stage1")
  (tmp_path / "config.json").write_text(config_files.dump(cfg))
  run_record = record.RunRecord(str(tmp_path))
  assert [(h.revision, h.start_step) for h in run_record.history()] == [(0, 0)]
  longer = refs.load("experiments.olmo3_tiny:stage1")
  longer.train.steps = 7
  _begin(run_record, longer, {}, ["resume"], 5)
  assert [(h.launch, h.revision, h.config) for h in record.read_history(tmp_path)] == [
      (1, 0, "config.json"), (2, 1, "config.1.json")]


def test_undo_takes_back_whatever_the_launch_added_but_a_set_aside_checkpoint(tmp_path):
  """Besides the record, a launch that trained nothing may have written an event file, an
  empty checkpoints directory, a lease: undo removes what was not there when `begin` started,
  keeping what was (and a damaged step the launch set aside, kept for inspection)."""
  cfg = refs.load("experiments.olmo3_tiny:stage1")
  (tmp_path / "notes.txt").write_text("mine")
  (tmp_path / "tensorboard").mkdir()
  (tmp_path / "tensorboard" / "events.1").write_text("old")
  (tmp_path / "checkpoints" / "4").mkdir(parents=True)
  run_record = record.RunRecord(str(tmp_path))
  before = record.Workdir(str(tmp_path)).listing()
  _begin(run_record, cfg, {"steps": 1}, ["x"], 4)
  (tmp_path / "tensorboard" / "events.2").write_text("new")  # the trainer's writers
  (tmp_path / "metrics.jsonl").write_text("")
  (tmp_path / "wandb").mkdir()
  (tmp_path / "wandb" / "run").write_text("")
  (tmp_path / "checkpoints" / "4").rename(tmp_path / "checkpoints" / "4.damaged-1")
  run_record.undo()
  assert record.Workdir(str(tmp_path)).listing() == before
  assert (tmp_path / "tensorboard" / "events.1").read_text() == "old"
  assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["4.damaged-1"]
