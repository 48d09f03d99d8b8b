"""A sweep's results for people and for the next run: results.csv (every variant's numbers,
read back by `--resume`), results.md (ranked), results.png (a bar per variant, the repeats'
range around a timed median), and the ranked lines the terminal shows."""

from __future__ import annotations

import csv
import io
from typing import Any

from etils import epath

def write_results(out: str, rows: list[dict[str, Any]], rank_by: str = "mfu") -> None:
  directory = epath.Path(out)
  directory.mkdir(parents=True, exist_ok=True)
  keys = ["variant"] + sorted({k for r in rows for k in r} - {"variant"})
  text = io.StringIO(newline="")
  writer = csv.DictWriter(text, keys)
  writer.writeheader()
  writer.writerows(rows)
  (directory / "results.csv").write_text(text.getvalue())

  order = ranked(rows, rank_by)
  (directory / "results.md").write_text(
      "| rank | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1) + "\n"
      + "".join(f"| {i} | " + " | ".join(_fmt(r.get(k)) for k in keys) + " |\n"
                for i, r in enumerate(order, 1)))
  _chart(directory / "results.png", order, rank_by)


def ranked(rows: list[dict[str, Any]], rank_by: str = "mfu") -> list[dict[str, Any]]:
  """The rows best first: what fits first; then by (median) MFU, else tokens/s, else the MFU
  ceiling of a compiled variant's step-time bound (ties, as where compute bounds several, by
  the time with nothing overlapped, shortest first), else memory (smallest first); or, by
  held-out CE, the lowest first (none: last)."""

  def rank(r):
    score = (r.get("mfu") or r.get("tokens_per_s") or r.get("mfu_ceiling")
             or -(r.get("memory_gb") or 1e9))
    return (not r.get("fits"), -score if score is not None else 0, r.get("serial_s") or 0)

  def rank_heldout(r):
    ce = r.get("heldout_ce")
    return (not r.get("fits"), ce is None, ce or 0.0)

  return sorted(rows, key=rank_heldout if rank_by == "heldout" else rank)


def read_rows(out: str) -> dict[str, dict[str, Any]]:
  """The rows of an earlier OUT/results.csv, by variant, values parsed back from text."""
  path = epath.Path(out) / "results.csv"
  if not path.exists():
    return {}

  def parse(v: str):
    if v in ("", "True", "False"):
      return {"": None, "True": True, "False": False}[v]
    try:
      return float(v)
    except ValueError:
      return v

  return {r["variant"]: {k: parse(v) if k != "variant" else v for k, v in r.items()}
          for r in csv.DictReader(io.StringIO(path.read_text(), newline=""))}


def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:.4g}"
  return "" if v is None else str(v)


def _readable(v) -> str:
  """4 significant digits; thousands and more whole, with separators (tokens/s 12,346)."""
  return f"{v:,.0f}" if isinstance(v, float) and abs(v) >= 1000 else _fmt(v)


def _chart(path: epath.Path, rows: list[dict[str, Any]], rank_by: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  metric = "heldout_ce" if rank_by == "heldout" else next(
      (k for k in ("mfu", "tokens_per_s", "mfu_ceiling", "memory_gb")
       if any(r.get(k) for r in rows)), None)
  fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
  names = [r["variant"] for r in rows]
  values = [r.get(metric) or 0 for r in rows]
  colors = ["tab:green" if r.get("fits") else "tab:red" for r in rows]
  # The repeats' range around each median, where the variant was timed.
  spread = [[v - (r.get(f"{metric}_min") if r.get(f"{metric}_min") is not None else v)
             for r, v in zip(rows, values)],
            [(r.get(f"{metric}_max") if r.get(f"{metric}_max") is not None else v) - v
             for r, v in zip(rows, values)]]
  bars = ax.barh(range(len(rows)), values, color=colors,
                 xerr=spread if any(map(any, spread)) else None, capsize=2)
  ax.bar_label(bars, fmt="%.4g", fontsize=7)
  ax.set_yticks(range(len(rows)), names, fontsize=7)
  ax.invert_yaxis()
  if metric == "heldout_ce" and any(values):
    # Variants differ by hundredths of a nat: bars from zero would all look the same length.
    ax.set_xlim(0.98 * min(v for v in values if v), 1.01 * max(values))
    metric += ", lower is better"
  timed = "median of the repeats, min-max bars; " if any(map(any, spread)) else ""
  ax.set_xlabel(f"{metric} ({timed}green: fits, red: does not)")
  fig.tight_layout()
  try:
    with path.open("wb") as f:
      fig.savefig(f, dpi=110, format="png")
  finally:
    plt.close(fig)


def describe(result: dict[str, Any]) -> str:
  """A variant's result for people: whether it fits, then each number rounded (`_readable`; a
  timed median with its repeats' range beside it), the error last."""
  spread = {k for k in result if k.endswith(("_min", "_max"))}
  parts = ["fits" if result.get("fits") else "does NOT fit"]
  for key, value in result.items():
    if key in ("fits", "error") or key in spread or value is None:
      continue
    text = f"{key} {_readable(value)}"
    if f"{key}_min" in result and f"{key}_max" in result:
      text += f" ({_readable(result[f'{key}_min'])}-{_readable(result[f'{key}_max'])})"
    parts.append(text)
  if result.get("error"):
    parts.append(f"error: {result['error']}")
  return ", ".join(parts)


def ranking(rows: list[dict[str, Any]], rank_by: str) -> list[str]:
  """The ranked variants, one line each (the table results.md holds, for the terminal)."""
  return [f"{i:>3}. {r['variant']}: {describe({k: v for k, v in r.items() if k != 'variant'})}"
          for i, r in enumerate(ranked(rows, rank_by), 1)]
