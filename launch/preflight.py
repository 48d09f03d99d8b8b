"""What a launch works out and checks before it writes anything or starts JAX (the experiment
its flags name, the workdir, the config's revision, the plan), and the two modes that stop there
(--dry_run, --compile_only). Each mistake is one line: `config_error` for the command line,
`error: ...` for the rest."""

from __future__ import annotations

import sys
import typing

import fiddle as fdl
from etils import epath
from fiddle import printing

from launch import config_changes, config_files, refs
from olmo3 import compilation_cache, program
from olmo3.io import pathnames
from olmo3.run import record
from olmo3.train import logs

if typing.TYPE_CHECKING:
  from olmo3.train.closing import NextStage


def dry_run(cfg: fdl.Config, exp, workdir: str, ref: str, next_stage: NextStage | None,
            topology: str | None, cache: str | None) -> None:
  """The config as Fiddle prints it, then what olmo3.train.dry_run says of the run (on the TPU
  `topology` when given; `next_stage`: the stage after this one, for a finished run's closing
  summary)."""
  from olmo3.train import dry_run as dry_run_lib

  print(printing.as_str_flattened(cfg))
  print()
  for line in dry_run_lib.lines(
      exp, workdir, ref, topology=topology, topology_devices=topology_devices,
      compilation_cache=compilation_cache.directory(cache), next_stage=next_stage):
    print(line)


def topology_devices(topology: str) -> list:
  from olmo3.train import aot

  return aot.topology_devices(topology)


def compile_only(exp, target: str) -> None:
  """The train step compiled for `target` ('local', or a TPU topology kind:AxBxC): its report,
  or DOES NOT FIT (exit 1)."""
  from olmo3.train import aot

  try:
    with logs.Heartbeat(f"compiling the train step for {target}"):
      report = program.abandoned_on_signal(
          lambda: aot.compile_train_step(exp, None if target == "local" else target),
          f"compiling the train step for {target}")
    print(report.format())
  except aot.DoesNotFit as e:
    print(f"DOES NOT FIT: {e}")
    sys.exit(1)
  except ValueError as e:
    config_error(str(e))


def config_error(message: str) -> typing.NoReturn:
  """A mistake on the command line: its one line, then where the flags are described (not
  the whole --help, which would bury it)."""
  refs.usage_error(message, "launch/main.py")


def experiment(ref: str, sets: list[str], fiddlers: list[str]
               ) -> tuple[fdl.Config, typing.Any]:
  """The config the flags name, and the Experiment it builds (a bad config: one line)."""
  try:
    cfg = refs.resolve(ref, sets, fiddlers)
    return cfg, fdl.build(cfg)
  except (refs.ConfigRefError, ValueError, TypeError) as e:
    config_error(refs.message(e))


def check_workdir(workdir: str) -> None:
  """The workdir is writable where it is (a local path, gs://, s3://) and a directory or can be
  created as one (no file where a directory goes)."""
  from olmo3.io import clients, storage

  try:
    clients.check_supported(workdir, writable=True, what="--workdir")
  except ValueError as e:
    sys.exit(f"error: {e}")
  if storage.exists(workdir) and not storage.is_dir(workdir):
    sys.exit(f"error: --workdir={workdir} is a file, not a directory: give a directory (a new "
             "one is created)")
  # On a local disk the nearest existing parent must be a directory (object stores have no
  # directories to be in the way).
  for parent in epath.Path(workdir).absolute().parents if not pathnames.is_url(workdir) else ():
    if parent.exists():
      if not parent.is_dir():
        sys.exit(f"error: --workdir={workdir}: {parent} is a file, so the directory cannot be "
                 "created there")
      break


def new_revision(workdir: str, cfg: fdl.Config, force: bool) -> dict[str, str] | None:
  """The config files of a new revision, or None when `cfg` is the latest revision's. Refuses
  a change of a field not marked resumable in olmo3.config (a longer run, another slice may
  change) unless --force_workdir."""
  try:
    previous = config_files.latest_config(workdir)
  except refs.ConfigRefError as e:  # unreadable, or naming code it may not import
    sys.exit(f"error: {e}")
  changed = config_changes.unresumable_changes(previous, cfg) if previous is not None else []
  if changed and not force:
    config_error(f"{workdir} holds a run of a different config (" + "; ".join(
        f"{c.path}: {c.a!r} -> {c.b!r}" for c in changed[:5])
        + "). Use another --workdir, or --force_workdir to continue it anyway.")
  return config_files.revision(previous, cfg)


def build_plan(exp, workdir: str, ref: str):
  """The RunPlan, or one line: data that cannot be read, or an init_from that holds no
  checkpoint yet (naming the command that trains it, for a default workdir)."""
  from olmo3.data.tokens import DataError
  from olmo3.io.checkpoint import CheckpointError
  from olmo3.run.plan import InitFromError, RunPlan

  try:
    return RunPlan.build(exp, workdir, ref)
  except (DataError, InitFromError) as e:
    sys.exit(f"error: {e}")
  except CheckpointError:
    source, hint = exp.checkpoint.init_from, "train the run that writes it first"
    named = record.named_by_convention(source)
    if named is not None:
      try:
        ref = f"experiments.{named[0]}:{named[1]}"
        refs.load(ref)
        hint = f"train it first: python launch/main.py --fdl_config={ref}"
      except (refs.ConfigRefError, ValueError, TypeError):
        pass
    sys.exit(f"error: CheckpointConfig.init_from={source!r} holds no checkpoint yet: {hint} "
             "(or point checkpoint.init_from at a checkpoint that exists)")

