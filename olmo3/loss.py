"""The one token loss: training, held-out evaluation and task scoring all read it from here.

The training loss is the token-mean cross-entropy over unmasked labels plus OLMo's z-loss
(weight × mean squared log-partition), the mean taken per data-parallel rank as OLMo-core
takes it (`rank_divisors`); held-out evaluation sums the same per-token cross-entropy over
documents; a task choice's score is minus its sum over the continuation (docs/recipe.md#loss,
docs/evaluation.md).

Each of these starts from `PerToken` (each position's cross-entropy, log-partition and mask),
computed one of two ways with the same result to float32 rounding:
- `token_nll(logits_BTV, labels_BT)` from full logits (the reference);
- `fused_token_nll(h_BTD, w_DV, labels_BT, chunk)` from the final hidden states and the LM
  head's kernel, over `chunk` vocabulary columns at a time, with its own gradient: neither the
  forward nor the backward pass ever holds [B, T, V] float32 logits, only [B, T, chunk]. For the
  7B at 8192 tokens a sequence that is 3.3 GB of logits (and as much gradient) never stored.

"float32" below means the wider of float32 and the model's dtype: a float64 model (parity
checks) gets float64 losses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from olmo3 import platforms
from olmo3 import xla_cpu

IGNORE = -1  # the label of a position with no target (any negative label is masked)

# A sharding constraint by logical axis names (olmo3.sharding.constrain); this module sits
# below the sharding layer, so callers that run on a mesh pass theirs in.
Constrain = Callable[[jax.Array, Sequence[str | None]], jax.Array]


def _wide(x: jax.Array) -> jnp.dtype:
  return jnp.promote_types(x.dtype, jnp.float32)


def _unconstrained(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  del names
  return x


class PerToken(NamedTuple):
  nll_BT: jax.Array  # -log p(label), float32; 0 where masked
  lse_BT: jax.Array  # the log-partition logsumexp(logits), float32
  mask_BT: jax.Array  # label >= 0


def token_nll(logits_BTV: jax.Array, labels_BT: jax.Array) -> PerToken:
  """Each position's cross-entropy, log-partition and mask from full logits, in float32."""
  logits = logits_BTV.astype(_wide(logits_BTV))
  mask_BT = labels_BT >= 0
  lse_BT = jax.nn.logsumexp(logits, axis=-1)
  target_BT = jnp.take_along_axis(logits, jnp.maximum(labels_BT, 0)[..., None], axis=-1)[..., 0]
  return PerToken(jnp.where(mask_BT, lse_BT - target_BT, 0.0), lse_BT, mask_BT)


def fused_token_nll(h_BTD: jax.Array, w_DV: jax.Array, labels_BT: jax.Array, chunk: int,
                    constrain: Constrain = _unconstrained) -> PerToken:
  """`token_nll(h_BTD @ w_DV, labels_BT)` without the full logits: a scan over vocabulary
  chunks of `chunk` columns keeps a running max and sum (online logsumexp) and the label's
  logit; the backward pass recomputes each chunk's logits and turns them straight into that
  chunk's share of the gradients.

  Logits are computed as the LM head computes them (inputs and kernel in h's dtype, the compute
  dtype; then float32). When `chunk` does not divide V the last chunk starts at V - chunk and
  ignores the columns the chunk before it covered, so no padded copy of the kernel is made.
  `constrain` lays out the chunk's logits and the kernel's gradient on the mesh. On one CPU
  device the rows are taken flat, [B·T, D] (olmo3.xla_cpu.rows_flat: the backward pass then
  writes the logits' gradient over the logits).
  """
  chunk = min(chunk, w_DV.shape[1])
  if xla_cpu.rows_flat(h_BTD.dtype):
    b, t, d = h_BTD.shape
    nll_N, lse_N = _fused(chunk, _unconstrained, h_BTD.reshape(b * t, d), w_DV,
                          labels_BT.reshape(b * t))
    nll_BT, lse_BT = nll_N.reshape(b, t), lse_N.reshape(b, t)
  else:
    nll_BT, lse_BT = _fused(chunk, constrain, h_BTD, w_DV, labels_BT)
  mask_BT = labels_BT >= 0
  return PerToken(jnp.where(mask_BT, nll_BT, 0.0), lse_BT, mask_BT)


