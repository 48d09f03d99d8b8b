"""olmo3.data.overlap: each held-out document's share of n-grams found in training tokens, the
documents that must leave a held-out split, and `launch/audit.py --overlap` on the tiny run."""

import json
import os

import numpy as np
import pytest

from olmo3.data import embedded, manifest as manifest_lib, overlap, prepare
from olmo3.data.tokens import write_token_file
from tests import forked

EOS = 0
N = overlap.NGRAM


def _words(seed: int, count: int) -> np.ndarray:
  """Random token ids (no EOS): documents that share no n-gram by chance."""
  return np.random.default_rng(seed).integers(2, 50_000, count).astype(np.uint32)


def _stream(*documents) -> np.ndarray:
  """Training tokens: the documents, each ended by EOS."""
  return np.concatenate([np.append(d, EOS).astype(np.uint32) for d in documents])


def _shares(held, training, **scan) -> list[float]:
  index = overlap.Index()
  for doc in held:
    index.add(doc)
  index.scan(training, EOS, **scan)
  return index.shares().tolist()


def test_a_share_counts_the_documents_ngrams_found_in_training_and_none_across_an_eos():
  doc = _words(0, 100)  # 88 distinct 13-grams
  other = _words(1, 300)
  assert _shares([doc], _stream(other, doc[:60], other[:40])) == [48 / 88]
  assert _shares([doc], _stream(other, doc)) == [1.0]
  # Cut in two by an EOS: the 12 n-grams across the cut are no n-grams of training's.
  assert _shares([doc], _stream(doc[:50], doc[50:])) == [76 / 88]
  assert _shares([doc], _stream(other)) == [0.0]


def test_a_document_shorter_than_an_ngram_is_found_only_as_an_exact_copy():
  short, other = np.array([5, 6, 7], np.uint32), _words(2, 40)
  assert _shares([short], _stream(other, [9, 5, 6, 7, 8], other)) == [0.0]  # inside another
  assert _shares([short], _stream(other, short, other)) == [1.0]
  # A stretch cut from a longer stream: its first document may be the tail of a longer one.
  assert _shares([short], _stream(short, other), whole_first=False) == [0.0]
  assert _shares([short], _stream(short, other), whole_first=True) == [1.0]


def test_a_scan_in_chunks_finds_what_one_scan_finds(monkeypatch):
  held = [_words(i, n) for i, n in ((3, 40), (4, 100), (5, 14))] + [np.array([8, 9], np.uint32)]
  # Copies of parts of them, and the short one whole, wherever the chunks are cut.
  training = _stream(_words(6, 30), held[0][5:35], _words(7, 3), held[3], held[1][:70],
                     held[2], _words(8, 25))
  whole = _shares(held, training)
  assert whole == [18 / 28, 58 / 88, 1.0, 1.0]
  for size in (7, 16, 29):  # chunks of 7 + 12 tokens: most n-grams and documents are cut
    monkeypatch.setattr(overlap, "SCAN_TOKENS", size)
    assert _shares(held, training) == whole, size


def test_a_sampled_index_estimates_shares_and_keeps_every_short_document():
  held = [_words(10 + i, 400) for i in range(20)] + [np.array([3, 4], np.uint32)]
  training = _stream(*[h[:100 + 10 * i] for i, h in enumerate(held[:20])], held[20])
  exact = overlap.Index()
  sampled = overlap.Index(max_pairs=800)  # of 20 x 388 n-grams
  for doc in held:
    exact.add(doc)
    sampled.add(doc)
  for index in (exact, sampled):
    index.scan(training, EOS)
  assert exact.rate == 1.0 and 0.05 < sampled.rate < 0.2
  assert sampled.shares()[20] == 1.0  # the short document: exact, never sampled away
  assert np.abs(sampled.shares()[:20] - exact.shares()[:20]).max() < 0.25
  assert abs(sampled.shares()[:20].mean() - exact.shares()[:20].mean()) < 0.05


