"""Checkpoints are verified, damage is quarantined without losing a good step, a checkpoint that
does not fit is a config error, changed data is refused, and a failed save stops the run: all
on one trained run (steps 2, 4, 6), copied per test, in process."""

import dataclasses
import errno
import fcntl
import logging
import os
import re
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

from olmo3.io import checkpoint
from olmo3.io import metrics as metrics_lib
from olmo3.io.checkpoint import CheckpointDamaged, CheckpointError
from olmo3.data.order import GlobalOrder
from olmo3.data.tokens import DataError
from olmo3.placement import ShardedModel
from olmo3.train import state as state_lib
from olmo3.train.run_checkpoints import OPT_STATE, RunCheckpoints
from olmo3.run.plan import RunPlan
from olmo3.train.loop import train

from train_helpers import micro_experiment, write_corpus


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
  """(experiment, workdir) of a 6-step run with checkpoints at steps 2, 4 and 6: trained once
  per test session, by whichever xdist worker asks first (the others wait on the lock)."""
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent  # this session's directory, the same for every worker
  root = shared / "checkpoints_trained"
  with open(shared / "checkpoints_trained.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (root / "done").exists():
      root.mkdir(exist_ok=True)
      exp = micro_experiment(write_corpus(root), steps=6, every=2)
      train(RunPlan.build(exp, str(root / "run")))
      (root / "done").touch()
  return micro_experiment(str(root / "train.npy"), steps=6, every=2), root / "run"


def _copy(trained, tmp_path, steps=(2, 4)):
  """A copy of the trained run holding only `steps` (a run that stopped at the last)."""
  _, run = trained
  workdir = tmp_path / "run"
  shutil.copytree(run, workdir, ignore=shutil.ignore_patterns("lease.json"))
  for path in (workdir / "checkpoints").iterdir():
    if path.name.isdigit() and int(path.name) not in steps:
      shutil.rmtree(path)
  return workdir


def _resume(exp, workdir, keep=10):
  """(state, data position, checkpoints) a run in `workdir` resumes with."""
  model = ShardedModel.for_experiment(exp)
  checkpoints = RunCheckpoints(workdir / "checkpoints", keep, False)
  with model.context():
    state, position = state_lib.restore_or_init(
        state_lib.StateLayout(exp, model), checkpoints, RunPlan.build(exp, str(workdir)))
  return state, position, checkpoints


def _data_file(step_dir, item):
  """The largest array-data file of an item (OCDBT keeps array chunks under d/)."""
  files = [p for p in (step_dir / item).rglob("*") if p.is_file() and p.parent.name == "d"]
  return max(files, key=lambda p: p.stat().st_size)


def _chunk(step_dir, item):
  """(file, offset, length, array) of the largest array chunk of an item stored in a data file:
  where OCDBT's b-tree says its compressed bytes lie, and the name a damage message gives the
  array (the chunk's key is `<Orbax's dotted name>/<chunk index>`)."""
  kv = ts.KvStore.open({"driver": "file", "path": f"{step_dir / item}/"}).result()
  manifest = ts.ocdbt.dump(kv).result()
  assert manifest["versions"][-1]["root_height"] == 0  # one b-tree node: a small checkpoint
  node = ts.ocdbt.dump(kv, manifest["versions"][-1]["root"]["location"]).result()
  chunks = []
  for entry in node["entries"]:
    if "indirect_value" in entry:  # "value:<prefix>:<file>:<offset>:<length>"
      prefix, name, offset, length = entry["indirect_value"].removeprefix("value:").rsplit(":", 3)
      chunks.append((int(length), step_dir / item / prefix / name, int(offset),
                     entry["key"].decode()))
  length, path, offset, key = max(chunks)
  array = f"[{item!r}]" + "".join(f"[{k}]" if k.isdigit() else f"[{k!r}]"
                                  for k in key.split("/")[0].split("."))
  return path, offset, length, array


def _rewrite_chunk(path, offset, length):
  """Rewrites a chunk in place, in its file's bytes, as a valid zstd frame of the same length
  and content size that decodes to zeros (RFC 8878: the frame's header, then RLE blocks of
  zeros, padded with empty raw blocks): damage that reads back without error, as other values."""
  data = bytearray(path.read_bytes())
  frame = data[offset:offset + length]
  fhd = frame[4]  # frame header descriptor
  assert frame[:4] == b"\x28\xb5\x2f\xfd" and fhd & 0x20, "a single-segment zstd frame"
  start, width = 5 + (0, 1, 2, 4)[fhd & 3], (1, 2, 4, 8)[fhd >> 6]
  size = int.from_bytes(frame[start:start + width], "little") + (256 if width == 2 else 0)
  out = bytearray(frame[:start + width])
  runs = [min(1 << 17, size - i) for i in range(0, size, 1 << 17)]  # a block holds <= 128 KiB
  room = length - len(out) - 4 * len(runs)  # an RLE block: 3 bytes of header and the byte
  while room % 3:  # an empty raw block is 3 bytes; one more RLE block changes room mod 3
    runs, room = [1, runs[0] - 1] + runs[1:], room - 4
  blocks = [(0, 0)] * (room // 3) + [(1, n) for n in runs]  # (type: 0 raw, 1 RLE; size)
  for i, (kind, n) in enumerate(blocks):
    out += ((n << 3) | (kind << 1) | (i == len(blocks) - 1)).to_bytes(3, "little")
    out += b"\0" * kind
  assert len(out) == length
  data[offset:offset + length] = out
  path.write_bytes(bytes(data))


def _flip(path, nbytes=16, mask=0xFF, start=None):
  """Flips bits at `start` (default: the middle) of a file; its length is unchanged."""
  data = bytearray(path.read_bytes())
  start = len(data) // 2 if start is None else start
  for i in range(start, start + nbytes):
    data[i] ^= mask
  path.write_bytes(bytes(data))


def _finite(tree):
  return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


def _names(directory):
  return sorted(p.name for p in directory.iterdir())


def test_checksums_are_the_same_on_the_host_and_on_any_mesh_and_see_one_bit():
  rng = np.random.default_rng(0)
  arrays = {"f32": rng.standard_normal((8, 6, 5)).astype(np.float32),
            "bf16": rng.standard_normal((8, 3)).astype(jnp.bfloat16),
            "i32": np.arange(-8, 8, dtype=np.int32), "flag": np.array([True, False]),
            "count": np.array(7, np.int32)}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
  spread = {k: jax.device_put(v, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(*(["x"] if v.ndim and len(v) % 8 == 0 else []))))
            for k, v in arrays.items()}
  host = checkpoint.summarize(arrays)
  assert checkpoint.summarize(spread) == host
  assert checkpoint.summarize(jax.device_put(arrays, jax.devices()[3])) == host
  flipped = arrays["f32"].copy()
  flipped.view(np.uint32)[5, 2, 1] ^= 1 << 7
  swapped = arrays["i32"].copy()
  swapped[[3, 4]] = swapped[[4, 3]]
  changed = checkpoint.summarize({"f32": flipped, "i32": swapped})
  assert changed["['f32']"] != host["['f32']"] and changed["['i32']"] != host["['i32']"]
  assert not checkpoint.summarize({"x": np.array([1.0, np.inf], jnp.bfloat16)})["['x']"].finite


def _damage_logged(caplog):
  """The one damage message logged (one line, with no TensorStore spec)."""
  [message] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
  assert "\n" not in message and "kvstore" not in message and "tensorstore_spec" not in message
  return message


def test_changed_values_in_opt_state_are_named_quarantined_and_the_run_resumes(
    trained, tmp_path, caplog):
  """The user's fault: 16 bytes flipped in an Adam-moment data file restored as NaN, silently.
  Here a chunk of an Adam moment reads back without error as other values (zeros): the step,
  the array and its item's directory are named with the checksums, the step is set aside,
  training resumes from step 2 and reproduces the uninterrupted run's losses."""
  exp, full = trained
  workdir = _copy(trained, tmp_path)
  step_dir = workdir / "checkpoints" / "4"
  path, offset, length, array = _chunk(step_dir, OPT_STATE)
  _rewrite_chunk(path, offset, length)
  with caplog.at_level(logging.ERROR):
    train(RunPlan.build(exp, str(workdir)))
  assert _damage_logged(caplog).startswith(
      f"{step_dir} is damaged: {array} in {step_dir / OPT_STATE}: checksum mismatch (saved ")
  assert "4.damaged-1" in _names(workdir / "checkpoints")

  def losses(run):
    return {r["step"]: r["loss"] for r in metrics_lib.read_jsonl(run / "metrics.jsonl")
            if "loss" in r}

  assert losses(workdir) == losses(full)
  state, _, _ = _resume(exp, workdir)
  assert int(state.step) == 6 and _finite((state.params, state.opt_state))


def test_an_unreadable_chunk_in_opt_state_is_named_with_the_librarys_cause(trained, tmp_path,
                                                                           caplog):
  """A chunk whose zstd frame no longer decodes (its magic number flipped): the same form as a
  checksum mismatch, the cause the first line of TensorStore's error, never its spec; the step
  is set aside and the run resumes from step 2."""
  exp, _ = trained
  workdir = _copy(trained, tmp_path)
  step_dir = workdir / "checkpoints" / "4"
  path, offset, _, array = _chunk(step_dir, OPT_STATE)
  _flip(path, nbytes=4, start=offset)
  with caplog.at_level(logging.ERROR):
    state, _, _ = _resume(exp, workdir)
  message = _damage_logged(caplog)
  assert message.startswith(f"{step_dir} is damaged: {array} in {step_dir / OPT_STATE}: "
                            "unreadable (ValueError: "), message
  assert "Unknown frame descriptor" in message
  assert int(state.step) == 2 and "4.damaged-1" in _names(workdir / "checkpoints")


def test_a_storage_outage_under_orbax_s_wrapper_is_not_damage():
  """Orbax wraps TensorStore's read error in one naming only the array: an outage of the
  storage service inside it is the environment's, never a reason to set a step aside."""
  with pytest.raises(Exception) as raised:
    try:
      raise ValueError('UNAVAILABLE: Error reading "layers.w/0.0" in OCDBT database at "gs://b/"')
    except ValueError as e:
      raise Exception("Encountered error while reading array index: (slice(0, 2, 1),)") from e
  assert checkpoint.is_environmental(raised.value)


def test_one_flipped_bit_in_the_parameters_is_detected(trained, tmp_path):
  exp, _ = trained
  workdir = _copy(trained, tmp_path)
  step_dir = workdir / "checkpoints" / "4"
  _flip(_data_file(step_dir, checkpoint.PARAMS), nbytes=1, mask=0x01)
  strict = dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint,
                                                                   fallback=False))
  with pytest.raises(CheckpointError, match=r"checkpoints/4 is damaged: \['params'\].*"
                                            r"\(checkpoint.fallback is off\)"):
    _resume(strict, workdir)
  assert _names(workdir / "checkpoints")[:2] == ["2", "4"]  # fallback off: nothing moved
  model = ShardedModel.for_experiment(exp)  # the same check guards every reader of params
  with pytest.raises(CheckpointDamaged, match=r"\['params'\]"):
    checkpoint.restore_params(step_dir, checkpoint.host_target(model.param_shapes))


