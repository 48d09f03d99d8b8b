"""Train an experiment.

  python launch/main.py --fdl_config=experiments.olmo3_tiny:stage1
  python launch/main.py --fdl_config=experiments.olmo3_7b:stage2 --dry_run
  python launch/main.py --fdl_config=experiments.olmo3_7b:stage1 --fdl_set=train.steps=10 \
      --fiddler=single_cosine --workdir=/tmp/run

The workdir (default runs/<module>.<function>) receives config.json (loads back with
launch/diff.py or launch.config_files.from_workdir), config.txt, command.txt, experiment.json,
history.jsonl, metrics.jsonl, TensorBoard events and checkpoints; rerunning the same command
resumes from the latest checkpoint, and a resume with a changed config adds revision n
(config.<n>.json, experiment.<n>.json) without rewriting earlier ones. A rerun with nothing to
train writes nothing; a mistake is one line, found before anything is written. A launch works
its facts out once (olmo3.run.plan.RunPlan: data, stage end, where the run starts), prints it
with --dry_run, records its summary and trains it. A launch that stops before its first step,
whatever stopped it, takes back what it wrote. SIGINT / SIGTERM stop the run at the end of the
step under way (no further step or evaluation), save it and exit 0, the last line saying
"interrupted at step N; saved; rerun the same command to resume". The experiment's flag set
is applied to XLA_FLAGS / LIBTPU_INIT_ARGS before JAX starts, and a job that spans several
processes (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or SLURM / TPU pod
environments) joins with jax.distributed.initialize(); a process of it that dies or fails ends
the others within the heartbeat timeout (OLMO3_HEARTBEAT_TIMEOUT_S), never leaving them waiting.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import time
import typing
from collections.abc import Iterator

from olmo3.train.preemption import Preemption

# Installed before the heavy imports below: a SIGTERM / SIGINT while the run starts stops it
# cleanly (exit 0) at its first step boundary instead of killing it.
PREEMPTION = Preemption() if __name__ == "__main__" else None
STARTED = time.monotonic()  # this launch's wall time, in its closing summary
if __name__ == "__main__":
  # A launch makes millions of objects that live as long as it does (its imports, then JAX's
  # tracing of every program), and at Python's default threshold (700 allocations) the cycle
  # collector scans them again and again: 0.4 CPU s of a short launch (6.5 -> 6.1, measured
  # on the tiny run). Refcounting still frees everything else at once.
  gc.set_threshold(50_000, 20, 20)

import fiddle as fdl  # noqa: E402
import jax  # noqa: E402  (imported through olmo3.config anyway; importing starts no backend)
from absl import app, flags, logging  # noqa: E402
from etils import epath  # noqa: E402
from fiddle import printing  # noqa: E402

from launch import config_files, diffs, peers, refs  # noqa: E402
from olmo3 import compilation_cache  # noqa: E402
from olmo3 import xla_flags as flags_lib  # noqa: E402
from olmo3.config import ConfigError  # noqa: E402
from olmo3.io import errors as errors_lib  # noqa: E402
from olmo3.io import pathnames, settings  # noqa: E402
from olmo3.run import record  # noqa: E402
from olmo3.train import logs  # noqa: E402
from olmo3.train.skips import TrainingStopped  # noqa: E402
# The rest is imported where it is used, out of --help's way: the stores' clients, the lease,
# the data pipeline, Orbax, the train step.

FLAGS = flags.DEFINE_string(
    "fdl_config", None, "experiment reference: package.module:function (or the dotted form)")
SETS = flags.DEFINE_multi_string("fdl_set", [], "override: path=value (a Python literal)")
FIDDLERS = flags.DEFINE_multi_string("fiddler", [], "fiddler: name or name(key=value, ...)")
WORKDIR = flags.DEFINE_string("workdir", None, "run directory (default runs/<module>.<fn>)")
DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "print the config and its numbers; allocate nothing (with "
    "--compile_only=KIND:AxBxC: the mesh and checkpoint layout on that topology, compiling nothing)")
COMPILE_ONLY = flags.DEFINE_string(
    "compile_only", None, "compile the train step and report memory and FLOPs: 'local' for this "
    "machine's devices, or a TPU topology kind:AxBxC (e.g. tpu7x:4x8x8; needs the tpu extra)")
FORCE = flags.DEFINE_bool("force_workdir", False,
                          "use a workdir that holds a run of a different config")
CACHE = flags.DEFINE_string(
    "compilation_cache", None,
    "persistent XLA compilation cache (a restarted or resumed run skips recompiling; a shared "
    "path such as gs://... serves every host); '' turns it off. Default: "
    "$JAX_COMPILATION_CACHE_DIR, else $OLMO3_CACHE/jax (~/.cache/olmo3/jax)")
# A process of a multi-process job that dies (SIGKILL, OOM, a lost host) stops sending
# heartbeats: this long after its last one, every other process stops too (non-zero) instead of
# waiting in a collective for a peer that is gone (a dead coordinator, process 0, stops them at
# once). Default: jax.distributed's own.
HEARTBEAT_ENV = "OLMO3_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_S = 100


def start_jax() -> None:
  """Joins the job's other processes (JAX_COORDINATOR_* or the cluster's own environment) and
  turns the persistent compilation cache on."""
  cache = compilation_cache.directory(CACHE.value)
  if cache:
    compilation_cache.enable(cache)
  env = os.environ
  heartbeat = max(1, round(settings.seconds_setting(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S)))
  position = peers.job_position(env)
  if position is not None:  # a lost peer ends this process in one line (launch/peers.py)
    peers.watch_stderr(*position)
  if "JAX_COORDINATOR_ADDRESS" in env:
    jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                               num_processes=int(env["JAX_NUM_PROCESSES"]),
                               process_id=int(env["JAX_PROCESS_ID"]),
                               heartbeat_timeout_seconds=heartbeat)
  elif int(env.get("SLURM_NTASKS", "1")) > 1 or "," in env.get("TPU_WORKER_HOSTNAMES", ""):
    # Cluster auto-detection (SLURM, multi-host TPU).
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
  compilation_cache.compile_once_per_cpu_job()


@contextlib.contextmanager
def leaving_at_once_on_failure() -> Iterator[None]:
  """A process of a multi-process job whose launch fails (an error, or an `error:` line) exits
  as soon as it has said why, skipping jax.distributed's shutdown barrier at exit: there it
  would wait for the other processes (up to 300 s) while they wait for it in a collective.
  Gone, it stops them at once (process 0 runs the coordination service) or within the
  heartbeat timeout (OLMO3_HEARTBEAT_TIMEOUT_S)."""
  try:
    yield
  except BaseException as e:
    code = errors_lib.exit_code(e) if isinstance(e, SystemExit) else 1
    if code and jax.process_count() > 1:
      # Runs before JAX's own exit handler (registered first, run last), after the error line.
      atexit.register(_exit_now, code)
      lost = peers.peer_lost(e, jax.process_index(), jax.process_count())
      if lost is not None:
        raise lost from None
    raise


def _exit_now(code: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access  # the exit that skips JAX's handler


def dry_run(cfg: fdl.Config, exp, workdir: str) -> None:
  """The config as Fiddle prints it, then what olmo3.run.dry_run says of the run."""
  from olmo3.run import dry_run as dry_run_lib

  print(printing.as_str_flattened(cfg))
  print()
  topology = COMPILE_ONLY.value if COMPILE_ONLY.value not in (None, "local") else None
  for line in dry_run_lib.lines(exp, workdir, FLAGS.value, topology=topology,
                                topology_devices=topology_devices,
                                compilation_cache=compilation_cache.directory(CACHE.value),
                                closing=closing_summary):
    print(line)


def topology_devices(topology: str) -> list:
  from olmo3.train import aot

  return aot.topology_devices(topology)


def compile_only(exp) -> None:
  from olmo3.train import aot

  target = None if COMPILE_ONLY.value == "local" else COMPILE_ONLY.value
  try:
    with logs.Heartbeat(f"compiling the train step for {COMPILE_ONLY.value}"):
      report = aot.compile_train_step(exp, target)
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


def experiment() -> tuple[fdl.Config, typing.Any]:
  """The config the flags name, and the Experiment it builds (a bad config: one line)."""
  try:
    cfg = refs.resolve(FLAGS.value, SETS.value, FIDDLERS.value)
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


def new_revision(workdir: str, cfg: fdl.Config) -> dict[str, str] | None:
  """The config files of a new revision, or None when `cfg` is the latest revision's. Refuses
  a change of a field not marked resumable in olmo3.config (a longer run, another slice may
  change) unless --force_workdir."""
  try:
    previous = config_files.latest_config(workdir)
  except refs.ConfigRefError as e:  # unreadable, or naming code it may not import
    sys.exit(f"error: {e}")
  changed = diffs.unresumable_changes(previous, cfg) if previous is not None else []
  if changed and not FORCE.value:
    config_error(f"{workdir} holds a run of a different config (" + "; ".join(
        f"{c.path}: {c.a!r} -> {c.b!r}" for c in changed[:5])
        + "). Use another --workdir, or --force_workdir to continue it anyway.")
  return config_files.revision(previous, cfg)


def build_plan(exp, workdir: str):
  """The RunPlan, or one line: data that cannot be read, or an init_from that holds no
  checkpoint yet (naming the command that trains it, for a default workdir)."""
  from olmo3.data.tokens import DataError
  from olmo3.io.checkpoint import CheckpointError
  from olmo3.run.plan import InitFromError, RunPlan

  try:
    return RunPlan.build(exp, workdir, FLAGS.value)
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


def begin(plan, revision: dict[str, str] | None):
  """Process 0 refuses a workdir another live run holds (before this launch records anything
  in it; train() then takes the lease) and records the launch. The record, to take back."""
  from olmo3.train.lease import Lease, LeaseHeld

  run_record = record.RunRecord(plan.workdir.root)
  if jax.process_index() == 0:
    try:
      if plan.workdir.lease.exists():
        lease = Lease(plan.workdir.root)
        lease.acquire()
        lease.release()
      run_record.begin(revision, plan.exp.to_dict(), sys.argv, plan.resume.step, plan.summary())
    except LeaseHeld as e:
      sys.exit(f"error: {e}")
  return run_record


def run(plan, run_record, created: bool) -> str:
  """train(plan); the launch's last line (the metrics, or where a signal stopped it). A run
  that stops before its first step (an error, or a signal) takes back what this launch wrote,
  whatever stopped it; an error is then one line when it has a one-line form (the user's
  data, tasks, checkpoints, the lease, metrics, storage), else raised on with its traceback."""
  from olmo3.io import retry
  from olmo3.train import closing
  from olmo3.train.loop import Progress, train

  progress = Progress()
  try:
    last = train(plan, preemption=PREEMPTION, progress=progress)
  except BaseException as e:
    if progress.steps == 0:
      with retry.attempts_once():  # the store may be down: cleanup never in the way of `e`
        take_back(plan, run_record, created)
    if isinstance(e, _one_line_errors()):
      verbose = errors_lib.traceback_wanted(logging.get_verbosity())
      logging.error("%s", e, exc_info=verbose)
      if not verbose:
        sys.exit(errors_lib.one_line(e))
    raise
  if progress.steps == 0:  # a signal before the first step, or nothing left to train
    take_back(plan, run_record, created)
  if progress.interrupted is not None:
    return closing.interruption(plan, progress)
  if progress.steps == 0 or not last:
    return ""
  return "\n".join(closing_summary(plan, time.monotonic() - STARTED))


def take_back(plan, run_record, created: bool) -> None:
  """What this launch wrote, on a run that trained nothing: the workdir as it was found
  (process 0; the others wrote nothing of their own)."""
  if jax.process_index() != 0:
    return
  try:
    if created:
      epath.Path(plan.workdir.root).rmtree(missing_ok=True)
    else:
      run_record.undo()
  except OSError as e:  # never in the way of the reason the run stopped
    logging.warning("could not take back what this launch wrote in %s: %s", plan.workdir.root, e)


def closing_summary(plan, launch_seconds: float | None = None) -> list[str]:
  """What the run in plan.workdir came to, and the commands to run next (olmo3.train.closing),
  the next stage's among them when the experiment's module defines it (stage<n+1>)."""
  from olmo3.train import closing

  module, function = refs.split_ref(FLAGS.value)
  following, stage = closing.following_function(function), None
  if following is not None and following in refs.module_functions(
      refs.import_module(module, f"--fdl_config={FLAGS.value!r}"), refs.Kind.EXPERIMENT):
    stage = closing.NextStage(module, function, following,
                              refs.load(f"{module}:{following}").checkpoint.init_from,
                              fdl.build(refs.resolve(FLAGS.value, [], FIDDLERS.value)).data)
  return closing.summary_lines(plan, stage, launch_seconds)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    config_error(f"unexpected arguments: {argv[1:]} (every option is a --flag)")
  # Libraries' INFO lines off (absl's -v 1 brings them back); no TPU probing on a CPU machine.
  logs.configure(logging.get_verbosity())
  refs.make_cwd_importable()
  if not FLAGS.value:
    config_error("--fdl_config is required, e.g. experiments.olmo3_tiny:stage1")
  cfg, exp = experiment()
  flags_lib.apply_to_environ(exp.xla_flags, exp.libtpu_flags, exp.env)
  workdir = WORKDIR.value or refs.default_workdir(FLAGS.value)
  if DRY_RUN.value or COMPILE_ONLY.value:
    if PREEMPTION is not None:
      PREEMPTION.restore()  # nothing to save: Ctrl-C stops these at once
    return dry_run(cfg, exp, workdir) if DRY_RUN.value else compile_only(exp)
  # Everything a launch can find wrong is found before anything is written: a launch that stops
  # early leaves no workdir, record, lease or event file behind.
  check_workdir(workdir)
  revision = new_revision(workdir, cfg)
  plan = build_plan(exp, workdir)
  start_jax()
  with leaving_at_once_on_failure():
    train_the_plan(plan, revision, workdir, exp)


def train_the_plan(plan, revision: dict[str, str] | None, workdir: str, exp) -> None:
  """The launch once JAX has started: a complete run reports itself; otherwise the launch is
  recorded and trained."""
  from olmo3.run.plan import Start
  from olmo3.sharded_model import ShardedModel
  from olmo3.train.state import confirm_complete

  if plan.resume.start is Start.COMPLETE:  # verified as the trainer would restore it
    plan = confirm_complete(plan, ShardedModel.for_experiment(plan.exp))
  if plan.resume.start is Start.COMPLETE:
    if jax.process_index() == 0:
      print("\n".join(closing_summary(plan)))
    print(f"{workdir}: the run is complete at step {plan.resume.step} (train.steps="
          f"{exp.train.steps}); nothing to train, nothing written")
    return
  if plan.stage_change:
    logging.warning("%s", plan.stage_change)
  created = not epath.Path(workdir).exists()
  run_record = begin(plan, revision)
  logging.info("training %s in %s on %d %s devices", FLAGS.value, workdir, jax.device_count(),
               jax.default_backend())
  last_line = run(plan, run_record, created)
  if last_line and jax.process_index() == 0:
    print(last_line)


def _one_line_errors() -> tuple[type[BaseException], ...]:
  """What a launch reports in one line wherever it happens (before train(): the workdir,
  storage and lease checks; `run` reports train()'s own, having taken back what it wrote)."""
  from olmo3.data.tokens import DataError
  from olmo3.eval.tasks import TaskError
  from olmo3.io.checkpoint import CheckpointError
  from olmo3.io.metrics import MetricsError
  from olmo3.train.lease import LeaseHeld, LeaseLost

  return (ConfigError, DataError, TaskError, CheckpointError, MetricsError, record.RecordError,
          LeaseHeld, LeaseLost, TrainingStopped, peers.PeerLost, OSError)  # OSError: storage


if __name__ == "__main__":
  app.run(errors_lib.reported(main, _one_line_errors, logging.get_verbosity))
