"""How much of each held-out document the training data holds: n-gram overlap, counted on the
run's own token ids (docs/data.md, "Held-out overlap", says which numbers AI2 uses and why these).

A document's n-grams are its runs of `NGRAM` consecutive tokens (without its EOS: a training
n-gram across a document's end holds one, and matches none). Its share is the fraction of its
distinct n-grams that occur anywhere in the training tokens scanned; a document shorter than
`NGRAM` tokens has no n-gram and is found only as an exact copy (a training document of the very
same tokens). A share of 1 is an exact copy or a document held whole inside training text; a
share of `THRESHOLD` or more overlaps training.

Cost: n-grams are 64-bit hashes. The held-out side (`Index`) keeps at most `MAX_NGRAMS` of its
(document, n-gram) pairs: past that, those whose hash is smallest, which picks the same n-grams
on both sides, so a share stays an unbiased estimate (`Index.rate` says how much was kept).
Training tokens stream through `Index.scan` in chunks: memory is the index and one chunk, time
linear in the tokens scanned (about 40 vector passes over each).
"""

from __future__ import annotations

import array
import dataclasses
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from olmo3.data.tokens import TOKEN_DTYPE, token_counts
from olmo3.io import storage

if TYPE_CHECKING:  # its module imports JAX (for the loss's IGNORE), which prepare never needs
  from olmo3.data.heldout import HeldoutDocs

NGRAM = 13  # tokens per n-gram
THRESHOLD = 0.5  # a document whose share of n-grams found in training reaches this overlaps
MAX_NGRAMS = 1 << 24  # held-out (document, n-gram) pairs kept: an index of 300 MB at most
SCAN_TOKENS = 1 << 22  # training tokens hashed at a time
SAMPLE_TOKENS = 1 << 26  # training tokens an audit reads by default (256 MB)
SAMPLE_WINDOW = 1 << 20  # contiguous tokens per window of a sampled audit
WORST = 5  # documents a report names, highest share first
LISTED = 20  # held-out documents moved to training that prepare's record names
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: the polynomial hash's base
_ALL = np.iinfo(np.uint64).max


