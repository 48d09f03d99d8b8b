"""The price of a restart of the 7B stage 1 on tpu7x:4x8x8 after a lost host, phase by phase
(benchmarks/restart_7b.py measures what this machine can), and the goodput of the whole run by
checkpoint cadence. What needs the pod is assumed and named in the result (`assumed`)."""

from __future__ import annotations

import datetime
import math
import os
import platform

HOSTS = 64  # tpu7x:4x8x8: 256 chips, 4 a host, 2 devices a chip
DEVICES_PER_HOST = 8
STEPS = 1_413_814  # stage 1 (experiments/olmo3_7b.py)
MFU = 0.445  # the public TPU reproduction's stage-1 MFU with the tpu7x flag set
MIX_FILES = 1_016  # OLMo-mix-0625-official's token files
# Assumptions for what needs the pod (seconds); each is named in the output.
ASSUMED = {
    "replacement_s": (120.0, "JobSet deletes and recreates the 64 pods on a spare or repaired "
                             "host and the cached image starts (not measurable here)"),
    "compile_cache_load_s": (10.0, "the 7B's TPU executable read from the persistent "
                                   "compilation cache and loaded (tens of MB; not measurable "
                                   "here)"),
    "restart_in_place_s": (15.0, "a restart in place (a crashed process, its host kept): the "
                                 "job's containers started again where they ran, no pod "
                                 "rescheduled (not measurable here)"),
}


def step_seconds() -> tuple[float, float]:
  """(seconds per step, TFLOP per step) of the 7B stage 1 on tpu7x:4x8x8 at MFU."""
  import fiddle as fdl

  from launch import refs
  from olmo3 import flops

  exp = fdl.build(refs.resolve("experiments.olmo3_7b:stage1"))
  per_step = exp.model.flops_per_token(exp.data.seq_len) * exp.tokens_per_step
  peak = flops.peak_flops_per_device("TPU7x")
  return per_step / (HOSTS * DEVICES_PER_HOST * peak * MFU), per_step / 1e12


def goodput(cadence: int, step_s: float, save_s: float, restart_s: float,
            mtbf_s: float) -> float:
  """The share of wall time that trains, for checkpoints every `cadence` steps each stalling
  the loop `save_s`, and failures every `mtbf_s` each costing `restart_s` plus the work since
  the last checkpoint (half an interval on average)."""
  interval = cadence * step_s + save_s  # wall time between checkpoints
  per_failure = restart_s + interval / 2
  useful_per_interval = cadence * step_s
  # Over one mean time between failures: intervals that train, then one failure's loss.
  return max(0.0, 1 - per_failure / mtbf_s) * useful_per_interval / interval


def markdown(result: dict) -> str:
  lines = ["| phase of a restart after a lost host | seconds |", "|---|---|"]
  lines += [f"| {name} | {seconds:,.1f} |" for name, seconds in result["restart_phases_s"].items()]
  lines += [f"| **restart, in all** | **{result['restart_s']:,.0f}** |",
            f"| (a launch that knows no attempt waits out the takeover age: "
            f"{result['restart_s_without_attempt']:,.0f}) | |", "",
            f"| checkpoint every (steps) | steps lost on average | goodput, a failure every "
            f"{result['mtbf_s'] / 3600:.0f} h | no attempt known, the lease's wait by the store's clock "
            f"(restart {result['restart_s_lease_by_store_clock']:,.0f} s) |", "|---|---|---|---|"]
  other = result["goodput_by_cadence_lease_by_store_clock"]
  for cadence, share in result["goodput_by_cadence"].items():
    best = " (Young's interval)" if int(cadence) == result["best_cadence_steps"] else ""
    lines.append(f"| {int(cadence):,}{best} | {int(cadence) / 2:,.0f} | {share:.2%} | "
                 f"{other[cadence]:.2%} |")
  lines += ["", "| phase of a restart in place (a crashed process) | seconds |", "|---|---|"]
  lines += [f"| {name} | {seconds:,.1f} |"
            for name, seconds in result["restart_in_place_phases_s"].items()]
  lines += [f"| **restart in place, in all** | **{result['restart_in_place_s']:,.0f}** |", "",
            "| checkpoint every (steps) | goodput, a crash every "
            f"{result['mtbf_s'] / 3600:.0f} h, restarted in place |", "|---|---|"]
  lines += [f"| {int(c):,} | {share:.2%} |"
            for c, share in result["goodput_in_place_by_cadence"].items()]
  return "\n".join(lines)


