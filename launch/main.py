"""Train an experiment.

  python launch/main.py --fdl_config=experiments.olmo3_tiny:stage1
  python launch/main.py --fdl_config=experiments.olmo3_7b:stage2 --dry_run
  python launch/main.py --fdl_config=experiments.olmo3_7b:stage1 --fdl_set=train.steps=10 \
      --fiddler=single_cosine --workdir=/tmp/run

The workdir (default runs/<module>.<function>) receives config.json (loads back with
launch/diff.py or launch.configs.from_workdir), config.txt, command.txt, experiment.json,
history.jsonl, metrics.jsonl, TensorBoard events and checkpoints; rerunning the same command
resumes from the latest checkpoint, and a resume with a changed config adds revision n
(config.<n>.json, experiment.<n>.json) without rewriting earlier ones. A rerun with nothing to
train writes nothing; a mistake is one line, found before anything is written. The
experiment's flag set is applied to XLA_FLAGS / LIBTPU_INIT_ARGS before JAX starts, and a job
that spans several processes (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or
SLURM / TPU pod environments) joins with jax.distributed.initialize().
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing

from olmo3.train.preemption import Preemption

# Installed before the heavy imports below: a SIGTERM / SIGINT while the run starts stops it
# cleanly (exit 0) at its first step boundary instead of killing it.
PREEMPTION = Preemption() if __name__ == "__main__" else None

import fiddle as fdl  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from etils import epath  # noqa: E402
from fiddle import printing  # noqa: E402

from launch import configs  # noqa: E402
from olmo3.config import Schedule  # noqa: E402
from olmo3.perf import flags as flags_lib  # noqa: E402
from olmo3.train import logs  # noqa: E402

FLAGS = flags.DEFINE_string(
    "fdl_config", None, "experiment reference: package.module:function (or the dotted form)")
SETS = flags.DEFINE_multi_string("fdl_set", [], "override: path=value (a Python literal)")
FIDDLERS = flags.DEFINE_multi_string("fiddler", [], "fiddler: name or name(key=value, ...)")
WORKDIR = flags.DEFINE_string("workdir", None, "run directory (default runs/<module>.<fn>)")
DRY_RUN = flags.DEFINE_bool("dry_run", False, "print the config and its numbers; allocate nothing")
COMPILE_ONLY = flags.DEFINE_string(
    "compile_only", None, "compile the train step and report memory and FLOPs: 'local' for this "
    "machine's devices, or a TPU topology kind:AxBxC (e.g. tpu7x:4x8x8; needs the tpu extra)")
FORCE = flags.DEFINE_bool("force_workdir", False,
                          "use a workdir that holds a run of a different config")
CACHE = flags.DEFINE_string(
    "compilation_cache", os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                        os.path.join("~", ".cache", "olmo3", "jax")),
    "persistent XLA compilation cache (a restarted or resumed run skips recompiling; a shared "
    "path such as gs://... serves every host); '' turns it off")


def default_workdir(ref: str) -> str:
  """runs/<module>.<function>: experiments.olmo3_tiny:stage1 -> runs/olmo3_tiny.stage1."""
  module, name = configs.split_ref(ref)
  return os.path.join("runs", f"{module.rsplit('.', 1)[-1]}.{name}")


def maybe_initialize_distributed() -> None:
  import jax

  env = os.environ
  if "JAX_COORDINATOR_ADDRESS" in env:
    jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                               num_processes=int(env["JAX_NUM_PROCESSES"]),
                               process_id=int(env["JAX_PROCESS_ID"]))
  elif int(env.get("SLURM_NTASKS", "1")) > 1 or "," in env.get("TPU_WORKER_HOSTNAMES", ""):
    jax.distributed.initialize()  # cluster auto-detection (SLURM, multi-host TPU)


def dry_run(cfg: fdl.Config, exp) -> None:
  print(printing.as_str_flattened(cfg))
  m, d, o = exp.model, exp.data, exp.optimizer
  print()
  print(f"parameters          {m.param_count:,}")
  print(f"FLOPs per token     {m.flops_per_token(d.seq_len) / 1e9:.3f} G (training, exact causal "
        "+ sliding-window count)")
  print(f"tokens per step     {d.global_batch_size} x {d.seq_len} = {exp.tokens_per_step:,}")
  over = (f"stitched: part 1 aimed at {o.stitch_first_steps:,}, part 2 from update "
          f"{o.stitch_resumed_at + 1:,} aimed at {o.stitch_second_steps:,}"
          if o.schedule is Schedule.STITCHED_COSINE else f"schedule over {o.decay_steps:,}")
  print(f"steps               {exp.train.steps:,} ({over})")
  print(f"peak LR             {o.peak_lr!r} ({o.schedule.value}, warmup {o.warmup_steps})")
  from olmo3.data import pipeline, sources

  exp, resolved = sources.resolved_view(exp)  # held-out sets and tokenizer as the run takes them
  print("\n".join(resolved))
  try:  # the epoch, when the configured files are reachable from here
    source = sources.token_files(dataclasses.replace(d, validate_tokens=False), None)
    per_epoch = pipeline.steps_per_epoch(d, source)
    stop = exp.train.stop_at_epoch
    end = f"; the stage ends at step {min(exp.train.steps, stop * per_epoch):,}" if stop else ""
    print(f"epoch               {len(source):,} instances = {per_epoch:,} steps{end}")
  except ValueError as e:  # DataError: files missing here (e.g. AI2's data on a laptop)
    print(f"epoch               unknown: the data files are not reachable here ({e})")
  ev = exp.eval
  cadence = (f"every {exp.train.eval_every:,} steps" if exp.train.eval_every
             else "never (train.eval_every=0)")
  root = d.root if ev.heldout_root is None else ev.heldout_root
  for mix in ev.heldout:
    try:
      files = sources.read_mix(mix, root, ev.heldout_tokenizer_id)
      labels = list(dict.fromkeys(f.label for f in files))
      print(f"held-out            {mix}: {len(labels)} sets, {cadence}: {', '.join(labels)}")
    except ValueError as e:
      print(f"held-out            {mix}: unreadable here ({e})")
  if not ev.heldout:
    print("held-out            none (eval.heldout=()): the generalization-gap alarm is off")
  print(f"downstream tasks    {len(ev.tasks)}, {cadence}"
        + (f" ({ev.task_limit} documents each)" if ev.task_limit else "")
        + (": " + ", ".join(ev.tasks) if ev.tasks else ""))
  print(f"mesh                {dict(exp.mesh.shape)} ", end="")
  import jax

  try:
    from olmo3 import sharding

    mesh = sharding.make_mesh(dict(exp.mesh.shape))
    print(f"-> {dict(mesh.shape)} on {jax.device_count()} {jax.default_backend()} devices")
  except ValueError as e:
    print(f"-> does not fit the {jax.device_count()} local devices ({e})")


def config_error(message: str) -> typing.NoReturn:
  """A mistake on the command line: its one line, then where the flags are described (not
  the whole --help, which would bury it)."""
  configs.usage_error(message, "launch/main.py")


def check_workdir(workdir: str) -> None:
  """The workdir is writable where it is (a local path, gs://, s3://) and a directory or can be
  created as one (no file where a directory goes)."""
  from olmo3 import storage

  try:
    storage.check_supported(workdir, writable=True, what="--workdir")
  except ValueError as e:
    sys.exit(f"error: {e}")
  if storage.exists(workdir) and not storage.is_dir(workdir):
    sys.exit(f"error: --workdir={workdir} is a file, not a directory: give a directory (a new "
             "one is created)")
  # On a local disk the nearest existing parent must be a directory (object stores have no
  # directories to be in the way).
  for parent in epath.Path(workdir).absolute().parents if not storage.is_url(workdir) else ():
    if parent.exists():
      if not parent.is_dir():
        sys.exit(f"error: --workdir={workdir}: {parent} is a file, so the directory cannot be "
                 "created there")
      break


def check_data_root(exp) -> None:
  """DataConfig.root, if given, exists and is used: only token files given as `paths` and the
  files of a mix file are relative to it (also held-out mix files while eval.heldout_root is
  None); a prepared directory, the built-in corpus included, names its own files. DataError
  otherwise."""
  from olmo3.data import sources
  from olmo3.data.tokens import DataError

  from olmo3 import storage

  root = exp.data.root
  if not root:
    return
  # An HTTP root is a prefix, not a directory anything can check: its files are checked.
  if storage.scheme(root) not in storage.READ_ONLY_SCHEMES and not storage.exists(root):
    raise DataError(f"DataConfig.root={root!r} does not exist: give the directory (or URL) the "
                    "token files are under")
  mixes = [exp.data.mix] if exp.data.mix else []
  if exp.eval.heldout_root is None:
    mixes += list(exp.eval.heldout or ())
  uses_root = bool(exp.data.paths) or any(sources.prepared(m) is None for m in mixes)
  if not uses_root:
    raise DataError(f"DataConfig.root={root!r} is not used: DataConfig.mix={exp.data.mix!r} is "
                    "a prepared directory (or the built-in corpus), which names its own files. "
                    "Drop data.root, or give data.paths or a mix file relative to it")


def check_init_from(exp, workdir: str) -> None:
  """checkpoint.init_from holds a checkpoint when this run has none of its own to resume:
  typically stage 2 launched before stage 1 has trained."""
  from olmo3.checkpoint import CheckpointError, resolve_step_dir, run_steps

  source = exp.checkpoint.init_from
  if not source or run_steps(epath.Path(workdir) / "checkpoints"):
    return
  try:
    resolve_step_dir(source)
  except CheckpointError:
    module, _, fn = epath.Path(source).name.rpartition(".")
    hint = "train the run that writes it first"
    if module and fn:  # a default workdir, runs/<module>.<function>: name its command
      try:
        configs.load(f"experiments.{module}:{fn}")
        hint = (f"train it first: python launch/main.py "
                f"--fdl_config=experiments.{module}:{fn}")
      except (configs.ConfigRefError, ValueError, TypeError):
        pass
    sys.exit(f"error: CheckpointConfig.init_from={source!r} holds no checkpoint yet: {hint} "
             "(or point checkpoint.init_from at a checkpoint that exists)")


def complete_at(exp, workdir: str, source) -> int | None:
  """The step the run in `workdir` is complete at, or None when there is something to train.
  Decided as the trainer decides (olmo3.train.state.restore_or_init: the newest checkpoint
  that reads back verified, falling back past damaged ones), but only when the newest
  committed step already reaches the stage's end; nothing is written unless a damaged
  checkpoint is quarantined (then there is something to train)."""
  from olmo3.checkpoint import run_steps
  from olmo3.sharded import ShardedModel
  from olmo3.train import state as state_lib
  from olmo3.train.checkpoints import RunCheckpoints
  from olmo3.train.loop import stage_end

  directory = epath.Path(workdir) / "checkpoints"
  steps = run_steps(directory)
  end = stage_end(exp, source)
  if not steps or steps[-1] < end:
    return None
  model = ShardedModel.for_experiment(exp)
  with model.context():
    layout = state_lib.StateLayout(exp, model)
    checkpoints = RunCheckpoints(directory, exp.checkpoint.keep, async_save=False)
    state, _ = state_lib.restore_or_init(layout, checkpoints, source)
  step = int(state.step)
  return step if step >= end else None


def probe_lease(workdir: str) -> None:
  """Refuses (LeaseHeld) a workdir another live run holds, before this launch records
  anything in it; train() then takes the lease for the run."""
  from olmo3.train.lease import Lease

  if (epath.Path(workdir) / "lease.json").exists():
    lease = Lease(workdir)
    lease.acquire()
    lease.release()


def _stop_catching_signals() -> None:
  if PREEMPTION is not None:
    PREEMPTION.restore()


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    config_error(f"unexpected arguments: {argv[1:]} (every option is a --flag)")
  # Libraries' INFO lines off (absl's -v 1 brings them back); no TPU probing on a CPU machine.
  logs.configure(logging.get_verbosity())
  configs.make_cwd_importable()
  if not FLAGS.value:
    config_error("--fdl_config is required, e.g. experiments.olmo3_tiny:stage1")
  try:
    cfg = configs.resolve(FLAGS.value, SETS.value, FIDDLERS.value)
    exp = fdl.build(cfg)
  except (configs.ConfigRefError, ValueError, TypeError) as e:  # a bad config: one line
    config_error(configs.message(e))
  flags_lib.apply_to_environ(exp.xla_flags, exp.libtpu_flags, exp.env)
  if DRY_RUN.value or COMPILE_ONLY.value:
    _stop_catching_signals()  # nothing to save: Ctrl-C stops these at once
  if DRY_RUN.value:
    dry_run(cfg, exp)
    return
  if COMPILE_ONLY.value:
    from olmo3.perf import aot

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
    return
  workdir = WORKDIR.value or default_workdir(FLAGS.value)
  # Everything a launch can find wrong is found before anything is written: a launch that stops
  # early leaves no workdir, record, lease or event file behind.
  check_workdir(workdir)
  record = configs.RunRecord(workdir)
  try:
    previous = record.latest()  # the config of the latest revision recorded here
  except configs.ConfigRefError as e:  # unreadable, or naming code it may not import
    sys.exit(f"error: {e}")
  if previous is not None and not FORCE.value:
    # Only fields marked resumable in olmo3.config may change (a longer run, another slice).
    changed = configs.unresumable_changes(previous, cfg)
    if changed:
      config_error(
          f"{workdir} holds a run of a different config (" + "; ".join(
              f"{c.path}: {c.a!r} -> {c.b!r}" for c in changed[:5])
          + "). Use another --workdir, or --force_workdir to continue it anyway.")
  from olmo3.checkpoint import CheckpointError, run_steps
  from olmo3.data import sources
  from olmo3.data.tokens import DataError
  from olmo3.eval.tasks import TaskError
  from olmo3.metrics import MetricsError
  from olmo3.train.lease import LeaseHeld

  from olmo3 import storage
  from olmo3.train.loop import FILE_SIZES

  check_init_from(exp, workdir)
  # Remote files' sizes: the run's own cache when it has one (a resume does not look thousands
  # of files up again); it is not saved here, before anything is decided: the trainer saves
  # what was looked up once it starts.
  size_cache = storage.SizeCache(storage.join(workdir, FILE_SIZES))
  try:  # the token files exist (their contents are checked when the run starts)
    check_data_root(exp)
    source = sources.token_files(
        dataclasses.replace(exp.data, validate_tokens=False), exp.model.vocab_size,
        size_cache=size_cache)
  except DataError as e:
    sys.exit(f"error: {e}")
  maybe_initialize_distributed()
  import jax

  from olmo3.train.loop import train

  if CACHE.value:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(CACHE.value))

  checkpoints = epath.Path(workdir) / "checkpoints"
  try:
    done = complete_at(exp, workdir, source)
  except (DataError, CheckpointError) as e:  # changed data, a checkpoint that does not fit
    sys.exit(f"error: {e}")
  if done is not None:
    print(f"{workdir}: the run is complete at step {done} (train.steps={exp.train.steps}); "
          "nothing to train, nothing written")
    return
  created, had_checkpoints = not epath.Path(workdir).exists(), checkpoints.exists()
  start = (run_steps(checkpoints) or [0])[-1]
  if jax.process_index() == 0:
    try:
      probe_lease(workdir)
      record.begin(cfg, sources.resolve(exp).to_dict(), sys.argv, start)
    except (LeaseHeld, DataError) as e:
      sys.exit(f"error: {e}")
  logging.info("training %s in %s on %d %s devices", FLAGS.value, workdir, jax.device_count(),
               jax.default_backend())
  try:
    last = train(exp, workdir, name=FLAGS.value, preemption=PREEMPTION, size_cache=size_cache)
  except (DataError, TaskError, CheckpointError, LeaseHeld, MetricsError) as e:  # one line
    logging.error("%s", e)
    if jax.process_index() == 0 and (run_steps(checkpoints) or [0])[-1] == start:
      # Nothing trained: take back what this launch wrote.
      if created:
        epath.Path(workdir).rmtree()
      else:
        record.undo()
        if not had_checkpoints and checkpoints.exists() and not any(checkpoints.iterdir()):
          checkpoints.rmdir()  # made by this launch's checkpoint manager, still empty
    sys.exit(f"error: {e}")
  if jax.process_index() == 0 and last:
    shown = {k: v for k, v in last.items() if not k.startswith("downstream/")}
    tasks = sorted({k.split("/")[1] for k in last if k.startswith("downstream/")})
    print(" ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items()))
          + (f" (+ {len(tasks)} downstream tasks in metrics.jsonl)" if tasks else ""))


if __name__ == "__main__":
  app.run(main)
