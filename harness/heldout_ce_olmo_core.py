"""Held-out CE by OLMo-core's own LM evaluator and by olmo3's definition, from the same
per-token losses: how far apart the two are at each evaluation batch size, and whether
`python -m olmo3.eval.compare` restates ours as OLMo-core's exactly where it says it can.

  python benchmarks/heldout_ce_olmo_core.py [--batch_sizes 1,7,10,16,20,31,32,35] [--epoch 1]
      [--seq_len 256]

The documents: the embedded corpus's held-out split (31 documents), cut to the tiny stages'
256 tokens. The per-token losses: a unigram model of the corpus's training split (each
predicted token's -log of its add-one frequency there): a weak model but a real one, whose
loss differs from document to document as any model's does. Both sides score every predicted
token with it. OLMo-core's side is its own code: a `NumpyPaddedFSLDataset` of the file, the
`NumpyFSLDataLoader` that `LMEvaluator.from_numpy_dataset` builds (seed 0) at a global batch of
B documents, iterated as `EvaluatorCallback` iterates an evaluator (`--epoch E`: the E-th
evaluation of a job under ai2-olmo-core 2.4 and earlier, which reshuffled at each one), each
batch's un-reduced losses (0 where `get_labels` ignores a label, as cross-entropy gives) handed
to `LMEvaluator.update_metrics`. Ours: the same documents as olmo3's `HeldoutDocs` cuts them,
summed in float64 over the predicted tokens.

Per batch size: the documents OLMo-core left out, its CE, ours, ours x tokens / (tokens +
documents), and the verdict of `olmo3.eval.ce_definitions` (exact, or not comparable: which
documents were left out). Prints a table and one JSON line; exits 1 when a pair that
ce_definitions calls exact differs by more than 1e-5 (OLMo-core sums in float32), or when the
number of documents it says OLMo-core left out is not the number OLMo-core's loader left out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import unittest.mock

import numpy as np

from olmo3 import platforms

EXACT = 1e-5  # |OLMo-core's CE - ours restated| where the restatement is exact
PAD = 1  # any id: padding is masked on both sides


def olmo_core_heldout(sets: dict[str, list[str]], seq_len: int, eos: int, vocab_size: int,
                      loss_V: np.ndarray, batch_size: int, epoch: int, work_dir: str
                      ) -> tuple[dict[str, float], dict[str, int]]:
  """({set: OLMo-core's CE}, {set: documents it scored}) of `sets` ({label: token files}) in
  one LMEvaluator, at `epoch`'s evaluation (1: ai2-olmo-core 2.6 and later, always)."""
  import torch
  from olmo_core.data import DataCollator
  from olmo_core.data.numpy_dataset import NumpyPaddedFSLDataset
  from olmo_core.data.utils import get_labels
  from olmo_core.eval.lm_evaluator import LMEvaluator

  from olmo3.data.tokens import TOKEN_DTYPE

  paths = [p for files in sets.values() for p in files]
  labels = [name for name, files in sets.items() for _ in files]
  dataset = NumpyPaddedFSLDataset(*paths, sequence_length=seq_len, pad_token_id=PAD,
                                  eos_token_id=eos, vocab_size=vocab_size,
                                  dtype=TOKEN_DTYPE.type,
                                  metadata=[{"label": label} for label in labels])
  dataset.work_dir = work_dir
  # Its document index is written by a process pool: threads here, so nothing is started.
  with unittest.mock.patch.object(concurrent.futures, "ProcessPoolExecutor",
                                  concurrent.futures.ThreadPoolExecutor):
    evaluator = LMEvaluator.from_numpy_dataset(
        dataset, name="lm", global_batch_size=batch_size * seq_len,
        collator=DataCollator(pad_token_id=PAD), device=torch.device("cpu"),
        deterministic=epoch == 1)
  table = torch.as_tensor(loss_V, dtype=torch.float32)
  for _ in range(epoch):  # not deterministic: each pass reshuffles with the next epoch
    evaluator.reset_metrics()
    scored = dict.fromkeys(sets, 0)
    for batch in evaluator:
      label_ids = get_labels(batch)
      ignored = label_ids == -100
      evaluator.update_metrics(batch, torch.where(ignored, 0.0, table[label_ids.clamp(min=0)]),
                               None)
      for meta in batch["metadata"]:
        scored[meta["label"]] += 1
    metrics = evaluator.compute_metrics()
  return ({name: float(metrics[f"{name}/CE loss"]) for name in sets}, scored)


def olmo3_heldout(sets: dict[str, list[str]], seq_len: int, eos: int, loss_V: np.ndarray
                  ) -> dict[str, dict[str, float]]:
  """{set: what olmo3's evaluator logs of it (ce_loss, tokens, documents,
  documents_left_out)}, the per-token losses being `loss_V[label]`."""
  from olmo3.data.heldout import HeldoutDocs

  out = {}
  for name, paths in sets.items():
    docs = HeldoutDocs(paths, seq_len, eos, PAD)
    labels = docs.rows(range(len(docs)), seq_len, len(docs))["labels"]
    predicted = labels[labels >= 0]
    out[name] = {"ce_loss": float(loss_V[predicted].astype(np.float64).sum() / len(predicted)),
                 "tokens": float(len(predicted)), "documents": float(len(docs)),
                 "documents_left_out": float(docs.file_documents - len(docs))}
  return out


def unigram_losses(paths: list[str], vocab_size: int) -> np.ndarray:
  """-log of each token's add-one frequency in `paths`: a unigram model's per-token loss."""
  from olmo3.data.tokens import TOKEN_DTYPE

  counts = np.ones(vocab_size)
  for path in paths:
    counts += np.bincount(np.fromfile(path, TOKEN_DTYPE), minlength=vocab_size)
  return -np.log(counts / counts.sum())


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch_sizes", default="1,7,10,16,20,31,32,35",
                      help="OLMo-core's global evaluation batches, in documents")
  parser.add_argument("--epoch", type=int, default=1)
  parser.add_argument("--seq_len", type=int, default=256)
  args = parser.parse_args(argv)
  platforms.choose()
  from olmo3.data import sources
  from olmo3.eval import ce_definitions
  from olmo3.eval.metric_series import Source

  train = [f.path for f in sources.read_mix("embedded")]
  heldout = sources.by_set(sources.read_mix("embedded-heldout"))
  manifest = sources.prepared("embedded").manifest
  eos, vocab_size = manifest.eos_id, manifest.vocab_size
  loss_V = unigram_losses(train, vocab_size)
  ours = olmo3_heldout(heldout, args.seq_len, eos, loss_V)
  rows, failures = [], []
  print("| batch | left out | OLMo-core CE | ours | ours restated | restated - OLMo-core | "
        "compare says |\n|---|---|---|---|---|---|---|")
  with tempfile.TemporaryDirectory() as work_dir:
    for batch in (int(b) for b in args.batch_sizes.split(",")):
      theirs, scored = olmo_core_heldout(heldout, args.seq_len, eos, vocab_size, loss_V,
                                         batch, args.epoch, work_dir)
      for name, mine in ours.items():
        step = 1
        olmo3 = Source("ours", {f"eval/{name}/{k}": {step: v} for k, v in mine.items()})
        reference = Source("OLMo-core", {f"eval/{name}/ce_loss": {step: theirs[name]}},
                           frozenset({f"eval/{name}/ce_loss"}))
        restated = ce_definitions.restate(
            f"eval/{name}/ce_loss", olmo3, reference, [step],
            ce_definitions.OlmoCoreEvaluation(batch, args.epoch), "ours")
        left_out = int(mine["documents"]) - scored[name]
        predicted = ce_definitions.dropped_documents(
            (int(mine["documents"]),), batch, args.epoch)[0]
        delta = restated.values[step] - theirs[name]
        if predicted != left_out or (restated.comparable and abs(delta) > EXACT):
          failures.append(batch)
        verdict = "exact" if restated.comparable else "not comparable"
        rows.append({"batch": batch, "set": name, "left_out": left_out,
                     "olmo_core": theirs[name], "ours": mine["ce_loss"],
                     "restated": restated.values[step], "verdict": verdict})
        print(f"| {batch} | {left_out} of {mine['documents']:.0f} | {theirs[name]:.6f} | "
              f"{mine['ce_loss']:.6f} | {restated.values[step]:.6f} | {delta:+.6f} | "
              f"{verdict} |")
  print(json.dumps({"epoch": args.epoch, "seq_len": args.seq_len, "rows": rows,
                    "failures": failures}))
  return 1 if failures else 0
