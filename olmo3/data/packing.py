"""Documents packed into fixed-length instances, as OLMo-core's NumpyPackedFSLDataset does
(AI2's stage 3: sequence_length=65536, generate_doc_lengths=True, source_group_size=8,
source_permutation_seed=123, long_doc_strategy left at "truncate"; ai2-olmo-core 2.4.0 and
3.0.0 pack local files alike for that setting).

The recipe, step by step (each step is OLMo-core's, checked against its classes by
tests/test_data_packing.py):
1. Source order: with a permutation seed, the token files are shuffled first, by Python's
   `random.Random(seed).shuffle` of their indices (`source_order`).
2. Source groups: consecutive runs of `source_group_size` files of that order, the last one
   shorter (`source_groups`). Each group is packed on its own.
3. Documents: every EOS ends one, [after the previous EOS, this EOS] (`document_spans`); tokens
   after a file's last EOS belong to no document and are never read. No BOS rule: dolma2 has no
   BOS. Documents never cross files.
4. Long documents: longer than the sequence length, "truncate" keeps the first seq_len tokens
   and drops the rest; "fragment" cuts them into seq_len pieces (`cap_long_documents`).
5. Optimized Best-Fit Decreasing (`best_fit_decreasing`): the group's documents (file by file,
   each file's in order) are sorted by length, longest first, by numpy's default argsort of the
   negated int64 lengths -- the same call as OLMo-core's, because its tie order is not stable
   and decides which of two equal-length documents goes where (see the caveat below). Each
   document then goes to the open bin with the least room that still holds it (several such
   bins: the one that reached that room first), else to a new bin. Bins are numbered in the
   order they were opened; a bin's documents stay in the order they were placed.
6. Instances: group by group, the groups' bins numbered on from the previous group's (instance
   i of group g is global instance group_offsets[g] + i). An instance is its documents' tokens one
   after another, then the pad token up to seq_len; padding is masked from the loss.

Segments (what attention masks by): each packed document is one segment, numbered 1, 2, ... in
the row; padding is segment 0 (PAD_SEGMENT). OLMo-core's doc_lens (its EOS scan of the padded
instance) are the lengths of those segments with the padding last, one segment, whenever
pad_token_id != eos_token_id (dolma2: 100277 vs 100257). With pad == eos OLMo-core would make
each pad token its own document; that touches neither the loss (padding is masked) nor real
tokens (which never see padding). `positions` restart at 0 in every segment (padding too), as
OLMo-core 3.0.0's intra-document RoPE does; AI2's 2.4.0 stage 3 used arange(seq_len) instead
(it never resets positions), which needs nothing from here.

Caveat (measured): numpy's default argsort of int64 dispatches on the CPU's SIMD features
(AVX-512 or not) and breaks ties differently on each: this machine's packing of a group of
10^3+ documents with tied lengths changes with NPY_DISABLE_CPU_FEATURES. So OLMo-core's own
instances depend on the machine that packed them, and ours match OLMo-core's on the same
machine and numpy. A run records the index's `digest` in its data identity, so a resume whose
machine packed otherwise is refused rather than trained on other rows; the hosts of one job
should share one index file (`cached_index`'s directory on a shared disk).

Differences from OLMo-core, by choice: remote files are scanned for EOS like local ones
(OLMo-core reads the `.csv.gz` metadata beside a URL instead; for EOS-terminated documents the
two agree), and the index is ours (arrays in memory, one optional cache file), not its
work_dir files.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import io
import json
import os
import random
import zipfile
from collections import deque
from collections.abc import Sequence

import numpy as np
from absl import logging

from olmo3.data import tokens as token_files
from olmo3.data.tokens import TOKEN_DTYPE, DataError
from olmo3.io import errors, file_sizes, pathnames, storage

LONG_DOC_STRATEGIES = ("truncate", "fragment")
PAD_SEGMENT = 0  # the segment id of padding; documents are 1, 2, ... in each row
_SCAN_TOKENS = 1 << 24  # tokens per read when finding documents
_SCAN_BATCH = 8  # reads of one file issued together (remote: concurrently)
_INDEX_FORMAT = 1


def source_order(n_files: int, seed: int | None) -> list[int]:
  """The file order OLMo-core's dataset configs hand its dataset: the mix order, or with
  `source_permutation_seed` the indices shuffled by Python's Mersenne Twister."""
  order = list(range(n_files))
  if seed is not None:
    random.Random(seed).shuffle(order)
  return order


