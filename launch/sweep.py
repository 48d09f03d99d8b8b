r"""Generate, compile or run, and rank the variants of a sweep.

  python launch/sweep.py --fdl_config=experiments.olmo3_7b:stage1 \
      --sweep=experiments.olmo3_7b:mfu_sweep --compile_only=tpu7x:4x8x8 --out sweeps/7b
  python launch/sweep.py --fdl_config=experiments.olmo3_tiny:stage1 \
      --sweep=experiments.olmo3_tiny:mfu_sweep --steps 16 --out sweeps/tiny
  python launch/sweep.py --fdl_config=experiments.olmo3_tiny:stage1 \
      --sweep=experiments.olmo3_tiny:head_shape_sweep --steps 100 --rank_by=heldout --out ...
  ... --variant 'model.remat=full,data.global_batch_size=16'    # rerun one variant alone

A sweep is a function returning a list of override dicts ({"model.remat": "full", ...}); each
variant is named after its overrides. Variants run in worker processes, one per flag set, so
each variant's XLA / libtpu flags take effect; a crash costs the variant that caused it alone
(the others are rerun); --jobs N runs N workers at a time. With --compile_only each variant's
train step is compiled for the target (memory, fits, compiled FLOPs, collective bytes per token
and the step-time bound with the MFU ceiling it implies: olmo3.train.aot.StepBound); with
--steps each trains N steps in a scratch workdir and is timed in steady state: the N steps form
--repeats + 1 windows of N // (repeats + 1) steps (at least 2); the first, which holds the compile, is not
timed, and each of the others is one timed repeat. tokens/s, TFLOP/s per device and MFU (when
the device's peak is known) are the repeats' median, with their min and max beside them
(`<metric>_min`, `<metric>_max`). With --rank_by=heldout each also evaluates its held-out sets
after its N steps (heldout_ce: the mean CE over the sets). Writes OUT/results.csv, OUT/results.md
(ranked: what fits, by median MFU, else median tokens/s, else the MFU ceiling of a compiled
variant's step-time bound, else memory; or by held-out CE) and OUT/results.png (the ranking
metric, the repeats' range as error bars), rewritten after each
variant, and prints "[k of N]" as variants finish. A misspelt override path stops the sweep
before any variant runs. Ctrl-C (SIGINT) or SIGTERM stops the sweep at once: the running
workers are killed, the variants they had not finished are left out of the tables (so --resume
runs them again), and the sweep exits 130 (SIGINT) or 143 (SIGTERM) naming the command that
continues it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

import fiddle as fdl
from absl import app, flags

from launch import refs
from launch.rankings import describe, ranking, read_rows, write_results
from olmo3.data import sources
from olmo3 import program, xla_flags as flags_lib

CONFIG = flags.DEFINE_string(
    "fdl_config", None, "experiment reference: package.module:function", required=True)
SWEEP = flags.DEFINE_string(
    "sweep", None, "sweep reference: package.module:function returning a list of override dicts",
    required=True)
SETS = flags.DEFINE_multi_string("fdl_set", [], "override for every variant: path=value "
                                 "(a Python literal)")
COMPILE_ONLY = flags.DEFINE_string("compile_only", None,
                                   "'local' or a TPU topology kind:AxBxC")
STEPS = flags.DEFINE_integer("steps", None, "train each variant this many steps (timed: the "
                             "--repeats windows after the first, which holds the compile)",
                             lower_bound=1)
REPEATS = flags.DEFINE_integer(
    "repeats", 3, "with --steps: timed windows per variant (after an untimed first one); the "
    "table reports their median, min and max", lower_bound=3)
flags.mark_flags_as_mutual_exclusive(["compile_only", "steps"], required=True)
RANK_BY = flags.DEFINE_enum(
    "rank_by", "mfu", ["mfu", "heldout"],
    "mfu: by MFU, else tokens/s, else memory (smallest first); heldout: with --steps, each "
    "variant evaluates its held-out sets (eval.heldout) after its last step, lowest CE first")
OUT = flags.DEFINE_string("out", None, "directory for results.csv, results.md, results.png",
                          required=True)
VARIANT = flags.DEFINE_string("variant", None, "run only the variant of this name")
JOBS = flags.DEFINE_integer("jobs", 1, "variants at a time (compile-only sweeps of a big model on "
                            "a many-core machine; keep 1 when timing with --steps)", lower_bound=1)
RESUME = flags.DEFINE_bool("resume", False,
                           "keep the variants OUT/results.csv already has; run the others")
# Set by the sweep for its own worker processes; kept out of --help (--helpfull lists them).
_WORKER = flags.DEFINE_string("_worker", None, "variant indices this worker runs",
                              module_name="launch.sweep.worker")
_RESULTS = flags.DEFINE_string("_results", None, "the worker's JSON-lines results file",
                               module_name="launch.sweep.worker")


@dataclasses.dataclass(frozen=True)
class Sweep:
  """What the flags ask for; workers get it back as flags."""
  fdl_config: str
  sweep: str
  fdl_set: tuple[str, ...]
  compile_only: str | None
  steps: int | None
  out: str
  jobs: int = 1
  rank_by: str = "mfu"
  repeats: int = 3


TIMED = ("tokens_per_s", "tflops_per_device", "mfu", "step_time_s")  # median, min, max each
MIN_WINDOW = 2  # steps per timed repeat: one step's time alone is mostly its dispatch jitter


def window(steps: int, repeats: int) -> int:
  """Steps per timed repeat: --steps split into an untimed first window and `repeats` timed."""
  return steps // (repeats + 1)


def apply(cfg: fdl.Config, overrides: dict[str, Any]) -> fdl.Config:
  """A variant's overrides, each checked (a bad path raises ConfigRefError naming it)."""
  for path, value in overrides.items():
    refs.set_field(cfg, path, value, f"sweep override {path!r}")
  return cfg


