"""OLMo 3 7B, as AI2 trained it: stage 1 pretraining, stage 2 midtraining anneal and stage 3
long-context extension.

Numbers from AI2's OLMo 3 release and OLMo-core's OLMo 3 7B scripts
(src/scripts/official/OLMo3/OLMo-3-1025-7B-*.py); docs/recipe.md lists each with its source.

  python launch/main.py --fdl_config=experiments.olmo3_7b:stage1 --dry_run
  python launch/main.py --fdl_config=experiments.olmo3_7b:stage1 --workdir=gs://bucket/olmo3-7b-s1
  python launch/main.py --fdl_config=experiments.olmo3_7b:stage2 \\
      --fdl_set=checkpoint.init_from='"gs://bucket/olmo3-7b-s1"'
  python launch/main.py --fdl_config=experiments.olmo3_7b:stage3 \\
      --fdl_set=checkpoint.init_from='"gs://bucket/olmo3-7b-s2"'
  python launch/main.py --fdl_config=experiments.olmo3_7b:stage1 --fiddler=single_cosine

Data: `data.root` must point at AI2's preprocessed token files (the mix lists paths relative
to it; olmo3 ships AI2's mix lists, olmo3/data/mixes.py): AI2's public host, as OLMo-core reads
it by default (`--fdl_set=data.root='"http://olmo-data.org"'`), or a copy in a bucket or on disk.
"""

from __future__ import annotations

import fiddle as fdl

from experiments.common import as_config
from olmo3.config import (INT32_MAX, AttentionKernel, CheckpointConfig, DataConfig, DType,
                          EvalConfig, Experiment, LongDocuments, LossMean, MeshConfig,
                          OptimizerConfig, Packing, Remat, RopePositions, RulerConfig,
                          ScaledLayers, Schedule, TrainConfig, Yarn, olmo3_7b)
from olmo3.xla_flags import FLAG_SETS
from olmo3.remat import Mode, Name
from olmo3.run.record import workdir_of

STAGE1_STEPS = 1_413_814  # one epoch of the Dolma 3 mix at 512 x 8192 tokens (≈ 5.93T tokens)
STAGE2_STEPS = 47_684  # ceil(100e9 / (256 x 8192)): the midtraining script's 100B-token duration
# ceil(50e9 / (64 x 65,536)): stage 3's 50B tokens (AI2's README; the checkpoint list's last
# stage-3 step is 11921). The official long-context script's max_duration (5e12 tokens) and
# hard_stop (597,046 steps) are the pretraining script's, copied (docs/recipe.md#stage-3).
STAGE3_STEPS = 11_921
# AI2's stage 1 ran as two scripts (OLMo-3-1025-7B-pretrain-1.py, -2.py), each with its own
# schedule. Part 1: CosWithWarmup(warmup 2000) over max_duration = 5e12 tokens, so its cosine aims
# at ceil(5e12 / 4,194,304) = 1,192,093 steps. Part 2 loaded part 1's step-596,047 checkpoint and
# ran HalfCosWithWarmup(warmup = 1,192,092 // 2 + 2000 // 2 = 597,046) over 7e12 tokens:
# ceil(7e12 / 4,194,304) = 1,668,931 steps. The epoch (hard_stop) ends first.
STITCH = dict(stitch_first_steps=1_192_093, stitch_resumed_at=596_047, stitch_at=597_046,
              stitch_second_steps=1_668_931)
# OLMo-3-1025-7B-pretrain-1.py's downstream evaluator: its "fast" task set (ai2-olmo-eval labels).
FAST_TASKS = tuple(sorted((
    # a subset of OLMES
    "arc_challenge_test_bpb_5shot", "arc_challenge_test_mc_5shot_fast", "arc_easy_test_bpb_5shot",
    "arc_easy_test_mc_5shot_fast", "hellaswag_bpb_5shot", "mmlu_humanities_test_bpb_5shot",
    "mmlu_humanities_test_mc_5shot_fast", "mmlu_other_test_bpb_5shot",
    "mmlu_other_test_mc_5shot_fast", "mmlu_social_sciences_test_bpb_5shot",
    "mmlu_social_sciences_test_mc_5shot_fast", "mmlu_stem_test_bpb_5shot",
    "mmlu_stem_test_mc_5shot_fast",
    # basic skills
    "basic_skills_arithmetic_rc_5shot", "basic_skills_coding_rc_5shot",
    "basic_skills_common_knowledge_rc_5shot", "basic_skills_logical_reasoning_rc_5shot",
    "basic_skills_pattern_rc_5shot", "basic_skills_string_operations_rc_5shot",
    # generation tasks scored by the gold answer's bits per byte
    "codex_humaneval_gold_bpb_3shot", "codex_mbpp_gold_bpb_3shot", "minerva_math_500_gold_bpb_0shot",
    "mt_mbpp_cpp_gold_bpb_3shot", "mt_mbpp_java_gold_bpb_3shot", "mt_mbpp_rust_gold_bpb_3shot",
    # a sanity check of multiple-choice ability
    "copycolors_10way_fast",
)))
# The Ironwood run's remat: keep every named activation on the device but the MLP
# up-projection, which is recomputed (docs/performance.md#remat).
IRONWOOD_REMAT = tuple((name.value, (Mode.REMAT if name is Name.MLPWI_1 else Mode.DEVICE).value)
                       for name in Name)