def _mix(h: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer: every bit of a key depends on every bit of the polynomial hash, so
  the smallest keys are a uniform sample of the n-grams."""
  h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return h ^ (h >> np.uint64(31))


def _keys(t64: np.ndarray, length: int, starts: np.ndarray | None = None) -> np.ndarray:
  """The key of each run of `length` tokens of `t64` (uint64): at every position, or at
  `starts`. The length seeds the hash, so a whole short document's key is no n-gram's."""
  count = len(t64) - length + 1 if starts is None else len(starts)
  h = np.full(max(count, 0), length, np.uint64)
  t64 = t64 + np.uint64(1)  # token 0 counts too
  for j in range(length):
    h *= _BASE
    h += t64[j:j + count] if starts is None else t64[starts + j]
  return _mix(h)


def document_keys(tokens: np.ndarray, n: int = NGRAM) -> np.ndarray:
  """The distinct keys of one document (its tokens, no EOS): its n-grams, or, shorter than n,
  the document whole."""
  t64 = np.asarray(tokens).astype(np.uint64)
  if len(t64) == 0:
    return np.zeros(0, np.uint64)
  return np.unique(_keys(t64, min(n, len(t64))))


def stream_keys(tokens: np.ndarray, eos: int, n: int = NGRAM, whole_first: bool = True
                ) -> tuple[np.ndarray, np.ndarray]:
  """The keys of a stretch of EOS-separated documents: of every n-gram, and of each document
  shorter than n that lies whole in the stretch (ended by an EOS, and begun by one, or by the
  stretch's start when `whole_first`)."""
  t64 = np.asarray(tokens).astype(np.uint64)
  grams = _keys(t64, n)  # those across an EOS match nothing: no held-out n-gram holds one
  ends = np.flatnonzero(t64 == np.uint64(eos))
  starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else ends
  if not whole_first and len(starts):
    starts, ends = starts[1:], ends[1:]
  lengths = ends - starts
  short = [_keys(t64, int(length), starts[lengths == length])
           for length in np.unique(lengths[(lengths > 0) & (lengths < n)])]
  return grams, np.concatenate([np.zeros(0, np.uint64), *short])


@dataclasses.dataclass(frozen=True)
class Overlap:
  """One group of held-out documents (a set, a task) against the training tokens scanned."""

  documents: int
  checked: int  # documents with a key kept (every one unless the index was sampled)
  overlapping: int  # share >= threshold
  exact: int  # share 1: an exact copy, or every n-gram found
  ngram_share: float  # of the group's (document, n-gram) pairs, the fraction found
  max_share: float
  worst: tuple[tuple[int, float], ...]  # (document index in the group, share), highest first


class Index:
  """The held-out side: each document's distinct keys (`add`), marked as found by `scan`."""

  def __init__(self, n: int = NGRAM, max_pairs: int = MAX_NGRAMS):
    self.n, self._max_pairs = n, max_pairs
    self.limit = _ALL  # n-gram keys at or above it are not kept (a sampled index)
    self._pending: list[np.ndarray] = []  # each document's keys
    self._pending_pairs = 0
    self._short: list[bool] = []  # documents shorter than n: one whole key, never sampled
    self.groups: list[str] = []  # each document's group
    self._keys: np.ndarray | None = None  # the sorted distinct keys, once the first scan began
    self._found = np.zeros(0, bool)
    self._pair_key = self._pair_doc = np.zeros(0, np.int32)  # each pair's key and document
    self._bits, self._filter = 0, np.zeros(0, np.uint8)  # the bit filter (`_freeze`)

  def add(self, tokens: np.ndarray, group: str = "") -> None:
    """Adds one document (its tokens without EOS) to `group`."""
    if self._keys is not None:
      raise RuntimeError("Index.add after the first scan")
    keys = document_keys(tokens, self.n)
    short = 0 < len(tokens) < self.n
    self._pending.append(keys if short else keys[keys < self.limit])
    self._short.append(short)
    self.groups.append(group)
    if not short:
      self._pending_pairs += len(self._pending[-1])
    if self._pending_pairs > 2 * self._max_pairs:  # trimmed to half that: amortized
      self._trim()

  def _trim(self) -> None:
    """Keeps the n-gram pairs whose keys are smallest, at most max_pairs of them."""
    grams = [k for k, short in zip(self._pending, self._short) if not short]
    every = np.concatenate(grams) if grams else np.zeros(0, np.uint64)
    if len(every) <= self._max_pairs:
      return
    self.limit = np.partition(every, self._max_pairs)[self._max_pairs]
    self._pending = [k if short else k[k < self.limit]
                     for k, short in zip(self._pending, self._short)]
    self._pending_pairs = sum(len(k) for k, short in zip(self._pending, self._short) if not short)

  def _freeze(self) -> None:
    if self._keys is not None:
      return
    self._trim()
    flat = np.concatenate(self._pending) if self._pending else np.zeros(0, np.uint64)
    self._keys, inverse = np.unique(flat, return_inverse=True)
    self._pair_key = inverse.astype(np.int32)
    self._pair_doc = np.repeat(np.arange(len(self._pending), dtype=np.int32),
                               list(map(len, self._pending)))
    self._found = np.zeros(len(self._keys), bool)
    self._pending = []
    # A bit per slot of the keys' top bits, 8 to 16 slots per key: most training keys miss
    # it, and only the rest are searched for (a binary search costs ~20 cache misses).
    self._bits = int(np.clip(np.ceil(np.log2(max(len(self._keys), 1))) + 4, 10, 28))
    slots = (self._keys >> np.uint64(64 - self._bits)).astype(np.int64)
    self._filter = np.zeros(1 << (self._bits - 3), np.uint8)  # 32 MB at most
    np.bitwise_or.at(self._filter, slots >> 3, np.left_shift(1, slots & 7).astype(np.uint8))

  def _maybe(self, keys: np.ndarray) -> np.ndarray:
    """False where a key is certainly not held out (its slot is empty)."""
    slots = (keys >> np.uint64(64 - self._bits)).astype(np.int64)
    return (self._filter[slots >> 3] >> (slots & 7).astype(np.uint8)) & 1 == 1

  @property
  def rate(self) -> float:
    """The share of n-grams the index keeps (1: all of them)."""
    return 1.0 if self.limit == _ALL else float(self.limit) / 2.0**64

  def scan(self, tokens: np.ndarray, eos: int, whole_first: bool = True) -> None:
    """Marks the held-out keys found in these training tokens (EOS-separated documents; a
    stretch cut from a longer stream passes `whole_first=False` unless it begins a document)."""
    self._freeze()
    if not len(self._keys):
      return
    for start in range(0, len(tokens), SCAN_TOKENS):
      # Chunks overlap by n - 1 tokens: no n-gram is lost at a cut, and a short document cut
      # there lies whole in the chunk it begins in.
      chunk = tokens[start:start + SCAN_TOKENS + self.n - 1]
      first = whole_first if start == 0 else bool(tokens[start - 1] == eos)
      grams, whole = stream_keys(chunk, eos, self.n, first)
      keys = np.concatenate([grams[grams < self.limit] if self.limit != _ALL else grams, whole])
      # Sorted, the binary searches walk the index in order (7x faster than scattered).
      keys = np.sort(keys[self._maybe(keys)])
      at = np.searchsorted(self._keys, keys)
      hit = at < len(self._keys)
      hit[hit] = self._keys[at[hit]] == keys[hit]
      self._found[at[hit]] = True
      if start + SCAN_TOKENS + self.n - 1 >= len(tokens):
        break

  def _counts(self, found: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per document: its keys found, and its keys."""
    docs = len(self.groups)
    return (np.bincount(self._pair_doc, weights=found[self._pair_key], minlength=docs),
            np.bincount(self._pair_doc, minlength=docs))

  def shares(self, found: np.ndarray | None = None) -> np.ndarray:
    """Each document's share of keys found (NaN: no key kept)."""
    self._freeze()
    hits, total = self._counts(self._found if found is None else found)
    with np.errstate(invalid="ignore", divide="ignore"):
      return hits / total

  def to_leave(self, threshold: float = THRESHOLD) -> tuple[np.ndarray, np.ndarray]:
    """What must leave the held-out side for it to be disjoint (a boolean mask): the documents
    whose share reaches `threshold`, and those that then do once the keys of those count as
    training's (a document moved into training may hold another held-out document); and each
    document's share: a leaving one's when it was found to leave, the others' against training
    with the leaving ones in it."""
    self._freeze()
    found = self._found.copy()
    leave = np.zeros(len(self.groups), bool)
    at_leaving = np.zeros(len(self.groups))
    while True:
      shares = self.shares(found)
      new = (np.nan_to_num(shares) >= threshold) & ~leave
      if not new.any():
        return leave, np.where(leave, at_leaving, shares)
      at_leaving[new] = shares[new]
      leave |= new
      found[self._pair_key[leave[self._pair_doc]]] = True

  def summary(self, threshold: float = THRESHOLD) -> dict[str, Overlap]:
    """Per group: its documents' overlap with the training tokens scanned."""
    shares = self.shares()
    hits, total = self._counts(self._found)
    groups = np.array(self.groups, dtype=object)
    out = {}
    for group in dict.fromkeys(self.groups):
      mine = np.flatnonzero(groups == group)
      s = shares[mine]
      checked = ~np.isnan(s)
      order = np.argsort(-np.nan_to_num(s, nan=-1.0), kind="stable")[:WORST]
      out[group] = Overlap(
          documents=len(mine), checked=int(checked.sum()),
          overlapping=int((s[checked] >= threshold).sum()),
          exact=int((s[checked] == 1.0).sum()),
          ngram_share=float(hits[mine].sum() / max(total[mine].sum(), 1)),
          max_share=float(s[checked].max()) if checked.any() else 0.0,
          worst=tuple((int(i), round(float(s[i]), 4)) for i in order if checked[i] and s[i] > 0))
    return out


class _SetAside:
  """Held-out documents kept in a local scratch file until the training side has been
  checked against them."""

  def __init__(self, file):
    self.file, self.where, self.ends = file, [], array.array("q", [0])

  def add(self, where: str, doc: np.ndarray) -> None:
    self.file.write(np.ascontiguousarray(doc, TOKEN_DTYPE).tobytes())
    self.where.append(where)
    self.ends.append(self.ends[-1] + len(doc))

  def documents(self) -> Iterator[np.ndarray]:
    self.file.flush()
    tokens = np.memmap(self.file, TOKEN_DTYPE, mode="r") if self.ends[-1] else None
    for start, end in zip(self.ends, self.ends[1:]):
      yield tokens[start:end] if end > start else np.zeros(0, TOKEN_DTYPE)


def disjoint(heldout: Iterable[tuple[str, np.ndarray]], training: Iterable[np.ndarray],
             eos: int, to_train: Callable[[np.ndarray], None],
             to_heldout: Callable[[np.ndarray], None]) -> dict[str, Any]:
  """Writes a split whose held-out side is disjoint from its training side (olmo3.data.prepare
  passes its documents, without EOS, and its writers). The held-out documents ((where, tokens),
  read first) are set aside in a local scratch file, the training documents written as they
  come and scanned in batches; then each held-out document that must leave (`Index.to_leave`)
  is written to training, after the others, and the rest to held-out, in their order. Returns
  the check's record (the manifest's `overlap`), naming the first moved documents."""
  index = Index()
  end = np.array([eos], TOKEN_DTYPE)
  with tempfile.TemporaryFile() as scratch:
    held = _SetAside(scratch)
    for where, doc in heldout:
      index.add(doc)
      held.add(where, doc)
    batch, batched = [], 0
    for doc in training:
      doc = np.concatenate([doc, end])
      to_train(doc)
      if index.groups:
        batch.append(doc)
        batched += len(doc)
      if batched >= SCAN_TOKENS:
        index.scan(np.concatenate(batch), eos)
        batch, batched = [], 0
    if batch:
      index.scan(np.concatenate(batch), eos)
    leave, shares = index.to_leave() if index.groups else (np.zeros(0, bool), np.zeros(0))
    for doc, out in zip(held.documents(), leave):
      (to_train if out else to_heldout)(np.concatenate([doc, end]))
  moved = np.flatnonzero(leave)
  order = moved[np.argsort(-shares[moved], kind="stable")]
  return {"ngram": index.n, "threshold": THRESHOLD, "sampled": index.rate,
          "checked": len(leave), "moved": len(moved),
          "moved_documents": [[held.where[i], round(float(shares[i]), 4)]
                              for i in order[:LISTED]],
          "max_share_kept": float(np.nan_to_num(shares[~leave]).max(initial=0.0))}


def describe(record: dict[str, Any]) -> list[str]:
  """What prepare prints of its check (`disjoint`'s record)."""
  what = (f"{record['ngram']}-token n-grams" + (
      f", a {record['sampled']:.2%} hash sample of them" if record["sampled"] < 1 else ""))
  if not record["checked"]:
    return ["held-out check: no held-out documents"]
  if not record["moved"]:
    return [f"held-out check: none of the {record['checked']:,} held-out documents has "
            f"{record['threshold']:.0%} of its {what} in the training split (highest: "
            f"{record['max_share_kept']:.1%})"]
  named = record["moved_documents"]
  return ([f"held-out check: {record['moved']:,} of the {record['checked']:,} held-out documents "
           f"had {record['threshold']:.0%} or more of their {what} in the training split and "
           f"were moved to it" + (f" ({len(named)} named):" if len(named) < record["moved"]
                                   else ":")]
          + [f"  {where}: {share:.1%}" for where, share in named]
          + [f"  the held-out documents kept have at most {record['max_share_kept']:.1%} of "
             "theirs there"])


def heldout_documents(docs: HeldoutDocs, eos: int, batch: int = 256) -> Iterator[np.ndarray]:
  """The documents a held-out set scores, as it scores them (cut to seq_len), without EOS."""
  for first in range(0, len(docs), batch):
    indices = range(first, min(first + batch, len(docs)))
    rows = docs.rows(indices, docs.seq_len, len(indices))["input_ids"]
    for row, length in zip(rows, docs.lengths[first:first + batch]):
      tokens = row[:length]
      yield tokens[:-1] if length and tokens[-1] == eos else tokens


def task_documents(requests: Sequence[Any]) -> list[np.ndarray]:
  """A downstream task's documents as the model reads them (olmo3.eval.tasks.Request's): each
  document's gold request, its context and whole continuation (cut from the left, as scored),
  less the context every document of the task begins with (fixed few-shot examples, often
  from the task's own training split, which training data may hold without harm)."""
  gold = {}
  for r in requests:
    if r.doc_id not in gold or r.cont_id == r.label:
      gold[r.doc_id] = r
  docs = [np.asarray(r.query + r.continuation[-1:], np.int64) for r in gold.values()]
  if len(docs) < 2:
    return docs
  shortest = min(map(len, docs))
  same = np.logical_and.reduce([doc[:shortest] == docs[0][:shortest] for doc in docs])
  shared = min(int(np.argmin(np.append(same, False))), shortest - 1)  # the first difference
  return [doc[shared:] for doc in docs]


def training_sample(paths: Sequence[str], counts: Sequence[int], tokens: int, eos: int
                    ) -> Iterator[tuple[np.ndarray, bool]]:
  """Stretches of the training token files (`counts` tokens each), with whether each begins a
  document: the files whole when they hold `tokens` or fewer, else `tokens // SAMPLE_WINDOW`
  windows of SAMPLE_WINDOW tokens spread evenly over them (in mix order), a few read at a
  time."""
  counts = np.asarray(counts, np.int64)
  total = int(counts.sum())
  if total <= tokens:
    spans = [(i, 0, int(n)) for i, n in enumerate(counts)]
  else:
    windows = max(tokens // SAMPLE_WINDOW, 1)
    starts = (np.arange(windows) * 2 + 1) * total // (2 * windows) - SAMPLE_WINDOW // 2
    ends_at = np.cumsum(counts)
    spans = []
    for start in np.clip(starts, 0, total - 1):
      i = int(np.searchsorted(ends_at, start, side="right"))
      offset = int(start - (ends_at[i] - counts[i]))
      spans.append((i, offset, min(offset + SAMPLE_WINDOW, int(counts[i]))))
  size = TOKEN_DTYPE.itemsize
  for first in range(0, len(spans), 8):
    group = spans[first:first + 8]
    # One token before each window says whether it begins a document.
    read = storage.read_ranges([(paths[i], max(a - 1, 0) * size, b * size) for i, a, b in group])
    for (_, a, _), data in zip(group, read):
      got = np.frombuffer(data, TOKEN_DTYPE)
      yield (got, True) if a == 0 else (got[1:], bool(got[0] == eos))


def measure(training: Sequence[str], heldout: Mapping[str, HeldoutDocs],
            tasks: Mapping[str, Sequence[np.ndarray]], eos: int,
            sample_tokens: int = SAMPLE_TOKENS) -> dict[str, Any]:
  """How much of each held-out set's documents (as the run scores them) and each task's
  documents the training data holds, against a sample of `sample_tokens` training tokens:
  what launch/audit.py --overlap reports and records."""
  index = Index()
  for name, docs in heldout.items():
    for doc in heldout_documents(docs, eos):
      index.add(doc, f"heldout/{name}")
  for name, docs in tasks.items():
    for doc in docs:
      index.add(doc, f"task/{name}")
  counts = token_counts(training, "training token file")
  scanned = 0
  for stretch, whole_first in (training_sample(training, counts, sample_tokens, eos)
                               if index.groups else ()):
    index.scan(stretch, eos, whole_first)
    scanned += len(stretch)
  found = {group: dataclasses.asdict(o) for group, o in index.summary().items()}
  return {"ngram": index.n, "threshold": THRESHOLD, "sampled_ngrams": index.rate,
          "training_files": len(training), "training_tokens_scanned": scanned,
          "training_tokens": sum(counts),
          "heldout": {k.split("/", 1)[1]: v for k, v in found.items() if k.startswith("heldout/")},
          "tasks": {k.split("/", 1)[1]: v for k, v in found.items() if k.startswith("task/")},
          "ok": not any(o["overlapping"] for o in found.values())}
