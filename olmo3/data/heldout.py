"""Held-out LM sets, as OLMo's perplexity sets (OLMo-core's NumpyPaddedFSLDataset): one
document per instance, truncated to seq_len, right-padded with PAD, padding masked. Documents
end with EOS in the token files. The files (validation sets: small) are read whole when the set
is opened, from local disk or a URL (olmo3.io.storage: gs://, s3://, http(s)://), and checked
there, so a missing file or a token the model cannot embed stops a run before its first step.
Chat data's held-out conversations are scored on their trained tokens only: a token file with a
label mask (olmo3.data.label_masks) has the labels of untrained tokens ignored, as training
ignores them, so the loss (and the generalization gap) is the assistant's."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence

import numpy as np

from olmo3.config import Experiment
from olmo3.io import storage
from olmo3.data import label_masks
from olmo3.data.tokens import TOKEN_DTYPE, DataError, is_local, token_count
from olmo3.loss import IGNORE


class HeldoutDocs:
  """Held-out documents, read as padded rows of any batch shape (`rows`)."""

  def __init__(self, paths: Sequence[str | os.PathLike], seq_len: int, eos_id: int, pad_id: int,
               max_documents: int | None = None, vocab_size: int | None = None,
               min_tokens: int | None = None):
    """The documents of `paths` (each ending at `eos_id`), those of at least `min_tokens`
    tokens when given, the first `max_documents` of them."""
    self.seq_len, self.pad_id = seq_len, pad_id
    self._tokens = []
    self._trained: list[np.ndarray | None] = []  # each file's label mask (chat data), or None
    self._docs: list[tuple[int, int, int]] = []  # (file, start, end)
    for f, path in enumerate(map(os.fspath, paths)):
      tokens = _read_tokens(path)
      if vocab_size is not None and tokens.max(initial=0) >= vocab_size:
        at = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"held-out token file {path}: token {int(tokens[at])} at position {at} "
                        f"is >= the model's vocab_size {vocab_size}")
      ends = np.flatnonzero(tokens == eos_id) + 1
      starts = np.concatenate([[0], ends[:-1]])
      self._docs.extend((f, int(s), int(e)) for s, e in zip(starts, ends))
      self._tokens.append(tokens)
      self._trained.append(_read_mask(path, len(tokens)))
    self.file_documents = len(self._docs)  # before min_tokens and max_documents choose
    if min_tokens is not None:
      self._docs = [d for d in self._docs if d[2] - d[1] >= min_tokens]
    if max_documents is not None:
      self._docs = self._docs[:max_documents]
    if not self._docs:
      raise DataError(f"held-out files {list(map(os.fspath, paths))} hold no EOS-terminated "
                      "document" + (f" of {min_tokens} tokens or more (eval.min_document_tokens)"
                                    if min_tokens is not None else ""))

  def __len__(self) -> int:
    return len(self._docs)

  @functools.cached_property
  def lengths(self) -> np.ndarray:
    """Each document's tokens as scored: cut to seq_len."""
    return np.array([min(end - start, self.seq_len) for _, start, end in self._docs])

  def document(self, index: int) -> np.ndarray:
    """Document `index`'s tokens, whole (EOS included)."""
    f, start, end = self._docs[index]
    return np.asarray(self._tokens[f][start:end])

  def rows(self, indices: Sequence[int], length: int, batch_size: int
           ) -> dict[str, np.ndarray]:
    """input_ids and labels [batch_size, length] of the documents `indices` (none longer than
    `length` once cut to seq_len), one per row; rows past them are fully masked."""
    ids = np.full((batch_size, length), self.pad_id, np.int32)
    labels = np.full((batch_size, length), IGNORE, np.int32)
    for row, index in enumerate(indices):
      f, start, end = self._docs[index]
      doc = np.asarray(self._tokens[f][start:min(end, start + self.seq_len)], np.int32)
      ids[row, :len(doc)] = doc
      labels[row, :len(doc) - 1] = doc[1:]
      trained = self._trained[f]
      if trained is not None:  # a label counts where its token is trained (OLMo-core's)
        labels[row, :len(doc) - 1][~trained[start + 1:start + len(doc)]] = IGNORE
    return {"input_ids": ids, "labels": labels}


def scored_sets(exp: Experiment, sets: Mapping[str, Sequence[str]]) -> dict[str, HeldoutDocs]:
  """{set: its documents} as the run's evaluation scores them ({set: token files} `sets`): at
  the run's sequence length, eval.min_document_tokens and eval.max_documents applied."""
  ev, model = exp.eval, exp.model
  return {name: HeldoutDocs(paths, exp.data.seq_len, model.eos_token_id, model.pad_token_id,
                            ev.max_documents, model.vocab_size, ev.min_document_tokens)
          for name, paths in sets.items()}


def _read_tokens(path: str) -> np.ndarray:
  token_count(path, "held-out token file")  # missing, empty or torn: named
  if is_local(path):
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
  return np.frombuffer(storage.read_bytes(path), TOKEN_DTYPE)


def _read_mask(path: str, tokens: int) -> np.ndarray | None:
  """The label mask of a held-out token file (None: it has none), read whole, as bool."""
  mask = label_masks.mask_path(path)
  if mask is None:
    return None
  data = np.frombuffer(storage.read_bytes(mask), np.uint8) if storage.exists(mask) else None
  if data is None or len(data) != tokens:
    raise DataError(f"held-out label mask {mask} " + ("does not exist" if data is None else
                    f"holds {len(data)} bytes, but its token file {path} holds {tokens} tokens")
                    + ": a mask is one byte (bool) per token")
  return data != 0
