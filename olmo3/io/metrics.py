"""Metric writers: TensorBoard event files, metrics.jsonl, W&B, the log.

A run writes scalars only, so the interface is CLU's `MetricWriter` cut to them. CLU's own writers
are not used: `clu.metric_writers` (and `clu.periodic_actions`, which imports it) imports a
TensorFlow summary writer at package import, and TensorFlow is a 1.4 GB install. TensorBoard
files hold tensorboard's own Event protos (`TensorBoardWriter`: without TensorFlow, torch or
boto3). Nothing here patches `sys.modules`, so any library imports the same before or after
this module.
"""

from __future__ import annotations

import abc
import itertools
import json
import os
import shutil
import socket
import struct
import tempfile
import time
from typing import Any, Iterable, Mapping

import google_crc32c
import numpy as np
from absl import logging

from olmo3.io import pathnames, storage

METRICS_JSONL = "metrics.jsonl"
TENSORBOARD = "tensorboard"  # the event files' directory


class MetricWriter(abc.ABC):
  """Where a run's scalars go: each write is one step's, writes of one step may repeat (a
  training row, then its evaluation)."""

  @abc.abstractmethod
  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes (or buffers) `scalars` at `step`."""

  def flush(self) -> None:
    """Everything written so far is where it goes (on disk, uploaded)."""

  def close(self) -> None:
    self.flush()


class MultiWriter(MetricWriter):
  """Writes to each of `writers`, in order."""

  def __init__(self, writers: Iterable[MetricWriter]):
    self.writers = tuple(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    for writer in self.writers:
      writer.write_scalars(step, scalars)

  def flush(self) -> None:
    for writer in self.writers:
      writer.flush()

  def close(self) -> None:
    for writer in self.writers:
      writer.close()


class LogWriter(MetricWriter):
  """Every scalar in the log at DEBUG (absl's -v 1), as CLU's logging writer showed them; the
  loop's own one-line progress is at INFO."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    logging.debug("[%d] %s", step, ", ".join(
        f"{k}={float(np.asarray(v)):.6g}" for k, v in sorted(scalars.items())))


class TensorBoardWriter(MetricWriter):
  """TensorBoard event files in `logdir` (local): tensorboard's own Event protos, each framed as
  a TFRecord (its length, the length's masked CRC-32C, the bytes, their masked CRC-32C) in a
  file named as TensorBoard's writers name theirs. The framing is written here, not through
  tensorboard's EventFileWriter: that writer is reachable only through the `tensorboard.summary`
  package, whose TensorFlow stub imports boto3, botocore and urllib3 (an S3 file layer a local
  event file never uses), 0.3 s of every launch. tests/test_metrics.py and the end-to-end test
  read the files back with tensorboard's own reader. Each row reaches the file when written,
  so a live TensorBoard sees every step."""

  def __init__(self, logdir: str | os.PathLike):
    from tensorboard.compat.proto import event_pb2, summary_pb2

    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    os.makedirs(logdir, exist_ok=True)
    name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_EVENT_FILES)}")
    self._file = open(os.path.join(logdir, name), "wb")  # pylint: disable=consider-using-with
    self._append(self._event(wall_time=time.time(), file_version="brain.Event:2"))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    values = [self._summary.Value(tag=k, simple_value=float(np.asarray(v)))
              for k, v in scalars.items()]
    self._append(self._event(wall_time=time.time(), step=int(step),
                             summary=self._summary(value=values)))

  def _append(self, event: Any) -> None:
    data = event.SerializeToString()
    length = struct.pack("<Q", len(data))
    self._file.write(length + _masked_crc(length) + data + _masked_crc(data))
    self._file.flush()

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()


_EVENT_FILES = itertools.count()  # several writers of one process in one second: other names


def _masked_crc(data: bytes) -> bytes:
  """TFRecord's checksum: CRC-32C, rotated right by 15 bits, plus a constant (little-endian)."""
  crc = google_crc32c.value(data)
  return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


class JsonlWriter(MetricWriter):
  """WORKDIR/metrics.jsonl: one JSON object per logged step, `step` and all its scalars (writes
  for the same step, such as training and evaluation metrics, are merged into one line).

  A run resuming from step N first drops the lines of steps after N (logged after its last
  checkpoint, before a crash: they are logged again) and a torn last line, so the file never
  repeats a step. Lines that are no metric row (not JSON, no integer `step`: a torn write in
  the middle, a hand edit) never stop a resume: each is reported by file and line and moved to
  `metrics.jsonl.set-aside`. `name` is the file as the user knows it (a bucket's URL for a
  local mirror)."""

  def __init__(self, path: str | os.PathLike, resumed_at: int = 0, name: str | None = None):
    _drop_after(path, resumed_at, name or os.fspath(path))
    self._file = open(path, "a", buffering=1)
    self._pending: dict[str, Any] = {}

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    if self._pending and self._pending["step"] != int(step):
      self.flush()
    self._pending.setdefault("step", int(step))
    self._pending.update({k: float(np.asarray(v)) for k, v in scalars.items()})

  def flush(self):
    if self._pending:
      self._file.write(json.dumps(self._pending) + "\n")
      self._pending = {}
    self._file.flush()

  def close(self):
    self.flush()
    self._file.close()


