"""The model's config: `ModelConfig` (the OLMo 3 transformer; it owns its parameter count and
training FLOPs per token, the Levanter convention), its RoPE scaling (`Yarn`) and enums, and the
presets (plain functions)."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from olmo3.config_checks import ConfigError, Validated, bounded, require, resumable
from olmo3.remat import Remat, check_custom


class DType(enum.StrEnum):
  FLOAT32 = "float32"
  BFLOAT16 = "bfloat16"
  # Parameters and every computation in float64 (needs jax_enable_x64): for parity checks that
  # must see differences below float32 rounding (benchmarks/train_parity_olmo_core.py), not
  # for training.
  FLOAT64 = "float64"


class AttentionKernel(enum.StrEnum):
  """How attention is computed. All give the same function (tested against XLA)."""

  XLA = "xla"  # explicit masked einsum + softmax; runs everywhere; the reference.
  DOT_PRODUCT = "dot_product"  # jax.nn.dot_product_attention, letting JAX pick the backend.
  CUDNN = "cudnn"  # jax.nn.dot_product_attention(implementation="cudnn"): fused flash on GPU.
  SPLASH = "splash"  # Pallas splash attention (TPU; interpret mode elsewhere, slow).


class ContextParallel(enum.StrEnum):
  """How attention reads a sequence that the mesh's `sequence` axis splits (context
  parallelism; docs/performance.md#context-parallelism). Both give the same losses and
  gradients as one device."""

  # Each device keeps its queries and gathers every key and value along the sequence (the
  # llama3-style context parallelism of OLMo-core, with which AI2 trained stage 3); the sequence
  # is laid out zig-zag so that causal attention costs every device the same.
  ALL_GATHER = "all_gather"
  # Ulysses: an all-to-all swaps the sequence split for a head split, each device attends the
  # whole sequence for its heads, and a second all-to-all swaps back. The degree must divide
  # the key/value heads.
  ALL_TO_ALL = "all_to_all"


def heads_split_problem(heads: int, split: int, what: str = "heads") -> str | None:
  """Why all-to-all context parallelism cannot split `heads` `split` ways (the mesh's sequence x
  tensor size), or None: one rule, worded once, for the experiment, the cluster job and the
  trace."""
  if split <= 1 or heads % split == 0:
    return None
  return (f"all-to-all context parallelism splits the heads {split} ways (mesh sequence x "
          f"tensor), which does not divide {heads} {what}; use "
          "model.context_parallel='all_gather' or a degree that divides the key/value heads")


INT32_MAX = 2**31 - 1  # step counts and token ids live in int32 arrays on the device


class ScaledLayers(enum.StrEnum):
  """Which layers' RoPE a `Yarn` scaling applies to."""

  # The full-attention layers only, the sliding-window layers keep their RoPE: OLMo-core's
  # `with_rope_scaling(..., full_attn_layers_only=True)`, as AI2 trained OLMo 3 7B's stage 3.
  FULL_ATTENTION = "full_attention"
  ALL = "all"  # every layer (what Hugging Face transformers 5.3's Olmo3 runs; for comparison)


class RopePositions(enum.StrEnum):
  """The RoPE positions of an instance that packs several documents (`segments` given)."""

  # 0..T-1 across the instance, whatever the documents: OLMo-core 2.4.0, with which AI2 ran
  # OLMo 3 7B's stage 3 (documents are separated by the attention mask alone).
  INSTANCE = "instance"
  # Restarting at 0 at each document's first token: OLMo-core 3.0.0's intra-document RoPE,
  # which it applies whenever a batch carries document lengths (without context parallelism).
  DOCUMENT = "document"


