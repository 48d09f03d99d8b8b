"""Peak FLOP/s per device and MFU (REFERENCE.md §6). Training FLOPs per token live on the model
config (`ModelConfig.flops_per_token`, exact causal + sliding-window count)."""

from __future__ import annotations

# Peak dense bf16 FLOP/s per JAX device, by a lowercase substring of `device.device_kind`.
# TPU7x (Ironwood) exposes 2 devices per chip: 2307e12 per chip.
PEAK_FLOPS = (
    ("tpu7x", 2307e12 / 2),
    ("tpu v6", 918e12),  # v6e: "TPU v6 lite"
    ("tpu v5 lite", 197e12),  # v5e
    ("tpu v5", 459e12),  # v5p: "TPU v5" / "TPU v5p"
    ("h200", 989e12),
    ("h100", 989e12),
)


def peak_flops_per_device(device_kind: str) -> float | None:
  """None when unknown (CPUs): MFU is then not reported rather than made up."""
  kind = device_kind.lower()
  return next((peak for key, peak in PEAK_FLOPS if key in kind), None)
