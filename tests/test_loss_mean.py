"""The training loss's mean as OLMo-core's train module takes it (TrainConfig.loss_mean,
loss_ranks): each data-parallel rank's summed loss over its own count of trained labels, the
mean of those over AI2's ranks, row i being rank i % ranks's. Against a hand computation in
numpy, whole and in microbatches, on 1 and 8 devices; one token mean as the named option."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3 import config, sharding
from olmo3.config import ConfigError, LossMean
from olmo3.loss import IGNORE, token_nll
from olmo3.placement import ShardedModel
from olmo3.train.step import loss_and_grads
from tests.conftest import random_params
from tests.train_helpers import micro_experiment

B, T, V, Z = 8, 12, 16, 1e-2  # rows, positions, vocabulary, z-loss weight (large: it shows)
# Each row's padding (trailing positions without a label) and the one row the repetition
# filter masked: ranks of 4 hold rows {0, 4}, {1, 5}, {2, 6}, {3, 7}, whose counts differ.
PADS = (0, 5, 9, 0, 2, 0, 1, 7)
FILTERED = 3


def _batch(seed: int = 0, pads=PADS, filtered: int | None = FILTERED):
  rng = np.random.default_rng(seed)
  table = rng.standard_normal((V, V)).astype(np.float32) * 3
  ids = rng.integers(0, V, (B, T)).astype(np.int32)
  labels = np.concatenate([ids[:, 1:], np.full((B, 1), IGNORE)], axis=1).astype(np.int32)
  for row, pad in enumerate(pads):
    labels[row, T - 1 - pad:] = IGNORE
  mask = np.zeros(B, bool)
  if filtered is not None:
    labels[filtered], mask[filtered] = IGNORE, True
  batch = {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(labels),
           "filtered": jnp.asarray(mask), "source": jnp.asarray(np.arange(B) % 3, jnp.int32)}
  return table, batch


def _reference(table, batch, ranks: int) -> tuple[float, float]:
  """(CE, z-loss) as OLMo-core's ranks take them, in float64: rank r holds rows r, r + ranks,
  ...; it divides its summed CE and squared log-partition by its unmasked labels plus T per
  filtered row; the ranks' quotients are averaged (the gradients' all-reduce mean)."""
  ids, labels = np.asarray(batch["input_ids"]), np.asarray(batch["labels"])
  logits = table.astype(np.float64)[ids]
  lse = np.log(np.exp(logits).sum(-1))
  mask = labels >= 0
  target = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0]
  nll, z = np.where(mask, lse - target, 0), np.where(mask, lse ** 2, 0)
  count = mask.sum(-1) + np.asarray(batch["filtered"]) * T
  ce_r, z_r = [], []
  for r in range(ranks):
    rows = np.arange(r, B, ranks)
    divisor = max(count[rows].sum(), 1)
    ce_r.append(nll[rows].sum() / divisor)
    z_r.append(z[rows].sum() / divisor)
  return float(np.mean(ce_r)), float(np.mean(z_r))


def _run(table, batch, mean=LossMean.PER_RANK, ranks=4, microbatches=1):
  exp = micro_experiment("unused")
  exp = dataclasses.replace(exp, train=dataclasses.replace(
      exp.train, z_loss_weight=Z, loss_mean=mean, loss_ranks=ranks, microbatches=microbatches))
  token_losses = lambda p, tokens, labels: token_nll(p["table"][tokens], labels)
  replicated = {"table": jax.sharding.SingleDeviceSharding(jax.devices()[0])}
  return jax.jit(lambda p, b: loss_and_grads(exp, token_losses, replicated, p, b, 3))(
      {"table": jnp.asarray(table)}, batch)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_per_rank_mean_equals_a_hand_computation(ranks):
  """Loss, logged CE and z-loss against numpy on a batch whose ranks hold different counts;
  the batch tells the means apart, so a step that took the global mean fails here."""
  table, batch = _batch()
  (loss, aux), _ = _run(table, batch, ranks=ranks)
  ce, z = _reference(table, batch, ranks)
  global_ce, _ = _reference(table, batch, 1)
  assert abs(ce - global_ce) > 1e-3 * ce  # far beyond the tolerance: a global mean fails
  assert float(aux["ce_loss"]) == pytest.approx(ce, rel=1e-6)
  assert float(aux["z_loss"]) == pytest.approx(z, rel=1e-6)
  assert float(loss) == pytest.approx(ce + Z * z, rel=1e-6)


def test_per_rank_gradients_are_the_mean_of_each_ranks_gradients():
  """The gradient is the average over ranks of each rank's own token-mean gradient, as
  OLMo-core's all-reduce makes it: each rank's loss taken alone, on its rows only."""
  table, batch = _batch()
  _, grads = _run(table, batch, ranks=4)
  per_rank = []
  for r in range(4):
    rows = np.arange(r, B, 4)
    alone = {k: v[rows] for k, v in batch.items()}
    per_rank.append(_run(table, alone, LossMean.GLOBAL, ranks=1)[1]["table"])
  np.testing.assert_allclose(grads["table"], np.mean(per_rank, axis=0), rtol=1e-5, atol=1e-7)


def test_global_mean_is_one_token_mean_and_one_rank_is_global():
  table, batch = _batch()
  (loss, aux), grads = _run(table, batch, LossMean.GLOBAL)
  ce, z = _reference(table, batch, 1)
  assert float(aux["ce_loss"]) == pytest.approx(ce, rel=1e-6)
  assert float(loss) == pytest.approx(ce + Z * z, rel=1e-6)
  (one, _), grads_one = _run(table, batch, LossMean.PER_RANK, ranks=1)
  assert float(one) == float(loss)
  np.testing.assert_array_equal(grads_one["table"], grads["table"])


def test_global_mean_differs_on_a_batch_whose_ranks_hold_different_counts():
  """The mutation a parity run would catch: a global mean where OLMo-core's is per rank."""
  table, batch = _batch()
  (per_rank, _), grads = _run(table, batch, ranks=4)
  (global_, _), grads_global = _run(table, batch, LossMean.GLOBAL)
  assert abs(float(per_rank) - float(global_)) > 1e-3 * float(global_)
  assert not np.allclose(grads["table"], grads_global["table"], rtol=1e-3)