def variant_config(sweep: Sweep, overrides: dict[str, Any]) -> fdl.Config:
  return apply(refs.resolve(sweep.fdl_config, sweep.fdl_set), overrides)


def run_variant(exp, compile_only: str | None, steps: int | None,
                heldout: bool = False, repeats: int = 3) -> dict[str, Any]:
  if compile_only:
    from olmo3.train import aot

    try:
      r = aot.compile_train_step(exp, None if compile_only == "local" else compile_only)
    except aot.DoesNotFit as e:
      return {"fits": False, "error": str(e)[:200]}
    bound = {} if r.bound is None else {
        "step_bound_s": round(r.bound.bound_s, 4), "mfu_ceiling": round(r.bound.mfu_ceiling, 4),
        "serial_s": round(r.bound.serial_s, 4),
        "bound_by": r.bound.limit}
    return {"fits": r.fits if r.fits is not None else True, "memory_gb": round(r.total_gb, 3),
            "temp_gb": round(r.temp_gb, 3), "compiled_tflops": r.compiled_tflops_per_step,
            "analytic_tflops": r.analytic_tflops_per_step, "compile_s": round(r.compile_s, 1),
            "collective_mb_per_token": round(r.collective_mb_per_token, 3), **bound}
  from olmo3.io import metrics as metrics_lib
  from olmo3.run.plan import RunPlan
  from olmo3.train.loop import train

  # The loop logs a row every `k` steps, each timing the steps since the previous row (the
  # loop's own clock): the rows at 2k .. (repeats + 1)k are the timed repeats; the first holds
  # the compile. `heldout`: the loop evaluates once, after the last step (after that step's
  # row), the held-out sets only: held-out loss ranks, and the tasks would add minutes.
  k = window(steps, repeats)
  exp = dataclasses.replace(
      exp, train=dataclasses.replace(exp.train, steps=steps, log_every=k,
                                     eval_every=steps if heldout else 0),
      eval=dataclasses.replace(exp.eval, tasks=()),
      checkpoint=dataclasses.replace(exp.checkpoint, every=10**9, init_from=None))
  with tempfile.TemporaryDirectory() as workdir:
    last = train(RunPlan.build(exp, workdir))
    rows = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  row = {"fits": True, **steady_state(rows, k, repeats), "repeats": repeats,
         "steps_per_repeat": k, "loss": last.get("loss")}
  return {**row, **heldout_columns(last)} if heldout else row


