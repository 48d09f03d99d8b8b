"""OLMo-format token files: raw little-endian uint32, no header (despite OLMo's `.npy` names).

`TokenFiles` cuts each file into `tokens // seq_len` instances (the tail is dropped; instances
never span files) and numbers them across files in mix order, as OLMo-core's fixed-length
numpy dataset does; with `chunk` > 1 (OLMo-core's max_target_sequence_length of chunk × seq_len)
only whole runs of `chunk` instances, `tokens // (chunk × seq_len) × chunk` of them. Each file
belongs to a source (its mix label; files given without labels form one source, `UNLABELLED`),
so every instance has one. Local files are memory-mapped; remote
ones (gs://, s3://, http(s)://: olmo3.io.storage) are read by range, a whole step's rows in one
concurrent batch (`read`), and their sizes are looked up once (concurrently) and cached.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from olmo3.io import clients, errors, file_sizes, pathnames, storage

TOKEN_DTYPE = np.dtype("<u4")
_SCAN_TOKENS = 1 << 24  # tokens per chunk when validating a file
UNLABELLED = "all"  # the one source of files given without labels (DataConfig.paths)


class DataError(ValueError):
  """Bad data input. The message names the file or field."""


def is_local(path: str | os.PathLike) -> bool:
  return not pathnames.is_url(path)


def _count(path: str, size: int | None, kind: str) -> int:
  if size is None:
    raise DataError(f"{kind} {path} does not exist")
  if size == 0:
    raise DataError(f"{kind} {path} is empty")
  if size % TOKEN_DTYPE.itemsize:
    raise DataError(f"{kind} {path} has {size} bytes, not a multiple of 4: not a raw uint32 "
                    "token file")
  return size // TOKEN_DTYPE.itemsize


# What a run whose data changed under it can do.
CHANGED_REMEDY = ("Restore the file; or continue deliberately on the data as it is now with "
                  "data.allow_changed_data=True; or start a new run on it")


def token_counts(paths: Sequence[str | os.PathLike], kind: str = "token file",
                 size_cache: file_sizes.SizeCache | None = None) -> list[int]:
  """The tokens each raw uint32 token file holds (remote sizes looked up concurrently, through
  `size_cache` when given), or DataError naming the first file (`kind` says what the files are
  for) that is missing, empty or not a whole number of tokens."""
  texts = [os.fspath(p) for p in paths]
  for text in texts:
    try:
      clients.check_supported(text, what=kind)
    except ValueError as e:
      raise DataError(str(e)) from None
  try:
    found = (size_cache.sizes if size_cache else storage.sizes)(texts)
  except errors.ChangedSince as e:
    raise DataError(f"{kind} {e}. {CHANGED_REMEDY}") from None
  return [_count(t, n, kind) for t, n in zip(texts, found)]


def token_count(path: str | os.PathLike, kind: str = "token file") -> int:
  """The tokens one raw uint32 token file holds (see `token_counts`)."""
  return token_counts([path], kind)[0]


class TokenFiles:
  """Fixed-length instances over token files. Random access; picklable (handles reopen)."""

  conversations = False  # chat data is always packed (olmo3.data.packing.PackedInstances)

  def __init__(self, paths: Sequence[str | os.PathLike], seq_len: int,
               vocab_size: int | None = None, validate_tokens: bool = False,
               labels: Sequence[str] | None = None,
               size_cache: file_sizes.SizeCache | None = None, chunk: int = 1):
    if not paths:
      raise DataError("no token files given")
    if labels is not None and len(labels) != len(paths):
      raise ValueError(f"{len(labels)} source labels for {len(paths)} token files")
    self.paths = [os.fspath(p) for p in paths]
    labels = [UNLABELLED] * len(paths) if labels is None else list(labels)
    self.source_names = tuple(sorted(set(labels)))  # a source's index is its place here
    self.file_source = np.searchsorted(self.source_names, labels).astype(np.int32)
    self.seq_len = seq_len
    self.vocab_size = vocab_size
    self.file_tokens = np.asarray(token_counts(self.paths, size_cache=size_cache), np.int64)
    self.file_instances = self.file_tokens // (chunk * seq_len) * chunk
    self.offsets = np.concatenate([[0], np.cumsum(self.file_instances)])
    if self.offsets[-1] == 0:
      whole = (f"a whole instance of {seq_len} tokens" if chunk == 1 else
               f"{chunk * seq_len} tokens (data.max_target_seq_len: {chunk} instances of "
               f"{seq_len})")
      raise DataError(f"no file holds {whole} (largest: {self.file_tokens.max()} tokens)")
    self._maps: dict[int, np.ndarray] = {}
    if validate_tokens:
      if vocab_size is None:
        raise ValueError("validate_tokens needs the model's vocab_size")
      for i in range(len(self.paths)):
        self._check_file(i)

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_maps"] = {}  # memory maps are reopened in the process that unpickles
    return state

  def _read(self, file: int, start: int, count: int) -> np.ndarray:
    return self._read_many([(file, start, count)])[0]

  def _read_many(self, spans: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
    """Tokens [start, start + count) of each (file, start, count): local files from their
    memory maps, remote ones in one concurrent batch of ranged reads."""
    out: list[np.ndarray | None] = [None] * len(spans)
    remote = []
    checked = set()
    for i, (file, start, count) in enumerate(spans):
      path = self.paths[file]
      if is_local(path):
        if file not in checked:
          self._check_size(file)
          checked.add(file)
        if file not in self._maps:
          self._maps[file] = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
        out[i] = np.asarray(self._maps[file][start:start + count])
      else:
        remote.append(i)
    size = TOKEN_DTYPE.itemsize
    try:
      chunks = storage.read_ranges([(self.paths[spans[i][0]], spans[i][1] * size,
                                     (spans[i][1] + spans[i][2]) * size) for i in remote])
    except errors.ChangedSince as e:
      raise DataError(f"token file {e}: it changed after this launch counted its tokens. "
                      f"{CHANGED_REMEDY}") from None
    for i, chunk in zip(remote, chunks):
      out[i] = np.frombuffer(chunk, TOKEN_DTYPE)
    return out  # type: ignore[return-value]

  def _check_size(self, file: int) -> None:
    """A local file is still as long as when it was counted: reading a memory map past the
    end of a file cut short since would kill the process (SIGBUS) instead of raising."""
    path, counted = self.paths[file], int(self.file_tokens[file])
    try:
      tokens = os.stat(path).st_size // TOKEN_DTYPE.itemsize
    except FileNotFoundError:
      tokens = None
    if tokens is None or tokens < counted:
      now = "is gone" if tokens is None else f"holds {tokens} tokens"
      raise DataError(f"token file {path} {now}; it held {counted} when this launch counted "
                      "them: it was cut short, moved or replaced since. Restore it (each launch "
                      "counts the data afresh)")

  def _check_file(self, file: int) -> None:
    for start in range(0, int(self.file_tokens[file]), _SCAN_TOKENS):
      chunk = self._read(file, start, _SCAN_TOKENS)
      if chunk.max(initial=0) >= self.vocab_size:
        at = start + int(np.argmax(chunk >= self.vocab_size))
        raise DataError(f"token file {self.paths[file]}: token {int(chunk[at - start])} at "
                        f"position {at} is >= the model's vocab_size {self.vocab_size}")

  def locate(self, index: int) -> tuple[int, int]:
    """(file number, first token) of instance `index`."""
    if not 0 <= index < len(self):
      raise IndexError(f"instance {index} out of range [0, {len(self)})")
    file = int(np.searchsorted(self.offsets, index, side="right") - 1)
    return file, int(index - self.offsets[file]) * self.seq_len

  def source_of(self, instances: np.ndarray) -> np.ndarray:
    """The source index (into `source_names`) of each instance, int32."""
    return self.file_source[np.searchsorted(self.offsets, instances, side="right") - 1]

  def __getitem__(self, index: int) -> np.ndarray:
    """Instance `index` as int32 token ids [seq_len]."""
    return self.read([index])[0]

  def read(self, instances: Sequence[int] | np.ndarray) -> np.ndarray:
    """Instances as int32 token ids [len(instances), seq_len], remote ones read together."""
    located = [self.locate(int(i)) for i in instances]
    rows = self._read_many([(file, start, self.seq_len) for file, start in located])
    tokens = np.stack(rows) if rows else np.zeros((0, self.seq_len), TOKEN_DTYPE)
    if self.vocab_size is not None and len(tokens) and tokens.max() >= self.vocab_size:
      r = int(np.argmax(tokens.max(axis=1) >= self.vocab_size))
      raise DataError(f"token file {self.paths[located[r][0]]}: instance {int(instances[r])} "
                      f"holds token {int(tokens[r].max())} >= the model's vocab_size "
                      f"{self.vocab_size}")
    return tokens.astype(np.int32)


def write_token_file(path: str | os.PathLike, tokens: np.ndarray) -> None:
  """Writes raw little-endian uint32 tokens whole (olmo3.io.storage.write_bytes_atomic)."""
  data = np.ascontiguousarray(tokens, TOKEN_DTYPE)
  # Flushed, not synced: token files are rewritten only by a tool that can run again, and a
  # file a machine's crash cut short fails its manifest's size check when read.
  storage.write_bytes_atomic(path, memoryview(data).cast("B"),  # no copy of up to 512 MB
                             durability=storage.Durability.FLUSHED)
