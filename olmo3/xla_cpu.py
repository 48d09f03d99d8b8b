"""Where olmo3 works around XLA:CPU's code generation, each measured on the tiny model's train
step (benchmarks/RESULTS.md, "Train step on CPU"). Every function here is the plain operation
on other platforms, so TPU and GPU programs are unchanged.

- Row reductions (`row_max`, `row_sum`). XLA:CPU rewrites a reduction over more than 32
  elements of the minor (last) axis into a windowed reduction that its loop emitter runs one
  element at a time, with the producer (an exponential, say) computed inside that scalar
  loop. A reduction over a major axis is vectorised along the minor one instead. So [..., N]
  is viewed as [..., A, N / A] and reduced over A first (vectorised, the producer fused in),
  then over the N / A left; an optimisation barrier between the two keeps XLA's simplifier
  from merging them back. On the logits ([4096, 8192] float32, 2 cores) the row max went
  from 35 to 9 ms and the log-partition's exp-sum from 72 to 11 ms. The max is the same value
  either way; the sum adds in another order (float rounding).
- Tables computed when the program is traced (`at_trace_time`). XLA does not fold an
  expression of iotas into a constant, and fuses an elementwise producer into each of its
  consumers: the RoPE tables' cos and sin ([T, K]) were evaluated again for every element of
  every [B, T, H, K] fusion that read them, in every layer, forward and backward. Computed
  eagerly, they enter the program as constants; eager, XLA:CPU's cosine is also the more
  exact one (3e-8 from the float64 cosine of the same float32 angles, where the cosine it
  fuses is 2e-6 off).
- Rows laid out flat (`rows_flat`). XLA:CPU writes an elementwise result over an operand of
  the same shape whose last use it is, unless a bitcast stands between them, as one does
  between a matmul's [B·T, C] output and [B, T, C]. On one CPU device the fused loss, the MLP
  and the attention's projections take their rows as [B·T, C]: the loss's backward pass then
  writes the logits' gradient over the logits (128 MB fewer fresh pages a step for the tiny
  model; every page of a step's temporaries is faulted in again at each step).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from olmo3 import platforms

_SPLITS = (16, 8, 4)  # A: the major-axis stage's length, the first that divides N
_SHORTEST = 128  # below this the minor-axis reduction is already cheap


def _on_cpu() -> bool:
  return platforms.compile_target() == "cpu"


def rows_flat(dtype: jnp.dtype) -> bool:
  """Whether to lay [B, T, C] activations of `dtype` out as [B·T, C] rows: on one CPU device
  (with more, the rows keep their logical batch and sequence axes for the sharding rules), in
  float32 or float64. In bfloat16 XLA:CPU folds a flat matmul's cast to float32 into the
  matmul, which then skips the bfloat16 rounding of its output that the [B, T, C] one keeps
  (the logits and norms would no longer round as the LM head's and TPUs' do)."""
  if not _on_cpu() or jnp.dtype(dtype).itemsize < 4:
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or mesh.size == 1


def at_trace_time() -> contextlib.AbstractContextManager:
  """A context whose JAX operations on static values run when traced, on a CPU."""
  return jax.ensure_compile_time_eval() if _on_cpu() else contextlib.nullcontext()


def _split(n: int) -> int | None:
  """A for a last axis of n on a CPU, or None for the plain reduction."""
  if n < _SHORTEST or not _on_cpu():
    return None
  return next((a for a in _SPLITS if n % a == 0), None)


def _two_stage(reduce, x: jax.Array, keepdims: bool) -> jax.Array:
  a = _split(x.shape[-1])
  if a is None:
    return reduce(x, axis=-1, keepdims=keepdims)
  partial = jax.lax.optimization_barrier(
      reduce(x.reshape(*x.shape[:-1], a, x.shape[-1] // a), axis=-2))
  return reduce(partial, axis=-1, keepdims=keepdims)


def row_max(x: jax.Array, keepdims: bool = False) -> jax.Array:
  """x.max(axis=-1)."""
  return _two_stage(jnp.max, x, keepdims)


def row_sum(x: jax.Array, keepdims: bool = False) -> jax.Array:
  """x.sum(axis=-1), to float rounding."""
  return _two_stage(jnp.sum, x, keepdims)