def stage1() -> fdl.Config[Experiment]:
  """Stage 1 pretraining: Dolma 3 mix (OLMo-mix-0625-official, 1016 token files), seed 34521,
  512 instances x 8192 tokens per step, AdamW (0.9, 0.95, eps 1e-8, wd 0.1, none on the input
  embedding), clip 1.0, z-loss 1e-5, peak LR 3e-4 with 2000 warmup steps and AI2's stitched
  schedule (see STITCH; `single_cosine` is the TPU reproduction's variant), step skipping as
  SkipStepAdamW and no abort on consecutive skips. bfloat16 compute, float32 parameters and
  optimizer state; pure FSDP. Evaluates as AI2's pretraining script: held-out perplexity on
  v3-small-ppl-validation and the "fast" downstream set (FAST_TASKS) every 10,000 steps."""
  return as_config(Experiment(
      # Splash attention (TPU) and the Ironwood run's remat. On GPUs: --fiddler=gpu.
      model=olmo3_7b().replace(compute_dtype=DType.BFLOAT16, attention=AttentionKernel.SPLASH,
                               remat=Remat.CUSTOM, remat_custom=IRONWOOD_REMAT),
      # Every OLMo 3 script passes max_target_sequence_length=max(8192, seq_len): at 8192 an
      # epoch shuffles single instances.
      data=DataConfig(mix="OLMo-mix-0625-official", root="", seq_len=8192,
                      max_target_seq_len=8192, global_batch_size=512, seed=34521,
                      validate_tokens=False, num_workers=2),
      mesh=MeshConfig(shape=(("data", 1), ("fsdp", -1), ("sequence", 1), ("tensor", 1))),
      optimizer=OptimizerConfig(peak_lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                no_decay=("embed_tokens",), clip_grad_norm=1.0,
                                schedule=Schedule.STITCHED_COSINE, warmup_steps=2000,
                                final_lr=3e-5, decay_steps=STAGE1_STEPS, **STITCH,
                                skip_spikes=True, spike_sigma=6.0, spike_window=128,
                                spike_min_history=64),
      # AI2's stage 1 stops at the end of the first epoch (hard_stop); STAGE1_STEPS is that
      # epoch for the official files, and a run on other files says so at startup.
      # The loss as OLMo-core's train module takes it: each data-parallel rank's token mean,
      # averaged over AI2's ranks (docs/recipe.md#the-loss-mean-over-data-parallel-ranks):
      # 512 H100 without context parallelism, one instance each.
      train=TrainConfig(steps=STAGE1_STEPS, seed=0, z_loss_weight=1e-5, log_every=10,
                        eval_every=10_000, stop_at_epoch=1, max_consecutive_skips=None,
                        loss_mean=LossMean.PER_RANK, loss_ranks=512),
      checkpoint=CheckpointConfig(every=1000, keep=3, async_save=True, init_from=None),
      libtpu_flags=FLAG_SETS["tpu7x"].libtpu,
      # AI2's in-loop evaluation, every 10,000 steps: the v3-small perplexity sets (11 held-out
      # sets, C4 en among them; data.root must hold eval-data/perplexity/ as AI2's bucket does)
      # and the "fast" downstream task set, at batches as large as training's.
      eval=EvalConfig(heldout=("v3-small-ppl-validation",),
                      heldout_tokenizer_id="dolma2-tokenizer", batch_size=512, tasks=FAST_TASKS,
                      tokenizer="allenai/dolma2-tokenizer"),
  ))