def test_a_checkpoint_that_does_not_fit_is_a_config_error_and_nothing_moves(trained, tmp_path):
  exp, _ = trained
  workdir = _copy(trained, tmp_path)
  before = _names(workdir / "checkpoints")
  wider = dataclasses.replace(exp, model=exp.model.replace(mlp_hidden=128))
  with pytest.raises(CheckpointError,
                     match=r"parameter \['layers'\]\['mlp'\]\['down_proj'\]\['kernel'\] has shape "
                           r"\(6, 96, 64\) in the checkpoint; the model expects \(6, 128, 64\)"):
    _resume(wider, workdir)
  assert _names(workdir / "checkpoints") == before


def test_quarantine_names_are_unique_and_an_all_damaged_run_refuses_to_start_over(
    trained, tmp_path):
  exp, full = trained
  workdir = _copy(trained, tmp_path)
  checkpoints = workdir / "checkpoints"
  for _ in range(2):  # the same step damaged twice
    _flip(_data_file(checkpoints / "4", OPT_STATE))
    state, _, _ = _resume(exp, workdir)
    assert int(state.step) == 2
    shutil.copytree(full / "checkpoints" / "4", checkpoints / "4")  # step 4 redone
  assert [n for n in _names(checkpoints) if "damaged" in n] == ["4.damaged-1", "4.damaged-2"]
  for step in ("2", "4"):
    _flip(_data_file(checkpoints / step, checkpoint.PARAMS))
  for _ in range(2):  # the rerun after the refusal refuses too
    with pytest.raises(CheckpointError, match=r"none is usable: quarantined as damaged .*"
                                              r"'4.damaged-3'.*Not starting over.*"
                                              r"checkpoint\.allow_restart_from_scratch=True"):
      _resume(exp, workdir)
  assert not any(n.isdigit() for n in _names(checkpoints))
  # Only when asked: a fresh start, the quarantined steps kept.
  again = dataclasses.replace(exp, checkpoint=dataclasses.replace(
      exp.checkpoint, allow_restart_from_scratch=True))
  state, _, _ = _resume(again, workdir)
  assert int(state.step) == 0 and len([n for n in _names(checkpoints) if "damaged" in n]) == 4


