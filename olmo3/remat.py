"""Rematerialisation: the model's named activations and the policies over them.

The model tags its activations with `jax.ad_checkpoint.checkpoint_name` using the names below
(MaxText's vocabulary, so policies and results compare across frameworks). A policy says which
of them the backward pass keeps on the device, offloads to host memory, or recomputes; it wraps
each transformer layer (docs/performance.md#remat). This module sits below the config and the
model: it imports no other olmo3 module.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import jax


class Name(enum.StrEnum):
  """The checkpoint names the model gives its activations (one list, used everywhere)."""

  DECODER_LAYER_INPUT = "decoder_layer_input"
  QUERY_PROJ = "query_proj"
  KEY_PROJ = "key_proj"
  VALUE_PROJ = "value_proj"
  CONTEXT = "context"  # the attention output, before the output projection
  OUT_PROJ = "out_proj"
  MLPWI_0 = "mlpwi_0"  # the MLP gate projection
  MLPWI_1 = "mlpwi_1"  # the MLP up projection
  MLPWO = "mlpwo"  # the MLP down projection
  # Queries, keys and values after all-to-all context parallelism swapped them to the head
  # split (only there): kept, the backward pass does not swap them again.
  SWAPPED_QKV = "swapped_qkv"
  # Keys and values gathered whole along the sequence by context parallelism's gathering
  # strategy (only there): kept, the backward pass does not gather them again.
  GATHERED_KV = "gathered_kv"


NAMES = tuple(n.value for n in Name)


class Mode(enum.StrEnum):
  """What Remat.CUSTOM does with one named activation."""

  DEVICE = "device"  # keep it in device memory
  OFFLOAD = "offload"  # move it to pinned host memory and back for the backward pass
  REMAT = "remat"  # recompute it


class Remat(enum.StrEnum):
  """What the backward pass recomputes inside each layer."""

  NONE = "none"  # no jax.checkpoint: everything the backward pass needs is kept
  FULL = "full"  # save nothing inside a layer: recompute it all
  MINIMAL = "minimal"  # save q/k/v/out projections and the MLP matmuls
  SAVE_QKV_PROJ = "save_qkv_proj"
  SAVE_DOT_EXCEPT_MLP = "save_dot_except_mlp"  # the attention matmuls, not the MLP's
  MINIMAL_WITH_CONTEXT = "minimal_with_context"  # minimal + the attention output
  CUSTOM = "custom"  # per name (ModelConfig.remat_custom): a Mode for each


SAVED: dict[Remat, tuple[Name, ...]] = {
    Remat.MINIMAL: (Name.QUERY_PROJ, Name.KEY_PROJ, Name.VALUE_PROJ, Name.OUT_PROJ,
                    Name.MLPWI_0, Name.MLPWI_1, Name.MLPWO),
    Remat.SAVE_QKV_PROJ: (Name.QUERY_PROJ, Name.KEY_PROJ, Name.VALUE_PROJ),
    Remat.SAVE_DOT_EXCEPT_MLP: (Name.QUERY_PROJ, Name.KEY_PROJ, Name.VALUE_PROJ, Name.CONTEXT,
                                Name.OUT_PROJ),
    Remat.MINIMAL_WITH_CONTEXT: (Name.QUERY_PROJ, Name.KEY_PROJ, Name.VALUE_PROJ, Name.CONTEXT,
                                 Name.OUT_PROJ, Name.MLPWI_0, Name.MLPWI_1, Name.MLPWO),
}


def check_custom(custom: Sequence[tuple[str, str]]) -> str | None:
  """Why a Remat.CUSTOM assignment is invalid (unknown name or mode, a name given twice), or
  None when it is valid."""
  names = [n for n, _ in custom]
  unknown = sorted(set(names) - set(NAMES))
  modes = sorted({m for _, m in custom} - {m.value for m in Mode})
  twice = sorted({n for n in names if names.count(n) > 1})
  if unknown:
    return f"unknown checkpoint names {unknown}; the model's names are {list(NAMES)}"
  if modes:
    return f"unknown modes {modes}; modes are {[m.value for m in Mode]}"
  if twice:
    return f"names given more than once: {twice}"
  return None


def policy(remat: Remat, custom: Sequence[tuple[str, str]] = ()):
  """A jax.checkpoint policy, or None for Remat.NONE (no checkpointing)."""
  remat = Remat(remat)
  if remat == Remat.NONE:
    return None
  if remat == Remat.FULL:
    return jax.checkpoint_policies.nothing_saveable
  if remat == Remat.CUSTOM:
    if (why := check_custom(custom)) is not None:
      raise ValueError(f"remat_custom: {why}")
    modes = dict(custom)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[n for n, m in modes.items() if m == Mode.DEVICE],
        names_which_can_be_offloaded=[n for n, m in modes.items() if m == Mode.OFFLOAD],
        offload_src="device", offload_dst="pinned_host")
  return jax.checkpoint_policies.save_only_these_names(*(n.value for n in SAVED[remat]))