def source_groups(n_files: int, group_size: int) -> list[range]:
  """Positions (in source order) of each packing group: runs of `group_size`, the last short."""
  if group_size < 1:
    raise ValueError(f"source_group_size must be >= 1, got {group_size}")
  return [range(i, min(i + group_size, n_files)) for i in range(0, n_files, group_size)]


def document_spans(eos_positions: np.ndarray) -> np.ndarray:
  """[D, 2] (start, end) of the documents of a file whose EOS tokens sit at `eos_positions`
  (ascending): each runs from just after the previous EOS through its own."""
  ends = np.asarray(eos_positions, np.int64) + 1
  starts = np.concatenate([[0], ends]).astype(np.int64)[:-1]
  return np.stack([starts, ends], axis=1)


def cap_long_documents(spans: np.ndarray, seq_len: int, strategy: str = "truncate") -> np.ndarray:
  """Documents longer than `seq_len`, truncated to their first `seq_len` tokens or cut into
  `seq_len` fragments (the last one shorter), in place of the original, order kept."""
  if strategy not in LONG_DOC_STRATEGIES:
    raise ValueError(f"long_doc_strategy must be one of {LONG_DOC_STRATEGIES}, got {strategy!r}")
  spans = np.asarray(spans, np.int64).reshape(-1, 2)
  lengths = spans[:, 1] - spans[:, 0]
  if strategy == "truncate":
    return np.stack([spans[:, 0], spans[:, 0] + np.minimum(lengths, seq_len)], axis=1)
  pieces = -(-lengths // seq_len)  # ceil: every document (length >= 1) keeps one piece at least
  first = np.repeat(spans[:, 0], pieces)
  within = np.arange(len(first)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
  starts = first + within * seq_len
  return np.stack([starts, np.minimum(starts + seq_len, np.repeat(spans[:, 1], pieces))], axis=1)


def best_fit_decreasing(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """OLMo-core's Optimized Best-Fit Decreasing over documents of `lengths` (each 1..seq_len).
  Returns (docs [D]: document indices in bin order, each bin's in placement order;
  bin_offsets [B + 1]: bin b holds docs[bin_offsets[b]:bin_offsets[b + 1]])."""
  lengths = np.asarray(lengths, np.int64)
  if len(lengths) and (lengths.min() < 1 or lengths.max() > seq_len):
    raise ValueError(f"document lengths must lie in [1, {seq_len}]")
  # Exactly OLMo-core's call (default kind, int64): its tie order decides the packing.
  by_length = np.argsort(-1 * lengths)
  rooms: list[int] = []  # the distinct room sizes of open bins, ascending
  bins_with_room: dict[int, deque[int]] = {}  # room -> open bins with it, first come first
  bin_of = np.empty(len(lengths), np.int64)
  opened = 0
  for k, length in enumerate(lengths[by_length].tolist()):
    at = bisect.bisect_left(rooms, length)  # the tightest room that holds the document
    if at == len(rooms):
      b, room = opened, seq_len
      opened += 1
    else:
      room = rooms[at]
      waiting = bins_with_room[room]
      b = waiting.popleft()
      if not waiting:
        del rooms[at]
    bin_of[k] = b
    left = room - length
    if left:
      waiting = bins_with_room.setdefault(left, deque())
      if not waiting:
        bisect.insort(rooms, left)
      waiting.append(b)
  placed = np.argsort(bin_of, kind="stable")  # by bin, placement order within each
  offsets = np.concatenate([[0], np.cumsum(np.bincount(bin_of, minlength=opened))])
  return by_length[placed], offsets.astype(np.int64)


def find_eos(path: str, n_tokens: int, eos_token_id: int) -> np.ndarray:
  """Positions of `eos_token_id` in a token file, reading it in large ranges (a remote file's
  several at once)."""
  size = TOKEN_DTYPE.itemsize
  starts = list(range(0, n_tokens, _SCAN_TOKENS))
  found = []
  for i in range(0, len(starts), _SCAN_BATCH):
    batch = starts[i:i + _SCAN_BATCH]
    chunks = storage.read_ranges(
        [(path, s * size, min(s + _SCAN_TOKENS, n_tokens) * size) for s in batch])
    for s, chunk in zip(batch, chunks):
      expected = min(_SCAN_TOKENS, n_tokens - s) * size
      if len(chunk) != expected:
        raise DataError(f"token file {path} ended at token {s + len(chunk) // size}; it held "
                        f"{n_tokens} when this launch counted them")
      found.append(np.flatnonzero(np.frombuffer(chunk, TOKEN_DTYPE) == eos_token_id) + s)
  return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedIndex:
  """Where every packed instance's documents lie. Instance i holds documents
  doc_* [instance_offsets[i]:instance_offsets[i + 1]], in row order."""

  key: dict  # what the packing depends on (paths, token counts, settings): a cache's identity
  paths: tuple[str, ...]  # in the caller's (mix) order; doc_file indexes them
  instance_offsets: np.ndarray  # [N + 1] int64
  doc_file: np.ndarray  # [S] int32
  doc_start: np.ndarray  # [S] int64, in tokens
  doc_len: np.ndarray  # [S] int32
  group_offsets: np.ndarray  # [G + 1] int64: group g's instances are [g_o[g], g_o[g + 1])

  @property
  def seq_len(self) -> int:
    return int(self.key["seq_len"])

  @property
  def digest(self) -> str:
    """A checksum of the packing (which documents, in which instance and row order): two
    indexes with the same digest give every instance the same tokens."""
    h = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode())
    for name in ("instance_offsets", "doc_file", "doc_start", "doc_len"):
      h.update(np.ascontiguousarray(getattr(self, name)).tobytes())
    return h.hexdigest()[:16]

  def __len__(self) -> int:
    return len(self.instance_offsets) - 1

  @classmethod
  def build(cls, paths: Sequence[str | os.PathLike], *, seq_len: int, eos_token_id: int,
            source_group_size: int = 1, source_permutation_seed: int | None = None,
            long_doc_strategy: str = "truncate",
            size_cache: file_sizes.SizeCache | None = None,
            label_masks: Sequence[str | None] | None = None) -> PackedIndex:
    """Scans the files for documents and packs each source group (see the module's recipe).
    `label_masks`: each file's label mask (chat data, olmo3.data.label_masks; None: all
    trained), read with its tokens and part of the index's key."""
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    texts = tuple(os.fspath(p) for p in paths)
    if not texts:
      raise DataError("no token files given")
    counts = token_files.token_counts(texts, size_cache=size_cache)
    order = source_order(len(texts), source_permutation_seed)
    key = _key(texts, counts, seq_len, eos_token_id, source_group_size,
               source_permutation_seed, long_doc_strategy, label_masks)
    files, starts, lens, per_instance, per_group = [], [], [], [np.zeros(1, np.int64)], [0]
    placed = 0  # documents placed in earlier groups (a group without any EOS places none)
    for group in source_groups(len(texts), source_group_size):
      members = [order[p] for p in group]
      spans = [cap_long_documents(document_spans(find_eos(texts[f], counts[f], eos_token_id)),
                                  seq_len, long_doc_strategy) for f in members]
      doc_file = np.concatenate([np.full(len(s), f, np.int32) for f, s in zip(members, spans)])
      doc_span = np.concatenate(spans) if spans else np.zeros((0, 2), np.int64)
      docs, bins = best_fit_decreasing(doc_span[:, 1] - doc_span[:, 0], seq_len)
      files.append(doc_file[docs])
      starts.append(doc_span[docs, 0])
      lens.append((doc_span[docs, 1] - doc_span[docs, 0]).astype(np.int32))
      per_instance.append(bins[1:] + placed)
      placed += len(docs)
      per_group.append(per_group[-1] + len(bins) - 1)
    index = cls(key, texts, np.concatenate(per_instance), np.concatenate(files),
                np.concatenate(starts), np.concatenate(lens), np.asarray(per_group, np.int64))
    if not len(index):
      raise DataError(f"no document (no token {eos_token_id}, the EOS) in any of the "
                      f"{len(texts)} token files")
    return index

  def save(self, path: str | os.PathLike) -> None:
    """Writes the index to one file (local or remote), so hosts and later launches share it."""
    buffer = io.BytesIO()
    np.savez(buffer, key=np.array(json.dumps(self.key)),
             **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("key", "paths")})
    # Flushed: a cache, its key checked when read and built again when it does not match.
    storage.write_bytes_atomic(path, buffer.getvalue(), durability=storage.Durability.FLUSHED)

  @classmethod
  def load(cls, path: str | os.PathLike, expected_key: dict | None = None) -> PackedIndex | None:
    """An index `save` wrote, or None when there is none or it was built from other files or
    settings than `expected_key` (a `build`'s key)."""
    if not storage.exists(path):
      return None
    try:
      with np.load(io.BytesIO(storage.read_bytes(path))) as saved:
        key = json.loads(str(saved["key"]))
        if expected_key is not None and key != json.loads(json.dumps(expected_key)):
          return None
        arrays = {name: saved[name] for name in saved.files if name != "key"}
      index = cls(key=key, paths=tuple(key["paths"]), **arrays)
      index.check()
    # What a truncated or overwritten file raises inside numpy's and zipfile's readers (a
    # storage failure is a StorageError, raised on): the index is a cache, built again.
    except (zipfile.BadZipFile, EOFError, ValueError, KeyError, TypeError) as e:
      logging.warning("packed-document index %s is damaged (%s: %s); building it again",
                      path, type(e).__name__, e)
      return None
    return index

  def check(self) -> None:
    """Raises ValueError unless the arrays describe a packing: offsets that start at 0, never
    fall and end at the document count, one file, start and length per document."""
    n_docs = len(self.doc_file)
    for name, offsets, end in (("instance_offsets", self.instance_offsets, n_docs),
                               ("group_offsets", self.group_offsets, len(self))):
      if (offsets.ndim != 1 or not len(offsets) or offsets[0] != 0 or offsets[-1] != end
          or (np.diff(offsets) < 0).any()):
        raise ValueError(f"{name} is not an offset table over {end} entries")
    if len(self.doc_start) != n_docs or len(self.doc_len) != n_docs:
      raise ValueError(f"{n_docs} documents but {len(self.doc_start)} starts and "
                       f"{len(self.doc_len)} lengths")
    if n_docs and (self.doc_file.min() < 0 or self.doc_file.max() >= len(self.paths)
                   or self.doc_len.min() < 1 or self.doc_len.max() > self.seq_len):
      raise ValueError("a document's file or length is out of range")


def _key(paths: Sequence[str], counts: Sequence[int], seq_len: int, eos_token_id: int,
         source_group_size: int, source_permutation_seed: int | None,
         long_doc_strategy: str, label_masks: Sequence[str | None] | None = None) -> dict:
  """What a packing depends on: its identity in a cache (and in a run's data identity). Label
  masks only where a file has one: the key of files without (stage 1-3's) is as it was."""
  key = {"format": _INDEX_FORMAT, "paths": list(paths), "tokens": [int(n) for n in counts],
         "seq_len": seq_len, "eos_token_id": eos_token_id,
         "source_group_size": source_group_size,
         "source_permutation_seed": source_permutation_seed,
         "long_doc_strategy": long_doc_strategy}
  if label_masks is not None and any(m is not None for m in label_masks):
    if len(label_masks) != len(paths):
      raise ValueError(f"{len(label_masks)} label masks for {len(paths)} token files")
    key["label_masks"] = [None if m is None else os.fspath(m) for m in label_masks]
  return key


def cached_index(paths: Sequence[str | os.PathLike], cache_dir: str | os.PathLike, *,
                 seq_len: int, eos_token_id: int, source_group_size: int = 1,
                 source_permutation_seed: int | None = None,
                 long_doc_strategy: str = "truncate",
                 size_cache: file_sizes.SizeCache | None = None,
                 label_masks: Sequence[str | None] | None = None) -> PackedIndex:
  """`PackedIndex.build`'s index, kept in `cache_dir` under a name derived from its key (the files,
  their token counts, their label masks and the settings): scanning a stage-3 mix for documents
  reads every token once, so a later launch over the same files loads it instead. A cached file
  whose key differs (another packing hashed alike) is rebuilt, never trusted.
  """
  texts = [os.fspath(p) for p in paths]
  key = _key(texts, token_files.token_counts(texts, size_cache=size_cache), seq_len,
             eos_token_id, source_group_size, source_permutation_seed, long_doc_strategy,
             label_masks)
  name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
  path = pathnames.join(os.fspath(cache_dir), f"packed-{name}.npz")
  index = PackedIndex.load(path, expected_key=key)
  if index is None:
    index = PackedIndex.build(texts, seq_len=seq_len, eos_token_id=eos_token_id,
                              source_group_size=source_group_size,
                              source_permutation_seed=source_permutation_seed,
                              long_doc_strategy=long_doc_strategy, size_cache=size_cache,
                              label_masks=label_masks)
    index.save(path)
  return index


@dataclasses.dataclass(frozen=True)
class PackedRows:
  """Packed instances as the step reads them.
    tokens      [R, T] int32  documents, then pad_token_id
    segment_ids [R, T] int32  1, 2, ... per document in the row; PAD_SEGMENT (0) on padding
    positions   [R, T] int32  position within the segment (0 at each document's first token)
    label_mask  [R, T] bool   OLMo-core's label_mask: False on padding (no loss where the
                              target is padding) and, for chat data, where the token's label
                              mask is False (not trained: OLMo-core reads the mask files at
                              the tokens' offsets)
    doc_lens    [R, D] int32  OLMo-core's collated doc_lens: the segments' lengths in row
                              order, padding last, zero-filled to the read's widest row"""

  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  label_mask: np.ndarray
  doc_lens: np.ndarray

  def labels(self, ignore: int) -> np.ndarray:
    """Next-token labels [R, T] int32: `ignore` where the next token is padding or not
    trained, and at the last position (OLMo-core's get_labels on a packed batch)."""
    out = np.full_like(self.tokens, ignore)
    out[:, :-1] = np.where(self.label_mask[:, 1:], self.tokens[:, 1:], ignore)
    return out


class PackedInstances:
  """Random access to packed instances; every read of a step is one batch of ranged reads."""

  def __init__(self, index: PackedIndex, *, pad_token_id: int, vocab_size: int | None = None,
               labels: Sequence[str] | None = None):
    if labels is not None and len(labels) != len(index.paths):
      raise ValueError(f"{len(labels)} source labels for {len(index.paths)} token files")
    self.index = index
    self.paths = list(index.paths)
    self.file_tokens = np.asarray(index.key["tokens"], np.int64)
    self.seq_len = index.seq_len
    self.pad_token_id = pad_token_id
    self.vocab_size = vocab_size
    labels = [token_files.UNLABELLED] * len(index.paths) if labels is None else list(labels)
    self.source_names = tuple(sorted(set(labels)))
    self.file_source = np.searchsorted(self.source_names, labels).astype(np.int32)

  def __len__(self) -> int:
    return len(self.index)

  @property
  def conversations(self) -> bool:
    """Whether the files are chat data: their label masks train some tokens only (SFT)."""
    return "label_masks" in self.index.key

  def spans(self, instance: int) -> list[tuple[int, int, int]]:
    """(file, first token, tokens) of each document of `instance`, in row order."""
    if not 0 <= instance < len(self):
      raise IndexError(f"instance {instance} out of range [0, {len(self)})")
    ix = self.index
    lo, hi = ix.instance_offsets[instance], ix.instance_offsets[instance + 1]
    return list(zip(ix.doc_file[lo:hi].tolist(), ix.doc_start[lo:hi].tolist(),
                    ix.doc_len[lo:hi].tolist()))

  def source_of(self, instances: np.ndarray) -> np.ndarray:
    """Each instance's source (index into `source_names`): its first document's file's, the
    longest document of the instance (a group may mix sources)."""
    first = self.index.doc_file[self.index.instance_offsets[np.asarray(instances, np.int64)]]
    return self.file_source[first]

  def read(self, instances: Sequence[int] | np.ndarray) -> PackedRows:
    instances = [int(i) for i in instances]
    per_row = [self.spans(i) for i in instances]
    flat = [s for row in per_row for s in row]
    size = TOKEN_DTYPE.itemsize
    paths = self.index.paths
    masks = self.index.key.get("label_masks") or [None] * len(paths)
    masked = [(masks[f], start, start + n) for f, start, n in flat if masks[f] is not None]
    try:  # a mask byte per token, at the tokens' offsets; all in one batch of reads
      read = storage.read_ranges([(paths[f], start * size, (start + n) * size)
                                  for f, start, n in flat] + masked)
    except errors.ChangedSince as e:
      raise DataError(f"token file {e}: it changed after this launch counted its tokens. "
                      f"{token_files.CHANGED_REMEDY}") from None
    chunks, mask_chunks = read[:len(flat)], iter(read[len(flat):])
    R, T = len(instances), self.seq_len
    tokens = np.full((R, T), self.pad_token_id, np.int32)
    segment_ids = np.full((R, T), PAD_SEGMENT, np.int32)
    positions = np.empty((R, T), np.int32)
    label_mask = np.zeros((R, T), bool)
    lens: list[list[int]] = []
    at = 0
    for r, row in enumerate(per_row):
      t = 0
      for seg, (f, start, n) in enumerate(row, start=1):
        chunk = chunks[at]
        at += 1
        if len(chunk) != n * size:
          raise DataError(f"token file {paths[f]} ended before token {start + n}: it was cut "
                          f"short since this launch counted it. {token_files.CHANGED_REMEDY}")
        tokens[r, t:t + n] = np.frombuffer(chunk, TOKEN_DTYPE)
        segment_ids[r, t:t + n] = seg
        positions[r, t:t + n] = np.arange(n, dtype=np.int32)
        if masks[f] is None:
          label_mask[r, t:t + n] = True
        else:
          trained = next(mask_chunks)
          if len(trained) != n:
            raise DataError(f"label mask {masks[f]} ended before byte {start + n}: it was cut "
                            f"short since this launch checked it. {token_files.CHANGED_REMEDY}")
          label_mask[r, t:t + n] = np.frombuffer(trained, np.uint8) != 0
        t += n
      positions[r, t:] = np.arange(T - t, dtype=np.int32)
      lens.append([n for _, _, n in row] + ([T - t] if t < T else []))
    if self.vocab_size is not None and R and tokens.max() >= self.vocab_size:
      r = int(np.argmax(tokens.max(axis=1) >= self.vocab_size))
      raise DataError(f"packed instance {instances[r]} (from {paths[per_row[r][0][0]]}) holds "
                      f"token {int(tokens[r].max())} >= the model's vocab_size {self.vocab_size}")
    doc_lens = np.zeros((R, max((len(x) for x in lens), default=0)), np.int32)
    for r, x in enumerate(lens):
      doc_lens[r, :len(x)] = x
    return PackedRows(tokens, segment_ids, positions, label_mask, doc_lens)