def test_rotation_keeps_the_step_the_run_resumed_from(trained, tmp_path):
  exp, _ = trained
  workdir = _copy(trained, tmp_path)
  state, position, checkpoints = _resume(exp, workdir, keep=1)
  for step in (6, 8):
    state_lib.save(checkpoints, state._replace(step=jnp.int32(step)),
                   RunPlan.build(exp, str(workdir)), position)
  checkpoints.wait()
  assert checkpoints.steps() == [4, 8]


def test_a_save_of_nan_is_refused_and_writes_nothing(tmp_path):
  checkpoints = RunCheckpoints(tmp_path / "checkpoints", 3, True)
  params = {"w": jnp.array([1.0, jnp.nan])}
  with pytest.raises(CheckpointError, match=r"refusing to save \['params'\]\['w'\]: NaN/Inf"):
    checkpoints.save(1, params, {"m": jnp.zeros(2)}, {"step": 1})
  checkpoints.wait()
  assert checkpoints.steps() == [] and not list((tmp_path / "checkpoints").iterdir())


def test_an_update_that_would_be_non_finite_is_skipped(trained):
  """Finite loss and gradients, but the update would leave an Inf in Adam's second moment:
  the step is skipped like a NaN loss, and parameters and moments stay exactly as they were."""
  from olmo3.data import pipeline
  from olmo3.train.step import jit_train_step

  exp, _ = trained
  model = ShardedModel.for_experiment(exp)
  layout = state_lib.StateLayout(exp, model)
  with model.context():
    state = layout.fresh()
    nu = state.opt_state[1].nu
    nu["norm"]["weight"] = nu["norm"]["weight"].at[0].set(jnp.inf)
    before = jax.device_get((state.params, state.opt_state))
    batch = next(iter(pipeline.Loader(exp.data, model.batch_sharding, start_step=0,
                                      num_steps=1, vocab_size=exp.model.vocab_size)))
    state, metrics = jit_train_step(exp, model, layout)(state, batch)
  assert float(metrics["skipped"]) == 1.0
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state))):
    np.testing.assert_array_equal(a, np.asarray(b))


