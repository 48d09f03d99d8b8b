"""Frozen configuration dataclasses. Every config validates itself at construction
(olmo3.config_checks, the checker): each field's value is checked against its annotation (bools
are bools, ints ints, floats finite numbers, enums members, tuples tuples), and every number
against the bounds its field declares (`bounded`, `resumable`); constraints between fields are
each class's `_check`. A bad value is a `ConfigError` naming `Class.field=value`.

The model config owns its parameter count and its training FLOPs per token (the Levanter
convention: the numbers travel with the shape that defines them). Presets are plain functions.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from olmo3.config_checks import (RESUMABLE, ConfigError, Validated, bounded, fail, nonempty,
                                 require, resumable)
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


# --- bounds and resumable fields (declared with olmo3.config_checks) -------------------------

INT32_MAX = 2**31 - 1  # step counts and token ids live in int32 arrays on the device
SEED_MAX = 2**63 - 1  # jax.random keys take a seed that fits int64


def resumable_fields(cls: type | None = None, prefix: str = "") -> tuple[str, ...]:
  """Dotted paths of every resumable field under `cls` (default: Experiment)."""
  cls = Experiment if cls is None else cls
  out = []
  for f in dataclasses.fields(cls):
    path = f"{prefix}{f.name}"
    if f.metadata.get(RESUMABLE):
      out.append(path)
    elif f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(
        f.default_factory()):
      out.extend(resumable_fields(type(f.default_factory()), f"{path}."))
  return tuple(out)


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


@dataclasses.dataclass(frozen=True)
class RepetitionFilter(Validated):
  """Mask the labels of an instance holding a run of >= max_count repetitions of any period in
  [min_period, max_period] (OLMo-core's instance filter, docs/data.md#repetition-filter)."""

  max_period: int = bounded(13, ge=1)  # and >= min_period
  min_period: int = bounded(1, ge=1)
  max_count: int = bounded(32, ge=3)  # shorter runs cannot be detected

  def _check(self) -> None:
    require(self, "max_period", self.max_period >= self.min_period,
            f"must be >= min_period ({self.min_period})")


class LongDocuments(enum.StrEnum):
  """What packing does with a document longer than an instance (OLMo-core's long_doc_strategy)."""

  TRUNCATE = "truncate"  # keep its first seq_len tokens (OLMo-core's default; AI2's stage 3)
  FRAGMENT = "fragment"  # cut it into seq_len pieces, each packed as a document


@dataclasses.dataclass(frozen=True)
class Packing(Validated):
  """Documents packed into instances, attention kept within each (OLMo-core's
  NumpyPackedFSLDataset with generate_doc_lengths=True, docs/data.md#packed-documents): the
  token files' documents (each ending at an EOS) are packed by optimized best-fit decreasing
  within groups of `source_group_size` files, the files put in groups in the order
  `source_permutation_seed` shuffles them; a bin not filled is padded (no loss there).
  Defaults are AI2's OLMo 3 7B stage 3."""

  source_group_size: int = bounded(8, ge=1)
  source_permutation_seed: int = bounded(123, ge=0)
  long_documents: LongDocuments = LongDocuments.TRUNCATE


@dataclasses.dataclass(frozen=True)
class DataConfig(Validated):
  """Where training tokens come from and in which order (OLMo-core's semantics, docs/data.md).

  Token files are given directly (`paths`) or by a mix file (`mix`: lines `label,path` with
  `{TOKENIZER}` in the path, as OLMo-core's mixes; a file path or the name of a mix that the
  installed ai2-olmo-core ships), resolved against `root` (a directory or a URL: gs://bucket,
  s3://bucket, or http://olmo-data.org, where AI2 serves its files; olmo3.io.storage).
  """

  paths: tuple[str, ...] = ()
  mix: str | None = None
  root: str = ""  # "": paths are as given (relative to the working directory)
  tokenizer_id: str = "allenai/dolma3-tokenizer"  # substituted for {TOKENIZER} in mix paths
  seq_len: int = bounded(8192, ge=2)  # inputs and labels
  # OLMo-core's max_target_sequence_length, which AI2's scripts set to max(8192, seq_len): each
  # file is cut into whole runs of max(max_target_seq_len, seq_len) tokens (the rest unused) and
  # an epoch shuffles those runs, each read as consecutive instances (`chunk_instances`), instead
  # of single instances. At seq_len 8192 and above a run is one instance. None: no runs, single
  # instances shuffled (OLMo-core's default).
  max_target_seq_len: int | None = bounded(8192, ge=2)
  global_batch_size: int = bounded(512, ge=1)  # instances per step
  seed: int = bounded(34521, ge=0)
  repetition_filter: RepetitionFilter | None = None  # off in the OLMo 3 7B recipe
  packing: Packing | None = None  # stage 3's packed documents; None: instances cut from files
  # Only the first N instances (memorisation experiments); at least one global batch.
  max_instances: int | None = bounded(None, ge=1)
  validate_tokens: bool = True  # scan every token file at startup for ids >= vocab
  num_workers: int = resumable(0, ge=0)  # Grain worker processes reading ahead (0: main process)
  prefetch: int = resumable(2, ge=1)  # steps buffered per worker
  # Global batches already on the devices ahead of the step being dispatched (read and
  # transferred by a background thread); 0 reads each batch when the loop asks for it.
  device_prefetch: int = resumable(2, ge=0)
  # Resume although the data identity recorded in the checkpoint differs (other files, another
  # mix or order): the run continues at the same instance position of the new data. Off, a
  # changed identity stops the resume, since the position would silently mean other tokens.
  allow_changed_data: bool = resumable(False)

  def _check(self) -> None:
    nonempty(self, "paths", "mix", "tokenizer_id")
    require(self, "paths", bool(self.paths) != bool(self.mix),
            "give token files in exactly one of `paths` and `mix`")
    require(self, "max_instances", self.max_instances is None
            or self.max_instances >= self.global_batch_size,
            f"must hold at least one global batch ({self.global_batch_size})")
    require(self, "max_target_seq_len", self.max_target_seq_len is None
            or self.max_target_seq_len <= self.seq_len
            or self.max_target_seq_len % self.seq_len == 0,
            f"must be a multiple of seq_len ({self.seq_len}), as OLMo-core requires, or None")
    require(self, "packing", self.packing is None or self.repetition_filter is None,
            "packed instances take no repetition_filter (OLMo-core's packed dataset has none)")

  @property
  def chunk_instances(self) -> int:
    """Consecutive instances an epoch's shuffle keeps together (1: single instances, and
    packed ones)."""
    if self.max_target_seq_len is None or self.packing is not None:
      return 1
    return max(self.max_target_seq_len, self.seq_len) // self.seq_len

  def replace(self, **changes: Any) -> DataConfig:
    return dataclasses.replace(self, **changes)


class Schedule(enum.StrEnum):
  COSINE = "cosine"  # linear warmup, then one cosine from peak to final_lr over the stage
  LINEAR = "linear"  # linear warmup (possibly none), then linear from peak to final_lr
  STITCHED_COSINE = "stitched_cosine"  # AI2's stage-1 schedule: two cosines (docs/recipe.md)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Validated):
  """AdamW with decoupled weight decay (p -= lr·wd·p) and global-norm clipping
  (docs/recipe.md#optimizer)."""

  peak_lr: float = bounded(3e-4, gt=0)
  b1: float = bounded(0.9, ge=0, lt=1)
  b2: float = bounded(0.95, ge=0, lt=1)
  eps: float = bounded(1e-8, gt=0)
  weight_decay: float = bounded(0.1, ge=0)
  no_decay: tuple[str, ...] = ("embed_tokens",)  # top-level parameter groups without decay
  clip_grad_norm: float = bounded(1.0, gt=0)
  schedule: Schedule = Schedule.COSINE
  warmup_steps: int = bounded(2000, ge=0, le=INT32_MAX)  # and < decay_steps
  final_lr: float = bounded(3e-5, ge=0)  # where the schedule ends (cosine, linear); <= peak_lr
  # The schedule's length in steps. Independent of TrainConfig.steps, so limiting a run to N
  # steps (--fdl_set=train.steps=N) runs the first N steps of the same schedule.
  decay_steps: int = bounded(1_413_814, ge=1, le=INT32_MAX)
  # STITCHED_COSINE only, AI2's stage 1 as its two official scripts ran it
  # (docs/recipe.md#learning-rate-schedules): part 1 is a cosine (warmup_steps, peak to final_lr)
  # aimed at stitch_first_steps; part 2 took over after the checkpoint of step stitch_resumed_at
  # with the second half of a cosine aimed at stitch_second_steps, which starts at stitch_at
  # and, before it, ramps linearly from 0 towards the midpoint LR (so it holds just below it).
  # With that schedule: warmup_steps < stitch_resumed_at < stitch_first_steps and
  # stitch_resumed_at <= stitch_at < stitch_second_steps.
  stitch_first_steps: int = bounded(1_192_093, ge=1, le=INT32_MAX)
  stitch_resumed_at: int = bounded(596_047, ge=0, le=INT32_MAX)
  stitch_at: int = bounded(597_046, ge=0, le=INT32_MAX)
  stitch_second_steps: int = bounded(1_668_931, ge=1, le=INT32_MAX)
  # Step skipping, as OLMo-core's SkipStepAdamW (docs/recipe.md#step-skipping): an update is
  # skipped when the CE loss or the pre-clip gradient norm exceeds the mean of the previous
  # spike_window steps' values (skipped steps included) by more than spike_sigma unbiased
  # standard deviations, once spike_min_history values (the current one included) exist.
  # Non-finite losses or gradients are always skipped and kept out of the window: they never
  # reach the parameters (OLMo-core would let one into its window).
  skip_spikes: bool = True
  spike_sigma: float = bounded(6.0, gt=0)  # <= 0 would skip every step above the mean
  spike_window: int = bounded(128, ge=1)
  # OLMo-core: max(2, spike_window // 2); at most spike_window + 1 (the window and the current).
  spike_min_history: int = bounded(64, ge=2)

  def _check(self) -> None:
    require(self, "final_lr", self.final_lr <= self.peak_lr,
            f"must be in [0, peak_lr={self.peak_lr}]")
    nonempty(self, "no_decay")
    require(self, "spike_min_history", self.spike_min_history <= self.spike_window + 1,
            f"must be in [2, spike_window + 1={self.spike_window + 1}]")
    if self.schedule == Schedule.STITCHED_COSINE:
      require(self, "stitch_resumed_at",
              self.warmup_steps < self.stitch_resumed_at < self.stitch_first_steps,
              f"must lie between warmup_steps ({self.warmup_steps}) and stitch_first_steps "
              f"({self.stitch_first_steps})")
      require(self, "stitch_at",
              self.stitch_resumed_at <= self.stitch_at < self.stitch_second_steps,
              f"must be in [stitch_resumed_at, stitch_second_steps={self.stitch_second_steps})")
    require(self, "decay_steps", self.decay_steps > self.warmup_steps,
            f"must be > warmup_steps ({self.warmup_steps})")


@dataclasses.dataclass(frozen=True)
class MeshConfig(Validated):
  """Mesh axis sizes (one may be -1: fill the devices) and the logical-axis rules."""

  shape: tuple[tuple[str, int], ...] = resumable((("data", 1), ("fsdp", -1), ("tensor", 1)))
  # (logical axis name, mesh axis, mesh axes or None) pairs; None: olmo3.sharding.FSDP_RULES.
  rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] | None = None
  # Multi-slice pods: the axes spanning slices over DCN, e.g. (("data", 4),); () = the slices
  # (if any) form the data axis. Each mesh axis is its `shape` size x its `dcn` size.
  dcn: tuple[tuple[str, int], ...] = resumable(())

  def _check(self) -> None:
    for name, pairs in (("shape", self.shape), ("dcn", self.dcn), ("rules", self.rules or ())):
      names = [n for n, _ in pairs]
      require(self, name, all(names) and len(set(names)) == len(names),
              "names must be non-empty and appear once")
    sizes = [n for _, n in self.shape]
    require(self, "shape", all(n == -1 or n >= 1 for n in sizes),
            "sizes must be >= 1, or -1 for one axis")
    require(self, "shape", sizes.count(-1) <= 1, "at most one axis may be -1")
    require(self, "dcn", all(n >= 1 for _, n in self.dcn), "sizes must be >= 1")
    mesh_axes = [a for _, m in self.rules or () for a in (m if isinstance(m, tuple) else (m,))]
    require(self, "rules", all(a != "" for a in mesh_axes), "mesh axis names must be non-empty")


