"""olmo3.io.metrics: it imports no heavy or TensorFlow-bound library and plants no module (so any
library imports the same before or after it); a mirrored workdir gets every file when the writer
closes; the Weights & Biases writer, in W&B's offline mode (no network): the run it writes is
read back from its transaction log and holds exactly the steps and values the TensorBoard writer
got, the experiment as config, and the workdir's run id, which a resumed run reuses."""

import json
import struct
import subprocess
import sys

import pytest

from olmo3.io import metrics as metrics_lib
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


# In a fresh process: what importing olmo3.io.metrics and writing a row brings in.
_IMPORTS_THEN_WRITES = """
import sys
before = set(sys.modules)
from olmo3.io import metrics
writer = metrics.create_writer(sys.argv[1], True)
writer.write_scalars(1, {"loss": 2.5})
writer.close()
new = set(sys.modules) - before
print(sorted(m for m in new if m.split(".")[0] in ("torch", "tensorflow", "tensorboardX", "clu",
                                                   "boto3", "botocore")))
print(sorted(m for m in new if sys.modules[m] is None))
import torch  # installed (the test extra) and importable: nothing hid it
"""


@pytest.mark.slow(seconds=4)
def test_metrics_import_without_torch_tensorflow_or_planted_modules(tmp_path):
  """No import-order trick: olmo3.io.metrics and the TensorBoard writer import neither torch
  (tensorboardX would, ≈2 s), TensorFlow, tensorboardX, CLU (a stand-in planted for a CLU
  module shows as one) nor boto3 (tensorboard's own writer would, 0.3 s), block no import (a
  None entry), and events still land."""
  done = subprocess.run([sys.executable, "-c", _IMPORTS_THEN_WRITES, str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.splitlines() == ["[]", "[]"], done.stdout
  assert _tensorboard(tmp_path / "tensorboard") == {1: {"loss": 2.5}}
  assert metrics_lib.read_jsonl(tmp_path / metrics_lib.METRICS_JSONL) == [
      {"step": 1, "loss": 2.5}]


def test_event_files_are_tfrecords_with_tensorboards_checksums(tmp_path):
  """Every record's length and bytes carry the masked CRC-32C tensorboard's own record code
  computes (its reader does not check them; TensorFlow's does), and the file starts with the
  version event."""
  from tensorboard.compat.proto import event_pb2
  from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

  writer = metrics_lib.TensorBoardWriter(tmp_path)
  writer.write_scalars(7, {"loss": 2.5, "lr": 1e-3})
  writer.close()
  (path,) = tmp_path.iterdir()
  assert path.name.startswith("events.out.tfevents.")
  data, events = path.read_bytes(), []
  while data:
    header, data = data[:8], data[8:]
    assert int.from_bytes(data[:4], "little") == masked_crc32c(header)
    n = int.from_bytes(header, "little")
    record, data = data[4:4 + n], data[4 + n:]
    assert int.from_bytes(data[:4], "little") == masked_crc32c(record)
    data = data[4:]
    events.append(event_pb2.Event.FromString(record))
  assert events[0].file_version == "brain.Event:2"
  assert events[1].step == 7 and {v.tag: v.simple_value for v in events[1].summary.value} == (
      {"loss": 2.5, "lr": pytest.approx(1e-3)})


def test_a_mirrored_workdir_gets_every_file_when_the_writer_closes(tmp_path):
  """Closing uploads what the inner writers wrote as they closed (a closed writer cannot be
  flushed again). The mirror's upload is storage.write_bytes_atomic, local paths included."""
  local, remote = tmp_path / "local", tmp_path / "remote"
  local.mkdir()
  writer = metrics_lib.MirroredWriter(metrics_lib.create_writer(local, True), str(local),
                                      str(remote))
  writer.write_scalars(1, {"loss": 2.5})
  writer.write_scalars(2, {"loss": 2.0})
  writer.close()
  assert not local.exists()
  assert metrics_lib.read_jsonl(remote / metrics_lib.METRICS_JSONL) == [
      {"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
  assert _tensorboard(remote / "tensorboard") == {1: {"loss": 2.5}, 2: {"loss": 2.0}}


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


@pytest.mark.slow(seconds=6)
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
    return metrics_lib.MultiWriter([
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