@dataclasses.dataclass(frozen=True)
class Yarn(Validated):
  """YaRN RoPE scaling (docs/architecture.md#yarn): each rotary frequency blends its original
  value with the value divided by `factor`, by a linear ramp over the dimensions whose
  wavelengths lie between the original context turning `beta_fast` and `beta_slow` times; cos and
  sin are multiplied by `attention_factor` (0.1 ln factor + 1), so attention logits by its square.
  Defaults are AI2's OLMo 3 7B stage 3 (OLMo-core's YaRNRoPEScalingConfig defaults)."""

  factor: float = bounded(8.0, ge=1)
  beta_fast: float = bounded(32.0, gt=0)  # rotations: above it, frequencies keep their value
  beta_slow: float = bounded(1.0, gt=0)  # and below it, they are divided by `factor`
  original_context: int = bounded(8192, ge=1)  # the context the unscaled model was trained at
  layers: ScaledLayers = ScaledLayers.FULL_ATTENTION

  def _check(self) -> None:
    require(self, "beta_fast", self.beta_fast > self.beta_slow,
            f"must be > beta_slow ({self.beta_slow})")

  @property
  def attention_factor(self) -> float:
    """What cos and sin are multiplied by (YaRN's section 3.4: 0.1 ln(factor) + 1)."""
    return 0.1 * math.log(self.factor) + 1.0

  def replace(self, **changes: Any) -> Yarn:
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ModelConfig(Validated):
  """The OLMo 3 transformer (docs/architecture.md). Defaults are OLMo 3 7B."""

  vocab_size: int = bounded(100_278, ge=1, le=INT32_MAX)  # tokenizer vocabulary (dolma2)
  padded_vocab_size: int = bounded(100_352, ge=1, le=INT32_MAX)  # embedding / LM-head rows
  d_model: int = bounded(4096, ge=1)
  n_layers: int = bounded(32, ge=1)
  n_heads: int = bounded(32, ge=1)
  n_kv_heads: int = bounded(32, ge=1)  # < n_heads: grouped-query attention
  mlp_hidden: int = bounded(11_008, ge=1)
  # Keys a sliding layer sees, the current one included (so at least 1).
  sliding_window: int = bounded(4096, ge=1)
  # Layer i is global when i % global_every == global_every - 1; the last is always global.
  global_every: int = bounded(4, ge=1)
  rope_theta: float = bounded(500_000.0, gt=0)
  rope_scaling: Yarn | None = None  # stage 3's long context (None: plain RoPE)
  rope_positions: RopePositions = RopePositions.INSTANCE
  norm_eps: float = bounded(1e-6, gt=0)
  init_std: float = bounded(0.02, gt=0)
  init_cutoff: float = bounded(3.0, gt=0)  # truncation of the normal init, in standard deviations
  # The longest sequence trained on (stages 1-2); exported as max_position_embeddings.
  max_seq_len: int = bounded(8192, ge=1)
  eos_token_id: int | None = bounded(100_257, ge=0)  # and < vocab_size
  pad_token_id: int | None = bounded(100_277, ge=0)  # and < vocab_size
  compute_dtype: DType = DType.BFLOAT16  # parameters are float32 (float64 with FLOAT64)
  attention: AttentionKernel = AttentionKernel.XLA
  # With the sequence split over the mesh: gather keys and values, or swap sequence for heads.
  context_parallel: ContextParallel = resumable(ContextParallel.ALL_GATHER)
  # Splash attention's query and key block (both; a shard's queries or the keys, if fewer):
  # the kernel's tile, and the granularity at which it skips masked blocks.
  splash_block: int = resumable(512, ge=8)
  scan_layers: bool = True  # scan over groups of `global_every` layers; False unrolls (same outputs)
  remat: Remat = Remat.NONE
  remat_custom: tuple[tuple[str, str], ...] = ()  # Remat.CUSTOM: (checkpoint name, mode)
  # LM-head columns per chunk of the fused cross-entropy (olmo3.loss.fused_token_nll): the
  # train step and evaluation never hold the full [B, T, V] float32 logits or their gradient,
  # only one [B, T, vocab_chunk] block at a time. Same losses and gradients to float32
  # rounding; None computes the full logits (the reference). A divisor of padded_vocab_size
  # wastes nothing; otherwise the last chunk overlaps the one before it.
  vocab_chunk: int | None = resumable(8192, ge=1)

  def _check(self) -> None:
    why = check_custom(self.remat_custom)
    require(self, "remat_custom", why is None, str(why))
    require(self, "padded_vocab_size", self.padded_vocab_size >= self.vocab_size,
            f"must be >= vocab_size ({self.vocab_size})")
    require(self, "d_model", self.d_model % self.n_heads == 0,
            f"not divisible by n_heads ({self.n_heads})")
    require(self, "n_kv_heads", self.n_kv_heads <= self.n_heads
            and self.n_heads % self.n_kv_heads == 0, f"must divide n_heads ({self.n_heads})")
    require(self, "n_heads", self.head_dim % 2 == 0,
            f"head_dim = d_model / n_heads = {self.head_dim} must be even for RoPE")
    for f in ("eos_token_id", "pad_token_id"):
      v = getattr(self, f)
      require(self, f, v is None or v < self.vocab_size,
              f"must be None or a token id in [0, vocab_size={self.vocab_size})")

  # --- shape facts ---------------------------------------------------------------------------

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  def is_global(self, layer: int) -> bool:
    """Full causal attention on this layer (else sliding window)."""
    return layer % self.global_every == self.global_every - 1 or layer == self.n_layers - 1

  @property
  def layer_is_global(self) -> tuple[bool, ...]:
    return tuple(self.is_global(i) for i in range(self.n_layers))

  def layer_rope_scaled(self, layer: int) -> bool:
    """Whether `rope_scaling` applies to this layer's RoPE."""
    if self.rope_scaling is None:
      return False
    return self.rope_scaling.layers == ScaledLayers.ALL or self.is_global(layer)

  def layer_window(self, layer: int) -> int | None:
    """Keys visible to a query on this layer (the query's own included); None = all causal."""
    return None if self.is_global(layer) else self.sliding_window

  # --- counts --------------------------------------------------------------------------------

  @property
  def block_param_count(self) -> int:
    d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
    attn = d * q + 2 * d * kv + q * d + q + kv  # q, k, v, o projections; q_norm, k_norm
    mlp = 3 * d * self.mlp_hidden
    return attn + mlp + 2 * d  # two post-sublayer norms

  @property
  def param_count(self) -> int:
    """All parameters, padded vocabulary rows included (7,298,617,344 for OLMo 3 7B)."""
    embed = self.padded_vocab_size * self.d_model
    return 2 * embed + self.n_layers * self.block_param_count + self.d_model

  @property
  def matmul_param_count(self) -> int:
    """N of docs/flops.md: matmul weights; input embedding and norm weights excluded."""
    d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
    per_block = 2 * d * q + 2 * d * kv + 3 * d * self.mlp_hidden
    return self.n_layers * per_block + self.d_model * self.padded_vocab_size

  def mean_keys_per_query(self, layer: int, seq_len: int) -> float:
    """Mean number of keys a query attends to on `layer` (causal, with the window if sliding)."""
    t, w = seq_len, self.layer_window(layer)
    if w is None or w >= t:
      return (t + 1) / 2
    return (w * (w + 1) / 2 + (t - w) * w) / t

  def flops_per_token(self, seq_len: int) -> float:
    """Exact training FLOPs per token (forward + backward): 6N + sum_l 12*H*Q*mean_keys(l).

    Counts the causal half and the sliding window exactly (docs/flops.md#our-count): 46.56 GFLOP for
    OLMo 3 7B at T=8192.
    """
    if seq_len < 1:
      raise ConfigError(f"seq_len={seq_len!r}: must be >= 1")
    attn = sum(12 * self.n_heads * self.head_dim * self.mean_keys_per_query(i, seq_len)
               for i in range(self.n_layers))
    return 6 * self.matmul_param_count + attn

  def replace(self, **changes: Any) -> ModelConfig:
    return dataclasses.replace(self, **changes)