def steady_state(rows: list[dict[str, float]], k: int, repeats: int) -> dict[str, float]:
  """From a run's metrics rows (one every k steps, each timing the steps since the previous):
  the `repeats` windows after the first (which holds the compile), and for each timed metric
  their median (the column ranked by) and their min and max (the spread: a shared or throttled
  machine shows here). A trailing partial window is not a repeat."""
  timed = [r for r in rows if "tokens_per_s" in r and r["step"] % k == 0
           and k < r["step"] <= (repeats + 1) * k]
  if len(timed) != repeats:
    raise RuntimeError(f"{len(timed)} timed windows of {k} steps logged, expected {repeats} "
                       f"(rows at steps {[r['step'] for r in rows if 'tokens_per_s' in r]})")
  out: dict[str, float] = {}
  for key in TIMED:
    values = [r[key] for r in timed if r.get(key) is not None]
    if values:
      out.update({key: statistics.median(values), f"{key}_min": min(values),
                  f"{key}_max": max(values)})
  return out


def heldout_columns(metrics: dict[str, float]) -> dict[str, float]:
  """heldout_ce (the mean CE over the held-out sets) from the loop's eval/<set>/ce_loss, and
  heldout_ce/<set> for each set when there are several."""
  ce = {k[len("eval/"):-len("/ce_loss")]: v for k, v in metrics.items()
        if k.startswith("eval/") and k.endswith("/ce_loss")}
  if not ce:
    raise ValueError("no held-out loss was logged (eval.heldout names no set)")
  return {"heldout_ce": sum(ce.values()) / len(ce),
          **({f"heldout_ce/{name}": v for name, v in ce.items()} if len(ce) > 1 else {})}


def _flag_key(exp) -> tuple:
  return exp.xla_flags, exp.libtpu_flags, exp.env


class Stop:
  """A sweep asked to stop (SIGINT, SIGTERM): `handle` (the parent's signal handler) kills the
  running workers' process groups at once and no worker starts after it. Workers run in
  sessions of their own, so a terminal's Ctrl-C reaches the parent alone: a worker that saw it
  would stop its training early and report the cut-short variant as a result."""

  def __init__(self):
    self.signal: int | None = None
    self._lock = threading.RLock()  # a second signal may come while the first is handled
    self._running: set[subprocess.Popen] = set()

  def handle(self, signum: int, frame=None) -> None:
    del frame
    with self._lock:
      self.signal = self.signal or signum
      running = list(self._running)
    for proc in running:
      _kill_group(proc)

  def start(self, cmd: list[str], **kwargs) -> subprocess.Popen | None:
    """`cmd` as a worker in a session (process group) of its own; None once stopping."""
    with self._lock:
      if self.signal is not None:
        return None
      proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
      self._running.add(proc)
      return proc

  def finished(self, proc: subprocess.Popen) -> None:
    with self._lock:
      self._running.discard(proc)


