"""RULER in the evaluation (olmo3.eval.ruler, olmo3.eval.ruler_tasks): instances equal to lm-eval
0.4.13's where its generators run offline, prompts refused (never cut) when longer than their
length, each continuation scored against its own instance's answers, the table the CLI prints,
and the long-context alarm."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from olmo3 import config, decode
from olmo3.data import sources, tokenizer as tokenizer_lib
from olmo3.eval import ruler_scores, ruler_tasks
from olmo3.eval.alarm import LONG_CONTEXT_METRIC, LongContextAlarm
from olmo3.eval.evaluator import Evaluator
from olmo3.eval.ruler_tasks import RulerError
from olmo3.io import checkpoint
from olmo3.placement import ShardedModel

from conftest import random_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe",
           "ruler_fwe")
TINY = config.olmo3_tiny()  # the embedded tokenizer's 8192 ids


@pytest.fixture(scope="module")
def tokenizer():
  return tokenizer_lib.load(sources.tokenizer_file("embedded"), "the embedded tokenizer")


def _count(tokenizer):
  return lambda text: len(tokenizer.encode(text).ids)


@pytest.mark.slow(seconds=45)
def test_instances_equal_lm_evals_where_its_generators_are_offline(tmp_path, tokenizer):
  """Every offline task at 1024 tokens (lm-eval's short-length branches) and the needles and
  common words at 4096 (its long ones): olmo3's first instances are lm-eval's, text for text,
  for the same tokenizer and seed, lm-eval run in its own process as it runs."""
  import transformers

  hf_dir = tmp_path / "tokenizer"
  transformers.PreTrainedTokenizerFast(
      tokenizer_file=sources.tokenizer_file("embedded")).save_pretrained(hf_dir)
  wanted = [(t, 1024) for t in OFFLINE] + [("niah_single_1", 4096), ("ruler_cwe", 4096)]
  seed, samples = 7, 4
  done = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tests", "lm_eval_ruler.py"), str(hf_dir), str(seed),
       str(samples), *(f"{t}:{n}" for t, n in wanted)],
      capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  theirs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
  assert len(theirs) == len(wanted) * samples
  for task, length in wanted:
    ours = ruler_tasks.generate(task, length, samples, seed, _count(tokenizer))
    expected = [r for r in theirs if (r["task"], r["length"]) == (task, length)]
    assert [(i.input, list(i.outputs), i.gen_prefix) for i in ours] == [
        (r["input"], r["outputs"], r["gen_prefix"]) for r in expected], (task, length)


def test_instances_are_deterministic_and_fit_their_length(tokenizer):
  """The same seed gives the same instances, another seed others; every task's prompts fit
  the length; the needles' answers are in their haystack, the essay tasks' haystack is the
  text given."""
  count = _count(tokenizer)
  words = ("Prose of the held-out documents. It is cut into sentences here! Is it? " * 200).split()
  for task in config.RULER_TASKS:
    first = ruler_tasks.generate(task, 1024, 2, 3, count, words)
    assert first == ruler_tasks.generate(task, 1024, 2, 3, count, words), task
    assert first != ruler_tasks.generate(task, 1024, 2, 4, count, words), task
    for instance in first:
      assert count(instance.prompt) <= 1024, task
      if task.startswith("niah"):
        assert all(answer in instance.input for answer in instance.outputs), task
    if ruler_tasks.uses_text(task):
      assert "Prose of the held-out documents." in first[0].input
  with pytest.raises(RulerError, match="ruler_vt at 512 tokens: no instance fits"):
    ruler_tasks.generate("ruler_vt", 512, 1, 0, count)  # lm-eval would loop forever here
  with pytest.raises(RulerError, match="ruler_cwe at 512 tokens: no room"):
    ruler_tasks.generate("ruler_cwe", 512, 1, 0, count)  # lm-eval: 0 words, nothing to find


def _experiment(tokenizer_file, lengths=(512,), samples=1, tasks=config.RULER_TASKS, **model):
  return config.Experiment(
      model=TINY.replace(max_seq_len=max(lengths), **model),
      data=config.DataConfig(paths=("unused",), seq_len=max(lengths), global_batch_size=8,
                             max_target_seq_len=None),
      eval=config.EvalConfig(heldout=(), tokenizer=tokenizer_file, batch_size=8,
                             ruler=config.RulerConfig(lengths=lengths, samples=samples,
                                                      tasks=tasks, prefill_chunk=256)))


def test_a_prompt_longer_than_its_length_is_refused_not_cut(tokenizer):
  exp = _experiment(sources.tokenizer_file("embedded"), tasks=("niah_single_1",))
  evaluator = Evaluator(exp, ShardedModel.for_experiment(exp, jax.devices()[:1]))
  instance = evaluator.ruler.instances[512][0]
  ids = evaluator.ruler.prompt_ids(instance)
  assert tokenizer.decode(ids) == instance.prompt  # whole
  longer = type(instance)(**{**instance.__dict__, "input": instance.input * 2})
  with pytest.raises(RulerError, match="longer than its length; refused"):
    evaluator.ruler.prompt_ids(longer)


def test_each_continuation_is_scored_against_its_own_answers(tokenizer, monkeypatch):
  """Generation stood in for by an oracle that answers each prompt with its own instance's
  answers (found by the prompt's tokens, whatever order the scorer sends them in): every task
  scores 1; answering with the next instance's answers scores what string matching
  gives; a continuation past an EOS, or past the task's own budget, is not read."""
  exp = _experiment(sources.tokenizer_file("embedded"), lengths=(1024,), samples=2,
                    tasks=("niah_single_1", "niah_multikey_2", "ruler_cwe", "ruler_fwe"))
  evaluator = Evaluator(exp, ShardedModel.for_experiment(exp, jax.devices()[:1]))
  table = evaluator.ruler
  by_prompt = {tuple(p): i for p, i in zip(table.prompts[1024], table.instances[1024])}
  shift = {"by": 0}
  eos = exp.model.eos_token_id

  def oracle(model, params, prompts, new_tokens, batch_size, chunk, pad_id):
    del model, params, batch_size, chunk, pad_id
    out = []
    instances = table.instances[1024]
    for ids in prompts:
      own = by_prompt[tuple(ids)]
      answer = instances[(instances.index(own) + shift["by"]) % len(instances)]
      said = tokenizer.encode(" " + ", ".join(answer.outputs), add_special_tokens=False).ids
      out.append((said + [eos] + [5] * new_tokens)[:new_tokens])
    return out

  monkeypatch.setattr(decode, "greedy", oracle)
  scores = evaluator.ruler_metrics(params=None)
  assert scores[ruler_scores.mean_metric(1024)] == 1.0 and all(
      v == 1.0 for k, v in scores.items() if k.startswith("ruler/")), scores
  shift["by"] = 1  # everyone answers the next instance's question
  wrong = evaluator.ruler_metrics(params=None)
  assert wrong[ruler_scores.metric("niah_single_1", 1024)] == 0.0
  assert wrong[ruler_scores.mean_metric(1024)] < 0.6
  assert ruler_scores.string_match_all(" The ANSWER is 12 and 7.\x01", ["answer", "7", "9"]) == 2 / 3


def test_batched_greedy_decoding_equals_one_prompt_at_a_time():
  """decode.greedy (prompts of different lengths in one batch, each at its own position,
  chunked prefill) gives each prompt `generate`'s tokens, on one device and with the cache's
  positions split over a sequence axis of 2 and 4 (context parallelism)."""
  micro = config.olmo3_micro().replace(rope_scaling=config.Yarn(factor=4.0, original_context=16))
  params = random_params(config.olmo3_micro(), seed=1)
  from olmo3 import model as model_lib, sharding

  net = model_lib.from_params(micro, params)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, micro.vocab_size, n).tolist() for n in (5, 17, 33, 12, 40, 3)]
  want = [decode.generate(net, p, 9) for p in prompts]
  for shape in ({"fsdp": 1}, {"fsdp": 2, "sequence": 2}, {"data": 2, "sequence": 4}):
    n = int(np.prod(list(shape.values())))
    model = ShardedModel(micro, sharding.make_mesh(shape, jax.devices()[:n]))
    got = decode.greedy(model, jax.device_put(params, model.param_shardings), prompts, 9,
                        batch_size=4, chunk=16)
    assert got == want, shape