# --- presets -----------------------------------------------------------------------------------


def olmo3_7b() -> ModelConfig:
  """OLMo 3 7B, stages 1-2 (docs/architecture.md)."""
  return ModelConfig()


def olmo3_7b_long_context() -> ModelConfig:
  """OLMo 3 7B after stage 3 (Olmo-3-1025-7B as released): YaRN x8 over 8192 tokens on the
  full-attention layers, trained at 65,536 tokens (docs/architecture.md#yarn)."""
  return ModelConfig(rope_scaling=Yarn(), max_seq_len=65_536)


def olmo3_32b() -> ModelConfig:
  """OLMo 3 32B: grouped-query attention (docs/architecture.md#shapes)."""
  return ModelConfig(d_model=5120, n_layers=64, n_heads=40, n_kv_heads=8, mlp_hidden=27_648)


def olmo3_tiny() -> ModelConfig:
  """2,902,144 parameters: the CPU default, trained on the embedded corpus (8k BPE vocabulary).

  Sized to train visibly on 2 CPU cores in minutes. The window (128) is half the sequence
  length the tiny experiments train on (256), as in the 7B (4096 of 8192), so sliding and
  global layers differ.
  """
  return ModelConfig(vocab_size=8192, padded_vocab_size=8192, d_model=128, n_layers=4, n_heads=4,
                     n_kv_heads=4, mlp_hidden=352, sliding_window=128, max_seq_len=256,
                     eos_token_id=0, pad_token_id=1, compute_dtype=DType.FLOAT32)


def olmo3_micro() -> ModelConfig:
  """A model that compiles in seconds, for tests: 6 layers (not a multiple of 4) and GQA."""
  return ModelConfig(vocab_size=500, padded_vocab_size=512, d_model=64, n_layers=6, n_heads=8,
                     n_kv_heads=2, mlp_hidden=96, sliding_window=16, max_seq_len=256,
                     eos_token_id=0, pad_token_id=1, compute_dtype=DType.FLOAT32)


PRESETS = {"olmo3_7b": olmo3_7b, "olmo3_7b_long_context": olmo3_7b_long_context,
           "olmo3_32b": olmo3_32b, "olmo3_tiny": olmo3_tiny, "olmo3_micro": olmo3_micro}
