"""The train step, a pure function: loss and gradients (accumulated over microbatches when
asked), clipping and AdamW, the scheduled learning rate, and step skipping.

`jit_train_step(exp, model, layout)` compiles it with the state's shardings, donating the
state; the loop, ahead-of-time compilation and benchmarks all call this one. Besides scalars,
the metrics hold each source's summed CE and unmasked token count (`source_ce_sum`,
`source_tokens`: [num_sources]), which the loop turns into per-source losses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from olmo3 import sharding as sharding_lib
from olmo3.config import Experiment, LossMean
from olmo3.data.pipeline import batch_only
from olmo3.loss import PerToken, lm_loss, rank_divisors
from olmo3.placement import ShardedModel
from olmo3.train import optim
from olmo3.train.state import StateLayout, TrainState

# input_ids, labels: [global batch, seq_len] int32; filtered: [global batch] bool (the
# repetition filter masked the instance); source: [global batch] int32 (olmo3.data.pipeline);
# segments: [global batch, seq_len] int32, only for packed instances (a document id per token).
Batch = dict[str, jax.Array]


# (params, tokens, labels[, segments]): segments only for packed instances
TokenLosses = Callable[..., PerToken]


def loss_and_grads(exp: Experiment, token_losses: TokenLosses, param_shardings: Any,
                   params: Any, batch: Batch, num_sources: int = 1):
  """((loss, metrics), gradients) of the whole global batch; with train.microbatches = k,
  accumulated over k sequential microbatches (each a 1/k slice of every device's rows, so no
  data moves), each row divided by its divisor from the whole batch: the same loss and update.
  `token_losses(params, tokens, labels[, segments])` is the model's per-token loss
  (`ShardedModel.token_losses`: the fused, vocabulary-chunked cross-entropy).

  The mean is OLMo-core's (train.loss_mean): per data-parallel rank over AI2's
  train.loss_ranks ranks (olmo3.loss.rank_divisors), or one over the global batch. A rank's
  count is OLMo-core's: its unmasked labels, plus all T positions of every instance the
  repetition filter masked (they count as tokens with zero loss). The metrics include the
  per-source sums of `lm_loss` over `num_sources` sources (batch["source"]).
  """
  z_loss_weight, k = exp.train.z_loss_weight, exp.train.microbatches
  ranks = exp.train.loss_ranks if exp.train.loss_mean is LossMean.PER_RANK else 1

  def loss_fn(params, divisor_B, tokens_BT, labels_BT, source_B, *segments_BT):
    return lm_loss(token_losses(params, tokens_BT, labels_BT, *segments_BT), z_loss_weight,
                   divisor_B, source_B, num_sources)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  seq_len = batch["labels"].shape[1]
  tokens_B = (batch["labels"] >= 0).sum(axis=-1) + batch["filtered"] * seq_len
  rows = (rank_divisors(tokens_B, ranks), batch["input_ids"], batch["labels"], batch["source"])
  if "segments" in batch:
    rows += (batch["segments"],)
  if k == 1:
    return grad_fn(params, *rows)

  def split(x_B):  # [B, ...] -> [k, B / k, ...]
    # Microbatch i holds rows i, i + k, ...: a slice of every device's rows.
    x_KM = x_B.reshape(x_B.shape[0] // k, k, *x_B.shape[1:]).swapaxes(0, 1)
    return sharding_lib.constrain(x_KM, (None, "batch", "seq")[:x_KM.ndim])

  def accumulate(total, micro):
    out = grad_fn(params, *micro)
    total = jax.tree.map(jnp.add, total, out)
    return (total[0], jax.lax.with_sharding_constraint(total[1], param_shardings)), None

  micro_K = tuple(split(x) for x in rows)
  shapes = jax.eval_shape(grad_fn, params, *(x[0] for x in micro_K))
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  zeros = (zeros[0], jax.lax.with_sharding_constraint(zeros[1], param_shardings))
  total, _ = jax.lax.scan(accumulate, zeros, micro_K)
  return total


def train_step(exp: Experiment, model: ShardedModel, tx: optax.GradientTransformationExtraArgs,
               num_sources: int = 1
               ) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
  """(state, batch) -> (next state, metrics); not jitted. batch["source"] < num_sources."""

  def step(state: TrainState, batch: Batch):
    (loss, aux), grads = loss_and_grads(exp, model.token_losses, model.param_shardings,
                                        state.params, batch, num_sources)
    grad_norm = optax.global_norm(grads)
    lr = optim.learning_rate(exp.optimizer, state.step + 1)  # this is update state.step + 1
    updates, opt_state = tx.update(grads, state.opt_state, state.params, lr=lr)
    params = optax.apply_updates(state.params, updates)
    # A skipped step (NaN/Inf, or a CE-loss / gradient-norm spike) leaves parameters and
    # optimizer state exactly as they were; the data moves on, as in OLMo-core. An update that
    # would put NaN/Inf into them (finite loss and gradients notwithstanding) is skipped too:
    # the state the loop holds, and so every checkpoint, stays finite.
    skip = optim.should_skip(exp.optimizer, state.skip, aux["ce_loss"], grad_norm)
    skip |= ~optim.all_finite((params, opt_state))
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)
    params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
    stats = optim.record(exp.optimizer, state.skip, aux["ce_loss"], grad_norm, skip)
    metrics = {"loss": loss, "ce_loss": aux["ce_loss"], "z_loss": aux["z_loss"],
               "grad_norm": grad_norm, "lr": lr, "tokens": aux["tokens"].astype(jnp.float32),
               "skipped": skip.astype(jnp.float32),
               "skipped_total": stats.skipped.astype(jnp.float32),
               "source_ce_sum": aux["source_ce_sum"], "source_tokens": aux["source_tokens"]}
    return TrainState(state.step + 1, params, opt_state, stats), metrics

  return step


def jit_train_step(exp: Experiment, model: ShardedModel, layout: StateLayout,
                   num_sources: int = 1):
  """The train step jitted with the state's shardings; the input state is donated and the
  metrics come back replicated (every process reads them). Call (or
  `.lower(*abstract_inputs(...))`) inside `model.context()`."""
  return jax.jit(train_step(exp, model, layout.tx, num_sources),
                 in_shardings=(layout.shardings, None),
                 out_shardings=(layout.shardings, model.replicated), donate_argnums=0)


def abstract_inputs(exp: Experiment, model: ShardedModel, layout: StateLayout
                    ) -> tuple[TrainState, dict[str, jax.ShapeDtypeStruct]]:
  """The train step's inputs as sharded ShapeDtypeStructs (ahead-of-time compilation)."""
  shape = (exp.data.global_batch_size, exp.data.seq_len)
  by_token = ("input_ids", "labels") + (("segments",) if exp.data.packing else ())
  batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=model.batch_sharding)
           for k in by_token}
  rows = batch_only(model.batch_sharding)
  batch["filtered"] = jax.ShapeDtypeStruct(shape[:1], jnp.bool_, sharding=rows)
  batch["source"] = jax.ShapeDtypeStruct(shape[:1], jnp.int32, sharding=rows)
  return layout.abstract, batch
