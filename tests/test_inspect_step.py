"""`python -m olmo3.inspect_step`: a step's rows as the loader reads them, without training. (Its
`--replay` against logged steps, after a checkpoint and after a resume on another mesh:
tests/test_reliability.py::test_two_processes_train_save_and_resume_on_another_mesh; over
HTTP: tests/test_storage.py.)"""

import dataclasses
import json
import os

import fiddle as fdl
import numpy as np
import pytest

from experiments import olmo3_tiny
from olmo3 import inspect_step as inspect_lib
from olmo3.config import ConfigError
from olmo3.data import pipeline, sources
from olmo3.data import tokenizer as tokenizer_lib
from olmo3.data.tokens import TOKEN_DTYPE
from olmo3.run import record
from olmo3.run.plan import RunPlan
from olmo3.train.replay import Agreement, ReplayError, agreement, cross_process_collectives
from tests.data_helpers import batch_sharding


def _workdir(tmp_path, exp, name="run"):
  """A workdir holding only what a launch records first (its resolved experiment): nothing
  trained."""
  workdir = os.fspath(tmp_path / name)
  plan = RunPlan.build(exp, workdir)
  os.makedirs(workdir)
  record.write_experiment(workdir, plan.exp.to_dict())
  return plan


def inspect(workdir, *args, capsys, monkeypatch):
  """inspect's JSON for `args` (run in this process; the run's XLA flags it sets are undone)."""
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  code = inspect_lib.main(["--workdir", os.fspath(workdir), *args, "--json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  return json.loads(out.out)


def _file_tokens(span):
  return np.fromfile(span["file"], TOKEN_DTYPE, count=span["tokens"],
                     offset=span["offset"] * TOKEN_DTYPE.itemsize)


def test_a_steps_rows_are_the_loaders_with_their_files_offsets_and_text(tmp_path, capsys,
                                                                          monkeypatch):
  """Step 3 of the tiny stage 1, untrained: each row is the instance the loader gives that
  step (data step 2), its tokens lie at the file and offset it names, and its text is those
  tokens decoded with the run's tokenizer."""
  exp = fdl.build(olmo3_tiny.stage1())
  plan = _workdir(tmp_path, exp)
  out = inspect(plan.workdir.root, "--step", "3", capsys=capsys, monkeypatch=monkeypatch)
  loader = pipeline.Loader(plan.exp.data, batch_sharding(1), start_step=2, num_steps=1,
                           source=plan.train_files)
  (batch,) = list(loader.host_batches())
  assert (out["step"], out["data_step"], out["past_end"]) == (3, 2, False)
  assert [r["instance"] for r in out["rows"]] == batch["instance"].tolist()
  assert [r["row"] for r in out["rows"]] == list(range(plan.exp.data.global_batch_size))
  tokenizer = tokenizer_lib.load(sources.tokenizer_file(plan.exp.eval.tokenizer), what="test")
  for row, tokens in zip(out["rows"], batch["input_ids"]):
    (span,) = row["spans"]
    assert span["file"] in plan.train_files.paths and span["tokens"] == exp.data.seq_len
    np.testing.assert_array_equal(_file_tokens(span), tokens)
    assert row["text"] == [tokenizer.decode(tokens.tolist(), skip_special_tokens=False)]
    assert (row["source"], row["filtered"]) == ("embedded", False)
  ids = inspect(plan.workdir.root, "--step", "3", "--tokens", capsys=capsys,
                monkeypatch=monkeypatch)
  assert [r["tokens"] for r in ids["rows"]] == batch["input_ids"].tolist()
  # a step past the stage's end is shown (the order goes on), not replayed
  past = inspect(plan.workdir.root, "--step", str(plan.end + 1), capsys=capsys,
                 monkeypatch=monkeypatch)
  assert past["past_end"] and past["data_step"] == plan.end
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  with pytest.raises(ReplayError, match=f"the stage ends at step {plan.end}"):
    inspect_lib.main(["--workdir", plan.workdir.root, "--step", str(plan.end + 1), "--replay"])


def test_a_packed_rows_documents_are_listed_each_at_its_file_and_offset(tmp_path, capsys,
                                                                       monkeypatch):
  """Stage 3's packed instances: one span per document, in row order, each holding the tokens
  the row holds there; the row's text is one string per document."""
  exp = fdl.build(olmo3_tiny.stage3())
  exp = dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint, init_from=None))
  plan = _workdir(tmp_path, exp)
  documents = []
  for step in range(1, 6):
    out = inspect(plan.workdir.root, "--step", str(step), capsys=capsys, monkeypatch=monkeypatch)
    loader = pipeline.Loader(plan.exp.data, batch_sharding(1), start_step=step - 1, num_steps=1,
                             source=plan.train_files)
    (batch,) = list(loader.host_batches())
    assert [r["instance"] for r in out["rows"]] == batch["instance"].tolist()
    for row, tokens, segments in zip(out["rows"], batch["input_ids"], batch["segments"]):
      assert len(row["spans"]) == segments.max() == len(row["text"])
      documents.append(len(row["spans"]))
      at = 0
      for seg, span in enumerate(row["spans"], start=1):
        np.testing.assert_array_equal(_file_tokens(span), tokens[at:at + span["tokens"]])
        assert (segments[at:at + span["tokens"]] == seg).all()
        at += span["tokens"]
  assert max(documents) > 1  # rows of several documents among them


