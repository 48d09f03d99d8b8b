"""How a run trains: the optimizer (AdamW, schedules, step skipping), the mesh, the loop's
cadences and the checkpoints (`init_from`, `init_mode`)."""

from __future__ import annotations

import dataclasses
import enum

from olmo3.config_checks import Validated, bounded, fail, nonempty, require, resumable
from olmo3.config.model import INT32_MAX

SEED_MAX = 2**63 - 1  # jax.random keys take a seed that fits int64


class Schedule(enum.StrEnum):
  COSINE = "cosine"  # linear warmup, then one cosine from peak to final_lr over the stage
  LINEAR = "linear"  # linear warmup (possibly none), then linear from peak to final_lr
  STITCHED_COSINE = "stitched_cosine"  # AI2's stage-1 schedule: two cosines (docs/recipe.md)


class SpikeWindowOnRestart(enum.StrEnum):
  """What a restart (a resume, or init_mode continue) does to the step-skipping window."""

  KEEP = "keep"  # restored from the checkpoint: the run skips as if it had never stopped
  EMPTY = "empty"  # emptied, as OLMo-core's SkipStepAdamW (which saves none) after AI2's restarts


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
  # The warmup as a fraction of the schedule's length instead (OLMo-core's LinearWithWarmup
  # (warmup_fraction): round(fraction x length) steps, worked out when the run is planned;
  # warmup_steps must then be 0). AI2's SFT warms up over 3% of its 2 epochs.
  warmup_fraction: float | None = bounded(None, ge=0, lt=1)
  final_lr: float = bounded(3e-5, ge=0)  # where the schedule ends (cosine, linear); <= peak_lr
  # The schedule's length in steps. Independent of TrainConfig.steps, so limiting a run to N
  # steps (--fdl_set=train.steps=N) runs the first N steps of the same schedule. None: the
  # stage's length, TrainConfig.stop_at_epoch epochs of its data (OLMo-core's t_max for a
  # duration in epochs), worked out when the run is planned (olmo3.run.plan).
  decay_steps: int | None = bounded(1_413_814, ge=1, le=INT32_MAX)
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
  # Read at each restart, hence resumable. EMPTY: no spike is skipped until spike_min_history
  # steps after it (docs/recipe.md#restarts).
  spike_window_on_restart: SpikeWindowOnRestart = resumable(SpikeWindowOnRestart.KEEP)

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
    if self.decay_steps is not None:
      require(self, "decay_steps", self.decay_steps > self.warmup_steps,
              f"must be > warmup_steps ({self.warmup_steps})")
    if self.warmup_fraction is not None:
      require(self, "warmup_steps", self.warmup_steps == 0,
              f"must be 0 with warmup_fraction={self.warmup_fraction} (the warmup is that "
              "fraction of the schedule)")
      require(self, "schedule", self.schedule is not Schedule.STITCHED_COSINE,
              "has fixed lengths: warmup_fraction is for cosine and linear schedules")
    require(self, "decay_steps",
            self.decay_steps is not None or self.schedule is not Schedule.STITCHED_COSINE,
            "must be given for the stitched cosine")


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


class LossMean(enum.StrEnum):
  """How the training loss averages the cross-entropy (and z-loss) over the global batch's
  trained labels (docs/recipe.md#the-loss-mean-over-data-parallel-ranks)."""

  # OLMo-core's TransformerTrainModule: each data-parallel rank divides its summed loss by its
  # own count of trained labels, and the gradients are averaged over the ranks: the mean over
  # TrainConfig.loss_ranks ranks of each rank's token mean. Row i of the global batch is rank
  # i % loss_ranks's (OLMo-core's loader deals each global batch out strided).
  PER_RANK = "per_rank"
  GLOBAL = "global"  # one token mean over the whole global batch (loss_ranks unused)


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
  # The loss's mean (LossMean) and AI2's data-parallel rank count it averages over: a recipe
  # number, not the mesh's, so a run's loss is AI2's whatever devices it runs on. It must divide
  # data.global_batch_size. 1: one rank, the global token mean. AI2's 7B: 512 in stage 1,
  # 128 in stage 2, 32 in stage 3 (experiments/olmo3_7b.py). Neither may change on resume: they
  # change the loss and so the run.
  loss_mean: LossMean = LossMean.PER_RANK
  loss_ranks: int = bounded(1, ge=1)


class InitMode(enum.StrEnum):
  """What `checkpoint.init_from` carries into a run: AI2's two ways of starting from a
  checkpoint (OLMo-core's `load_trainer_state`)."""

  # Parameters and optimizer moments (with Adam's count: its bias correction goes on); step,
  # learning-rate schedule, data position and step-skip window start from 0. A new stage, as
  # AI2 started midtraining from stage 1's end (load_trainer_state=False).
  NEW_STAGE = "new_stage"
  # Also the step (the schedule resumes where the checkpoint's run was), the data position (the
  # next batch is the one that run would have trained on next) and the step-skip window as
  # OptimizerConfig.spike_window_on_restart says: the same stage continued, on the same data,
  # sequence length and global batch (load_trainer_state=True).
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
