"""python -m olmo3.eval.compare RUN_A RUN_B [--tolerance 0.005] [--plot FILE.png] [--json]

Aligns two runs' evaluations by step (from each WORKDIR/metrics.jsonl: held-out CE, downstream
metrics, the gap alarm), prints a table of differences, and flags every metric whose values
differ by more than the tolerance (the TPU reproduction matched AI2 within ±0.005). With --plot,
draws both runs' train loss and held-out curves in one PNG. Exits 1 when anything is flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from olmo3.metrics import read_jsonl

EVAL_PREFIXES = ("eval/", "downstream/")


def load_metrics(workdir: str) -> list[dict[str, float]]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise SystemExit(f"error: {path} not found")
  return read_jsonl(path)


def evals_by_step(rows: list[dict[str, float]]) -> dict[int, dict[str, float]]:
  out: dict[int, dict[str, float]] = {}
  for row in rows:
    values = {k: v for k, v in row.items() if k.startswith(EVAL_PREFIXES)}
    if values:
      out.setdefault(int(row["step"]), {}).update(values)
  return out


def compare(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], tolerance: float
            ) -> list[dict]:
  rows = []
  for step in sorted(set(a) & set(b)):
    for metric in sorted(set(a[step]) & set(b[step])):
      if metric.endswith("/ppl"):
        continue  # exp(CE): CE is compared
      delta = b[step][metric] - a[step][metric]
      rows.append({"step": step, "metric": metric, "a": a[step][metric], "b": b[step][metric],
                   "delta": delta, "flagged": abs(delta) > tolerance})
  return rows


def plot(path: str, runs: dict[str, list[dict[str, float]]]) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 5))
  for (name, rows), color in zip(runs.items(), ("tab:blue", "tab:orange")):
    train = [(r["step"], r["ce_loss"]) for r in rows if "ce_loss" in r]
    if train:
      ax.plot(*zip(*train), color=color, alpha=0.6, label=f"{name}: train CE")
    for metric in sorted({k for r in rows for k in r if k.startswith("eval/")
                          and k.endswith("/ce_loss")}):
      points = [(r["step"], r[metric]) for r in rows if metric in r]
      ax.plot(*zip(*points), color=color, marker="o", linestyle="--",
              label=f"{name}: {metric.removeprefix('eval/').removesuffix('/ce_loss')} held-out CE")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats)")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m olmo3.eval.compare", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_a")
  parser.add_argument("run_b")
  parser.add_argument("--tolerance", type=float, default=0.005)
  parser.add_argument("--plot", default=None)
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  rows_a, rows_b = load_metrics(args.run_a), load_metrics(args.run_b)
  table = compare(evals_by_step(rows_a), evals_by_step(rows_b), args.tolerance)
  if args.json:
    print(json.dumps(table, indent=1))
  elif not table:
    print("no evaluations at common steps")
  else:
    width = max(len(r["metric"]) for r in table)
    print(f"{'step':>7}  {'metric'.ljust(width)}  {'A':>10}  {'B':>10}  {'B-A':>10}")
    for r in table:
      print(f"{r['step']:>7}  {r['metric'].ljust(width)}  {r['a']:>10.4f}  {r['b']:>10.4f}  "
            f"{r['delta']:>+10.4f}{'  <-- beyond ±' + str(args.tolerance) if r['flagged'] else ''}")
  if args.plot:
    plot(args.plot, {os.path.basename(os.path.normpath(args.run_a)) or "A": rows_a,
                     os.path.basename(os.path.normpath(args.run_b)) or "B": rows_b})
    print(f"wrote {args.plot}")
  flagged = sum(r["flagged"] for r in table)
  print(f"{flagged} of {len(table)} comparisons differ by more than {args.tolerance}")
  return 1 if flagged else 0


if __name__ == "__main__":
  sys.exit(main())
