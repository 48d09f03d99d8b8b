"""The training loss: token-mean cross-entropy over unmasked labels plus z-loss (REFERENCE §3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lm_loss(logits_BTV: jax.Array, labels_BT: jax.Array, z_loss_weight: float = 0.0,
            batch_tokens: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(loss, metrics). Labels < 0 are masked. Logits are upcast to float32.

  The divisor is max(1, unmasked tokens): an all-masked batch (every instance flagged by the
  repetition filter, say) gives loss 0, never NaN. For one microbatch of a larger batch, pass
  the whole batch's unmasked token count as `batch_tokens`: the microbatches' losses (and
  gradients) then sum to the whole batch's.
  """
  logits = logits_BTV.astype(jnp.float32)
  mask = labels_BT >= 0
  lse_BT = jax.nn.logsumexp(logits, axis=-1)
  target_BT = jnp.take_along_axis(logits, jnp.maximum(labels_BT, 0)[..., None], axis=-1)[..., 0]
  n_tokens = mask.sum()
  divisor = jnp.maximum(n_tokens if batch_tokens is None else batch_tokens, 1
                        ).astype(jnp.float32)
  ce = jnp.where(mask, lse_BT - target_BT, 0.0).sum() / divisor
  z_loss = jnp.where(mask, jnp.square(lse_BT), 0.0).sum() / divisor
  return ce + z_loss_weight * z_loss, {"ce_loss": ce, "z_loss": z_loss, "tokens": n_tokens}