def stage2() -> fdl.Config[Experiment]:
  """Stage 2 midtraining anneal: stage 1 with the Dolmino mix (OLMo-midtraining-mix-0625-100B,
  11,933 files), seed 1337, 256 instances per step, peak LR 2.0712352850360292e-4 (the value in
  AI2's OLMo-3-1025-7B-midtrain.py; it equals part 1's cosine at update 476,838, not the LR where
  stage 1 ended) linear to 0 over 47,684 steps without warmup (LinearWithWarmup(warmup=0,
  alpha_f=0)), initialised from stage 1's final checkpoint: parameters and AdamW moments; step,
  schedule and data position reset. AI2's midtraining script evaluates nothing in the loop; this
  keeps stage 1's evaluation, so the anneal is watched too (eval.tasks=() turns it off)."""
  cfg = stage1()
  cfg.data.mix = "OLMo-midtraining-mix-0625-100B"
  cfg.data.seed = 1337
  cfg.data.global_batch_size = 256
  cfg.optimizer.peak_lr = 2.0712352850360292e-4
  cfg.optimizer.schedule = Schedule.LINEAR
  cfg.optimizer.warmup_steps = 0
  cfg.optimizer.final_lr = 0.0
  cfg.optimizer.decay_steps = STAGE2_STEPS
  cfg.train.steps = STAGE2_STEPS
  cfg.train.stop_at_epoch = None  # the midtraining script stops at its 100B tokens only
  cfg.train.loss_ranks = 128  # AI2's 128 H100, two instances each
  cfg.checkpoint.init_from = workdir_of(stage1)  # runs/olmo3_7b.stage1
  return cfg


# RULER's lengths for the long-context model: those of AI2's reported scores for OLMo 3 7B
# (Olmo Hybrid paper, Table 3), which the evaluation shows beside the run's.
RULER_LENGTHS = (4096, 8192, 16384, 32768, 65536)


def stage3() -> fdl.Config[Experiment]:
  """Stage 3 long-context extension to 65,536 tokens (OLMo-3-1025-7B-long-context.py, run with
  ai2-olmo-core 2.4.0): stage 2 with YaRN RoPE scaling (factor 8, beta_fast 32, beta_slow 1,
  original context 8192) on the full-attention layers only, the longmino mix
  (OLMo-longmino-mix-0625, 998 files) packed into 65,536-token instances (best-fit decreasing
  over groups of 8 files shuffled with seed 123, long documents truncated, attention within
  each document, RoPE positions 0..65,535 across the instance as OLMo-core 2.4.0 ran it), 64
  instances per step (4,194,304 tokens), data seed 34521, peak LR 2.0712352850360292e-4 after
  200 warmup steps, linear to 0 over STAGE3_STEPS (50B tokens), initialised from stage 2's
  final checkpoint: parameters and AdamW moments, step and schedule reset
  (load_trainer_state=False, load_optim_state=True). AI2's script evaluates nothing in the
  loop; this keeps the held-out perplexity sets (64 documents a batch, their CE also per band
  of 8192 positions), so the extension is watched.

  Context parallelism of 8, as AI2's (OLMo-core's TransformerContextParallelConfig.llama3,
  degree 8): each 65,536-token sequence split over 8 devices of the `sequence` axis, each
  holding 2 of 16 chunks (zig-zag: causal attention costs each the same), keys and values
  gathered whole on the global layers, and on the sliding ones only the chunk before each of
  a device's own (its 4,096-token chunk is the window), all kept for the backward pass (the
  custom remat keeps `gathered_kv`); fsdp takes the rest (64 on tpu7x:4x8x8's 512 devices: one
  sequence each); weights over fsdp x sequence. On tpu7x:4x8x8: 47.5 GB a device, 6.61 MB of
  collectives a token (1.42x stage 1). `--fdl_set=model.context_parallel='all_to_all'` swaps
  sequence for heads instead (Ulysses: 39.7 GB, 6.74 MB a token, 1.45x).
  docs/performance.md#context-parallelism, benchmarks/RESULTS.md ("What stage 3 moves between
  devices", the cp_sweep)."""
  cfg = stage2()
  cfg.mesh.shape = (("data", 1), ("fsdp", -1), ("sequence", 8), ("tensor", 1))
  cfg.model.rope_scaling = fdl.Config(Yarn, factor=8.0, beta_fast=32.0, beta_slow=1.0,
                                      original_context=8192, layers=ScaledLayers.FULL_ATTENTION)
  cfg.model.rope_positions = RopePositions.INSTANCE
  cfg.model.max_seq_len = 65_536
  cfg.data.mix = "OLMo-longmino-mix-0625"
  cfg.data.seq_len = 65_536
  cfg.data.max_target_seq_len = None  # packed instances are shuffled one by one
  cfg.data.packing = fdl.Config(Packing, source_group_size=8, source_permutation_seed=123,
                                long_documents=LongDocuments.TRUNCATE)
  cfg.data.seed = 34521
  cfg.data.global_batch_size = 64
  cfg.optimizer.warmup_steps = 200
  cfg.optimizer.decay_steps = STAGE3_STEPS
  cfg.train.steps = STAGE3_STEPS
  # AI2's 256 H100 with context parallelism of degree 8 (OLMo-3-1025-7B-long-context.py:
  # TransformerContextParallelConfig.llama3(degree=8, head_stride=4)): 32 data-parallel ranks,
  # each 8 GPUs sharing 2 instances; OLMo-core counts a rank's labels before the sequence is
  # split, so the loss is the mean of 32 token means of 2 instances.
  cfg.train.loss_ranks = 32
  cfg.eval.batch_size = 64
  cfg.eval.position_band = 8192  # held-out CE per 8192 positions: within and beyond stage 2's
  cfg.eval.ruler = fdl.Config(RulerConfig, lengths=RULER_LENGTHS)
  cfg.checkpoint.init_from = workdir_of(stage2)  # runs/olmo3_7b.stage2
  return cfg


