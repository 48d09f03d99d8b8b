"""Evaluation, W&B, and the `Experiment` every other config composes (what Fiddle builds and
the launcher runs); `resumable_fields`, the fields a resumed run may change."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from olmo3.config_checks import RESUMABLE, Validated, bounded, fail, nonempty, require, resumable
from olmo3.config.data import DataConfig
from olmo3.config.model import ContextParallel, ModelConfig, heads_split_problem
from olmo3.config.training import (CheckpointConfig, LossMean, MeshConfig, OptimizerConfig,
                                   TrainConfig)


# RULER's tasks that olmo3 generates (olmo3.eval.ruler): needle in a haystack (one needle; several
# keys; several values; several queries), variable tracking, common and frequent words.
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
               "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
               "ruler_vt", "ruler_cwe", "ruler_fwe")


@dataclasses.dataclass(frozen=True)
class RulerConfig(Validated):
  """RULER's synthetic long-context tasks in the evaluation (olmo3.eval.ruler,
  docs/evaluation.md#ruler): instances generated offline from the evaluation's tokenizer (and,
  for the essay-haystack tasks, the run's held-out documents) at each length, scored by greedy
  generation of the answer; the long-context alarm watches the longest length. Every field is
  resumable: RULER may be turned on for a run under way."""

  # Each instance's length in tokens, prompt and answer budget together (RULER's
  # max_seq_length). Empty: RULER off.
  lengths: tuple[int, ...] = resumable(())
  tasks: tuple[str, ...] = resumable(RULER_TASKS)
  samples: int = resumable(20, ge=1)  # instances per task and length
  seed: int = resumable(42, ge=0)  # the same instances on every host and at every evaluation
  # Prompt positions sent through the model at a time (attention's arrays grow with it).
  prefill_chunk: int = resumable(2048, ge=1)
  # The long-context alarm fires when the longest length's mean score falls by more than this
  # (a fraction: scores are 0..1) while the shortest length's falls by less than half of it.
  alarm_drop: float = resumable(0.1, gt=0, le=1)

  def _check(self) -> None:
    require(self, "lengths", all(n >= 64 for n in self.lengths)
            and list(self.lengths) == sorted(set(self.lengths)),
            "increasing prompt lengths of at least 64 tokens")
    unknown = sorted(set(self.tasks) - set(RULER_TASKS))
    require(self, "tasks", bool(self.tasks) and not unknown
            and len(set(self.tasks)) == len(self.tasks),
            f"distinct names among {list(RULER_TASKS)}"
            + (f" ({unknown} unknown)" if unknown else ""))

  @property
  def enabled(self) -> bool:
    return bool(self.lengths)


@dataclasses.dataclass(frozen=True)
class EvalConfig(Validated):
  """Evaluation during training (and standalone, `python -m olmo3.eval`), as OLMo-core's
  in-loop evaluators (docs/evaluation.md).

  Held-out LM sets: mixes whose labels name the sets (one document per instance, as OLMo-core's
  NumpyPaddedFSLDataset), e.g. AI2's `v3-small-ppl-validation` (C4, Dolma sources, Pile, ...),
  read through the same mechanism as training data. Downstream tasks: ai2-olmo-eval labels (the
  `eval` extra), prepared with `tokenizer` and scored as OLMo-core does. The generalization-gap
  alarm compares train and held-out loss at each evaluation.
  """

  # Mixes (as DataConfig.mix; a prepared directory means its held-out split); each label of a
  # mix is one set. None: the training data's own held-out split (DataConfig.mix a directory
  # written by olmo3.data.prepare, the embedded corpus included), none for other data.
  heldout: tuple[str, ...] | None = ()
  # What heldout mix paths are relative to (None: data.root; "": as given).
  heldout_root: str | None = None
  # Substituted for {TOKENIZER} in held-out mix paths: AI2 stores its perplexity sets under
  # "dolma2-tokenizer" (the training mixes under "allenai/dolma3-tokenizer", the same tokenizer).
  heldout_tokenizer_id: str = "dolma2-tokenizer"
  batch_size: int = bounded(8, ge=1)  # documents (or task requests) per evaluation batch (global)
  max_documents: int | None = bounded(None, ge=1)  # per held-out set (None: all)
  # Only held-out documents of at least this many tokens are scored, the first max_documents of
  # them (stage 3: documents longer than the context it extends). None: every document.
  min_document_tokens: int | None = bounded(None, ge=2)
  # Held-out CE also per band of this many positions of the predicted token
  # (eval/<set>/ce_loss_pos<a>_<b>): with the original context as the band, whether loss falls
  # beyond it (stage 3). None: no bands.
  position_band: int | None = bounded(None, ge=1)
  tasks: tuple[str, ...] = ()  # ai2-olmo-eval task labels, e.g. "arc_easy_rc_5shot"
  task_limit: int | None = bounded(None, ge=1)  # documents per task (None: all the task holds)
  # Tasks' tokenizer: a tokenizer.json path, hub name, "embedded", or None: the training data's
  # (its prepared directory's tokenizer.json). olmo3.data.sources.resolve fills both Nones.
  tokenizer: str | None = "allenai/dolma2-tokenizer"
  alarm_window: int = bounded(2, ge=1)  # evaluations the alarm looks back
  alarm_margin: float = bounded(0.05, gt=0)  # train-loss improvement (nats) counted as improving
  stop_on_alarm: bool = False
  ruler: RulerConfig = dataclasses.field(default_factory=RulerConfig)

  def _check(self) -> None:
    nonempty(self, "heldout", "heldout_tokenizer_id", "tokenizer")
    require(self, "tasks", all(spec and ":" not in spec for spec in self.tasks),
            "each task is an ai2-olmo-eval label, e.g. 'arc_easy_rc_5shot' "
            "(olmo_eval.list_tasks() lists them)")


class WandbMode(enum.StrEnum):
  OFF = "off"  # TensorBoard and metrics.jsonl only (the default)
  ONLINE = "online"  # streams to the W&B server (needs `wandb login` or WANDB_API_KEY)
  OFFLINE = "offline"  # the W&B run written locally (WANDB_DIR, else ./wandb); `wandb sync` uploads


@dataclasses.dataclass(frozen=True)
class WandbConfig(Validated):
  """Weights & Biases metrics (the `wandb` extra) beside TensorBoard: process 0 logs the scalars
  TensorBoard gets, at the same steps, with the experiment as the run's config. The run id is
  kept in WORKDIR/wandb_run_id, so a resumed run continues the same W&B run. Every field is
  resumable: W&B may be turned on (or its names changed) for a run already under way."""

  mode: WandbMode = resumable(WandbMode.OFF)
  project: str = resumable("olmo3")
  entity: str | None = resumable(None)  # a team or user (None: the API key's default entity)
  name: str | None = resumable(None)  # the run's display name (None: the workdir's name)

  def _check(self) -> None:
    nonempty(self, "project", "entity", "name")

  @property
  def enabled(self) -> bool:
    return self.mode is not WandbMode.OFF


@dataclasses.dataclass(frozen=True)
class Experiment(Validated):
  """Everything a run is: what Fiddle builds and the launcher runs."""

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(mix="OLMo-mix-0625-official"))
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
  # Flags ('--name=value') appended to XLA_FLAGS / LIBTPU_INIT_ARGS before JAX starts. Both
  # variables are split at whitespace, so a flag holding any would silently become two.
  xla_flags: tuple[str, ...] = ()
  libtpu_flags: tuple[str, ...] = ()
  env: tuple[tuple[str, str], ...] = ()  # environment variables set before JAX starts

  def _check(self) -> None:
    for name in ("xla_flags", "libtpu_flags"):
      require(self, name, all(f.startswith("--") and f.split() == [f]
                              for f in getattr(self, name)),
              "each entry is one flag, '--name=value', without whitespace")
    require(self, "env", all(k and "=" not in k and "\0" not in k + v for k, v in self.env),
            "names must be non-empty, without '='; no NUL characters")
    if self.eval.ruler.lengths and self.eval.ruler.lengths[-1] > self.model.max_seq_len:
      fail(self, "eval.ruler.lengths", f"{self.eval.ruler.lengths[-1]} exceeds model.max_seq_len "
           f"({self.model.max_seq_len}): the model has no positions there (a shorter context "
           "wants shorter lengths; () turns RULER off)", self.eval.ruler.lengths)
    if self.data.seq_len > self.model.max_seq_len:
      fail(self, "data.seq_len", f"exceeds model.max_seq_len ({self.model.max_seq_len})",
           self.data.seq_len)
    if self.optimizer.decay_steps is None and self.train.stop_at_epoch is None:
      fail(self, "optimizer.decay_steps", "None (the stage's length) needs train.stop_at_epoch: "
           "the stage's epochs", None)
    shape = dict(self.mesh.shape)
    split = shape.get("sequence", 1) * max(shape.get("tensor", 1), 1)
    problem = heads_split_problem(self.model.n_kv_heads, split,
                                  "key/value heads (model.n_kv_heads)")
    if (self.model.context_parallel is ContextParallel.ALL_TO_ALL and shape.get("sequence", 1) > 1
        and problem):
      fail(self, "model.context_parallel", problem, self.model.context_parallel.value)
    if (self.train.loss_mean is LossMean.PER_RANK
        and self.data.global_batch_size % self.train.loss_ranks):
      fail(self, "train.loss_ranks", "must divide data.global_batch_size "
           f"({self.data.global_batch_size}): each rank holds whole instances (change both "
           "together; 1: one token mean)", self.train.loss_ranks)

  @property
  def tokens_per_step(self) -> int:
    return self.data.global_batch_size * self.data.seq_len

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Experiment:
    """Inverse of to_dict (plain JSON: no Fiddle needed to read a run's experiment.json); the
    nested dicts become their configs as any dict given for a config field does."""
    return cls(**d)



def resumable_fields(cls: type | None = None, prefix: str = "") -> tuple[str, ...]:
  """Dotted paths of every resumable field under `cls` (default: Experiment)."""
  cls = Experiment if cls is None else cls
  out = []
  for f in dataclasses.fields(cls):
    path = f"{prefix}{f.name}"
    if f.metadata.get(RESUMABLE):
      out.append(path)
    elif f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(
        f.default_factory()):
      out.extend(resumable_fields(type(f.default_factory()), f"{path}."))
  return tuple(out)
