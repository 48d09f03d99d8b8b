"""The OLMo 3 transformer in Flax NNX, top to bottom (docs/architecture.md).

Shapes in names: B batch, T query positions, S key positions, D d_model, H query heads,
G key/value heads, R = H / G, U = T·R (a key/value head's queries), K head dim, F MLP hidden,
V padded vocabulary, L layers.

Parameters are float32; matmuls run in `cfg.compute_dtype`; norms, RoPE and softmax run in
float32. A float64 model (`DType.FLOAT64`, for parity checks below float32 rounding; it needs
`jax_enable_x64`) holds float64 parameters and runs everything in float64. Parameter paths
follow Hugging Face's names, so conversion is a mechanical mapping. RoPE and the attention
kernels are olmo3/attention.py's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from olmo3 import attention as attention_lib
from olmo3 import halo as halo_lib
from olmo3.attention import wide
from olmo3.config import AttentionKernel, ContextParallel, DType, ModelConfig
from olmo3 import remat as remat_lib
from olmo3.remat import Name
from olmo3.sharding import constrain, heads_over_sequence, sequence_shards
from olmo3 import xla_cpu


def truncated_normal(std: float, cutoff: float) -> nnx.Initializer:
  """Normal(0, std) cut at ±cutoff·std, as torch's trunc_normal_(std, a=-3std, b=3std).

  Not jax.nn.initializers.truncated_normal: that one rescales so the *truncated* distribution
  has the given std, which is not what OLMo-core does.
  """

  def init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
    # Drawn in float32 whatever the parameter dtype: a float64 model starts from the float32
    # model's weights (and OLMo-core's float32 state dict holds them exactly).
    return (std * jax.random.truncated_normal(key, -cutoff, cutoff, shape, jnp.float32)
            ).astype(dtype)

  return init


def param_dtype(cfg: ModelConfig) -> jnp.dtype:
  """float32, or float64 for a float64 model."""
  if cfg.compute_dtype == DType.FLOAT64 and not jax.config.read("jax_enable_x64"):
    raise ValueError("ModelConfig.compute_dtype=float64 needs jax_enable_x64 (JAX would "
                     "silently compute in float32)")
  return jnp.dtype(jnp.float64 if cfg.compute_dtype == DType.FLOAT64 else jnp.float32)


def _dense(cfg: ModelConfig, d_in: int, d_out: int, names: tuple[str, str], rngs: nnx.Rngs):
  return nnx.Linear(
      d_in, d_out, use_bias=False, dtype=jnp.dtype(cfg.compute_dtype.value),
      param_dtype=param_dtype(cfg),
      kernel_init=nnx.with_partitioning(truncated_normal(cfg.init_std, cfg.init_cutoff), names),
      rngs=rngs)


def _rows(x_BTD: jax.Array) -> tuple[int, ...]:
  """The leading axes a row-wise layer (projections, MLP) computes over: [B, T], or [B·T] on
  one CPU device, where XLA:CPU then writes gradients in place (olmo3.xla_cpu.rows_flat)."""
  b, t = x_BTD.shape[:2]
  return (b * t,) if xla_cpu.rows_flat(x_BTD.dtype) else (b, t)


class RMSNorm(nnx.Module):
  """Weight-only RMSNorm computed in float32 (float64 inputs: float64), cast back to the input
  dtype."""

  def __init__(self, cfg: ModelConfig, dim: int, axis: str, *, rngs: nnx.Rngs | None = None):
    del rngs  # deterministic init (ones)
    self.eps = cfg.norm_eps
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype(cfg)), out_sharding=(axis,))

  def __call__(self, x: jax.Array) -> jax.Array:
    xw = x.astype(wide(x.dtype))
    y = xw * jax.lax.rsqrt(jnp.mean(jnp.square(xw), axis=-1, keepdims=True) + self.eps)
    return (self.weight[...] * y).astype(x.dtype)


# --- modules -----------------------------------------------------------------------------------


class Attention(nnx.Module):
  """q, k, v projections -> QK-norm over the full projections -> RoPE -> attention -> o."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    self.q_proj = _dense(cfg, d, q, ("embed", "q_heads"), rngs)
    self.k_proj = _dense(cfg, d, kv, ("embed", "kv_heads"), rngs)
    self.v_proj = _dense(cfg, d, kv, ("embed", "kv_heads"), rngs)
    self.o_proj = _dense(cfg, q, d, ("q_heads", "embed"), rngs)
    self.q_norm = RMSNorm(cfg, q, "q_heads")
    self.k_norm = RMSNorm(cfg, kv, "kv_heads")

  def __call__(self, x_BTD: jax.Array, rope: tuple[jax.Array, jax.Array],
               window: int | None, segments_BT: jax.Array | None = None,
               order_T: np.ndarray | None = None) -> jax.Array:
    """`order_T`: the columns' positions when the sequence is laid out for context
    parallelism (Transformer.features)."""
    cfg = self.cfg
    b, t, _ = x_BTD.shape
    q_BTHK, k_BTGK, v_BTGK = self.qkv(x_BTD, rope)
    if order_T is None:
      out_BTHK = attention_lib.attend(q_BTHK, k_BTGK, v_BTGK, window, cfg.attention,
                                      segments_BT, splash_block=cfg.splash_block)
    elif cfg.context_parallel is ContextParallel.ALL_TO_ALL:
      out_BTHK = self._all_to_all(q_BTHK, k_BTGK, v_BTGK, window, segments_BT, order_T)
    else:
      out_BTHK = self._all_gather(q_BTHK, k_BTGK, v_BTGK, window, segments_BT, order_T)
    context = checkpoint_name(out_BTHK.reshape(*_rows(x_BTD), cfg.n_heads * cfg.head_dim),
                              Name.CONTEXT)
    return checkpoint_name(self.o_proj(context), Name.OUT_PROJ).reshape(b, t, cfg.d_model)

  def _all_gather(self, q_BTHK, k_BTGK, v_BTGK, window, segments_BT, order_T):
    """Context parallelism by gathering (ContextParallel.ALL_GATHER): each shard keeps its
    queries (at their positions `order_T`) and reads every key, so keys, values (and their
    documents) are gathered whole along the sequence, in position order (the all-gather of
    OLMo-core's llama3-style context parallelism; its gradient a reduce-scatter). A sliding
    layer reads only the chunks its window reaches (`_halo`), where that moves less."""
    halo = halo_lib.plan(order_T, sequence_shards(), window)
    if halo is not None and self.cfg.attention is AttentionKernel.SPLASH and (
        halo.chunk % attention_lib.SPLASH_LANES):
      halo = None  # splash tiles queries by its lanes: chunks shorter than that are gathered
    if halo is not None:
      return self._halo(q_BTHK, k_BTGK, v_BTGK, window, segments_BT, halo)
    if self.cfg.attention is AttentionKernel.SPLASH:  # gathers inside its shard_map
      return attention_lib.attend(q_BTHK, k_BTGK, v_BTGK, window, self.cfg.attention,
                                  segments_BT, positions_T=order_T, segments_BS=segments_BT,
                                  keys_split=True, splash_block=self.cfg.splash_block)
    inverse_S = None if attention_lib.in_order(order_T) else np.argsort(order_T)

    def whole(x, names):
      # Gathered first, then put in position order on each device: permuted while sharded,
      # the partitioner moved the whole array through an all-reduce each way (twice an
      # all-gather's bytes, and its gradient reduced whole where a reduce-scatter suffices).
      x = constrain(x, names)
      return x if inverse_S is None else constrain(x[:, inverse_S], names)

    k_BSGK, v_BSGK = (checkpoint_name(whole(x, ("batch", None, "act_heads", None)),
                                      Name.GATHERED_KV) for x in (k_BTGK, v_BTGK))
    segments_BS = None if segments_BT is None else whole(segments_BT, ("batch", None))
    return attention_lib.attend(q_BTHK, k_BSGK, v_BSGK, window, self.cfg.attention, segments_BT,
                                positions_T=order_T, segments_BS=segments_BS,
                                splash_block=self.cfg.splash_block)

  def _halo(self, q_BTHK, k_BTGK, v_BTGK, window, segments_BT, halo: halo_lib.Halo):
    """A sliding layer under context parallelism by gathering: each chunk of queries reads the
    chunks its window reaches, received from the shards that hold them (olmo3.halo), not the
    whole sequence; the received keys and values are kept for the backward pass."""
    k_NSGK, v_NSGK = (checkpoint_name(x, Name.GATHERED_KV)
                      for x in halo_lib.keys_read(k_BTGK, v_BTGK, halo))
    segments_NC, segments_NS = halo_lib.documents_read(segments_BT, q_BTHK.shape[0], halo)
    out_NCHK = attention_lib.attend(halo_lib.chunked(q_BTHK, halo), k_NSGK, v_NSGK, window,
                                    self.cfg.attention,
                                    segments_NC, positions_T=halo.positions_C,
                                    segments_BS=segments_NS, chunk_rows=True,
                                    splash_block=self.cfg.splash_block)
    return halo_lib.unchunked(out_NCHK, halo)

  def _all_to_all(self, q_BTHK, k_BTGK, v_BTGK, window, segments_BT, order_T):
    """Ulysses context parallelism (ContextParallel.ALL_TO_ALL): queries, keys and values go
    from the sequence split to a head split (an all-to-all each), every device attends the
    whole sequence, in position order, for its heads with the plain causal mask, and the output
    goes back to the sequence split (a fourth; the backward pass swaps the output's gradient
    in and the three gradients back). No key is gathered whole and no mask is offset."""
    inverse_T = None if attention_lib.in_order(order_T) else np.argsort(order_T)

    def whole(x):  # the sequence whole on each device, in position order
      x = heads_over_sequence(x)
      return x if inverse_T is None else heads_over_sequence(x[:, inverse_T])

    if segments_BT is not None:
      segments_BT = constrain(segments_BT if inverse_T is None else segments_BT[:, inverse_T],
                              ("batch", None))
    q_BTHK, k_BTGK, v_BTGK = (checkpoint_name(whole(x), Name.SWAPPED_QKV)
                              for x in (q_BTHK, k_BTGK, v_BTGK))
    out_BTHK = attention_lib.attend(q_BTHK, k_BTGK, v_BTGK, window, self.cfg.attention,
                                    segments_BT, heads_over_sequence=True,
                                    splash_block=self.cfg.splash_block)
    # Pinned to the head split before the swap back, so that the backward pass swaps the
    # output's gradient too (left free, the partitioner gathers it whole along the heads).
    out_BTHK = heads_over_sequence(out_BTHK)
    if inverse_T is not None:
      out_BTHK = heads_over_sequence(out_BTHK[:, order_T])
    return constrain(out_BTHK, ("batch", "seq", "act_heads", None))

  def qkv(self, x_BTD: jax.Array, rope: tuple[jax.Array, jax.Array]
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries [B, T, H, K], keys and values [B, T, G, K] as attention reads them (keys and
    values are also what olmo3.decode's KV cache holds)."""
    cfg = self.cfg
    b, t, d = x_BTD.shape
    x = x_BTD.reshape(*_rows(x_BTD), d)
    q = self.q_norm(checkpoint_name(self.q_proj(x), Name.QUERY_PROJ))
    k = self.k_norm(checkpoint_name(self.k_proj(x), Name.KEY_PROJ))
    v = checkpoint_name(self.v_proj(x), Name.VALUE_PROJ)
    heads = ("batch", "seq", "act_heads", None)
    rotate = attention_lib.apply_rope
    q_BTHK = constrain(rotate(q.reshape(b, t, cfg.n_heads, cfg.head_dim), *rope), heads)
    k_BTGK = constrain(rotate(k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim), *rope), heads)
    v_BTGK = constrain(v.reshape(b, t, cfg.n_kv_heads, cfg.head_dim), heads)
    return q_BTHK, k_BTGK, v_BTGK


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)). gate/up/down are OLMo-core's w1/w3/w2."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.gate_proj = _dense(cfg, cfg.d_model, cfg.mlp_hidden, ("embed", "mlp"), rngs)
    self.up_proj = _dense(cfg, cfg.d_model, cfg.mlp_hidden, ("embed", "mlp"), rngs)
    self.down_proj = _dense(cfg, cfg.mlp_hidden, cfg.d_model, ("mlp", "embed"), rngs)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    b, t, d = x_BTD.shape
    x = x_BTD.reshape(*_rows(x_BTD), d)
    gate = checkpoint_name(self.gate_proj(x), Name.MLPWI_0)
    up = checkpoint_name(self.up_proj(x), Name.MLPWI_1)
    hidden = jax.nn.silu(gate) * up
    if hidden.ndim == 3:
      hidden = constrain(hidden, ("batch", "seq", "act_mlp"))
    return checkpoint_name(self.down_proj(hidden), Name.MLPWO).reshape(b, t, d)


