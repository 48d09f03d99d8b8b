"""python -m olmo3.data.prepare: documents -> OLMo-format token files + manifest.json.

  python -m olmo3.data.prepare --input PATTERN [--input ...] --tokenizer TOKENIZER --out DIR \\
      [--heldout_fraction F] [--workers N]

Inputs are plain text files (one document each), JSONL / JSONL.gz or Parquet (one document per
record, field `text`). TOKENIZER is a tokenizer.json path or a Hugging Face hub name (OLMo 3:
allenai/dolma2-tokenizer). Every document gets EOS appended. Documents, never instances, are
split between train and held-out, by a hash of the document's text: deterministic, independent
of the worker count, and exact duplicates always land in the same split.

Output: DIR/train/part-NNNNN.npy and DIR/heldout/part-NNNNN.npy (raw uint32 tokens), the
tokenizer they were made with (DIR/tokenizer.json) and DIR/manifest.json. DIR is a data source
in its own right: `--fdl_set=data.mix='"DIR"'` trains on its train split, evaluates its held-out
split and prepares tasks with its tokenizer (olmo3.data.sources). Files are written into a
staging directory and moved into place before the manifest is written (atomically, last): an
interrupted run never leaves a manifest that points at partial files. Rerunning on the same
input reproduces the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np
from etils import epath
from tokenizers import Tokenizer
from tqdm import tqdm

from olmo3.data.tokens import TOKEN_DTYPE, DataError, write_token_file

SPLITS = ("train", "heldout")
TOKENIZER_FILE = "tokenizer.json"  # beside manifest.json: the tokenizer of the token files
TOKENS_PER_FILE = 1 << 27  # 512 MB per token file
_DOCS_PER_CHUNK = 256
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>")


def expand_inputs(patterns: Sequence[str]) -> list[str]:
  """Input files in a deterministic order (sorted within each pattern, patterns in order)."""
  files = []
  for pattern in patterns:
    matched = sorted(glob.glob(pattern, recursive=True))
    if not matched:
      raise DataError(f"--input {pattern!r} matches no file")
    files.extend(f for f in matched if os.path.isfile(f))
  return list(dict.fromkeys(files))


def read_documents(path: str) -> Iterator[str]:
  """The documents of one input file."""
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
        yield record["text"]
  elif name.endswith(".parquet"):
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    if "text" not in table.schema_arrow.names:
      raise DataError(f"{path}: Parquet file has no column 'text' "
                      f"(columns: {table.schema_arrow.names})")
    for batch in table.iter_batches(columns=["text"]):
      yield from (t for t in batch.column(0).to_pylist() if t is not None)
  else:
    with open(path, encoding="utf-8", errors="replace") as f:
      yield f.read()


def is_heldout(text: str, fraction: float) -> bool:
  digest = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).digest()
  return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


def load_tokenizer(name: str) -> Tokenizer:
  if os.path.exists(name):
    return Tokenizer.from_file(name)
  try:
    return Tokenizer.from_pretrained(name)
  except Exception as e:  # the hub may be out of reach: say which tokenizer
    raise DataError(f"--tokenizer {name!r}: not a tokenizer.json file and not loadable from the "
                    f"Hugging Face hub ({e})") from None


def eos_id(tokenizer: Tokenizer, eos: str | None) -> int:
  for token in ([eos] if eos else _EOS_CANDIDATES):
    token_id = tokenizer.token_to_id(token)
    if token_id is not None:
      return token_id
  raise DataError(f"the tokenizer has no EOS token among {[eos] if eos else _EOS_CANDIDATES}; "
                  "name it with --eos")


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
  global _worker_tokenizer
  _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode(texts: list[str]) -> list[np.ndarray]:
  return [np.asarray(e.ids, TOKEN_DTYPE) for e in
          _worker_tokenizer.encode_batch(texts, add_special_tokens=False)]


def _chunks(files: Sequence[str], fraction: float) -> Iterator[tuple[list[str], list[bool]]]:
  texts, held = [], []
  for path in files:
    for text in read_documents(path):
      texts.append(text)
      held.append(is_heldout(text, fraction))
      if len(texts) == _DOCS_PER_CHUNK:
        yield texts, held
        texts, held = [], []
  if texts:
    yield texts, held


class _SplitWriter:
  """Appends documents to part files of one split, in order."""

  def __init__(self, root: str, split: str):
    self.dir = os.path.join(root, split)
    os.makedirs(self.dir, exist_ok=True)
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
    write_token_file(os.path.join(os.path.dirname(self.dir), name), np.concatenate(self.pending))
    self.files.append(name)
    self.file_tokens.append(self.pending_tokens)
    self.pending, self.pending_tokens = [], 0


@dataclasses.dataclass(frozen=True)
class Manifest:
  """DIR/manifest.json: per split the token files (relative to DIR), each file's token count
  (`file_tokens`; manifests written before it have the split's total only) and counts. Loading
  checks the files against it: a missing, shortened or grown file is a DataError naming it."""

  splits: dict
  vocab_size: int
  eos_id: int
  tokenizer: str
  heldout_fraction: float

  @classmethod
  def load(cls, directory: str | os.PathLike) -> Manifest:
    path = epath.Path(directory) / "manifest.json"
    if not path.exists():
      raise DataError(f"{directory}: no manifest.json (run python -m olmo3.data.prepare)")
    try:
      manifest = cls(**json.loads(path.read_text()))
      manifest.splits["train"]["tokens"]  # a manifest has at least the training split
    except (ValueError, TypeError, KeyError) as e:  # malformed JSON, missing or unknown keys
      raise DataError(f"{path} is not a readable manifest ({type(e).__name__}: {e}); prepare "
                      "the data again (python -m olmo3.data.prepare)") from None
    manifest._check_files(directory, path)
    return manifest

  def _check_files(self, directory: str | os.PathLike, path: epath.Path) -> None:
    for split, info in self.splits.items():
      files = self.files(directory, split)
      for file in files:
        if not file.exists():
          raise DataError(f"token file {file} is missing (listed in {path})")
      have = [file.stat().length // TOKEN_DTYPE.itemsize for file in files]
      for file, tokens, want in zip(files, have, info.get("file_tokens", ())):
        if tokens != want:
          raise DataError(f"token file {file} holds {tokens} tokens; {path} says {want}: the "
                          "file was changed or cut short since it was prepared (prepare again)")
      if sum(have) != info["tokens"]:
        raise DataError(f"the {split} files of {path} hold {sum(have)} tokens; it says "
                        f"{info['tokens']}: a file was changed or cut short since it was prepared "
                        f"({list(map(os.fspath, files))})")

  def files(self, directory: str | os.PathLike, split: str) -> list[epath.Path]:
    return [epath.Path(directory) / f for f in self.splits[split]["files"]]


def prepare(inputs: Sequence[str], tokenizer: str | Tokenizer, out: str,
            heldout_fraction: float = 0.0, workers: int = 1, eos: str | None = None,
            progress: bool = True, tokenizer_name: str | None = None) -> Manifest:
  """Tokenises `inputs` into `out` (see the module docstring). Returns the manifest, whose
  `tokenizer` is `tokenizer_name`, else the name or path `tokenizer` was given as."""
  if not 0 <= heldout_fraction < 1:
    raise DataError(f"--heldout_fraction={heldout_fraction}: must be in [0, 1)")
  files = expand_inputs(inputs)
  tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
  eos_token = eos_id(tok, eos)
  os.makedirs(out, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=".staging-", dir=out)
  try:
    writers = {s: _SplitWriter(staging, s) for s in SPLITS}
    pool = multiprocessing.get_context("spawn").Pool(
        workers, initializer=_init_worker, initargs=(tok.to_str(),)) if workers > 1 else None
    _init_worker(tok.to_str())
    bar = tqdm(unit="doc", disable=not progress, desc=f"tokenizing {len(files)} files")
    try:
      chunks = _chunks(files, heldout_fraction)
      # A bounded window of chunks at a time: memory stays flat whatever the input size, and
      # the output order is the input order whatever the worker count.
      while window := list(itertools.islice(chunks, 4 * max(workers, 1))):
        texts = [t for t, _ in window]
        for (_, held), docs in zip(window, pool.map(_encode, texts) if pool else map(_encode, texts)):
          for doc, h in zip(docs, held):
            writers["heldout" if h else "train"].add(np.append(doc, TOKEN_DTYPE.type(eos_token)))
          bar.update(len(docs))
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
        heldout_fraction=heldout_fraction)
    if manifest.splits["train"]["tokens"] == 0:
      raise DataError(f"{inputs}: no training tokens (all documents empty or held out)")
    # The tokenizer travels with its tokens: whoever reads DIR tokenizes tasks and compares
    # tokenizers with this very file, whatever the name it was loaded by points at later.
    with open(os.path.join(staging, TOKENIZER_FILE), "w") as f:
      f.write(tok.to_str())
    # Publish: old manifest out first, files into place, new manifest in last (atomically).
    manifest_path = os.path.join(out, "manifest.json")
    if os.path.exists(manifest_path):
      os.remove(manifest_path)
    for split in SPLITS:
      shutil.rmtree(os.path.join(out, split), ignore_errors=True)
      os.replace(os.path.join(staging, split), os.path.join(out, split))
    os.replace(os.path.join(staging, TOKENIZER_FILE), os.path.join(out, TOKENIZER_FILE))
    tmp = manifest_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(dataclasses.asdict(manifest), f, indent=2, sort_keys=True)
    os.replace(tmp, manifest_path)
    return manifest
  finally:
    shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m olmo3.data.prepare", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--input", action="append", required=True,
                      help="a file or glob pattern (repeatable): .txt, .jsonl[.gz], .parquet")
  parser.add_argument("--tokenizer", required=True, help="tokenizer.json path or hub name")
  parser.add_argument("--out", required=True)
  parser.add_argument("--heldout_fraction", type=float, default=0.0)
  parser.add_argument("--workers", type=int, default=1)
  parser.add_argument("--eos", default=None, help="EOS token string (default: <|endoftext|>)")
  args = parser.parse_args(argv)
  try:
    manifest = prepare(args.input, args.tokenizer, args.out, args.heldout_fraction,
                       args.workers, args.eos)
  except DataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for split, info in manifest.splits.items():
    print(f"{split}: {info['documents']:,} documents, {info['tokens']:,} tokens, "
          f"{len(info['files'])} files")
  print(f"wrote {os.path.join(args.out, 'manifest.json')}; train on it with "
        f"--fdl_set=data.mix='\"{args.out}\"' (its held-out split and tokenizer come along)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
