"""The fused, vocabulary-chunked loss equals the loss from full logits: values and gradients to
float32 rounding, whatever the chunk (dividing the vocabulary, overlapping at its end, or
larger than it), with masked labels and z-loss; and the compiled loss really never holds full
logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3 import loss, sharding, xla_cpu
from olmo3.placement import ShardedModel
from olmo3.train import step as step_lib
from tests.conftest import random_params
from tests.train_helpers import micro_experiment

B, T, D, V = 3, 20, 16, 200


def _inputs(seed: int = 0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.standard_normal((B, T, D)), dtype)
  w = jnp.asarray(rng.standard_normal((D, V)) * 0.6, jnp.float32)  # logits spread over nats
  labels = rng.integers(0, V, (B, T)).astype(np.int32)
  labels[0, :5] = loss.IGNORE
  labels[2, -1] = loss.IGNORE
  return h, w, jnp.asarray(labels)


def _objective(per_token_fn, z_loss_weight=1e-2):
  """A scalar that gives both outputs (CE and log-partition) a non-trivial cotangent."""

  def f(h, w, labels):
    per_token = per_token_fn(h, w, labels)
    total, metrics = loss.lm_loss(per_token, z_loss_weight)
    return total + 0.3 * per_token.lse_BT[1].sum(), metrics

  return f


def _unfused(h, w, labels):
  return loss.token_nll(jnp.einsum("btd,dv->btv", h, w.astype(h.dtype)), labels)


@pytest.mark.parametrize("chunk", [50, 64, 512])  # divides V, overlaps at the end, > V
def test_fused_loss_and_gradients_equal_the_full_logits_ones(chunk):
  h, w, labels = _inputs()
  fused = lambda h, w, labels: loss.fused_token_nll(h, w, labels, chunk)
  for a, b in zip(jax.jit(fused)(h, w, labels), jax.jit(_unfused)(h, w, labels)):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)
  grad = lambda f: jax.jit(jax.value_and_grad(_objective(f), argnums=(0, 1), has_aux=True))
  (value, metrics), (dh, dw) = grad(fused)(h, w, labels)
  (value_ref, metrics_ref), (dh_ref, dw_ref) = grad(_unfused)(h, w, labels)
  assert float(value) == pytest.approx(float(value_ref), rel=1e-6)
  assert float(metrics["z_loss"]) == pytest.approx(float(metrics_ref["z_loss"]), rel=1e-6)
  assert int(metrics["tokens"]) == int(metrics_ref["tokens"])
  scale_h, scale_w = float(jnp.abs(dh_ref).max()), float(jnp.abs(dw_ref).max())
  np.testing.assert_allclose(dh, dh_ref, rtol=1e-5, atol=1e-6 * scale_h)
  np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-6 * scale_w)


@pytest.mark.parametrize("chunk", [50, 64, 512])
def test_label_logit_is_the_same_gathered_as_selected(monkeypatch, chunk):
  """XLA:CPU gathers each row's label logit, TPUs sum a masked select: the same values, bit for
  bit, in every chunk layout (the last chunk overlapping the one before it included)."""
  h, w, labels = _inputs()
  # A new function for each: jit would reuse the first trace for the same one.
  fused = lambda: jax.jit(lambda h, w, labels: loss.fused_token_nll(h, w, labels, chunk))
  gathered = fused()(h, w, labels)
  monkeypatch.setattr(loss.platforms, "compile_target", lambda: "tpu")  # the masked sum
  monkeypatch.setattr(xla_cpu, "_on_cpu", lambda: True)  # the rest as on the CPU
  selected = fused()(h, w, labels)
  for a, b in zip(gathered, selected):
    np.testing.assert_array_equal(a, b)


def test_fused_loss_in_bfloat16_rounds_logits_as_the_lm_head_does():
  """bf16 compute: logits are bf16 products as the head's matmul gives them, then float32; the
  forward pass is the same to float32 rounding, the gradients to bf16 rounding."""
  h, w, labels = _inputs(1, jnp.bfloat16)
  fused = lambda h, w, labels: loss.fused_token_nll(h, w, labels, 64)
  for a, b in zip(jax.jit(fused)(h, w, labels), jax.jit(_unfused)(h, w, labels)):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)
  grad = lambda f: jax.jit(jax.grad(lambda *a: _objective(f)(*a)[0], argnums=(0, 1)))
  (dh, dw), (dh_ref, dw_ref) = grad(fused)(h, w, labels), grad(_unfused)(h, w, labels)
  assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(dh, np.float32), np.asarray(dh_ref, np.float32),
                             rtol=2e-2, atol=2e-2 * float(jnp.abs(dh_ref.astype(jnp.float32)).max()))
  np.testing.assert_allclose(dw, dw_ref, rtol=2e-2, atol=1e-2 * float(jnp.abs(dw_ref).max()))


def test_non_finite_logits_stay_non_finite():
  """A NaN in the hidden states must reach the loss (the step then skips the update)."""
  h, w, labels = _inputs()
  nll = loss.fused_token_nll(h.at[1, 3, 0].set(jnp.nan), w, labels, 64).nll_BT
  assert np.isnan(nll[1, 3]) and np.isfinite(nll[0]).all()


def _models(exp):
  mesh = sharding.make_mesh({"fsdp": -1})
  fused = ShardedModel(exp.model, mesh)
  full = ShardedModel(exp.model.replace(vocab_chunk=None), mesh)
  return fused, full


@pytest.mark.seconds(8)
def test_train_step_loss_gradients_and_evaluation_equal_with_and_without_fusing():
  """The micro model on 8 devices (FSDP), vocabulary 512 in chunks of 96 (the last overlaps):
  the step's loss, per-source sums and every parameter's gradient; held-out sums; the logits
  the one-pass multiple-choice scoring reads. And the compiled loss and gradients hold no
  [B, T, V] array per device, only [B, T, chunk] ones (the full-logits program shows that the
  check can see them)."""
  exp = micro_experiment("unused")  # one layer: the loss does not care what the layers are
  exp = dataclasses.replace(exp, model=exp.model.replace(vocab_chunk=96, n_layers=1))
  fused, full = _models(exp)
  params = jax.device_put(random_params(exp.model, 0), fused.param_shardings)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, exp.model.vocab_size, (8, 33)).astype(np.int32)
  labels = tokens[:, 1:].copy()
  labels[3, 10:] = loss.IGNORE
  batch = {"input_ids": jnp.asarray(tokens[:, :-1]), "labels": jnp.asarray(labels),
           "filtered": jnp.zeros(8, bool), "source": jnp.asarray(np.arange(8) % 2, jnp.int32)}

  def run(model):
    with model.context():
      compiled = jax.jit(lambda p, b: step_lib.loss_and_grads(
          exp, model.token_losses, model.param_shardings, p, b, 2)).lower(params, batch).compile()
      return compiled(params, batch), compiled.as_text()

  ((value, aux), grads), text = run(fused)
  ((value_ref, aux_ref), grads_ref), text_ref = run(full)
  per_device = "32,512]"  # one row of [B, T, V] on each of the 8 devices
  assert per_device in text_ref
  assert per_device not in text, "the fused loss materialises full logits"
  assert "f32[1,32,96]" in text
  assert float(value) == pytest.approx(float(value_ref), rel=1e-6)
  np.testing.assert_allclose(aux["source_ce_sum"], aux_ref["source_ce_sum"], rtol=1e-6)
  for path, g, g_ref in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(grads),
                            jax.tree.leaves(grads_ref)):
    scale = float(jnp.abs(g_ref).max())
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5 * scale, err_msg=str(path[0]))
  with fused.context():
    per_token = jax.jit(fused.token_losses)(params, batch["input_ids"], batch["labels"])
    ce, n = per_token.nll_BT.sum(), per_token.mask_BT.sum()
    position = jnp.asarray(rng.integers(0, 32, 8))
    at = jax.jit(fused.logits_at)(params, batch["input_ids"], position)
  with full.context():
    logits = np.asarray(jax.jit(full.apply)(params, batch["input_ids"]), np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  mask = labels >= 0
  nll = -np.take_along_axis(logp, np.maximum(labels, 0)[..., None], -1)[..., 0]
  assert float(ce) == pytest.approx(nll[mask].sum(), rel=1e-6) and int(n) == mask.sum()
  np.testing.assert_allclose(at, logits[np.arange(8), position], rtol=1e-5, atol=1e-5)