SET_ASIDE = ".set-aside"  # metrics.jsonl.set-aside: the lines a resume could not read as rows


def _parse_row(line: str) -> tuple[dict[str, Any] | None, str]:
  """(the metric row of a metrics.jsonl line, '') or (None, why it is no metric row)."""
  try:
    row = json.loads(line)
  except ValueError as e:
    return None, f"not JSON ({e})"
  step = row.get("step") if isinstance(row, dict) else None
  if type(step) is not int:  # pylint: disable=unidiomatic-typecheck  # bool is no step
    return None, f"no integer 'step' (step={step!r})"
  return row, ""


def _row_step(line: str) -> tuple[int | None, str]:
  """(the step of a metrics.jsonl line, '') or (None, why it is no metric row)."""
  row, why = _parse_row(line)
  return (None, why) if row is None else (row["step"], "")


def _drop_after(path: str | os.PathLike, step: int, name: str) -> None:
  """Rewrites `path` (atomically) without its lines of steps after `step`, without a last line
  a crash cut short, and without lines that are no metric row: those are logged (`name`:line)
  and appended to `path` + SET_ASIDE, never deleted."""
  if not os.path.exists(path):
    return
  with open(path, errors="surrogateescape") as f:  # undecodable bytes: set aside as they are
    lines = f.read().split("\n")
  kept, aside = [], []
  for number, line in enumerate(lines[:-1], start=1):  # after the last newline: empty or torn
    if not line.strip():
      continue
    row_step, why = _row_step(line)
    if row_step is None:
      aside.append(line + "\n")
      if len(aside) <= 5:
        logging.warning("%s:%d: %s; set aside in %s%s", name, number, why, name, SET_ASIDE)
    elif row_step <= step:
      kept.append(line + "\n")
  if len(aside) > 5:
    logging.warning("%s: %d more lines that are no metric rows set aside in %s%s", name,
                    len(aside) - 5, name, SET_ASIDE)
  if aside:
    with open(f"{os.fspath(path)}{SET_ASIDE}", "a", errors="surrogateescape") as f:
      f.writelines(aside)
  if len(kept) != len(lines) - 1 or lines[-1]:
    # Flushed: the rows are appended unsynced too, and a crash's torn tail is what this repairs.
    storage.write_bytes_atomic(path, "".join(kept).encode(errors="surrogateescape"),
                               durability=storage.Durability.FLUSHED)


def create_writer(workdir: str | os.PathLike, is_main_process: bool, resumed_at: int = 0
                  ) -> MetricWriter:
  """The log (at DEBUG) everywhere; TensorBoard events and metrics.jsonl from the main process
  only (resumed at step `resumed_at`: see JsonlWriter). A workdir in an object store gets both
  through a local mirror (`MirroredWriter`)."""
  if not is_main_process:
    return LogWriter()
  workdir = os.fspath(workdir)
  local = tempfile.mkdtemp(prefix="olmo3-metrics-") if pathnames.is_url(workdir) else workdir
  if local != workdir and storage.exists(pathnames.join(workdir, METRICS_JSONL)):
    with open(os.path.join(local, METRICS_JSONL), "wb") as f:  # continued, then uploaded whole
      f.write(storage.read_bytes(pathnames.join(workdir, METRICS_JSONL)))
  if local != workdir and storage.exists(pathnames.join(workdir, METRICS_JSONL + SET_ASIDE)):
    with open(os.path.join(local, METRICS_JSONL + SET_ASIDE), "wb") as f:  # kept, added to
      f.write(storage.read_bytes(pathnames.join(workdir, METRICS_JSONL + SET_ASIDE)))
  writer = MultiWriter([LogWriter(), TensorBoardWriter(os.path.join(local, TENSORBOARD)),
                        JsonlWriter(os.path.join(local, METRICS_JSONL), resumed_at,
                                    pathnames.join(workdir, METRICS_JSONL))])
  return writer if local == workdir else MirroredWriter(writer, local, workdir)


