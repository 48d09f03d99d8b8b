"""`python -m olmo3.data.prepare --chat`: conversations -> OLMo-core's SFT files + manifest.json.

  python -m olmo3.data.prepare --chat --input 'convs/*.jsonl' --tokenizer TOKENIZER \\
      --chat_template olmo3_think|tokenizer|FILE.jinja --out DIR [--max_tokens 32768]

Each JSONL line (.jsonl or .jsonl.gz) holds a conversation in `messages` (role/content objects,
as open-instruct and the Hugging Face chat datasets write them; other keys are ignored). Each
is rendered with the chat template and encoded as open-instruct's converter made AI2's SFT
data (olmo3.data.chat: cut to --max_tokens, only the assistant's turns trained); one with
nothing to train on is dropped and counted. Whole conversations are held out as `prepare` holds
out documents (the same --heldout_fraction and floor, by a hash of the conversation's messages),
without the n-gram overlap check: every conversation shares the template's text.

Output per split, in parts of --part_tokens tokens (default 1 GiB of uint32, open-instruct's;
a conversation may straddle two parts, as there): DIR/<split>/token_ids_part_NNNN.npy,
labels_mask_part_NNNN.npy and token_ids_part_NNNN.csv.gz (olmo3.data.label_masks); then
DIR/tokenizer.json, DIR/tokenizer_config.json (the template as `chat_template`, the special
tokens) and DIR/manifest.json, last. The template's name, SHA-256 and whole text are in the
manifest's `chat` record. Written, replaced and cleaned up as `prepare` does.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from olmo3.data import chat as chat_lib
from olmo3.data import label_masks, preparing
from olmo3.data import tokenizer as tokenizer_lib
from olmo3.data.manifest import MANIFEST_FILE, SPLITS, TOKENIZER_FILE, Manifest
from olmo3.data.tokens import DataError, write_token_file
from olmo3.io import clients, pathnames, storage

_CHUNK = 64  # conversations per worker task


def read_conversations(path: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
  """(file:line, messages) of each conversation of a JSONL file; a DataError naming the line
  for one that is not JSON or has no valid `messages`."""
  if not path.lower().endswith((".jsonl", ".jsonl.gz", ".json.gz")):
    raise DataError(f"--input {path}: --chat reads JSONL files (.jsonl, .jsonl.gz) of "
                    "conversations in 'messages'")
  opener = gzip.open if path.lower().endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"{path}:{number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e})") from None
      if not isinstance(record, dict) or "messages" not in record:
        raise DataError(f"{where}: no 'messages' (a list of role/content messages)")
      yield where, chat_lib.check_messages(record["messages"], where)


def conversation_text(messages: list[dict[str, Any]]) -> str:
  """What a conversation's held-out hash is taken of: its messages, canonically."""
  return json.dumps(messages, sort_keys=True, ensure_ascii=False)


_worker_chat: chat_lib.Chat | None = None
_worker_max_tokens = 0


def _init_worker(template: chat_lib.ChatTemplate, tokenizer_json: str,
                 special: tuple[tuple[str, str], ...], max_tokens: int) -> None:
  global _worker_chat, _worker_max_tokens
  _worker_chat = chat_lib.Chat(template, Tokenizer.from_str(tokenizer_json), special)
  _worker_max_tokens = max_tokens


def _encode(conversations: list[list[dict[str, Any]]]):
  return [_worker_chat.encode(m, _worker_max_tokens) for m in conversations]


