"""What one in-loop evaluation of the 7B costs, against the 10,000 training steps between two.

  python benchmarks/eval_price_7b.py [--tokenizer allenai/dolma2-tokenizer]
      [--requests_cache FILE] [--heldout_root DIR] [--heldout_tokens_per_set 1000000]
      [--mfu 0.445] [--compile tpu7x:4x8x8] [--smoke]

`experiments.olmo3_7b:stage1` evaluates, every 10,000 steps, AI2's 26 "fast" tasks
(`olmo3_7b.FAST_TASKS`, prepared by ai2-olmo-eval with the task tokenizer at seq_len 8192) and
the 11 v3-small perplexity sets, in batches of 512 rows. For each task this counts the real
tokens (each request's query) and the tokens its batches hold once padded, as the evaluator
batched them before (each task alone, longest first, 512 rows at seq_len halved while the
longest fits, never below 512; every held-out document one row of 8192) and as it batches them
now (`olmo3.eval.tasks.plan`: requests of all tasks pooled by program, longest first, each batch
at the shortest of `tasks.bucket_lengths` that holds it; held-out documents the same way).

FLOPs are the model's exact forward count (`ModelConfig.flops_per_token(length) / 3`; the
multiple-choice program applies the LM head at one position per row), over the padded tokens.
Seconds are FLOPs / (devices x peak x `--mfu`), the MFU the train step is assumed to reach
(44.5%: the TPU reproduction's measured figure with the tpu7x flag set), and the fraction is of
10,000 train steps at the same MFU. `--compile` also compiles the evaluation programs for that
topology (`olmo3.train.aot.compile_eval_batch`: the longest and shortest batch shape each
program runs) and reports their per-device memory and compile time.

Held-out sets: with `--heldout_root` (a directory or URL laid out as AI2's bucket,
`eval-data/perplexity/v3_small_dolma2-tokenizer/...`) their real documents; without it, an
assumption, printed: each set `--heldout_tokens_per_set` tokens in documents whose lengths are
log-normal (median 400 tokens, sigma 1.0, cut at 8192). The task requests need the task
tokenizer (allenai/dolma2-tokenizer from the Hugging Face hub, or a tokenizer.json path);
preparing all 26 tasks takes about 20 minutes on 2 cores, so `--requests_cache` keeps their
lengths in a JSON file. `--smoke` prices two tasks at 20 documents with the embedded
tokenizer and assumed held-out sets (no compile): the tests run it.

Prints a Markdown table per task and the totals, and one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np

from olmo3 import platforms

STEPS_BETWEEN = 10_000  # the 7B's train.eval_every
ASSUMED_MEDIAN, ASSUMED_SIGMA = 400, 1.0  # held-out document lengths when the sets are absent
HELDOUT_SETS = 11  # v3-small-ppl-validation
OLD_SHORTEST = 512  # the old evaluator's shortest padded length
DEVICE_KIND, DEVICES = "TPU7x", 512  # tpu7x:4x8x8, the slice the 7B's stage 1 runs on


@dataclasses.dataclass(frozen=True)
class Items:
  """One task's (or held-out set's) rows: query lengths, and K for one-pass multiple choice."""

  name: str
  lengths: tuple[int, ...]
  choices: int | None = None  # None: scored by row_logprob

  @property
  def program(self) -> str:
    return "row_logprob" if self.choices is None else "choice_logprobs"


def task_items(labels: tuple[str, ...], tokenizer: str, seq_len: int, limit: int | None,
               cache: str | None, eos: int, pad: int) -> list[Items]:
  """Each task's request lengths, prepared by ai2-olmo-eval (or read from `cache`)."""
  if cache and os.path.exists(cache):
    with open(cache) as f:
      saved = json.load(f)
    if saved["tokenizer"] == tokenizer and saved["seq_len"] == seq_len and all(
        label in saved["tasks"] for label in labels):
      return [Items(label, tuple(saved["tasks"][label]["lengths"]),
                    saved["tasks"][label]["choices"]) for label in labels]
  from olmo3.data import sources
  from olmo3.eval import tasks as tasks_lib

  tok = tasks_lib.load_tokenizer(sources.tokenizer_file(tokenizer), eos, pad)
  out = []
  for label in labels:
    task = tasks_lib.load_task(label, tok, seq_len, limit)
    fast = task.requests[0].choices is not None
    out.append(Items(label, tuple(len(r.query) for r in task.requests),
                     max(len(r.choices) for r in task.requests) if fast else None))
    print(f"prepared {label}: {len(task.requests)} requests", file=sys.stderr, flush=True)
  if cache:
    with open(cache, "w") as f:
      json.dump({"tokenizer": tokenizer, "seq_len": seq_len, "tasks": {
          i.name: {"lengths": list(i.lengths), "choices": i.choices} for i in out}}, f)
  return out