def _changed(exp, **data):
  return dataclasses.replace(exp, data=dataclasses.replace(exp.data, **data))


def test_changed_data_is_refused_naming_the_change(trained, tmp_path):
  exp, _ = trained
  workdir = _copy(trained, tmp_path)
  with pytest.raises(DataError, match=r"data changed since checkpoint .*checkpoints/4 \(step 4, "
                                      r"32 instances consumed\): data.seed was 1, now 2"):
    _resume(_changed(exp, seed=2), workdir)
  with pytest.raises(DataError, match=r"data.global_batch_size was 8, now 4"):
    _resume(_changed(exp, global_batch_size=4), workdir)
  assert _names(workdir / "checkpoints")[:2] == ["2", "4"]
  # A token file shortened in place (the run's own copy: the trained run's file is shared).
  corpus = tmp_path / "train.npy"
  shutil.copy(exp.data.paths[0], corpus)
  own = _changed(exp, paths=(str(corpus),))
  state, _, _ = _resume(exp, workdir)
  checkpoints = RunCheckpoints(tmp_path / "own" / "checkpoints", 3, False)
  plan = RunPlan.build(own, str(tmp_path / "own"))
  state_lib.save(checkpoints, state, plan, state_lib.DataPosition(plan.identity))
  corpus.write_bytes(corpus.read_bytes()[:-4000])
  with pytest.raises(DataError, match=rf"token file {corpus} held 40000 tokens, now 39000"):
    _resume(own, tmp_path / "own")


