"""Autoregressive decoding with a KV cache, on the training model's own parameters and modules.

`extend` runs the tokens at positions start..start+T-1 through an `olmo3.model.Transformer`,
reading earlier positions' keys and values from a fixed-size cache and writing its own into
it: `generate` sends the prompt through once, then each new token alone, so no step recomputes
the prefix, and after the prompt's compile every step runs one compiled program (the cache's
shape never changes). It is the training forward with attention's keys and values taken from
the cache: the same projections, QK-norm and RoPE (`Attention.qkv`, with the RoPE tables read
at the tokens' absolute positions), the same attention (`attention.grouped_attention`: masked_attention over the cache's layout), the same
reordered norms, and each layer's window as in training. tests/test_sample.py checks its
logits against the full forward at every position, and greedy text against transformers'
`generate` on the exported checkpoint.

`greedy` decodes a batch of prompts of different lengths in one compiled program per batch
shape, on a `ShardedModel`'s mesh (rows over the data axes, the cache over the sequence axis):
what in-loop long-context evaluation (olmo3.eval.ruler) runs.

Shapes as in olmo3.model; S here is the cache's length (the positions it holds).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from olmo3.config import ModelConfig
from olmo3.attention import grouped_attention, layer_ropes
from olmo3.model import Transformer, check_token_ids
from olmo3.placement import ShardedModel
from olmo3 import sharding
from olmo3.sharding import constrain

# A layer's cache's logical axes, [B, G, S, K], where the mesh splits the sequence and the
# heads do not divide over it: rows over the batch's mesh axes, positions over the sequence's
# (each device holds a piece of every row's keys, and XLA reduces the softmax across the
# pieces), heads as attention's activations.
CACHE_AXES = ("batch", "act_heads", "seq", None)


def _laid_out(x_BGSK: jax.Array) -> jax.Array:
  """A cache array on the mesh: with context parallelism, its heads split over the sequence
  axis where they divide (sharding.head_major_cache_spec: attention stays on each device, as
  all-to-all context parallelism keeps it: with the positions split instead, the 7B's compiled
  RULER batch moved terabytes between devices, benchmarks/RESULTS.md), else CACHE_AXES."""
  spec = sharding.head_major_cache_spec(x_BGSK.shape[1])
  return constrain(x_BGSK, CACHE_AXES) if spec is None else jax.lax.with_sharding_constraint(
      x_BGSK, spec)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Each layer's keys (RoPE applied) and values at positions 0..S-1, [B, G, S, K] a layer
  (head-major, as attention reads them: `attention.grouped_attention`), one array a layer so
  that each step writes its positions in place. Slots not written yet hold zeros; no query
  sees them, since they are later than every query so far."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @classmethod
  def empty(cls, cfg: ModelConfig, batch: int, length: int) -> KVCache:
    shape = (batch, cfg.n_kv_heads, length, cfg.head_dim)
    dtype = jnp.dtype(cfg.compute_dtype.value)  # what the projections return in training

    def layers():
      return tuple(_laid_out(jnp.zeros(shape, dtype)) for _ in range(cfg.n_layers))

    return cls(layers(), layers())


def features(model: Transformer, cache: KVCache, tokens_BT: jax.Array, start: jax.Array
             ) -> tuple[jax.Array, KVCache]:
  """The final hidden states [B, T, D] (after the last norm: what the LM head reads) of
  `tokens_BT` at positions start..start+T-1, the cache holding every earlier position; and the
  cache with these positions written. `start` is one position for every row, or [B], each
  row's own (a batch of prompts of different lengths decodes each at its own position).
  start + T must not exceed the cache's length. The layers run one after another (not
  scanned as in training), each reading and writing its own cache array in place."""
  cfg = model.cfg
  b, t = tokens_BT.shape
  s = cache.k[0].shape[2]
  start_B = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
  positions_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  # These positions' RoPE tables [B, T, K], plain and (with YaRN) scaled.
  ropes = {scaled: tuple(table_SK[positions_BT] for table_SK in tables)
           for scaled, tables in layer_ropes(cfg, s).items()}
  query_BT1 = positions_BT[:, :, None]
  key_11S = jnp.arange(s)[None, None, :]
  graphdef, stacked = nnx.split(model.layers)
  write = jax.vmap(lambda c_GSK, x_GTK, at: jax.lax.dynamic_update_slice_in_dim(c_GSK, x_GTK, at,
                                                                              axis=1))
  x_BTD = model.embed_tokens(tokens_BT)
  ks, vs = [], []
  for i in range(cfg.n_layers):
    block = nnx.merge(graphdef, jax.tree.map(lambda p, i=i: p[i], stacked))
    # attention.attention_mask's rule at absolute positions: a sliding layer's query sees the
    # `window` keys ending at its own; a global layer's, every earlier one.
    window = cfg.layer_window(i) or s
    mask_BTS = (key_11S <= query_BT1) & (key_11S > query_BT1 - window)
    rope = ropes.get(True, ropes[False]) if cfg.layer_rope_scaled(i) else ropes[False]
    attn = block.self_attn
    q_BTHK, k_BTGK, v_BTGK = attn.qkv(x_BTD, rope)
    ks.append(_laid_out(write(cache.k[i], k_BTGK.transpose(0, 2, 1, 3), start_B)))
    vs.append(_laid_out(write(cache.v[i], v_BTGK.transpose(0, 2, 1, 3), start_B)))
    out_BTHK = grouped_attention(q_BTHK, ks[-1], vs[-1], mask_BTS)
    attn_BTD = attn.o_proj(out_BTHK.reshape(b, t, -1))
    h_BTD = x_BTD + block.post_attention_layernorm(attn_BTD)  # as Block.__call__
    x_BTD = h_BTD + block.post_feedforward_layernorm(block.mlp(h_BTD))
  return model.norm(x_BTD), KVCache(tuple(ks), tuple(vs))


def extend(model: Transformer, cache: KVCache, tokens_BT: jax.Array, start: jax.Array
           ) -> tuple[jax.Array, KVCache]:
  """Logits [B, T, V] (padded vocabulary, compute dtype) of `tokens_BT` at positions
  start..start+T-1 (`features`), and the cache with these positions written."""
  h_BTD, cache = features(model, cache, tokens_BT, start)
  return model.lm_head(h_BTD), cache


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


@functools.cache  # one program (and its compiles) per model and settings
def greedy_program(model: ShardedModel, new_tokens: int, chunk: int) -> Callable:
  """(params, tokens_BT, lengths_B) -> the `new_tokens` greedy tokens [B, new_tokens] that
  follow each row's prompt (its first lengths_B[b] tokens; the rest of the row is padding),
  jitted on the model's mesh: one program for the whole generation. The prompts go through the
  model `chunk` positions at a time (T a multiple of it: attention's [B, H, chunk, S] arrays
  stay bounded at long lengths), then every row decodes at its own position. Rows are split
  over the batch's mesh axes and the cache over the sequence's (`_laid_out`: context
  parallelism). Generation does not stop at an end of sequence: the caller cuts each row."""
  cfg = model.cfg

  def pick(h_BD: jax.Array, lm_head) -> jax.Array:  # Sampling()'s greedy rule, as `generate`
    logits_BV = lm_head(h_BD)[:, :cfg.vocab_size]  # the padded vocabulary's rows are no tokens
    return Sampling().pick(logits_BV, key=None).astype(jnp.int32)

  def run(params, tokens_BT, lengths_B):
    net = nnx.merge(model.graphdef, params)
    b, t = tokens_BT.shape
    # Positions a whole number of chunks: the cache splits evenly over the sequence axis.
    cache = KVCache.empty(cfg, b, -(-(t + new_tokens - 1) // chunk) * chunk)

    def prefill(carry, c):
      cache, last_BD = carry
      start = c * chunk
      h_BCD, cache = features(net, cache, jax.lax.dynamic_slice_in_dim(tokens_BT, start, chunk,
                                                                       axis=1), start)
      at_B = lengths_B - 1 - start  # the prompt's last position, if in this chunk
      here_BD = jnp.take_along_axis(h_BCD, jnp.clip(at_B, 0, chunk - 1)[:, None, None],
                                    axis=1)[:, 0]
      inside_B1 = ((at_B >= 0) & (at_B < chunk))[:, None]
      return (cache, jnp.where(inside_B1, here_BD, last_BD)), None

    last_BD = jnp.zeros((b, cfg.d_model), jnp.dtype(cfg.compute_dtype.value))
    (cache, last_BD), _ = jax.lax.scan(prefill, (cache, last_BD), jnp.arange(t // chunk))

    def step(carry, i):
      token_B, cache = carry
      h_B1D, cache = features(net, cache, token_B[:, None], lengths_B + i)
      return (pick(h_B1D[:, 0], net.lm_head), cache), token_B

    (last_B, _), tokens_NB = jax.lax.scan(step, (pick(last_BD, net.lm_head), cache),
                                          jnp.arange(new_tokens - 1))
    return jnp.concatenate([tokens_NB.T, last_B[:, None]], axis=1)

  return jax.jit(run, in_shardings=(model.param_shardings, model.batch_sharding,
                                    row_sharding(model)), out_shardings=model.replicated)


def row_sharding(model: ShardedModel) -> jax.sharding.NamedSharding:
  """A [B] vector's sharding: split as the batch's rows are."""
  return jax.sharding.NamedSharding(model.mesh,
                                    jax.sharding.PartitionSpec(*model.batch_sharding.spec[:1]))


def _global(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def greedy(model: ShardedModel, params: Any, prompts: Sequence[Sequence[int]], new_tokens: int,
           batch_size: int, chunk: int, pad_id: int = 0) -> list[list[int]]:
  """Each prompt's `new_tokens` greedy continuation (`greedy_program`), in batches of
  `batch_size` rows (the last one filled with copies of a prompt, dropped), every batch as
  long as the longest prompt rounded up to `chunk` (one program shape, compiled once). Every
  batch is dispatched before any result is read."""
  if new_tokens < 1:
    raise ValueError(f"new_tokens {new_tokens}: at least one token is generated")
  if not prompts:
    return []
  for ids in prompts:
    check_token_ids(np.asarray(ids), model.cfg.vocab_size)
  program = greedy_program(model, new_tokens, chunk)
  t = -(-max(len(ids) for ids in prompts) // chunk) * chunk
  pending = []
  with model.context():
    for first in range(0, len(prompts), batch_size):
      group = list(prompts[first:first + batch_size])
      group += [group[0]] * (batch_size - len(group))
      tokens_BT = np.full((batch_size, t), pad_id, np.int32)
      for row, ids in enumerate(group):
        tokens_BT[row, :len(ids)] = ids
      lengths_B = np.array([len(ids) for ids in group], np.int32)
      # Every process holds the whole batch (the same prompts): each puts its devices' pieces.
      pending.append(program(params, _global(tokens_BT, model.batch_sharding),
                             _global(lengths_B, row_sharding(model))))
  out = np.concatenate([np.asarray(p) for p in pending])[:len(prompts)]
  return out.tolist()