def test_a_document_that_holds_a_leaving_one_leaves_too():
  """A held-out document moved into training makes training hold what it holds: B, clean
  against training, is half A; C shares nothing."""
  p, q, r, s, c = (_words(20 + i, 60) for i in range(5))
  a, b = np.concatenate([p, q, r]), np.concatenate([r, s[:40]])  # 168 and 88 n-grams
  index = overlap.Index()
  for doc in (a, b, c):
    index.add(doc)
  index.scan(_stream(np.concatenate([p, q])), EOS)
  assert index.shares().tolist() == [108 / 168, 0.0, 0.0]
  leave, shares = index.to_leave()
  assert leave.tolist() == [True, True, False]
  assert shares.tolist() == [108 / 168, 48 / 88, 0.0]  # each when it left; C against both
  assert index.shares().tolist() == [108 / 168, 0.0, 0.0]  # the scan's: training alone


def test_a_tasks_documents_are_its_gold_requests_less_their_shared_few_shot_context():
  from olmo3.eval.tasks import Request

  shots = [7, 8, 9, 10]  # the examples every request's context begins with

  def request(doc, cont, label, question, answer):
    query = tuple(shots + question + answer[:-1])  # context + continuation[:-1]
    return Request(doc, cont, label, query, tuple(answer), None, 1, 1, 1, 1)

  requests = [request(0, 0, 1, [20, 21], [30]), request(0, 1, 1, [20, 21], [31, 32]),
              request(1, 0, 0, [22], [33, 34]), request(1, 1, 0, [22], [35])]
  assert [d.tolist() for d in overlap.task_documents(requests)] == [[20, 21, 31, 32],
                                                                   [22, 33, 34]]
  assert [d.tolist() for d in overlap.task_documents(requests[:2])] == [[*shots, 20, 21, 31, 32]]


def _env():
  return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


@pytest.mark.slow(seconds=20)
def test_the_audit_reports_a_copied_document_and_finds_the_tiny_run_clean(tmp_path):
  """`launch/audit.py --overlap` on experiments.olmo3_tiny:stage1: as configured, its held-out
  set (the embedded split, which prepare made disjoint) and its tasks share nothing past the
  threshold (exit 0); with a second held-out set holding a held-out document and a copy of a
  training document, that set is named, the copy as whole (exit 1). Each report is the run's
  record."""
  corpus = embedded.corpus_dir()
  manifest = manifest_lib.Manifest.load(corpus)
  train = np.fromfile(manifest.files(corpus, "train")[0], "<u4")
  held = np.fromfile(manifest.files(corpus, "heldout")[0], "<u4")
  ends = np.flatnonzero(train == EOS)
  copy = train[ends[99] + 1:ends[100] + 1]  # the 101st training document, with its EOS
  write_token_file(tmp_path / "copied.npy",
                   np.concatenate([held[:np.flatnonzero(held == EOS)[0] + 1], copy]))
  (tmp_path / "copied.txt").write_text(f"copied,{tmp_path / 'copied.npy'}\n")
  tiny = ["--fdl_config=experiments.olmo3_tiny:stage1", "--overlap"]

  done = forked.completed("audit", [*tiny, f"--workdir={tmp_path / 'clean'}"], _env())
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(done.stdout.splitlines()[-1])
  assert report["ok"] and report["training_tokens_scanned"] == report["training_tokens"]
  assert list(report["heldout"]) == ["embedded"] and len(report["tasks"]) == 8
  for found in [*report["heldout"].values(), *report["tasks"].values()]:
    assert found["documents"] == found["checked"] > 0 and found["overlapping"] == 0, found
    assert found["max_share"] < overlap.THRESHOLD
  assert json.loads((tmp_path / "clean" / "overlap.json").read_text()) == report
  assert "warning" not in done.stderr

  done = forked.completed("audit", [
      *tiny, f"--workdir={tmp_path / 'copied'}", "--fdl_set=eval.tasks=()",
      f"--fdl_set=eval.heldout=('embedded-heldout', '{tmp_path / 'copied.txt'}')"], _env())
  assert done.returncode == 1, done.stderr[-3000:]
  report = json.loads(done.stdout.splitlines()[-1])
  copied = report["heldout"]["copied"]
  assert (copied["documents"], copied["overlapping"], copied["exact"]) == (2, 1, 1)
  assert copied["worst"][0] == [1, 1.0] and not report["ok"]
  assert report["heldout"]["embedded"]["overlapping"] == 0
  assert json.loads((tmp_path / "copied" / "overlap.json").read_text()) == report
  warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
  assert warnings == ["warning: held-out copied: 1 of 2 documents have 50% or more of their "
                      "n-grams in the training data (document 1: 100%): its numbers measure "
                      "memory, not generalization"], done.stderr[-3000:]
