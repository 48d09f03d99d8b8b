"""Train an experiment.

  python launch/main.py --fdl_config=experiments.olmo3_tiny:stage1   (flags: docs/launch.md)

Here: the flags, JAX's start (jax.distributed for a job of several processes), and a failed
launch: a mistake is one line found before anything is written (launch/preflight.py), a launch
that stops before its first step takes back what it wrote, a process that dies ends the others
within the heartbeat timeout. Rerunning resumes; SIGINT / SIGTERM save the step and exit 0.
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
  # Millions of objects live as long as a launch (imports, JAX's tracing): at the default
  # threshold the cycle collector rescans them, 0.4 CPU s of a short launch (6.5 -> 6.1).
  gc.set_threshold(50_000, 20, 20)

import jax  # noqa: E402  (imported through olmo3.config anyway; importing starts no backend)
from absl import app, flags, logging  # noqa: E402
from etils import epath  # noqa: E402

from launch import peers, preflight, refs  # noqa: E402
from olmo3 import compilation_cache, program  # noqa: E402
from olmo3 import xla_flags as flags_lib  # noqa: E402
from olmo3.config import ConfigError  # noqa: E402
from olmo3.io import pathnames  # noqa: E402
from olmo3.run import record  # noqa: E402
from olmo3.train import logs  # noqa: E402
from olmo3.train.skips import TrainingStopped  # noqa: E402
# The rest (store clients, lease, data pipeline, Orbax, the train step) where used: not in --help.
if typing.TYPE_CHECKING:
  from olmo3.train.closing import NextStage

FLAGS = flags.DEFINE_string(
    "fdl_config", None, "experiment reference: package.module:function (or the dotted form)")
SETS = flags.DEFINE_multi_string("fdl_set", [], "override: path=value (a Python literal)")
FIDDLERS = flags.DEFINE_multi_string("fiddler", [], "fiddler: name or name(key=value, ...)")
WORKDIR = flags.DEFINE_string("workdir", None, "run directory (default runs/<module>.<fn>)")
DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "print the config and its numbers; allocate nothing (with --compile_only="
    "KIND:AxBxC: the mesh and checkpoint layout on that topology, compiling nothing)")
COMPILE_ONLY = flags.DEFINE_string(
    "compile_only", None, "compile the train step and report memory and FLOPs: 'local' for this "
    "machine's devices, or a TPU topology kind:AxBxC (e.g. tpu7x:4x8x8; needs the tpu extra)")
FORCE = flags.DEFINE_bool("force_workdir", False, "use a workdir holding a run of another config")
CACHE = flags.DEFINE_string(
    "compilation_cache", None,
    "persistent XLA compilation cache (a restart skips recompiling; a gs://... path serves every "
    "host); '' turns it off. Default: $JAX_COMPILATION_CACHE_DIR, else $OLMO3_CACHE/jax")


def start_jax() -> None:
  """Joins the job's other processes (JAX_COORDINATOR_* or the cluster's own environment) and
  turns the persistent compilation cache on."""
  cache = compilation_cache.directory(CACHE.value)
  if cache:
    compilation_cache.enable(cache)
  env = os.environ
  heartbeat = max(1, round(program.seconds_setting(peers.HEARTBEAT_ENV,
                                                       peers.DEFAULT_HEARTBEAT_S)))
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
    code = program.exit_code(e) if isinstance(e, SystemExit) else 1
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


def run(plan, revision: dict[str, str] | None, created: bool) -> str:
  """Takes the workdir's lease, records the launch (process 0) and trains it (train(plan));
  the launch's last line (the metrics, or where a signal stopped it). The lease comes first:
  a launch it refuses has written nothing, so it takes nothing back (what the workdir holds
  is the holder's). A run that stops before its first step (an error, or a signal) takes
  back what this launch wrote, whatever stopped it, then releases the lease; an error is
  then one line when it has a one-line form (the user's data, tasks, checkpoints, the lease,
  metrics, storage), else raised on with its traceback."""
  from olmo3.io import retry
  from olmo3.run.lease import Lease, hold
  from olmo3.train import closing
  from olmo3.train.loop import Progress, train

  lease = Lease(plan.workdir.root)
  hold(lease)  # LeaseHeld: one line, nothing written
  run_record = record.RunRecord(plan.workdir.root)
  progress = Progress()
  try:
    if jax.process_index() == 0:
      run_record.begin(revision, plan.exp.to_dict(), sys.argv, plan.resume.step, plan.summary())
    logging.info("training %s in %s on %d %s devices", FLAGS.value, plan.workdir.root,
                 jax.device_count(), jax.default_backend())
    last = train(plan, preemption=PREEMPTION, progress=progress, lease=lease)
  except BaseException as e:
    with retry.cleanup_after(e):
      leave(plan, run_record, created, lease, trained=progress.steps > 0, failed=True)
    if (isinstance(e, _one_line_errors())
        and not program.traceback_wanted(logging.get_verbosity())):
      sys.exit(program.one_line(e))  # the launch's last line, said once
    raise
  # (trained nothing: a signal before the first step, or nothing left to train)
  leave(plan, run_record, created, lease, trained=progress.steps > 0, failed=False)
  if progress.interrupted is not None:
    return closing.interruption(plan, progress)
  if progress.steps == 0 or not last:
    return ""
  return "\n".join(closing.lines(plan, next_stage(), time.monotonic() - STARTED))


def next_stage() -> NextStage | None:
  """The stage after this launch's (olmo3.train.closing.NextStage), when the experiment's module
  defines it (its NEXT_STAGE entry, else stage<n+1>), else None: what a launch's closing
  summary, and a dry run's, name."""
  from olmo3.train import closing

  module, function = refs.split_ref(FLAGS.value)
  found = refs.import_module(module, f"--fdl_config={FLAGS.value!r}")
  # A module names the stages that do not follow as stage<n+1> (NEXT_STAGE: stage3 -> sft)
  following = (getattr(found, "NEXT_STAGE", {}).get(function)
               or closing.following_function(function))
  if following is None or following not in refs.module_functions(found, refs.Kind.EXPERIMENT):
    return None
  return closing.NextStage(module, function, following,
                           refs.load(f"{module}:{following}").checkpoint.init_from,
                           preflight.experiment(FLAGS.value, [], FIDDLERS.value)[1].data)


def leave(plan, run_record, created: bool, lease, trained: bool, failed: bool) -> None:
  """The launch's way out of its workdir (process 0; the others wrote nothing of their own):
  a launch that trained nothing takes back what it wrote, the workdir as it was found, while
  it still holds the lease; then the lease is released, on every way out. After a failure
  (`failed`) the taking back tries each remote operation once (the store may be down: the
  cleanup is never in the way of the error), the release as the caller's
  `retry.cleanup_after` says."""
  from olmo3.io import retry

  if jax.process_index() != 0:
    return
  try:
    if not trained:
      with retry.attempts_once() if failed else contextlib.nullcontext():
        take_back(plan, run_record, lease)
  finally:
    lease.release()  # never raises
  if created and not trained and not pathnames.is_url(plan.workdir.root):
    # The directory it made, if nothing is left in it (another launch's lease, taken since
    # this one released its own, keeps it: rmdir removes only an empty directory).
    with contextlib.suppress(OSError):
      os.rmdir(plan.workdir.root)


def take_back(plan, run_record, lease) -> None:
  """What this launch wrote, on a run that trained nothing (`RunRecord.undo`): only while it
  can prove it still holds the lease it took before writing anything, so no other launch has
  written there since. A launch that cannot (its lease taken over, or unreadable) leaves the
  workdir as it is: removing entries then could remove another launch's run."""
  if not lease.still_held():
    logging.warning("not taking back what this launch wrote in %s: it cannot prove it still "
                    "holds the workdir lease %s, so another launch may have written there since",
                    plan.workdir.root, lease.url)
    return
  try:
    run_record.undo()
  except OSError as e:  # never in the way of the reason the run stopped
    logging.warning("could not take back what this launch wrote in %s: %s", plan.workdir.root, e)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    preflight.config_error(f"unexpected arguments: {argv[1:]} (every option is a --flag)")
  # Libraries' INFO lines off (absl's -v 1 brings them back); no TPU probing on a CPU machine.
  logs.configure(logging.get_verbosity())
  refs.make_cwd_importable()
  if not FLAGS.value:
    preflight.config_error("--fdl_config is required, e.g. experiments.olmo3_tiny:stage1")
  cfg, exp = preflight.experiment(FLAGS.value, SETS.value, FIDDLERS.value)
  flags_lib.apply_to_environ(exp.xla_flags, exp.libtpu_flags, exp.env)
  workdir = WORKDIR.value or refs.default_workdir(FLAGS.value)
  if DRY_RUN.value or COMPILE_ONLY.value:
    if PREEMPTION is not None:
      PREEMPTION.restore()  # nothing to save: Ctrl-C stops these at once
    if not DRY_RUN.value:
      return preflight.compile_only(exp, COMPILE_ONLY.value)
    topology = COMPILE_ONLY.value if COMPILE_ONLY.value not in (None, "local") else None
    return preflight.dry_run(cfg, exp, workdir, FLAGS.value, next_stage(), topology,
                             CACHE.value)
  # Everything a launch can find wrong is found before anything is written: a launch that stops
  # early leaves no workdir, record, lease or event file behind.
  preflight.check_workdir(workdir)
  revision = preflight.new_revision(workdir, cfg, FORCE.value)
  plan = preflight.build_plan(exp, workdir, FLAGS.value)
  start_jax()
  with leaving_at_once_on_failure():
    train_the_plan(plan, revision, workdir, exp)


def train_the_plan(plan, revision: dict[str, str] | None, workdir: str, exp) -> None:
  """The launch once JAX has started: a complete run reports itself; otherwise the launch is
  recorded and trained."""
  from olmo3.run.plan import Start
  from olmo3.placement import ShardedModel
  from olmo3.train import closing
  from olmo3.train.state import confirm_complete

  if plan.resume.start is Start.COMPLETE:  # verified as the trainer would restore it
    plan = confirm_complete(plan, ShardedModel.for_experiment(plan.exp))
  if plan.resume.start is Start.COMPLETE:
    if jax.process_index() == 0:
      print("\n".join(closing.lines(plan, next_stage())))
    print(f"{workdir}: the run is complete at step {plan.resume.step} (train.steps="
          f"{exp.train.steps}); nothing to train, nothing written")
    return
  if plan.stage_change:
    logging.warning("%s", plan.stage_change)
  created = not epath.Path(workdir).exists()
  last_line = run(plan, revision, created)
  if last_line and jax.process_index() == 0:
    print(last_line)


def _one_line_errors() -> tuple[type[BaseException], ...]:
  """What a launch reports in one line wherever it happens (before train(): the workdir,
  storage and lease checks; `run` reports train()'s own, having taken back what it wrote)."""
  from olmo3.data.tokens import DataError
  from olmo3.eval.tasks import TaskError
  from olmo3.io.checkpoint import CheckpointError
  from olmo3.io.metrics import MetricsError
  from olmo3.run.lease import LeaseHeld, LeaseLost

  return (ConfigError, DataError, TaskError, CheckpointError, MetricsError, record.RecordError,
          LeaseHeld, LeaseLost, TrainingStopped, peers.PeerLost, OSError)  # OSError: storage


if __name__ == "__main__":
  app.run(program.reported(main, _one_line_errors, logging.get_verbosity),
          flags_parser=lambda argv: refs.parse_flags(argv, "launch/main.py"))
