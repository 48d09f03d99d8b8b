"""Continuing AI2's own run: an OLMo-core checkpoint, continued by OLMo-core and by olmo3.

  python benchmarks/continue_olmo_core.py [--steps 10] [--continue_steps 20] [--spike_at 15]
  python benchmarks/continue_olmo_core.py --stage3 [--steps 10] [--continue_steps 20]

OLMo-core's own Trainer with its TransformerTrainModule (SkipStepAdamW with AI2's groups, which
leave the input embedding undecayed; CosWithWarmup; z-loss 1e-5; clipping at 1.0), its data
loader and its Checkpointer trains olmo3_micro for --steps steps on token files and saves the
step (and step 0, which, as in AI2's runs, makes SkipStepAdamW's count one more than its
updates). From that checkpoint, in AI2's two ways:

- continue (`load_trainer_state=True`: a stage continued): OLMo-core's Trainer loads it and
  trains --continue_steps more steps of the same schedule and data; olmo3 starts with
  checkpoint.init_from = the step directory and init_mode=continue (the trainer converts it into
  its workdir, olmo3.train.state) and trains the same steps;
- new_stage (`load_trainer_state=False`: AI2's midtraining from stage 1): both start a second
  stage from the weights and optimizer state, on other token files with another seed and global
  batch, LinearWithWarmup(warmup=0, alpha_f=0) over --continue_steps steps; olmo3 initialises
  from the checkpoint the continue mode converted (`checkpoint.init_from` takes an import too).

olmo3's side is its trainer's start (RunPlan, restore_or_init), loader and train step, stepped as
its loop steps them; both sides in float32 on the CPU. The continue mode's first stage crosses
epochs (13 steps each), so the position includes an epoch. Each continuation's token files hold
one odd batch (a single token repeated) at its --spike_at-th step, which trips SkipStepAdamW's
rule: its window (16 values here) starts empty on loading, on both sides.

--stage3 instead continues a stage-2-shaped checkpoint into stage 3 (AI2's long-context
extension, shrunk): OLMo-core's Trainer trains --steps steps of stage 2's recipe and saves; both
sides start stage 3 from it with its weights and optimizer state, not its trainer state
(`load_trainer_state=False, load_optim_state=True`; olmo3: init_mode=new_stage from the
OLMo-core checkpoint itself): YaRN over stage 2's 64-token context on the full-attention
layers, documents packed into 256-token instances by OLMo-core's NumpyPackedFSLDataset (ours by
olmo3.data.packing), attention within each document (OLMo-core's flash_2 backend through
harness/flash_attn_standin, as harness/stage3_parity_olmo_core.py runs it), RoPE positions as
the installed OLMo-core's, 2 micro-batches, LinearWithWarmup(warmup=5, alpha_f=0) over
--continue_steps steps. No odd batch there: the skip window (which starts empty) never acts, and
the skip decisions compared are all "no".

Prints per-step CE loss, gradient norm, LR, skip decision and instances from both, then one JSON
object: per mode max |CE loss diff| (and of CE + z-loss), max relative grad-norm diff, max |LR
diff|, skip decisions equal, instances equal, skipped steps; `ok` says all are within tolerance
(loss 1e-5, grad norm 1e-4, LR 1e-9); exits 1 when not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from typing import Any

import numpy as np

# Stage 3's documents, OLMo-core's packed dataset settings, the flash-attn stand-in and
# OLMo-core's model with the flash_2 backend.
from harness import stage3_parity_olmo_core as s3

SEQ_LEN, PEAK_LR, STAGE2_LR, WINDOW = 64, 1e-3, 5e-4, 16
SPIKE_TOKEN = 7
TOLERANCES = {"max_abs_loss_diff": 1e-5, "max_abs_total_loss_diff": 1e-5,
              "max_rel_grad_norm_diff": 1e-4, "max_abs_lr_diff": 1e-9}


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage's data: token files (instances per file), seed, instances per step."""

  files: tuple[int, ...]
  seed: int
  batch: int