# The stage after each, where it is not stage<n+1> (the launcher's closing summary names it).
NEXT_STAGE = {"stage3": "sft_think", "sft_think": "sft_instruct"}
SFT_SEQ_LEN = 32_768  # AI2's SFT sequence (open-instruct scripts/train/olmo3/7b_*_sft.sh)


def sft_think() -> fdl.Config[Experiment]:
  """Supervised fine-tuning into OLMo 3 7B Think, as AI2 ran it with OLMo-core (commit 38f66526c,
  src/scripts/train/sft/OLMo2-7B-sft.py; settings from open-instruct's
  scripts/train/olmo3/7b_think_sft.sh; docs/recipe.md#sft): the stage-3 model (YaRN on the
  full-attention layers) initialised from stage 3's final checkpoint, parameters and AdamW
  moments (the moments when the checkpoint has them; step, schedule and data position reset:
  load_trainer_state=False); conversations tokenized with AI2's Think template (`olmo3_think`)
  and trained on the assistant's tokens only; 32 instances of 32,768 tokens a step (1,048,576),
  packed by best-fit decreasing with attention within each conversation and long ones
  truncated (NumpyPackedFSLDataset, generate_doc_lengths=True, one file a group, files in
  order), loader seed 34521; 2 epochs; SkipStepAdamW betas (0.9, 0.95), weight decay 0, clip
  1.0, peak LR 5e-5, linear warmup over 3% of the steps then linear to 0
  (LinearWithWarmup(warmup_fraction=0.03, alpha_f=0)); no z-loss; the loss each data-parallel
  rank's token mean, averaged over AI2's 32 ranks (64 H100, context parallelism 2); context
  parallelism 2 here too. AI2's SFT script evaluates nothing in the loop; this evaluates the
  data's held-out conversations (assistant tokens only) every 1000 steps, with the
  generalization-gap alarm.

  AI2's tokenized SFT data is gone (open-instruct issue 1888); its source is the released
  Dolci Think SFT mix (JSONL conversations). Prepare it (or your own) first:

    python -m olmo3.data.prepare --chat --input 'dolci-think-sft/*.jsonl' \
        --tokenizer allenai/dolma2-tokenizer --chat_template olmo3_think --out data/olmo3-think-sft
    python launch/main.py --fdl_config=experiments.olmo3_7b:sft_think --dry_run
  """
  cfg = stage3()
  cfg.mesh.shape = (("data", 1), ("fsdp", -1), ("sequence", 2), ("tensor", 1))
  cfg.data.mix, cfg.data.root = "data/olmo3-think-sft", ""
  cfg.data.chat_template = "olmo3_think"
  cfg.data.seq_len = SFT_SEQ_LEN
  cfg.data.global_batch_size = 32
  cfg.data.seed = 34521
  cfg.data.packing = fdl.Config(Packing, source_group_size=1, source_permutation_seed=None,
                                long_documents=LongDocuments.TRUNCATE)
  opt = cfg.optimizer
  opt.peak_lr, opt.weight_decay, opt.final_lr = 5e-5, 0.0, 0.0
  opt.schedule, opt.warmup_steps, opt.warmup_fraction = Schedule.LINEAR, 0, 0.03
  opt.decay_steps = None  # over the stage: its 2 epochs
  cfg.train.steps = INT32_MAX  # the stage ends with its second epoch
  cfg.train.stop_at_epoch = 2
  cfg.train.z_loss_weight = 0.0  # z_loss_multiplier=None in AI2's SFT scripts
  cfg.train.seed = 53184  # OLMo-core's init seed at 38f66526c (unused: the run starts from stage 3)
  # 64 H100 with context parallelism 2: 32 data-parallel ranks of one instance each.
  cfg.train.loss_ranks = 32
  cfg.train.eval_every = 1000
  cfg.eval.heldout, cfg.eval.tokenizer, cfg.eval.tasks = None, None, ()
  cfg.eval.position_band = None
  cfg.eval.batch_size = 32
  cfg.checkpoint.init_from = workdir_of(stage3)  # runs/olmo3_7b.stage3
  return cfg


