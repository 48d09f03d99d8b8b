"""Starting from AI2's OLMo-core checkpoints: what their facts (olmo3.convert.olmo_core_import's
`facts`, kept in an imported checkpoint's meta) say about a run that starts from them, and the
refusals when the run would not do what OLMo-core would.

Both modes (olmo3.config.InitMode) take the optimizer state, and OLMo-core, loading it, keeps the
checkpoint's betas, eps and weight decay per parameter over its config's: so must the run's
OptimizerConfig (`check_optimizer`), else it would train on with other settings than AI2's.

Continuing (InitMode.CONTINUE) also takes the trainer state: the step (the learning-rate schedule
resumes where AI2's was) and the data position, from the data loader's state, as OLMo-core's
loader resumes it: batch `tokens_processed // global batch` of its epoch. olmo3's global order
is OLMo-core's, so the next batch is the one OLMo-core would feed next, if the data is the same:
the same token files (OLMo-core's data fingerprint), sequence length, global batch, seed and
run length of its shuffle (OLMo-core's `max_target_sequence_length`). Anything else is refused,
naming both values. The step-skip window starts empty, as OLMo-core's does on
loading: SkipStepAdamW keeps its window outside its state dict, so no checkpoint holds one.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any

from olmo3.config import ConfigError, Experiment, ModelConfig, OptimizerConfig
from olmo3.data.tokens import TOKEN_DTYPE, DataError
from olmo3.io.checkpoint import CheckpointError

FINGERPRINT_VERSION = "v2.0"  # OLMo-core's NumpyDatasetBase.fingerprint_version that this computes


def olmo_core_fingerprint(identity: dict[str, Any], model: ModelConfig,
                          max_target_sequence_length: int | None) -> str:
  """OLMo-core's fingerprint of the token files a run's data identity lists
  (NumpyFSLDataset.fingerprint): its class, the tokenizer's ids, the token dtype, the target
  length, and each file's name and size in bytes. BOS is None, as in AI2's dolma2 tokenizer."""
  fields = {"vocab_size": model.vocab_size, "pad_token_id": model.pad_token_id,
            "eos_token_id": model.eos_token_id, "dtype": TOKEN_DTYPE.type,
            "max_target_sequence_length": max_target_sequence_length, "bos_token_id": None}
  sha = hashlib.sha256(b"class=NumpyFSLDataset")
  for name, value in fields.items():
    sha.update(f"{name}={value},".encode())
  for path, tokens in identity["files"]:
    sha.update(f"path={os.path.basename(path)},size={tokens * TOKEN_DTYPE.itemsize},".encode())
  return sha.hexdigest()


def _close(a: float, b: float) -> bool:
  return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def check_optimizer(facts: dict[str, Any], cfg: OptimizerConfig, source: str) -> None:
  """ConfigError naming the field unless `cfg` gives every parameter group the betas, eps and
  weight decay the checkpoint's optimizer state holds (what OLMo-core would train on with)."""
  for group, found in sorted(facts["optimizer"].items()):
    decay = 0.0 if group in cfg.no_decay else cfg.weight_decay
    wrong = []
    if not all(map(_close, found["betas"], (cfg.b1, cfg.b2))):
      wrong.append((f"OptimizerConfig.b1={cfg.b1}, b2={cfg.b2}", f"betas {found['betas']}"))
    if not _close(found["eps"], cfg.eps):
      wrong.append((f"OptimizerConfig.eps={cfg.eps}", f"eps {found['eps']}"))
    if not _close(found["weight_decay"], decay):
      wrong.append((f"OptimizerConfig.weight_decay={cfg.weight_decay}, "
                    f"no_decay={cfg.no_decay} (weight decay {decay} for {group!r})",
                    f"weight_decay {found['weight_decay']} for {group!r}"))
    if wrong:
      ours, theirs = wrong[0]
      raise ConfigError(f"{ours}: the optimizer state of {source} has {theirs}, which "
                        "OLMo-core would continue with; set the config to match")


def olmo_core_start(facts: dict[str, Any], exp: Experiment, identity: dict[str, Any],
                    steps_per_epoch: int, source: str) -> tuple[int, int]:
  """(step, data step) at which a run continues the OLMo-core run whose checkpoint's `facts`
  these are: its global step, and the global data step of the batch OLMo-core's loader would
  read next. DataError (CheckpointError without a trainer state) naming both values when the
  run's data is not the checkpoint's."""
  trainer = facts["trainer"]
  if trainer is None:
    raise CheckpointError(f"{source} holds no trainer state (train/rank0.pt): it can start a new "
                          "stage (checkpoint.init_mode='new_stage'), not continue one")
  loader, data = trainer["data_loader"], exp.data
  seq = loader.get("sequence_length")

  def refuse(what: str) -> DataError:
    return DataError(f"checkpoint.init_mode=continue: {what}; continuing it on other data "
                     "would not be AI2's run")

  if loader.get("dataset_type") != "fsl":
    raise refuse(f"{source} was trained on a {loader.get('dataset_type')!r} dataset, not "
                 "fixed-length instances ('fsl')")
  if seq != data.seq_len:
    raise refuse(f"{source} was trained at sequence length {seq}, DataConfig.seq_len="
                 f"{data.seq_len}")
  # The runs of consecutive instances an epoch shuffles: OLMo-core's are max(target, seq)
  # tokens long with a max_target_sequence_length, single instances without; the run's own is
  # its data identity's (single instances where it records none).
  target = loader.get("max_target_sequence_length")
  their_run = max(target or seq, seq)
  our_run = identity.get("max_target_seq_len", data.seq_len)
  if their_run != our_run:
    raise refuse(f"{source}'s data order shuffles runs of {their_run} tokens "
                 f"(max_target_sequence_length={target}), this run's runs of {our_run}")
  done, tokens = loader["batches_processed"], loader["tokens_processed"]
  if done:
    batch = tokens // done // seq
  else:  # at an epoch's start: the trainer's count says the batch
    batch = trainer["global_train_tokens_seen"] // trainer["global_step"] // seq if (
        trainer["global_step"]) else data.global_batch_size
  if batch != data.global_batch_size:
    raise refuse(f"{source} was trained with {batch} instances per step, "
                 f"DataConfig.global_batch_size={data.global_batch_size}")
  if loader["seed"] != data.seed:
    raise refuse(f"{source}'s data order has seed {loader['seed']}, DataConfig.seed={data.seed}")
  version = loader.get("dataset_fingerprint_version")
  if version != FINGERPRINT_VERSION:
    raise refuse(f"{source}'s data fingerprint is of version {version!r}, olmo3 computes "
                 f"{FINGERPRINT_VERSION!r}")
  ours = olmo_core_fingerprint(identity, exp.model, target)
  if loader["dataset_fingerprint"] != ours:
    what = f"mix {data.mix!r}" if data.mix else f"{len(identity['files'])} token files"
    raise refuse(f"{source} was trained on other token files (OLMo-core's data fingerprint "
                 f"{loader['dataset_fingerprint'][:12]}...) than this run's {what} "
                 f"({ours[:12]}...: the files' names and sizes, the tokenizer's ids in "
                 "ModelConfig)")
  epoch = loader.get("epoch") or trainer["epoch"]
  return trainer["global_step"], (epoch - 1) * steps_per_epoch + tokens // (batch * seq)

