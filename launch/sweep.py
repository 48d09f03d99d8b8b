"""Generate, compile or run, and rank the variants of a sweep.

  python launch/sweep.py --fdl_config=experiments.olmo3_7b:stage1 \
      --sweep=experiments.olmo3_7b:mfu_sweep --compile_only=tpu7x:4x8x8 --out sweeps/7b
  python launch/sweep.py --fdl_config=experiments.olmo3_tiny:stage1 \
      --sweep=experiments.olmo3_tiny:mfu_sweep --steps 5 --out sweeps/tiny
  ... --variant 'model.remat=full,data.global_batch_size=16'    # rerun one variant alone

A sweep is a function returning a list of override dicts ({"model.remat": "full", ...}); each
variant is named after its overrides and runs in a process of its own, so its XLA / libtpu flag
set takes effect and a crash costs that variant alone (--jobs N runs N at a time). With
--compile_only each variant's train step is compiled
for the target (memory, fits, compiled FLOPs); with --steps each trains N steps in a scratch
workdir (tokens/s, TFLOP/s per device, MFU when the device's peak is known). Writes
OUT/results.csv, OUT/results.md (ranked: what fits, by MFU or by memory) and OUT/results.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fiddle as fdl  # noqa: E402

from launch import configs  # noqa: E402
from olmo3.perf import flags as flags_lib  # noqa: E402


def variant_name(overrides: dict[str, Any]) -> str:
  def short(v):
    if isinstance(v, (tuple, list)):
      return "on" if v else "off"
    return str(getattr(v, "value", v))

  return ",".join(f"{k}={short(v)}" for k, v in overrides.items())


def load_sweep(ref: str) -> list[dict[str, Any]]:
  module, name = configs.split_ref(ref)
  fn = getattr(configs.import_module(module, f"--sweep={ref!r}"), name, None)
  if not callable(fn):
    raise configs.ConfigRefError(f"--sweep={ref!r}: {module} has no function {name!r}")
  return list(fn())


def apply(cfg: fdl.Config, overrides: dict[str, Any]) -> fdl.Config:
  for path, value in overrides.items():
    *parents, leaf = path.split(".")
    node = cfg
    for p in parents:
      node = getattr(node, p)
    setattr(node, leaf, value)
  return cfg


def run_variant(exp, compile_only: str | None, steps: int | None) -> dict[str, Any]:
  if compile_only:
    from olmo3.perf import aot

    try:
      r = aot.compile_train_step(exp, None if compile_only == "local" else compile_only)
    except aot.DoesNotFit as e:
      return {"fits": False, "error": str(e)[:200]}
    return {"fits": r.fits if r.fits is not None else True, "memory_gb": round(r.total_gb, 3),
            "temp_gb": round(r.temp_gb, 3), "compiled_tflops": r.compiled_tflops_per_step,
            "analytic_tflops": r.analytic_tflops_per_step, "compile_s": round(r.compile_s, 1)}
  from olmo3.train.loop import Trainer

  exp = dataclasses.replace(
      exp, train=dataclasses.replace(exp.train, steps=steps, log_every=steps, eval_every=0),
      checkpoint=dataclasses.replace(exp.checkpoint, every=10**9, init_from=None))
  with tempfile.TemporaryDirectory() as workdir:
    last = Trainer(exp, workdir).run()
  return {"fits": True, "tokens_per_s": last.get("tokens_per_s"),
          "tflops_per_device": last.get("tflops_per_device"), "mfu": last.get("mfu"),
          "loss": last.get("loss")}


def write_results(out: str, rows: list[dict[str, Any]]) -> None:
  os.makedirs(out, exist_ok=True)
  keys = ["variant"] + sorted({k for r in rows for k in r} - {"variant"})
  with open(os.path.join(out, "results.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, keys)
    writer.writeheader()
    writer.writerows(rows)

  def rank(r):  # what fits first; then by MFU (or throughput), else by memory
    score = r.get("mfu") or r.get("tokens_per_s") or -(r.get("memory_gb") or 1e9)
    return (not r.get("fits"), -score if score is not None else 0)

  ranked = sorted(rows, key=rank)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write("| rank | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1) + "\n")
    for i, r in enumerate(ranked, 1):
      f.write(f"| {i} | " + " | ".join(_fmt(r.get(k)) for k in keys) + " |\n")
  _chart(os.path.join(out, "results.png"), ranked)


def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:.4g}"
  return "" if v is None else str(v)


def _chart(path: str, rows: list[dict[str, Any]]) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  metric = next((k for k in ("mfu", "tokens_per_s", "memory_gb") if any(r.get(k) for r in rows)),
                None)
  fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
  names = [r["variant"] for r in rows]
  values = [r.get(metric) or 0 for r in rows]
  colors = ["tab:green" if r.get("fits") else "tab:red" for r in rows]
  ax.barh(range(len(rows)), values, color=colors)
  ax.set_yticks(range(len(rows)), names, fontsize=7)
  ax.invert_yaxis()
  ax.set_xlabel(f"{metric} (green: fits, red: does not)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _variant_in_subprocess(args, index: int, name: str) -> dict[str, Any]:
  """Runs one variant in a fresh process: its XLA / libtpu flags only take effect before JAX
  starts, and a compiler crash or out-of-memory abort costs that variant alone."""
  with tempfile.TemporaryDirectory() as scratch:
    result_path = os.path.join(scratch, "result.json")
    mode = (["--compile_only", args.compile_only] if args.compile_only
            else ["--steps", str(args.steps)])
    cmd = [sys.executable, os.path.abspath(__file__), "--fdl_config", args.fdl_config,
           "--sweep", args.sweep, *(f"--fdl_set={s}" for s in args.fdl_set), *mode,
           "--out", scratch, "--_worker", str(index), "--_result", result_path]
    done = subprocess.run(cmd, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if args.jobs == 1:
      print(log[-2000:] if done.returncode else "", end="", flush=True)
    if os.path.exists(result_path):
      with open(result_path) as f:
        return json.load(f)
    last = [line for line in log.strip().splitlines() if line.strip()][-1:] or ["no output"]
    return {"fits": False, "error": f"variant process exited {done.returncode}: {last[0][:200]}"}


def _worker(args) -> int:
  overrides = load_sweep(args.sweep)[args._worker]
  exp = fdl.build(apply(configs.resolve(args.fdl_config, args.fdl_set), overrides))
  flags_lib.apply_to_environ(exp.xla_flags, exp.libtpu_flags, exp.env)  # before JAX starts
  if args.compile_only and args.compile_only != "local":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no TPU is held
  try:
    result = run_variant(exp, args.compile_only, args.steps)
  except Exception as e:  # reported in the table; the sweep goes on
    traceback.print_exc()
    result = {"fits": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
  with open(args._result, "w") as f:
    json.dump(result, f)
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="launch/sweep.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--fdl_config", required=True)
  parser.add_argument("--sweep", required=True)
  parser.add_argument("--fdl_set", action="append", default=[])
  mode = parser.add_mutually_exclusive_group(required=True)
  mode.add_argument("--compile_only", help="'local' or a TPU topology kind:AxBxC")
  mode.add_argument("--steps", type=int, help="train each variant this many steps")
  parser.add_argument("--out", required=True)
  parser.add_argument("--variant", default=None, help="run only the variant of this name")
  parser.add_argument("--jobs", type=int, default=1,
                      help="variants at a time (compile-only sweeps of a big model on a "
                      "many-core machine; keep 1 when timing with --steps)")
  parser.add_argument("--_worker", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--_result", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args._worker is not None:
    return _worker(args)
  variants = list(enumerate(load_sweep(args.sweep)))
  if args.variant:
    variants = [(i, v) for i, v in variants if variant_name(v) == args.variant]
    if not variants:
      print(f"error: no variant named {args.variant!r}", file=sys.stderr)
      return 2

  def one(item):
    index, overrides = item
    name = variant_name(overrides)
    if args.jobs == 1:
      print(f"--- {name}", flush=True)
    row = {"variant": name, **_variant_in_subprocess(args, index, name)}
    print(f"{name}: {({k: v for k, v in row.items() if k != 'variant'})}", flush=True)
    return row

  with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
    rows = list(pool.map(one, variants))
  write_results(args.out, rows)
  print(f"wrote {args.out}/results.csv, results.md, results.png ({len(rows)} variants)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
