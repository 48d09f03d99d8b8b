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
            batch_tokens: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(loss, metrics): CE + z_loss_weight · lse², summed over unmasked labels and divided by
  `batch_tokens` (default: the unmasked label count; the train step passes OLMo-core's count,
  which also counts the positions of instances the repetition filter masked, and for one
  microbatch the whole batch's count, so the microbatches' losses and gradients sum to the
  whole batch's). The divisor is at least 1: an all-masked batch gives 0, never NaN.
  """
  nll_BT, lse_BT, mask_BT = token_nll(logits_BTV, labels_BT)
  n_tokens = mask_BT.sum()
  divisor = jnp.maximum(n_tokens if batch_tokens is None else batch_tokens, 1
                        ).astype(jnp.float32)
  ce = nll_BT.sum() / divisor
  z_loss = jnp.where(mask_BT, jnp.square(lse_BT), 0.0).sum() / divisor
  return ce + z_loss_weight * z_loss, {"ce_loss": ce, "z_loss": z_loss, "tokens": n_tokens}


def summed_nll(logits_BTV: jax.Array, labels_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(summed cross-entropy, unmasked token count) of a batch: held-out sets add these up."""
  nll_BT, _, mask_BT = token_nll(logits_BTV, labels_BT)
  return nll_BT.sum(), mask_BT.sum()


def row_logprob(logits_BTV: jax.Array, labels_BT: jax.Array) -> jax.Array:
  """[B]: each row's summed log-probability of its unmasked labels (a task choice's score)."""
  return -token_nll(logits_BTV, labels_BT)[0].sum(axis=-1)