class _PartWriter:
  """Appends conversations (ids, mask) to one split's parts, cut every `part_tokens` tokens
  whatever the conversations, as open-instruct cuts them; each part's bounds file lists the
  conversations (pieces) in it."""

  def __init__(self, root: str, split: str, part_tokens: int):
    self.root, self.split, self.part_tokens = root, split, part_tokens
    if not pathnames.is_url(root):
      os.makedirs(os.path.join(root, split), exist_ok=True)
    self.ids: list[np.ndarray] = []
    self.masks: list[np.ndarray] = []
    self.bounds: list[tuple[int, int]] = []  # split-relative, of conversations not yet written
    self.pending = self.written = self.documents = self.trained = 0
    self.files: list[str] = []
    self.file_tokens: list[int] = []

  def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
    start = self.written + self.pending
    self.ids.append(ids)
    self.masks.append(mask)
    self.bounds.append((start, start + len(ids)))
    self.pending += len(ids)
    self.documents += 1
    self.trained += int(mask.sum())
    while self.pending >= self.part_tokens:
      self._part(self.part_tokens)

  def close(self) -> None:
    if self.pending:
      self._part(self.pending)

  def _part(self, n: int) -> None:
    ids, masks = np.concatenate(self.ids), np.concatenate(self.masks)
    self.ids, self.masks = [ids[n:]], [masks[n:]]
    lo, hi = self.written, self.written + n
    lines = "".join(f"{max(s, lo) - lo},{min(e, hi) - lo}\n" for s, e in self.bounds
                    if e > lo and s < hi)
    self.bounds = [(s, e) for s, e in self.bounds if e > hi]
    number = len(self.files)
    name = f"{self.split}/{label_masks.TOKENS.format(number)}"
    write_token_file(pathnames.join(self.root, name), ids[:n])
    # Flushed, as the token files: prepared data, checked against its manifest when read.
    flushed = storage.Durability.FLUSHED
    storage.write_bytes_atomic(
        pathnames.join(self.root, self.split, label_masks.MASK.format(number)),
        np.ascontiguousarray(masks[:n], np.bool_).tobytes(), durability=flushed)
    storage.write_bytes_atomic(  # mtime 0: the same input gives the same bytes
        pathnames.join(self.root, self.split, label_masks.BOUNDS.format(number)),
        gzip.compress(lines.encode(), mtime=0), durability=flushed)
    self.files.append(name)
    self.file_tokens.append(n)
    self.written, self.pending = hi, self.pending - n

  def record(self) -> dict[str, Any]:
    numbers = range(len(self.files))
    return {"files": self.files, "file_tokens": self.file_tokens,
            "masks": [f"{self.split}/{label_masks.MASK.format(i)}" for i in numbers],
            "bounds": [f"{self.split}/{label_masks.BOUNDS.format(i)}" for i in numbers],
            "documents": self.documents, "tokens": self.written, "trained_tokens": self.trained}


@dataclasses.dataclass
class _Counts:
  read: int = 0
  dropped: int = 0
  first_dropped: str | None = None


def _conversations(files: Sequence[str], cut: int, heldout: bool
                   ) -> Iterator[tuple[str, list[dict[str, Any]]]]:
  for path in files:
    for where, messages in read_conversations(path):
      if (preparing.rank(conversation_text(messages)) < cut) == heldout:
        yield where, messages


def _write_split(files: Sequence[str], cut: int, heldout: bool, writer: _PartWriter, pool,
                 counts: _Counts, bar) -> None:
  """Encodes one side's conversations in input order (a bounded window of chunks at a time,
  as `prepare`) into `writer`."""
  chunks = iter(lambda it=_conversations(files, cut, heldout): list(itertools.islice(it, _CHUNK)),
                [])
  while window := list(itertools.islice(chunks, 8)):
    encoded = (pool.map(_encode, [[m for _, m in c] for c in window]) if pool
               else [_encode([m for _, m in c]) for c in window])
    for chunk, results in zip(window, encoded):
      for (where, _), result in zip(chunk, results):
        counts.read += 1
        if result is None:
          counts.dropped += 1
          counts.first_dropped = counts.first_dropped or where
        else:
          writer.add(*result)
      bar.update(len(chunk))


def _write_splits(files: Sequence[str], cut: int, writers: dict[str, _PartWriter],
                  setup: tuple, workers: int, progress: bool) -> _Counts:
  """Encodes the conversations into both splits' writers (`setup`: `_init_worker`'s)."""
  pool = multiprocessing.get_context("spawn").Pool(
      workers, initializer=_init_worker, initargs=setup) if workers > 1 else None
  _init_worker(*setup)
  counts = _Counts()
  bar = tqdm(unit="conversation", disable=not progress, desc=f"encoding {len(files)} files")
  try:
    for split in SPLITS:
      _write_split(files, cut, split == "heldout", writers[split], pool, counts, bar)
      writers[split].close()
  finally:
    bar.close()
    if pool:
      pool.terminate()
  return counts