def _chunk_logits(h_BTD, w_DV, labels_BT, i, chunk, constrain):
  """Chunk i's logits [B, T, C] (float32), which of its columns are its own (not also in the
  chunk before it) and which is the label; and the chunk's first column and kernel slice."""
  v = w_DV.shape[1]
  start = jnp.minimum(i * chunk, v - chunk)
  w_DC = jax.lax.dynamic_slice_in_dim(w_DV, start, chunk, axis=1).astype(h_BTD.dtype)
  logits_BTC = constrain(jnp.einsum("...d,dc->...c", h_BTD, w_DC).astype(_wide(h_BTD)),
                         ("batch", "seq", "act_vocab"))
  cols_C = start + jnp.arange(chunk)
  # Only a last chunk that overlaps the one before it has columns of another chunk (None: all
  # its own, the case whenever chunk divides V; decided statically, so no mask is computed).
  own_C = None if v % chunk == 0 else cols_C >= i * chunk
  is_label_BTC = cols_C == jnp.maximum(labels_BT, 0)[..., None]
  if own_C is not None:
    is_label_BTC &= own_C
  return logits_BTC, own_C, is_label_BTC, start, w_DC


def _label_logit(logits_BTC, labels_BT, i, chunk, v):
  """[B, T]: the logit of each row's label if chunk i holds it as its own column, else 0."""
  start = jnp.minimum(i * chunk, v - chunk)
  label_BT = jnp.maximum(labels_BT, 0)
  picked_BT = jnp.take_along_axis(
      logits_BTC, jnp.clip(label_BT - start, 0, chunk - 1)[..., None], axis=-1)[..., 0]
  # Own columns are i·chunk and up (a last chunk that overlaps the one before starts lower).
  return jnp.where((label_BT >= i * chunk) & (label_BT < start + chunk), picked_BT, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(chunk, constrain, h_BTD, w_DV, labels_BT):
  """(lse - label logit, lse) per position, unmasked."""
  return _fused_forward(chunk, constrain, h_BTD, w_DV, labels_BT)[0]


def _fused_forward(chunk, constrain, h_BTD, w_DV, labels_BT):
  n_chunks = -(-w_DV.shape[1] // chunk)
  # The label's logit, the same value either way. XLA:CPU writes the masked [B, T, C] select
  # out and sums it in a separate windowed pass (≈ 40 ms of the tiny CPU step); a gather reads
  # one value per row. TPUs keep the select: it fuses into the pass that takes max and sum.
  gather = platforms.compile_target() == "cpu"

  def step(carry, i):
    max_BT, sum_BT, target_BT = carry
    logits_BTC, own_C, is_label_BTC, _, _ = _chunk_logits(h_BTD, w_DV, labels_BT, i, chunk,
                                                          constrain)
    if own_C is not None:
      logits_BTC = jnp.where(own_C, logits_BTC, -jnp.inf)
    new_max_BT = jnp.maximum(max_BT, xla_cpu.row_max(logits_BTC))
    sum_BT = sum_BT * jnp.exp(max_BT - new_max_BT) + xla_cpu.row_sum(
        jnp.exp(logits_BTC - new_max_BT[..., None]))
    if gather:
      target_BT = target_BT + _label_logit(logits_BTC, labels_BT, i, chunk, w_DV.shape[1])
    else:
      target_BT = target_BT + jnp.where(is_label_BTC, logits_BTC, 0.0).sum(axis=-1)
    return (new_max_BT, sum_BT, target_BT), None

  shape = labels_BT.shape
  dtype = _wide(h_BTD)
  init = (jnp.full(shape, -jnp.inf, dtype), jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
  (max_BT, sum_BT, target_BT), _ = jax.lax.scan(step, init, jnp.arange(n_chunks))
  lse_BT = max_BT + jnp.log(sum_BT)
  return (lse_BT - target_BT, lse_BT), (h_BTD, w_DV, labels_BT, lse_BT)


def _fused_backward(chunk, constrain, residuals, cotangents):
  h_BTD, w_DV, labels_BT, lse_BT = residuals
  d_nll_BT, d_lse_BT = cotangents
  n_chunks = -(-w_DV.shape[1] // chunk)
  dtype = _wide(h_BTD)

  def step(carry, i):
    dh_BTD, dw_DV = carry
    logits_BTC, own_C, is_label_BTC, start, w_DC = _chunk_logits(
        h_BTD, w_DV, labels_BT, i, chunk, constrain)
    # d nll / d logits = softmax - onehot(label); d lse / d logits = softmax.
    p_BTC = jnp.exp(logits_BTC - lse_BT[..., None])
    if own_C is not None:
      p_BTC = jnp.where(own_C, p_BTC, 0.0)
    d_BTC = ((d_nll_BT + d_lse_BT)[..., None] * p_BTC
             - jnp.where(is_label_BTC, d_nll_BT[..., None], 0.0)).astype(h_BTD.dtype)
    dh_BTD = dh_BTD + jnp.einsum("...c,dc->...d", d_BTC, w_DC).astype(dtype)
    dw_DC = jnp.einsum("...d,...c->dc", h_BTD, d_BTC).astype(dtype)
    dw_DV = jax.lax.dynamic_update_slice_in_dim(
        dw_DV, jax.lax.dynamic_slice_in_dim(dw_DV, start, chunk, axis=1) + dw_DC, start, axis=1)
    return (dh_BTD, dw_DV), None

  init = (constrain(jnp.zeros(h_BTD.shape, dtype), ("batch", "seq", "act_embed")),
          constrain(jnp.zeros(w_DV.shape, dtype), ("embed", "vocab")))
  (dh_BTD, dw_DV), _ = jax.lax.scan(step, init, jnp.arange(n_chunks))
  return dh_BTD.astype(h_BTD.dtype), dw_DV.astype(w_DV.dtype), None


_fused.defvjp(_fused_forward, _fused_backward)


def rank_divisors(tokens_B: jax.Array, ranks: int) -> jax.Array:
  """[B]: each row's loss divisor for OLMo-core's mean over `ranks` data-parallel ranks, from
  each row's token count `tokens_B` (what OLMo-core counts for the loss: see `lm_loss`).

  OLMo-core's loader deals a global batch out strided (rank r gets rows r, r + ranks, ...);
  each rank divides its summed loss by its own count, and the ranks' gradients are averaged. So
  row i's share of the loss is its sum over ranks x the count of rank i % ranks. ranks = 1: the
  whole batch's count for every row, one token mean. A rank's count is taken as at least 1: a
  rank with nothing to train on adds 0, never NaN. Computed on the whole batch: a microbatch's
  rows keep their divisors.
  """
  b = tokens_B.shape[0]
  count_W = jnp.maximum(tokens_B.reshape(b // ranks, ranks).sum(axis=0), 1)  # row q·W + r: [q, r]
  return jnp.broadcast_to(ranks * count_W, (b // ranks, ranks)).reshape(b)


def lm_loss(per_token: PerToken, z_loss_weight: float = 0.0,
            divisor_B: jax.Array | None = None, source_B: jax.Array | None = None,
            num_sources: int = 1) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(loss, metrics): CE + z_loss_weight · lse² over unmasked labels, each row's sum divided by
  its `divisor_B` and the rows added (`ce_loss` and `z_loss` in the metrics are the same
  quotients). Default: the unmasked label count for every row, one token mean. The train step
  passes `rank_divisors` of OLMo-core's count, which also counts the positions of instances
  the repetition filter masked, taken on the whole batch, so the microbatches' losses and
  gradients sum to the whole batch's. A divisor is taken as at least 1: an all-masked batch
  gives 0, never NaN.
  With `source_B` (each row's source, in [0, num_sources)) the metrics also hold each source's
  summed CE and unmasked token count (`source_ce_sum`, `source_tokens`: [S], S = num_sources),
  raw sums whatever the divisors.
  """
  nll_BT, lse_BT, mask_BT = per_token
  n_tokens = mask_BT.sum()
  divisor_B = jnp.broadcast_to(n_tokens if divisor_B is None else divisor_B, mask_BT.shape[:1])
  weight_B = 1 / jnp.maximum(divisor_B, 1).astype(nll_BT.dtype)
  nll_B = nll_BT.sum(axis=-1)
  ce = (nll_B * weight_B).sum()
  z_loss = (jnp.where(mask_BT, jnp.square(lse_BT), 0.0).sum(axis=-1) * weight_B).sum()
  metrics = {"ce_loss": ce, "z_loss": z_loss, "tokens": n_tokens}
  if source_B is not None:
    # Masked sums, not a one-hot matmul: TPUs multiply float32 matrices in bfloat16 passes.
    is_source_BS = source_B[:, None] == jnp.arange(num_sources)
    metrics["source_ce_sum"] = jnp.where(is_source_BS, nll_B[:, None], 0.0).sum(axis=0)
    metrics["source_tokens"] = jnp.where(is_source_BS, mask_BT.sum(axis=-1)[:, None], 0
                                         ).sum(axis=0)
  return ce + z_loss_weight * z_loss, metrics


def row_logprob(per_token: PerToken) -> jax.Array:
  """[B]: each row's summed log-probability of its unmasked labels (a task choice's score)."""
  return -per_token.nll_BT.sum(axis=-1)


def choice_logprobs(logits_BV: jax.Array, choices_BK: jax.Array) -> jax.Array:
  """[B, K]: log p(choice k) from each row's logits at its answer position (multiple choice
  scored in one pass: every answer is one token after the same context). Negative choices
  (padding) give 0."""
  logp_BV = jax.nn.log_softmax(logits_BV.astype(_wide(logits_BV)), axis=-1)
  logp_BK = jnp.take_along_axis(logp_BV, jnp.maximum(choices_BK, 0), axis=-1)
  return jnp.where(choices_BK >= 0, logp_BK, 0.0)