def test_allowed_data_change_continues_at_the_same_instance(trained, tmp_path):
  """The global batch halved at step 4 (32 instances consumed): the loader continues at data
  step 8 of the new batch, whose instances are the next ones of the same epoch order; the LR
  schedule's step stays 4. Checkpoints then record the new data and the moved position."""
  exp, _ = trained
  workdir = _copy(trained, tmp_path)
  half = _changed(exp, global_batch_size=4, allow_changed_data=True)
  state, position, checkpoints = _resume(half, workdir)
  assert int(state.step) == 4 and position.data_step(4) == 8
  n = 40_000 // 32
  np.testing.assert_array_equal(GlobalOrder(n, 4, 1).batch(8), GlobalOrder(n, 8, 1).batch(4)[:4])
  state_lib.save(checkpoints, state._replace(step=jnp.int32(5)), RunPlan.build(half, str(workdir)),
                 position)
  checkpoints.wait()
  _, again, _ = _resume(half, workdir)  # no change since: no override needed
  assert again.data_step(5) == 9


def test_a_failed_async_save_stops_the_run_at_once_with_its_cause(tmp_path, monkeypatch):
  """The disk fills while step 4 is written in the background: the run stops within the next
  steps (not at the save of step 6) with the OS error and the path, naming the steps that are
  there (step 2: rotation, keeping 1, had already dropped it from Orbax's own list); step 4 is
  never listed, and its partial directory is removed when the run restarts."""
  import builtins

  exp = micro_experiment(write_corpus(tmp_path), steps=12, every=2)
  exp = dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint, keep=1))
  checkpoints = tmp_path / "run" / "checkpoints"
  real_open = builtins.open

  def full_disk(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax") and os.fspath(file).startswith(f"{checkpoints}/4."):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
    return real_open(file, mode, *args, **kwargs)

  monkeypatch.setattr(builtins, "open", full_disk)
  with pytest.raises(CheckpointError, match=r"saving checkpoint step 4 .* failed: OSError: "
                                            r"\[Errno 28\] No space left on device: '.*/4\..*"
                                            r"It is not listed; the checkpoints are steps \[2\]$"):
    train(RunPlan.build(exp, str(tmp_path / "run")))
  monkeypatch.undo()
  logged = [r["step"] for r in metrics_lib.read_jsonl(tmp_path / "run" / "metrics.jsonl")
            if "loss" in r]
  assert max(logged) < 6
  deadline = time.time() + 30
  while True:  # a restart removes the partial step 4 (in the background; in this process the
    # failed save's last writers may still be finishing, so restart until it stays removed)
    assert RunCheckpoints(checkpoints, 3, True).steps() == [2]
    time.sleep(0.2)
    if _names(checkpoints) == ["2"] or time.time() > deadline:
      break
  assert _names(checkpoints) == ["2"]


@pytest.mark.parametrize("how", ["emptied", "without meta"])
def test_a_committed_step_emptied_or_without_its_meta_is_damage_set_aside(trained, tmp_path,
                                                                           caplog, how):
  """Inside the run's own checkpoints a committed step missing its meta is damage (quarantined,
  the run falls back), not "not a model checkpoint" stopping every resume."""
  exp, _ = trained
  workdir = _copy(trained, tmp_path)
  step_dir = workdir / "checkpoints" / "4"
  for part in list(step_dir.iterdir()) if how == "emptied" else [step_dir / "meta"]:
    shutil.rmtree(part) if part.is_dir() else part.unlink()
  with caplog.at_level(logging.ERROR):
    state, _, _ = _resume(exp, workdir)
  assert int(state.step) == 2
  assert _damage_logged(caplog).startswith(f"{step_dir} is damaged: ['meta'] in "
                                           f"{step_dir / 'meta'}: missing")
  assert "4.damaged-1" in _names(workdir / "checkpoints")


def test_a_disk_with_room_for_one_checkpoint_but_not_for_rotation_refuses_a_fresh_run(
    tmp_path, monkeypatch):
  """Rotation removes a step only once the next has landed, so a run keeping 2 checkpoints
  grows its directory to 3: with room for one and a half, it is refused before step 1 (on a
  40 MB disk the tiny run saved step 1, then failed writing step 2 with Orbax's lines)."""
  from olmo3.train.state import StateLayout

  exp = micro_experiment(write_corpus(tmp_path), steps=6, every=2)
  exp = dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint, keep=2))
  layout = StateLayout(exp, ShardedModel.for_experiment(exp))
  size = sum(x.size * x.dtype.itemsize
             for x in jax.tree.leaves((layout.abstract.params, layout.abstract.opt_state)))
  real = shutil.disk_usage
  monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=int(1.5 * size)))
  with pytest.raises(CheckpointError, match=(
      r"has 0.00 GiB free; this run adds 3 checkpoints of 0.00 GiB before rotation "
      r"\(checkpoint.keep=2\) removes one: free space there, lower checkpoint.keep, or give "
      r"--workdir on a disk with room$")):
    train(RunPlan.build(exp, str(tmp_path / "run")))
  assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