def prepare_chat(inputs: Sequence[str], tokenizer: str | Tokenizer, out: str, template: str,
                 max_tokens: int = label_masks.MAX_TOKENS,
                 heldout_fraction: float = preparing.DEFAULT_HELDOUT_FRACTION,
                 heldout_min_documents: int = preparing.DEFAULT_HELDOUT_MIN_DOCUMENTS,
                 workers: int = 1, eos: str | None = None, progress: bool = True,
                 tokenizer_name: str | None = None,
                 part_tokens: int = label_masks.PART_TOKENS) -> Manifest:
  """Tokenises the conversations of `inputs` into `out` (see the module docstring)."""
  if not 0 <= heldout_fraction < 1:
    raise DataError(f"--heldout_fraction={heldout_fraction}: must be in [0, 1)")
  if heldout_min_documents < 0 or max_tokens < 1 or part_tokens < 1:
    raise DataError("--heldout_min_documents must be >= 0, --max_tokens and --part_tokens >= 1")
  try:
    clients.check_supported(out, writable=True, what="--out")
  except ValueError as e:
    raise DataError(str(e)) from None
  files = preparing.expand_inputs(inputs)
  preparing.refuse_to_replace_foreign_files(out, files)
  tok = (tokenizer if isinstance(tokenizer, Tokenizer)
         else tokenizer_lib.load(tokenizer, what="--tokenizer"))
  config = (tokenizer_lib.config(tokenizer, "--tokenizer") if isinstance(tokenizer, str)
            else None)
  chosen = chat_lib.ChatTemplate.named(template, config)
  eos_token = preparing.eos_id(tok, eos)
  special = chat_lib.special_tokens(tok, eos_token, config)
  cut = preparing.heldout_cut(
      (conversation_text(m) for f in files for _, m in read_conversations(f)),
      heldout_fraction, heldout_min_documents)
  staging = preparing.Staging(out)
  with staging as root:  # in a bucket, `out` itself (as prepare)
    writers = {s: _PartWriter(root, s, part_tokens) for s in SPLITS}
    counts = _write_splits(files, cut, writers, (chosen, tok.to_str(), special, max_tokens),
                           workers, progress)
    manifest = Manifest(
        splits={s: w.record() for s, w in writers.items()}, vocab_size=tok.get_vocab_size(),
        eos_id=eos_token, heldout_fraction=heldout_fraction, kind="chat",
        tokenizer=tokenizer_name or (tokenizer if isinstance(tokenizer, str) else "<in memory>"),
        chat={"template": {"name": chosen.name, "sha256": chosen.sha256, "text": chosen.text},
              "max_tokens": max_tokens, "conversations": counts.read,
              "dropped": counts.dropped, "first_dropped": counts.first_dropped})
    if manifest.splits["train"]["tokens"] == 0:
      raise DataError(f"{inputs}: no conversation to train on ({counts.read} read, "
                      f"{counts.dropped} with no assistant token to train)")
    staging.into_place()
    flushed = storage.Durability.FLUSHED  # as `prepare`: a tool that can run again
    storage.write_bytes_atomic(pathnames.join(out, TOKENIZER_FILE), tok.to_str().encode(),
                               durability=flushed)
    saved = {**(config or {}), **dict(special), "chat_template": chosen.text}
    storage.write_bytes_atomic(pathnames.join(out, tokenizer_lib.CONFIG_FILE), json.dumps(
        saved, indent=2, sort_keys=True).encode(), durability=flushed)
    storage.write_bytes_atomic(pathnames.join(out, MANIFEST_FILE), json.dumps(
        dataclasses.asdict(manifest), indent=2, sort_keys=True).encode(), durability=flushed)
    return manifest


def describe(manifest: Manifest) -> list[str]:
  """What `prepare --chat` prints of what it wrote."""
  record = manifest.chat or {}
  lines = [f"{split}: {info['documents']:,} conversations, {info['tokens']:,} tokens "
           f"({info['trained_tokens']:,} trained), {len(info['files'])} parts"
           for split, info in manifest.splits.items()]
  template = record.get("template", {})
  lines.append(f"chat template {template.get('name')} (sha256 {template.get('sha256', '')[:12]}); "
               f"{record.get('dropped', 0):,} of {record.get('conversations', 0):,} "
               "conversations dropped (nothing to train)" + (
                   f", the first {record['first_dropped']}" if record.get("first_dropped") else ""))
  return lines