def heldout_items(exp, root: str | None, tokens_per_set: int) -> tuple[list[Items], str]:
  """Each held-out set's document lengths (cut to seq_len), and how they were obtained."""
  seq_len = exp.data.seq_len
  if root:
    from olmo3.data import sources
    from olmo3.data.heldout import HeldoutDocs

    ev = dataclasses.replace(exp.eval, heldout_root=root)
    sets = sources.heldout_sets(dataclasses.replace(exp, eval=ev))
    return [Items(name, tuple(HeldoutDocs(paths, seq_len, exp.model.eos_token_id,
                                          exp.model.pad_token_id).lengths.tolist()))
            for name, paths in sets.items()], f"the sets under {root}"
  rng = np.random.default_rng(0)
  out = []
  for s in range(HELDOUT_SETS):
    lengths, total = [], 0
    while total < tokens_per_set:
      n = int(min(seq_len, max(2, rng.lognormal(math.log(ASSUMED_MEDIAN), ASSUMED_SIGMA))))
      lengths.append(n)
      total += n
    out.append(Items(f"heldout set {s + 1}", tuple(lengths)))
  return out, (f"assumed: {HELDOUT_SETS} sets x {tokens_per_set:,} tokens, document lengths "
               f"log-normal (median {ASSUMED_MEDIAN}, sigma {ASSUMED_SIGMA}), cut at {seq_len}")


def old_cost(items: Items, cfg, seq_len: int, rows: int, heldout: bool) -> tuple[int, float]:
  """(padded tokens, FLOPs) as the evaluator batched before this change: each task alone, 512
  rows at seq_len halved while the longest fits (never below 512), every held-out document at
  seq_len."""
  lengths = sorted(items.lengths, reverse=True)
  tokens, flops = 0, 0.0
  for start in range(0, len(lengths), rows):
    length = seq_len
    while not heldout and length % 2 == 0 and length // 2 >= max(lengths[start], OLD_SHORTEST):
      length //= 2
    tokens += rows * length
    flops += forward_flops(cfg, length, rows, items.choices is not None)
  return tokens, flops


@dataclasses.dataclass
class Cost:
  """Padded tokens (row-attributed, and padding rows of the pool's last batches), FLOPs."""

  padded: dict[str, int] = dataclasses.field(default_factory=dict)
  empty_rows: int = 0  # tokens of rows that hold nothing (the last batch of each pool)
  flops: float = 0.0
  batches: int = 0
  shapes: set[tuple[str, int]] = dataclasses.field(default_factory=set)


def forward_flops(cfg, length: int, rows: int, one_position: bool) -> float:
  """Forward FLOPs of `rows` x `length` tokens; with one_position the LM head runs once a row."""
  total = cfg.flops_per_token(length) / 3 * length * rows
  if one_position:
    total -= 2 * cfg.d_model * cfg.padded_vocab_size * (length - 1) * rows
  return total