@dataclasses.dataclass(frozen=True)
class TrainConfig(Validated):
  steps: int = resumable(1_413_814, ge=1, le=INT32_MAX)
  seed: int = bounded(0, ge=0, le=SEED_MAX)  # parameter initialisation
  z_loss_weight: float = bounded(1e-5, ge=0)
  log_every: int = resumable(1, ge=1)
  # Held-out evaluation every K steps (0: never); also at the end.
  eval_every: int = resumable(1000, ge=0)
  # Cap on held-out batches per evaluation (None: all).
  eval_batches: int | None = resumable(None, ge=1)
  # End the stage when this epoch of its data ends, if that comes before `steps` (AI2's stage 1:
  # hard_stop = one epoch). None: `steps` alone decides.
  stop_at_epoch: int | None = bounded(None, ge=1)
  # Stop the run after this many skipped steps in a row (None: never, as AI2's runs).
  max_consecutive_skips: int | None = bounded(None, ge=1)
  # Gradient accumulation: each step's global batch runs as this many sequential microbatches
  # (same data, same update, 1/k of the activation memory). How a run resumed on a smaller
  # slice keeps its global batch and per-device memory.
  microbatches: int = resumable(1, ge=1)


class InitMode(enum.StrEnum):
  """What `checkpoint.init_from` carries into a run: AI2's two ways of starting from a
  checkpoint (OLMo-core's `load_trainer_state`)."""

  # Parameters and optimizer moments (with Adam's count: its bias correction goes on); step,
  # learning-rate schedule, data position and step-skip window start from 0. A new stage, as
  # AI2 started midtraining from stage 1's end (load_trainer_state=False).
  NEW_STAGE = "new_stage"
  # Also the step (the schedule resumes where the checkpoint's run was), the data position (the
  # next batch is the one that run would have trained on next) and the step-skip window where
  # the checkpoint holds it: the same stage continued, on the same data, sequence length and
  # global batch (load_trainer_state=True).
  CONTINUE = "continue"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Validated):
  """Orbax checkpoints in WORKDIR/checkpoints; resume from the latest automatically."""

  every: int = resumable(1000, ge=1)
  keep: int = resumable(3, ge=1)
  async_save: bool = resumable(True)
  # Initialise from another run's checkpoint (a step directory, or a run's workdir or
  # checkpoints directory: the checkpoint at the end of its stage, olmo3.run.plan.init_from_step)
  # or from AI2's OLMo-core checkpoint (a step directory or URL, or a name `python -m
  # olmo3.convert import-olmo-core --list` lists; converted into the workdir once), as
  # init_mode says. Used when the workdir has no checkpoint of its own.
  init_from: str | None = None
  init_mode: InitMode = InitMode.NEW_STAGE
  # A damaged latest checkpoint (missing or truncated files) is reported by name; with
  # fallback the run resumes from the previous one instead of stopping.
  fallback: bool = True
  # A workdir that ever held checkpoints but has none usable now starts over from step 0 only
  # with this set: a lost checkpoints directory must not silently restart a long run. Set for
  # the one run that should start over, hence resumable.
  allow_restart_from_scratch: bool = resumable(False)

  def _check(self) -> None:
    nonempty(self, "init_from")
    if self.init_mode is InitMode.CONTINUE and not self.init_from:
      fail(self, "init_mode", "continues checkpoint.init_from, which is not set",
           self.init_mode.value)


