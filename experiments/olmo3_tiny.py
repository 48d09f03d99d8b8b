"""The OLMo 3 7B recipe shrunk to a laptop CPU: the embedded default. No download.

  python launch/main.py --fdl_config=experiments.olmo3_tiny:stage1   # ≈ 2 minutes on 2 cores
  python launch/main.py --fdl_config=experiments.olmo3_tiny:stage2   # anneals from stage 1
  python launch/diff.py experiments.olmo3_7b:stage2 experiments.olmo3_tiny:stage2

Each stage is the 7B's (experiments/olmo3_7b.py) passed through `laptop_stage`, so every
recipe choice there (optimizer, clipping, z-loss, schedule shape, seeds, step skipping, stage-2
initialisation) reaches the run that tests it. `laptop_stage` changes size fields
(`laptop_size`: model shape, batch and the loss's rank count, steps, schedule lengths,
cadences, LR scale), data fields (the embedded corpus, its held-out split and tokenizer,
zero-shot task variants, the documents scored per task) and, through `cpu`, the machine fields
a CPU needs (XLA attention instead of TPU splash, float32 compute, no remat, XLA:CPU flags
instead of TPU flags, no Grain worker processes).

The data order keeps the 7B's grain. AI2's scripts pass max_target_sequence_length =
max(8192, seq_len) (DataConfig.max_target_seq_len): at the 7B's 8192 tokens an epoch shuffles
single instances. At the tiny 256 tokens, 8192 would shuffle runs of 32 consecutive instances:
the embedded corpus (3,190,304 tokens in one file) would still give 12,448 instances (389 runs;
12,462 single ones), plenty for stage 1's 1,600, but each step of 16 would be half a run, 4096
consecutive tokens of the corpus, so a step would see one or two documents instead of 16
places of the corpus. `laptop_size` scales the target with the sequence (256, one instance),
so the tiny stages shuffle single instances as the 7B does.
"""

from __future__ import annotations

import fiddle as fdl

from experiments import olmo3_7b
from olmo3.config import AttentionKernel, DType, Experiment, Schedule, olmo3_tiny
from olmo3.remat import Remat
from olmo3.xla_flags import FLAG_SETS
from olmo3.run.record import workdir_of

# The tiny model's shape (2,902,144 parameters; an 8k BPE vocabulary trained on the corpus).
SIZE_FIELDS = ("vocab_size", "padded_vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
               "mlp_hidden", "sliding_window", "max_seq_len", "eos_token_id", "pad_token_id")
BATCH_DIVISOR = 32  # 512 -> 16 instances per step in stage 1, 256 -> 8 in stage 2
SEQ_LEN = 256  # the window (128) is half of it, as the 7B's 4096 of 8192
BASE_SEQ_LEN = 8192  # the 7B's stage 1-2 sequence, which SEQ_LEN stands for
# RULER at laptop size: the 7B's lengths scaled as the context is, from 1024 tokens (variable
# tracking's worked example of up to 500 tokens, common words' worked example and the 128-token
# answers of the needles leave a shorter length no room), one instance a task and length: one
# batch a length, so that evaluating stays a CPU's fifth of the tiny stage 3 (a model this
# small scores 0 at these lengths; benchmarks/ruler_learns.py shows one that learns).
RULER_SHORTEST, RULER_SAMPLES = 1024, 1
LR_SCALE = 10.0  # a 2.9M-parameter model takes a 10x larger learning rate
WARMUP_STEPS = 10  # for stages that warm up (the 7B's 2000 would be most of the run)
# OLMo's reading-comprehension suite, zero-shot (short contexts for a 256-token model).
TASKS = tuple(f"{t}_rc_0shot" for t in ("arc_easy", "arc_challenge", "boolq", "csqa", "hellaswag",
                                        "openbookqa", "piqa", "winogrande"))
# Documents scored per task at each evaluation: a machine setting, chosen with the cadence
# below so evaluation stays under a fifth of a laptop run's wall time (benchmarks/RESULTS.md,
# "The tiny run's evaluation share": 20 documents cost 13% of stage 1, and stage 2's two
# evaluations 21% of its shorter run even at 10).
TASK_LIMIT = 10


