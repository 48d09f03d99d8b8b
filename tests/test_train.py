import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from olmo3.config import OptimizerConfig, Schedule
from olmo3.io import metrics as metrics_lib
from olmo3.train import optim
from olmo3.placement import ShardedModel
from olmo3.train import state as state_lib
from olmo3.train.run_checkpoints import RunCheckpoints
from olmo3.run.plan import RunPlan
from olmo3.train.loop import train

from train_helpers import micro_experiment, write_corpus


def test_weight_decay_spares_only_the_input_embedding():
  params = {"embed_tokens": {"embedding": jnp.ones((4, 2))}, "lm_head": {"kernel": jnp.ones((2, 4))},
            "norm": {"weight": jnp.ones(2)}}
  tx = optim.adamw(OptimizerConfig(weight_decay=0.1), params)
  zero = jax.tree.map(jnp.zeros_like, params)
  lr = 1e-2
  updates, _ = tx.update(zero, tx.init(params), params, lr=lr)
  new = jax.tree.map(lambda p, u: p + u, params, updates)
  assert (new["embed_tokens"]["embedding"] == 1).all()
  np.testing.assert_allclose(new["lm_head"]["kernel"], 1 - lr * 0.1)  # p *= 1 - lr·wd
  np.testing.assert_allclose(new["norm"]["weight"], 1 - lr * 0.1)


@pytest.mark.seconds(5)
def test_adam_moments_are_sharded_like_their_parameters(tmp_path):
  """Every Adam moment lives where its parameter lives: a replicated moment would put a full
  copy of the optimizer state on every device (the 7B would need 58 GB more per device)."""
  exp = micro_experiment(write_corpus(tmp_path))
  state = state_lib.StateLayout(exp, ShardedModel.for_experiment(exp)).fresh()
  params = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
  moments = 0
  for path, x in jax.tree_util.tree_leaves_with_path(state.opt_state):
    key = jax.tree_util.keystr(path)
    owner = [p for p in params if key.endswith(p)]
    if not owner:
      assert x.size == 1  # Adam's step count
      continue
    moments += 1
    assert x.sharding.is_equivalent_to(params[owner[0]].sharding, x.ndim), key
  assert moments == 2 * len(params)
  # The big matrices are split over the 8 devices, not replicated.
  kernel = state.opt_state[1].mu["lm_head"]["kernel"]
  assert kernel.addressable_shards[0].data.size * 8 == kernel.size


def _restored(exp, workdir):
  """The state a run in `workdir` resumes from (its latest checkpoint, or init_from)."""
  model = ShardedModel.for_experiment(exp)
  with model.context():
    return state_lib.restore_or_init(state_lib.StateLayout(exp, model),
                                     RunCheckpoints(f"{workdir}/checkpoints", 10, False),
                                     RunPlan.build(exp, str(workdir)))[0]


def _losses(workdir):
  by_step = {}
  for row in metrics_lib.read_jsonl(f"{workdir}/metrics.jsonl"):
    if "loss" in row:
      by_step[row["step"]] = row["loss"]  # the last write wins (a resumed run rewrites steps)
  return by_step


def _dispatches_and_rows(monkeypatch) -> list[str]:
  """The order in which the loop dispatches steps and writes their rows, as it runs."""
  from olmo3.train import loop

  events = []
  compiled_step, create_writer = loop.compiled_step, metrics_lib.create_writer

  def compiled_spy(*args):
    step_fn = compiled_step(*args)

    def dispatch(state, batch):
      events.append(f"dispatch {sum(e.startswith('dispatch') for e in events) + 1}")
      return step_fn(state, batch)

    return dispatch

  def writer_spy(*args, **kwargs):
    writer = create_writer(*args, **kwargs)
    write = writer.write_scalars

    def write_scalars(step, values):
      if "loss" in values:  # a row (not CLU's progress report)
        events.append(f"row {step}")
      write(step, values)

    writer.write_scalars = write_scalars
    return writer

  monkeypatch.setattr(loop, "compiled_step", compiled_spy)
  monkeypatch.setattr(metrics_lib, "create_writer", writer_spy)
  return events


