"""Frozen configuration dataclasses. Every config validates itself at construction.

The model config owns its parameter count and its training FLOPs per token (the Levanter
convention: the numbers travel with the shape that defines them). Presets are plain functions.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from olmo3.remat import Remat, check_custom


class ConfigError(ValueError):
  """A configuration field holds an invalid value. The message names the field."""


class DType(enum.StrEnum):
  FLOAT32 = "float32"
  BFLOAT16 = "bfloat16"


class AttentionKernel(enum.StrEnum):
  """How attention is computed. All give the same function (tested against XLA)."""

  XLA = "xla"  # explicit masked einsum + softmax; runs everywhere; the reference.
  DOT_PRODUCT = "dot_product"  # jax.nn.dot_product_attention, letting JAX pick the backend.
  CUDNN = "cudnn"  # jax.nn.dot_product_attention(implementation="cudnn"): fused flash on GPU.
  SPLASH = "splash"  # Pallas splash attention (TPU; interpret mode elsewhere, slow).


def _coerce_enum(obj: Any, name: str, enum_type: type[enum.Enum]) -> None:
  """Accepts the enum or its string value (configs round-trip through JSON and CLI flags)."""
  value = getattr(obj, name)
  if isinstance(value, enum_type):
    return
  try:
    object.__setattr__(obj, name, enum_type(value))
  except ValueError:
    choices = ", ".join(repr(m.value) for m in enum_type)
    raise ConfigError(f"{type(obj).__name__}.{name}={value!r}: expected one of {choices}") from None


def _require(cond: bool, cls: str, field: str, value: Any, why: str) -> None:
  if not cond:
    raise ConfigError(f"{cls}.{field}={value!r}: {why}")


RESUMABLE = "resumable"  # field metadata: may change between runs in one workdir


def resumable(default: Any) -> Any:
  """A field that may change when a run resumes in the same workdir (a longer run, another
  cadence, another slice): the launcher accepts a changed value instead of refusing the
  workdir. Every other field must match the run's config.json."""
  return dataclasses.field(default=default, metadata={RESUMABLE: True})


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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The OLMo 3 transformer (docs/architecture.md). Defaults are OLMo 3 7B."""

  vocab_size: int = 100_278  # tokenizer vocabulary (dolma2)
  padded_vocab_size: int = 100_352  # embedding / LM-head rows, a multiple of 128
  d_model: int = 4096
  n_layers: int = 32
  n_heads: int = 32
  n_kv_heads: int = 32  # < n_heads: grouped-query attention
  mlp_hidden: int = 11_008
  sliding_window: int = 4096  # keys a sliding layer sees, the current one included
  global_every: int = 4  # layer i is global when i % global_every == global_every - 1; last is global
  rope_theta: float = 500_000.0
  norm_eps: float = 1e-6
  init_std: float = 0.02
  init_cutoff: float = 3.0  # truncation of the normal init, in standard deviations
  max_seq_len: int = 8192  # longest sequence trained on (stages 1-2); exported as max_position_embeddings
  eos_token_id: int | None = 100_257
  pad_token_id: int | None = 100_277
  compute_dtype: DType = DType.BFLOAT16  # parameters are always float32
  attention: AttentionKernel = AttentionKernel.XLA
  scan_layers: bool = True  # scan over groups of `global_every` layers; False unrolls (same outputs)
  remat: Remat = Remat.NONE
  remat_custom: tuple[tuple[str, str], ...] = ()  # Remat.CUSTOM: (checkpoint name, mode)

  def __post_init__(self) -> None:
    _coerce_enum(self, "compute_dtype", DType)
    _coerce_enum(self, "attention", AttentionKernel)
    _coerce_enum(self, "remat", Remat)
    object.__setattr__(self, "remat_custom", tuple(tuple(x) for x in self.remat_custom))
    c = type(self).__name__
    why = check_custom(self.remat_custom)
    _require(why is None, c, "remat_custom", self.remat_custom, str(why))
    for f in ("vocab_size", "padded_vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
              "mlp_hidden", "global_every", "max_seq_len"):
      v = getattr(self, f)
      _require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, c, f, v,
               "must be a positive integer")
    _require(self.sliding_window >= 1, c, "sliding_window", self.sliding_window,
             "the window must hold at least the current token (>= 1)")
    _require(self.padded_vocab_size >= self.vocab_size, c, "padded_vocab_size",
             self.padded_vocab_size, f"must be >= vocab_size ({self.vocab_size})")
    _require(self.d_model % self.n_heads == 0, c, "d_model", self.d_model,
             f"not divisible by n_heads ({self.n_heads})")
    _require(self.n_kv_heads <= self.n_heads and self.n_heads % self.n_kv_heads == 0, c,
             "n_kv_heads", self.n_kv_heads, f"must divide n_heads ({self.n_heads})")
    _require(self.head_dim % 2 == 0, c, "n_heads", self.n_heads,
             f"head_dim = d_model / n_heads = {self.head_dim} must be even for RoPE")
    _require(self.rope_theta > 0, c, "rope_theta", self.rope_theta, "must be > 0")
    _require(self.norm_eps > 0, c, "norm_eps", self.norm_eps, "must be > 0")
    _require(self.init_std > 0, c, "init_std", self.init_std, "must be > 0")
    _require(self.init_cutoff > 0, c, "init_cutoff", self.init_cutoff, "must be > 0")
    for f in ("eos_token_id", "pad_token_id"):
      v = getattr(self, f)
      _require(v is None or 0 <= v < self.vocab_size, c, f, v,
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
class RepetitionFilter:
  """Mask the labels of an instance holding a run of >= max_count repetitions of any period in
  [min_period, max_period] (OLMo-core's instance filter, docs/data.md#repetition-filter)."""

  max_period: int = 13
  min_period: int = 1
  max_count: int = 32

  def __post_init__(self) -> None:
    c = type(self).__name__
    _require(self.min_period >= 1, c, "min_period", self.min_period, "must be >= 1")
    _require(self.max_period >= self.min_period, c, "max_period", self.max_period,
             f"must be >= min_period ({self.min_period})")
    _require(self.max_count >= 3, c, "max_count", self.max_count,
             "must be >= 3 (shorter runs cannot be detected)")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where training tokens come from and in which order (OLMo-core's semantics, docs/data.md).

  Token files are given directly (`paths`) or by a mix file (`mix`: lines `label,path` with
  `{TOKENIZER}` in the path, as OLMo-core's mixes; a file path or the name of a mix that the
  installed ai2-olmo-core ships), resolved against `root` (a directory or an etils.epath URL
  such as gs://bucket/).
  """

  paths: tuple[str, ...] = ()
  mix: str | None = None
  root: str = ""
  tokenizer_id: str = "allenai/dolma3-tokenizer"  # substituted for {TOKENIZER} in mix paths
  seq_len: int = 8192
  global_batch_size: int = 512  # instances per step
  seed: int = 34521
  repetition_filter: RepetitionFilter | None = None  # off in the OLMo 3 7B recipe
  max_instances: int | None = None  # only the first N instances (memorisation experiments)
  validate_tokens: bool = True  # scan every token file at startup for ids >= vocab
  num_workers: int = resumable(0)  # Grain worker processes reading ahead (0: the main process)
  prefetch: int = resumable(2)  # steps buffered per worker

  def __post_init__(self) -> None:
    c = type(self).__name__
    object.__setattr__(self, "paths", tuple(self.paths))
    if isinstance(self.repetition_filter, dict):  # from JSON
      object.__setattr__(self, "repetition_filter", RepetitionFilter(**self.repetition_filter))
    _require(bool(self.paths) != bool(self.mix), c, "paths", self.paths,
             "give token files in exactly one of `paths` and `mix`")
    _require(self.seq_len >= 2, c, "seq_len", self.seq_len, "must be >= 2 (inputs and labels)")
    _require(self.global_batch_size >= 1, c, "global_batch_size", self.global_batch_size,
             "must be >= 1")
    _require(self.seed >= 0, c, "seed", self.seed, "must be >= 0")
    _require(self.num_workers >= 0, c, "num_workers", self.num_workers, "must be >= 0")
    _require(self.prefetch >= 1, c, "prefetch", self.prefetch, "must be >= 1")
    _require(self.max_instances is None or self.max_instances >= self.global_batch_size, c,
             "max_instances", self.max_instances,
             f"must hold at least one global batch ({self.global_batch_size})")

  def replace(self, **changes: Any) -> DataConfig:
    return dataclasses.replace(self, **changes)


class Schedule(enum.StrEnum):
  COSINE = "cosine"  # linear warmup, then one cosine from peak to final_lr over the stage
  LINEAR = "linear"  # linear warmup (possibly none), then linear from peak to final_lr
  STITCHED_COSINE = "stitched_cosine"  # AI2's stage-1 schedule: two cosines (docs/recipe.md)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with decoupled weight decay (p -= lr·wd·p) and global-norm clipping
  (docs/recipe.md#optimizer)."""

  peak_lr: float = 3e-4
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  no_decay: tuple[str, ...] = ("embed_tokens",)  # top-level parameter groups without decay
  clip_grad_norm: float = 1.0
  schedule: Schedule = Schedule.COSINE
  warmup_steps: int = 2000
  final_lr: float = 3e-5  # where the schedule ends (cosine, linear)
  # The schedule's length in steps. Independent of TrainConfig.steps, so limiting a run to N
  # steps (--fdl_set=train.steps=N) runs the first N steps of the same schedule.
  decay_steps: int = 1_413_814
  # STITCHED_COSINE only, AI2's stage 1 as its two official scripts ran it
  # (docs/recipe.md#learning-rate-schedules): part 1 is a cosine (warmup_steps, peak to final_lr)
  # aimed at stitch_first_steps; part 2 took over after the checkpoint of step stitch_resumed_at
  # with the second half of a cosine aimed at stitch_second_steps, which starts at stitch_at
  # and, before it, ramps linearly from 0 towards the midpoint LR (so it holds just below it).
  stitch_first_steps: int = 1_192_093
  stitch_resumed_at: int = 596_047
  stitch_at: int = 597_046
  stitch_second_steps: int = 1_668_931
  # Step skipping, as OLMo-core's SkipStepAdamW (docs/recipe.md#step-skipping): an update is
  # skipped when the CE loss or the pre-clip gradient norm exceeds the mean of the previous
  # spike_window steps' values (skipped steps included) by more than spike_sigma unbiased
  # standard deviations, once spike_min_history values (the current one included) exist.
  # Non-finite losses or gradients are always skipped and kept out of the window: they never
  # reach the parameters (OLMo-core would let one into its window).
  skip_spikes: bool = True
  spike_sigma: float = 6.0
  spike_window: int = 128
  spike_min_history: int = 64  # OLMo-core: max(2, spike_window // 2)

  def __post_init__(self) -> None:
    _coerce_enum(self, "schedule", Schedule)
    object.__setattr__(self, "no_decay", tuple(self.no_decay))
    c = type(self).__name__
    _require(self.peak_lr > 0, c, "peak_lr", self.peak_lr, "must be > 0")
    _require(0 <= self.final_lr <= self.peak_lr, c, "final_lr", self.final_lr,
             f"must be in [0, peak_lr={self.peak_lr}]")
    for f in ("b1", "b2"):
      _require(0 <= getattr(self, f) < 1, c, f, getattr(self, f), "must be in [0, 1)")
    _require(self.eps > 0, c, "eps", self.eps, "must be > 0")
    _require(self.weight_decay >= 0, c, "weight_decay", self.weight_decay, "must be >= 0")
    _require(self.clip_grad_norm > 0, c, "clip_grad_norm", self.clip_grad_norm, "must be > 0")
    _require(self.warmup_steps >= 0, c, "warmup_steps", self.warmup_steps, "must be >= 0")
    _require(2 <= self.spike_min_history <= self.spike_window + 1, c, "spike_min_history",
             self.spike_min_history, f"must be in [2, spike_window + 1={self.spike_window + 1}]")
    if self.schedule == Schedule.STITCHED_COSINE:
      _require(self.warmup_steps < self.stitch_resumed_at < self.stitch_first_steps, c,
               "stitch_resumed_at", self.stitch_resumed_at,
               f"must lie between warmup_steps ({self.warmup_steps}) and stitch_first_steps "
               f"({self.stitch_first_steps})")
      _require(self.stitch_resumed_at <= self.stitch_at < self.stitch_second_steps, c,
               "stitch_at", self.stitch_at, f"must be in [stitch_resumed_at, "
               f"stitch_second_steps={self.stitch_second_steps})")
    _require(self.decay_steps > self.warmup_steps, c, "decay_steps",
             self.decay_steps, f"must be > warmup_steps ({self.warmup_steps})")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes (one may be -1: fill the devices) and the logical-axis rules."""

  shape: tuple[tuple[str, int], ...] = resumable((("data", 1), ("fsdp", -1), ("tensor", 1)))
  rules: tuple[tuple[str, Any], ...] | None = None  # None: olmo3.sharding.FSDP_RULES
  # Multi-slice pods: the axes spanning slices over DCN, e.g. (("data", 4),); () = the slices
  # (if any) form the data axis. Each mesh axis is its `shape` size x its `dcn` size.
  dcn: tuple[tuple[str, int], ...] = resumable(())

  def __post_init__(self) -> None:
    object.__setattr__(self, "shape", tuple((str(a), int(n)) for a, n in dict(self.shape).items()))
    if self.rules is not None:  # JSON gives lists
      object.__setattr__(self, "rules", tuple(
          (str(n), tuple(m) if isinstance(m, list) else m) for n, m in self.rules))
    object.__setattr__(self, "dcn", tuple((str(a), int(n)) for a, n in dict(self.dcn).items()))
    _require(all(n >= 1 for _, n in self.dcn), type(self).__name__, "dcn", self.dcn,
             "sizes must be >= 1")
    sizes = [n for _, n in self.shape]
    _require(all(n == -1 or n >= 1 for n in sizes), type(self).__name__, "shape", self.shape,
             "sizes must be >= 1, or -1 for one axis")
    _require(sizes.count(-1) <= 1, type(self).__name__, "shape", self.shape,
             "at most one axis may be -1")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = resumable(1_413_814)
  seed: int = 0  # parameter initialisation
  z_loss_weight: float = 1e-5
  log_every: int = resumable(1)
  eval_every: int = resumable(1000)  # held-out evaluation every K steps (0: never); also at the end
  eval_batches: int | None = resumable(None)  # cap on held-out batches per evaluation (None: all)
  # End the stage when this epoch of its data ends, if that comes before `steps` (AI2's stage 1:
  # hard_stop = one epoch). None: `steps` alone decides.
  stop_at_epoch: int | None = None
  # Stop the run after this many skipped steps in a row (None: never, as AI2's runs).
  max_consecutive_skips: int | None = None
  # Gradient accumulation: each step's global batch runs as this many sequential microbatches
  # (same data, same update, 1/k of the activation memory). How a run resumed on a smaller
  # slice keeps its global batch and per-device memory.
  microbatches: int = resumable(1)

  def __post_init__(self) -> None:
    c = type(self).__name__
    _require(self.steps >= 1, c, "steps", self.steps, "must be >= 1")
    _require(self.log_every >= 1, c, "log_every", self.log_every, "must be >= 1")
    _require(self.eval_every >= 0, c, "eval_every", self.eval_every, "must be >= 0")
    _require(self.z_loss_weight >= 0, c, "z_loss_weight", self.z_loss_weight, "must be >= 0")
    _require(self.microbatches >= 1, c, "microbatches", self.microbatches, "must be >= 1")
    _require(self.stop_at_epoch is None or self.stop_at_epoch >= 1, c, "stop_at_epoch",
             self.stop_at_epoch, "must be None or >= 1")
    _require(self.max_consecutive_skips is None or self.max_consecutive_skips >= 1, c,
             "max_consecutive_skips", self.max_consecutive_skips, "must be None or >= 1")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints in WORKDIR/checkpoints; resume from the latest automatically."""

  every: int = resumable(1000)
  keep: int = resumable(3)
  async_save: bool = resumable(True)
  # Initialise from another run's checkpoint (a step directory, or a run's checkpoints
  # directory: its latest step): parameters and optimizer moments; step, schedule and data
  # position start fresh. Used when the workdir has no checkpoint of its own.
  init_from: str | None = None
  # A damaged latest checkpoint (missing or truncated files) is reported by name; with
  # fallback the run resumes from the previous one instead of stopping.
  fallback: bool = True

  def __post_init__(self) -> None:
    c = type(self).__name__
    _require(self.every >= 1, c, "every", self.every, "must be >= 1")
    _require(self.keep >= 1, c, "keep", self.keep, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Evaluation during training (and standalone, `python -m olmo3.eval`), as OLMo-core's
  in-loop evaluators (docs/evaluation.md).

  Held-out LM sets: mixes whose labels name the sets (one document per instance, as OLMo-core's
  NumpyPaddedFSLDataset), e.g. AI2's `v3-small-ppl-validation` (C4, Dolma sources, Pile, ...),
  read through the same mechanism as training data. Downstream tasks: ai2-olmo-eval labels (the
  `eval` extra), prepared with `tokenizer` and scored as OLMo-core does. The generalization-gap
  alarm compares train and held-out loss at each evaluation.
  """

  heldout: tuple[str, ...] = ()  # mixes (as DataConfig.mix); each label of a mix is one set
  heldout_root: str | None = None  # what heldout mix paths are relative to (None: data.root)
  # Substituted for {TOKENIZER} in held-out mix paths: AI2 stores its perplexity sets under
  # "dolma2-tokenizer" (the training mixes under "allenai/dolma3-tokenizer", the same tokenizer).
  heldout_tokenizer_id: str = "dolma2-tokenizer"
  batch_size: int = 8  # documents (or task requests) per evaluation batch (global)
  max_documents: int | None = None  # per held-out set (None: all)
  tasks: tuple[str, ...] = ()  # ai2-olmo-eval task labels, e.g. "arc_easy_rc_5shot"
  task_limit: int | None = None  # documents per task (None: all the task holds)
  tokenizer: str = "allenai/dolma2-tokenizer"  # tokenizer.json path, hub name, or "embedded"
  alarm_window: int = 2  # evaluations the alarm looks back
  alarm_margin: float = 0.05  # train-loss improvement (nats) that counts as improving
  stop_on_alarm: bool = False

  def __post_init__(self) -> None:
    object.__setattr__(self, "heldout", tuple(self.heldout))
    object.__setattr__(self, "tasks", tuple(self.tasks))
    c = type(self).__name__
    _require(all(isinstance(m, str) and m for m in self.heldout), c, "heldout", self.heldout,
             "each entry is a mix name or file, e.g. 'v3-small-ppl-validation'")
    _require(self.batch_size >= 1, c, "batch_size", self.batch_size, "must be >= 1")
    _require(self.max_documents is None or self.max_documents >= 1, c, "max_documents",
             self.max_documents, "must be >= 1 (or None: all)")
    _require(self.task_limit is None or self.task_limit >= 1, c, "task_limit", self.task_limit,
             "must be >= 1 (or None: all)")
    _require(self.alarm_window >= 1, c, "alarm_window", self.alarm_window, "must be >= 1")
    _require(self.alarm_margin > 0, c, "alarm_margin", self.alarm_margin, "must be > 0")
    for spec in self.tasks:
      _require(isinstance(spec, str) and spec and ":" not in spec, c, "tasks", self.tasks,
               "each task is an ai2-olmo-eval label, e.g. 'arc_easy_rc_5shot' "
               "(olmo_eval.list_tasks() lists them)")


@dataclasses.dataclass(frozen=True)
class Experiment:
  """Everything a run is: what Fiddle builds and the launcher runs."""

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(mix="OLMo-mix-0625-official"))
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  xla_flags: tuple[str, ...] = ()  # appended to XLA_FLAGS before JAX starts
  libtpu_flags: tuple[str, ...] = ()  # appended to LIBTPU_INIT_ARGS before JAX starts
  env: tuple[tuple[str, str], ...] = ()  # environment variables set before JAX starts

  def __post_init__(self) -> None:
    object.__setattr__(self, "xla_flags", tuple(self.xla_flags))
    object.__setattr__(self, "libtpu_flags", tuple(self.libtpu_flags))
    object.__setattr__(self, "env", tuple((str(k), str(v)) for k, v in self.env))
    _require(self.data.seq_len <= self.model.max_seq_len, "Experiment", "data.seq_len",
             self.data.seq_len, f"exceeds model.max_seq_len ({self.model.max_seq_len})")

  @property
  def tokens_per_step(self) -> int:
    return self.data.global_batch_size * self.data.seq_len

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Experiment:
    """Inverse of to_dict (plain JSON: no Fiddle needed to read a run's experiment.json)."""
    parts = {"model": ModelConfig, "data": DataConfig, "mesh": MeshConfig,
             "optimizer": OptimizerConfig, "train": TrainConfig, "checkpoint": CheckpointConfig,
             "eval": EvalConfig}
    fields = {k: (parts[k](**v) if k in parts else v) for k, v in d.items()}
    return cls(**fields)


# --- presets -----------------------------------------------------------------------------------


def olmo3_7b() -> ModelConfig:
  """OLMo 3 7B, stages 1-2 (docs/architecture.md)."""
  return ModelConfig()


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


PRESETS = {"olmo3_7b": olmo3_7b, "olmo3_32b": olmo3_32b, "olmo3_tiny": olmo3_tiny,
           "olmo3_micro": olmo3_micro}
