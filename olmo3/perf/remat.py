"""Rematerialisation policies by name, over the model's named checkpoints (MaxText's vocabulary,
REFERENCE.md §7). Applied to each scanned group of layers (and each unrolled layer)."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from olmo3.config import Remat


NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj",
         "mlpwi_0", "mlpwi_1", "mlpwo")
_SAVED = {
    Remat.MINIMAL: ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1",
                    "mlpwo"),
    Remat.SAVE_QKV_PROJ: ("query_proj", "key_proj", "value_proj"),
    Remat.SAVE_DOT_EXCEPT_MLP: ("query_proj", "key_proj", "value_proj", "context", "out_proj"),
    Remat.MINIMAL_WITH_CONTEXT: ("query_proj", "key_proj", "value_proj", "context", "out_proj",
                                 "mlpwi_0", "mlpwi_1", "mlpwo"),
}


def policy(remat: Remat, custom: Sequence[tuple[str, str]] = ()):
  """A jax.checkpoint policy, or None for Remat.NONE (no checkpointing)."""
  remat = Remat(remat)
  if remat == Remat.NONE:
    return None
  if remat == Remat.FULL:
    return jax.checkpoint_policies.nothing_saveable
  if remat == Remat.CUSTOM:
    modes = dict(custom)
    unknown = set(modes) - set(NAMES)
    bad = {m for m in modes.values()} - {"device", "offload", "remat"}
    if unknown or bad:
      raise ValueError(f"remat_custom: unknown names {sorted(unknown)} or modes {sorted(bad)}; "
                       f"names are {NAMES}, modes device/offload/remat")
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[n for n, m in modes.items() if m == "device"],
        names_which_can_be_offloaded=[n for n, m in modes.items() if m == "offload"],
        offload_src="device", offload_dst="pinned_host")
  return jax.checkpoint_policies.save_only_these_names(*_SAVED[remat])
