"""Supervised fine-tuning against AI2's trainer code: chat data with label masks, side by side
with OLMo-core's own NumpyPackedFSLDataset and TransformerTrainModule.

  python benchmarks/sft_parity_olmo_core.py [--dtype float64|float32] [--steps 30] [--ranks 2]
      [--batch 4] [--seq_len 256]

The recipe is experiments.olmo3_tiny:sft (the 7B's Think SFT, olmo3_7b.sft_think, at laptop
size), built as the launcher builds it and changed only where a side-by-side run must: its
sequence --seq_len (256; YaRN's original context a quarter of it, as the recipe's 256 of
1024), the data below, the 7B's peak LR 5e-5 (--peak_lr; the tiny recipe's is 10x: see
below), --batch instances a step in 2 micro-batches (AI2's Instruct SFT: two
instances a rank, gradient accumulation 2), the loss's ranks --ranks, no evaluation, fresh
weights (train.seed) instead of the tiny stage 3's, RoPE positions as the installed OLMo-core
takes them (harness/stage3_parity_olmo_core.py: 3.0.0 restarts them at each document; the two
conventions differ by rounding only), and the dtype. Everything else is the recipe's: YaRN on
the full-attention layers, packing by best-fit decreasing one file a group in file order with
long conversations truncated, loader seed 34521, 2 epochs (train.stop_at_epoch), SkipStepAdamW
(0.9, 0.95, eps 1e-8, weight decay 0), clipping at 1.0, no z-loss, LinearWithWarmup with 3% of
the run's steps warming up (optimizer.warmup_fraction) and then linear to 0 over the run
(optimizer.decay_steps None: the 2 epochs), the loss each data-parallel rank's token mean
averaged over the ranks (LossMean.PER_RANK).

The data: conversations of the embedded chat corpus (olmo3.data.embedded: questions about the
standard library answered by its docstrings), every 7th three of them joined into one
multi-turn conversation (some longer than an instance: truncated by the packing) and every 19th
eight (longer than `prepare --chat --max_tokens` = 2 x --seq_len: cut there, its EOS lost, so
OLMo-core's EOS scan joins it to the next conversation, as on AI2's data), written by olmo3's
own `prepare --chat` (olmo3.data.prepare_chat: AI2's Think template, the assistant's turns
trained) into parts of 12 instances' tokens (conversations straddle parts, as in AI2's 1 GiB
parts), as many conversations as make --steps / 2 steps an epoch.

OLMo-core side: NumpyPackedFSLDatasetConfig(paths, label_mask_paths, generate_doc_lengths=True,
long_doc_strategy=truncate) over the token files and their masks, as AI2's SFT script builds it,
ordered by its own loader (dp_world_size=--ranks, dp_rank=r; epoch 2 reshuffled), and its
TransformerTrainModule on --ranks ranks (a process each over gloo, DDP) with
LinearWithWarmup(warmup_fraction=0.03, alpha_f=0) over its Trainer's max_steps (2 epochs of its
loader's batches): the machinery of harness/stage3_parity_olmo_core.py (the flash-attn stand-in
for its intra-document attention, the float64 changes). Our side: the launcher's own path
(olmo3.run.plan.RunPlan.build resolves the data directory, checks the masks and the chat
template, packs, fixes the schedule's length and the stage's end) and olmo3.data.pipeline.Loader
into olmo3.train.step.jit_train_step with train.loss_ranks = --ranks, on one device, from the
same initial weights.

Checked: every step's instances (the token ids of each global-batch row), labels (ours against
OLMo-core's get_labels of its batch: the label masks, padding, the shift) and document lengths,
against OLMo-core's loader at 1, 2 and 4 ranks (`data_by_ranks`; trained at --ranks only); each
step's loss, grad norm and LR. Two mutations, each evaluated at every step's parameters and
batch, must fail the tolerances: `masks_off` (the same instances, every label trained: the token
files read without their masks) and, at several ranks, `global_mean` (one token mean over the
global batch, LossMean.GLOBAL, where OLMo-core's ranks each take their own: the ranks' trained
counts differ at (nearly) every step, `steps_with_unequal_rank_counts`).

float32: at the tiny recipe's LR (5e-4) the float32 run drifts past the tolerances (30 steps:
|loss diff| 1.3e-5 on one rank, grad norm 4.8e-4; benchmarks/RESULTS.md), float64 agreeing to
1e-15 there too. The drift starts in OLMo-core's gradient norm: torch's float32 CPU norm
kernel (clip_grad_norm_'s foreach norm) is off by ~5e-5 on a tensor as large as the 8192 x 128
embedding, so every clipped update is scaled by a norm 1e-6 to 1e-5 off (step 1: its norm
7e-6 below the float64 norm of its own float32 gradients, ours 1e-7), and fast training
amplifies it. At the 7B's LR it stays within the tolerances.

Prints per-step loss, grad norm and LR from both, then one JSON object: steps, dtype, ranks,
max_abs_loss_diff, max_rel_grad_norm_diff, max_abs_lr_diff, skip_decisions_equal,
instances_equal, label_masks_equal, doc_lengths_equal (at every rank count checked),
data_by_ranks, documents_per_row, trained_fraction (trained labels per non-padding token),
schedule (steps, steps per epoch, our warmup, OLMo-core's t_max), peak_lr, first_loss, last_loss,
rank_label_counts_first_step, steps_with_unequal_rank_counts, masks_off, global_mean (--ranks >
1), olmo_core_version, rope_positions, tolerances, within; exits 1 when `within` is false.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import tempfile
from typing import Any

from harness import stage3_parity_olmo_core as stage3
from harness import train_parity_olmo_core as bench

MICROBATCHES = 2
JOIN_EVERY, JOINED = 7, 3  # multi-turn conversations, some longer than an instance
CUT_EVERY, CUT = 19, 8  # conversations longer than prepare's --max_tokens: cut, EOS lost
PART_INSTANCES = 12  # a part file holds this many instances' tokens


@functools.lru_cache(maxsize=1)
def _corpus() -> tuple:
  from olmo3.data import embedded

  return tuple(embedded.conversations())  # seconds: the standard library's sources parsed


def conversations(n: int) -> list[list[dict[str, str]]]:
  """The first `n` conversations of the embedded chat corpus's, some joined (module docstring)."""
  corpus = iter(_corpus())
  out = []
  while len(out) < n:
    joined = CUT if len(out) % CUT_EVERY == CUT_EVERY - 1 else (
        JOINED if len(out) % JOIN_EVERY == JOIN_EVERY - 1 else 1)
    messages = []
    for _ in range(joined):  # one system prompt at most, first
      messages += [m for m in next(corpus) if not (messages and m["role"] == "system")]
    out.append(messages)
  return out


