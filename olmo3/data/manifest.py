"""The format of a prepared directory (what `python -m olmo3.data.prepare` writes and every
run reads): DIR/manifest.json, written last, naming per split (`SPLITS`) its token files and
their token counts (chat data: also their label masks and conversation bounds,
olmo3.data.label_masks); DIR/tokenizer.json beside it, the tokenizer of those tokens. Here so that
reading the format (a launch, `sample`, `inspect_step`) never loads the tool that writes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.parse

import yarl

from olmo3.data.tokens import TOKEN_DTYPE, DataError
from olmo3.io import pathnames, storage

SPLITS = ("train", "heldout")
MANIFEST_FILE = "manifest.json"  # what makes a directory a prepared one: written last
TOKENIZER_FILE = "tokenizer.json"  # beside manifest.json: the tokenizer of the token files


def _decodings(entry: str) -> list[str]:
  """`entry`, then it percent-decoded, again, ... until decoding changes nothing."""
  out = [entry]
  while (decoded := urllib.parse.unquote(out[-1])) != out[-1]:
    out.append(decoded)
  return out


def _plain_path(entry: str) -> bool:
  """A relative path of named parts: no absolute path, drive, URL, '.', '..' or empty part
  (a doubled slash), backslashes taken as slashes (as Windows and browsers' URL parsers
  read them)."""
  parts = entry.replace("\\", "/").split("/")
  return not (entry.startswith(("/", "\\")) or "://" in entry or ":" in parts[0]
              or any(p in ("", ".", "..") for p in parts)
              # URL parsers drop tabs and newlines anywhere and control characters at the
              # ends ("..\t" is requested as ".."): no file name of ours holds one.
              or any(ord(c) < 0x20 or ord(c) == 0x7f for c in entry))


def _requested_inside(root: str, entry: str) -> bool:
  """Whether the URL an HTTP client requests for `entry` under the URL `root` lies under
  `root`'s path: the check made on what aiohttp sends (its parser, yarl, resolves dot
  segments and drops what URL parsing drops), not on the manifest's text."""
  base = yarl.URL(root.rstrip("/") + "/")
  requested = yarl.URL(pathnames.join(root, entry))
  return (requested.origin() == base.origin()
          and requested.path.startswith(base.path) and requested.path != base.path)


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
  # The held-out split's check against the training split (overlap.disjoint); None: prepared
  # before the check existed, or chat data (whose conversations share the template's text).
  overlap: dict | None = None
  kind: str = "text"  # "chat": conversations with label masks (`prepare --chat`)
  # Chat data: the template (name, sha256, text), max_tokens and the conversations dropped.
  chat: dict | None = None

  @classmethod
  def load(cls, directory: str | os.PathLike) -> Manifest:
    """The manifest of `directory` (a local path or a URL, http(s):// included), its files
    checked."""
    path = pathnames.join(pathnames.normalized(directory), MANIFEST_FILE)
    if not storage.exists(path):
      raise DataError(f"{directory}: no {MANIFEST_FILE} (run python -m olmo3.data.prepare)")
    try:
      manifest = cls(**json.loads(storage.read_text(path)))
      manifest.splits["train"]["tokens"]  # a manifest has at least the training split
    except (ValueError, TypeError, KeyError) as e:  # malformed JSON, missing or unknown keys
      raise DataError(f"{path} is not a readable manifest ({type(e).__name__}: {e}); prepare "
                      "the data again (python -m olmo3.data.prepare)") from None
    manifest._check_entries(directory, path)
    manifest._check_files(directory, path)
    return manifest

  def _check_entries(self, directory: str | os.PathLike, path: str) -> None:
    """Every listed file lies inside `directory`: a relative path without '..' (or a URL, or a
    drive) that no symbolic link leads out of. A manifest is data someone else may have
    written: one naming ../x or /etc/passwd would have a run train on (and an error quote)
    whatever file that is. The rule holds for each spelling an entry has once percent-escapes
    are decoded, as often as they decode: an HTTP client decodes and normalises the URL it
    requests (aiohttp's yarl turns `d/%2e%2e/x` into `/x`), and a server may decode again."""
    root = os.fspath(directory)
    local = not pathnames.is_url(root)
    real_root = os.path.realpath(root) if local else None
    for split, info in self.splits.items():
      entries = info.get("files") if isinstance(info, dict) else None
      if not isinstance(entries, list):
        raise DataError(f"{path}: split {split!r} has no list of files; prepare the data again "
                        "(python -m olmo3.data.prepare)")
      for entry in entries + list(info.get("masks", ())) + list(info.get("bounds", ())):
        if not isinstance(entry, str) or not all(map(_plain_path, _decodings(entry))) or (
            pathnames.scheme(root) in ("http", "https") and not _requested_inside(root, entry)):
          raise DataError(f"{path}: file {entry!r} of split {split!r} is not a plain path "
                          "inside its directory (no absolute path, URL, '.', '..' or control "
                          "character, plain or percent-encoded); the manifest was not written by "
                          "olmo3.data.prepare or was edited")
        if local:
          real = os.path.realpath(os.path.join(root, entry))
          if os.path.commonpath([real, real_root]) != real_root:
            raise DataError(f"{path}: file {entry!r} of split {split!r} leads outside its "
                            f"directory through a symbolic link (to {real})")

  def _check_files(self, directory: str | os.PathLike, path: str) -> None:
    for split, info in self.splits.items():
      files = self.files(directory, split)
      found = storage.sizes(files)  # remote ones concurrently
      for file, size in zip(files, found):
        if size is None:
          raise DataError(f"token file {file} is missing (listed in {path})")
      have = [size // TOKEN_DTYPE.itemsize for size in found]
      for file, tokens, want in zip(files, have, info.get("file_tokens", ())):
        if tokens != want:
          raise DataError(f"token file {file} holds {tokens} tokens; {path} says {want}: the "
                          "file was changed or cut short since it was prepared (prepare again)")
      if sum(have) != info["tokens"]:
        raise DataError(f"the {split} files of {path} hold {sum(have)} tokens; it says "
                        f"{info['tokens']}: a file was changed or cut short since it was prepared "
                        f"({files})")
      masks = [pathnames.join(pathnames.normalized(directory), m) for m in info.get("masks", ())]
      for mask, size, tokens in zip(masks, storage.sizes(masks), have):
        if size != tokens:  # one byte per token (olmo3.data.label_masks)
          raise DataError(f"label mask {mask} " + ("is missing" if size is None else
                          f"holds {size} bytes for {tokens} tokens") + f" (listed in {path}): "
                          "it was changed since it was prepared (prepare again)")

  def files(self, directory: str | os.PathLike, split: str) -> list[str]:
    """The paths (or URLs) of a split's token files."""
    root = pathnames.normalized(directory)
    return [pathnames.join(root, f) for f in self.splits[split]["files"]]
