"""AI2's OLMo-core checkpoints as files: the list AI2 published, and where a checkpoint's parts
are. Reading them (torch's format) is olmo3.convert.olmo_core_import's job; this module only
names and finds them, so a run can tell one apart from its own checkpoints without torch.

OLMo-core, the code that trained OLMo 3, saves a step as a directory
(olmo_core.train.checkpoint.Checkpointer):

  stepN/model_and_optim/.metadata     torch.distributed.checkpoint's metadata (a pickle)
  stepN/model_and_optim/__R_F.distcp  the tensors, chunk by chunk (each a torch.save)
  stepN/train/rank0.pt                the trainer state (step, data position; one per rank)

  stepN/.metadata.json                OLMo-core's own marker, written once the rest is complete
  stepN/config.json                   the experiment's config (its trainer's ConfigSaverCallback,
                                      after the marker; olmo3.convert.olmo_core_config reads it)

A directory holding `.metadata` itself is a model (and optimizer) checkpoint without trainer
state, which OLMo-core loads too.

A save folder holds a run's step directories; OLMo-core's `load_path` pointed at one loads its
newest complete step, as `locate` does: complete as OLMo-core's `Checkpointer.dir_is_checkpoint`
decides it (`.metadata` there, or all of `train/rank0.pt`, `model_and_optim/.metadata` and
`.metadata.json`: on a bucket a step is written in place, the marker last, so a step cut short
lacks it; on a disk OLMo-core writes `stepN-tmp` and renames it, a name no step has).

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
import re

from olmo3.io import pathnames, storage
from olmo3.io.checkpoint import CheckpointError

MODEL_DIR, METADATA, TRAINER_STATE = "model_and_optim", ".metadata", "train/rank0.pt"
MARKER = ".metadata.json"  # OLMo-core's Checkpointer.METADATA_FNAME
_STEP = re.compile(r"step(\d+)")  # Checkpointer.CHECKPOINT_DIR's names
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
  folder: str | None = None  # the save folder whose newest complete step `root` is
  passed_over: tuple[str, ...] = ()  # newer steps there, incomplete: "step45 (no .metadata.json)"

  def picked(self) -> str | None:
    """What a save folder's choice was, in one line (None: a step directory was named)."""
    if self.folder is None:
      return None
    skipped = (f"; passed over, incomplete (OLMo-core had not finished writing them): "
               f"{', '.join(self.passed_over)}" if self.passed_over else "")
    return (f"{self.folder} is an OLMo-core save folder: taking its newest complete step, "
            f"{pathnames.split(self.root)[1]}{skipped}")


class IncompleteSaveFolder(CheckpointError):
  """An OLMo-core save folder whose step directories are all incomplete."""


def locate(source: str | os.PathLike) -> OlmoCoreCheckpoint | None:
  """The OLMo-core checkpoint `source` names: a name of `official()` (no request made: AI2's
  step directories hold model_and_optim/ and train/), a step directory (local, gs://, s3://,
  http(s)://) that holds model_and_optim/.metadata or .metadata, or a save folder (not over
  http(s), which lists nothing) of step directories: its newest complete step (module
  docstring; `picked()` says which). None when it is none of these; IncompleteSaveFolder when
  it is a save folder without a complete step."""
  text = os.fspath(source).rstrip("/")
  if text in official():
    root = official()[text].url
    return OlmoCoreCheckpoint(root, pathnames.join(root, MODEL_DIR),
                              pathnames.join(root, TRAINER_STATE))
  return _step_directory(text) or _newest_step(text)


def _step_directory(text: str) -> OlmoCoreCheckpoint | None:
  if storage.exists(pathnames.join(text, MODEL_DIR, METADATA)):
    trainer = pathnames.join(text, TRAINER_STATE)
    return OlmoCoreCheckpoint(text, pathnames.join(text, MODEL_DIR),
                              trainer if storage.exists(trainer) else None)
  if storage.exists(pathnames.join(text, METADATA)):
    return OlmoCoreCheckpoint(text, text, None)
  return None


def _missing(step_dir: str) -> list[str]:
  """What OLMo-core's `dir_is_checkpoint` would miss in `step_dir` ([]: a complete step)."""
  if storage.exists(pathnames.join(step_dir, METADATA)):
    return []
  return [part for part in (TRAINER_STATE, f"{MODEL_DIR}/{METADATA}", MARKER)
          if not storage.exists(pathnames.join(step_dir, part))]


def _newest_step(folder: str) -> OlmoCoreCheckpoint | None:
  """The newest complete step directory of the save folder `folder` (None: not a save folder)."""
  if pathnames.scheme(folder) in pathnames.READ_ONLY_SCHEMES or not storage.is_dir(folder):
    return None
  steps = sorted(((int(m.group(1)), p.name) for p in pathnames.absolute(folder).iterdir()
                  if (m := _STEP.fullmatch(p.name))), reverse=True)
  passed_over = []
  for _, name in steps:
    root = pathnames.join(folder, name)
    missing = _missing(root)
    if not missing:  # complete, so it holds the metadata _step_directory looks for
      return dataclasses.replace(_step_directory(root), folder=folder,
                                 passed_over=tuple(passed_over))
    passed_over.append(f"{name} (no {', '.join(missing)})")
  if passed_over:
    raise IncompleteSaveFolder(f"{folder}: an OLMo-core save folder without a complete step "
                               f"(OLMo-core's marker is {MARKER}, written last): "
                               f"{', '.join(passed_over)}")
  return None