def prepare(directory: pathlib.Path, n: int, seq_len: int):
  """`n` conversations through olmo3's `prepare --chat` into `directory` (replaced): the
  manifest."""
  from olmo3.data import embedded, prepare_chat

  jsonl = directory.parent / "conversations.jsonl"
  jsonl.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(n)))
  return prepare_chat.prepare_chat(
      [str(jsonl)], str(embedded.corpus_dir() / "tokenizer.json"), str(directory),
      embedded.CHAT_TEMPLATE, max_tokens=2 * seq_len, heldout_fraction=0.0,
      heldout_min_documents=0, progress=False, part_tokens=PART_INSTANCES * seq_len)


def packed_instances(manifest, directory: pathlib.Path, seq_len: int, eos: int) -> int:
  from olmo3.data import packing

  paths = [str(directory / f) for f in manifest.splits["train"]["files"]]
  return len(packing.PackedIndex.build(paths, seq_len=seq_len, eos_token_id=eos,
                                       source_group_size=1))


def chat_data(directory: pathlib.Path, steps_per_epoch: int, batch: int, seq_len: int,
              eos: int) -> dict[str, Any]:
  """Prepares the fewest conversations whose packed instances make `steps_per_epoch` global
  batches of `batch` (the loaders drop the rest of an epoch), found by bisection; a record of
  what was written."""
  def batches(n: int) -> int:
    return packed_instances(prepare(directory, n, seq_len), directory, seq_len, eos) // batch

  low, high = 0, 8
  while batches(high) < steps_per_epoch:
    low, high = high, 2 * high
  while high - low > 1:  # batches(low) < steps_per_epoch <= batches(high)
    middle = (low + high) // 2
    low, high = (middle, high) if batches(middle) < steps_per_epoch else (low, middle)
  if batches(high) != steps_per_epoch:  # leaves `directory` holding `high` conversations
    raise RuntimeError(f"no number of conversations makes {steps_per_epoch} batches an epoch")
  manifest = json.loads((directory / "manifest.json").read_text())
  train = manifest["splits"]["train"]
  return {"conversations": high, "parts": len(train["files"]), "tokens": train["tokens"],
          "trained_tokens": train["trained_tokens"]}