def test_a_disk_without_room_for_the_next_checkpoint_stops_the_run_before_it_trains(
    trained, tmp_path, monkeypatch):
  """A local workdir whose disk has less room than one more checkpoint: a CheckpointError
  naming both sizes before step 5 is trained (it trained the interval, then failed to save it,
  and the rerun trained it again to fail the same way)."""
  exp, _ = trained
  workdir = _copy(trained, tmp_path, steps=(2, 4))
  rows = (workdir / "metrics.jsonl").read_text()
  real = shutil.disk_usage
  monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=4096))
  with pytest.raises(CheckpointError, match=(
      rf"^{re.escape(str(workdir / 'checkpoints'))} has 0.00 GiB free; a checkpoint of this run "
      r"takes \d+\.\d\d GiB: free space there, or give --workdir on a disk with room$")):
    train(RunPlan.build(exp, str(workdir)))
  assert (workdir / "metrics.jsonl").read_text() == rows  # nothing trained
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [
      "2", "4"]


def test_a_launch_that_fenced_an_earlier_attempt_waits_for_its_save_in_flight(tmp_path, caplog):
  """The fenced attempt's save, begun while it held the lease, lands after the takeover: the
  later attempt lists the checkpoints only once it has (Orbax's temporary step renamed to the
  step), so it resumes from that step; a save that never lands is waited for up to the bound,
  said in one warning, and the committed steps are used."""
  import threading

  from olmo3.train.run_checkpoints import await_fenced_save

  directory = tmp_path / "checkpoints"
  (directory / "9").mkdir(parents=True)
  landing = directory / "10.orbax-checkpoint-tmp"
  landing.mkdir()
  lands = threading.Timer(0.6, lambda: landing.rename(directory / "10"))
  lands.start()
  start = time.monotonic()
  with caplog.at_level(logging.INFO):
    await_fenced_save(directory, "attempt 0", timeout_s=30)
  lands.join()
  assert 0.5 < time.monotonic() - start < 10 and (directory / "10").is_dir()
  assert "attempt 0 has a save in flight (10.orbax-checkpoint-tmp)" in caplog.text
  (directory / "11.orbax-checkpoint-tmp").mkdir()  # a save that never lands
  start = time.monotonic()
  await_fenced_save(directory, "attempt 0", timeout_s=0.5)
  assert time.monotonic() - start < 5
  assert re.search(r"attempt 0 still holds a save in flight after \d+ s "
                   r"\(11\.orbax-checkpoint-tmp\): resuming from the committed steps", caplog.text)
  # Abandoned (its writer died): nothing written into it for the quiet time, however long the
  # bound; a save that keeps writing is waited for past the quiet time.
  start = time.monotonic()
  await_fenced_save(directory, "attempt 0", timeout_s=60, quiet_s=0.5)
  assert time.monotonic() - start < 5 and "wrote nothing for 0 s: taken as abandoned" in (
      caplog.text.replace("for 1 s", "for 0 s"))
  shard = directory / "11.orbax-checkpoint-tmp" / "shard"
  writes = [threading.Timer(0.3 * i, lambda i=i: shard.write_bytes(b"x" * i)) for i in (1, 2, 3)]
  writes.append(threading.Timer(1.2, lambda: (directory / "11.orbax-checkpoint-tmp").rename(
      directory / "11")))
  for w in writes:
    w.start()
  await_fenced_save(directory, "attempt 0", timeout_s=60, quiet_s=0.5)
  assert (directory / "11").is_dir()
  await_fenced_save(tmp_path / "none", "attempt 0", timeout_s=30)  # no directory: no wait