@pytest.mark.seconds(11)
def test_training_reduces_loss_and_resume_is_bit_identical(tmp_path, monkeypatch):
  """Also: the devices never wait while the host fetches and writes a row. Step s's row is read
  after step s + 1 is dispatched, except where the loop needs step s anyway (a checkpoint, the
  last step)."""
  path = write_corpus(tmp_path)
  full = micro_experiment(path, steps=8)
  events = _dispatches_and_rows(monkeypatch)
  train(RunPlan.build(full, str(tmp_path / "full")))  # checkpoints at 2, 4, 6, 8
  assert events == ["dispatch 1", "dispatch 2", "row 1", "row 2", "dispatch 3", "dispatch 4",
                    "row 3", "row 4", "dispatch 5", "dispatch 6", "row 5", "row 6",
                    "dispatch 7", "dispatch 8", "row 7", "row 8"]
  first = dataclasses.replace(full, train=dataclasses.replace(full.train, steps=5))
  train(RunPlan.build(first, str(tmp_path / "resumed")))  # checkpoints at 2, 4, 5
  train(RunPlan.build(full, str(tmp_path / "resumed")))  # resumes from step 5
  a, b = _losses(tmp_path / "full"), _losses(tmp_path / "resumed")
  assert sorted(a) == sorted(b) == list(range(1, 9))
  assert a == b  # bit-identical on CPU, step for step
  assert a[8] < a[1] - 1.0  # it learns


@pytest.mark.seconds(6)
def test_the_host_runs_one_step_ahead_of_the_devices_and_no_further(tmp_path, monkeypatch):
  """When step s is dispatched, step s - 2 has ended, though no row, evaluation or save needs
  it (rows every 100 steps): a signal stops the step under way or the one queued behind it.
  With the host free to run ahead, Ctrl-C seen after step 10's row stopped a run at step 16."""
  from olmo3.train import loop

  compiled_step, ready = loop.compiled_step, {}

  def spy(*args):
    step_fn, dispatched = compiled_step(*args), []

    def dispatch(state, batch):
      if len(dispatched) >= 2:
        ready[len(dispatched) + 1] = all(m.is_ready() for m in dispatched[-2].values())
      state, step_metrics = step_fn(state, batch)
      dispatched.append(step_metrics)
      return state, step_metrics
    return dispatch

  monkeypatch.setattr(loop, "compiled_step", spy)
  exp = micro_experiment(write_corpus(tmp_path), steps=8, every=100)
  exp = dataclasses.replace(exp, model=exp.model.replace(d_model=256, n_layers=4),
                            train=dataclasses.replace(exp.train, log_every=100))
  train(RunPlan.build(exp, str(tmp_path / "run")))
  assert ready == {s: True for s in range(3, 9)}


@pytest.mark.seconds(22)
def test_stage2_starts_fresh_from_stage1_moments_on_any_mesh(tmp_path, caplog):
  """Stage 2 takes stage 1's parameters and moments; on another layout (the hardware switch
  between stages: here 8 devices in one fsdp axis -> 4 in data x fsdp) it trains the same."""
  path = write_corpus(tmp_path)
  stage1 = micro_experiment(path, steps=4)
  train(RunPlan.build(stage1, str(tmp_path / "s1")))
  stage2 = dataclasses.replace(
      stage1, data=dataclasses.replace(stage1.data, seed=1337),
      optimizer=dataclasses.replace(stage1.optimizer, schedule=Schedule.LINEAR, warmup_steps=0,
                                    final_lr=0.0, decay_steps=3),
      train=dataclasses.replace(stage1.train, steps=3),
      checkpoint=dataclasses.replace(stage1.checkpoint, init_from=str(tmp_path / "s1")))
  state = _restored(stage2, tmp_path / "s2")
  final1 = _restored(stage1, tmp_path / "s1")  # stage 1's latest checkpoint (step 4)
  assert int(state.step) == 0 and int(final1.step) == 4
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(final1.params)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(final1.opt_state)):
    np.testing.assert_array_equal(a, b)  # moments and Adam's count (bias correction) carried
  train(RunPlan.build(stage2, str(tmp_path / "s2")))
  assert sorted(_losses(tmp_path / "s2")) == [1, 2, 3]
  switched = dataclasses.replace(stage2, mesh=dataclasses.replace(
      stage2.mesh, shape=(("data", 2), ("fsdp", 2))))
  with caplog.at_level("INFO"):
    train(RunPlan.build(switched, str(tmp_path / "switched")),
          model=ShardedModel.for_experiment(switched, jax.devices()[:4]))
  assert (f"{tmp_path / 's1'}/checkpoints/4: written on {{'fsdp': 8}} of 8 cpu devices in 1 "
          "process; restored onto {'data': 2, 'fsdp': 2} of 4 cpu devices in 1 process, each "
          "array resharded as it is read") in caplog.text
  np.testing.assert_allclose(list(_losses(tmp_path / "switched").values()),
                             list(_losses(tmp_path / "s2").values()), rtol=1e-5)



