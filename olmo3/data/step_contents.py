"""What a global step's batch holds, row by row: the instance, its source, where its tokens lie
(token file and offset, one span per document for packed instances) and whether the repetition
filter masked it. Read through the loader's own `ReadStep`, so it is the batch the train step
got, never a re-derivation of it (`python -m olmo3.inspect_step` prints it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from olmo3.config import DataConfig
from olmo3.data.packing import PackedInstances
from olmo3.data.pipeline import ReadStep, order_for
from olmo3.data.tokens import TokenFiles


@dataclasses.dataclass(frozen=True)
class Span:
  """Tokens [offset, offset + tokens) of a token file."""

  file: str
  offset: int
  tokens: int


@dataclasses.dataclass(frozen=True)
class Row:
  row: int  # in the global batch
  instance: int  # the global instance index (the epoch's order maps the step's rows to it)
  source: str  # the mix's label of its token file
  spans: tuple[Span, ...]  # one per packed document; one for a fixed-length instance
  filtered: bool  # the repetition filter masked it (no loss; its tokens still count)


@dataclasses.dataclass(frozen=True)
class StepContents:
  data_step: int
  rows: tuple[Row, ...]
  batch: dict[str, np.ndarray]  # the whole global batch as the loader reads it (STEP_KEYS)


def _spans(source: TokenFiles | PackedInstances, instance: int) -> tuple[Span, ...]:
  if isinstance(source, PackedInstances):
    return tuple(Span(source.paths[f], start, n) for f, start, n in source.spans(instance))
  file, start = source.locate(instance)
  return (Span(source.paths[file], start, source.seq_len),)


def read(cfg: DataConfig, source: TokenFiles | PackedInstances, data_step: int) -> StepContents:
  """Global data step `data_step`'s batch, every row of it."""
  order = order_for(cfg, source)
  order.prepare(order.epoch_of(data_step))
  batch = ReadStep(source, order, np.arange(cfg.global_batch_size),
                   cfg.repetition_filter).map(data_step)
  names = source.source_names
  rows = tuple(Row(r, int(i), names[int(s)], _spans(source, int(i)), bool(f))
               for r, (i, s, f) in enumerate(zip(batch["instance"], batch["source"],
                                                 batch["filtered"])))
  return StepContents(data_step, rows, batch)
