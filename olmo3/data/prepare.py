"""python -m olmo3.data.prepare: documents -> OLMo-format token files + manifest.json.

  python -m olmo3.data.prepare --input PATTERN [--input ...] --tokenizer TOKENIZER --out DIR \\
      [--heldout_fraction F] [--heldout_min_documents N] [--workers N]
  python -m olmo3.data.prepare --chat --chat_template NAME ...: conversations (JSONL
      `messages`) in OLMo-core's SFT format, with label masks (olmo3.data.prepare_chat)

Inputs are plain text files (one document each), JSONL / JSONL.gz or Parquet (one document per
record, field `text`). TOKENIZER is a tokenizer.json path or a Hugging Face hub name (OLMo 3:
allenai/dolma2-tokenizer). Every document gets EOS appended. Documents, never instances, are
split between train and held-out, by a hash of the document's text: deterministic, independent
of the worker count, and exact duplicates always land in the same split.

A held-out split is made unless asked not to (`--heldout_fraction 0`): by default 1% of the
documents, and at least 100 (never more than a tenth of them), so that a run on the directory
evaluates documents it never trains on and its generalization-gap alarm can fire. The floor
holds out the documents with the smallest hashes: the same rule, a lower cut.

The held-out split is then made disjoint from the training split (olmo3.data.overlap): a
held-out document that has half or more of its 13-token n-grams in the training documents (a
near-duplicate, a copy with small changes, a document quoted whole inside another; an exact copy
when it is shorter than that) is moved to training, after its other documents, and named in the
output and in the manifest's `overlap` record with its share. (So the split may end below the
floor; a split left empty is refused.)

Output: DIR/train/part-NNNNN.npy and DIR/heldout/part-NNNNN.npy (raw uint32 tokens), the
tokenizer they were made with (DIR/tokenizer.json) and DIR/manifest.json. DIR is a local path,
gs:// or s3:// (olmo3.io.storage; not http(s)://, which is read-only). DIR is a data source in
its own right, wherever it is read from (http(s):// too: `python -m olmo3.data.serve`):
`--fdl_set=data.mix='"DIR"'` trains on its train split, evaluates its held-out split and
prepares tasks with its tokenizer (olmo3.data.sources).

The manifest is written last (atomically), and only a directory with one is a prepared
directory: an interrupted or failed run never leaves a manifest that points at partial files.
On a disk, files are written into a staging directory and moved into place, the old manifest
removed just before; in a bucket, which has no rename, each token file is uploaded to its
place as soon as it is complete (an object appears whole or not at all), the old manifest
removed before the first, and a failed run removes what it uploaded. Rerunning on the same
input reproduces the same bytes.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from olmo3 import program
from olmo3.data import label_masks, overlap, prepare_chat
from olmo3.data import tokenizer as tokenizer_lib
from olmo3.data.manifest import MANIFEST_FILE, SPLITS, TOKENIZER_FILE, Manifest
from olmo3.data.preparing import (  # noqa: F401  # (is_heldout: the embedded corpus's split)
    DEFAULT_HELDOUT_FRACTION, DEFAULT_HELDOUT_MIN_DOCUMENTS, FLOOR_SHARE, eos_id, expand_inputs,
    Staging, heldout_cut, is_heldout, rank, refuse_to_replace_foreign_files)
from olmo3.data.tokens import TOKEN_DTYPE, DataError, write_token_file
from olmo3.io import clients, errors, pathnames, storage

TOKENS_PER_FILE = 1 << 27  # 512 MB per token file
_DOCS_PER_CHUNK = 256


def read_documents(path: str) -> Iterator[tuple[str, str]]:
  """The documents of one input file: (where each is, for messages: file, line or row, and a
  JSONL record's id; its text)."""
  name = path.lower()
  if name.endswith((".jsonl", ".jsonl.gz", ".json.gz")):
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
      for number, line in enumerate(f, start=1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise DataError(f"{path}:{number}: not valid JSON ({e})") from None
        if not isinstance(record.get("text"), str):
          raise DataError(f"{path}:{number}: no string field 'text'")
        known = f" (id {record['id']})" if isinstance(record.get("id"), (str, int)) else ""
        yield f"{path}:{number}{known}", record["text"]
  elif name.endswith(".parquet"):
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    if "text" not in table.schema_arrow.names:
      raise DataError(f"{path}: Parquet file has no column 'text' "
                      f"(columns: {table.schema_arrow.names})")
    rows = itertools.count(1)
    for batch in table.iter_batches(columns=["text"]):
      yield from ((f"{path}, row {row}", t) for row, t in zip(rows, batch.column(0).to_pylist())
                  if t is not None)
  else:
    with open(path, encoding="utf-8", errors="replace") as f:
      yield path, f.read()


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
  global _worker_tokenizer
  _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode(texts: list[str]) -> list[np.ndarray]:
  return [np.asarray(e.ids, TOKEN_DTYPE) for e in
          _worker_tokenizer.encode_batch(texts, add_special_tokens=False)]


def _documents(files: Sequence[str]) -> Iterator[str]:
  for path in files:
    yield from (text for _, text in read_documents(path))


def _chunks(files: Sequence[str], cut: int, heldout: bool
            ) -> Iterator[tuple[list[str], list[str]]]:
  """The documents of one side of the split, in input order, in chunks: where each one is,
  and its text."""
  wheres, texts = [], []
  for path in files:
    for where, text in read_documents(path):
      if (rank(text) < cut) == heldout:
        wheres.append(where)
        texts.append(text)
        if len(texts) == _DOCS_PER_CHUNK:
          yield wheres, texts
          wheres, texts = [], []
  if texts:
    yield wheres, texts


def _encoded(files: Sequence[str], cut: int, heldout: bool, pool, width: int, bar
             ) -> Iterator[tuple[str, np.ndarray]]:
  """(where, tokens) of one side's documents, in input order. A bounded window of chunks at a
  time: memory stays flat whatever the input size, and the order is the input order whatever
  the worker count."""
  chunks = _chunks(files, cut, heldout)
  while window := list(itertools.islice(chunks, width)):
    texts = [t for _, t in window]
    for (wheres, _), docs in zip(window, pool.map(_encode, texts) if pool else map(_encode, texts)):
      yield from zip(wheres, docs)
      bar.update(len(docs))


class _SplitWriter:
  """Appends documents to part files of one split, in order, under `root` (a local directory
  or a URL)."""

  def __init__(self, root: str, split: str):
    self.root = root
    if not pathnames.is_url(root):
      os.makedirs(os.path.join(root, split), exist_ok=True)
    self.files: list[str] = []
    self.file_tokens: list[int] = []
    self.pending: list[np.ndarray] = []
    self.pending_tokens = self.documents = self.tokens = 0
    self.split = split

  def add(self, doc: np.ndarray) -> None:
    self.pending.append(doc)
    self.pending_tokens += len(doc)
    self.documents += 1
    self.tokens += len(doc)
    if self.pending_tokens >= TOKENS_PER_FILE:
      self.flush()

  def flush(self) -> None:
    if not self.pending:
      return
    name = f"{self.split}/part-{len(self.files):05d}.npy"
    write_token_file(pathnames.join(self.root, name), np.concatenate(self.pending))
    self.files.append(name)
    self.file_tokens.append(self.pending_tokens)
    self.pending, self.pending_tokens = [], 0


def prepare(inputs: Sequence[str], tokenizer: str | Tokenizer, out: str,
            heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, workers: int = 1,
            eos: str | None = None, progress: bool = True, tokenizer_name: str | None = None,
            heldout_min_documents: int = DEFAULT_HELDOUT_MIN_DOCUMENTS) -> Manifest:
  """Tokenises `inputs` into `out` (see the module docstring). Returns the manifest, whose
  `tokenizer` is `tokenizer_name`, else the name or path `tokenizer` was given as."""
  if not 0 <= heldout_fraction < 1:
    raise DataError(f"--heldout_fraction={heldout_fraction}: must be in [0, 1)")
  if heldout_min_documents < 0:
    raise DataError(f"--heldout_min_documents={heldout_min_documents}: must be >= 0")
  try:
    clients.check_supported(out, writable=True, what="--out")
  except ValueError as e:
    raise DataError(str(e)) from None
  files = expand_inputs(inputs)
  refuse_to_replace_foreign_files(out, files)
  tok = (tokenizer if isinstance(tokenizer, Tokenizer)
         else tokenizer_lib.load(tokenizer, what="--tokenizer"))
  eos_token = eos_id(tok, eos)
  cut = heldout_cut(_documents(files), heldout_fraction, heldout_min_documents)
  staging = Staging(out)
  with staging as root:  # in a bucket, `out` itself (module docstring)
    writers = {s: _SplitWriter(root, s) for s in SPLITS}
    pool = multiprocessing.get_context("spawn").Pool(
        workers, initializer=_init_worker, initargs=(tok.to_str(),)) if workers > 1 else None
    _init_worker(tok.to_str())
    bar = tqdm(unit="doc", disable=not progress, desc=f"tokenizing {len(files)} files")
    try:
      encoding = (pool, 4 * max(workers, 1), bar)
      disjoint = overlap.disjoint(
          _encoded(files, cut, True, *encoding) if cut else (),  # none held out: no pass
          (doc for _, doc in _encoded(files, cut, False, *encoding)), eos_token,
          writers["train"].add, writers["heldout"].add)
    finally:
      bar.close()
      if pool:
        pool.terminate()
    for w in writers.values():
      w.flush()
    manifest = Manifest(
        splits={s: {"files": w.files, "file_tokens": w.file_tokens, "documents": w.documents,
                    "tokens": w.tokens}
                for s, w in writers.items()},
        vocab_size=tok.get_vocab_size(), eos_id=eos_token,
        tokenizer=tokenizer_name or (tokenizer if isinstance(tokenizer, str) else "<in memory>"),
        heldout_fraction=heldout_fraction, overlap=disjoint)
    _check_splits(manifest, inputs, cut)
    staging.into_place()
    # Flushed, as the token files: a tool that can run again, and a manifest whose files are
    # checked against it whenever it is read.
    flushed = storage.Durability.FLUSHED
    # The tokenizer travels with its tokens: whoever reads DIR tokenizes tasks and compares
    # tokenizers with this very file, whatever the name it was loaded by points at later.
    storage.write_bytes_atomic(pathnames.join(out, TOKENIZER_FILE), tok.to_str().encode(),
                               durability=flushed)
    storage.write_bytes_atomic(pathnames.join(out, MANIFEST_FILE), json.dumps(
        dataclasses.asdict(manifest), indent=2, sort_keys=True).encode(), durability=flushed)
    return manifest


def _check_splits(manifest: Manifest, inputs: Sequence[str], cut: bool) -> None:
  """Refuses a preparation with no training tokens, or asked for held-out documents and left
  with none."""
  if manifest.splits["train"]["tokens"] == 0:
    raise DataError(f"{inputs}: no training tokens (all documents empty or held out)")
  if cut and manifest.splits["heldout"]["documents"] == 0:
    raise DataError(f"{inputs}: every held-out document overlaps the training documents and "
                    "moved to them: no held-out split is left (deduplicate the input, or "
                    "raise --heldout_fraction)")


def _chat_arguments(parser) -> None:
  parser.add_argument("--chat", action="store_true",
                      help="the inputs are JSONL conversations ('messages'): written in "
                      "OLMo-core's SFT format with label masks (olmo3.data.prepare_chat)")
  parser.add_argument("--chat_template", default=None,
                      help="with --chat: olmo3_think (AI2's Think SFT template), tokenizer (the "
                      "tokenizer's own chat_template) or a .jinja file")
  parser.add_argument("--max_tokens", type=int, default=label_masks.MAX_TOKENS,
                      help="with --chat: each conversation cut to this many tokens (default "
                      "AI2's)")
  parser.add_argument("--part_tokens", type=int, default=label_masks.PART_TOKENS,
                      help="with --chat: tokens per part file (default 1 GiB of uint32, as "
                      "open-instruct's converter)")


def main(argv: list[str] | None = None) -> int:
  parser = program.parser("python -m olmo3.data.prepare", __doc__)
  parser.add_argument("--input", action="append", required=True,
                      help="a file or glob pattern (repeatable): .txt, .jsonl[.gz], .parquet")
  parser.add_argument("--tokenizer", required=True, help="tokenizer.json path or hub name")
  parser.add_argument("--out", required=True)
  parser.add_argument(
      "--heldout_fraction", type=float, default=DEFAULT_HELDOUT_FRACTION,
      help=f"documents held out for evaluation (default {DEFAULT_HELDOUT_FRACTION}, at least "
      "--heldout_min_documents of them); 0: no held-out split, and a run on the directory "
      "evaluates no held-out set, so its generalization-gap alarm cannot fire")
  parser.add_argument(
      "--heldout_min_documents", type=int, default=DEFAULT_HELDOUT_MIN_DOCUMENTS,
      help=f"the floor of held-out documents (default {DEFAULT_HELDOUT_MIN_DOCUMENTS}; never "
      f"more than 1/{FLOOR_SHARE} of the documents): small inputs still get a held-out set")
  parser.add_argument("--workers", type=int, default=1)
  parser.add_argument("--eos", default=None, help="EOS token string (default: <|endoftext|>)")
  _chat_arguments(parser)
  args = parser.parse_args(argv)
  try:
    if args.chat != (args.chat_template is not None):
      raise DataError("--chat and --chat_template go together: conversations are rendered "
                      "with a chat template (olmo3_think, tokenizer or a .jinja file)")
    if args.chat:
      manifest = prepare_chat.prepare_chat(
          args.input, args.tokenizer, args.out, args.chat_template, args.max_tokens,
          args.heldout_fraction, args.heldout_min_documents, args.workers, args.eos,
          part_tokens=args.part_tokens)
    else:
      manifest = prepare(args.input, args.tokenizer, args.out, args.heldout_fraction,
                         args.workers, args.eos, heldout_min_documents=args.heldout_min_documents)
  except (DataError, OSError) as e:  # OSError: the output's store (olmo3.io.storage)
    if program.traceback_wanted():  # OLMO3_TRACEBACK=1
      raise
    print(f"error: {errors.first_line(e)}", file=sys.stderr)
    return 2
  if args.chat:
    print("\n".join(prepare_chat.describe(manifest)))
  else:
    for split, info in manifest.splits.items():
      print(f"{split}: {info['documents']:,} documents, {info['tokens']:,} tokens, "
            f"{len(info['files'])} files")
    print("\n".join(overlap.describe(manifest.overlap)))
  print(f"wrote {pathnames.join(args.out, MANIFEST_FILE)}; train on it with "
        f"--fdl_set=data.mix='\"{args.out}\"' (its held-out split and tokenizer come along)")
  return 0


if __name__ == "__main__":
  # Whatever else it raises from the stores ends as one line too, and the process ends even
  # if a client's thread does not (program.reported).
  sys.exit(program.reported(main, lambda: (DataError, OSError))())
