"""AI2's OLMo-core checkpoints as files: the list AI2 published, and where a checkpoint's parts
are. Reading them (torch's format) is olmo3.convert.olmo_core_import's job; this module only
names and finds them, so a run can tell one apart from its own checkpoints without torch.

OLMo-core, the code that trained OLMo 3, saves a step as a directory
(olmo_core.train.checkpoint.Checkpointer):

  stepN/model_and_optim/.metadata     torch.distributed.checkpoint's metadata (a pickle)
  stepN/model_and_optim/__R_F.distcp  the tensors, chunk by chunk (each a torch.save)
  stepN/train/rank0.pt                the trainer state (step, data position; one per rank)

A directory holding `.metadata` itself is a model (and optimizer) checkpoint without trainer
state, which OLMo-core loads too.

`official()` lists the checkpoints AI2 published of OLMo-3-1025-7B under names like
`olmo3-7b/stage2/step10000`. Its data, OLMo-3-1025-7B.csv beside this module, is a verbatim copy
of OLMo-core's src/scripts/official/OLMo3/OLMo-3-1025-7B.csv (github.com/allenai/OLMo-core,
last changed in commit 843fe3d3ccf7, 2025-11-20; sha256 3585876234dc...), so names resolve on a
machine without a network.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import os
import pathlib

from olmo3.io import pathnames, storage

MODEL_DIR, METADATA, TRAINER_STATE = "model_and_optim", ".metadata", "train/rank0.pt"
_OFFICIAL_CSV = pathlib.Path(__file__).with_name("OLMo-3-1025-7B.csv")
_OFFICIAL_MODEL = "olmo3-7b"  # the names' prefix for that file's model


@dataclasses.dataclass(frozen=True)
class Official:
  name: str  # e.g. olmo3-7b/stage2/step10000
  stage: str  # the CSV's stage column, e.g. stage2_midtraining
  step: int
  tokens: int  # tokens seen, as the CSV says
  url: str  # the step directory on AI2's checkpoint host


@functools.cache
def official() -> dict[str, Official]:
  """AI2's published OLMo-3-1025-7B checkpoints by name, in the CSV's order. A name is the
  model, then the URL's last two parts: olmo3-7b/stage1/step1413814 (stage 1's end),
  olmo3-7b/stage2/step47684, olmo3-7b/stage3/step11921."""
  out = {}
  for row in csv.DictReader(io.StringIO(_OFFICIAL_CSV.read_text())):
    url = row["Checkpoint Directory"].rstrip("/")
    name = "/".join([_OFFICIAL_MODEL, *url.split("/")[-2:]])
    out[name] = Official(name, row["Stage"], int(row["Step"]), int(row["Tokens Seen"]), url)
  return out


@dataclasses.dataclass(frozen=True)
class OlmoCoreCheckpoint:
  """Where one OLMo-core checkpoint's parts are (local paths or URLs)."""

  root: str  # the step directory
  model_dir: str  # the distributed checkpoint: root/model_and_optim, or root itself
  trainer_state: str | None  # root/train/rank0.pt; None: a model-and-optimizer checkpoint


def locate(source: str | os.PathLike) -> OlmoCoreCheckpoint | None:
  """The OLMo-core checkpoint `source` names: a name of `official()` (no request made: AI2's
  step directories hold model_and_optim/ and train/), or a step directory (local, gs://, s3://,
  http(s)://) that holds model_and_optim/.metadata or .metadata; None when it is neither."""
  text = os.fspath(source).rstrip("/")
  if text in official():
    root = official()[text].url
    return OlmoCoreCheckpoint(root, pathnames.join(root, MODEL_DIR),
                              pathnames.join(root, TRAINER_STATE))
  if storage.exists(pathnames.join(text, MODEL_DIR, METADATA)):
    trainer = pathnames.join(text, TRAINER_STATE)
    return OlmoCoreCheckpoint(text, pathnames.join(text, MODEL_DIR),
                              trainer if storage.exists(trainer) else None)
  if storage.exists(pathnames.join(text, METADATA)):
    return OlmoCoreCheckpoint(text, text, None)
  return None