class Block(nnx.Module):
  """Reordered norm: each sublayer's OUTPUT is normalised before the residual add."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.self_attn = Attention(cfg, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg, cfg.d_model, "embed")
    self.mlp = MLP(cfg, rngs=rngs)
    self.post_feedforward_layernorm = RMSNorm(cfg, cfg.d_model, "embed")

  def __call__(self, x_BTD: jax.Array, rope: tuple[jax.Array, jax.Array],
               window: int | None, segments_BT: jax.Array | None = None,
               order_T: np.ndarray | None = None) -> jax.Array:
    x_BTD = constrain(checkpoint_name(x_BTD, Name.DECODER_LAYER_INPUT),
                      ("batch", "seq", "act_embed"))
    h_BTD = x_BTD + self.post_attention_layernorm(self.self_attn(x_BTD, rope, window,
                                                                 segments_BT, order_T))
    return h_BTD + self.post_feedforward_layernorm(self.mlp(h_BTD))


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
  """All L blocks as one Block whose parameters have a leading `layers` axis."""

  @nnx.split_rngs(splits=cfg.n_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs: nnx.Rngs) -> Block:
    return Block(cfg, rngs=rngs)

  return make(rngs)


def check_token_ids(tokens: jax.Array | np.ndarray, vocab_size: int) -> None:
  """Raises a clear error for ids outside [0, vocab_size) when the ids are concrete.

  Under jit the ids are abstract; `Transformer` then maps bad ids to a missing embedding row,
  which yields NaN (loud) instead of silently reading a padding row.
  """
  if isinstance(tokens, jax.core.Tracer) or (
      isinstance(tokens, jax.Array) and not tokens.is_fully_addressable):
    return
  ids = np.asarray(tokens)
  if not np.issubdtype(ids.dtype, np.integer):
    raise TypeError(f"token ids must be integers, got dtype {ids.dtype}")
  bad = (ids < 0) | (ids >= vocab_size)
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"token id {int(ids[where])} at index {where} is outside the vocabulary "
                     f"[0, {vocab_size}); {int(bad.sum())} ids are out of range")


class Transformer(nnx.Module):
  """Embedding -> L blocks (sliding / global) -> final norm -> untied LM head (padded vocab)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = nnx.Embed(
        cfg.padded_vocab_size, cfg.d_model, dtype=jnp.dtype(cfg.compute_dtype.value),
        param_dtype=param_dtype(cfg),
        embedding_init=nnx.with_partitioning(truncated_normal(cfg.init_std, cfg.init_cutoff),
                                             ("table_vocab", "table_embed")),
        rngs=rngs)
    self.layers = _stacked_blocks(cfg, rngs)
    self.norm = RMSNorm(cfg, cfg.d_model, "embed")
    self.lm_head = _dense(cfg, cfg.d_model, cfg.padded_vocab_size, ("embed", "vocab"), rngs)

  def __call__(self, tokens_BT: jax.Array, segments_BT: jax.Array | None = None, *,
               return_hidden: bool = False):
    """Logits [B, T, V] over the padded vocabulary, in the compute dtype. `segments_BT`: a
    document id per token of packed instances (attention stays within a document; RoPE
    positions as `cfg.rope_positions`); None: one sequence per row.

    With return_hidden, also every layer's output [L, B, T, D] (for per-layer parity).
    """
    h_BTD, hidden_LBTD = self._features(tokens_BT, segments_BT, return_hidden)
    logits_BTV = constrain(self.lm_head(h_BTD), ("batch", "seq", "act_vocab"))
    return (logits_BTV, hidden_LBTD) if return_hidden else logits_BTV

  def features(self, tokens_BT: jax.Array, segments_BT: jax.Array | None = None,
               order_T: np.ndarray | None = None) -> jax.Array:
    """[B, T, D]: what the LM head reads (the final norm's output, in the compute dtype). The
    fused loss (olmo3.loss.fused_token_nll) takes these and the head's kernel.

    `order_T`: the rows laid out for context parallelism (olmo3.sharding.balanced_order):
    column j of `tokens_BT` (and `segments_BT`, and of the output) is position order_T[j] of
    its row. None: column j is position j."""
    return self._features(tokens_BT, segments_BT, False, order_T)[0]

  def _features(self, tokens_BT: jax.Array, segments_BT: jax.Array | None, return_hidden: bool,
                order_T: np.ndarray | None = None):
    cfg = self.cfg
    if order_T is None and sequence_shards() > 1:
      order_T = np.arange(tokens_BT.shape[1])  # the mesh's contiguous split, unbalanced
    check_token_ids(tokens_BT, cfg.vocab_size)
    valid = (tokens_BT >= 0) & (tokens_BT < cfg.vocab_size)
    tokens_BT = jnp.where(valid, tokens_BT, cfg.padded_vocab_size)  # no row there: NaN
    x_BTD = self.embed_tokens(tokens_BT)
    if segments_BT is not None:
      segments_BT = constrain(segments_BT, ("batch", "seq"))
    ropes = attention_lib.layer_ropes(cfg, tokens_BT.shape[1], segments_BT, order_T)
    x_BTD, hidden_LBTD = self._blocks(x_BTD, ropes, segments_BT, order_T, return_hidden)
    return constrain(self.norm(x_BTD), ("batch", "seq", "act_embed")), hidden_LBTD

  def _blocks(self, x_BTD, ropes, segments_BT, order_T, return_hidden: bool):
    """Runs the layers: scanned in groups of `global_every` (same static windows and RoPE
    tables in every group), the remainder unrolled; or all unrolled. Same parameters, same
    outputs. `ropes[scaled]`: the RoPE tables of layers whose RoPE is (not) scaled."""
    cfg = self.cfg
    graphdef, stacked = nnx.split(self.layers)

    def block(params, x, layer):
      return nnx.merge(graphdef, params)(x, ropes[cfg.layer_rope_scaled(layer)],
                                         cfg.layer_window(layer), segments_BT, order_T)

    remat = remat_lib.policy(cfg.remat, cfg.remat_custom)
    if remat is not None:
      block = jax.checkpoint(block, policy=remat, prevent_cse=False, static_argnums=(2,))

    period, n_layers = cfg.global_every, cfg.n_layers
    n_scanned = (n_layers // period) * period if cfg.scan_layers else 0
    hidden = []
    if n_scanned:
      groups = jax.tree.map(
          lambda a: a[:n_scanned].reshape(n_scanned // period, period, *a.shape[1:]), stacked)
      # Layer j of every full group has the window and RoPE of layer j of the first.
      def group(x, params):
        outs = []
        for j in range(period):
          x = block(jax.tree.map(functools.partial(lambda j, a: a[j], j), params), x, j)
          outs.append(x)
        return x, (jnp.stack(outs) if return_hidden else None)

      x_BTD, ys = jax.lax.scan(group, x_BTD, groups)
      if return_hidden:
        hidden.extend(ys.reshape(n_scanned, *x_BTD.shape))
    for i in range(n_scanned, n_layers):
      x_BTD = block(jax.tree.map(lambda a: a[i], stacked), x_BTD, i)
      hidden.append(x_BTD)
    return x_BTD, (jnp.stack(hidden) if return_hidden else None)


def abstract_model(cfg: ModelConfig) -> Transformer:
  """The model's structure with ShapeDtypeStructs for parameters; allocates nothing.

  Needs no mesh: the logical axis names stay as metadata (nnx.get_partition_spec reads them).
  Each call gives a new module over the same (immutable) abstract leaves.
  """
  return nnx.merge(*_abstract_split(cfg))


@functools.lru_cache(maxsize=16)
def _abstract_split(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  # Tracing the model's construction costs 20-100 ms; a launch asks for it several times
  # (the sharded model, parameter shapes, conversions) and the test suite hundreds.
  with nnx.use_eager_sharding(False):
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def param_count(model: Transformer) -> int:
  """Parameters of a (possibly abstract) model, counted from its arrays' shapes."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def param_shapes(cfg: ModelConfig) -> dict:
  """The parameter tree as nested dicts of ShapeDtypeStruct (the checkpoint layout)."""
  return nnx.state(abstract_model(cfg), nnx.Param).to_pure_dict()


def from_params(cfg: ModelConfig, params: dict) -> Transformer:
  """A model holding `params` (nested dict of arrays, as `param_shapes` lays out)."""
  graphdef, state = nnx.split(abstract_model(cfg))
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)
