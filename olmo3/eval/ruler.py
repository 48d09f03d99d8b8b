"""RULER in the evaluation: its synthetic long-context tasks (olmo3.eval.ruler_tasks), generated
once when the evaluator is built, scored by greedy generation on the run's own model
(olmo3.decode.greedy: batched, compiled, the cache split over the mesh's sequence axis where the
run has context parallelism), as lm-eval scores them: the continuation decoded, stripped, and
each expected answer looked for in it, case aside (string_match_all: the share of an
instance's answers found, averaged). docs/evaluation.md#ruler-long-context-tasks.

A prompt longer than its length is refused when the instances are built, never cut. The
answer's budget (lm-eval's max_gen_toks: 128 tokens for the needles) may run past the length:
lm-eval's generators reserve it for the input alone, or not at all (frequent words), and this
keeps their instances as they are.

Metrics (0..1): ruler/<task>/<length>, and ruler/mean/<length> over the tasks
(olmo3.eval.ruler_scores: the names, AI2's figures, the tables).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from olmo3 import decode
from olmo3.config import Experiment
from olmo3.eval.ruler_scores import cleaned, mean_metric, metric, string_match_all
from olmo3.eval.ruler_tasks import Instance, RulerError, generate, uses_text
from olmo3.placement import ShardedModel


def haystack_words(texts: Iterable[str], enough: int) -> list[str]:
  """Prose for the essay haystacks, split at spaces as lm-eval splits its essays: at least
  `enough` words when the texts hold them."""
  words: list[str] = []
  for text in texts:
    words.extend(re.sub(r"\s+", " ", text).strip().split(" "))
    if len(words) >= enough:
      break
  return words


class Ruler:
  """The instances of eval.ruler's tasks at its lengths, and their scoring."""

  def __init__(self, exp: Experiment, model: ShardedModel, tokenizer: Any,
               texts: Callable[[], Iterable[str]]):
    """`tokenizer`: a tokenizers.Tokenizer (the run's evaluation tokenizer); `texts()`: the
    prose the essay haystacks are cut from (called only when a chosen task reads one)."""
    self.exp, self.model, self.cfg = exp, model, exp.eval.ruler
    self.tokenizer = tokenizer
    cfg = self.cfg

    def count(text: str) -> int:  # as lm-eval's tokenizer call: special tokens included
      return len(tokenizer.encode(text).ids)

    words = (haystack_words(texts(), 2 * cfg.lengths[-1])
             if any(uses_text(t) for t in cfg.tasks) else [])
    self.instances: dict[int, list[Instance]] = {}
    self.prompts: dict[int, list[list[int]]] = {}
    for length in cfg.lengths:
      found = [i for task in cfg.tasks
               for i in generate(task, length, cfg.samples, cfg.seed, count, words)]
      self.instances[length] = found
      self.prompts[length] = [self.prompt_ids(i) for i in found]

  def prompt_ids(self, instance: Instance) -> list[int]:
    """The prompt's tokens (no special tokens: the model reads text as it trained on it);
    refused when longer than the instance's length."""
    ids = self.tokenizer.encode(instance.prompt, add_special_tokens=False).ids
    if len(ids) > instance.length:
      raise RulerError(f"RULER {instance.task} at {instance.length}: instance {instance.index}'s "
                       f"prompt is {len(ids)} tokens, longer than its length; refused (a "
                       "prompt is never cut)")
    return ids

  def score(self, params: Any, stop: Callable[[], bool] | None = None
            ) -> dict[str, float] | None:
    """{ruler/<task>/<length>: score, ruler/mean/<length>: mean over the tasks}; None when
    `stop()` said to stop (asked before each length)."""
    out: dict[str, float] = {}
    eos = self.exp.model.eos_token_id
    for length in self.cfg.lengths:
      if stop is not None and stop():
        return None
      instances, prompts = self.instances[length], self.prompts[length]
      # (every batch is as long as the longest prompt: the order of the prompts pads nothing)
      budget = max(i.new_tokens for i in instances)
      made = decode.greedy(self.model, params, prompts, budget, self.exp.eval.batch_size,
                           min(self.cfg.prefill_chunk, length), self.exp.model.pad_token_id)
      scores: dict[str, list[float]] = {}
      for instance, ids in zip(instances, made):
        ids = ids[:instance.new_tokens]  # the task's own budget
        if eos in ids:
          ids = ids[:ids.index(eos)]
        text = cleaned(self.tokenizer.decode(ids, skip_special_tokens=True))
        scores.setdefault(instance.task, []).append(string_match_all(text, instance.outputs))
      for task, found in scores.items():
        out[metric(task, length)] = float(np.mean(found))
      out[mean_metric(length)] = float(np.mean([out[metric(t, length)] for t in scores]))
    return out