def test_unpadded_unfiltered_batches_give_the_global_mean_exactly():
  """Stages 1 and 2: every instance holds T - 1 labels, so every rank's count is the same and
  the per-rank mean is the global one, bit for bit."""
  table, batch = _batch(pads=(0,) * B, filtered=None)
  (per_rank, aux), grads = _run(table, batch, ranks=4)
  (global_, aux_global), grads_global = _run(table, batch, LossMean.GLOBAL)
  assert float(per_rank) == float(global_) and float(aux["ce_loss"]) == float(aux_global["ce_loss"])
  np.testing.assert_array_equal(grads["table"], grads_global["table"])


def test_a_rank_with_nothing_to_train_on_adds_zero():
  """Rows 3 and 7 (rank 3 of 4) all masked and not filtered: that rank's count is 0; it adds
  0 to the mean (OLMo-core would divide by 0), the other ranks keep theirs."""
  pads = list(PADS)
  pads[3] = pads[7] = T - 1
  table, batch = _batch(pads=pads, filtered=None)
  (loss, aux), grads = _run(table, batch, ranks=4)
  ce, _ = _reference(table, batch, 4)
  assert np.isfinite(float(loss)) and np.isfinite(grads["table"]).all()
  assert float(aux["ce_loss"]) == pytest.approx(ce, rel=1e-6)