def cpu(cfg: fdl.Config[Experiment]) -> fdl.Config[Experiment]:
  """Fiddler: what a CPU needs of a TPU recipe: XLA attention (splash would run interpreted),
  float32 compute, no remat, XLA:CPU's flag set instead of libtpu's, batches read in the main
  process."""
  cfg.model.attention = AttentionKernel.XLA
  cfg.model.compute_dtype = DType.FLOAT32
  # The TPU policy recomputes activations to fit HBM; a CPU's memory is the host's, and the
  # recomputation only costs time (the tiny step: 5-8% of it).
  cfg.model.remat, cfg.model.remat_custom = Remat.NONE, ()
  cfg.xla_flags, cfg.libtpu_flags, cfg.env = FLAG_SETS["cpu"].xla, (), ()
  cfg.data.num_workers = 0
  return cfg


def laptop_stage(cfg: fdl.Config[Experiment], steps: int, init_from: str | None = None,
                 eval_every: int = 25) -> fdl.Config[Experiment]:
  """Fiddler: a 7B stage at laptop size (`laptop_size`), `steps` long, on the embedded corpus,
  evaluating the training data's held-out split (the embedded corpus's, or that of a prepared
  directory set as data.mix) and TASK_LIMIT documents of each TASKS task, tokenized with the
  data's tokenizer, every `eval_every` steps and at the last. The per-task sample and the
  cadence are sized for the CPU (evaluation under 20% of the run's wall time), not part of the
  recipe."""
  laptop_size(cfg, steps)
  if init_from is not None:
    cfg.checkpoint.init_from = init_from
  # The training data's own held-out split and tokenizer (olmo3.data.sources.resolve): the
  # embedded corpus's, or those of the directory --fdl_set=data.mix='"DIR"' names.
  cfg.eval.heldout, cfg.eval.tokenizer = None, None
  cfg.eval.batch_size, cfg.eval.max_documents = 16, 32
  cfg.eval.tasks, cfg.eval.task_limit = TASKS, TASK_LIMIT
  cfg.train.eval_every = eval_every
  return cfg