class MirroredWriter(MetricWriter):
  """Writes through `inner` into a local directory and uploads the files that changed to
  `remote` (an object-store URL) at each flush: an object store cannot append, so each file
  is uploaded whole and replaces the previous upload at once. The loop flushes before every
  checkpoint and at the end, so the bucket's metrics are never behind its checkpoints."""

  def __init__(self, inner: MetricWriter, local: str, remote: str):
    self.inner, self.local, self.remote = inner, local, remote
    self._uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns)

  def write_scalars(self, step, scalars):
    self.inner.write_scalars(step, scalars)

  def flush(self):
    self.inner.flush()
    self._upload()

  def close(self):
    self.inner.close()  # a closed writer cannot flush: upload what it wrote as it closed
    self._upload()
    shutil.rmtree(self.local, ignore_errors=True)

  def _upload(self):
    for root, _, files in os.walk(self.local):
      for name in files:
        path = os.path.join(root, name)
        rel = os.path.relpath(path, self.local)
        stat = os.stat(path)
        if self._uploaded.get(rel) != (stat.st_size, stat.st_mtime_ns):
          with open(path, "rb") as f:
            # Flushed (an upload, durable once acknowledged): the next flush uploads again.
            storage.write_bytes_atomic(pathnames.join(self.remote, *rel.split(os.sep)), f.read(),
                                       durability=storage.Durability.FLUSHED)
          self._uploaded[rel] = (stat.st_size, stat.st_mtime_ns)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, float]]:
  """The rows of a metrics.jsonl (a local path or a URL). Lines that are no metric row (see
  JsonlWriter: a resume sets them aside) are skipped, each logged by file and line: a reader
  (a finished run's summary, its --dry_run) changes nothing, and never stops on one."""
  rows, skipped = [], 0
  # Undecodable bytes: that line is no metric row, the others still are.
  text = storage.read_bytes(path).decode(errors="surrogateescape")
  for number, line in enumerate(text.split("\n"), start=1):  # numbered as _drop_after does
    if not line.strip():
      continue
    row, why = _parse_row(line)
    if row is not None:
      rows.append(row)
      continue
    skipped += 1
    if skipped <= 5:
      logging.warning("%s:%d: %s; skipped (a resume of the run sets such lines aside in %s%s)",
                      os.fspath(path), number, why, os.fspath(path), SET_ASIDE)
  if skipped > 5:
    logging.warning("%s: %d more lines that are no metric rows skipped", os.fspath(path),
                    skipped - 5)
  return rows


# --- Weights & Biases (the `wandb` extra) --------------------------------------------------------

WANDB_RUN_ID = "wandb_run_id"  # in the workdir: the W&B run a resumed run continues
_RUN_ID_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"  # W&B's own ids: 8 of these


class MetricsError(Exception):
  """A metric writer that cannot start (a missing extra); the message says what to install."""


class WandbWriter(MetricWriter):
  """A W&B run: the scalars at the steps the other writers get (hyperparameters are the run's
  config, given when it starts)."""

  def __init__(self, run: Any):
    self._run = run

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    # W&B merges the writes of one step (a training row, then its evaluation) into one row.
    self._run.log({k: float(np.asarray(v)) for k, v in scalars.items()}, step=int(step))

  def flush(self):
    pass  # the run streams as it logs

  def close(self):
    self._run.finish()


def wandb_run_id(workdir: str | os.PathLike) -> str:
  """The W&B run id of the run in `workdir`: the one stored there, else a new one, stored
  before W&B starts (a run that dies while starting still resumes into the same W&B run)."""
  import secrets

  from etils import epath

  path = epath.Path(workdir) / WANDB_RUN_ID
  if path.exists():
    return path.read_text().strip()
  run_id = "".join(secrets.choice(_RUN_ID_CHARS) for _ in range(8))
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(run_id + "\n")
  return run_id


def create_wandb_writer(workdir: str | os.PathLike, *, mode: str, project: str,
                        entity: str | None, name: str | None, config: Mapping[str, Any]
                        ) -> WandbWriter:
  """A W&B run for the run in `workdir` (mode "online" or "offline"), resuming the W&B run a
  previous launch in `workdir` started, with `config` as its config. Call on process 0 only.
  wandb is imported here (≈2 s), only when W&B is on."""
  try:
    import wandb
  except ImportError:
    raise MetricsError(f"W&B logging (wandb.mode={mode!r}) needs the wandb extra: "
                       "pip install -e '.[wandb]' (or set wandb.mode='off')") from None
  # The config as experiment.json holds it (W&B would store an enum by its member's name).
  plain = json.loads(json.dumps(dict(config), default=str))
  run = wandb.init(project=project, entity=entity, name=name or _run_name(workdir),
                   id=wandb_run_id(workdir), resume="allow", mode=mode, config=plain,
                   allow_val_change=True)
  return WandbWriter(run)


def _run_name(workdir: str | os.PathLike) -> str:
  from etils import epath

  return epath.Path(workdir).name