@pytest.mark.parametrize("args, said", [
    (["--top", "3"], "--top needs --replay"),
    (["--per_token", "--from_step", "0"], "--from_step, --per_token needs --replay"),
    (["--replay", "--top", "0"], "--top 0: must be at least 1"),
])
def test_options_that_need_a_replay_or_make_no_sense_are_refused_in_one_line(
    tmp_path, capsys, args, said):
  code = inspect_lib.main(["--workdir", os.fspath(tmp_path), "--step", "1", *args])
  assert code == 2
  assert capsys.readouterr().err == f"error: {said}" + (
      " (the losses come from replaying the step)\n" if "needs" in said else "\n")


def _history(workdir, *launches):
  """history.jsonl of launches (start_step, revision, mesh), as the launcher records them."""
  lines = [record.Launch(i, rev, start, "config.json", "experiment.json", (), "",
                         {"layout": {"mesh": mesh, "devices": 4 if mesh else 1,
                                     "device_kind": "cpu", "processes": 1}}).to_json()
           for i, (start, rev, mesh) in enumerate(launches, start=1)]
  (workdir / "history.jsonl").write_text("\n".join(lines) + "\n")


def test_a_replay_starts_at_the_newest_checkpoint_before_the_step_on_its_launchs_mesh(tmp_path):
  """Where a replay starts and on what mesh, from the run's record: the newest checkpoint before
  the step (or the one asked for), the layout of the launch that trained the step, whether the
  run restarted at that checkpoint (then restored as that launch restored it), and a start
  before a launch on another mesh refused, naming the step to start from."""
  from types import SimpleNamespace

  from olmo3.train import replay

  for step in (3, 6, 9):
    (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
  _history(tmp_path, (0, 0, {}), (6, 0, {}), (9, 1, {"fsdp": 4}))  # resumed at 6, resized at 9
  plan = SimpleNamespace(workdir=record.Workdir(os.fspath(tmp_path)))
  got = {s: replay.origin(plan, s) for s in (2, 5, 7, 10)}
  assert {s: (o.from_step, o.launch.launch, o.layout["mesh"], o.restarted)
          for s, o in got.items()} == {2: (0, 1, {}, True), 5: (3, 1, {}, False),
                                       7: (6, 2, {}, True), 10: (9, 3, {"fsdp": 4}, True)}
  assert got[5].layout_from is replay.LayoutFrom.HISTORY
  # steps 4..8 crossed a restart on the same config and mesh: fine (restarted there again,
  # as the run did); 7..10 a resize: refused
  across = replay.origin(plan, 8, from_step=3)
  assert (across.from_step, across.restarted, across.restarts) == (3, False, (6,))
  with pytest.raises(ReplayError, match=r"^steps 7\.\.10 were trained by two launches \(launch 2 "
                                        r"and launch 3, which started at step 9\) on different "
                                        r"configs or meshes: replay from step 9 or later"):
    replay.origin(plan, 10, from_step=6)
  with pytest.raises(ReplayError, match=r"--from_step 4: no committed checkpoint there \(have "
                                        r"\[3, 6, 9\]; 0: the stage's start\)"):
    replay.origin(plan, 8, from_step=4)
  with pytest.raises(ReplayError, match="--from_step 6: must be before --step 6"):
    replay.origin(plan, 6, from_step=6)
  # A -> B -> C where A and C match but B trained on another config: B's steps are refused
  other = tmp_path / "other"
  (other / "checkpoints" / "3").mkdir(parents=True)
  _history(other, (0, 0, {}), (3, 1, {}), (6, 0, {}))
  with pytest.raises(ReplayError, match=r"\(launch 2 and launch 3, which started at step 6\)"):
    replay.origin(SimpleNamespace(workdir=record.Workdir(os.fspath(other))), 8, from_step=0)
  # A launch that fell back to an earlier checkpoint (its newest damaged) redid the steps after
  # it: launch 2's steps (another mesh) are not the run's, and launch 3 trained 4..8
  fell_back = tmp_path / "fell_back"
  (fell_back / "checkpoints" / "3").mkdir(parents=True)
  _history(fell_back, (0, 0, {}), (6, 1, {"fsdp": 4}), (3, 0, {}))
  again = replay.origin(SimpleNamespace(workdir=record.Workdir(os.fspath(fell_back))), 8,
                        from_step=0)
  assert (again.launch.launch, again.layout["mesh"], again.restarts) == (3, {}, (3,))


def test_a_replay_promises_bit_for_bit_only_where_every_sum_runs_in_the_runs_order(monkeypatch):
  """What a replay is expected to equal the log to, from the run's layout and the replay's: bit
  for bit on the run's devices with its process count, or (CPU) with its cross-process
  collectives; to float rounding after a run on several processes of an accelerator, on other
  devices, on GPU without deterministic reductions, or without a recorded layout. The report
  says which, and calls a difference where bit for bit was expected a mismatch."""
  def layout(processes, mesh=None, devices=4, kind="cpu"):
    return {"mesh": {"fsdp": 4} if mesh is None else mesh, "devices": devices,
            "device_kind": kind, "processes": processes}

  monkeypatch.setenv("XLA_FLAGS", "")
  here = layout(1)
  bit, rounding = Agreement.BIT_FOR_BIT, Agreement.ROUNDING
  assert [cross_process_collectives(l) for l in (None, layout(1), layout(2),
                                                 layout(2, kind="TPU v4"))] == [
      False, False, True, False]
  assert agreement(layout(1), here, "cpu", False)[0] is bit
  assert agreement(layout(2), here, "cpu", True) == (bit, (
      "the run's devices; its 2 processes' cross-device sums in their order (gloo, one rank per "
      "device)"))
  # 2 processes' sums replayed with the in-process collectives: another order
  assert agreement(layout(2), here, "cpu", False) == (rounding, (
      "the run's 2 processes summed across devices in another order than one process does"))
  assert agreement(layout(2, kind="TPU v4"), layout(1, kind="TPU v4"), "tpu", False)[0] is rounding
  assert agreement(layout(1, kind="TPU v4"), layout(1, kind="TPU v4"), "tpu", False)[0] is bit
  assert agreement(layout(1, mesh={}, devices=1), here, "cpu", False)[0] is rounding
  assert agreement(None, here, "cpu", False)[0] is rounding
  gpu = layout(1, kind="NVIDIA H100")
  assert agreement(gpu, gpu, "gpu", False)[0] is rounding
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
  assert agreement(gpu, gpu, "gpu", False)[0] is bit

  logged = {"loss": 2.5, "ce_loss": 2.25, "grad_norm": 1.0, "skipped": 0.0}
  out = {"step": 5, "workdir": "run", "experiment": "experiment.json", "data_step": 4,
         "past_end": False, "rows": [], "loss": 2.5, "ce_loss": 2.25, "grad_norm": 1.0000001,
         "skipped": False,
         "replay": {"from_step": 4, "layout": here, "layout_from": "the launch's record",
                    "run_layout": layout(2), "expected": "bit for bit", "why": "the reason",
                    "logged": logged, "matches_log": {"loss": True, "ce_loss": True,
                                                      "grad_norm": False, "skipped": True}}}
  said = inspect_lib.lines(out, 0)
  assert said[2] == "against the log, expected bit for bit: the reason"
  assert said[5].endswith("differs by 1e-07 (not bit for bit: another state, batch, program or "
                          "machine than the run's)")
  out["replay"]["expected"] = "to float rounding"
  assert inspect_lib.lines(out, 0)[5].endswith("differs by 1e-07")


def test_a_step_past_any_runs_and_a_garbled_record_are_one_line_each(tmp_path, capsys,
                                                                     monkeypatch):
  """A --step past 64-bit positions (an OverflowError deep in numpy) and an experiment.json
  cut short or edited (a JSON or config traceback) each end in one `error:` line naming it."""
  plan = _workdir(tmp_path, fdl.build(olmo3_tiny.stage1()))
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  assert inspect_lib.main(["--workdir", plan.workdir.root, "--step", str(10**20)]) == 2
  assert capsys.readouterr().err.strip() == (
      f"error: --step {10**20}: larger than any run's steps (at most 2**48)")
  path = tmp_path / "run" / "experiment.json"
  text = path.read_text()
  path.write_text(text[:len(text) // 2])
  with pytest.raises(SystemExit) as refused:
    inspect_lib.main(["--workdir", plan.workdir.root, "--step", "3"])
  assert str(refused.value).startswith(
      f"error: {path} is not a readable experiment record (JSONDecodeError: ")
  assert str(refused.value).endswith(
      "); it was edited, cut short or not written by olmo3's launcher")
  path.write_text(json.dumps({"model": 3}))  # well-formed, not an experiment: the field named
  with pytest.raises(ConfigError, match=r"^Experiment.model=3: expected a ModelConfig"):
    inspect_lib.main(["--workdir", plan.workdir.root, "--step", "3"])