@dataclasses.dataclass(frozen=True)
class EvalConfig(Validated):
  """Evaluation during training (and standalone, `python -m olmo3.eval`), as OLMo-core's
  in-loop evaluators (docs/evaluation.md).

  Held-out LM sets: mixes whose labels name the sets (one document per instance, as OLMo-core's
  NumpyPaddedFSLDataset), e.g. AI2's `v3-small-ppl-validation` (C4, Dolma sources, Pile, ...),
  read through the same mechanism as training data. Downstream tasks: ai2-olmo-eval labels (the
  `eval` extra), prepared with `tokenizer` and scored as OLMo-core does. The generalization-gap
  alarm compares train and held-out loss at each evaluation.
  """

  # Mixes (as DataConfig.mix; a prepared directory means its held-out split); each label of a
  # mix is one set. None: the training data's own held-out split (DataConfig.mix a directory
  # written by olmo3.data.prepare, the embedded corpus included), none for other data.
  heldout: tuple[str, ...] | None = ()
  # What heldout mix paths are relative to (None: data.root; "": as given).
  heldout_root: str | None = None
  # Substituted for {TOKENIZER} in held-out mix paths: AI2 stores its perplexity sets under
  # "dolma2-tokenizer" (the training mixes under "allenai/dolma3-tokenizer", the same tokenizer).
  heldout_tokenizer_id: str = "dolma2-tokenizer"
  batch_size: int = bounded(8, ge=1)  # documents (or task requests) per evaluation batch (global)
  max_documents: int | None = bounded(None, ge=1)  # per held-out set (None: all)
  # Only held-out documents of at least this many tokens are scored, the first max_documents of
  # them (stage 3: documents longer than the context it extends). None: every document.
  min_document_tokens: int | None = bounded(None, ge=2)
  # Held-out CE also per band of this many positions of the predicted token
  # (eval/<set>/ce_loss_pos<a>_<b>): with the original context as the band, whether loss falls
  # beyond it (stage 3). None: no bands.
  position_band: int | None = bounded(None, ge=1)
  tasks: tuple[str, ...] = ()  # ai2-olmo-eval task labels, e.g. "arc_easy_rc_5shot"
  task_limit: int | None = bounded(None, ge=1)  # documents per task (None: all the task holds)
  # Tasks' tokenizer: a tokenizer.json path, hub name, "embedded", or None: the training data's
  # (its prepared directory's tokenizer.json). olmo3.data.sources.resolve fills both Nones.
  tokenizer: str | None = "allenai/dolma2-tokenizer"
  alarm_window: int = bounded(2, ge=1)  # evaluations the alarm looks back
  alarm_margin: float = bounded(0.05, gt=0)  # train-loss improvement (nats) counted as improving
  stop_on_alarm: bool = False

  def _check(self) -> None:
    nonempty(self, "heldout", "heldout_tokenizer_id", "tokenizer")
    require(self, "tasks", all(spec and ":" not in spec for spec in self.tasks),
            "each task is an ai2-olmo-eval label, e.g. 'arc_easy_rc_5shot' "
            "(olmo_eval.list_tasks() lists them)")


