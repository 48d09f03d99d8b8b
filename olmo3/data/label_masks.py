"""Chat (SFT) data's files, as open-instruct's converter writes them for OLMo-core and as
`python -m olmo3.data.prepare --chat` writes them too: per part N of a split,
  token_ids_part_NNNN.npy    raw uint32 token ids (no .npy header, as every token file)
  labels_mask_part_NNNN.npy  raw bool, one byte per token: True where the token is trained on
                             (its label at the position before it counts in the loss)
  token_ids_part_NNNN.csv.gz `start,end` of each conversation in the part (part-relative, no
                             header; a conversation cut by the part's edge is in both parts)

A token file's mask is found by its name (`mask_path`: the same directory, the same part
number), never by the order of a listing: OLMo-core's SFT script at 9e9747105 globbed
`token_ids_part_*.npy` as the masks on gs:// and s3:// and nothing checked their sizes, so
token bytes were read as masks. Here a mask is refused unless it holds exactly one byte per
token of its token file (`check`): a uint32 token file given as a mask has four.

An open-instruct directory (no manifest.json) is read as it is (`open_instruct_parts`): its
token files listed by part number, locally, on gs:// and s3:// from a listing, and over
http(s)://, which has no listing, by asking for part 0000, 0001, ... until one is missing.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

import numpy as np
from etils import epath

from olmo3.data.tokens import DataError
from olmo3.io import file_sizes, pathnames, storage

TOKENS = "token_ids_part_{:04d}.npy"
MASK = "labels_mask_part_{:04d}.npy"
BOUNDS = "token_ids_part_{:04d}.csv.gz"
STATISTICS = "dataset_statistics.json"  # open-instruct's record of a conversion
TOKENIZER_DIR = "tokenizer"  # where open-instruct saves the tokenizer (and its template)
PART_TOKENS = (1 << 30) // 4  # open-instruct's parts: 1 GiB of uint32 tokens
MAX_TOKENS = 32768  # AI2's --max_seq_length: each conversation of the OLMo 3 SFT data cut to it
_TOKEN_NAME = re.compile(r"token_ids_part_(\d+)\.npy")
_HEAD = 1 << 16  # bytes of each mask read at the start to check it
_PROBE = 16  # http(s) part numbers asked for at once


def part_number(path: str) -> int | None:
  """N of a token file named token_ids_part_N.npy; None for any other name."""
  found = _TOKEN_NAME.fullmatch(pathnames.split(os.fspath(path))[1])
  return None if found is None else int(found.group(1))


def mask_path(token_path: str | os.PathLike) -> str | None:
  """The label mask of a token file: labels_mask_part_N.npy beside token_ids_part_N.npy (the
  part number spelled as in the token file's name); None for a file of another name."""
  parent, name = pathnames.split(os.fspath(token_path))
  found = _TOKEN_NAME.fullmatch(name)
  return None if found is None else pathnames.join(parent, f"labels_mask_part_{found.group(1)}.npy")


def masks_of(paths: Sequence[str]) -> list[str | None]:
  return [mask_path(p) for p in paths]


def check(paths: Sequence[str], counts: Sequence[int], what: str,
          size_cache: file_sizes.SizeCache | None = None) -> list[str | None]:
  """The masks of token files `paths` (holding `counts` tokens), each checked: it exists, holds
  one byte per token of its token file, its bytes are 0 or 1 (where read), and the files' masks
  train at least one token. DataError naming the file otherwise (`what`: the files' use, e.g.
  "DataConfig.mix='DIR'"). Reads a mask's start only, unless no mask trains there."""
  masks = masks_of(paths)
  named = [(p, m, n) for p, m, n in zip(paths, masks, counts) if m is not None]
  if not named:
    return masks
  found = (size_cache.sizes if size_cache else storage.sizes)([m for _, m, _ in named])
  for (path, mask, tokens), size in zip(named, found):
    if size is None:
      raise DataError(f"{what}: label mask {mask} of token file {path} does not exist")
    if size != tokens:
      raise DataError(f"{what}: label mask {mask} holds {size} bytes, but its token file {path} "
                      f"holds {tokens} tokens: a mask is one byte (bool) per token" + (
                          " (this one is 4 bytes per token: a uint32 token file given as a mask?)"
                          if size == 4 * tokens else ""))
  heads = storage.read_ranges([(m, 0, min(_HEAD, n)) for _, m, n in named])
  for (_, mask, _), head in zip(named, heads):
    _check_bytes(mask, np.frombuffer(head, np.uint8), 0)
  if not any(np.frombuffer(h, np.uint8).any() for h in heads) and not any(
      _trains(m, n) for _, m, n in named):
    raise DataError(f"{what}: its label masks ({named[0][1]}, ...) train no token: every label "
                    "would be ignored")
  return masks


def _check_bytes(mask: str, values: np.ndarray, at: int) -> None:
  if values.size and values.max() > 1:
    where = int(np.argmax(values > 1))
    raise DataError(f"label mask {mask}: byte {at + where} is {int(values[where])}, not 0 or 1: "
                    "not a bool mask (a token file given as a mask?)")


def _trains(mask: str, size: int) -> bool:
  """Whether any byte of a mask past its head is true (read in large ranges)."""
  step = 1 << 24
  for start in range(_HEAD, size, step):
    values = np.frombuffer(storage.read_ranges([(mask, start, min(start + step, size))])[0],
                           np.uint8)
    _check_bytes(mask, values, start)
    if values.any():
      return True
  return False


def open_instruct_parts(directory: str) -> list[str] | None:
  """The token files of a directory open-instruct's converter wrote (token_ids_part_*.npy),
  in part-number order; None when `directory` holds no token_ids_part_0000.npy. Local, gs://
  and s3:// directories are listed; http(s):// ones probed part by part (no listing there).
  A part missing between others is a DataError: the directory is incomplete."""
  root = pathnames.normalized(directory)
  if not storage.exists(pathnames.join(root, TOKENS.format(0))):
    return None
  if pathnames.scheme(root) in pathnames.READ_ONLY_SCHEMES:
    count = 0
    while True:
      names = [pathnames.join(root, TOKENS.format(count + i)) for i in range(_PROBE)]
      found = storage.sizes(names)
      count += next((i for i, s in enumerate(found) if s is None), _PROBE)
      if None in found:
        return [pathnames.join(root, TOKENS.format(i)) for i in range(count)]
  numbered = sorted((part_number(p.name), p.name) for p in epath.Path(root).iterdir()
                    if part_number(p.name) is not None)
  for expected, (number, name) in enumerate(numbered):
    if number != expected:
      raise DataError(f"{root}: {TOKENS.format(expected)} is missing ({name} follows): the "
                      "directory is incomplete")
  return [pathnames.join(root, name) for _, name in numbered]


def open_instruct_template(directory: str) -> tuple[str | None, str | None]:
  """(the chat template's name in dataset_statistics.json, the template's text from the saved
  tokenizer's tokenizer_config.json or chat_template.jinja) of an open-instruct directory;
  None for each not there."""
  root = pathnames.normalized(directory)
  name = text = None
  statistics = pathnames.join(root, STATISTICS)
  if storage.exists(statistics):
    try:
      name = json.loads(storage.read_text(statistics))["configuration"]["chat_template"]
    except (ValueError, KeyError, TypeError):
      name = None
  config = pathnames.join(root, TOKENIZER_DIR, "tokenizer_config.json")
  jinja = pathnames.join(root, TOKENIZER_DIR, "chat_template.jinja")
  if storage.exists(config):
    try:
      text = json.loads(storage.read_text(config)).get("chat_template")
    except (ValueError, AttributeError):
      text = None
  if not isinstance(text, str) and storage.exists(jinja):
    text = storage.read_text(jinja)
  return (name if isinstance(name, str) else None), (text if isinstance(text, str) else None)
