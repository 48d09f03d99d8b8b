"""FLOP conventions, each device's published peaks (FLOP/s, HBM, bandwidths), MFU
(docs/flops.md).

Our number is `ModelConfig.flops_per_token` (exact: causal halving and the sliding window).
Other frameworks count differently; these functions reproduce their conventions so MFU figures
can be compared like for like. Always name the convention with an MFU.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
  """One JAX device's published peaks: dense bf16 FLOP/s, HBM bytes and bytes/s, and the
  interconnect's bytes/s into the device (half the chip's bidirectional ICI or NVLink figure,
  shared among the chip's JAX devices)."""

  flops: float
  hbm_bytes: float
  hbm_bandwidth: float
  link_bandwidth: float


# By a lowercase substring of `device.device_kind`, from the vendors' spec tables: Cloud TPU's
# "System architecture" pages (per chip: BF16 TFLOP/s, HBM GiB and GB/s, bidirectional ICI
# GB/s) and NVIDIA's H100 / H200 SXM datasheets (NVLink 900 GB/s bidirectional). TPU7x
# (Ironwood) exposes its chip as 2 devices (2,307 TFLOP/s, 192 GB, 7,380 GB/s, ICI 1,200 GB/s
# a chip); v5p's chip is one device (megacore).
_DEVICES = (
    ("tpu7x", DevicePeaks(2307e12 / 2, 96e9, 7380e9 / 2, 1200e9 / 2 / 2)),
    ("tpu v6", DevicePeaks(918e12, 32e9, 1638e9, 800e9 / 2)),  # v6e: "TPU v6 lite"
    ("tpu v5 lite", DevicePeaks(197e12, 16e9, 819e9, 200e9 / 2)),  # v5e: ICI 1,600 Gbit/s
    ("tpu v5", DevicePeaks(459e12, 95e9, 2765e9, 1200e9 / 2)),  # v5p: "TPU v5" / "TPU v5p"
    ("h200", DevicePeaks(989e12, 141e9, 4.8e12, 900e9 / 2)),
    ("h100", DevicePeaks(989e12, 80e9, 3.35e12, 900e9 / 2)),
)


def device_peaks(device_kind: str) -> DevicePeaks | None:
  """None when unknown (CPUs): a bound or an MFU is then not reported rather than made up."""
  kind = device_kind.lower()
  return next((peaks for key, peaks in _DEVICES if key in kind), None)


def peak_flops_per_device(device_kind: str) -> float | None:
  """None when unknown (CPUs): MFU is then not reported rather than made up."""
  peaks = device_peaks(device_kind)
  return peaks.flops if peaks else None


def hbm_bytes_per_device(device_kind: str) -> float | None:
  peaks = device_peaks(device_kind)
  return peaks.hbm_bytes if peaks else None