NAN_MARK, SPIKE_MARK = 491, 490  # token ids the corpus never holds (it draws below 480)


class _Injecting(ShardedModel):
  """Turns a batch holding a marker token into a NaN loss or a large loss spike."""

  def features(self, params, tokens, segments=None, order=None):  # scales the head's input
    h = super().features(params, tokens, segments, order)
    scale = jnp.where(jnp.any(tokens == NAN_MARK), jnp.nan,
                      jnp.where(jnp.any(tokens == SPIKE_MARK), 30.0, 1.0))
    return h * scale.astype(h.dtype)


def _marked_corpus(tmp_path, marks):
  """The training corpus with marker tokens planted in the given instances."""
  from olmo3.data import tokens as tokens_lib

  path = write_corpus(tmp_path, vocab=480)
  data = np.fromfile(path, dtype="<u4")
  for instance, mark in marks.items():
    data[instance * 32] = mark
  tokens_lib.write_token_file(path, data)
  return path


def _skip_experiment(path, steps, **optimizer):
  exp = micro_experiment(path, steps=steps, every=1000)
  return dataclasses.replace(
      exp, optimizer=dataclasses.replace(exp.optimizer, spike_window=16, spike_min_history=8,
                                         **optimizer))


@pytest.mark.seconds(12)
def test_nan_and_spike_steps_are_skipped(tmp_path):
  """In the real loop: the NaN step and the injected loss spike are skipped, and every other
  decision is SkipStepAdamW's on the logged CE losses and gradient norms (OLMo-core's class
  replayed on them; the NaN step stays out of the window, our one deliberate difference)."""
  from olmo3.data.order import GlobalOrder
  from olmo_core.optim import SkipStepAdamW

  order = GlobalOrder(40_000 // 32, 8, seed=1)  # write_corpus: 40,000 tokens; micro's seed
  nan_step, spike_step = 12, 20
  path = _marked_corpus(tmp_path, {int(order.batch(nan_step - 1)[0]): NAN_MARK,
                                   int(order.batch(spike_step - 1)[0]): SPIKE_MARK})
  exp = _skip_experiment(path, steps=30)
  assert exp.data.seed == 1
  train(RunPlan.build(exp, str(tmp_path / "run")), model=_Injecting.for_experiment(exp))
  rows = {r["step"]: r for r in metrics_lib.read_jsonl(tmp_path / "run" / "metrics.jsonl")}
  skipped = [s for s in sorted(rows) if rows[s].get("skipped")]
  assert nan_step in skipped and spike_step in skipped and np.isnan(rows[nan_step]["loss"])
  reference = SkipStepAdamW([torch.nn.Parameter(torch.zeros(1))], rolling_interval_length=16)
  expected = [nan_step]
  for s in sorted(rows):
    if s == nan_step:
      continue
    reference.latest_loss = torch.tensor(rows[s]["ce_loss"])
    reference.latest_grad_norm = torch.tensor(rows[s]["grad_norm"])
    if reference.get_step_factor().item() == 0.0:
      expected.append(s)
  assert skipped == sorted(expected)
  state = _restored(exp, tmp_path / "run")  # the final checkpoint
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
  assert rows[30]["skipped_total"] == len(skipped)


@pytest.mark.seconds(8)
def test_consecutive_nan_steps_stop_the_run(tmp_path):
  path = _marked_corpus(tmp_path, {i: NAN_MARK for i in range(40_000 // 32)})
  exp = _skip_experiment(path, steps=20)
  exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, max_consecutive_skips=3))
  from olmo3.train.skips import TrainingStopped

  with pytest.raises(TrainingStopped, match="3 consecutive steps skipped"):
    train(RunPlan.build(exp, str(tmp_path / "run")), model=_Injecting.for_experiment(exp))


@pytest.mark.seconds(20)
def test_gradient_accumulation_trains_as_the_whole_batch(tmp_path):
  """Two microbatches per step (each 1/2 of every device's rows) give the losses and gradient
  norms of the whole batch at once, up to float32 summation order; a batch the microbatches
  cannot split over the devices is refused; speed is reported per device of the run's mesh."""
  from olmo3.data.tokens import DataError

  path = write_corpus(tmp_path)
  whole = micro_experiment(path, steps=4, every=10)
  # A moderate LR: at 1e-2 the micro model's loss jumps around and amplifies the float32
  # summation-order differences beyond what the comparison is about.
  whole = dataclasses.replace(whole, optimizer=dataclasses.replace(whole.optimizer, peak_lr=1e-3))
  accumulated = dataclasses.replace(whole, train=dataclasses.replace(whole.train, microbatches=2))
  devices = jax.devices()[:2]
  for name, exp in (("whole", whole), ("accumulated", accumulated)):
    train(RunPlan.build(exp, str(tmp_path / name)),
          model=ShardedModel.for_experiment(exp, devices))
  rows = {name: [r for r in metrics_lib.read_jsonl(tmp_path / name / "metrics.jsonl") if "loss" in r]
          for name in ("whole", "accumulated")}
  for key in ("loss", "grad_norm", "tokens", "train/all/ce_loss"):
    np.testing.assert_allclose([r[key] for r in rows["accumulated"]],
                               [r[key] for r in rows["whole"]], rtol=1e-5)
  # Speed is per device of the run's mesh (2 devices here), not of the machine's 8.
  flops = whole.model.flops_per_token(whole.data.seq_len) * whole.tokens_per_step
  for r in rows["whole"]:
    assert r["tflops_per_device"] * 1e12 * r["step_time_s"] * len(devices) == pytest.approx(
        flops, rel=1e-9)
  # `paths` files are one source: its loss is the batch's (nothing filtered, a log every step).
  np.testing.assert_allclose([r["train/all/ce_loss"] for r in rows["whole"]],
                             [r["ce_loss"] for r in rows["whole"]], rtol=1e-5)
  with pytest.raises(DataError, match=r"global_batch_size=8 .*TrainConfig.microbatches=8"):
    bad = dataclasses.replace(whole, train=dataclasses.replace(whole.train, microbatches=8))
    train(RunPlan.build(bad, str(tmp_path / "bad")),
          model=ShardedModel.for_experiment(bad, devices))


def test_source_losses_are_token_means_over_the_interval():
  from olmo3.train.rows import source_losses

  sums = [(np.array([6.0, 0.0, 1.0], np.float32), np.array([2, 0, 1], np.int32)),
          (np.array([3.0, 0.0, 0.0], np.float32), np.array([4, 0, 0], np.int32))]
  assert source_losses(("a", "b", "c"), sums) == {"train/a/ce_loss": 1.5, "train/c/ce_loss": 1.0}


@pytest.mark.seconds(8)
def test_a_stage_can_end_with_its_epoch(tmp_path, caplog):
  """train.stop_at_epoch: the stage ends where the epoch ends (4 steps of 8 instances here),
  before train.steps, and says so at startup; the last step is checkpointed."""
  import logging

  exp = micro_experiment(write_corpus(tmp_path), steps=10, every=100)
  exp = dataclasses.replace(exp, data=dataclasses.replace(exp.data, max_instances=32),
                            train=dataclasses.replace(exp.train, stop_at_epoch=1))
  with caplog.at_level(logging.WARNING):
    train(RunPlan.build(exp, str(tmp_path / "run")))
  assert "train.steps=10 but epoch 1 of the data ends at step 4" in caplog.text
  assert sorted(_losses(tmp_path / "run")) == [1, 2, 3, 4]
  assert RunCheckpoints(tmp_path / "run" / "checkpoints", 10, False).steps() == [4]


def test_loss_divisor_counts_filtered_instances_as_olmo_core_does():
  """A batch where the repetition filter masked one instance: OLMo-core's train module divides
  the summed CE and z-loss by the unmasked labels plus T for each masked instance."""
  from olmo_core.nn.functional import cross_entropy_loss

  from olmo3.loss import IGNORE, token_nll
  from olmo3.train.step import loss_and_grads

  rng = np.random.default_rng(0)
  b, t, v = 4, 16, 32
  logits = rng.standard_normal((b, t, v)).astype(np.float32) * 3
  labels = rng.integers(0, v, (b, t)).astype(np.int32)
  labels[:, -1] = IGNORE
  labels[1] = IGNORE  # the filtered instance
  filtered = np.array([False, True, False, False])
  exp = micro_experiment("unused")
  (loss, aux), _ = loss_and_grads(
      exp, lambda p, tokens, labels: token_nll(p["logits"], labels), None,
      {"logits": jnp.asarray(logits)},
      {"input_ids": jnp.zeros((b, t), jnp.int32), "labels": jnp.asarray(labels),
       "filtered": jnp.asarray(filtered), "source": jnp.zeros(b, jnp.int32)})
  torch_labels = torch.from_numpy(np.where(labels == IGNORE, -100, labels).astype(np.int64))
  ce_sum, z_sum = cross_entropy_loss(torch.from_numpy(logits).view(-1, v), torch_labels.view(-1),
                                     reduction="sum", compute_z_loss=True,
                                     z_loss_multiplier=exp.train.z_loss_weight)
  divisor = (torch_labels != -100).sum() + (~torch.from_numpy(~filtered)).sum() * t
  assert float(aux["ce_loss"]) == pytest.approx(float(ce_sum / divisor), rel=1e-6)
  assert float(loss) == pytest.approx(float((ce_sum + z_sum) / divisor), rel=1e-6)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_per_source_sums_match_a_direct_computation(microbatches):
  """Each source's summed CE and unmasked token count, from a bigram model's logits, as numpy
  computes them; whole or in microbatches, and whatever the sources, the loss is the same."""
  from olmo3.loss import IGNORE, token_nll
  from olmo3.train.step import loss_and_grads

  rng = np.random.default_rng(0)
  b, t, v, n_sources = 8, 16, 32, 3
  table = rng.standard_normal((v, v)).astype(np.float32) * 3
  ids = rng.integers(0, v, (b, t)).astype(np.int32)
  labels = np.concatenate([ids[:, 1:], np.full((b, 1), IGNORE)], axis=1).astype(np.int32)
  labels[2, 5:] = IGNORE
  source = np.array([2, 0, 2, 2, 0, 1, 2, 0], np.int32)
  exp = micro_experiment("unused")
  exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, microbatches=microbatches))
  token_losses = lambda p, tokens, labels: token_nll(p["table"][tokens], labels)

  def run(source, num_sources):
    replicated = {"table": jax.sharding.SingleDeviceSharding(jax.devices()[0])}
    return loss_and_grads(exp, token_losses, replicated, {"table": jnp.asarray(table)},
                          {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(labels),
                           "filtered": jnp.zeros(b, bool), "source": jnp.asarray(source)},
                          num_sources)

  (loss, aux), grads = run(source, n_sources)
  logits = table[ids].astype(np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  mask = labels >= 0
  nll = np.where(mask, -np.take_along_axis(logp, np.maximum(labels, 0)[..., None], -1)[..., 0], 0)
  for s in range(n_sources):
    assert float(aux["source_ce_sum"][s]) == pytest.approx(nll[source == s].sum(), rel=1e-5)
    assert int(aux["source_tokens"][s]) == mask[source == s].sum()
  (loss_one, _), grads_one = run(np.zeros(b, np.int32), 1)
  assert float(loss) == float(loss_one)
  for a, g in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_one)):
    np.testing.assert_array_equal(a, g)


