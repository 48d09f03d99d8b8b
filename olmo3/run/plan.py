"""A launch's facts, worked out once: `RunPlan.build(exp, workdir)` resolves the experiment
(held-out sets, their root, the task tokenizer), lists and sizes the training and held-out
token files (each mix read once; remote sizes through the workdir's cache), fixes the data's
identity and the stage's end, and decides where the run starts. The launcher prints it
(--dry_run), records it and hands it to `olmo3.train.loop.train`; the trainer and the evaluator
read it and derive none of it again. Building it reads; it writes nothing.

Where a run starts (`Resume`), from what the workdir holds when the launch begins:
- RESUME: the run's newest committed checkpoint (the trainer verifies it, and falls back past
  a damaged one: olmo3.train.state);
- COMPLETE: that checkpoint already reaches the stage's end (the launcher has the trainer's
  restore confirm it before it says so);
- INIT_FROM: no checkpoint of its own, and checkpoint.init_from names one (its parameters and
  moments; the step, schedule and data position too with checkpoint.init_mode=continue): a step
  directory, or a run's workdir (or its checkpoints directory), which means the checkpoint at
  the end of that run's stage (`init_from_step`), not its newest; or AI2's OLMo-core checkpoint
  (olmo3.io.olmo_core_checkpoints.locate: a step directory, or a save folder, which means its
  newest complete step, as OLMo-core's load_path does), which the trainer converts into the
  workdir once (`Workdir.olmo_core_import`);
- FRESH: neither: step 0 from train.seed.

A resumed run whose stage now ends elsewhere than its last launch's did (train.steps raised on
a finished run) says so (`RunPlan.stage_change`: "extending the run from 100 to 120 steps").
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any

from absl import logging

from olmo3 import sharding
from olmo3.io import checkpoint, file_sizes, olmo_core_checkpoints, pathnames
from olmo3.config import DataConfig, Experiment, InitMode
from olmo3.data import pipeline, sources
from olmo3.data.tokens import TokenFiles, token_counts
from olmo3.run import record
from olmo3.run.record import Workdir


class Start(enum.Enum):
  FRESH = "fresh"
  INIT_FROM = "init_from"
  RESUME = "resume"
  COMPLETE = "complete"


@dataclasses.dataclass(frozen=True)
class Resume:
  start: Start
  step: int = 0  # RESUME / COMPLETE: the newest committed checkpoint (else 0)
  init_from: str | None = None  # INIT_FROM: the step directory checkpoint.init_from names
  # INIT_FROM of an OLMo-core checkpoint: checkpoint.init_from as given; `init_from` is where
  # it is (or will be) converted.
  olmo_core: str | None = None


@dataclasses.dataclass(frozen=True)
class HeldoutSet:
  name: str  # the set's label in its mix (eval/<name>/ce_loss)
  paths: tuple[str, ...]
  tokens: tuple[int, ...]  # per file


def data_identity(cfg: DataConfig, source: TokenFiles) -> dict[str, Any]:
  """The data a run trains on, as each checkpoint records it (plain JSON): a resume that finds
  it changed refuses (olmo3.train.state)."""
  return json.loads(json.dumps({
      "files": [[os.fspath(p), int(n)] for p, n in zip(source.paths, source.file_tokens)],
      "mix": cfg.mix, "instances": pipeline.instances(cfg, source), "seq_len": cfg.seq_len,
      "max_target_seq_len": cfg.chunk_instances * cfg.seq_len,  # the run length actually used
      "global_batch_size": cfg.global_batch_size, "seed": cfg.seed,
      "max_instances": cfg.max_instances,
      "repetition_filter": (dataclasses.asdict(cfg.repetition_filter)
                            if cfg.repetition_filter else None),
      # Packed instances: how, and what came out (the packing's tie order depends on the
      # machine's numpy: a resume on a machine that packed otherwise would train other rows).
      "packing": dataclasses.asdict(cfg.packing) if cfg.packing else None,
      "packed_index": source.index.digest if cfg.packing else None}))


def stage_end(exp: Experiment, steps_per_epoch: int) -> int:
  """The step this stage ends at: train.steps, or the end of epoch train.stop_at_epoch when
  that comes first."""
  if exp.train.stop_at_epoch is None:
    return exp.train.steps
  return min(exp.train.steps, exp.train.stop_at_epoch * steps_per_epoch)


# What each checkpoint.init_mode takes from the checkpoint, as a dry run says it.
CARRIED = {
    InitMode.NEW_STAGE: "its parameters, and its AdamW moments when it holds them (else fresh "
                        "ones); step, schedule and data position start from 0",
    InitMode.CONTINUE: "its parameters, AdamW moments, step, schedule and data position"}


def schedule_for_stage(exp: Experiment, steps_per_epoch: int) -> Experiment:
  """`exp` with its schedule's length and warmup in steps, where the recipe gives them relative
  to the stage: `optimizer.decay_steps` None is the stage's length (train.stop_at_epoch epochs
  of its data, as OLMo-core's t_max is the trainer's max_duration in epochs), and
  `optimizer.warmup_fraction` its warmup, round(fraction x length) as OLMo-core's
  LinearWithWarmup rounds it. Limiting the run (train.steps) runs the first steps of the same
  schedule, as with a fixed length."""
  o = exp.optimizer
  if o.decay_steps is not None and o.warmup_fraction is None:
    return exp
  length = o.decay_steps or exp.train.stop_at_epoch * steps_per_epoch
  warmup = o.warmup_steps if o.warmup_fraction is None else round(length * o.warmup_fraction)
  return dataclasses.replace(exp, optimizer=dataclasses.replace(
      o, decay_steps=length, warmup_steps=warmup, warmup_fraction=None))


class InitFromError(checkpoint.CheckpointError):
  """checkpoint.init_from names a run whose stage's end has no checkpoint (not finished), or
  whose record cannot be read. The message names the field and what to do."""


def init_from_step(init_from: str) -> str:
  """The checkpoint step directory `checkpoint.init_from` means: a step directory is itself; a
  run's workdir or checkpoints directory means the checkpoint at the end of its stage: the
  newest committed step that ended the stage of the launch that wrote it (its history line's
  plan). A raised train.steps makes the extended end the stage's end once it is reached; a run
  recorded without stage ends (trained without the launcher) means its newest checkpoint.
  CheckpointError when there is no checkpoint; InitFromError when none ends a stage."""
  path = pathnames.absolute(init_from)
  if (path / checkpoint.PARAMS).exists():
    return os.fspath(path)
  directory = checkpoint.steps_directory(path)
  steps = checkpoint.run_steps(directory)
  if not steps:
    return os.fspath(checkpoint.resolve_step_dir(init_from))  # its error names what is missing
  try:
    history = record.read_history(directory.parent)  # the run's workdir
  except record.RecordError as e:
    raise InitFromError(f"CheckpointConfig.init_from={init_from!r}: {e}") from None
  if not any("end" in h.plan for h in history):
    return os.fspath(directory / str(steps[-1]))

  def recorded_end(step: int) -> int | None:
    """The stage end that the launch that wrote `step` recorded (its history line's plan)."""
    launch = record.producer(history, step)
    return launch.plan.get("end") if launch is not None else None

  finished = [s for s in steps if recorded_end(s) == s]
  if finished:
    return os.fspath(directory / str(finished[-1]))
  raise InitFromError(
      f"CheckpointConfig.init_from={init_from!r}: that run has not reached the end of its stage "
      f"(step {recorded_end(steps[-1])}; its newest checkpoint is step {steps[-1]}): finish it "
      f"first (rerun its command), or name a step directory, e.g. "
      f"checkpoint.init_from='{directory / str(steps[-1])}'")


def decide_start(workdir: Workdir, init_from: str | None, end: int) -> Resume:
  """Where a run in `workdir` starts (the module docstring): from its committed checkpoints'
  names and init_from's, reading no array. CheckpointError when the run has no checkpoint and
  init_from holds none (InitFromError: none at the end of its stage)."""
  steps = checkpoint.run_steps(workdir.checkpoints)
  if steps:
    return Resume(Start.COMPLETE if steps[-1] >= end else Start.RESUME, steps[-1])
  return stage_start(workdir, init_from)


def stage_start(workdir: Workdir, init_from: str | None) -> Resume:
  """Where a run in `workdir` starts before it has a checkpoint of its own: init_from, else
  fresh."""
  if init_from:
    try:
      located = olmo_core_checkpoints.locate(init_from)
    except olmo_core_checkpoints.IncompleteSaveFolder as e:
      raise InitFromError(f"CheckpointConfig.init_from={init_from!r}: {e}") from None
    if located is not None:
      if located.folder is not None:  # a save folder: the step it took is what is converted
        say = logging.warning if located.passed_over else logging.info
        say("CheckpointConfig.init_from=%r: %s", init_from, located.picked())
      return Resume(Start.INIT_FROM, init_from=workdir.olmo_core_import,
                    olmo_core=init_from if located.folder is None else located.root)
    return Resume(Start.INIT_FROM, init_from=init_from_step(init_from))
  return Resume(Start.FRESH)


def _trained_tokenizer(step_dir: str) -> str | None:
  """The tokenizer the run that wrote checkpoint `step_dir` (WORKDIR/checkpoints/STEP) trained
  with: its experiment file's eval.tokenizer; None where no launcher record says."""
  checkpoints, step = pathnames.split(pathnames.normalized(step_dir))
  try:
    path = record.experiment_file(pathnames.split(checkpoints)[0], int(step))
    return json.loads(path.read_text())["eval"]["tokenizer"]
  except (record.RecordError, OSError, ValueError, KeyError, TypeError):
    return None


def stage_change(workdir: Workdir, resume: Resume, end: int) -> str | None:
  """What a resumed run says when its stage now ends elsewhere than its last launch's did
  (history.jsonl): "extending the run from 100 to 120 steps" when that launch had finished."""
  if resume.start is not Start.RESUME:
    return None
  try:
    history = record.read_history(workdir.root)
  except record.RecordError:
    return None  # the launcher reports an unreadable record itself
  previous = history[-1].plan.get("end") if history else None
  if previous is None or previous == end:
    return None
  if resume.step >= previous:
    return (f"extending the run from {previous} to {end} steps (it was complete at step "
            f"{resume.step}; the stage's end is now step {end})")
  return f"the stage now ends at step {end}, not {previous} as the last launch set it"


@dataclasses.dataclass(frozen=True)
class RunPlan:
  exp: Experiment  # resolved: what the run executes and experiment.json records
  workdir: Workdir
  name: str  # the experiment's reference (recorded in each checkpoint)
  train_files: TokenFiles  # sized and checked
  heldout: tuple[HeldoutSet, ...]  # () when the run never evaluates
  identity: dict[str, Any]  # data_identity of the training data
  steps_per_epoch: int
  end: int  # the step the stage ends at
  resume: Resume
  size_cache: file_sizes.SizeCache  # the workdir's remote sizes: the trainer saves what was found
  # Why the generalization-gap alarm cannot fire (no held-out set is evaluated), or None:
  # the trainer's startup warning, one line.
  alarm_off: str | None = None
  # A resumed run's changed stage end (`stage_change`), or None: the launcher announces it.
  stage_change: str | None = None

  @classmethod
  def build(cls, exp: Experiment, workdir: str, name: str = "") -> RunPlan:
    """Raises DataError (data) or CheckpointError (init_from) naming the field or file."""
    cache = file_sizes.SizeCache(Workdir(workdir).file_sizes,
                                 accept_changes=exp.data.allow_changed_data)
    return cls.from_resolved(sources.resolve(exp, cache), workdir, name, cache)

  @classmethod
  def from_resolved(cls, resolved: sources.Resolved, workdir: str, name: str = "",
                    cache: file_sizes.SizeCache | None = None) -> RunPlan:
    """`build`, the experiment's data already resolved (a dry run prints the resolution even
    where the files cannot be sized); `cache`: the one the resolution sized files through."""
    where = Workdir(workdir)
    exp = resolved.exp
    cache = cache or file_sizes.SizeCache(where.file_sizes,
                                          accept_changes=exp.data.allow_changed_data)
    train_files = resolved.train_files or sources.token_files(
        exp.data, exp.model.vocab_size, cache, files=list(resolved.train), model=exp.model)
    evaluates = bool(exp.train.eval_every)
    sets = sources.by_set([f for _, files in resolved.heldout for f in files])
    heldout = tuple(HeldoutSet(n, p, tuple(token_counts(p, "held-out token file", cache)))
                    for n, p in sets.items()) if evaluates else ()
    per_epoch = pipeline.steps_per_epoch(exp.data, train_files)
    exp = schedule_for_stage(exp, per_epoch)
    end = stage_end(exp, per_epoch)
    if end != exp.train.steps:
      logging.warning("train.steps=%d but epoch %d of the data ends at step %d (%d instances, "
                      "%d steps per epoch): the stage ends at step %d", exp.train.steps,
                      exp.train.stop_at_epoch, exp.train.stop_at_epoch * per_epoch,
                      len(train_files), per_epoch, end)
    why = ("TrainConfig.eval_every=0: the run never evaluates" if not evaluates
           else None if heldout else resolved.no_heldout or "no held-out set resolved")
    resume = decide_start(where, exp.checkpoint.init_from, end)
    if resume.start is Start.INIT_FROM and resume.olmo_core is None:
      sources.check_init_tokenizer(exp, _trained_tokenizer(resume.init_from),
                                   exp.checkpoint.init_from)
    return cls(exp, where, name, train_files, heldout, data_identity(exp.data, train_files),
               per_epoch, end, resume, cache,
               why and f"no held-out evaluation: {why}, so the generalization-gap alarm cannot "
               "fire", stage_change(where, resume, end))

  def summary(self) -> dict[str, Any]:
    """What the run record keeps of the plan (plain JSON; each checkpoint's meta holds the
    whole data identity). `layout`: the mesh the launch trains on (ShardedModel.for_experiment's
    over every device), which a replay of its steps takes again (olmo3.train.replay)."""
    files = self.train_files
    return {"layout": sharding.layout(sharding.experiment_mesh(self.exp.mesh)),
            "start": self.resume.start.value, "step": self.resume.step,
            "init_from": self.resume.init_from, "olmo_core": self.resume.olmo_core,
            "init_mode": self.exp.checkpoint.init_mode.value, "end": self.end,
            "steps_per_epoch": self.steps_per_epoch, "instances": self.identity["instances"],
            "files": len(files.paths), "tokens": int(files.file_tokens.sum()),
            "heldout": {s.name: sum(s.tokens) for s in self.heldout}}

  def start_checkpoint(self) -> str | None:
    """The olmo3 checkpoint step directory this launch restores: its own newest (a resume) or
    checkpoint.init_from's; None when it starts fresh, is complete, or starts from an OLMo-core
    checkpoint (converted at the start)."""
    resume = self.resume
    if resume.start is Start.RESUME:
      return os.fspath(self.workdir.checkpoints / str(resume.step))
    if resume.start is Start.INIT_FROM and resume.olmo_core is None:
      return resume.init_from
    return None

  def describe(self) -> list[str]:
    """What --dry_run prints of the plan (olmo3.train.dry_run: the config's numbers come before
    it, what is evaluated after it)."""
    exp, data = self.exp, self.exp.data
    split = sources.prepared(data.mix) if data.mix else None
    if split is not None:
      where = (f"{split.directory}: {split.split} split, "
               f"{len(split.manifest.splits[split.split]['files'])} files")
    else:
      where = data.mix or f"{len(data.paths)} token files (data.paths)"
    stop = (f"; the stage ends at step {self.end:,}" if exp.train.stop_at_epoch is not None
            else "")
    resume = self.resume
    start = {Start.FRESH: "fresh, from train.seed",
             Start.INIT_FROM: f"initialised from {resume.olmo_core or resume.init_from} "
                              f"(checkpoint.init_mode={exp.checkpoint.init_mode.value}: "
                              f"{CARRIED[exp.checkpoint.init_mode]})"
                              + (f", converted into {resume.init_from}" if resume.olmo_core
                                 else ""),
             Start.RESUME: f"resumes from step {resume.step:,} of {self.workdir.checkpoints}"
                           + (f"; {self.stage_change}" if self.stage_change else ""),
             Start.COMPLETE: f"complete at step {resume.step:,}: nothing to train"}
    return [f"training data       {where}",
            f"task tokenizer      {'none' if exp.eval.tokenizer is None else exp.eval.tokenizer}",
            f"epoch               {len(self.train_files):,} instances = "
            f"{self.steps_per_epoch:,} steps{stop}",
            f"schedule            {exp.optimizer.schedule.value} over "
            f"{exp.optimizer.decay_steps:,} steps, warmup {exp.optimizer.warmup_steps:,}",
            f"start               {start[resume.start]}"]