# Stage 1: 52 instances, 13 steps per epoch. Stage 2: 45 instances, 22 steps per epoch.
STAGE1, STAGE2 = Stage((30, 22), seed=7, batch=4), Stage((16, 20, 9), seed=1337, batch=2)


def write_tokens(directory: str, stage: Stage, spike_step: int | None, vocab: int
                 ) -> list[str]:
  """The stage's token files: windows of a noisy repeating sequence (learnable, so the loss
  falls), except the instances of global data step `spike_step` (0-based; None: none), which
  repeat one token."""
  from olmo3.data import tokens
  from olmo3.data.order import GlobalOrder

  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(stage.seed)
  total = sum(stage.files) * SEQ_LEN
  data = np.tile(rng.integers(2, vocab, 97), total // 97 + 1)[:total]
  noise = rng.random(total) < 0.05
  data[noise] = rng.integers(2, vocab, int(noise.sum()))
  if spike_step is not None:
    for instance in GlobalOrder(sum(stage.files), stage.batch, stage.seed).batch(spike_step):
      data[instance * SEQ_LEN:(instance + 1) * SEQ_LEN] = SPIKE_TOKEN
  paths, start = [], 0
  for i, n in enumerate(stage.files):
    paths.append(os.path.join(directory, f"part-{i}.npy"))
    tokens.write_token_file(paths[-1], data[start:start + n * SEQ_LEN])
    start += n * SEQ_LEN
  return paths


# --- OLMo-core -----------------------------------------------------------------------------


def olmo_core_trainer(model_cfg, paths: list[str], stage: Stage, work: str, *, max_steps: int,
                      scheduler, lr: float, save_every: int | None = None,
                      seq_len: int = SEQ_LEN, dataset_config: Any = None, model: Any = None,
                      microbatches: int = 1, **trainer: Any):
  """OLMo-core's Trainer as AI2's scripts build one, shrunk, and the callback recording its
  steps; it saves every `save_every` steps (None: never). `dataset_config` replaces the token
  files' NumpyFSLDatasetConfig (stage 3: the packed dataset, which is packed here, in this
  process, by the method its prepare() would run in a process pool), `model` the model built
  from `model_cfg`."""
  import torch
  from olmo_core.data import (NumpyDataLoaderConfig, NumpyDatasetDType, NumpyFSLDatasetConfig,
                              TokenizerConfig)
  from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig
  from olmo_core.train import Duration, TrainerConfig
  from olmo_core.train.callbacks import Callback, CheckpointerCallback
  from olmo_core.train.train_module import TransformerTrainModuleConfig

  from olmo3.convert import olmo_core_params

  class Record(Callback):
    """Each step's instances (before it) and metrics (as the trainer logs them)."""

    def __init__(self):
      self.rows: dict[int, dict[str, Any]] = {}

    def pre_step(self, batch: dict[str, Any]) -> None:
      self.rows[self.trainer.global_step] = {"instances": batch["index"].tolist()}

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
      if "train/CE loss" in metrics:
        ce, z = float(metrics["train/CE loss"]), float(metrics["train/Z loss"])
        self.rows[step].update(ce_loss=ce, loss=ce + z,
                               grad_norm=float(metrics["optim/total grad norm"]),
                               lr=float(metrics["optim/LR (group 0)"]),
                               skipped=bool(metrics["optim/step skipped"]))

  tokenizer = TokenizerConfig(vocab_size=model_cfg.vocab_size,
                              eos_token_id=model_cfg.eos_token_id,
                              pad_token_id=model_cfg.pad_token_id)
  dataset = (dataset_config or NumpyFSLDatasetConfig(
      paths=paths, sequence_length=seq_len, tokenizer=tokenizer,
      dtype=NumpyDatasetDType.uint32, work_dir=work)).build()
  for group in getattr(dataset, "_source_path_groups", ()):
    dataset._pack_documents_from_source_into_instances(*group)
  loader = NumpyDataLoaderConfig(global_batch_size=stage.batch * seq_len, seed=stage.seed,
                                 num_workers=0, work_dir=work).build(dataset)
  torch.manual_seed(0)
  module = TransformerTrainModuleConfig(
      rank_microbatch_size=stage.batch * seq_len // microbatches, max_sequence_length=seq_len,
      optim=SkipStepAdamWConfig(
          lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, rolling_interval_length=WINDOW,
          sigma_factor=6,
          group_overrides=[OptimGroupOverride(params=["embeddings.weight"],
                                              opts=dict(weight_decay=0.0))]),
      scheduler=scheduler, z_loss_multiplier=1e-5, max_grad_norm=1.0,
  ).build(model or olmo_core_params.transformer_config(model_cfg).build(init_device="cpu"))
  record = Record()
  # A disabled checkpointer saves nothing; the trainer still loads (no_checkpoints would not).
  checkpointer = CheckpointerCallback(save_interval=save_every or 1, ephemeral_save_interval=None,
                                      enabled=save_every is not None)
  return TrainerConfig(
      save_folder=os.path.join(work, "save"), work_dir=work,
      max_duration=Duration.steps(max_steps), metrics_collect_interval=1, **trainer,
  ).with_callback("checkpointer", checkpointer).with_callback("record", record).build(
      module, loader), record


def olmo_core_side(model_cfg, stage1_paths: list[str], stage2_paths: list[str], root: str,
                   steps: int, continue_steps: int) -> tuple[str, dict[str, list[dict]]]:
  """(the first stage's checkpoint at `steps`, each mode's continuation rows)."""
  from olmo_core.optim import CosWithWarmup, LinearWithWarmup
  from olmo_core.train import Duration
  from olmo_core.train.common import LoadStrategy

  cosine = CosWithWarmup(warmup=4, alpha_f=0.1)
  first, _ = olmo_core_trainer(
      model_cfg, stage1_paths, STAGE1, os.path.join(root, "oc-stage1"),
      max_steps=steps + continue_steps, scheduler=cosine, lr=PEAK_LR, save_every=steps,
      hard_stop=Duration.steps(steps))
  first.fit()
  saved = os.path.join(first.save_folder, f"step{steps}")
  runs = {}
  for mode, paths, stage, scheduler, lr, total, trainer_state in (
      ("continue", stage1_paths, STAGE1, cosine, PEAK_LR, steps + continue_steps, True),
      ("new_stage", stage2_paths, STAGE2, LinearWithWarmup(warmup=0, alpha_f=0.0), STAGE2_LR,
       continue_steps, False)):
    trainer, record = olmo_core_trainer(
        model_cfg, paths, stage, os.path.join(root, f"oc-{mode}"), max_steps=total,
        scheduler=scheduler, lr=lr, load_path=saved, load_strategy=LoadStrategy.always,
        load_trainer_state=trainer_state, load_optim_state=True)
    trainer.fit()
    runs[mode] = [record.rows[s] for s in sorted(record.rows)]
  return saved, runs


# --- olmo3 ---------------------------------------------------------------------------------


def olmo3_experiment(model_cfg, paths: list[str], stage: Stage, *, init_from: str, mode: str,
                     steps: int, schedule: str, lr: float, decay_steps: int,
                     seq_len: int = SEQ_LEN, warmup: int | None = None, packing: Any = None,
                     microbatches: int = 1):
  from olmo3.config import (CheckpointConfig, DataConfig, Experiment, InitMode,
                            OptimizerConfig, Schedule, TrainConfig)

  cosine = Schedule(schedule) is Schedule.COSINE
  optimizer = OptimizerConfig(
      peak_lr=lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, no_decay=("embed_tokens",),
      clip_grad_norm=1.0, schedule=Schedule(schedule),
      warmup_steps=(4 if cosine else 0) if warmup is None else warmup,
      final_lr=lr * 0.1 if cosine else 0.0, decay_steps=decay_steps, skip_spikes=True,
      spike_sigma=6.0, spike_window=WINDOW, spike_min_history=WINDOW // 2)
  return Experiment(
      model=model_cfg.replace(max_seq_len=seq_len),
      # OLMo-core's side builds its dataset without max_target_sequence_length: instances
      # shuffled one by one, as max_target_seq_len=None gives.
      data=DataConfig(paths=tuple(paths), seq_len=seq_len, global_batch_size=stage.batch,
                      seed=stage.seed, max_target_seq_len=None, packing=packing),
      optimizer=optimizer, train=TrainConfig(steps=steps, z_loss_weight=1e-5, eval_every=0,
                                             microbatches=microbatches),
      checkpoint=CheckpointConfig(init_from=init_from, init_mode=InitMode(mode),
                                  async_save=False))


def olmo3_run(exp, workdir: str) -> list[dict]:
  """Our trainer's start (the plan, restore_or_init) and its steps, as the loop runs them."""
  import jax

  from olmo3.data import pipeline
  from olmo3.run.plan import RunPlan
  from olmo3.placement import ShardedModel
  from olmo3.train.run_checkpoints import RunCheckpoints
  from olmo3.train.state import StateLayout, restore_or_init
  from olmo3.train.step import jit_train_step

  plan = RunPlan.build(exp, workdir)
  model = ShardedModel.for_experiment(exp, jax.devices()[:1])
  layout = StateLayout(exp, model)
  rows = []
  with model.context():
    checkpoints = RunCheckpoints(plan.workdir.checkpoints, 1, async_save=False)
    state, position = restore_or_init(layout, checkpoints, plan)
    start = int(state.step)
    loader = pipeline.Loader(exp.data, model.batch_sharding,
                             start_step=position.data_step(start), num_steps=plan.end - start,
                             source=plan.train_files)
    step_fn = jit_train_step(exp, model, layout, len(plan.train_files.source_names))
    for host in loader.host_batches():
      batch = loader.host_rows.to_global({k: host[k] for k in pipeline.STEP_KEYS if k in host})
      state, metrics = step_fn(state, batch)
      m = jax.device_get(metrics)
      rows.append({"instances": host["instance"].tolist(), "ce_loss": float(m["ce_loss"]),
                   "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                   "lr": float(m["lr"]), "skipped": bool(m["skipped"])})
  return rows


# --- stage 3 ------------------------------------------------------------------------------

# Stage 3 (--stage3), AI2's long-context extension shrunk: documents packed into instances 4x
# stage 2's length, YaRN over stage 2's context on the full-attention layers, 2 micro-batches,
# stage 2's peak LR after a warmup (AI2's 200 of 11,921 steps, shrunk), linear to 0.
STAGE3 = Stage((), seed=34521, batch=4)  # its files: stage3_parity_olmo_core's documents
STAGE3_SEQ_LEN, STAGE3_WARMUP, STAGE3_MICROBATCHES = 4 * SEQ_LEN, 5, 2


def stage3_model(model_cfg):
  """Stage 2's model with YaRN over stage 2's context, RoPE positions as the installed
  OLMo-core's (2.4.0: across the instance; 3.0.0: per document)."""
  from olmo3 import config

  return model_cfg.replace(
      max_seq_len=STAGE3_SEQ_LEN,
      rope_positions=s3.olmo_core_rope_positions(s3.olmo_core_version()),
      rope_scaling=config.Yarn(factor=8.0, beta_fast=32.0, beta_slow=1.0,
                               original_context=SEQ_LEN))


def stage3(model_cfg, stage2_paths: list[str], root: str, steps: int,
           continue_steps: int) -> tuple[list[dict], list[dict]]:
  """(ours, OLMo-core's) rows of stage 3 started from a stage-2-shaped OLMo-core checkpoint:
  OLMo-core's Trainer trains --steps steps of stage 2's recipe (LinearWithWarmup(warmup=0,
  alpha_f=0) over them: the stage ends at LR 0, as AI2's did) and saves; from there both sides
  start stage 3 with its weights and optimizer state, not its trainer state
  (load_trainer_state=False, load_optim_state=True; olmo3: init_mode=new_stage from the
  OLMo-core checkpoint itself), OLMo-core's on its packed dataset with its flash_2 backend's
  intra-document attention (the stand-in), ours on our packed loader."""
  import pathlib

  from olmo_core.data import TokenizerConfig
  from olmo_core.data.numpy_dataset import NumpyPackedFSLDatasetConfig
  from olmo_core.optim import LinearWithWarmup
  from olmo_core.train.common import LoadStrategy

  from olmo3.config import Packing
  from olmo3.convert import olmo_core_params

  first, _ = olmo_core_trainer(
      model_cfg, stage2_paths, STAGE2, os.path.join(root, "oc-stage2"), max_steps=steps,
      scheduler=LinearWithWarmup(warmup=0, alpha_f=0.0), lr=STAGE2_LR, save_every=steps)
  first.fit()
  saved = os.path.join(first.save_folder, f"step{steps}")
  corpus = s3.write_corpus(
      pathlib.Path(root) / "stage3",
      int(1.5 * continue_steps * STAGE3.batch * STAGE3_SEQ_LEN), STAGE3_SEQ_LEN,
      model_cfg.vocab_size)
  yarn = stage3_model(model_cfg)
  work = os.path.join(root, "oc-stage3")
  packed = NumpyPackedFSLDatasetConfig(
      paths=corpus, tokenizer=TokenizerConfig(vocab_size=yarn.vocab_size,
                                              eos_token_id=yarn.eos_token_id,
                                              pad_token_id=yarn.pad_token_id),
      dtype="uint32", sequence_length=STAGE3_SEQ_LEN, generate_doc_lengths=True,
      source_group_size=s3.GROUP_SIZE, source_permutation_seed=s3.PERMUTATION_SEED,
      work_dir=work)
  schedule = LinearWithWarmup(warmup=STAGE3_WARMUP, alpha_f=0.0)
  with s3.flash_attn_standin():
    model = s3._build_with_flash_attention(
        s3._blocks(olmo_core_params.transformer_config(yarn), s3._flash_attention))
    trainer, record = olmo_core_trainer(
        yarn, corpus, STAGE3, work, max_steps=continue_steps, scheduler=schedule, lr=STAGE2_LR,
        seq_len=STAGE3_SEQ_LEN, dataset_config=packed, model=model,
        microbatches=STAGE3_MICROBATCHES, load_path=saved, load_strategy=LoadStrategy.always,
        load_trainer_state=False, load_optim_state=True)
    trainer.fit()
  theirs = [record.rows[s] for s in sorted(record.rows)]
  ours = olmo3_run(olmo3_experiment(
      yarn, corpus, STAGE3, init_from=saved, mode="new_stage", steps=continue_steps,
      schedule="linear", lr=STAGE2_LR, decay_steps=continue_steps, seq_len=STAGE3_SEQ_LEN,
      warmup=STAGE3_WARMUP,
      packing=Packing(source_group_size=s3.GROUP_SIZE,
                      source_permutation_seed=s3.PERMUTATION_SEED),
      microbatches=STAGE3_MICROBATCHES), os.path.join(root, "olmo3-stage3"))
  return ours, theirs


# --- the comparison ------------------------------------------------------------------------


def compare(ours: list[dict], theirs: list[dict], instances: bool = True) -> dict[str, Any]:
  """Per-step rows of both sides compared; `instances`: both logged the instance ids (olmo3's
  loop does not: a run through it compares the rest)."""
  pairs = list(zip(ours, theirs))
  result = {
      "steps": len(ours), "steps_olmo_core": len(theirs),
      "max_abs_loss_diff": max(abs(a["ce_loss"] - b["ce_loss"]) for a, b in pairs),
      "max_abs_total_loss_diff": max(abs(a["loss"] - b["loss"]) for a, b in pairs),
      "max_rel_grad_norm_diff": max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"]
                                    for a, b in pairs),
      "max_abs_lr_diff": max(abs(a["lr"] - b["lr"]) for a, b in pairs),
      "skip_decisions_equal": [a["skipped"] for a in ours] == [b["skipped"] for b in theirs],
      "skipped_steps": [i + 1 for i, b in enumerate(theirs) if b["skipped"]],
  }
  if instances:
    result["instances_equal"] = [a["instances"] for a in ours] == [b["instances"] for b in theirs]
  return result


def within(result: dict[str, Any]) -> bool:
  return (result["steps"] == result["steps_olmo_core"] and result["skip_decisions_equal"]
          and result["instances_equal"]
          and all(result[k] <= v for k, v in TOLERANCES.items()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # float32 on the CPU on both sides
  from olmo3 import program

  parser = program.parser("python benchmarks/continue_olmo_core.py", __doc__)
  parser.add_argument("--steps", type=int, default=10, help="OLMo-core's first stage")
  parser.add_argument("--continue_steps", type=int, default=20)
  parser.add_argument("--spike_at", type=int, default=15,
                      help="the continuation step with the odd batch (0: none)")
  parser.add_argument("--workdir", help="keep everything here (default: a temporary directory)")
  parser.add_argument("--stage3", action="store_true",
                      help="instead: a stage-2-shaped checkpoint continued into stage 3")
  args = parser.parse_args(argv)
  from olmo3 import config

  model_cfg = config.olmo3_micro()
  with tempfile.TemporaryDirectory(prefix="continue-olmo-core-") as tmp:
    root = args.workdir or tmp
    if args.stage3:
      stage2 = write_tokens(os.path.join(root, "stage2"), STAGE2, None, model_cfg.vocab_size)
      ours, theirs = stage3(model_cfg, stage2, root, args.steps, args.continue_steps)
      return _report({"stage3": ours}, {"stage3": theirs}, 0,
                     {"olmo_core_version": s3.olmo_core_version(),
                      "rope_positions": stage3_model(model_cfg).rope_positions.value})
    # Data steps are 0-based: continuation step k of the first stage is data step steps + k - 1.
    spike = args.spike_at or None
    stage1 = write_tokens(os.path.join(root, "stage1"), STAGE1,
                          spike and args.steps + spike - 1, model_cfg.vocab_size)
    stage2 = write_tokens(os.path.join(root, "stage2"), STAGE2, spike and spike - 1,
                          model_cfg.vocab_size)
    saved, theirs = olmo_core_side(model_cfg, stage1, stage2, root, args.steps,
                                   args.continue_steps)
    continued = os.path.join(root, "olmo3-continue")
    ours = {"continue": olmo3_run(olmo3_experiment(
        model_cfg, stage1, STAGE1, init_from=saved, mode="continue",
        steps=args.steps + args.continue_steps, schedule="cosine", lr=PEAK_LR,
        decay_steps=args.steps + args.continue_steps), continued)}
    from olmo3.run.record import Workdir

    ours["new_stage"] = olmo3_run(olmo3_experiment(
        model_cfg, stage2, STAGE2, init_from=Workdir(continued).olmo_core_import,
        mode="new_stage", steps=args.continue_steps, schedule="linear", lr=STAGE2_LR,
        decay_steps=args.continue_steps), os.path.join(root, "olmo3-new-stage"))
  return _report(ours, theirs, args.steps)


def _report(ours: dict[str, list[dict]], theirs: dict[str, list[dict]], steps: int,
            facts: dict[str, Any] | None = None) -> dict[str, Any]:
  """Prints each mode's steps side by side and the JSON result; returns it."""
  result = {}
  for mode in ours:
    print(f"{mode}: {'step':>4}  {'CE (ours)':>10} {'CE (OLMo-core)':>14}  {'grad norm':>9} "
          f"{'grad norm':>9}  {'LR':>10} {'LR':>10}  skipped  instances")
    first = steps if mode == "continue" else 0
    for i, (a, b) in enumerate(zip(ours[mode], theirs[mode]), start=first + 1):
      print(f"{'':>{len(mode) + 1}} {i:>4}  {a['ce_loss']:>10.7f} {b['ce_loss']:>14.7f}  "
            f"{a['grad_norm']:>9.6f} {b['grad_norm']:>9.6f}  {a['lr']:>10.4e} {b['lr']:>10.4e}  "
            f"{int(a['skipped'])} {int(b['skipped'])}      {a['instances']}"
            f"{'' if a['instances'] == b['instances'] else ' != ' + str(b['instances'])}")
    result[mode] = compare(ours[mode], theirs[mode])
  result.update(facts or {})
  result["ok"] = all(within(result[mode]) for mode in ours)
  print(json.dumps(result))
  return result
