"""What a launch checks of chat (SFT) data before its first step (olmo3.data.sources calls
these while it resolves the experiment): its label masks fit their token files and train
something (olmo3.data.label_masks.check), it is trained packed, as OLMo-core's SFT trains it,
and it was tokenized with the chat template the run names (`DataConfig.chat_template`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from absl import logging

from olmo3.config import DataConfig
from olmo3.data import chat, label_masks
from olmo3.data.manifest import MANIFEST_FILE
from olmo3.data.tokens import DataError, token_counts
from olmo3.io import file_sizes, pathnames

_SHA256 = re.compile(r"[0-9a-f]{64}")


def _data(cfg: DataConfig) -> str:
  return f"DataConfig.mix={cfg.mix!r}" if cfg.mix else "DataConfig.paths"


def check_training(cfg: DataConfig, paths: Sequence[str],
                   size_cache: file_sizes.SizeCache | None = None) -> list[str | None] | None:
  """The label masks of the training token files `paths` (None: no file has one), checked
  (olmo3.data.label_masks.check); chat data without `cfg.packing` is refused: OLMo-core's SFT
  packs conversations (NumpyPackedFSLDataset), and fixed-length instances cut from the files
  would start and end inside conversations."""
  masks = label_masks.masks_of(paths)
  if all(m is None for m in masks):
    return None
  if cfg.packing is None:
    raise DataError(f"{_data(cfg)} is chat data (label masks beside its token files), which is "
                    "trained packed: set data.packing (as experiments.olmo3_7b's SFT recipes: "
                    "Packing(source_group_size=1, source_permutation_seed=None))")
  label_masks.check(paths, token_counts(paths, size_cache=size_cache), _data(cfg), size_cache)
  return masks


def expected_sha256(name: str) -> str:
  """The SHA-256 of the template `DataConfig.chat_template` names: a template olmo3 ships, a
  .jinja file, or the hash itself (64 hex digits: a template olmo3 cannot ship)."""
  if _SHA256.fullmatch(name):
    return name
  if name == chat.TOKENIZERS_OWN:
    raise DataError(f"DataConfig.chat_template={name!r}: a run cannot check data against "
                    "\"the tokenizer's own\" template; name the template (a .jinja file, or its "
                    "SHA-256)")
  return chat.ChatTemplate.named(name, what="DataConfig.chat_template").sha256


def recorded_template(cfg: DataConfig, manifest: Any) -> tuple[str, str | None, str]:
  """(the template's name, its SHA-256 or None when not recorded, where that was read) of the
  training data: a prepared directory's manifest, or an open-instruct directory's saved
  tokenizer (its dataset_statistics.json names the template)."""
  if manifest is not None:
    where = pathnames.join(pathnames.normalized(cfg.mix), MANIFEST_FILE)
    template = (manifest.chat or {}).get("template", {})
    return template.get("name", "?"), template.get("sha256"), where
  if not cfg.mix:
    return "?", None, "DataConfig.paths"
  name, text = label_masks.open_instruct_template(cfg.mix)
  where = pathnames.join(pathnames.normalized(cfg.mix), label_masks.TOKENIZER_DIR)
  sha = None if text is None else hashlib.sha256(text.encode()).hexdigest()
  return name or "?", sha, where


def check_template(cfg: DataConfig, prepared: Any, paths: Sequence[str]) -> None:
  """Refuses (one line) a DataConfig.chat_template on data that is no chat data, or that
  differs from the template the data was tokenized with (compared by SHA-256); warns when the
  data does not record its template. `prepared`: the training data's prepared split (with its
  manifest), or None."""
  is_chat = any(m is not None for m in label_masks.masks_of(paths))
  if cfg.chat_template is None:
    return
  if not is_chat:
    raise DataError(f"DataConfig.chat_template={cfg.chat_template!r}, but {_data(cfg)} is no "
                    "chat data (no label masks beside its token files): drop the template or "
                    "train on data that python -m olmo3.data.prepare --chat wrote")
  want = expected_sha256(cfg.chat_template)
  name, have, where = recorded_template(cfg, None if prepared is None else prepared.manifest)
  if have is None:
    logging.warning("%s: the chat template the data was tokenized with (%s) is not recorded "
                    "there, so DataConfig.chat_template=%r cannot be checked", where, name,
                    cfg.chat_template)
  elif have != want:
    raise DataError(f"DataConfig.chat_template={cfg.chat_template!r} (sha256 {want[:12]}) is "
                    f"not the template {_data(cfg)} was tokenized with ({name}, sha256 "
                    f"{have[:12]}, {where}): prepare the data with it, or name that template")
