"""olmo3/xla_cpu.py: each workaround gives the plain operation's values, and does what it is
there for in the compiled CPU program (so a JAX upgrade that makes one useless, or breaks it,
fails here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3 import attention, loss, xla_cpu


@pytest.mark.parametrize("shape", [(3, 5, 512), (7, 8192), (4, 100), (2, 3, 132)])
def test_row_reductions_equal_the_plain_ones(shape):
  """The max bit for bit (infinities and NaN rows included), the sum to float32 rounding,
  keepdims or not, whether the last axis splits (512, 8192, 132) or not (100)."""
  x = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 30
  x[0, ..., 3] = -np.inf
  x[-1, ..., :] = -np.inf
  x[1, ..., 7] = np.nan
  x = jnp.asarray(x)
  for keep in (False, True):
    np.testing.assert_array_equal(jax.jit(lambda x: xla_cpu.row_max(x, keep))(x),
                                  x.max(axis=-1, keepdims=keep))
    finite = jnp.where(jnp.isfinite(x), x, 0.0)
    np.testing.assert_allclose(jax.jit(lambda x: xla_cpu.row_sum(x, keep))(finite),
                               finite.sum(axis=-1, keepdims=keep), rtol=1e-6, atol=1e-4)


def test_the_row_max_is_split_on_a_cpu_and_plain_elsewhere(monkeypatch):
  x = jnp.zeros((4, 8192))
  split = jax.jit(xla_cpu.row_max).lower(x).as_text()
  assert "tensor<4x16x512xf32>" in split  # reduced over 16 first, then over 512
  monkeypatch.setattr(xla_cpu, "_on_cpu", lambda: False)
  assert "tensor<4x16x512xf32>" not in jax.jit(lambda x: xla_cpu.row_max(x)).lower(x).as_text()


def test_rope_tables_are_constants_on_a_cpu_and_closer_to_the_exact_cosine(monkeypatch):
  """Computed when traced: the program holds no cosine to evaluate again in each fusion. The
  eager tables are also the more exact: within 1e-7 of the float64 cosine of the same float32
  angles, where XLA:CPU's fused cosine is 2e-6 off."""
  t, k, theta = 64, 32, 500_000.0
  tables = lambda: jax.jit(lambda: attention.rope_tables(t, k, theta))
  assert "cosine" not in tables().lower().as_text()
  cos, sin = tables()()
  inv_freq = jnp.float32(1) / jnp.float32(theta) ** (np.arange(0, k, 2, dtype=np.float32) / k)
  angles = np.arange(t, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None]
  angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
  np.testing.assert_allclose(cos, np.cos(angles), rtol=0, atol=1e-7)
  np.testing.assert_allclose(sin, np.sin(angles), rtol=0, atol=1e-7)
  monkeypatch.setattr(xla_cpu, "_on_cpu", lambda: False)
  assert "cosine" in tables().lower().as_text()
  np.testing.assert_allclose(tables()()[0], cos, rtol=0, atol=5e-6)


def test_flat_rows_only_on_one_cpu_device_in_float32_or_wider(monkeypatch):
  assert xla_cpu.rows_flat(jnp.float32) and xla_cpu.rows_flat(jnp.float64)
  assert not xla_cpu.rows_flat(jnp.bfloat16)
  mesh = jax.sharding.AbstractMesh((2,), ("data",))
  with jax.sharding.use_abstract_mesh(mesh):
    assert not xla_cpu.rows_flat(jnp.float32)
  monkeypatch.setattr(xla_cpu, "_on_cpu", lambda: False)
  assert not xla_cpu.rows_flat(jnp.float32)


def test_the_fused_loss_gradient_is_written_over_the_logits(monkeypatch):
  """The reason rows are flat: the loss's gradient program holds one [B·T, V] buffer (the
  logits, overwritten by their gradient), not two; with [B, T, V] rows it holds two."""
  b, t, d, v = 4, 64, 32, 4096
  h = jnp.ones((b, t, d), jnp.float32)
  w = jnp.ones((d, v), jnp.float32)
  labels = jnp.zeros((b, t), jnp.int32)

  def temp_bytes():
    grad = jax.jit(jax.grad(lambda h, w: loss.fused_token_nll(h, w, labels, v).nll_BT.sum(),
                            argnums=(0, 1)))
    return grad.lower(h, w).compile().memory_analysis().temp_size_in_bytes

  logits = b * t * v * 4
  flat = temp_bytes()
  assert logits <= flat < 2 * logits, (flat, logits)
  monkeypatch.setattr(xla_cpu, "rows_flat", lambda dtype: False)
  assert temp_bytes() >= 2 * logits