@pytest.mark.parametrize("mean", list(LossMean))
def test_microbatches_give_the_whole_batchs_loss_and_gradients(mean):
  """Microbatch i holds rows i, i + k, ...: each row keeps the divisor of its rank, taken on the
  whole batch. Per-source sums stay raw sums."""
  table, batch = _batch()
  (loss, aux), grads = _run(table, batch, mean)
  (loss_2, aux_2), grads_2 = _run(table, batch, mean, microbatches=2)
  assert float(loss_2) == pytest.approx(float(loss), rel=1e-6)
  np.testing.assert_allclose(grads_2["table"], grads["table"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(aux_2["source_ce_sum"], aux["source_ce_sum"], rtol=1e-6)
  np.testing.assert_array_equal(aux_2["source_tokens"], aux["source_tokens"])
  labels = np.asarray(batch["labels"])
  assert [int(aux["source_tokens"][s]) for s in range(3)] == [
      int((labels[np.arange(B) % 3 == s] >= 0).sum()) for s in range(3)]


@pytest.mark.seconds(4)
def test_the_loss_does_not_depend_on_the_mesh():
  """The micro model (its fused, vocabulary-chunked loss) on 1 and on 8 devices, whole and in
  2 microbatches: the same per-rank loss and gradients. The rank of a row is its place in the
  global batch, never the device that holds it."""
  exp = micro_experiment("unused")
  exp = dataclasses.replace(exp, model=exp.model.replace(n_layers=1, vocab_chunk=96),
                            train=dataclasses.replace(exp.train, loss_ranks=4))
  rng = np.random.default_rng(0)
  rows, length = 16, 32
  tokens = rng.integers(0, exp.model.vocab_size, (rows, length + 1)).astype(np.int32)
  labels = tokens[:, 1:].copy()
  for row, pad in enumerate(rng.integers(0, length, rows)):
    labels[row, length - pad:] = IGNORE
  host = {"input_ids": tokens[:, :-1], "labels": labels, "filtered": np.zeros(rows, bool),
          "source": np.zeros(rows, np.int32)}
  params = random_params(exp.model, 0)

  def run(devices, microbatches):
    run_exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train,
                                                                 microbatches=microbatches))
    model = ShardedModel(exp.model, sharding.make_mesh({"fsdp": -1}, devices))
    batch = {k: jax.device_put(v, model.batch_sharding if v.ndim == 2 else
                               jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec(
                                   model.batch_sharding.spec[0])))
             for k, v in host.items()}
    with model.context():
      p = jax.device_put(params, model.param_shardings)
      (loss, _), grads = jax.jit(lambda p, b: loss_and_grads(
          run_exp, model.token_losses, model.param_shardings, p, b))(p, batch)
      return float(loss), jax.tree.map(np.asarray, grads)

  loss_one, grads_one = run(jax.devices()[:1], 1)
  for devices, microbatches in ((jax.devices()[:1], 2), (jax.devices(), 1), (jax.devices(), 2)):
    loss, grads = run(devices, microbatches)
    assert loss == pytest.approx(loss_one, rel=1e-6), (len(devices), microbatches)
    for g, g_one in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_one)):
      np.testing.assert_allclose(g, g_one, rtol=1e-4, atol=1e-6 * float(np.abs(g_one).max()))
  global_exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train,
                                                                  loss_mean=LossMean.GLOBAL))
  model = ShardedModel(exp.model, sharding.make_mesh({"fsdp": -1}, jax.devices()[:1]))
  with model.context():
    (loss_global, _), _ = jax.jit(lambda p, b: loss_and_grads(
        global_exp, model.token_losses, model.param_shardings, p, b))(params, host)
  assert abs(float(loss_global) - loss_one) > 1e-3 * loss_one  # the padding makes them differ


def test_loss_ranks_must_divide_the_global_batch():
  exp = micro_experiment("unused")  # 8 instances a step
  with pytest.raises(ConfigError, match=r"^Experiment.train.loss_ranks=3: must divide "
                                        r"data.global_batch_size \(8\)"):
    dataclasses.replace(exp, train=dataclasses.replace(exp.train, loss_ranks=3))
  # One global mean uses no ranks: nothing to divide.
  dataclasses.replace(exp, train=dataclasses.replace(exp.train, loss_ranks=3,
                                                     loss_mean=LossMean.GLOBAL))
  default = config.TrainConfig()
  assert (default.loss_mean, default.loss_ranks) == (LossMean.PER_RANK, 1)
