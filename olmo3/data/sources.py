"""The data package's one entrance: a mix name (or file list) -> labelled token files; a
tokenizer name -> the file or hub name it loads from. The built-in corpus (`embedded`,
`embedded-heldout`, tokenizer `embedded`) is prepared here on first use, so nothing below this
module needs to know it exists.
"""

from __future__ import annotations

import importlib.resources
import os
from typing import NamedTuple

from etils import epath

from olmo3.config import DataConfig
from olmo3.data import embedded, prepare
from olmo3.data.tokens import DataError, TokenFiles

EMBEDDED = {"embedded": "train", "embedded-heldout": "heldout"}  # the built-in corpus's splits
EMBEDDED_LABEL = "embedded"  # the built-in corpus is one source; both splits carry its label


class MixFile(NamedTuple):
  label: str  # the source it belongs to: a mix line's first column
  path: epath.Path


def read_mix(mix: str, root: str = "", tokenizer_id: str = "") -> list[MixFile]:
  """The token files a mix lists, in order, with their source labels. `mix` is `embedded` /
  `embedded-heldout` (the built-in corpus, prepared on first use), a mix file (`label,path`
  lines, `#` comments, `{TOKENIZER}` in paths) or the name of a mix shipped by ai2-olmo-core.
  Paths are relative to `root` (a directory or URL) or, without one, to the mix file."""
  if mix in EMBEDDED:
    directory = embedded.corpus_dir()
    return [MixFile(EMBEDDED_LABEL, epath.Path(p))
            for p in prepare.Manifest.load(directory).files(directory, EMBEDDED[mix])]
  mix_path = epath.Path(mix)
  if not mix_path.exists():
    try:
      packaged = importlib.resources.files("olmo_core").joinpath(f"data/mixes/{mix}.txt")
    except ModuleNotFoundError:
      packaged = None
    if packaged is None or not packaged.is_file():
      raise DataError(f"DataConfig.mix={mix!r}: no such mix file, and no mix of that name in "
                      "ai2-olmo-core (pip install ai2-olmo-core to use AI2's named mixes)")
    mix_path = epath.Path(os.fspath(packaged))
  base = epath.Path(root) if root else mix_path.parent
  paths = []
  for number, line in enumerate(mix_path.read_text().splitlines(), start=1):
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    if line.count(",") != 1:
      raise DataError(f"{mix_path}:{number}: expected 'label,path', got {line!r}")
    label, rel = (part.strip() for part in line.split(","))
    if not label or not rel:
      raise DataError(f"{mix_path}:{number}: expected 'label,path', got {line!r}")
    paths.append(MixFile(label, base / rel.replace("{TOKENIZER}", tokenizer_id)))
  if not paths:
    raise DataError(f"{mix_path}: the mix lists no token files")
  return paths


def token_files(cfg: DataConfig, vocab_size: int | None) -> TokenFiles:
  """The configured training token files, checked at startup: a mix's, each labelled with its
  source, or `paths`, which form one source (`tokens.UNLABELLED`)."""
  if cfg.mix:
    labels, paths = zip(*read_mix(cfg.mix, cfg.root, cfg.tokenizer_id))
  else:
    labels, paths = None, [epath.Path(cfg.root) / p if cfg.root else epath.Path(p)
                           for p in cfg.paths]
  return TokenFiles(paths, cfg.seq_len, vocab_size, validate_tokens=cfg.validate_tokens,
                    labels=labels)


def tokenizer_file(name: str) -> str:
  """What a tokenizer name is loaded from: "embedded" is the built-in corpus's tokenizer.json;
  any other name (a tokenizer.json path or a Hugging Face hub name) is itself."""
  return os.fspath(embedded.corpus_dir() / "tokenizer.json") if name == "embedded" else name