def test_log_policy_quiets_libraries_info_until_verbose_and_skips_tpu_probing(monkeypatch):
  import logging as py_logging

  from olmo3.train import logs

  # configure() installs its unraisable hook: put back the one pytest had.
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  monkeypatch.setattr(logs, "_PREVIOUS_HOOK", logs._PREVIOUS_HOOK)  # pylint: disable=protected-access

  from absl import logging as absl_logging

  from olmo3 import platforms

  def record(path, level=py_logging.INFO):
    return py_logging.LogRecord("absl", level, path, 1, "msg", (), None)

  library = "/venv/lib/python3.11/site-packages/jax/_src/xla_bridge.py"
  orbax = "/venv/lib/python3.11/site-packages/orbax/checkpoint/_src/futures/future.py"
  ours = logs.__file__
  handler = absl_logging.get_absl_handler()
  try:
    logs.configure(0)
    assert sys.unraisablehook is logs._unraisable  # pylint: disable=protected-access
    assert not handler.filter(record(library))  # a library's INFO: dropped
    assert handler.filter(record(library, py_logging.WARNING))  # its warnings: kept
    # Orbax's errors: those of a save or restore the run reports itself, in its last line
    assert not handler.filter(record(orbax, py_logging.ERROR))
    assert handler.filter(record(ours)) and handler.filter(record("/work/my_experiment.py"))
    installed = "/venv/lib/python3.11/site-packages/"  # this project installed without -e
    monkeypatch.setattr(logs, "_OURS", (installed + "olmo3/", installed + "launch/"))
    assert handler.filter(record(installed + "launch/main.py"))
    assert not handler.filter(record(installed + "orbax/checkpoint/checkpoint_manager.py"))
    logs.configure(1)  # -v 1: everything again
    assert handler.filter(record(library)) and handler.filter(record(orbax, py_logging.ERROR))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    monkeypatch.setattr(platforms, "has_accelerator", lambda: True)
    logs.configure(0)
    assert "JAX_PLATFORMS" not in os.environ  # a TPU or GPU machine: JAX chooses
    assert "TPU_WORKER_HOSTNAMES" not in os.environ
    monkeypatch.setattr(platforms, "has_accelerator", lambda: False)
    logs.configure(0)
    assert os.environ["JAX_PLATFORMS"] == "cpu"  # no accelerator: libtpu is never loaded
    assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"  # but for topology compiles
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    logs.configure(0)
    assert os.environ["JAX_PLATFORMS"] == "cuda"  # the user's choice stands
  finally:  # nothing leaks into other tests' logging
    handler.removeFilter(logs._FILTER)  # pylint: disable=protected-access


