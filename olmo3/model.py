"""The OLMo 3 transformer in Flax NNX, top to bottom (docs/architecture.md).

Shapes in names: B batch, T query positions, S key positions, D d_model, H query heads,
G key/value heads, R = H / G, U = T·R (a key/value head's queries), K head dim, F MLP hidden,
V padded vocabulary, L layers.

Parameters are float32; matmuls run in `cfg.compute_dtype`; norms, RoPE and softmax run in
float32. A float64 model (`DType.FLOAT64`, for parity checks below float32 rounding; it needs
`jax_enable_x64`) holds float64 parameters and runs everything in float64. Parameter paths
follow Hugging Face's names, so conversion is a mechanical mapping.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from olmo3.config import AttentionKernel, DType, ModelConfig, RopePositions, Yarn
from olmo3 import remat as remat_lib
from olmo3.remat import Name
from olmo3.sharding import constrain, logical_to_spec, sequence_axes, sequence_shards


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


def wide(dtype: jnp.dtype) -> jnp.dtype:
  """What norms, RoPE, softmax and losses compute in: float32, or float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


def _dense(cfg: ModelConfig, d_in: int, d_out: int, names: tuple[str, str], rngs: nnx.Rngs):
  return nnx.Linear(
      d_in, d_out, use_bias=False, dtype=jnp.dtype(cfg.compute_dtype.value),
      param_dtype=param_dtype(cfg),
      kernel_init=nnx.with_partitioning(truncated_normal(cfg.init_std, cfg.init_cutoff), names),
      rngs=rngs)


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
    if order_T is not None and not _in_order(order_T):
      return cos_TK[order_T], sin_TK[order_T]
    return cos_TK, sin_TK

  ropes = {False: tables(None)}
  if cfg.rope_scaling is not None:
    ropes[True] = tables(cfg.rope_scaling)
  return ropes


# --- attention kernels -------------------------------------------------------------------------


