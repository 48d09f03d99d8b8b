"""Metric writers: CLU's interfaces and writers, TensorBoard event files, logs, metrics.jsonl.

Why a shim: `import clu.metric_writers` imports CLU's TensorFlow summary writer at package import
and fails without TensorFlow (a 1.4 GB install). Before CLU's package is first imported, `install`
registers a `clu.metric_writers.summary_writer` module whose `SummaryWriter` is a CLU
`MetricWriter` writing TensorBoard event files with tensorboardX. CLU's `create_default_writer`,
`AsyncMultiWriter` and `periodic_actions` then work unchanged. With TensorFlow installed, CLU's
own writer is used. Everything that touches CLU's writers imports this module first.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import types
from typing import Any, Mapping

import numpy as np

from olmo3 import storage

METRICS_JSONL = "metrics.jsonl"


def _import_tensorboardx():
  """tensorboardX, imported with torch hidden: its writer module imports torch (≈2 s per process
  start) only to recognise torch tensors, which we never pass it. torch, when installed (the test
  and eval extras), stays importable afterwards."""
  if "torch" in sys.modules:
    import tensorboardX
    return tensorboardX
  sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` fail fast
  try:
    import tensorboardX
  finally:
    del sys.modules["torch"]
  return tensorboardX


def _tensorboardx_writer_class():
  from clu.metric_writers import interface
  TbxWriter = _import_tensorboardx().SummaryWriter

  class SummaryWriter(interface.MetricWriter):
    """CLU MetricWriter -> TensorBoard event files, via tensorboardX (no TensorFlow)."""

    def __init__(self, logdir: str):
      self._writer = TbxWriter(logdir=logdir, flush_secs=30)

    def write_summaries(self, step, values, metadata=None):
      for key, value in values.items():
        self._writer.add_scalar(key, np.asarray(value).item(), step)

    def write_scalars(self, step: int, scalars: Mapping[str, Any]):
      for key, value in scalars.items():
        self._writer.add_scalar(key, float(np.asarray(value)), step)

    def write_images(self, step: int, images: Mapping[str, Any]):
      for key, value in images.items():
        self._writer.add_images(key, np.asarray(value), step, dataformats="NHWC")

    def write_videos(self, step: int, videos: Mapping[str, Any]):
      for key, value in videos.items():
        self._writer.add_video(key, np.asarray(value), step)

    def write_audios(self, step: int, audios: Mapping[str, Any], *, sample_rate: int):
      for key, value in audios.items():
        self._writer.add_audio(key, np.asarray(value), step, sample_rate=sample_rate)

    def write_texts(self, step: int, texts: Mapping[str, str]):
      for key, value in texts.items():
        self._writer.add_text(key, value, step)

    def write_histograms(self, step: int, arrays: Mapping[str, Any], num_buckets=None):
      for key, value in arrays.items():
        self._writer.add_histogram(key, np.asarray(value), step,
                                   bins=num_buckets[key] if num_buckets else "tensorflow")

    def write_hparams(self, hparams: Mapping[str, Any]):
      self._writer.add_text("hparams", json.dumps(dict(hparams), default=str, indent=1), 0)

    def flush(self):
      self._writer.flush()

    def close(self):
      self._writer.close()

  return SummaryWriter


def install() -> None:
  """Makes `import clu.metric_writers` work without TensorFlow (idempotent)."""
  name = "clu.metric_writers.summary_writer"
  if name in sys.modules or importlib.util.find_spec("tensorflow") is not None:
    return
  module = types.ModuleType(name, "tensorboardX-backed SummaryWriter (olmo3.metrics)")

  def __getattr__(attr):  # resolved while CLU's package imports, after its interface module
    if attr == "SummaryWriter":
      module.SummaryWriter = _tensorboardx_writer_class()
      return module.SummaryWriter
    raise AttributeError(attr)

  module.__getattr__ = __getattr__
  sys.modules[name] = module


install()

from clu import metric_writers  # noqa: E402  (after install)
from clu.metric_writers import interface  # noqa: E402


class ScalarWriter(interface.MetricWriter):
  """A writer of scalars (and hparams) only: every other kind of summary is dropped. Ours log
  nothing else, and CLU's interface wants each method."""

  def write_summaries(self, step, values, metadata=None):
    pass

  def write_images(self, step, images):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_texts(self, step, texts):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass


class JsonlWriter(ScalarWriter):
  """WORKDIR/metrics.jsonl: one JSON object per logged step, `step` and all its scalars (writes
  for the same step, such as training and evaluation metrics, are merged into one line).

  A run resuming from step N first drops the lines of steps after N (logged after its last
  checkpoint, before a crash: they are logged again) and a torn last line, so the file never
  repeats a step."""

  def __init__(self, path: str | os.PathLike, resumed_at: int = 0):
    _drop_after(path, resumed_at)
    self._file = open(path, "a", buffering=1)
    self._pending: dict[str, Any] = {}

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    if self._pending and self._pending["step"] != int(step):
      self.flush()
    self._pending.setdefault("step", int(step))
    self._pending.update({k: float(np.asarray(v)) for k, v in scalars.items()})

  def write_hparams(self, hparams):
    pass

  def flush(self):
    if self._pending:
      self._file.write(json.dumps(self._pending) + "\n")
      self._pending = {}
    self._file.flush()

  def close(self):
    self.flush()
    self._file.close()


