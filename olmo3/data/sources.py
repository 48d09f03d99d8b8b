"""The data package's one entrance: a mix name (or file list) -> token files; a tokenizer name
-> a tokenizer. The built-in corpus (`embedded`, `embedded-heldout`, tokenizer `embedded`) is
prepared here on first use, so nothing below this module needs to know it exists.
"""

from __future__ import annotations

import importlib.resources
import os

from etils import epath
from tokenizers import Tokenizer

from olmo3.config import DataConfig
from olmo3.data import embedded, prepare
from olmo3.data.tokens import DataError, TokenFiles

EMBEDDED = {"embedded": "train", "embedded-heldout": "heldout"}  # the built-in corpus's splits


def read_mix(mix: str, root: str = "", tokenizer_id: str = "") -> list[epath.Path]:
  """The token files a mix lists, in order. `mix` is `embedded` / `embedded-heldout` (the
  built-in corpus, prepared on first use), a mix file (`label,path` lines, `#` comments,
  `{TOKENIZER}` in paths) or the name of a mix shipped by ai2-olmo-core."""
  if mix in EMBEDDED:
    directory = embedded.corpus_dir()
    return [epath.Path(p) for p in prepare.Manifest.load(directory).files(directory, EMBEDDED[mix])]
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
    _, rel = line.split(",")
    paths.append(base / rel.replace("{TOKENIZER}", tokenizer_id))
  if not paths:
    raise DataError(f"{mix_path}: the mix lists no token files")
  return paths


def token_files(cfg: DataConfig, vocab_size: int | None) -> TokenFiles:
  """The configured training token files (from `paths`, or a mix), checked at startup."""
  if cfg.mix:
    paths = read_mix(cfg.mix, cfg.root, cfg.tokenizer_id)
  else:
    paths = [epath.Path(cfg.root) / p if cfg.root else epath.Path(p) for p in cfg.paths]
  return TokenFiles(paths, cfg.seq_len, vocab_size, validate_tokens=cfg.validate_tokens)


def load_tokenizer(name: str) -> Tokenizer:
  """A tokenizer.json path, a Hugging Face hub name, or "embedded" (the built-in corpus's BPE)."""
  if name == "embedded":
    return Tokenizer.from_file(os.fspath(embedded.corpus_dir() / "tokenizer.json"))
  return prepare.load_tokenizer(name)
