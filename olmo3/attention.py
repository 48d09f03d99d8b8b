"""Where the transformer's tokens look: rotary position embedding (RoPE, YaRN scaling, per-
document positions) and attention (the causal, sliding-window and document masks, and the kernels
that apply them: xla, dot_product, cudnn and splash, with context parallelism).

Shapes in names as in olmo3/model.py: B batch, T query positions, S key positions, H query heads,
G key/value heads, R = H / G, U = T·R, K head dim. RoPE and softmax run in float32 (`wide`:
float64 for a float64 model).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from olmo3 import platforms
from olmo3.config import AttentionKernel, ModelConfig, RopePositions, Yarn
from olmo3.remat import Name
from olmo3 import xla_cpu
from olmo3.sharding import (chunk_rows_spec, heads_over_sequence_spec, logical_to_spec,
                            sequence_axes, sequence_shards)


def wide(dtype: jnp.dtype) -> jnp.dtype:
  """What norms, RoPE, softmax and losses compute in: float32, or float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


# --- rotary position embedding -----------------------------------------------------------------


def rope_frequencies(head_dim: int, theta: float, scaling: Yarn | None = None,
                     dtype: jnp.dtype = jnp.float32) -> tuple[jax.Array, float]:
  """The K/2 inverse frequencies (`dtype`) and the factor cos and sin are multiplied by.

  YaRN (`scaling`) as OLMo-core's YaRNRoPEScalingConfig computes it: frequency i is
  `f_i / factor * ramp_i + f_i * (1 - ramp_i)`, where the ramp rises linearly from 0 at
  floor(d(beta_fast)) to 1 at ceil(d(beta_slow)) (clipped to [0, K/2 - 1]), and d(r) is the
  dimension whose wavelength turns r times over the original context:
  K · ln(original_context / (2π r)) / (2 ln theta)."""
  half = head_dim // 2
  inv_freq_K2 = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim))
  if scaling is None:
    return inv_freq_K2, 1.0

  def dim_turning(rotations: float) -> float:
    return (head_dim * math.log(scaling.original_context / (rotations * 2.0 * math.pi))
            / (2.0 * math.log(theta)))

  low = max(math.floor(dim_turning(scaling.beta_fast)), 0)
  high = min(math.ceil(dim_turning(scaling.beta_slow)), half - 1)
  ramp_K2 = jnp.clip((jnp.arange(half, dtype=dtype) - low) / max(high - low, 1e-3), 0, 1)
  inv_freq_K2 = inv_freq_K2 / scaling.factor * ramp_K2 + inv_freq_K2 * (1 - ramp_K2)
  return inv_freq_K2, scaling.attention_factor


def rope_tables(seq_len: int, head_dim: int, theta: float, dtype: jnp.dtype = jnp.float32,
                scaling: Yarn | None = None) -> tuple[jax.Array, jax.Array]:
  """cos, sin of shape [T, K] (`dtype`) for positions 0..T-1, rotate-half layout; with YaRN
  `scaling`, its frequencies and both tables times its attention factor."""
  with xla_cpu.at_trace_time():
    inv_freq_K2, factor = rope_frequencies(head_dim, theta, scaling, dtype)
    angles_TK2 = jnp.arange(seq_len, dtype=dtype)[:, None] * inv_freq_K2[None, :]
    angles_TK = jnp.concatenate([angles_TK2, angles_TK2], axis=-1)
    return jnp.cos(angles_TK) * factor, jnp.sin(angles_TK) * factor


def apply_rope(x_BTNK: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """NeoX rotate-half RoPE: pairs dimension k with k + K/2. The tables are [T, K] (every row
  at positions 0..T-1) or [B, T, K] (each row's own positions). Computed in float32 (float64
  inputs: float64)."""
  x = x_BTNK.astype(wide(x_BTNK.dtype))
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  cos_BTNK, sin_BTNK = ((t[None, :, None, :] if t.ndim == 2 else t[:, :, None, :])
                        for t in (cos, sin))
  out = x * cos_BTNK + rotated * sin_BTNK
  return out.astype(x_BTNK.dtype)


def document_positions(segments_BT: jax.Array) -> jax.Array:
  """[B, T] int32: each token's position within its document (a run of equal segment ids),
  counted from 0 at the document's first token."""
  t = segments_BT.shape[1]
  index_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segments_BT.shape)
  starts_BT = jnp.concatenate([jnp.ones_like(segments_BT[:, :1], bool),
                               segments_BT[:, 1:] != segments_BT[:, :-1]], axis=1)
  first_BT = jax.lax.cummax(jnp.where(starts_BT, index_BT, 0), axis=1)
  return index_BT - first_BT