@pytest.mark.seconds(10)
def test_the_cli_prints_a_table_per_task_and_length(tmp_path, capsys):
  """python -m olmo3.eval --workdir RUN --ruler: RULER alone, one row per task and a column
  per length, the mean, the report's "ruler" scores; AI2's row where lengths are AI2's."""
  from olmo3.eval.__main__ import main

  exp = _experiment(sources.tokenizer_file("embedded"), lengths=(1536,),
                    tasks=("ruler_vt", "ruler_fwe"))
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  (run / "experiment.json").write_text(json.dumps(exp.to_dict()))
  checkpoint.save_model(run / "checkpoints" / "5", exp.model, random_params(exp.model, 5))
  assert main(["--workdir", str(run), "--ruler", "--ruler_lengths", "1024", "1536",
               "--ruler_samples", "1"]) == 0
  out = capsys.readouterr().out.splitlines()
  header = out.index(next(line for line in out if "RULER" in line))
  assert out[header + 1].split() == ["1024", "1536"]
  rows = {line.split()[0]: line.split()[1:] for line in out[header + 2:header + 5]}
  assert set(rows) == {"ruler_fwe", "ruler_vt", "mean"}
  assert all(len(v) == 2 for v in rows.values())
  report = json.loads((run / "eval_report.json").read_text())
  assert set(report["steps"]["5"]["ruler"]) == {
      ruler_scores.metric(t, n) for t in ("ruler_fwe", "ruler_vt")
      for n in (1024, 1536)} | {ruler_scores.mean_metric(1024), ruler_scores.mean_metric(1536)}
  lines = ruler_scores.table(report["steps"]["5"]["ruler"] | {ruler_scores.mean_metric(4096): 0.5}, (4096,))
  assert lines[-1].split()[-1] == "95.8"  # AI2's figure at 4K