def _drop_after(path: str | os.PathLike, step: int) -> None:
  """Rewrites `path` (atomically) without its lines of steps after `step` and without a last
  line a crash cut short."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = f.read().split("\n")
  kept = []
  for line in lines[:-1]:  # the part after the last newline is empty or torn
    if line.strip() and json.loads(line)["step"] <= step:
      kept.append(line + "\n")
  if len(kept) != len(lines) - 1 or lines[-1]:
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
      f.writelines(kept)
    os.replace(tmp, path)


def create_writer(workdir: str | os.PathLike, is_main_process: bool, resumed_at: int = 0
                  ) -> interface.MetricWriter:
  """Logs everywhere; TensorBoard events and metrics.jsonl from the main process only (resumed
  at step `resumed_at`: see JsonlWriter). A workdir in an object store gets both through a
  local mirror (`MirroredWriter`)."""
  if not is_main_process:
    return metric_writers.create_default_writer(just_logging=True, asynchronous=False)
  workdir = os.fspath(workdir)
  local = tempfile.mkdtemp(prefix="olmo3-metrics-") if storage.is_url(workdir) else workdir
  if local != workdir and storage.exists(storage.join(workdir, METRICS_JSONL)):
    with open(os.path.join(local, METRICS_JSONL), "wb") as f:  # continued, then uploaded whole
      f.write(storage.read_bytes(storage.join(workdir, METRICS_JSONL)))
  default = metric_writers.create_default_writer(os.path.join(local, "tensorboard"),
                                                 asynchronous=False)
  writer = metric_writers.MultiWriter([
      default, JsonlWriter(os.path.join(local, METRICS_JSONL), resumed_at)])
  return writer if local == workdir else MirroredWriter(writer, local, workdir)


class MirroredWriter(interface.MetricWriter):
  """Writes through `inner` into a local directory and uploads the files that changed to
  `remote` (an object-store URL) at each flush: an object store cannot append, so each file
  is uploaded whole and replaces the previous upload at once. The loop flushes before every
  checkpoint and at the end, so the bucket's metrics are never behind its checkpoints."""

  def __init__(self, inner: interface.MetricWriter, local: str, remote: str):
    self.inner, self.local, self.remote = inner, local, remote
    self._uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns)

  def write_scalars(self, step, scalars):
    self.inner.write_scalars(step, scalars)

  def write_summaries(self, step, values, metadata=None):
    self.inner.write_summaries(step, values, metadata)

  def write_images(self, step, images):
    self.inner.write_images(step, images)

  def write_videos(self, step, videos):
    self.inner.write_videos(step, videos)

  def write_audios(self, step, audios, *, sample_rate):
    self.inner.write_audios(step, audios, sample_rate=sample_rate)

  def write_texts(self, step, texts):
    self.inner.write_texts(step, texts)

  def write_histograms(self, step, arrays, num_buckets=None):
    self.inner.write_histograms(step, arrays, num_buckets)

  def write_hparams(self, hparams):
    self.inner.write_hparams(hparams)

  def flush(self):
    self.inner.flush()
    for root, _, files in os.walk(self.local):
      for name in files:
        path = os.path.join(root, name)
        rel = os.path.relpath(path, self.local)
        stat = os.stat(path)
        if self._uploaded.get(rel) != (stat.st_size, stat.st_mtime_ns):
          with open(path, "rb") as f:
            storage.write_bytes_atomic(storage.join(self.remote, *rel.split(os.sep)), f.read())
          self._uploaded[rel] = (stat.st_size, stat.st_mtime_ns)

  def close(self):
    self.inner.close()
    self.flush()
    shutil.rmtree(self.local, ignore_errors=True)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, float]]:
  """The rows of a metrics.jsonl (a local path or a URL)."""
  return [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]


# --- Weights & Biases (the `wandb` extra) --------------------------------------------------------

WANDB_RUN_ID = "wandb_run_id"  # in the workdir: the W&B run a resumed run continues
_RUN_ID_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"  # W&B's own ids: 8 of these


class MetricsError(Exception):
  """A metric writer that cannot start (a missing extra); the message says what to install."""


class WandbWriter(ScalarWriter):
  """CLU MetricWriter -> a W&B run: the scalars at the steps the other writers get (the loop
  writes scalars only; hyperparameters go into the run's config)."""

  def __init__(self, run: Any):
    self._run = run

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    # W&B merges the writes of one step (a training row, then its evaluation) into one row.
    self._run.log({k: float(np.asarray(v)) for k, v in scalars.items()}, step=int(step))

  def write_hparams(self, hparams: Mapping[str, Any]):
    self._run.config.update(dict(hparams), allow_val_change=True)

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
