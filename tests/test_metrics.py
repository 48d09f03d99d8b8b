"""olmo3.metrics' Weights & Biases writer, in W&B's offline mode (no network): the run it writes
is read back from its transaction log and holds exactly the steps and values the TensorBoard
writer got, the experiment as config, and the workdir's run id, which a resumed run reuses."""

import json
import struct
import sys

import pytest

from olmo3 import metrics as metrics_lib
from olmo3.config import AttentionKernel

# What the loop writes: a training row per step, an evaluation merged into the row of its step.
# Values a float32 holds exactly: TensorBoard stores scalars as float32, W&B as JSON doubles.
ROWS = {1: {"loss": 4.5, "lr": 0.25}, 2: {"loss": 4.125, "lr": 0.5},
        3: {"loss": 3.75, "lr": 0.5}}
EVALS = {3: {"eval/embedded/ce_loss": 5.0625, "alarm/generalization_gap": 0.0}}
# What the loop passes (Experiment.to_dict(): enums and tuples in it) and, in its JSON form
# (experiment.json's), what the W&B run's config holds.
CONFIG_GIVEN = {"model": {"d_model": 128, "attention": AttentionKernel.XLA},
                "train": {"steps": 3, "seed": 0}, "xla_flags": ("--a=1",)}
CONFIG = {"model": {"d_model": 128, "attention": "xla"}, "train": {"steps": 3, "seed": 0},
          "xla_flags": ["--a=1"]}
BLOCK = 32 * 1024  # the .wandb file is LevelDB's log format: 32 KiB blocks of chunks


def _records(path):
  """The protobuf Records of a .wandb transaction log (wandb.proto's Record, as wandb-core
  writes them): a 7-byte header (":W&B", magic, version), then LevelDB log blocks whose chunks
  (crc32c, length, type: full / first / middle / last) carry one record each, or a part."""
  from wandb.proto import wandb_internal_pb2  # the wandb extra (in the test extra); ≈2 s

  data = path.read_bytes()
  ident, _, version = struct.unpack("<4sHB", data[:7])
  assert ident == b":W&B" and version == 0, (ident, version)
  pos, parts = 7, b""
  while pos + 7 <= len(data):
    if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a chunk header is padding
      pos += BLOCK - pos % BLOCK
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
    if kind == 0:  # zero padding up to the block's end
      pos += -pos % BLOCK
      continue
    parts = chunk if kind in (1, 2) else parts + chunk
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      yield record


def _offline_run(wandb_dir, run_id):
  """The run record and the history ({step: {key: value}}) of each offline run dir of `run_id`,
  oldest first (a resumed run writes a second one)."""
  runs = []
  for log in sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
    run, history = None, {}
    for record in _records(log):
      kind = record.WhichOneof("record_type")
      if kind == "run":
        run = record.run
      elif kind == "history":
        # wandb-core writes a key as `nested_key` (the path through nested dicts, which the W&B
        # UI joins with dots; ours are flat: one part); older writers used `key`.
        items = {i.key or ".".join(i.nested_key): json.loads(i.value_json)
                 for i in record.history.item}
        history[record.history.step.num] = {k: v for k, v in items.items()
                                            if not k.startswith("_")}
    runs.append((run, history))
  return runs


def _tensorboard(logdir):
  from tensorboard.backend.event_processing import event_accumulator

  events = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0})
  events.Reload()
  out = {}
  for tag in events.Tags()["scalars"]:
    for event in events.Scalars(tag):
      out.setdefault(event.step, {})[tag] = event.value
  return out


def _log(writer, rows, evals):
  for step, row in rows.items():
    writer.write_scalars(step, row)
    if step in evals:
      writer.write_scalars(step, evals[step])
  writer.close()
  # finish() can return before wandb-core has written the last records; stopping the service
  # (as the end of a process does) waits for them.
  import wandb

  wandb.teardown()


def test_wandb_offline_run_holds_what_tensorboard_got_and_resumes(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.delenv("WANDB_MODE", raising=False)  # the config's mode decides
  (tmp_path / "wandb_dir").mkdir()
  workdir = tmp_path / "olmo3_tiny.stage1"

  def writers(rows, resumed_at=0):
    wandb_writer = metrics_lib.create_wandb_writer(
        workdir, mode="offline", project="olmo3-test", entity=None, name=None,
        config=CONFIG_GIVEN)
    return metrics_lib.metric_writers.MultiWriter([
        metrics_lib.create_writer(workdir, True, resumed_at=resumed_at), wandb_writer])

  import wandb

  try:
    _log(writers(ROWS), ROWS, EVALS)
    run_id = (workdir / metrics_lib.WANDB_RUN_ID).read_text().strip()
    ((run, history),) = _offline_run(tmp_path / "wandb_dir", run_id)
    assert history == _tensorboard(workdir / "tensorboard") == {
        s: {**ROWS[s], **EVALS.get(s, {})} for s in ROWS}
    assert (run.run_id, run.project, run.display_name) == (run_id, "olmo3-test",
                                                           "olmo3_tiny.stage1")
    assert {u.key: json.loads(u.value_json) for u in run.config.update
            if not u.key.startswith("_")} == CONFIG
    # A resumed run (from step 3) continues the same W&B run.
    _log(writers({4: {"loss": 3.5, "lr": 0.25}}, resumed_at=3), {4: {"loss": 3.5, "lr": 0.25}},
         {})
    assert (workdir / metrics_lib.WANDB_RUN_ID).read_text().strip() == run_id
    (_, first), (resumed, second) = _offline_run(tmp_path / "wandb_dir", run_id)
    assert resumed.run_id == run_id and first == history
    assert second == {4: {"loss": 3.5, "lr": 0.25}}
  finally:
    wandb.teardown()  # stops wandb-core's service process


def test_wandb_without_the_extra_is_a_one_line_error_naming_it(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as if not installed
  with pytest.raises(metrics_lib.MetricsError) as e:
    metrics_lib.create_wandb_writer(tmp_path, mode="online", project="p", entity=None,
                                    name=None, config={})
  assert str(e.value) == ("W&B logging (wandb.mode='online') needs the wandb extra: "
                          "pip install -e '.[wandb]' (or set wandb.mode='off')")
  assert not (tmp_path / metrics_lib.WANDB_RUN_ID).exists()  # nothing written
