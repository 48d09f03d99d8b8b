"""The training data's config: `DataConfig` (the mix, sequence, batch, order and loader), the
repetition filter and stage 3's packing."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from olmo3.config_checks import Validated, bounded, nonempty, require, resumable


@dataclasses.dataclass(frozen=True)
class RepetitionFilter(Validated):
  """Mask the labels of an instance holding a run of >= max_count repetitions of any period in
  [min_period, max_period] (OLMo-core's instance filter, docs/data.md#repetition-filter)."""

  max_period: int = bounded(13, ge=1)  # and >= min_period
  min_period: int = bounded(1, ge=1)
  max_count: int = bounded(32, ge=3)  # shorter runs cannot be detected

  def _check(self) -> None:
    require(self, "max_period", self.max_period >= self.min_period,
            f"must be >= min_period ({self.min_period})")


class LongDocuments(enum.StrEnum):
  """What packing does with a document longer than an instance (OLMo-core's long_doc_strategy)."""

  TRUNCATE = "truncate"  # keep its first seq_len tokens (OLMo-core's default; AI2's stage 3)
  FRAGMENT = "fragment"  # cut it into seq_len pieces, each packed as a document


@dataclasses.dataclass(frozen=True)
class Packing(Validated):
  """Documents packed into instances, attention kept within each (OLMo-core's
  NumpyPackedFSLDataset with generate_doc_lengths=True, docs/data.md#packed-documents): the
  token files' documents (each ending at an EOS) are packed by optimized best-fit decreasing
  within groups of `source_group_size` files, the files put in groups in the order
  `source_permutation_seed` shuffles them; a bin not filled is padded (no loss there).
  Defaults are AI2's OLMo 3 7B stage 3."""

  source_group_size: int = bounded(8, ge=1)
  # None: the files in mix order (OLMo-core's default, its SFT scripts').
  source_permutation_seed: int | None = bounded(123, ge=0)
  long_documents: LongDocuments = LongDocuments.TRUNCATE


@dataclasses.dataclass(frozen=True)
class DataConfig(Validated):
  """Where training tokens come from and in which order (OLMo-core's semantics, docs/data.md).

  Token files are given directly (`paths`) or by a mix file (`mix`: lines `label,path` with
  `{TOKENIZER}` in the path, as OLMo-core's mixes; a file path or the name of a mix that the
  installed ai2-olmo-core ships), resolved against `root` (a directory or a URL: gs://bucket,
  s3://bucket, or http://olmo-data.org, where AI2 serves its files; olmo3.io.storage).
  """

  paths: tuple[str, ...] = ()
  mix: str | None = None
  root: str = ""  # "": paths are as given (relative to the working directory)
  tokenizer_id: str = "allenai/dolma3-tokenizer"  # substituted for {TOKENIZER} in mix paths
  seq_len: int = bounded(8192, ge=2)  # inputs and labels
  # OLMo-core's max_target_sequence_length, which AI2's scripts set to max(8192, seq_len): each
  # file is cut into whole runs of max(max_target_seq_len, seq_len) tokens (the rest unused) and
  # an epoch shuffles those runs, each read as consecutive instances (`chunk_instances`), instead
  # of single instances. At seq_len 8192 and above a run is one instance. None: no runs, single
  # instances shuffled (OLMo-core's default).
  max_target_seq_len: int | None = bounded(8192, ge=2)
  global_batch_size: int = bounded(512, ge=1)  # instances per step
  seed: int = bounded(34521, ge=0)
  repetition_filter: RepetitionFilter | None = None  # off in the OLMo 3 7B recipe
  packing: Packing | None = None  # stage 3's packed documents; None: instances cut from files
  # The chat template the data must have been tokenized with (chat / SFT data, checked before
  # the first step by SHA-256 against its manifest or open-instruct's saved tokenizer): a
  # template olmo3 ships (olmo3_think), a .jinja file, or its SHA-256. None: not checked.
  chat_template: str | None = None
  # Only the first N instances (memorisation experiments); at least one global batch.
  max_instances: int | None = bounded(None, ge=1)
  validate_tokens: bool = True  # scan every token file at startup for ids >= vocab
  num_workers: int = resumable(0, ge=0)  # Grain worker processes reading ahead (0: main process)
  prefetch: int = resumable(2, ge=1)  # steps buffered per worker
  # Global batches already on the devices ahead of the step being dispatched (read and
  # transferred by a background thread); 0 reads each batch when the loop asks for it.
  device_prefetch: int = resumable(2, ge=0)
  # Resume although the data identity recorded in the checkpoint differs (other files, another
  # mix or order): the run continues at the same instance position of the new data. Off, a
  # changed identity stops the resume, since the position would silently mean other tokens.
  allow_changed_data: bool = resumable(False)

  def _check(self) -> None:
    nonempty(self, "paths", "mix", "tokenizer_id", "chat_template")
    require(self, "paths", bool(self.paths) != bool(self.mix),
            "give token files in exactly one of `paths` and `mix`")
    require(self, "max_instances", self.max_instances is None
            or self.max_instances >= self.global_batch_size,
            f"must hold at least one global batch ({self.global_batch_size})")
    require(self, "max_target_seq_len", self.max_target_seq_len is None
            or self.max_target_seq_len <= self.seq_len
            or self.max_target_seq_len % self.seq_len == 0,
            f"must be a multiple of seq_len ({self.seq_len}), as OLMo-core requires, or None")
    require(self, "packing", self.packing is None or self.repetition_filter is None,
            "packed instances take no repetition_filter: olmo3's packing does not apply one "
            "(OLMo-core's packed dataset can; AI2's stage 3 sets none)")

  @property
  def chunk_instances(self) -> int:
    """Consecutive instances an epoch's shuffle keeps together (1: single instances, and
    packed ones)."""
    if self.max_target_seq_len is None or self.packing is not None:
      return 1
    return max(self.max_target_seq_len, self.seq_len) // self.seq_len

  def replace(self, **changes: Any) -> DataConfig:
    return dataclasses.replace(self, **changes)