def _kill_group(proc: subprocess.Popen) -> None:
  """The worker and whatever it started (its session's process group), without waiting."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):  # already gone (and perhaps reaped)
    pass


class Interrupted(Exception):
  """The sweep stopped on a signal; `unfinished` names the variants it recorded nothing for."""

  def __init__(self, signum: int, unfinished: list[str]):
    super().__init__(signum, unfinished)
    self.signum, self.unfinished = signum, unfinished


def _run_worker(sweep: Sweep, indices: list[int], on_result, stop: Stop) -> None:
  """Runs variants `indices` (one flag set) in a fresh process: flags only take effect before
  JAX starts. Results stream back one JSON line per variant; `on_result(index, result)` gets
  each. If the process dies (a compiler abort, out of host memory), the variants it did not
  finish are rerun one process each, so a crash costs the variant that caused it alone; if the
  sweep was stopped (`stop`), they are left unrecorded."""
  with tempfile.TemporaryDirectory() as scratch:
    results = os.path.join(scratch, "results.jsonl")
    mode = (["--compile_only", sweep.compile_only] if sweep.compile_only
            else ["--steps", str(sweep.steps), "--repeats", str(sweep.repeats)])
    cmd = [sys.executable, os.path.abspath(__file__), "--fdl_config", sweep.fdl_config,
           "--sweep", sweep.sweep, *(f"--fdl_set={s}" for s in sweep.fdl_set), *mode,
           "--rank_by", sweep.rank_by,
           "--out", scratch, "--_worker", ",".join(map(str, indices)), "--_results", results]
    # The worker's temporary files (its variants' scratch workdirs) go under `scratch`, which
    # this process removes even when the worker was killed before it could.
    env = dict(os.environ, TMPDIR=scratch)
    with open(os.path.join(scratch, "log"), "w+") as log:
      proc = stop.start(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
      if proc is None:
        return
      seen = 0
      try:
        while True:
          finished = proc.poll() is not None
          lines = []
          if os.path.exists(results):
            with open(results) as f:
              lines = f.read().split("\n")[:-1]  # whole lines: the last may be half written
          for line in lines[seen:]:
            row = json.loads(line)
            on_result(row["index"], row["result"])
          seen = len(lines)
          if finished:
            break
          time.sleep(0.5)
      finally:
        stop.finished(proc)
      log.seek(0)
      tail = [line for line in log.read().strip().splitlines() if line.strip()]
    missing = indices[seen:]
  if not missing or stop.signal is not None:
    return
  if sweep.jobs == 1:
    print("\n".join(tail[-20:]), flush=True)
  if len(missing) > 1:
    for index in missing:
      _run_worker(sweep, [index], on_result, stop)
    return
  on_result(missing[0], {"fits": False, "error": f"variant process exited {proc.returncode}: "
                                                 f"{(tail or ['no output'])[-1][:200]}"})


def _build(sweep: Sweep, overrides: dict[str, Any]):
  """The variant's experiment; a bad override or an invalid config raises ConfigRefError."""
  try:
    return fdl.build(variant_config(sweep, overrides))
  except (ValueError, TypeError) as e:  # ConfigRefError included; Experiment's own checks
    raise refs.ConfigRefError(f"variant {refs.variant_name(overrides)}: {e}") from None


