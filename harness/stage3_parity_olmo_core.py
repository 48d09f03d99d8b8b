"""Stage 3's training steps against AI2's trainer code: YaRN, packed documents, attention within
each document, side by side with OLMo-core's own TransformerTrainModule.

  python benchmarks/stage3_parity_olmo_core.py [--dtype float32|float64] [--steps 30]
      [--batch 4] [--seq_len 256] [--original_context 64] [--rope_positions instance|document]
      [--peak_lr 2.0712352850360292e-4] [--ranks 1|2]

AI2's stage 3 (OLMo-3-1025-7B-long-context.py), shrunk: an OLMo 3 with YaRN (factor 8,
beta_fast 32, beta_slow 1) over an original context of --original_context tokens on its
full-attention layers (OLMo-core's `with_rope_scaling`, through olmo3.convert.olmo_core_params),
run at --seq_len (>= 4x that); token files whose documents (each ending at the EOS) are packed
into instances by OLMo-core's own NumpyPackedFSLDataset (generate_doc_lengths, source groups of 2
files shuffled with seed 123, long documents truncated) and ordered by its own data loader (seed
34521), whose collator hands the module `doc_lens` / `max_doc_lens` as AI2's trainer did; the
stage-3 optimizer: SkipStepAdamW (0.9, 0.95, eps 1e-8, weight decay 0.1 except the input
embedding, the 128-step skip window), clipping at 1.0, z-loss 1e-5, AI2's peak LR
2.0712352850360292e-4 with LinearWithWarmup to 0 (10 warmup steps over a 40-step layout: the
recipe's 200 of 11,921, shrunk), each step's batch in 2 micro-batches. Our side:
olmo3.train.step.jit_train_step on the same initial weights, fed by olmo3's own packed loader
(olmo3.data.packing through olmo3.data.pipeline.Loader); every step's instances (tokens),
labels and document lengths are checked equal to OLMo-core's batches.

--ranks 2 runs OLMo-core's trainer as AI2's stage 3 ran it, on data-parallel ranks: one
process per rank (spawned here, a gloo process group, the environment torchrun gives), DDP
averaging the ranks' gradients, each rank fed by its own OLMo-core loader (dp_world_size=2,
dp_rank=r: rows r, r + 2, ... of each global batch, checked against ours), each dividing its
loss by its own count of trained labels (the instances' padding differs, so the counts do:
`steps_with_unequal_rank_counts`). Ours runs on one device with train.loss_ranks=2; at each
step it also takes the loss and gradient norm of one global token mean (`LossMean.GLOBAL`, the
mutation) at the same parameters: their largest differences from OLMo-core's ranks are in
`global_mean` (with the step and its ranks' label counts), and must exceed the tolerances.
At 10x that LR (--peak_lr) float32 rounding grows with the fast fall of the loss past the
float32 tolerance over 30 steps (benchmarks/RESULTS.md); float64 agrees to 1e-13 there too.

Intra-document attention: OLMo-core masks attention by document only in flash-attn's
variable-length kernel (its torch SDPA backend refuses document lengths), and flash-attn runs
only on CUDA. So OLMo-core's model is built with the flash_2 backend, AI2's, and
harness/flash_attn_standin (an exact CPU stand-in of flash-attn 2's functions, tested against a
dense masked softmax in tests/test_flash_attn_standin.py) is put first on sys.path while it
runs: OLMo-core's own varlen path (`cu_doc_lens`, the windows (w - 1, 0) of its sliding layers)
runs on the CPU. The stand-in is removed afterwards.

RoPE positions follow the installed OLMo-core: 2.4.0, the version AI2 ran stage 3 with,
rotates by the position in the instance whatever the documents (`RopePositions.INSTANCE`, the
recipe's); 3.0.0 restarts positions at each document when document lengths reach the model
without context parallelism (its intra-document RoPE: `RopePositions.DOCUMENT`). The installed
version picks ours; --rope_positions forces the other one. Measured (benchmarks/RESULTS.md): it
changes nothing beyond rounding. RoPE rotates q and k alike, so a score depends on the two
positions' difference only, and with attention kept within documents that difference is the
same whether positions restart at each document or not: the two conventions give the same
model in exact arithmetic, and differ only in how the angles of larger positions round.

--dtype float64 runs both sides in float64 as harness/train_parity_olmo_core.py does (its
docstring lists the float32 casts taken out of OLMo-core there), the override blocks that carry
YaRN included. YaRN's ramp over the dimensions is computed by OLMo-core in float32 whatever the
dtype (`torch.arange(..., dtype=torch.float32)` in `compute_scaled_inv_freq`); in float64 every
float32 `arange` of OLMo-core's rope module is made float64 (which also covers the plain
frequencies that benchmark patches), so the float64 run shows differences below float32's.

Prints per-step loss, grad norm and LR from both, then one JSON object: steps,
max_abs_loss_diff, max_rel_grad_norm_diff, max_abs_lr_diff, skip_decisions_equal,
instances_equal, label_masks_equal (our labels are get_labels' of OLMo-core's batch),
doc_lengths_equal, documents_per_row (segments per instance, padding one of
them), first_loss, last_loss, olmo_core_version, rope_positions (ours),
olmo_core_rope_positions (what the installed OLMo-core does), ranks,
rank_label_counts_first_step, steps_with_unequal_rank_counts, global_mean (--ranks > 1),
within (the dtype's tolerances and the data checks; at several ranks also unequal counts and
the mutation caught); exits 1 when it is false.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import socket
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

# Its pieces shared here: OLMo-core's trainer stand-in, the float64 changes to its model and
# optimizer, the comparison, the table of each step.
from harness import train_parity_olmo_core as bench

HERE = pathlib.Path(__file__).resolve().parent
FLASH_ATTN_STANDIN = HERE / "flash_attn_standin"
EOS, PAD = 0, 1  # olmo3_micro's ids; documents' tokens are drawn from 2..vocab-1
GROUP_SIZE, PERMUTATION_SEED, DATA_SEED = 2, 123, 34521
SCHEDULE_STEPS, WARMUP_STEPS = 40, 10  # the LR's layout: stage 3's 200 of 11,921, shrunk
PEAK_LR = 2.0712352850360292e-4  # AI2's stage 3's (and stage 2's)
MICROBATCHES = 2
TOLERANCES = {"float32": {"max_abs_loss_diff": 1e-5, "max_rel_grad_norm_diff": 1e-4,
                          "max_abs_lr_diff": 1e-9},
              "float64": {"max_abs_loss_diff": 1e-9, "max_rel_grad_norm_diff": 1e-8,
                          "max_abs_lr_diff": 1e-15}}


def olmo_core_version() -> str:
  return importlib.metadata.version("ai2-olmo-core")


def olmo_core_rope_positions(version: str):
  """What the installed OLMo-core's RoPE does with a packed batch (no context parallelism):
  3.0.0 and later restart positions at every document; before it (2.4.0, AI2's stage 3),
  positions run across the instance."""
  from olmo3.config import RopePositions

  major = int(version.split(".")[0])
  return RopePositions.DOCUMENT if major >= 3 else RopePositions.INSTANCE


def write_corpus(directory: pathlib.Path, n_tokens: int, seq_len: int, vocab: int) -> list[str]:
  """Six token files of documents (each ending at the EOS): mostly short ones, some near an
  instance's length, some longer (truncated by the packing); noisy windows of one repeating
  sequence, so the loss falls."""
  from olmo3.data import tokens

  directory.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(7)
  base = rng.integers(2, vocab, 97)
  stream = np.tile(base, (3 * seq_len) // 97 + 2)
  paths = []
  for f in range(6):
    docs, total = [], 0
    while total < n_tokens // 6:
      kind = rng.random()
      n = int(rng.integers(2, seq_len // 4) if kind < 0.6 else
              rng.integers(seq_len // 4, seq_len) if kind < 0.9 else
              rng.integers(seq_len + 1, 2 * seq_len))
      start = int(rng.integers(0, 97))
      doc = stream[start:start + n - 1].copy()
      noise = rng.random(n - 1) < 0.05
      doc[noise] = rng.integers(2, vocab, int(noise.sum()))
      docs.append(np.append(doc, EOS))
      total += n
    path = directory / f"part-{f}.npy"
    tokens.write_token_file(path, np.concatenate(docs))
    paths.append(str(path))
  return paths


def _experiment(args, paths: list[str]):
  from olmo3 import config
  from olmo3.config import (DataConfig, DType, Experiment, OptimizerConfig, Packing, Schedule,
                            TrainConfig)

  model = config.olmo3_micro().replace(
      d_model=128, n_heads=4, n_kv_heads=2, sliding_window=48, max_seq_len=args.seq_len,
      compute_dtype=DType(args.dtype), rope_positions=args.rope_positions,
      rope_scaling=config.Yarn(factor=8.0, beta_fast=32.0, beta_slow=1.0,
                               original_context=args.original_context))
  optimizer = OptimizerConfig(
      peak_lr=args.peak_lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, no_decay=("embed_tokens",),
      clip_grad_norm=1.0, schedule=Schedule.LINEAR, warmup_steps=WARMUP_STEPS, final_lr=0.0,
      decay_steps=SCHEDULE_STEPS, skip_spikes=True, spike_sigma=6.0, spike_window=128,
      spike_min_history=64)
  data = DataConfig(paths=tuple(paths), seq_len=args.seq_len, max_target_seq_len=None,
                    global_batch_size=args.batch, seed=DATA_SEED,
                    packing=Packing(source_group_size=GROUP_SIZE,
                                    source_permutation_seed=PERMUTATION_SEED))
  return Experiment(model=model, data=data, optimizer=optimizer,
                    train=TrainConfig(steps=args.steps, z_loss_weight=1e-5,
                                      microbatches=MICROBATCHES, loss_ranks=args.ranks))


def olmo_core_batches(exp, work_dir: pathlib.Path, ranks: int = 1,
                      paths: list[str] | None = None) -> tuple[list[list[dict[str, Any]]], int]:
  """(batches, batches per epoch): the first exp.train.steps batches of OLMo-core's own packed
  dataset and data loader over `paths` (default exp.data.paths; their label masks when they
  have them, as AI2's SFT script passes label_mask_paths), as its collator makes them
  (input_ids, label_mask, doc_lens, max_doc_lens, ...): per step, each of `ranks` data-parallel
  ranks' batch as its loader hands it over (dp_world_size=ranks, dp_rank=r: rank r's share of
  each global batch), epoch after epoch as its Trainer goes on (reshuffle(epoch), then reset()).
  Its prepare() packs each source group in a process pool; here each group is packed in this
  process by the method the pool would run, after which prepare() finds the work_dir files
  and starts nothing."""
  from olmo_core.data import DataCollator, NumpyDataLoaderBase, TokenizerConfig
  from olmo_core.data.numpy_dataset import NumpyPackedFSLDatasetConfig

  from olmo3.data import label_masks

  d, m = exp.data, exp.model
  paths = list(d.paths) if paths is None else list(paths)
  masks = label_masks.masks_of(paths)
  dataset = NumpyPackedFSLDatasetConfig(
      paths=paths, label_mask_paths=None if None in masks else masks,
      tokenizer=TokenizerConfig(vocab_size=m.vocab_size, eos_token_id=m.eos_token_id,
                                pad_token_id=m.pad_token_id),
      dtype="uint32", sequence_length=d.seq_len, generate_doc_lengths=True,
      long_doc_strategy=d.packing.long_documents.value,
      source_group_size=d.packing.source_group_size,
      source_permutation_seed=d.packing.source_permutation_seed,
      work_dir=str(work_dir)).build()
  for group in dataset._source_path_groups:
    dataset._pack_documents_from_source_into_instances(*group)
  dataset.prepare()
  by_rank = []
  for rank in range(ranks):
    loader = NumpyDataLoaderBase.wrap_numpy_dataset(
        dataset, collator=DataCollator(pad_token_id=m.pad_token_id),
        global_batch_size=d.global_batch_size * d.seq_len, work_dir=str(work_dir), seed=d.seed,
        dp_world_size=ranks, dp_rank=rank)
    batches = []
    for epoch in itertools.count(1):  # the Trainer's epochs
      loader.reshuffle(epoch=epoch)
      batches += itertools.islice(loader, exp.train.steps - len(batches))
      loader.reset()
      if len(batches) == exp.train.steps:
        break
    by_rank.append(batches)
  return [list(step) for step in zip(*by_rank)], loader.total_batches


def rank_label_counts(theirs: list[list[dict[str, Any]]]) -> list[list[int]]:
  """Per step, each rank's count of trained labels as OLMo-core's train module takes it."""
  from olmo_core.data.utils import get_labels

  return [[int((get_labels(dict(b)) != -100).sum()) for b in step] for step in theirs]


def _run_lengths(row: np.ndarray) -> list[int]:
  edges = np.flatnonzero(np.diff(row)) + 1
  return np.diff(np.concatenate([[0], edges, [len(row)]])).tolist()


def check_batches(ours_: list[dict[str, np.ndarray]], theirs: list[list[dict[str, Any]]]
                  ) -> dict[str, bool]:
  """Our global batches (input_ids, labels, segments per step) against OLMo-core's ranks'
  batches of the same steps, rows r, r + ranks, ... being rank r's (its loader's strided
  share): instances_equal (the token ids), label_masks_equal (our labels are the labels
  OLMo-core's get_labels makes of its batch: its label_mask, padding, the shift) and
  doc_lengths_equal (our segments' lengths are its collated doc_lens)."""
  from olmo_core.data.utils import get_labels

  checks = {"instances_equal": len(ours_) == len(theirs), "label_masks_equal": True,
            "doc_lengths_equal": True}
  for batch, ranks in zip(ours_, theirs):
    tokens, labels, segments = batch["input_ids"], batch["labels"], batch["segments"]
    for r, other in enumerate(ranks):
      share = slice(r, None, len(ranks))
      checks["instances_equal"] &= bool(np.array_equal(tokens[share], other["input_ids"].numpy()))
      checks["label_masks_equal"] &= bool(np.array_equal(
          np.where(labels[share] < 0, -100, labels[share]), get_labels(dict(other)).numpy()))
      checks["doc_lengths_equal"] &= all(
          _run_lengths(s) == np.trim_zeros(np.asarray(lens), "b").tolist()
          for s, lens in zip(segments[share], other["doc_lens"]))
  return checks


def packed_source(exp):
  """olmo3's packed instances over exp.data.paths (olmo3.data.packing), as stage 3 packs them."""
  from olmo3.data import packing

  d, m = exp.data, exp.model
  index = packing.PackedIndex.build(
      d.paths, seq_len=d.seq_len, eos_token_id=m.eos_token_id,
      source_group_size=d.packing.source_group_size,
      source_permutation_seed=d.packing.source_permutation_seed,
      long_doc_strategy=d.packing.long_documents.value)
  return packing.PackedInstances(index, pad_token_id=m.pad_token_id, vocab_size=m.vocab_size)


@dataclasses.dataclass(frozen=True)
class Mutation:
  """A wrong definition, evaluated at each step's parameters and batch (the difference of two
  definitions at that step, not of two runs that drifted apart): the loss of `exp` (its train
  config: e.g. LossMean.GLOBAL) on our batch, its labels those of `source`'s batch of the same
  step when given (the same instances read otherwise: e.g. without their label masks)."""
  name: str
  exp: Any
  source: Any = None


def ours(exp, source, steps: int, mutations: tuple[Mutation, ...] = ()
         ) -> tuple[dict, list[dict], list[dict[str, np.ndarray]]]:
  """(initial parameters as numpy, per-step rows, each step's global batch as numpy: input_ids,
  labels, segments) from our train step fed by olmo3's loader (olmo3.data.pipeline.Loader,
  as the launcher's loop builds it) over `source`, for `steps` steps. Each row also holds, per
  mutation, the loss and gradient norm it gives at the same parameters and batch
  (`mutations`: {name: {loss, grad_norm}})."""
  import jax
  import optax

  from olmo3.config import DType
  from olmo3.data import pipeline
  from olmo3.placement import ShardedModel
  from olmo3.train.state import StateLayout
  from olmo3.train.step import jit_train_step, loss_and_grads

  d, m = exp.data, exp.model
  rows, batches = [], []
  with jax.enable_x64(m.compute_dtype == DType.FLOAT64):
    model = ShardedModel.for_experiment(exp, jax.devices()[:1])
    layout = StateLayout(exp, model)
    step = jit_train_step(exp, model, layout)

    def loader(instances):
      return iter(pipeline.Loader(d, model.batch_sharding, start_step=0, num_steps=steps,
                                  source=instances, microbatches=exp.train.microbatches))

    def evaluate(mutation: Mutation):
      @jax.jit
      def loss_and_norm(params, batch):
        (loss, _), grads = loss_and_grads(mutation.exp, model.token_losses, model.param_shardings,
                                          params, batch)
        return loss, optax.global_norm(grads)
      return loss_and_norm

    evaluated = [(mu, evaluate(mu), None if mu.source is None else loader(mu.source))
                 for mu in mutations]
    with model.context():
      state = layout.fresh()
      initial = jax.tree.map(np.asarray, state.params)
      for batch in loader(source):
        batches.append({k: np.asarray(batch[k]) for k in ("input_ids", "labels", "segments")})
        extra = {}
        for mu, loss_and_norm, other in evaluated:  # before the step, which donates the state
          given = batch
          if other is not None:
            relabelled = next(other)
            assert np.array_equal(np.asarray(relabelled["input_ids"]), batches[-1]["input_ids"])
            given = {**batch, "labels": relabelled["labels"]}
          loss, norm = jax.device_get(loss_and_norm(state.params, given))
          extra[mu.name] = {"loss": float(loss), "grad_norm": float(norm)}
        state, metrics = step(state, batch)
        got = jax.device_get(metrics)
        rows.append({"loss": float(got["loss"]), "grad_norm": float(got["grad_norm"]),
                     "lr": float(got["lr"]), "skipped": bool(got["skipped"]),
                     "mutations": extra})
  return initial, rows, batches


def documents_per_row(batches: list[dict[str, np.ndarray]]) -> float:
  """Segments per instance over the run (padding counts as one)."""
  return float(np.mean([len(_run_lengths(s)) for b in batches for s in b["segments"]]))


def mutation_diffs(name: str, our_rows: list[dict], their_rows: list[dict],
                   counts: list[list[int]]) -> dict[str, Any]:
  """How far mutation `name`, at each step's parameters, is from OLMo-core's step: its largest
  |loss difference| and relative grad-norm difference, the step of the latter and its ranks'
  label counts."""
  mutated = [x["mutations"][name] for x in our_rows]
  loss_diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(mutated, their_rows)]
  norm_diffs = [abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"]
                for x, y in zip(mutated, their_rows)]
  worst = int(np.argmax(norm_diffs))
  return {"max_abs_loss_diff": max(loss_diffs), "max_rel_grad_norm_diff": max(norm_diffs),
          "at_step": worst + 1, "rank_label_counts_there": counts[worst]}


def print_mutation(what: str, diffs: dict[str, Any]) -> None:
  print(f"{what}, at each step's parameters: max |loss diff| {diffs['max_abs_loss_diff']:.3e}, "
        f"max rel grad-norm diff {diffs['max_rel_grad_norm_diff']:.3e} (step "
        f"{diffs['at_step']}, rank label counts {diffs['rank_label_counts_there']})")


def caught(diffs: dict[str, Any], tolerances: dict[str, float]) -> bool:
  """Whether a mutation's differences exceed the dtype's tolerances (loss or grad norm)."""
  return (diffs["max_abs_loss_diff"] > tolerances["max_abs_loss_diff"]
          or diffs["max_rel_grad_norm_diff"] > tolerances["max_rel_grad_norm_diff"])


@contextlib.contextmanager
def flash_attn_standin() -> Iterator[None]:
  """OLMo-core's flash-attn 2 backend, served by harness/flash_attn_standin: the stand-in first
  on sys.path and OLMo-core's flash_attn_api module reloaded, so that its own `import
  flash_attn` runs again and finds it (the backend classes read the module's globals, which a
  reload updates in place). Afterwards the stand-in leaves and the module is reloaded without
  it, as before."""
  from olmo_core.nn.attention import flash_attn_api

  saved = sys.modules.pop("flash_attn", None)
  sys.path.insert(0, str(FLASH_ATTN_STANDIN))
  try:
    importlib.reload(flash_attn_api)
    served = pathlib.Path(flash_attn_api.flash_attn_2.__file__).resolve()
    assert served.is_relative_to(FLASH_ATTN_STANDIN.resolve()), served
    yield
  finally:
    sys.path.remove(str(FLASH_ATTN_STANDIN))
    sys.modules.pop("flash_attn", None)
    if saved is not None:
      sys.modules["flash_attn"] = saved
    importlib.reload(flash_attn_api)


def _blocks(tc, change):
  """OLMo-core's transformer config with `change` applied to its block and to every override
  block (with_rope_scaling's copies for the YaRN layers)."""
  overrides = {i: change(b) for i, b in (tc.block_overrides or {}).items()} or None
  return dataclasses.replace(tc, block=change(tc.block), block_overrides=overrides)


def _flash_attention(block):
  from olmo_core.nn.attention import AttentionBackendName

  from olmo3.convert.olmo_core_params import attention_field

  field = attention_field(block)
  mixer = dataclasses.replace(getattr(block, field), backend=AttentionBackendName.flash_2)
  return dataclasses.replace(block, **{field: mixer})


def _float64_block(tc):
  """train_parity's float64 model config applied to one block config (its RMSNorms' and
  RoPE's float32 casts off)."""
  return lambda block: bench._float64_model_config(dataclasses.replace(tc, block=block)).block


class _Float64Arange:
  """OLMo-core's rope module's view of torch in float64 runs: what it would make a float32
  arange (the frequencies' exponents, YaRN's ramp over the dimensions, the positions) is
  float64."""

  def __getattr__(self, name: str) -> Any:
    import torch

    return getattr(torch, name)

  @staticmethod
  def arange(*args, dtype=None, **kwargs):
    import torch

    if dtype in (torch.float32, torch.float):
      dtype = torch.float64
    return torch.arange(*args, dtype=dtype, **kwargs)


def _build_with_flash_attention(tc):
  """OLMo-core's model on the CPU with the flash_2 backend in every layer. OLMo-core 3.0.0
  swaps a flash backend for torch's when CUDA is absent (with a warning), so CUDA is reported
  present while the attention modules are built (nothing else runs then: the weights are
  created on the CPU); 2.4.0 builds what it is told."""
  import unittest.mock

  import torch
  from olmo_core.nn.attention.backend import FlashAttention2Backend

  with unittest.mock.patch.object(torch.cuda, "is_available", lambda: True):
    model = tc.build(init_device="cpu")
  backends = {type(b.attention.backend).__name__ for b in model.blocks.values()}
  assert backends == {FlashAttention2Backend.__name__}, backends
  return model


def olmo_core_run(exp, initial: dict, theirs: list[list[dict[str, Any]]], max_steps: int
                  ) -> list[dict]:
  """The same run through OLMo-core's TransformerTrainModule on as many data-parallel ranks as
  `theirs` has batches a step, its Trainer's max_steps (the schedule's length) `max_steps`: in
  this process for one; for more, one process per rank over gloo (`_rank_process`), each fed
  its own loader's batches, and the loss of a step the mean of the ranks' losses (what the
  module logs: its all-reduce mean)."""
  ranks = len(theirs[0])
  if ranks == 1:
    return _olmo_core_rank(exp, initial, [step[0] for step in theirs], ranks, max_steps)
  context = multiprocessing.get_context("spawn")  # torch and JAX are not fork-safe
  with socket.socket() as s:  # a free port for the process group's rendezvous
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  with tempfile.TemporaryDirectory() as tmp:
    outs = [pathlib.Path(tmp) / f"rank{r}.json" for r in range(ranks)]
    processes = [context.Process(target=_rank_process, args=(
        r, ranks, port, exp, initial, [step[r] for step in theirs], max_steps, str(outs[r])))
                 for r in range(ranks)]
    for p in processes:
      p.start()
    pending = list(processes)
    while pending:  # a rank that fails leaves the others waiting in a collective: end them
      multiprocessing.connection.wait([p.sentinel for p in pending])
      ended = [p for p in pending if not p.is_alive()]
      pending = [p for p in pending if p.is_alive()]
      if any(p.exitcode for p in ended):
        for p in pending:
          p.terminate()
          p.join()
        raise RuntimeError("OLMo-core's ranks failed: exit codes "
                           f"{[p.exitcode for p in processes]}")
    per_rank = [json.loads(out.read_text()) for out in outs]
  rows = []
  for step in zip(*per_rank):
    first = step[0]
    if any((r["grad_norm"], r["lr"], r["skipped"]) != (first["grad_norm"], first["lr"],
                                                        first["skipped"]) for r in step):
      raise RuntimeError(f"OLMo-core's ranks disagree after the all-reduce: {step}")
    rows.append({**first, "loss": float(np.mean([r["loss"] for r in step]))})
  return rows


def _rank_process(rank: int, ranks: int, port: int, exp, initial: dict,
                  batches: list[dict[str, Any]], max_steps: int, out: str) -> None:
  """One data-parallel rank of OLMo-core's trainer, in its own process, as torchrun starts
  one: the environment it sets, a gloo process group; its rows written to `out` as JSON."""
  import torch.distributed as dist

  os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(ranks), NUM_NODES="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port))
  dist.init_process_group("gloo")
  try:
    pathlib.Path(out).write_text(json.dumps(
        _olmo_core_rank(exp, initial, batches, ranks, max_steps)))
  finally:
    dist.destroy_process_group()


def _scheduler(o):
  """OLMo-core's LinearWithWarmup as the recipe gives it: a warmup of optimizer.warmup_steps, or
  of optimizer.warmup_fraction of the run (OLMo-core rounds it from its Trainer's max_steps)."""
  from olmo_core.optim import LinearWithWarmup

  from olmo3.config import Schedule

  assert o.schedule is Schedule.LINEAR, o.schedule
  warmup = ({"warmup": o.warmup_steps} if o.warmup_fraction is None
            else {"warmup_fraction": o.warmup_fraction})
  return LinearWithWarmup(alpha_f=o.final_lr / o.peak_lr, **warmup)


def _olmo_core_rank(exp, initial: dict, batches: list[dict[str, Any]], ranks: int,
                    max_steps: int) -> list[dict]:
  """One rank's run through OLMo-core's TransformerTrainModule: its model (flash_2 backend,
  YaRN override blocks), its loss over the collated batches' labels (divided by this rank's
  own count of trained labels), micro-batches, clipping, SkipStepAdamW (weight decay off for
  the input embedding when the recipe decays the others) and LinearWithWarmup (`_scheduler`),
  z-loss when the recipe has it.
  Several ranks: DDP over the process group (AI2 ran HSDP; both average the ranks' gradients,
  which is all the loss sees), each rank's batch its share of the global one, in micro-batches
  of global / ranks / train.microbatches instances (one at 2 ranks: stage 3's
  rank_microbatch_size=sequence_length)."""
  import unittest.mock

  import torch
  from olmo_core.distributed.parallel import DataParallelType
  from olmo_core.nn import lm_head, rope
  from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig
  from olmo_core.train.train_module import (TransformerDataParallelConfig, TransformerTrainModule,
                                            TransformerTrainModuleConfig)

  from olmo3.config import DType
  from olmo3.convert import olmo_core_params

  float64 = exp.model.compute_dtype == DType.FLOAT64
  o, d = exp.optimizer, exp.data
  outputs = []  # each micro-batch's loss as the model returns it
  Recorded = bench.recording(TransformerTrainModule, outputs)
  config = TransformerTrainModuleConfig(
      rank_microbatch_size=d.global_batch_size * d.seq_len // ranks // exp.train.microbatches,
      max_sequence_length=d.seq_len,
      optim=SkipStepAdamWConfig(
          lr=o.peak_lr, weight_decay=o.weight_decay, betas=(o.b1, o.b2), eps=o.eps,
          group_overrides=[OptimGroupOverride(params=["embeddings.weight"],
                                              opts={"weight_decay": 0.0})]
          if o.weight_decay and "embed_tokens" in o.no_decay else None,
          rolling_interval_length=o.spike_window, sigma_factor=int(o.spike_sigma)),
      scheduler=_scheduler(o), z_loss_multiplier=exp.train.z_loss_weight or None,
      max_grad_norm=o.clip_grad_norm,
      dp_config=TransformerDataParallelConfig(name=DataParallelType.ddp) if ranks > 1 else None)
  trainer = bench._Trainer(global_batch_size=d.global_batch_size * d.seq_len,
                           max_steps=max_steps)
  rows = []
  with bench._one_torch_thread(), flash_attn_standin(), contextlib.ExitStack() as patches:
    if float64:
      patches.enter_context(unittest.mock.patch.object(
          lm_head, "cross_entropy_loss", bench._float64_cross_entropy))
      patches.enter_context(unittest.mock.patch.object(rope, "torch", _Float64Arange()))
    torch.manual_seed(0)
    tc = _blocks(olmo_core_params.transformer_config(exp.model), _flash_attention)
    if float64:
      tc = _blocks(bench._float64_model_config(tc), _float64_block(tc))
    model = _build_with_flash_attention(tc)
    module = Recorded(model=model.to(torch.float64) if float64 else model,
                      device=torch.device("cpu"),
                      **config.as_dict(exclude_none=True, recurse=False))
    module.model.load_state_dict(olmo_core_params.state_dict(exp.model, initial))
    if float64:
      bench._float64_state(module.optim)
    trainer.dp_process_group = module.dp_process_group  # None on one rank
    module._attach_trainer(trainer)
    module.pre_train()
    module.zero_grads()
    for batch in batches:
      trainer.global_step += 1
      trainer.metrics.clear()
      outputs.clear()
      rows.append(bench.olmo_core_step(module, trainer, outputs, batch))
  return rows


def main(argv: list[str] | None = None) -> dict:
  from olmo3.config import RopePositions

  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--batch", type=int, default=4, help="instances per step")
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--original_context", type=int, default=64,
                      help="YaRN's original context (the run's is --seq_len)")
  parser.add_argument("--dtype", choices=sorted(TOLERANCES), default="float32")
  parser.add_argument("--peak_lr", type=float, default=PEAK_LR)
  parser.add_argument("--rope_positions", choices=[p.value for p in RopePositions],
                      default=None, help="ours; default: what the installed OLMo-core does")
  parser.add_argument("--ranks", type=int, default=1,
                      help="OLMo-core's data-parallel ranks (>1: processes over gloo); ours "
                           "runs on one device with train.loss_ranks set to it")
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: both sides on the CPU
  from olmo3 import platforms
  from olmo3.config import LossMean

  platforms.choose()
  version = olmo_core_version()
  expected = olmo_core_rope_positions(version)
  args.rope_positions = RopePositions(args.rope_positions or expected)
  with tempfile.TemporaryDirectory() as tmp:
    directory = pathlib.Path(tmp)
    paths = write_corpus(directory, int(1.5 * args.steps * args.batch * args.seq_len),
                         args.seq_len, vocab=500)
    exp = _experiment(args, paths)
    theirs, _ = olmo_core_batches(exp, directory / "work", args.ranks)
    # At several ranks, the mutation: one global token mean where OLMo-core's ranks each take
    # theirs, evaluated at every step's parameters.
    mutations = (Mutation("global_mean", dataclasses.replace(exp, train=dataclasses.replace(
        exp.train, loss_mean=LossMean.GLOBAL))),) if args.ranks > 1 else ()
    initial, our_rows, batches = ours(exp, packed_source(exp), args.steps, mutations)
    checks = {**check_batches(batches, theirs), "documents_per_row": documents_per_row(batches)}
    their_rows = olmo_core_run(exp, initial, theirs, exp.optimizer.decay_steps)
  bench.print_rows(our_rows, their_rows, args.dtype)
  counts = rank_label_counts(theirs)
  result = {"dtype": args.dtype, **bench.compare(our_rows, their_rows), **checks,
            "first_loss": their_rows[0]["loss"], "last_loss": their_rows[-1]["loss"],
            "seq_len": args.seq_len, "original_context": args.original_context,
            "peak_lr": args.peak_lr,
            "olmo_core_version": version, "rope_positions": args.rope_positions.value,
            "olmo_core_rope_positions": expected.value, "ranks": args.ranks,
            "rank_label_counts_first_step": counts[0],
            "steps_with_unequal_rank_counts": sum(len(set(c)) > 1 for c in counts)}
  tolerances = TOLERANCES[args.dtype]
  result["within"] = (result["skip_decisions_equal"] and checks["instances_equal"]
                      and checks["label_masks_equal"] and checks["doc_lengths_equal"] and all(
                          result[k] <= bound for k, bound in tolerances.items()))
  if args.ranks > 1:
    result["global_mean"] = mutation_diffs("global_mean", our_rows, their_rows, counts)
    print_mutation(f"ours with one global token mean against OLMo-core's {args.ranks} ranks",
                   result["global_mean"])
    # The comparison can see the mean: the ranks' counts differ, and the global mean fails it.
    result["within"] &= (result["steps_with_unequal_rank_counts"] > 0
                         and caught(result["global_mean"], tolerances))
  print(json.dumps(result))
  return result