def laptop_size(cfg: fdl.Config[Experiment], steps: int = 50) -> fdl.Config[Experiment]:
  """Fiddler: a 7B stage's model, batch and schedule at laptop size, `steps` long, on the
  embedded corpus, keeping the stage's evaluation (held-out mixes, task list, cadence scaled
  with the run). The held-out mixes resolve against eval.heldout_root or data.root as usual and
  must hold tokens of the tiny tokenizer; tasks are prepared with eval.tokenizer. E.g.
  --fiddler='experiments.olmo3_tiny:laptop_size' --fdl_set=eval.tokenizer='"embedded"'
  --fdl_set=eval.heldout_root='"DIR"' --fdl_set=eval.task_limit=4."""
  tiny = olmo3_tiny()
  # Stage 3's context is 8x stages 1-2's (65,536 of 8192): the tiny one keeps the ratio.
  longer = cfg.data.seq_len // BASE_SEQ_LEN
  for field in SIZE_FIELDS:
    setattr(cfg.model, field, getattr(tiny, field))
  cfg.model.max_seq_len = tiny.max_seq_len * longer
  if cfg.model.rope_scaling is not None:  # YaRN extends the tiny stages' own context
    cfg.model.rope_scaling.original_context = tiny.max_seq_len
  if cfg.eval.position_band is not None:  # the bands stand for the same stretch of context
    cfg.eval.position_band = cfg.eval.position_band * SEQ_LEN // BASE_SEQ_LEN
  ruler = cfg.eval.ruler
  if isinstance(ruler, fdl.Config) and ruler.lengths:  # the same stretches of context, those
    # long enough for RULER's answers (128 tokens) beside a haystack, within the model's
    scaled = (n * SEQ_LEN // BASE_SEQ_LEN for n in ruler.lengths)
    ruler.lengths = tuple(n for n in scaled if RULER_SHORTEST <= n <= cfg.model.max_seq_len)
    ruler.samples, ruler.prefill_chunk = RULER_SAMPLES, SEQ_LEN * 2
  cfg.data.mix, cfg.data.root = "embedded", ""
  cfg.data.seq_len = SEQ_LEN * longer
  if cfg.data.max_target_seq_len is not None:  # the 7B's target is its sequence (see above)
    cfg.data.max_target_seq_len = SEQ_LEN * longer
  cfg.data.global_batch_size //= BATCH_DIVISOR
  # The loss's AI2 data-parallel ranks (512, 128, 32) become 2: the fewest that still average
  # per rank (stage 3's padded instances make each rank's token mean differ from the global
  # one), and a count that divides every even batch a tiny run is given. One where the 7B has 1.
  cfg.train.loss_ranks = min(2, cfg.train.loss_ranks)
  # A laptop's devices (one CPU, usually) all on fsdp: no context parallelism (stage 3's 8).
  cfg.mesh.shape = (("data", 1), ("fsdp", -1), ("sequence", 1), ("tensor", 1))
  # Schedule lengths keep their proportion to the stage; the learning rate scales with size.
  ratio = steps / cfg.train.steps
  opt = cfg.optimizer
  lengths = ("decay_steps",) + (("stitch_first_steps", "stitch_resumed_at", "stitch_second_steps")
                                if opt.schedule == Schedule.STITCHED_COSINE else ())
  for field in lengths:
    if getattr(opt, field) is not None:  # None: over the stage's epochs, as the 7B's
      setattr(opt, field, max(1, round(getattr(opt, field) * ratio)))
  opt.warmup_steps = WARMUP_STEPS if opt.warmup_steps else 0
  if opt.schedule == Schedule.STITCHED_COSINE:  # part 2 starts at part 1's midpoint, as AI2's
    opt.stitch_at = (opt.stitch_first_steps - 1) // 2 + opt.warmup_steps // 2
  # x LR_SCALE, printed without binary noise (3e-4 x 10 is 0.0029999999999999996 otherwise).
  opt.peak_lr = float(f"{opt.peak_lr * LR_SCALE:.15g}")
  opt.final_lr = float(f"{opt.final_lr * LR_SCALE:.15g}")
  cfg.train.steps = steps
  cfg.train.log_every, cfg.train.eval_every, cfg.checkpoint.every = 5, 25, 50
  cfg.eval.batch_size = 16
  return cpu(cfg)


def stage1() -> fdl.Config[Experiment]:
  """Stage 1: 16 x 256 tokens per step, 100 steps, peak LR 3e-3 after 10 warmup steps."""
  return laptop_stage(olmo3_7b.stage1(), steps=100)


def stage2() -> fdl.Config[Experiment]:
  """Stage 2: 8 x 256 tokens per step, 40 steps, LR 2.07e-3 linear to 0, initialised from
  stage 1's final checkpoint (parameters and moments). Evaluates at its end only: its 40 short
  steps take less time than an evaluation's fixed part (the programs' compiles)."""
  return laptop_stage(olmo3_7b.stage2(), steps=40, init_from=workdir_of(stage1),
                      eval_every=40)


def stage3() -> fdl.Config[Experiment]:
  """Stage 3: the long-context extension at 8x the tiny context (2048 tokens, YaRN over the
  tiny stages' 256), the embedded corpus's documents packed into instances with attention
  kept within each, 2 x 2048 tokens per step, 40 steps, LR 2.07e-3 after 10 warmup steps,
  linear to 0, initialised from the tiny stage 2's final checkpoint (parameters and moments).
  Evaluates at its end, on held-out documents of 1024 tokens or more, per band of 256
  positions (`python -m olmo3.eval --workdir runs/olmo3_tiny.stage2 --like
  runs/olmo3_tiny.stage3` scores stage 2's model the same way)."""
  cfg = laptop_stage(olmo3_7b.stage3(), steps=40, init_from=workdir_of(stage2), eval_every=40)
  # Held-out documents of 4x the tiny context or more (18 of the corpus's 31), scored to 2048
  # tokens: CE per band of 256 positions shows the loss beyond the context stage 2 trained at.
  cfg.eval.min_document_tokens = 4 * SEQ_LEN
  return cfg


# The stage after each, where it is not stage<n+1> (the launcher's closing summary names it).
NEXT_STAGE = {"stage3": "sft"}
# 32 // BATCH_DIVISOR would be 1 instance: too few for 2 ranks' token means, and the train
# loss the generalization-gap alarm reads too noisy (at 4 a step, logged every 5 steps, noise
# alone fired it at the last evaluation).
SFT_BATCH = 8


def sft() -> fdl.Config[Experiment]:
  """SFT: the 7B's Think SFT (olmo3_7b.sft_think) at laptop size, from the tiny stage 3's final
  checkpoint (parameters and moments), on the embedded chat corpus (questions about the
  standard library answered by its own docstrings, rendered with AI2's Think template and
  trained on the answers only): its 2 epochs of 8 x 1024 tokens a step, LR 5e-4 after a warmup
  of 3% of them, linear to 0, the loss averaged over 2 ranks' token means. Evaluates the
  corpus's held-out conversations (assistant tokens only) every 24 steps, a third of the run
  (the alarm looks two evaluations back, so it can fire at the last), the train loss logged at
  every step (the alarm compares its means between evaluations).

    python launch/main.py --fdl_config=experiments.olmo3_tiny:sft
    python -m olmo3.sample --workdir runs/olmo3_tiny.sft --chat --prompt 'What does json.dumps do?'
  """
  cfg = laptop_stage(olmo3_7b.sft_think(), steps=olmo3_7b.INT32_MAX,
                     init_from=workdir_of(stage3), eval_every=24)
  cfg.data.mix = "embedded_chat"
  cfg.data.global_batch_size = SFT_BATCH
  cfg.train.log_every = 1
  cfg.eval.tasks = ()  # AI2's SFT scores no tasks in the loop; the held-out answers are watched
  return cfg


def memorize() -> fdl.Config[Experiment]:
  """Stage 1 on a deliberately tiny slice (32 instances, 2 steps per epoch) repeated for 50
  epochs: train loss collapses while held-out loss stalls and rises, and the
  generalization-gap alarm must fire. Evaluates every 10 steps, held-out loss only."""
  cfg = stage1()
  cfg.data.max_instances = 32
  cfg.train.stop_at_epoch = None  # 50 epochs on purpose
  cfg.train.eval_every = 10
  cfg.eval.tasks = ()
  return cfg


def mfu_sweep() -> list[dict[str, object]]:
  """A CPU-sized sweep (12 variants): remat policy x batch x attention kernel. Compiled (memory)
  or timed in steady state (16 steps: 4 untimed, the compile among them, then 3 timed repeats
  of 4; ranked by their median tokens/s):
  python launch/sweep.py --fdl_config=experiments.olmo3_tiny:stage1
  --sweep=experiments.olmo3_tiny:mfu_sweep --compile_only=local --out sweeps/tiny
  python launch/sweep.py --fdl_config=experiments.olmo3_tiny:stage1
  --sweep=experiments.olmo3_tiny:mfu_sweep --steps 16 --out sweeps/tiny"""
  return [{"model.remat": remat, "data.global_batch_size": batch, "model.attention": kernel}
          for remat in ("none", "full", "minimal")
          for batch in (8, 16)
          for kernel in ("xla", "dot_product")]


def head_shape_sweep() -> list[dict[str, object]]:
  """The 7B's head-shape sweep (experiments.olmo3_7b:head_shape_sweep) at tiny size (6): 2 x 64,
  4 x 32 (the tiny model) and 8 x 16 heads x head_dim at d_model = 128, multi-head, each from
  two initialisation seeds (train.seed 0 and 1) to show the spread; data order as stage 1
  (data.seed 34521). Parameters and analytic FLOPs are the same for every shape; what ranks is
  quality: the embedded held-out CE (its 32 documents, the same for every variant) after the
  same budget, the whole tiny stage 1 (100 steps of 16 x 256 tokens, its schedule included).
  16 CPU-minutes (24 minutes on 2 cores shared with other jobs); results in
  benchmarks/sweeps/olmo3_tiny_head_shape/:
  python launch/sweep.py --fdl_config=experiments.olmo3_tiny:stage1
  --sweep=experiments.olmo3_tiny:head_shape_sweep --steps 100 --rank_by=heldout
  --out benchmarks/sweeps/olmo3_tiny_head_shape"""
  return [{"model.n_heads": heads, "model.n_kv_heads": heads, "train.seed": seed}
          for heads in (2, 4, 8) for seed in (0, 1)]