def layer_ropes(cfg: ModelConfig, seq_len: int, segments_BT: jax.Array | None = None,
                order_T: np.ndarray | None = None) -> dict[bool, tuple[jax.Array, jax.Array]]:
  """The RoPE tables of the layers whose RoPE `cfg.rope_scaling` scales (key True) and of the
  others (False), computed once per forward in the float32 (float64) RoPE runs in: [T, K] for
  positions 0..T-1, or, with `segments_BT` and `RopePositions.DOCUMENT`, [B, T, K] at each
  token's position within its document. With `order_T` (the columns laid out for context
  parallelism: column j is position order_T[j], `segments_BT` laid out alike), the tables of
  the laid-out columns."""
  dtype = wide(jnp.dtype(cfg.compute_dtype.value))
  per_document = segments_BT is not None and cfg.rope_positions == RopePositions.DOCUMENT
  positions_BT = None
  if per_document and order_T is None:
    positions_BT = document_positions(segments_BT)
  elif per_document:  # a document's first token is found in position order: int32s move
    inverse_T = np.argsort(order_T)
    positions_BT = document_positions(segments_BT[:, inverse_T])[:, order_T]

  def tables(scaling: Yarn | None) -> tuple[jax.Array, jax.Array]:
    cos_TK, sin_TK = rope_tables(seq_len, cfg.head_dim, cfg.rope_theta, dtype, scaling)
    if positions_BT is not None:
      return cos_TK[positions_BT], sin_TK[positions_BT]
    if order_T is not None and not in_order(order_T):
      return cos_TK[order_T], sin_TK[order_T]
    return cos_TK, sin_TK

  ropes = {False: tables(None)}
  if cfg.rope_scaling is not None:
    ropes[True] = tables(cfg.rope_scaling)
  return ropes


# --- attention kernels -------------------------------------------------------------------------


def in_order(order_T: np.ndarray) -> bool:
  return bool((order_T == np.arange(len(order_T))).all())


def attention_mask(seq_len: int, window: int | None, positions_T: np.ndarray | None = None
                   ) -> jax.Array:
  """[T, S] bool: query q sees key s when s <= q and, if sliding, s > q - window.

  So a sliding layer sees exactly `window` keys, the query's own position included. With
  `positions_T`, query row j is at position positions_T[j] (keys stay at 0..S-1, S = seq_len).
  """
  q_T1 = jnp.arange(seq_len)[:, None] if positions_T is None else jnp.asarray(positions_T)[:, None]
  s_1S = jnp.arange(seq_len)[None, :]
  mask = s_1S <= q_T1
  if window is not None:
    mask &= s_1S > q_T1 - window
  return mask


def document_mask(segments_BT: jax.Array, segments_BS: jax.Array | None = None) -> jax.Array:
  """[B, T, S] bool: query t may see key s only within its own document (equal segment ids);
  the keys' documents `segments_BS` (default: the queries')."""
  keys_BS = segments_BT if segments_BS is None else segments_BS
  return segments_BT[:, :, None] == keys_BS[:, None, :]


def masked_attention(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array,
                     mask_TS: jax.Array) -> jax.Array:
  """Grouped-query attention where query t sees key s when mask_TS[t, s] (one [T, S] mask for
  every row, or [B, T, S], each row its own); softmax in float32. The XLA kernel, and the
  KV-cache decode (olmo3.decode: queries at later positions, through `grouped_attention`).

  Laid out for XLA:CPU, where it is the training kernel: each key/value head's R query heads
  form one [U, K] block of queries (keys and values are never repeated), every [U, S] array is
  4-dimensional (a size-1 R axis makes XLA:CPU copy them between layouts), and the gradient is
  written out (`_attention_bwd`): a layer's forward and backward passes write three [U, S]
  arrays (scores, exponentials, their gradient) where autodiff of a masked softmax wrote seven
  (docs/performance.md#attention-kernels)."""
  return _attention(mask_TS, q_BTHK, k_BSGK, v_BSGK)