def test_long_context_alarm():
  """Fires when the longest length falls while the shortest holds, against the previous
  evaluation or the first (the starting checkpoint); not when every length falls alike, nor
  on a fall under its threshold."""
  alarm = LongContextAlarm(drop=0.1)
  assert alarm.observe(0, {512: 0.9, 2048: 0.8}) is None  # the starting checkpoint
  assert alarm.observe(10, {512: 0.92, 2048: 0.74}) is None  # a fall of 0.06
  evals = {}
  warning = alarm.observe(20, {512: 0.9, 2048: 0.66}, evals)  # 0.14 below the start
  assert warning and "RULER at 2048 tokens fell 0.140" in warning and alarm.fired_at == 20
  assert evals[LONG_CONTEXT_METRIC] == 1.0
  evals = {}
  assert alarm.observe(30, {512: 0.5, 2048: 0.4}, evals) is None  # everything fell
  assert evals[LONG_CONTEXT_METRIC] == 0.0
  assert LongContextAlarm().observe(0, {2048: 0.1}) is None  # one length: nothing to hold


def test_ruler_settings_are_checked():
  with pytest.raises(config.ConfigError, match="increasing prompt lengths"):
    config.RulerConfig(lengths=(1024, 512))
  with pytest.raises(config.ConfigError, match=r"\['qa_squad'\] unknown"):
    config.RulerConfig(tasks=("qa_squad",))
  with pytest.raises(config.ConfigError, match="exceeds model.max_seq_len"):
    config.Experiment(model=TINY, eval=config.EvalConfig(ruler={"lengths": (4096,)}))


def test_compare_shows_each_sides_last_ruler_beside_ai2s():
  ours = {ruler_scores.mean_metric(4096): {10: 0.5, 20: 0.6},
          ruler_scores.mean_metric(65536): {20: 0.3}}
  lines = ruler_scores.comparison_lines(ours, {})
  assert lines[2].split() == ["4096", "60.0", "(step", "20)", "-", "95.8"]
  assert lines[-1].split() == ["65536", "30.0", "(step", "20)", "-", "70.9"]
  assert ruler_scores.comparison_lines({}, {}) == []
