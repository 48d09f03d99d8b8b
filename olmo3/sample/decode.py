"""Autoregressive decoding with a KV cache, on the training model's own parameters and modules.

`extend` runs the tokens at positions start..start+T-1 through an `olmo3.model.Transformer`,
reading earlier positions' keys and values from a fixed-size cache and writing its own into
it: `generate` sends the prompt through once, then each new token alone, so no step recomputes
the prefix, and after the prompt's compile every step runs one compiled program (the cache's
shape never changes). It is the training forward with attention's keys and values taken from
the cache: the same projections, QK-norm and RoPE (`Attention.qkv`, with the RoPE tables read
at the tokens' absolute positions), the same attention (`attention.masked_attention`), the same
reordered norms, and each layer's window as in training. tests/test_sample.py checks its
logits against the full forward at every position, and greedy text against transformers'
`generate` on the exported checkpoint.

Shapes as in olmo3.model; S here is the cache's length (the positions it holds).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from olmo3.config import ModelConfig
from olmo3.attention import layer_ropes, masked_attention
from olmo3.model import Attention, Transformer, check_token_ids


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Every layer's keys (RoPE applied) and values at positions 0..S-1. Slots not written yet
  hold zeros; no query sees them, since they are later than every query so far."""

  k_LBSGK: jax.Array
  v_LBSGK: jax.Array

  @classmethod
  def empty(cls, cfg: ModelConfig, batch: int, length: int) -> KVCache:
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.compute_dtype.value)  # what the projections return in training
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _attention(attn: Attention, x_BTD: jax.Array, rope: tuple[jax.Array, jax.Array],
               k_BSGK: jax.Array, v_BSGK: jax.Array, start: jax.Array, mask_TS: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`Attention.__call__` over the cache: these positions' keys and values are written at
  `start`, then the queries attend over the whole cache, masked. Returns the output [B, T, D]
  and the layer's updated cache."""
  b, t, _ = x_BTD.shape
  q_BTHK, k_BTGK, v_BTGK = attn.qkv(x_BTD, rope)
  k_BSGK = jax.lax.dynamic_update_slice_in_dim(k_BSGK, k_BTGK, start, axis=1)
  v_BSGK = jax.lax.dynamic_update_slice_in_dim(v_BSGK, v_BTGK, start, axis=1)
  out_BTHK = masked_attention(q_BTHK, k_BSGK, v_BSGK, mask_TS)
  return attn.o_proj(out_BTHK.reshape(b, t, -1)), k_BSGK, v_BSGK


def extend(model: Transformer, cache: KVCache, tokens_BT: jax.Array, start: jax.Array
           ) -> tuple[jax.Array, KVCache]:
  """Logits [B, T, V] (padded vocabulary, compute dtype) of `tokens_BT` at positions
  start..start+T-1, the cache holding every earlier position; and the cache with these
  positions written. start + T must not exceed the cache's length."""
  cfg = model.cfg
  t, s = tokens_BT.shape[1], cache.k_LBSGK.shape[2]
  # These positions' RoPE tables, plain and (with YaRN) scaled; each layer takes its own.
  ropes = {scaled: tuple(jax.lax.dynamic_slice_in_dim(table_SK, start, t) for table_SK in tables)
           for scaled, tables in layer_ropes(cfg, s).items()}
  scaled_L = jnp.array([cfg.layer_rope_scaled(i) for i in range(cfg.n_layers)])
  query_T1 = (start + jnp.arange(t))[:, None]
  key_1S = jnp.arange(s)[None, :]
  # attention.attention_mask's rule at absolute positions: a sliding layer's query sees the
  # `window` keys ending at its own; a global layer's window is the whole cache (all earlier).
  windows_L = jnp.array([cfg.layer_window(i) or s for i in range(cfg.n_layers)], jnp.int32)
  graphdef, stacked = nnx.split(model.layers)

  def layer(x_BTD, per_layer):
    params, k_BSGK, v_BSGK, window, scaled = per_layer
    block = nnx.merge(graphdef, params)
    rope = tuple(jnp.where(scaled, a, b) for a, b in zip(ropes.get(True, ropes[False]),
                                                         ropes[False]))
    mask_TS = (key_1S <= query_T1) & (key_1S > query_T1 - window)
    attn_BTD, k_BSGK, v_BSGK = _attention(block.self_attn, x_BTD, rope, k_BSGK, v_BSGK, start,
                                          mask_TS)
    h_BTD = x_BTD + block.post_attention_layernorm(attn_BTD)  # as Block.__call__
    return h_BTD + block.post_feedforward_layernorm(block.mlp(h_BTD)), (k_BSGK, v_BSGK)

  x_BTD = model.embed_tokens(tokens_BT)
  x_BTD, (k_LBSGK, v_LBSGK) = jax.lax.scan(
      layer, x_BTD, (stacked, cache.k_LBSGK, cache.v_LBSGK, windows_L, scaled_L))
  return model.lm_head(model.norm(x_BTD)), KVCache(k_LBSGK, v_LBSGK)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is picked: the most likely (temperature 0), or drawn from
  softmax(logits / temperature) cut to the most likely tokens whose probabilities reach top_p
  (nucleus sampling; 1: no cut)."""

  temperature: float = 0.0
  top_p: float = 1.0

  def pick(self, logits_BV: jax.Array, key: jax.Array) -> jax.Array:
    """Token ids [B] from logits [B, V] over the real vocabulary."""
    logits_BV = logits_BV.astype(jnp.float32)
    if self.temperature == 0:
      return jnp.argmax(logits_BV, axis=-1)
    logits_BV = logits_BV / self.temperature
    if self.top_p < 1:
      sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
      probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
      above_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # the more likely tokens' total
      # The smallest logit still kept: the most likely token always is (its `above` is 0).
      floor_B1 = jnp.min(jnp.where(above_BV < self.top_p, sorted_BV, jnp.inf), axis=-1,
                         keepdims=True)
      logits_BV = jnp.where(logits_BV >= floor_B1, logits_BV, -jnp.inf)
    return jax.random.categorical(key, logits_BV, axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("cache",))
def _next_token(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache, tokens_BT: jax.Array,
                start: jax.Array, key: jax.Array, sampling: Sampling
                ) -> tuple[jax.Array, KVCache]:
  model = nnx.merge(graphdef, state)
  logits_BTV, cache = extend(model, cache, tokens_BT, start)
  # The padded vocabulary's rows are no tokens: never picked.
  return sampling.pick(logits_BTV[:, -1, :model.cfg.vocab_size], key), cache


def generate(model: Transformer, prompt_ids: Sequence[int], max_new_tokens: int,
             sampling: Sampling = Sampling(), seed: int = 0,
             stop: Callable[[list[int]], bool] | None = None) -> list[int]:
  """The ids that follow `prompt_ids` (one sequence): max_new_tokens of them, or fewer ending
  with the model's EOS (`ModelConfig.eos_token_id`) when it is picked, or where `stop` (given
  the new ids so far) says so: a chat template's end of turn."""
  cfg = model.cfg
  check_token_ids(np.asarray(prompt_ids), cfg.vocab_size)
  graphdef, state = nnx.split(model)
  # Positions that go through the model: the prompt's and every new token's but the last.
  cache = KVCache.empty(cfg, 1, len(prompt_ids) + max_new_tokens - 1)
  tokens_BT = jnp.asarray([prompt_ids], jnp.int32)
  start, new = 0, []
  for key in jax.random.split(jax.random.key(seed), max_new_tokens):
    token_B, cache = _next_token(graphdef, state, cache, tokens_BT, jnp.int32(start), key,
                                 sampling)
    new.append(int(token_B[0]))  # waits for the step: EOS decides whether there is another
    if new[-1] == cfg.eos_token_id or (stop is not None and stop(new)):
      break
    start += tokens_BT.shape[1]
    tokens_BT = token_B[:, None]
  return new