def sft_instruct() -> fdl.Config[Experiment]:
  """Supervised fine-tuning into OLMo 3 7B Instruct (OLMo-core commit 9e9747105,
  src/scripts/train/sft/OLMo-sft.py; open-instruct's 7b_instruct_sft.sh): the Think SFT's
  recipe from the Think SFT's final checkpoint (parameters and moments), on conversations
  tokenized with the chat template of AI2's tokenizer allenai/olmo-3-tokenizer-instruct-dev
  (the tokenizer's own: `prepare --chat --chat_template tokenizer`), peak LR 8e-5, the loss
  averaged over AI2's 16 data-parallel ranks (32 H100, context parallelism 2, two instances
  each), init seed 543210. AI2's run read its data from gs://, where that commit's script took
  the token files for label masks (docs/recipe.md#sft); olmo3 pairs each mask with its file.

    python -m olmo3.data.prepare --chat --input 'dolci-instruct-sft/*.jsonl' \
        --tokenizer allenai/olmo-3-tokenizer-instruct-dev --chat_template tokenizer \
        --out data/olmo3-instruct-sft
  """
  cfg = sft_think()
  cfg.data.mix = "data/olmo3-instruct-sft"
  cfg.data.chat_template = None  # the tokenizer's own: the directory's manifest records it
  cfg.optimizer.peak_lr = 8e-5
  cfg.train.seed = 543210
  cfg.train.loss_ranks = 16
  cfg.checkpoint.init_from = workdir_of(sft_think)  # runs/olmo3_7b.sft_think
  return cfg


def single_cosine(cfg: fdl.Config[Experiment]) -> fdl.Config[Experiment]:
  """Fiddler: one cosine from 3e-4 to 3e-5 over the whole stage instead of AI2's stitched
  schedule: the public TPU reproduction's variant (it matched AI2's results; its LR is x1.20
  AI2's at step 597k, x0.74 at 1.2M, and ends at 3e-5 instead of ≈ 3.93e-5)."""
  cfg.optimizer.schedule = Schedule.COSINE
  cfg.optimizer.decay_steps = cfg.train.steps
  return cfg


def flag_set(cfg: fdl.Config[Experiment], name: str = "tpu7x") -> fdl.Config[Experiment]:
  """Fiddler: a compiler flag set from olmo3.xla_flags (tpu7x, v5p, v6e, gpu_hopper), e.g.
  --fiddler='flag_set(name="tpu7x")'. The tpu7x set took the TPU reproduction from 27% to 44.5%
  MFU (SparseCore collective offload)."""
  flags = FLAG_SETS[name]
  cfg.xla_flags, cfg.libtpu_flags, cfg.env = flags.xla, flags.libtpu, flags.env
  return cfg


def gpu(cfg: fdl.Config[Experiment]) -> fdl.Config[Experiment]:
  """Fiddler: H100/H200 clusters — cuDNN flash attention with the window, the Hopper XLA flag
  set, no TPU flags."""
  cfg.model.attention = AttentionKernel.CUDNN
  return flag_set(cfg, "gpu_hopper")