def price(measured: dict, startup: dict, preemptions_per_day: float) -> dict:
  from olmo3.run import lease

  step_s, tflop = step_seconds()
  gcs = measured["checkpoint_gcs"]
  state_gb = gcs["gb"] * HOSTS
  def phases_of(detection: tuple[str, float], restarted: tuple[str, float],
                first_batch: tuple[str, float]) -> dict[str, float]:
    """A restart's phases: those a kind of restart changes given, the rest shared."""
    return dict([
        detection, restarted,
        ("process start and imports", measured["imports"]["imports_s"]),
        (f"the plan: {MIX_FILES:,} remote sizes looked up", measured["plan"]["sizes_s"]),
        ("the workdir's lease: the JobSet's next restart attempt takes the lost attempt's over "
         "at once (measured against the bucket)", measured["lease"]["takeover_s"]),
        ("tracing and lowering the train step",
         measured.get("lower", {}).get("trace_and_lower_s", float("nan"))),
        ("the compiled program from the persistent cache (assumed)",
         ASSUMED["compile_cache_load_s"][0]),
        (f"restore: {gcs['gb']:.2f} GB a host read from the bucket and resharded",
         gcs["restore_s"] - gcs["checksums_s"]),
        ("the restore's verification (checksums; on the TPU at HBM speed, here "
         f"{gcs['checksums_s']:.1f} s on the CPU)", 0.0),
        first_batch])

  # The host that replaced the lost one starts with an empty cache: it reads the block of the
  # epoch's order its first step needs from the copy kept beside the run in the bucket (it
  # computed the whole order before: startup's first_batch_cold_s), and every host waits for
  # it at the first step.
  phases = phases_of(
      ("detection: a lost host's peers stop within the heartbeat timeout the rendered jobs set "
       "(measured: the longer of a frozen worker and a frozen coordinator)",
       max(measured["detection_SIGSTOP_worker"]["detect_s"],
           measured["detection_SIGSTOP_coordinator"]["detect_s"])),
      ("replacement (assumed)", ASSUMED["replacement_s"][0]),
      ("the first batch: the new host reads its block of the order kept beside the run "
       "(startup_7b.py)", startup["first_batch_new_host_beside_s"]))
  # A restart in place: a process crashed (its sockets closed with it: found at once), the
  # hosts stay, so every host's cache holds the epoch's order (startup's restart at a far
  # step) and nothing is rescheduled.
  in_place = phases_of(
      ("detection: a crashed process's peers stop at once (measured: its sockets close)",
       max(measured["detection_SIGKILL_worker"]["detect_s"],
           measured["detection_SIGKILL_coordinator"]["detect_s"])),
      ("the containers restarted in place (assumed)", ASSUMED["restart_in_place_s"][0]),
      ("the first batch: every host reads its kept order, at step 1,000,000 (startup_7b.py)",
       startup["first_batch_restart_s"]["step_1000000"]))
  restart_s = sum(v for v in phases.values() if not math.isnan(v))
  mtbf = 86_400 / preemptions_per_day
  # The loop's stall per save: what the async save blocks on on a TPU, the copy of the host's
  # share off the devices (its checksums run there at HBM speed), measured by itself.
  save_s = gcs["copy_off_devices_s"]
  cadences = [100, 200, 500, 1000, 2000, 5000, 10_000]
  # Young's interval: sqrt(2 x the save's cost x the time between failures), in steps.
  best = max(1, round(math.sqrt(2 * save_s * mtbf) / step_s))
  table = {c: goodput(c, step_s, save_s, restart_s, mtbf) for c in [*cadences, best]}
  # Where the launch knows no attempt (xpk's JobSets, a pod restarted by hand), it waits for the
  # lease to stay unchanged for the takeover age; were that age counted from the lease's last
  # renewal by one clock (the store's), the time before the restarted process watches would
  # count toward it (not built).
  waiting_s = restart_s - measured["lease"]["takeover_s"] + lease.DEFAULT_TAKEOVER_S
  before_watching = list(phases.values())[:4]
  store_clock_s = waiting_s - min(lease.DEFAULT_TAKEOVER_S, sum(before_watching))
  table_store_clock = {c: goodput(c, step_s, save_s, store_clock_s, mtbf)
                       for c in [*cadences, best]}
  in_place_s = sum(v for v in in_place.values() if not math.isnan(v))
  run_days = STEPS * step_s / 86_400
  return {
      "restart_in_place_phases_s": in_place, "restart_in_place_s": in_place_s,
      "goodput_in_place_by_cadence": {str(c): goodput(c, step_s, save_s, in_place_s, mtbf)
                                      for c in sorted([*cadences, best])},
      "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, "
      f"{os.cpu_count()} cores", "measured": measured, "startup": startup,
      "assumed": {k: {"seconds": v, "why": why} for k, (v, why) in ASSUMED.items()}
      | {"step_s": {"seconds": step_s, "why": f"{tflop:,.0f} TFLOP a step at {MFU:.1%} MFU on "
                    f"{HOSTS * DEVICES_PER_HOST} tpu7x devices"},
         "bucket_parallel": {"why": "every host restores its share at the rate measured here, "
                             "at the same time (a bucket's aggregate bandwidth is far larger)"}},
      "state_gb": state_gb, "restart_phases_s": phases, "restart_s": restart_s,
      "run_days_without_failures": run_days, "mtbf_s": mtbf, "save_blocking_s": save_s,
      "goodput_by_cadence": {str(c): g for c, g in sorted(table.items())},
      "restart_s_without_attempt": waiting_s,
      "restart_s_lease_by_store_clock": store_clock_s,
      "goodput_by_cadence_lease_by_store_clock": {str(c): g for c, g in
                                                  sorted(table_store_clock.items())},
      "best_cadence_steps": best,
  }
