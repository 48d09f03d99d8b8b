"""FLOP conventions, peak FLOP/s and HBM per device, MFU (docs/flops.md).

Our number is `ModelConfig.flops_per_token` (exact: causal halving and the sliding window).
Other frameworks count differently; these functions reproduce their conventions so MFU figures
can be compared like for like. Always name the convention with an MFU.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from olmo3.config import ModelConfig


class Convention(enum.StrEnum):
  EXACT = "exact"  # ours: causal + sliding window, 6N over matmul weights
  OLMO_CORE_LEGACY = "olmo_core_legacy"  # 12·H·Q·min(W, T) per layer, no causal halving
  MAXTEXT = "maxtext"  # causal halving, sliding layers counted as global
  PALM = "palm"  # 12·L·H·Q·T (torchtitan too)


def flops_per_token(cfg: ModelConfig, seq_len: int, convention: Convention = Convention.EXACT
                    ) -> float:
  if convention == Convention.EXACT:
    return cfg.flops_per_token(seq_len)
  per_key = 12 * cfg.n_heads * cfg.head_dim  # FLOPs per (query, key) pair, forward + backward
  dense = 6 * cfg.matmul_param_count
  if convention == Convention.OLMO_CORE_LEGACY:
    keys = [min(cfg.layer_window(i) or seq_len, seq_len) for i in range(cfg.n_layers)]
    return dense + per_key * sum(keys)
  if convention == Convention.MAXTEXT:
    return dense + per_key * cfg.n_layers * (seq_len + 1) / 2
  if convention == Convention.PALM:
    return dense + per_key * cfg.n_layers * seq_len
  raise ValueError(f"unknown convention {convention!r}")


def within_document_flops_per_token(cfg: ModelConfig, lengths: Sequence[int]) -> float:
  """Training FLOPs per token of an instance packing documents of `lengths` tokens (summing to
  the instance's length; padding counts as a document), counting only the (query, key) pairs
  within a document: what a kernel that skips the pairs across documents computes (OLMo-core's
  flash-attn varlen). Splash skips only the blocks its causal / window mask leaves empty, so
  olmo3's step computes `ModelConfig.flops_per_token` whatever the documents
  (docs/flops.md#long-context-and-packed-documents)."""
  seq_len = sum(lengths)
  if seq_len < 1 or min(lengths) < 1:
    raise ValueError(f"document lengths {list(lengths)[:8]}...: each must be >= 1")

  def pairs(length: int, window: int | None) -> int:  # sum over p < length of min(p + 1, W)
    w = length if window is None else min(window, length)
    return w * (w + 1) // 2 + (length - w) * w

  per_key = 12 * cfg.n_heads * cfg.head_dim
  attn = sum(per_key * sum(pairs(d, cfg.layer_window(i)) for d in lengths)
             for i in range(cfg.n_layers))
  return 6 * cfg.matmul_param_count + attn / seq_len


# Peak dense bf16 FLOP/s and HBM bytes per JAX device, by a lowercase substring of
# `device.device_kind`. TPU7x (Ironwood) exposes 2 devices per chip (2307e12 and 192 GB a chip).
_DEVICES = (
    ("tpu7x", 2307e12 / 2, 96e9),
    ("tpu v6", 918e12, 32e9),  # v6e: "TPU v6 lite"
    ("tpu v5 lite", 197e12, 16e9),  # v5e
    ("tpu v5", 459e12, 95e9),  # v5p: "TPU v5" / "TPU v5p"
    ("h200", 989e12, 141e9),
    ("h100", 989e12, 80e9),
)


def _lookup(device_kind: str) -> tuple[float, float] | None:
  kind = device_kind.lower()
  return next(((peak, hbm) for key, peak, hbm in _DEVICES if key in kind), None)


def peak_flops_per_device(device_kind: str) -> float | None:
  """None when unknown (CPUs): MFU is then not reported rather than made up."""
  found = _lookup(device_kind)
  return found[0] if found else None


def hbm_bytes_per_device(device_kind: str) -> float | None:
  found = _lookup(device_kind)
  return found[1] if found else None