def mfu_sweep() -> list[dict[str, object]]:
  """MFU-tuning variants as data (12): remat policy (the Ironwood run's custom policy, full,
  minimal) x per-device batch (1 or 2 sequences on 512 devices) x the tpu7x flag set (SparseCore
  collective offload; without it the reproduction ran at 27% MFU instead of 44.5%). Splash
  attention throughout: XLA attention materialises 8192 x 8192 scores per head. Each variant
  compiles in its own process, so its flag set takes effect. Run:
  python launch/sweep.py --fdl_config=experiments.olmo3_7b:stage1
  --sweep=experiments.olmo3_7b:mfu_sweep --compile_only=tpu7x:4x8x8 --out sweeps/7b"""
  return [{"model.remat": remat, "data.global_batch_size": batch,
           "libtpu_flags": FLAG_SETS["tpu7x"].libtpu if offload else ()}
          for remat in ("custom", "full", "minimal")
          for batch in (512, 1024)
          for offload in (True, False)]


def cp_sweep() -> list[dict[str, object]]:
  """Stage 3's layout on 512 devices (7 variants): the sequence split 8 ways (AI2's degree,
  fsdp 64: one sequence per data-parallel group), 16 ways (fsdp 32: two sequences a group), or
  4 ways with the heads over 2 (tensor 2, fsdp 64); keys and values gathered (AI2's strategy)
  or the sequence swapped for heads (all-to-all, at 8 and 16 ways: 32 heads divide); the
  Ironwood run's remat or full remat; and splash's block at 512 or 1024 (its tile, and the
  granularity at which it skips the blocks the causal mask leaves empty). Ranked by the MFU
  ceiling of each variant's step-time bound where it fits, compile-only:
  python launch/sweep.py --fdl_config=experiments.olmo3_7b:stage3
  --sweep=experiments.olmo3_7b:cp_sweep --compile_only=tpu7x:4x8x8
  --out benchmarks/sweeps/olmo3_7b_stage3_tpu7x_4x8x8"""
  def mesh(sequence: int, tensor: int = 1) -> tuple[tuple[str, int], ...]:
    return (("data", 1), ("fsdp", -1), ("sequence", sequence), ("tensor", tensor))

  a2a = {"model.context_parallel": "all_to_all"}
  return [{"mesh.shape": mesh(8), "model.remat": "custom"},
          {"mesh.shape": mesh(8), "model.remat": "full"},
          {"mesh.shape": mesh(16), "model.remat": "custom"},
          {"mesh.shape": mesh(4, tensor=2), "model.remat": "custom"},
          {"mesh.shape": mesh(8), "model.remat": "custom", "model.splash_block": 1024},
          {"mesh.shape": mesh(8), "model.remat": "custom", **a2a},
          {"mesh.shape": mesh(16), "model.remat": "custom", **a2a}]


def head_shape_sweep() -> list[dict[str, object]]:
  """Attention head shapes at the 7B's d_model = 4096 (4): 8 x 512, 16 x 256, 32 x 128 (the 7B)
  and 64 x 64 heads x head_dim, multi-head as the 7B (n_kv_heads = n_heads), everything else
  stage 1. H x K = d_model throughout, so the parameters (q_norm / k_norm included: QK-norm runs
  over the whole H·K projection, not per head) and the analytic FLOPs (ModelConfig.
  flops_per_token; the attention core, 12·H·K per key, is 11% of them at 8192 tokens) are the
  same for every variant. What differs is how the hardware runs them: the per-head contractions
  (q·kᵀ over K, p·v producing K) against the MXU, 128 x 128 on v5p and 256 x 256 on v6e and
  tpu7x (K = 64 fills half of a v5p pass, K = 256 a whole v6e / tpu7x one); splash attention's
  grid (one step per head and block pair) and its per-head softmax statistics (H x T floats per
  sequence); the scores XLA attention materialises (H x T x S); and RoPE (K / 2 frequencies
  per head between 1 and 1/theta). Whether a shape keeps the 7B's quality is the tiny sweep's
  question (experiments.olmo3_tiny:head_shape_sweep). Run (≈ 5 minutes a variant on 2 cores):
  python launch/sweep.py --fdl_config=experiments.olmo3_7b:stage1
  --sweep=experiments.olmo3_7b:head_shape_sweep --compile_only=tpu7x:4x8x8
  --out benchmarks/sweeps/olmo3_7b_head_shape_tpu7x_4x8x8"""
  return [{"model.n_heads": heads, "model.n_kv_heads": heads} for heads in (8, 16, 32, 64)]