def test_a_result_that_reaches_a_closed_event_loop_goes_to_the_log_not_stderr(monkeypatch, caplog):
  """Orbax closes its loop without cancelling pending TensorStore writes once a save failed; the
  late write's callback must not print a traceback under the run's one-line error. Every other
  unraisable exception still reaches the hook that was there before."""
  import asyncio
  import logging as py_logging

  import tensorstore as ts

  from olmo3.train import logs

  before = []
  monkeypatch.setattr(logs, "_PREVIOUS_HOOK", before.append)
  monkeypatch.setattr(sys, "unraisablehook", logs._unraisable)  # pylint: disable=protected-access
  promise, write = ts.Promise.new()

  async def save():
    pending = asyncio.ensure_future(wait(write))  # another part's write, still in flight
    # It stays pending for good (the point of the test): no "Task was destroyed" line when it
    # is collected.
    pending._log_destroy_pending = False  # pylint: disable=protected-access
    await asyncio.sleep(0)
    raise OSError("one part of the save failed")

  async def wait(future):
    await future

  loop = asyncio.new_event_loop()  # as Orbax runs a save: run_until_complete, then close
  with pytest.raises(OSError):
    loop.run_until_complete(save())
  loop.close()
  with caplog.at_level(py_logging.DEBUG, logger="absl"):
    promise.set_result(None)  # the write completes: its callback meets the closed loop
  assert before == []
  assert "a result arrived after its event loop closed" in caplog.text
  assert "Event loop is closed" in caplog.text

  class Broken:
    def __del__(self):
      raise ValueError("not this one")

  Broken()
  assert [type(u.exc_value) for u in before] == [ValueError]


