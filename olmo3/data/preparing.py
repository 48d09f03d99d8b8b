"""What both preparations share (`python -m olmo3.data.prepare`, of documents, and its
`--chat`, of conversations, olmo3.data.prepare_chat): the inputs, the held-out split by hash,
the EOS, and how an output directory is replaced (never a file no preparation wrote).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import heapq
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence

from etils import epath
from tokenizers import Tokenizer

from olmo3.data import tokenizer as tokenizer_lib
from olmo3.data.manifest import MANIFEST_FILE, SPLITS, TOKENIZER_FILE
from olmo3.data.tokens import DataError
from olmo3.io import pathnames, retry, storage

DEFAULT_HELDOUT_FRACTION = 0.01  # of the documents, held out unless --heldout_fraction 0
DEFAULT_HELDOUT_MIN_DOCUMENTS = 100  # the floor: a held-out loss over fewer is mostly noise
FLOOR_SHARE = 10  # the floor never holds out more than 1/FLOOR_SHARE of the documents
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


def rank(text: str) -> int:
  """A document's place in the held-out order: its text's hash, as a 64-bit integer."""
  digest = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).digest()
  return int.from_bytes(digest[:8], "big")


def is_heldout(text: str, fraction: float) -> bool:
  """Held out by the fraction alone (`heldout_cut` may lower the cut for a floor)."""
  return rank(text) < fraction * 2.0**64


def heldout_cut(texts: Iterable[str], fraction: float, min_documents: int) -> int:
  """The rank below which a document is held out: `fraction` of the rank range, or, when that
  holds out fewer than min(min_documents, a tenth of the documents), just above the rank of
  the last document the floor takes (its exact duplicates with it). Reads `texts` only until
  the fraction alone is known to reach `min_documents`. No held-out split when fraction is 0."""
  cut = int(fraction * 2.0**64)  # exact: the float is an integer at this magnitude
  if fraction == 0 or min_documents <= 0:
    return cut
  below, total, smallest = 0, 0, []  # smallest: the min_documents lowest ranks (negated heap)
  for text in texts:
    place = rank(text)
    total += 1
    below += place < cut
    if below >= min_documents:
      return cut
    if len(smallest) < min_documents:
      heapq.heappush(smallest, -place)
    elif place < -smallest[0]:
      heapq.heapreplace(smallest, -place)
  floor = min(min_documents, total // FLOOR_SHARE)
  if below >= floor or floor == 0:
    return cut
  return sorted(-r for r in smallest)[floor - 1] + 1


def eos_id(tokenizer: Tokenizer, eos: str | None) -> int:
  for token in ([eos] if eos else _EOS_CANDIDATES):
    token_id = tokenizer.token_to_id(token)
    if token_id is not None:
      return token_id
  raise DataError(f"the tokenizer has no EOS token among {[eos] if eos else _EOS_CANDIDATES}; "
                  "name it with --eos")


def refuse_to_replace_foreign_files(out: str, inputs: Sequence[str]) -> None:
  """`prepare` replaces OUT/train and OUT/heldout whole. Before anything is read or written:
  refuses an input that lies in one of them, and a file there that no earlier preparation
  wrote (the manifest beside them, if any, does not list it): the user's files are never
  removed to make room."""
  splits = {split: pathnames.join(out, split) for split in SPLITS}
  if not pathnames.is_url(out):
    for path in inputs:
      real = os.path.realpath(path)
      for split, where in splits.items():
        inside = os.path.realpath(where)
        if os.path.commonpath([real, inside]) == inside:
          raise DataError(f"--input {path} lies in --out {out}'s {split}/, which prepare "
                          "replaces whole: move the input elsewhere or choose another --out")
  listed: set[str] = set()
  manifest_path = pathnames.join(out, MANIFEST_FILE)
  if storage.exists(manifest_path):
    try:
      earlier = json.loads(storage.read_text(manifest_path))
      listed = {f for info in earlier["splits"].values()  # chat data: masks and bounds too
                for f in info["files"] + info.get("masks", []) + info.get("bounds", [])}
    except (ValueError, TypeError, KeyError, AttributeError):
      listed = set()  # a torn or foreign manifest vouches for no file
  for split, where in splits.items():
    directory = epath.Path(where)
    if not directory.exists():
      continue
    for found in _files_under(directory):
      entry = f"{split}/{os.fspath(found.relative_to(directory))}"
      if entry not in listed:
        raise DataError(f"--out {out}: {pathnames.join(out, entry)} was not written by an "
                        f"earlier prepare (no {MANIFEST_FILE} there lists it), and prepare "
                        f"replaces {split}/ whole: choose an empty or new --out, or move the "
                        "file")


def _files_under(directory: epath.Path) -> Iterator[epath.Path]:
  """Every file below `directory`, a local one or in a bucket (epath has no recursive glob for
  buckets), in sorted order."""
  for child in sorted(directory.iterdir()):
    if child.is_dir():
      yield from _files_under(child)
    else:
      yield child


def into_place(root: str, out: str) -> None:
  """The staged splits of a local `out` into place: the old manifest out first (from then on
  `out` is no prepared directory until the new one lands), then each split directory."""
  manifest_path = os.path.join(out, MANIFEST_FILE)
  if os.path.exists(manifest_path):
    os.remove(manifest_path)
  for split in SPLITS:
    shutil.rmtree(os.path.join(out, split), ignore_errors=True)
    os.replace(os.path.join(root, split), os.path.join(out, split))


def remove_output(out: str) -> None:
  """Removes what `prepare` writes to `out` in a bucket, the manifest first: from then on `out`
  is no prepared directory, whatever else is still there."""
  for name in (MANIFEST_FILE, TOKENIZER_FILE, tokenizer_lib.CONFIG_FILE):  # (chat data's)
    storage.remove(pathnames.join(out, name))
  for split in SPLITS:
    path = pathnames.join(out, split)
    retry.retried(lambda p=path: epath.Path(p).rmtree(missing_ok=True), path, "removing")


class Staging:
  """Where a preparation writes `out`: in a bucket, `out` itself (no rename there: every file
  goes straight to its place, and what a failed run wrote is removed); on a disk, a staging
  directory inside it whose splits `into_place` moves in, removed on the way out with an `out`
  a failed first preparation created (no empty --out left behind).

    with Staging(out) as root:
      ... write the splits under root ...
      staging.into_place()  # then the tokenizer and, last, the manifest into `out`
  """

  def __init__(self, out: str):
    self.out, self.remote = out, pathnames.is_url(out)
    self.root, self._created = out, False

  def __enter__(self) -> str:
    if self.remote:
      remove_output(self.out)
    else:
      self._created = not os.path.exists(self.out)
      os.makedirs(self.out, exist_ok=True)
      self.root = tempfile.mkdtemp(prefix=".staging-", dir=self.out)
    return self.root

  def into_place(self) -> None:
    if not self.remote:
      into_place(self.root, self.out)

  def __exit__(self, kind, error, tb) -> None:
    if self.remote:
      if error is not None:  # nothing of a failed run stays in the bucket
        with retry.cleanup_after(error):
          retry.quietly(f"removing what was written to {self.out}",
                        lambda: remove_output(self.out))
      return
    shutil.rmtree(self.root, ignore_errors=True)
    if self._created:
      with contextlib.suppress(OSError):  # only if empty: the preparation failed
        os.rmdir(self.out)