def sft_experiment(args, directory: pathlib.Path, rope_positions):
  """experiments.olmo3_tiny:sft changed where a side-by-side run must (module docstring)."""
  import fiddle as fdl

  from experiments import olmo3_7b, olmo3_tiny
  from olmo3.config import DType

  exp = fdl.build(olmo3_tiny.sft())
  peak_lr = olmo3_7b.sft_think().optimizer.peak_lr if args.peak_lr is None else args.peak_lr
  model = exp.model.replace(
      max_seq_len=args.seq_len, compute_dtype=DType(args.dtype), rope_positions=rope_positions,
      rope_scaling=dataclasses.replace(exp.model.rope_scaling, original_context=args.seq_len // 4))
  data = exp.data.replace(mix=str(directory), root="", seq_len=args.seq_len,
                          global_batch_size=args.batch)
  train = dataclasses.replace(exp.train, loss_ranks=args.ranks, microbatches=MICROBATCHES,
                              eval_every=0)
  return dataclasses.replace(
      exp, model=model, data=data, train=train,
      optimizer=dataclasses.replace(exp.optimizer, peak_lr=peak_lr),
      checkpoint=dataclasses.replace(exp.checkpoint, init_from=None),
      # Nothing evaluated (eval_every=0): RULER's lengths would not fit the shortened model.
      eval=dataclasses.replace(exp.eval, ruler=dataclasses.replace(exp.eval.ruler, lengths=())))


def masks_off(exp, paths: list[str]):
  """The same token files packed without their label masks: every label trained."""
  from olmo3.data import packing

  d, m = exp.data, exp.model
  index = packing.PackedIndex.build(
      paths, seq_len=d.seq_len, eos_token_id=m.eos_token_id,
      source_group_size=d.packing.source_group_size,
      source_permutation_seed=d.packing.source_permutation_seed,
      long_doc_strategy=d.packing.long_documents.value)
  return packing.PackedInstances(index, pad_token_id=m.pad_token_id, vocab_size=m.vocab_size)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dtype", choices=sorted(stage3.TOLERANCES), default="float64")
  parser.add_argument("--steps", type=int, default=30, help="even: 2 epochs of steps / 2")
  parser.add_argument("--ranks", type=int, default=2,
                      help="OLMo-core's data-parallel ranks (>1: processes over gloo); ours "
                           "runs on one device with train.loss_ranks set to it")
  parser.add_argument("--batch", type=int, default=4, help="instances per step")
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--peak_lr", type=float, default=None,
                      help="default: the 7B Think SFT's, 5e-5 (the tiny recipe's is 10x)")
  args = parser.parse_args(argv)
  if args.steps % 2 or args.steps < 2 or args.batch % args.ranks:
    parser.error("--steps must be even (2 epochs) and --batch a multiple of --ranks")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: both sides on the CPU
  from olmo3 import platforms

  platforms.choose()
  import numpy as np

  from olmo3.config import LossMean
  from olmo3.run.plan import RunPlan

  version = stage3.olmo_core_version()
  rope_positions = stage3.olmo_core_rope_positions(version)
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    recipe = sft_experiment(args, root / "chat", rope_positions)
    data = chat_data(root / "chat", args.steps // 2, args.batch, args.seq_len,
                     recipe.model.eos_token_id)
    plan = RunPlan.build(recipe, str(root / "run"))
    paths = list(plan.train_files.paths)
    # Ours: the planned experiment (the schedule's length and warmup in steps), `end` steps.
    exp = dataclasses.replace(plan.exp, train=dataclasses.replace(plan.exp.train,
                                                                  steps=plan.end))
    theirs, per_epoch = stage3.olmo_core_batches(exp, root / "work", args.ranks, paths)
    mutations = (stage3.Mutation("masks_off", exp, masks_off(exp, paths)),)
    if args.ranks > 1:
      mutations += (stage3.Mutation("global_mean", dataclasses.replace(
          exp, train=dataclasses.replace(exp.train, loss_mean=LossMean.GLOBAL))),)
    initial, our_rows, batches = stage3.ours(exp, plan.train_files, plan.end, mutations)
    by_ranks = {}
    for ranks in (1, 2, 4):
      if args.batch % ranks == 0:
        other = theirs if ranks == args.ranks else stage3.olmo_core_batches(
            exp, root / "work", ranks, paths)[0]
        by_ranks[str(ranks)] = stage3.check_batches(batches, other)
    # OLMo-core's trainer: the recipe's warmup fraction, over 2 epochs of its loader's batches.
    max_steps = recipe.train.stop_at_epoch * per_epoch
    their_rows = stage3.olmo_core_run(recipe, initial, theirs, max_steps)
  bench.print_rows(our_rows, their_rows, args.dtype)
  counts = stage3.rank_label_counts(theirs)
  labels = np.stack([b["labels"] for b in batches])
  tokens = np.stack([b["input_ids"] for b in batches])
  tolerances = stage3.TOLERANCES[args.dtype]
  checks = {k: all(c[k] for c in by_ranks.values())
            for k in ("instances_equal", "label_masks_equal", "doc_lengths_equal")}
  result = {
      "steps": len(our_rows), "dtype": args.dtype, "ranks": args.ranks,
      **stage3.bench.compare(our_rows, their_rows), **checks, "data_by_ranks": by_ranks,
      "data": data, "documents_per_row": stage3.documents_per_row(batches),
      "trained_fraction": float((labels >= 0).sum() / (tokens != exp.model.pad_token_id).sum()),
      "schedule": {"steps": plan.end, "steps_per_epoch": plan.steps_per_epoch,
                   "warmup_steps": exp.optimizer.warmup_steps,
                   "decay_steps": exp.optimizer.decay_steps, "olmo_core_t_max": max_steps},
      "first_loss": their_rows[0]["loss"], "last_loss": their_rows[-1]["loss"],
      "rank_label_counts_first_step": counts[0],
      "steps_with_unequal_rank_counts": sum(len(set(c)) > 1 for c in counts),
      "masks_off": stage3.mutation_diffs("masks_off", our_rows, their_rows, counts),
      "peak_lr": exp.optimizer.peak_lr,
      "olmo_core_version": version, "rope_positions": rope_positions.value,
      "tolerances": tolerances}
  stage3.print_mutation("ours with every label trained (no label masks)", result["masks_off"])
  caught = [stage3.caught(result["masks_off"], tolerances)]
  if args.ranks > 1:
    result["global_mean"] = stage3.mutation_diffs("global_mean", our_rows, their_rows, counts)
    stage3.print_mutation(f"ours with one global token mean against OLMo-core's {args.ranks} "
                          "ranks", result["global_mean"])
    caught.append(stage3.caught(result["global_mean"], tolerances)
                  and result["steps_with_unequal_rank_counts"] > 0)
  result["within"] = bool(
      result["steps"] == args.steps and result["skip_decisions_equal"] and all(checks.values())
      and all(result[k] <= bound for k, bound in tolerances.items()) and all(caught))
  print(json.dumps(result))
  return result