def _worker(sweep: Sweep, indices: list[int], results: str) -> None:
  variants = refs.load_sweep(sweep.sweep)
  for n, index in enumerate(indices):
    exp = _build(sweep, variants[index])
    if n == 0:  # the caller groups variants by flag set
      flags_lib.apply_to_environ(*_flag_key(exp))  # before JAX starts
    print(f"--- {refs.variant_name(variants[index])}", flush=True)
    try:
      result = run_variant(exp, sweep.compile_only, sweep.steps, sweep.rank_by == "heldout",
                           sweep.repeats)
    except Exception as e:  # reported in the table; the sweep goes on
      traceback.print_exc()
      result = {"fits": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    with open(results, "a") as f:
      f.write(json.dumps({"index": index, "result": result}) + "\n")


def run_sweep(sweep: Sweep, variant: str | None = None, resume: bool = False,
              stop: Stop | None = None) -> list[dict]:
  """Runs the sweep's variants (or the one named `variant`) and writes the tables. Raises
  Interrupted when `stop` was signalled (what finished before is in the tables)."""
  stop = stop or Stop()
  if sweep.rank_by == "heldout" and not sweep.steps:
    raise refs.ConfigRefError("--rank_by=heldout needs --steps: held-out loss is measured "
                                 "after training")
  if sweep.steps and window(sweep.steps, sweep.repeats) < MIN_WINDOW:
    raise refs.ConfigRefError(
        f"--steps={sweep.steps} with --repeats={sweep.repeats}: needs at least "
        f"{MIN_WINDOW * (sweep.repeats + 1)} steps (an untimed first window, which holds the "
        f"compile, then {sweep.repeats} timed windows, each of at least {MIN_WINDOW} steps)")
  variants = list(enumerate(refs.load_sweep(sweep.sweep)))
  if variant:
    variants = [(i, v) for i, v in variants if refs.variant_name(v) == variant]
    if not variants:
      raise refs.ConfigRefError(f"--variant={variant!r}: {sweep.sweep} has no variant of "
                                   "that name")

  # Variants that share a flag set share a worker process (--jobs splits them further). The
  # tables are rewritten after every variant: an interrupted sweep keeps what it measured, and
  # --resume picks it up.
  done = read_rows(sweep.out) if resume else {}
  names = {i: refs.variant_name(v) for i, v in variants}
  groups: dict[tuple, list[int]] = {}
  for i, overrides in variants:
    if names[i] not in done:
      exp = _build(sweep, overrides)
      # eval.heldout None follows the training data (a prepared directory's held-out split)
      if sweep.rank_by == "heldout" and not sources.resolve(exp).exp.eval.heldout:
        raise refs.ConfigRefError(f"variant {names[i]}: --rank_by=heldout needs held-out "
                                     "sets (eval.heldout is empty)")
      groups.setdefault(_flag_key(exp), []).append(i)
  units = [g[j::sweep.jobs] for g in groups.values() for j in range(min(sweep.jobs, len(g)))]
  lock = threading.Lock()
  total = len(names)
  kept = sum(name in done for name in names.values())
  print(f"{total} variants" + (f" ({kept} kept from {sweep.out}/results.csv)" if kept else "")
        + f": running {total - kept} in {len(units)} worker processes", flush=True)

  def on_result(index: int, result: dict[str, Any]) -> None:
    row = {"variant": names[index], **result}
    with lock:
      done[names[index]] = row
      finished = sum(name in done for name in names.values())
      print(f"[{finished} of {total}] {names[index]}: {describe(result)}", flush=True)
      write_results(sweep.out, list(done.values()), sweep.rank_by)

  with concurrent.futures.ThreadPoolExecutor(sweep.jobs) as pool:
    list(pool.map(lambda unit: _run_worker(sweep, unit, on_result, stop), units))
  rows = list(done.values())
  if stop.signal is not None:
    raise Interrupted(stop.signal, [name for name in names.values() if name not in done])
  write_results(sweep.out, rows, sweep.rank_by)
  return rows


def main(argv: list[str]) -> None:
  program.begin()
  if len(argv) > 1:
    refs.usage_error(f"unexpected arguments: {argv[1:]}", "launch/sweep.py")
  refs.make_cwd_importable()
  sweep = Sweep(CONFIG.value, SWEEP.value, tuple(SETS.value), COMPILE_ONLY.value, STEPS.value,
                OUT.value, JOBS.value, RANK_BY.value, REPEATS.value)
  if _WORKER.value is not None:
    try:
      _worker(sweep, [int(i) for i in _WORKER.value.split(",")], _RESULTS.value)
    except refs.ConfigRefError as e:
      refs.usage_error(str(e), "launch/sweep.py")
    return
  stop = Stop()
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, stop.handle)
  try:
    rows = run_sweep(sweep, VARIANT.value, RESUME.value, stop)
  except refs.ConfigRefError as e:
    refs.usage_error(str(e), "launch/sweep.py")
  except Interrupted as e:
    command = ["python", *sys.argv] + ([] if RESUME.value else ["--resume"])
    print(f"interrupted ({signal.Signals(e.signum).name}): {len(e.unfinished)} variant"
          f"{'s' * (len(e.unfinished) != 1)} not finished, nothing recorded for them; "
          f"continue with: {shlex.join(command)}", flush=True)
    sys.exit(128 + e.signum)
  print("\n".join(ranking(rows, sweep.rank_by)))
  print(f"wrote {sweep.out}/results.csv, results.md, results.png ({len(rows)} variants)")


if __name__ == "__main__":
  app.run(main)