def _to_groups(x_BTHK: jax.Array, g: int) -> jax.Array:
  """[B, T, H, K] -> [B, G, U, K]: head h = g·R + r is query row t·R + r of group g."""
  b, t, h, k = x_BTHK.shape
  return x_BTHK.reshape(b, t, g, h // g, k).transpose(0, 2, 1, 3, 4).reshape(b, g, t * h // g, k)


def _from_groups(x_BGUK: jax.Array, t: int) -> jax.Array:
  b, g, u, k = x_BGUK.shape
  return x_BGUK.reshape(b, g, t, u // t, k).transpose(0, 2, 1, 3, 4).reshape(b, t, g * u // t, k)


def _transposed(x: jax.Array) -> jax.Array:
  """x with its last two axes swapped, and copied: XLA would fold the swap into the next dot,
  which XLA:CPU then runs outside YNNPACK at half the speed. Only [.., K, U] operands go here:
  the copy is S / K times smaller than the [U, S] operand it spares."""
  return jax.lax.optimization_barrier(jnp.swapaxes(x, -1, -2))


def _per_group(x):
  """A [U, S] mask-derived array as is; a per-row [B, U, S] one as [B, 1, U, S] (the same for
  every key/value head)."""
  return x if x.ndim == 2 else x[:, None]


@jax.custom_vjp
def _attention(mask_TS, q_BTHK, k_BSGK, v_BSGK):
  return _attention_fwd(mask_TS, q_BTHK, k_BSGK, v_BSGK)[0]


def _attention_fwd(mask_TS, q_BTHK, k_BSGK, v_BSGK):
  k_BGSK, v_BGSK = k_BSGK.transpose(0, 2, 1, 3), v_BSGK.transpose(0, 2, 1, 3)
  return _grouped(mask_TS, q_BTHK, k_BGSK, v_BGSK)


def grouped_attention(q_BTHK: jax.Array, k_BGSK: jax.Array, v_BGSK: jax.Array,
                      mask_TS: jax.Array) -> jax.Array:
  """`masked_attention` over keys and values laid out head-major, [B, G, S, K]: the layout
  olmo3.decode's KV cache keeps, so that no step copies the cache into it. Forward only."""
  return _grouped(mask_TS, q_BTHK, k_BGSK, v_BGSK)[0]


def _grouped(mask_TS, q_BTHK, k_BGSK, v_BGSK):
  t, g, k = q_BTHK.shape[1], k_BGSK.shape[1], q_BTHK.shape[3]
  accum = wide(q_BTHK.dtype)
  # Scaled before the matmul: a scalar inside it is a [U, S] operand XLA:CPU materialises.
  q_BGUK = _to_groups(q_BTHK, g) * k ** -0.5
  # The mask as an additive bias (0 or the most negative float, so a row with no visible key
  # averages them all, as a masked softmax does): XLA:CPU adds it in the scores' matmul, where
  # a select would be a pass of its own. Query row u = t·R + r repeats mask row t.
  bias_US = _per_group(jnp.repeat(jnp.where(mask_TS, 0.0, jnp.finfo(accum).min).astype(accum),
                                  q_BTHK.shape[2] // g, axis=-2))
  scores_BGUS = jnp.einsum("bguk,bgsk->bgus", q_BGUK, k_BGSK).astype(accum) + bias_US
  # Unnormalised probabilities and their row sums, kept for the backward pass; the output is
  # divided by the sums instead of the [U, S] probabilities.
  exp_BGUS = jnp.exp(scores_BGUS - xla_cpu.row_max(scores_BGUS, keepdims=True))
  sum_BGU1 = xla_cpu.row_sum(exp_BGUS, keepdims=True)
  out_BGUK = jnp.einsum("bgus,bgsk->bguk", exp_BGUS.astype(v_BGSK.dtype),
                        v_BGSK).astype(accum) / sum_BGU1
  # Whether a row sees a key. A masked score's exponential is 0 in such a row, so it gets no
  # gradient; a row that sees none averages the values whatever its scores: none of them do.
  seen_U1 = _per_group(jnp.repeat(mask_TS.any(axis=-1, keepdims=True), q_BTHK.shape[2] // g,
                                  axis=-2))
  out_BTHK = _from_groups(out_BGUK, t).astype(q_BTHK.dtype)
  return out_BTHK, (q_BGUK, k_BGSK, v_BGSK, exp_BGUS, sum_BGU1, seen_U1, out_BGUK)


def _attention_bwd(residuals, d_out_BTHK):
  q_BGUK, k_BGSK, v_BGSK, exp_BGUS, sum_BGU1, seen_U1, out_BGUK = residuals
  t, k, dtype = d_out_BTHK.shape[1], q_BGUK.shape[3], q_BGUK.dtype
  d_out_BGUK = _to_groups(d_out_BTHK, q_BGUK.shape[1]).astype(exp_BGUS.dtype)
  # The softmax's gradient, p · (dp - Σ_s p·dp), with Σ_s p·dp = Σ_k out·d_out: a [U, K] sum
  # instead of a [U, S] one.
  d_p_BGUS = jnp.einsum("bguk,bgsk->bgus", d_out_BGUK.astype(dtype), v_BGSK).astype(
      exp_BGUS.dtype)
  d_scores_BGUS = (exp_BGUS * (d_p_BGUS - (d_out_BGUK * out_BGUK).sum(axis=-1, keepdims=True))
                   * jnp.where(seen_U1, 1 / sum_BGU1, 0.0)).astype(dtype)
  d_q_BGUK = jnp.einsum("bgus,bgsk->bguk", d_scores_BGUS, k_BGSK) * k ** -0.5
  # Keys and values contract over U: [K, U] x [U, S], the [U, S] operand read in place.
  d_k_BGKS = jnp.einsum("bgku,bgus->bgks", _transposed(q_BGUK), d_scores_BGUS)
  d_v_BGKS = jnp.einsum("bgku,bgus->bgks", _transposed((d_out_BGUK / sum_BGU1).astype(dtype)),
                        exp_BGUS.astype(dtype))
  return (None, _from_groups(d_q_BGUK, t), d_k_BGKS.transpose(0, 3, 1, 2),
          d_v_BGKS.transpose(0, 3, 1, 2))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _attend_xla(q_BTHK, k_BSGK, v_BSGK, window, segments_BT, positions_T, segments_BS):
  mask = attention_mask(k_BSGK.shape[1], window, positions_T)
  if segments_BT is not None:
    mask = mask[None] & document_mask(segments_BT, segments_BS)
  return masked_attention(q_BTHK, k_BSGK, v_BSGK, mask)


def _attend_dot_product(q_BTHK, k_BSGK, v_BSGK, window, segments_BT, positions_T, segments_BS,
                        implementation):
  if implementation == "cudnn" and positions_T is not None:
    # Each shard's queries see keys up to their own positions: a causal mask offset by the
    # shard's place in the sequence, which jax.nn.dot_product_attention's cuDNN path cannot
    # take (only a top-left causal mask, or a dense one, which at 65,536 tokens does not fit).
    raise ValueError(f"model.attention='cudnn' cannot run with the sequence split over mesh axes "
                     f"{sequence_axes()} (context parallelism); use 'splash' (TPU), "
                     "'dot_product' or 'xla', or mesh sequence size 1")
  if segments_BT is not None and implementation == "cudnn":
    # jax.nn.dot_product_attention's cuDNN path takes documents only as a dense mask, which at
    # stage 3's lengths does not fit (65,536^2 per row).
    raise ValueError("model.attention='cudnn' cannot mask documents (packed instances); use "
                     "'dot_product' or 'splash'")
  if positions_T is not None:  # queries at their positions: the mask says which keys
    mask = attention_mask(k_BSGK.shape[1], window, positions_T)[None, None]
    if segments_BT is not None:
      mask = mask & document_mask(segments_BT, segments_BS)[:, None]
    return jax.nn.dot_product_attention(q_BTHK, k_BSGK, v_BSGK, scale=q_BTHK.shape[-1] ** -0.5,
                                        mask=mask, implementation=implementation)
  # local_window_size=(left, right) counts keys besides the query: W visible keys => W - 1.
  return jax.nn.dot_product_attention(
      q_BTHK, k_BSGK, v_BSGK, scale=q_BTHK.shape[-1] ** -0.5, is_causal=True,
      mask=None if segments_BT is None else document_mask(segments_BT)[:, None],
      local_window_size=None if window is None else (window - 1, 0),
      implementation=implementation)


SPLASH_LANES = 128  # splash's query blocks are multiples of this (a TPU vector's lanes)


def _splash_mask(seq_len: int, window: int | None, positions_T: np.ndarray):
  """Splash's causal (sliding-window) mask with query row j at position positions_T[j] and keys
  at 0..S-1, computed inside the kernel; splash skips the blocks it masks whole."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  class PositionedCausalMask(sm._ComputableMask):  # pylint: disable=protected-access
    # splash's own CausalMask / LocalMask with q_sequence set to the queries' positions (its
    # mask function receives q_sequence's entries as the query ids); they compare unequal to
    # any mask whose positions differ, so block sparsity is computed for these positions.
    def __init__(self):
      def visible(q_ids, kv_ids):
        seen = kv_ids <= q_ids
        return seen if window is None else seen & (kv_ids > q_ids - window)

      super().__init__((len(positions_T), seq_len), visible)
      self.q_sequence = np.asarray(positions_T, np.int32)

    def __eq__(self, other):
      return (isinstance(other, PositionedCausalMask) and self.shape == other.shape
              and np.array_equal(self.q_sequence, other.q_sequence))

    def __hash__(self):
      return hash((self.shape, window, self.q_sequence.tobytes()))

  return PositionedCausalMask()


def _whole_keys(k_BGSK, v_BGSK, segments, axes, inverse_S):
  """Inside splash's shard_map: a shard's keys, values and key documents gathered whole along
  the sequence's mesh `axes` (if any) and put in position order (`inverse_S`, if any)."""
  if axes is not None:
    k_BGSK, v_BGSK = (checkpoint_name(jax.lax.all_gather(x, axes, axis=2, tiled=True),
                                      Name.GATHERED_KV) for x in (k_BGSK, v_BGSK))
    if segments:
      segments = (segments[0], jax.lax.all_gather(segments[1], axes, axis=1, tiled=True))
  if inverse_S is not None:
    k_BGSK, v_BGSK = k_BGSK[:, :, inverse_S], v_BGSK[:, :, inverse_S]
    if segments:
      segments = (segments[0], segments[1][:, inverse_S])
  return k_BGSK, v_BGSK, segments


def _attend_splash(q_BTHK, k_BSGK, v_BSGK, window, segments_BT, positions_T, segments_BS,
                   block: int, heads_over_sequence: bool, keys_split: bool, chunk_rows: bool):
  """Pallas splash attention; interpret mode off TPU (for tests). shard_map'd over the mesh.
  Documents (`segments_BT`) go in as splash's segment ids. With context parallelism by
  gathering, each shard runs its own queries (at `positions_T`) against every key: the kernel
  is made for the whole sequence with q_seq_shards = the shards, each shard reading its part of
  the mask. `keys_split`: keys, values and their documents come split along the sequence as
  the queries are (laid out as `positions_T`) and are gathered inside the shard_map, then put
  in position order, so that their gradient is a reduce-scatter (gathered outside, the
  shard_map's transpose all-reduced the whole sequence's gradients: 34 GB a step of the 7B's
  stage 3). `heads_over_sequence` (all-to-all context parallelism): the sequence is whole on
  every device and the heads are split over the sequence's mesh axes too. `chunk_rows`: each
  row is one chunk of a sequence (olmo3.halo), the rows split over the batch's and the
  sequence's mesh axes."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  from flax.core import spmd

  t, s, heads = q_BTHK.shape[1], k_BSGK.shape[1], q_BTHK.shape[2]
  inverse_S = None if positions_T is None or not keys_split else np.argsort(positions_T)
  mesh = jax.sharding.get_abstract_mesh()
  rules = spmd.get_logical_axis_rules()
  on_mesh = not mesh.empty and bool(rules)
  spec = logical_to_spec(("batch", "act_heads", "seq", None), rules) if on_mesh else None
  q_shards = sequence_shards()
  if heads_over_sequence:
    batch, _, heads_axes, _ = heads_over_sequence_spec()
    spec, q_shards = jax.sharding.PartitionSpec(batch, heads_axes, None, None), 1
  elif chunk_rows:
    spec, q_shards = jax.sharding.PartitionSpec(chunk_rows_spec(), spec[1], None, None), 1
  if q_shards > 1 and positions_T is None:
    positions_T = np.arange(t)  # the mesh's contiguous split (Attention passes its own order)
  head_shards = 1
  if on_mesh and spec[1] is not None:
    head_shards = int(np.prod([mesh.shape[a] for a in
                               (spec[1] if isinstance(spec[1], tuple) else (spec[1],))]))
  block_q = min(block, t // q_shards)
  block_kv = min(block, s)
  if (t // q_shards) % block_q or s % block_kv:
    raise ValueError(f"splash attention needs each shard's {t // q_shards} queries and the "
                     f"{s} keys divisible by its block ({block}, model.splash_block)")
  sizes = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                        block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
                        block_q_dq=block_q, block_kv_dq=block_kv)
  if positions_T is None:
    one = sm.CausalMask((t, s)) if window is None else sm.LocalMask(
        (t, s), window_size=(window - 1, 0), offset=0)
  else:
    one = _splash_mask(s, window, positions_T)
  # The kernel holds its mask's block layout as arrays, split over query shards and heads.
  splash = sk.make_splash_mha(sm.MultiHeadMask([one] * heads), block_sizes=sizes,
                              head_shards=head_shards, q_seq_shards=q_shards,
                              interpret=platforms.compile_target() != "tpu")

  def kernel(splash, q_BHTK, k_BGSK, v_BGSK, *segments):
    if keys_split:
      k_BGSK, v_BGSK, segments = _whole_keys(k_BGSK, v_BGSK, segments,
                                             spec[2] if on_mesh else None, inverse_S)
    if not segments:
      return jax.vmap(splash)(q_BHTK, k_BGSK, v_BGSK)
    return jax.vmap(lambda q, k, v, ids_q, ids_k: splash(
        q, k, v, segment_ids=sk.SegmentIds(ids_q, ids_k)))(q_BHTK, k_BGSK, v_BGSK, *segments)

  scale = q_BTHK.shape[-1] ** -0.5  # splash does not scale the logits itself
  q, k, v = ((x.transpose(0, 2, 1, 3)) for x in (q_BTHK * scale, k_BSGK, v_BSGK))
  segments = () if segments_BT is None else (
      segments_BT, segments_BT if segments_BS is None else segments_BS)
  if on_mesh:
    P = jax.sharding.PartitionSpec
    # Every key on each sequence shard, or the shard's own (`keys_split`: gathered inside).
    kv_spec = spec if keys_split else P(spec[0], spec[1], None, None)
    splash_spec = splash.manual_sharding_spec(jax.sharding.NamedSharding(mesh, P(spec[1],
                                                                                 spec[2])))
    kernel = jax.shard_map(kernel, mesh=mesh,
                           in_specs=(splash_spec, spec, kv_spec, kv_spec)
                           + ((P(spec[0], spec[2]), P(spec[0], kv_spec[2])) if segments
                              else ()),
                           out_specs=spec, check_vma=False)
  return kernel(splash, q, k, v, *segments).transpose(0, 2, 1, 3)


def attend(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, window: int | None,
           kernel: AttentionKernel, segments_BT: jax.Array | None = None, *,
           positions_T: np.ndarray | None = None, segments_BS: jax.Array | None = None,
           heads_over_sequence: bool = False, keys_split: bool = False,
           chunk_rows: bool = False, splash_block: int = 512) -> jax.Array:
  """Causal (sliding-window when `window` is set) grouped-query attention; with `segments_BT`
  (a document id per token of a packed instance), never across documents.

  Queries are at positions 0..T-1 and keys at 0..S-1 (S = T), or, with `positions_T` (context
  parallelism: the queries laid out across the sequence's shards), query row j is at position
  positions_T[j], the keys still at 0..S-1 with their documents `segments_BS`.
  `keys_split` (splash only): keys, values and `segments_BS` are split along the sequence and
  laid out as the queries are; the kernel gathers them itself.
  `heads_over_sequence`: the inputs are laid out for all-to-all context parallelism
  (olmo3.sharding.heads_over_sequence_spec), which the splash kernel's shard_map must know;
  `chunk_rows`: each row is one chunk of a sequence, the rows split over the batch's and the
  sequence's mesh axes (olmo3.halo), as the splash kernel's shard_map must know too.
  The other kernels follow their inputs' sharding."""
  args = (q_BTHK, k_BSGK, v_BSGK, window, segments_BT, positions_T, segments_BS)
  if keys_split and kernel is not AttentionKernel.SPLASH:
    raise ValueError(f"the {kernel.value} kernel reads keys gathered whole (keys_split is "
                     "splash's)")
  match kernel:
    case AttentionKernel.XLA:
      return _attend_xla(*args)
    case AttentionKernel.DOT_PRODUCT:
      return _attend_dot_product(*args, None)
    case AttentionKernel.CUDNN:
      return _attend_dot_product(*args, "cudnn")
    case AttentionKernel.SPLASH:
      return _attend_splash(*args, splash_block, heads_over_sequence, keys_split, chunk_rows)
  raise ValueError(f"unknown attention kernel {kernel!r}")
