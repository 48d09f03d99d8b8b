"""The one token loss: training, held-out evaluation and task scoring all read it from here.

The training loss is the token-mean cross-entropy over unmasked labels plus OLMo's z-loss
(weight × mean squared log-partition); held-out evaluation sums the same per-token
cross-entropy over documents; a task choice's score is minus its sum over the continuation
(docs/recipe.md#loss, docs/evaluation.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IGNORE = -1  # the label of a position with no target (any negative label is masked)


def token_nll(logits_BTV: jax.Array, labels_BT: jax.Array
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(nll_BT, lse_BT, mask_BT): each position's cross-entropy -log p(label) (0 where masked),
  its log-partition logsumexp(logits), and the mask (label >= 0). Computed in float32."""
  logits = logits_BTV.astype(jnp.float32)
  mask_BT = labels_BT >= 0
  lse_BT = jax.nn.logsumexp(logits, axis=-1)
  target_BT = jnp.take_along_axis(logits, jnp.maximum(labels_BT, 0)[..., None], axis=-1)[..., 0]
  return jnp.where(mask_BT, lse_BT - target_BT, 0.0), lse_BT, mask_BT


def lm_loss(logits_BTV: jax.Array, labels_BT: jax.Array, z_loss_weight: float = 0.0,
            batch_tokens: jax.Array | None = None, source_B: jax.Array | None = None,
            num_sources: int = 1) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(loss, metrics): CE + z_loss_weight · lse², summed over unmasked labels and divided by
  `batch_tokens` (default: the unmasked label count; the train step passes OLMo-core's count,
  which also counts the positions of instances the repetition filter masked, and for one
  microbatch the whole batch's count, so the microbatches' losses and gradients sum to the
  whole batch's). The divisor is at least 1: an all-masked batch gives 0, never NaN.
  With `source_B` (each row's source, in [0, num_sources)) the metrics also hold each source's
  summed CE and unmasked token count (`source_ce_sum`, `source_tokens`: [S], S = num_sources).
  """
  nll_BT, lse_BT, mask_BT = token_nll(logits_BTV, labels_BT)
  n_tokens = mask_BT.sum()
  divisor = jnp.maximum(n_tokens if batch_tokens is None else batch_tokens, 1
                        ).astype(jnp.float32)
  ce = nll_BT.sum() / divisor
  z_loss = jnp.where(mask_BT, jnp.square(lse_BT), 0.0).sum() / divisor
  metrics = {"ce_loss": ce, "z_loss": z_loss, "tokens": n_tokens}
  if source_B is not None:
    # Masked sums, not a one-hot matmul: TPUs multiply float32 matrices in bfloat16 passes.
    is_source_BS = source_B[:, None] == jnp.arange(num_sources)
    metrics["source_ce_sum"] = jnp.where(is_source_BS, nll_BT.sum(axis=-1)[:, None], 0.0
                                         ).sum(axis=0)
    metrics["source_tokens"] = jnp.where(is_source_BS, mask_BT.sum(axis=-1)[:, None], 0
                                         ).sum(axis=0)
  return ce + z_loss_weight * z_loss, metrics


def summed_nll(logits_BTV: jax.Array, labels_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(summed cross-entropy, unmasked token count) of a batch: held-out sets add these up."""
  nll_BT, _, mask_BT = token_nll(logits_BTV, labels_BT)
  return nll_BT.sum(), mask_BT.sum()


def row_logprob(logits_BTV: jax.Array, labels_BT: jax.Array) -> jax.Array:
  """[B]: each row's summed log-probability of its unmasked labels (a task choice's score)."""
  return -token_nll(logits_BTV, labels_BT)[0].sum(axis=-1)


def choice_logprobs(logits_BTV: jax.Array, position_B: jax.Array, choices_BK: jax.Array
                    ) -> jax.Array:
  """[B, K]: log p(choice k) at each row's `position` (multiple choice scored in one pass:
  every answer is one token after the same context). Negative choices (padding) give 0."""
  logits_BV = jnp.take_along_axis(logits_BTV, position_B[:, None, None], axis=1)[:, 0]
  logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  logp_BK = jnp.take_along_axis(logp_BV, jnp.maximum(choices_BK, 0), axis=-1)
  return jnp.where(choices_BK >= 0, logp_BK, 0.0)