class WandbMode(enum.StrEnum):
  OFF = "off"  # TensorBoard and metrics.jsonl only (the default)
  ONLINE = "online"  # streams to the W&B server (needs `wandb login` or WANDB_API_KEY)
  OFFLINE = "offline"  # the W&B run written locally (WANDB_DIR, else ./wandb); `wandb sync` uploads


@dataclasses.dataclass(frozen=True)
class WandbConfig(Validated):
  """Weights & Biases metrics (the `wandb` extra) beside TensorBoard: process 0 logs the scalars
  TensorBoard gets, at the same steps, with the experiment as the run's config. The run id is
  kept in WORKDIR/wandb_run_id, so a resumed run continues the same W&B run. Every field is
  resumable: W&B may be turned on (or its names changed) for a run already under way."""

  mode: WandbMode = resumable(WandbMode.OFF)
  project: str = resumable("olmo3")
  entity: str | None = resumable(None)  # a team or user (None: the API key's default entity)
  name: str | None = resumable(None)  # the run's display name (None: the workdir's name)

  def _check(self) -> None:
    nonempty(self, "project", "entity", "name")

  @property
  def enabled(self) -> bool:
    return self.mode is not WandbMode.OFF


@dataclasses.dataclass(frozen=True)
class Experiment(Validated):
  """Everything a run is: what Fiddle builds and the launcher runs."""

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(mix="OLMo-mix-0625-official"))
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
  # Flags ('--name=value') appended to XLA_FLAGS / LIBTPU_INIT_ARGS before JAX starts. Both
  # variables are split at whitespace, so a flag holding any would silently become two.
  xla_flags: tuple[str, ...] = ()
  libtpu_flags: tuple[str, ...] = ()
  env: tuple[tuple[str, str], ...] = ()  # environment variables set before JAX starts

  def _check(self) -> None:
    for name in ("xla_flags", "libtpu_flags"):
      require(self, name, all(f.startswith("--") and f.split() == [f]
                              for f in getattr(self, name)),
              "each entry is one flag, '--name=value', without whitespace")
    require(self, "env", all(k and "=" not in k and "\0" not in k + v for k, v in self.env),
            "names must be non-empty, without '='; no NUL characters")
    if self.data.seq_len > self.model.max_seq_len:
      fail(self, "data.seq_len", f"exceeds model.max_seq_len ({self.model.max_seq_len})",
           self.data.seq_len)

  @property
  def tokens_per_step(self) -> int:
    return self.data.global_batch_size * self.data.seq_len

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Experiment:
    """Inverse of to_dict (plain JSON: no Fiddle needed to read a run's experiment.json); the
    nested dicts become their configs as any dict given for a config field does."""
    return cls(**d)


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