def test_heartbeat_reports_a_long_phase_while_it_runs(caplog):
  import logging as py_logging
  import time

  from olmo3.train import logs

  with caplog.at_level(py_logging.INFO):
    with logs.Heartbeat("compiling the thing", every=0.05) as beat:
      time.sleep(0.3)
  messages = [r.getMessage() for r in caplog.records]
  assert messages[0] == "compiling the thing ..."
  assert sum(m.startswith("compiling the thing: ") and m.endswith("so far")
             for m in messages) >= 2
  assert messages[-1] == "compiling the thing: done in 0 s" and beat.seconds >= 0.3
  assert [logs.duration(s) for s in (4.4, 247, 7500)] == ["4 s", "4 min 07 s", "2 h 05 min"]


def test_a_checkpoints_layout_is_described_against_the_mesh_it_is_read_onto():
  from olmo3 import sharding

  four = sharding.make_mesh({"data": 2, "fsdp": 2}, jax.devices()[:4])
  pod = {"mesh": {"fsdp": 512}, "devices": 512, "device_kind": "TPU7x", "processes": 64}
  assert sharding.layout_change(pod, four) == (
      "written on {'fsdp': 512} of 512 TPU7x devices in 64 processes; restored onto "
      "{'data': 2, 'fsdp': 2} of 4 cpu devices in 1 process, each array resharded as it is read")
  assert sharding.layout_change(sharding.layout(four), four) == (
      "written on {'data': 2, 'fsdp': 2} of 4 cpu devices in 1 process: the same layout")
  assert sharding.layout_change(None, four).startswith("not recorded (an older checkpoint); "
                                                       "restored onto {'data': 2, 'fsdp': 2}")