def _in_order(order_T: np.ndarray) -> bool:
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
  KV-cache decode (olmo3.sample.decode: queries at later positions).

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
  t, g, k = q_BTHK.shape[1], k_BSGK.shape[2], q_BTHK.shape[3]
  accum = wide(q_BTHK.dtype)
  # Scaled before the matmul: a scalar inside it is a [U, S] operand XLA:CPU materialises.
  q_BGUK = _to_groups(q_BTHK, g) * k ** -0.5
  k_BGSK, v_BGSK = k_BSGK.transpose(0, 2, 1, 3), v_BSGK.transpose(0, 2, 1, 3)
  # The mask as an additive bias (0 or the most negative float, so a row with no visible key
  # averages them all, as a masked softmax does): XLA:CPU adds it in the scores' matmul, where
  # a select would be a pass of its own. Query row u = t·R + r repeats mask row t.
  bias_US = _per_group(jnp.repeat(jnp.where(mask_TS, 0.0, jnp.finfo(accum).min).astype(accum),
                                  q_BTHK.shape[2] // g, axis=-2))
  scores_BGUS = jnp.einsum("bguk,bgsk->bgus", q_BGUK, k_BGSK).astype(accum) + bias_US
  # Unnormalised probabilities and their row sums, kept for the backward pass; the output is
  # divided by the sums instead of the [U, S] probabilities.
  exp_BGUS = jnp.exp(scores_BGUS - scores_BGUS.max(axis=-1, keepdims=True))
  sum_BGU1 = exp_BGUS.sum(axis=-1, keepdims=True)
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


def _targets_tpu() -> bool:
  """Compiling for TPUs: the mesh's devices (a TPU topology compiled from a CPU host counts)."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None) if not mesh.empty else None
  return (device.platform if device is not None else jax.default_backend()) == "tpu"


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


def _attend_splash(q_BTHK, k_BSGK, v_BSGK, window, segments_BT, positions_T, segments_BS,
                   block: int):
  """Pallas splash attention; interpret mode off TPU (for tests). shard_map'd over the mesh.
  Documents (`segments_BT`) go in as splash's segment ids. With context parallelism each
  shard runs its own queries (at `positions_T`) against every key: the kernel is made for the
  whole sequence with q_seq_shards = the shards, each shard reading its part of the mask."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  from flax.core import spmd

  t, s, heads = q_BTHK.shape[1], k_BSGK.shape[1], q_BTHK.shape[2]
  mesh = jax.sharding.get_abstract_mesh()
  rules = spmd.get_logical_axis_rules()
  on_mesh = not mesh.empty and bool(rules)
  spec = logical_to_spec(("batch", "act_heads", "seq", None), rules) if on_mesh else None
  q_shards = sequence_shards()
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
                              interpret=not _targets_tpu())

  def kernel(splash, q_BHTK, k_BGSK, v_BGSK, *segments):
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
    kv_spec = P(spec[0], spec[1], None, None)  # every key on each sequence shard
    splash_spec = splash.manual_sharding_spec(jax.sharding.NamedSharding(mesh, P(spec[1],
                                                                                 spec[2])))
    kernel = jax.shard_map(kernel, mesh=mesh,
                           in_specs=(splash_spec, spec, kv_spec, kv_spec)
                           + ((P(spec[0], spec[2]), P(spec[0], None)) if segments else ()),
                           out_specs=spec, check_vma=False)
  return kernel(splash, q, k, v, *segments).transpose(0, 2, 1, 3)


def attend(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, window: int | None,
           kernel: AttentionKernel, segments_BT: jax.Array | None = None, *,
           positions_T: np.ndarray | None = None, segments_BS: jax.Array | None = None,
           splash_block: int = 512) -> jax.Array:
  """Causal (sliding-window when `window` is set) grouped-query attention; with `segments_BT`
  (a document id per token of a packed instance), never across documents.

  Queries are at positions 0..T-1 and keys at 0..S-1 (S = T), or, with `positions_T` (context
  parallelism: the queries laid out across the sequence's shards), query row j is at position
  positions_T[j], the keys still at 0..S-1 with their documents `segments_BS`."""
  args = (q_BTHK, k_BSGK, v_BSGK, window, segments_BT, positions_T, segments_BS)
  match kernel:
    case AttentionKernel.XLA:
      return _attend_xla(*args)
    case AttentionKernel.DOT_PRODUCT:
      return _attend_dot_product(*args, None)
    case AttentionKernel.CUDNN:
      return _attend_dot_product(*args, "cudnn")
    case AttentionKernel.SPLASH:
      return _attend_splash(*args, splash_block)
  raise ValueError(f"unknown attention kernel {kernel!r}")


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
    q_BTHK, k_BSGK, v_BSGK = self.qkv(x_BTD, rope)
    segments_BS = None
    if order_T is not None:
      # Context parallelism: each shard keeps its queries and reads every key, so keys, values
      # (and their documents) are gathered whole along the sequence, in position order (the
      # all-gather of OLMo-core's llama3-style context parallelism; its gradient a
      # reduce-scatter).
      inverse_S = None if _in_order(order_T) else np.argsort(order_T)
      whole = lambda x: x if inverse_S is None else x[:, inverse_S]
      k_BSGK, v_BSGK = (constrain(whole(x), ("batch", None, "act_heads", None))
                        for x in (k_BSGK, v_BSGK))
      if segments_BT is not None:
        segments_BS = constrain(whole(segments_BT), ("batch", None))
    out_BTHK = attend(q_BTHK, k_BSGK, v_BSGK, window, cfg.attention, segments_BT,
                      positions_T=order_T, segments_BS=segments_BS,
                      splash_block=cfg.splash_block)
    context = checkpoint_name(out_BTHK.reshape(b, t, cfg.n_heads * cfg.head_dim), Name.CONTEXT)
    return checkpoint_name(self.o_proj(context), Name.OUT_PROJ)

  def qkv(self, x_BTD: jax.Array, rope: tuple[jax.Array, jax.Array]
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries [B, T, H, K], keys and values [B, T, G, K] as attention reads them (keys and
    values are also what olmo3.sample.decode's KV cache holds)."""
    cfg = self.cfg
    b, t, _ = x_BTD.shape
    q = self.q_norm(checkpoint_name(self.q_proj(x_BTD), Name.QUERY_PROJ))
    k = self.k_norm(checkpoint_name(self.k_proj(x_BTD), Name.KEY_PROJ))
    v = checkpoint_name(self.v_proj(x_BTD), Name.VALUE_PROJ)
    heads = ("batch", "seq", "act_heads", None)
    q_BTHK = constrain(apply_rope(q.reshape(b, t, cfg.n_heads, cfg.head_dim), *rope), heads)
    k_BTGK = constrain(apply_rope(k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim), *rope), heads)
    v_BTGK = constrain(v.reshape(b, t, cfg.n_kv_heads, cfg.head_dim), heads)
    return q_BTHK, k_BTGK, v_BTGK


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)). gate/up/down are OLMo-core's w1/w3/w2."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.gate_proj = _dense(cfg, cfg.d_model, cfg.mlp_hidden, ("embed", "mlp"), rngs)
    self.up_proj = _dense(cfg, cfg.d_model, cfg.mlp_hidden, ("embed", "mlp"), rngs)
    self.down_proj = _dense(cfg, cfg.mlp_hidden, cfg.d_model, ("mlp", "embed"), rngs)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    gate_BTF = checkpoint_name(self.gate_proj(x_BTD), Name.MLPWI_0)
    up_BTF = checkpoint_name(self.up_proj(x_BTD), Name.MLPWI_1)
    hidden_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, ("batch", "seq", "act_mlp"))
    return checkpoint_name(self.down_proj(hidden_BTF), Name.MLPWO)


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
    ropes = layer_ropes(cfg, tokens_BT.shape[1], segments_BT, order_T)
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
