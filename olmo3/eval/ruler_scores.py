"""RULER's scores by name, without the model: the metric names a run logs (ruler/<task>/<length>,
ruler/mean/<length>, 0..1), how a continuation is scored (lm-eval's RULER metric), AI2's
published figures for OLMo 3 7B, and the tables the CLI, the closing summary and `compare`
print. No JAX: `compare` and the summary read logged metrics only."""

from __future__ import annotations

import re
from collections.abc import Sequence

# OLMo 3 7B (the base model after its long-context stage), RULER's mean over its tasks at each
# length: AI2's Olmo Hybrid paper, Table 3.
AI2_OLMO3_7B = {4096: 0.958, 8192: 0.893, 16384: 0.832, 32768: 0.789, 65536: 0.709}
AI2_SOURCE = "AI2's OLMo 3 7B (Olmo Hybrid paper, Table 3)"
PREFIX = "ruler/"


def metric(task: str, length: int) -> str:
  return f"{PREFIX}{task}/{length}"


def mean_metric(length: int) -> str:
  return f"{PREFIX}mean/{length}"


def means(metrics: dict[str, float]) -> dict[int, float]:
  """{length: mean score} of the ruler/mean/<length> metrics in `metrics`."""
  head = f"{PREFIX}mean/"
  return {int(k[len(head):]): v for k, v in metrics.items() if k.startswith(head)}


def cleaned(text: str) -> str:
  """A continuation as lm-eval scores it: stripped, control characters made line breaks."""
  return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match_all(prediction: str, outputs: Sequence[str]) -> float:
  """The share of `outputs` found in the prediction, case aside (RULER's string_match_all)."""
  found = prediction.lower()
  return sum(o.lower() in found for o in outputs) / len(outputs)


def table(metrics: dict[str, float], lengths: Sequence[int]) -> list[str]:
  """Lines of a table: a row per task, a column per length (scores 0-100), the mean, and
  AI2's row where the lengths are AI2's."""
  tasks = sorted({k[len(PREFIX):].rsplit("/", 1)[0] for k in metrics if k.startswith(PREFIX)}
                 - {"mean"})
  width = max([len(t) for t in tasks] + [len(AI2_SOURCE) if _shared(lengths) else 4])

  def row(name: str, values: list[float | None]) -> str:
    return f"{name:<{width}}" + "".join(
        f"{'-' if v is None else f'{100 * v:.1f}':>8}" for v in values)

  lines = [f"{'':<{width}}" + "".join(f"{n:>8}" for n in lengths)]
  lines += [row(t, [metrics.get(metric(t, n)) for n in lengths]) for t in tasks]
  lines.append(row("mean", [metrics.get(mean_metric(n)) for n in lengths]))
  if _shared(lengths):
    lines.append(row(AI2_SOURCE, [AI2_OLMO3_7B.get(n) for n in lengths]))
  return lines


def _shared(lengths: Sequence[int]) -> bool:
  return bool(set(lengths) & set(AI2_OLMO3_7B))


def last_means(series: dict[str, dict[int, float]]) -> tuple[int, dict[int, float]] | None:
  """(step, {length: mean}) of the last RULER evaluation in per-step metric series
  ({metric: {step: value}}), or None."""
  head = f"{PREFIX}mean/"
  by_length = {int(k[len(head):]): v for k, v in series.items() if k.startswith(head)}
  steps = sorted({s for values in by_length.values() for s in values})
  if not steps:
    return None
  return steps[-1], {n: v[steps[-1]] for n, v in by_length.items() if steps[-1] in v}


def comparison_lines(ours: dict[str, dict[int, float]], reference: dict[str, dict[int, float]]
                     ) -> list[str]:
  """RULER's mean per length at each side's last RULER evaluation, beside AI2's published
  figures for OLMo 3 7B: what `python -m olmo3.eval.compare` prints (none when neither side
  scored RULER)."""
  sides = [last_means(ours), last_means(reference)]
  if not any(sides):
    return []
  lengths = sorted({n for side in sides if side for n in side[1]} | set(AI2_OLMO3_7B))
  lines = ["RULER, mean over its tasks (0-100; docs/evaluation.md#ruler-long-context-tasks):",
           f"  {'length':>8}  {'ours':>18}  {'reference':>18}  {'AI2 OLMo 3 7B':>13}"]

  def cell(side: tuple[int, dict[int, float]] | None, n: int) -> str:
    return "-" if not side or n not in side[1] else f"{100 * side[1][n]:.1f} (step {side[0]})"

  for n in lengths:
    ai2 = AI2_OLMO3_7B.get(n)
    lines.append(f"  {n:>8}  {cell(sides[0], n):>18}  {cell(sides[1], n):>18}  "
                 f"{'-' if ai2 is None else f'{100 * ai2:.1f}':>13}")
  return lines