def new_cost(groups: list[list[Items]], cfg, buckets, rows: int) -> Cost:
  """The evaluator's batching now: each list in `groups` is one pool (held-out sets, cloze
  tasks, multiple-choice tasks), batched together."""
  from olmo3.eval import tasks as tasks_lib

  cost = Cost()
  for pool in groups:
    if not pool:
      continue
    owners = [i for i, items in enumerate(pool) for _ in items.lengths]
    lengths = [n for items in pool for n in items.lengths]
    for indices, length in tasks_lib.plan(lengths, buckets, rows):
      for index in indices:
        name = pool[owners[index]].name
        cost.padded[name] = cost.padded.get(name, 0) + length
      cost.empty_rows += (rows - len(indices)) * length
      one = pool[0].choices is not None
      cost.flops += forward_flops(cfg, length, rows, one)
      cost.batches += 1
      cost.shapes.add((pool[0].program, length))
  return cost


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokenizer", default=None,
                      help="task tokenizer (default: the experiment's, allenai/dolma2-tokenizer)")
  parser.add_argument("--requests_cache", default=None)
  parser.add_argument("--heldout_root", default=None)
  parser.add_argument("--heldout_tokens_per_set", type=int, default=1_000_000)
  parser.add_argument("--mfu", type=float, default=0.445)
  parser.add_argument("--compile", default=None, help="a TPU topology, e.g. tpu7x:4x8x8")
  parser.add_argument("--smoke", action="store_true")
  args = parser.parse_args(argv)
  platforms.choose()
  import fiddle as fdl

  from experiments import olmo3_7b
  from olmo3 import flops as flops_lib
  from olmo3.eval import tasks as tasks_lib

  exp = fdl.build(olmo3_7b.stage1())
  if args.compile:  # as the launcher does before JAX starts: the compiler parses them
    from olmo3 import xla_flags

    xla_flags.apply_to_environ(exp.xla_flags, exp.libtpu_flags, exp.env)
  cfg, seq_len, rows = exp.model, exp.data.seq_len, exp.eval.batch_size
  labels, limit, tokenizer = exp.eval.tasks, None, args.tokenizer or exp.eval.tokenizer
  if args.smoke:  # the embedded tokenizer's ids are the tiny model's: only lengths are used
    labels, limit, tokenizer = ("arc_easy_test_bpb_5shot", "copycolors_10way_fast"), 20, "embedded"
    args.heldout_tokens_per_set = 20_000
  tasks = task_items(labels, tokenizer, seq_len, limit, args.requests_cache, cfg.eos_token_id,
                     cfg.pad_token_id)
  heldout, heldout_source = heldout_items(exp, args.heldout_root, args.heldout_tokens_per_set)
  buckets = tasks_lib.bucket_lengths(seq_len, cfg.attention)
  cost = new_cost([heldout, [t for t in tasks if t.choices is None],
                   [t for t in tasks if t.choices is not None]], cfg, buckets, rows)
  old_flops = 0.0
  print(f"held-out documents: {heldout_source}; tasks tokenized with {tokenizer}\n")
  print("| task / set | program | requests | real tokens | padded before | padded now "
        "| padding now |\n|---|---|---|---|---|---|---|")
  totals = {"real": 0, "before": 0, "now": cost.empty_rows}
  for items in heldout + tasks:
    real, now = sum(items.lengths), cost.padded[items.name]
    before, flops = old_cost(items, cfg, seq_len, rows, items in heldout)
    old_flops += flops
    totals["real"] += real
    totals["before"] += before
    totals["now"] += now
    print(f"| {items.name} | {items.program} | {len(items.lengths):,} | {real:,} | {before:,} "
          f"| {now:,} | {1 - real / now:.0%} |")
  print(f"| padding rows of the pools' last batches | | | | | {cost.empty_rows:,} | |")
  waste_before = 1 - totals["real"] / totals["before"]
  waste_now = 1 - totals["real"] / totals["now"]
  print(f"| **total** | | {sum(len(i.lengths) for i in heldout + tasks):,} | {totals['real']:,} "
        f"| {totals['before']:,} ({waste_before:.0%} padding) | {totals['now']:,} "
        f"({waste_now:.0%} padding) | |")

  peak = flops_lib.peak_flops_per_device(DEVICE_KIND)
  devices = DEVICES
  train_flops = cfg.flops_per_token(seq_len) * exp.tokens_per_step
  train_s = train_flops / (devices * peak * args.mfu)
  eval_s = cost.flops / (devices * peak * args.mfu)
  old_s = old_flops / (devices * peak * args.mfu)
  result = {
      "requests": sum(len(i.lengths) for i in tasks),
      "heldout_documents": sum(len(i.lengths) for i in heldout),
      "real_tokens": totals["real"], "padded_tokens_before": totals["before"],
      "padded_tokens_now": totals["now"], "padding_before": round(waste_before, 3),
      "padding_now": round(waste_now, 3), "programs": len(cost.shapes),
      "batches": cost.batches, "eval_pflop": round(cost.flops / 1e15, 1),
      "eval_pflop_before": round(old_flops / 1e15, 1),
      "train_step_pflop": round(train_flops / 1e15, 1),
      "eval_s": round(eval_s, 1), "eval_s_before": round(old_s, 1),
      "train_step_s": round(train_s, 2),
      "fraction_of_10k_steps": round(eval_s / (STEPS_BETWEEN * train_s), 6), "mfu": args.mfu,
  }
  print(f"\nOne evaluation: {cost.flops / 1e15:,.1f} PFLOP forward ({len(cost.shapes)} programs: "
        f"{sorted(cost.shapes)}); at {args.mfu:.1%} MFU on 512 TPU7x devices "
        f"{eval_s:,.1f} s (before: {old_s:,.1f} s) vs a train step's {train_s:.2f} s: "
        f"{result['fraction_of_10k_steps']:.4%} of the {STEPS_BETWEEN:,} steps between two.")
  if args.compile:
    from olmo3.placement import ShardedModel
    from olmo3.train import aot

    model = ShardedModel.for_experiment(exp, aot.topology_devices(args.compile))
    used: dict[str, list[int]] = {}
    for program, length in cost.shapes:
      used.setdefault(program, []).append(length)
    k = max((t.choices for t in tasks if t.choices), default=None)
    reports = []
    for program, lengths in sorted(used.items()):
      for length in sorted({min(lengths), max(lengths)}):
        report = aot.compile_eval_batch(exp, length, k if program == "choice_logprobs" else None,
                                        args.compile, model)
        reports.append(dataclasses.asdict(report))
        print(f"compiled {report.program} [{report.rows} x {report.length}] for {args.compile}: "
              f"{report.total_gb:.2f} GB per device (temporaries {report.temp_gb:.2f}) of "
              f"{report.hbm_gb} GB, in {report.compile_s:.0f} s", flush=True)
    result["compiled"] = reports
  print(json.dumps(result))
  return result
