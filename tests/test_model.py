import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo3 import config, sharding
from olmo3 import attention as attention_lib
from olmo3 import halo as halo_lib
from olmo3 import model as model_lib
from olmo3.config import AttentionKernel
from olmo3.placement import ShardedModel

from conftest import random_params

MICRO = config.olmo3_micro()  # 6 layers (not a multiple of 4), GQA 8 q heads / 2 kv heads


def _tokens(cfg, batch, seq_len, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq_len)))


@pytest.fixture(scope="module")
def micro_params():
  return random_params(MICRO, seed=1)


def test_attention_mask_window_counts_the_query_itself():
  mask = np.asarray(attention_lib.attention_mask(8, window=3))
  assert mask[5].nonzero()[0].tolist() == [3, 4, 5]  # exactly W keys, the query's own included
  assert mask[1].nonzero()[0].tolist() == [0, 1]
  assert mask.sum(1).max() == 3
  causal = np.asarray(attention_lib.attention_mask(8, window=None))
  assert (causal == np.tril(np.ones((8, 8), bool))).all()


def test_dot_product_local_window_matches_our_window():
  # jax.nn.dot_product_attention's local_window_size=(W-1, 0) is our W-key window (docs/performance.md#attention-kernels).
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 12, 2, 8)), jnp.float32) for _ in range(3))
  for window in (1, 3, 5):
    ours = attention_lib.attend(q, k, v, window, AttentionKernel.XLA)
    theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla",
                                          local_window_size=(window - 1, 0))
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
  off_by_one = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(3, 0))
  assert np.abs(np.asarray(attention_lib.attend(q, k, v, 3, AttentionKernel.XLA) - off_by_one)).max() > 1e-3


def _kernels_on_this_backend():
  kernels = [AttentionKernel.DOT_PRODUCT, AttentionKernel.SPLASH]  # splash: interpret mode off TPU
  if jax.default_backend() == "gpu":
    kernels.append(AttentionKernel.CUDNN)  # cuDNN only exists on GPUs
  return kernels


@pytest.mark.parametrize("kernel", _kernels_on_this_backend())
@pytest.mark.parametrize("window", [None, 1, 16, 37])
def test_attention_kernels_equal_xla(kernel, window):
  rng = np.random.default_rng(0)
  dtype = jnp.bfloat16 if kernel == AttentionKernel.CUDNN else jnp.float32
  q = jnp.asarray(rng.standard_normal((2, 128, 8, 16)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((2, 128, 2, 16)), dtype) for _ in range(2))
  ref = attention_lib.attend(q, k, v, window, AttentionKernel.XLA)
  out = attention_lib.attend(q, k, v, window, kernel)
  tol = 2e-2 if dtype == jnp.bfloat16 else 2e-6
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol)


def _plain_attention(q, k, v, mask):
  """Grouped-query attention as autodiff sees it: keys and values repeated, a masked softmax."""
  r = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
  scores = jnp.einsum("bthk,bshk->bhts", q, k) * q.shape[-1] ** -0.5
  scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  return jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, axis=-1), v)


@pytest.mark.parametrize("window", [None, 5])
def test_xla_attention_gradient_equals_autodiff_of_a_masked_softmax(window):
  """masked_attention's hand-written gradient (its custom VJP) against jax.grad of the plain
  formula, in float64 so that only a wrong formula can differ; a row that sees no key (the
  decode's padding) gets the plain formula's zero gradient too."""
  with jax.enable_x64():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 24, 6, 8)))
    k, v = (jnp.asarray(rng.standard_normal((2, 24, 2, 8))) for _ in range(2))
    mask = attention_lib.attention_mask(24, window).at[3].set(False)
    weights = jnp.asarray(rng.standard_normal((2, 24, 6, 8)))

    def loss(fn):
      return lambda q, k, v: jnp.sum(fn(q, k, v, mask) * weights)

    ours = jax.value_and_grad(loss(attention_lib.masked_attention), argnums=(0, 1, 2))(q, k, v)
    plain = jax.value_and_grad(loss(_plain_attention), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(ours[0], plain[0], rtol=1e-12)
    for a, b in zip(ours[1], plain[1]):
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel", _kernels_on_this_backend())
@pytest.mark.seconds(5)
def test_model_with_each_kernel_equals_xla(kernel, micro_params):
  tokens = _tokens(MICRO, 2, 128)
  ref = model_lib.from_params(MICRO, micro_params)(tokens)
  out = model_lib.from_params(MICRO.replace(attention=kernel), micro_params)(tokens)
  np.testing.assert_allclose(out, ref, atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("n_layers", [4, 6, 9])
@pytest.mark.seconds(4)
def test_scanned_and_unrolled_layers_agree(n_layers):
  cfg = MICRO.replace(n_layers=n_layers)
  params = random_params(cfg, seed=2)
  tokens = _tokens(cfg, 2, 40)
  scanned, h_scanned = model_lib.from_params(cfg, params)(tokens, return_hidden=True)
  unrolled, h_unrolled = model_lib.from_params(cfg.replace(scan_layers=False), params)(
      tokens, return_hidden=True)
  assert h_scanned.shape == (n_layers, 2, 40, cfg.d_model)
  np.testing.assert_allclose(scanned, unrolled, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(h_scanned, h_unrolled, atol=2e-5, rtol=1e-5)


@pytest.mark.seconds(5)
def test_init_is_truncated_normal_and_float32():
  cfg = MICRO.replace(d_model=256, n_heads=4, n_kv_heads=4, mlp_hidden=512, n_layers=2)
  with sharding.use_mesh(sharding.make_mesh(devices=jax.devices()[:1])):
    model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
  for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
    assert leaf.dtype == jnp.float32
  w = np.asarray(model.layers.mlp.gate_proj.kernel[...])
  assert np.abs(w).max() <= 0.06 + 1e-7  # cut at ±3σ
  assert np.abs(w).max() > 0.055
  # std of N(0, 0.02²) truncated at ±3σ is 0.02 · 0.9866 (torch.nn.init.trunc_normal_'s law).
  assert w.std() == pytest.approx(0.02 * 0.9866, rel=0.01)
  assert (np.asarray(model.layers.post_attention_layernorm.weight[...]) == 1).all()
  # Layers are initialised independently.
  assert not np.allclose(w[0], w[1])


def test_every_parameter_has_logical_axis_names():
  specs = nnx.get_partition_spec(nnx.state(model_lib.abstract_model(MICRO), nnx.Param))
  for path, leaf in jax.tree_util.tree_flatten_with_path(model_lib.param_shapes(MICRO))[0]:
    names = specs
    for key in path:
      names = names[key.key]
    names = names.get_metadata()["out_sharding"]
    assert len(names) == len(leaf.shape) and all(isinstance(n, str) for n in names), path
    if path[0].key == "layers":
      assert names[0] == "layers"


@pytest.mark.seconds(7)
def test_bfloat16_compute_keeps_float32_params(micro_params):
  model = model_lib.from_params(MICRO.replace(compute_dtype="bfloat16"), micro_params)
  logits = model(_tokens(MICRO, 1, 20))
  assert logits.dtype == jnp.bfloat16
  assert model.lm_head.kernel[...].dtype == jnp.float32


def test_remat_points_are_named(micro_params):
  model = model_lib.from_params(MICRO, micro_params)
  graphdef, state = nnx.split(model)
  jaxpr = str(jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, _tokens(MICRO, 1, 8)))
  for name in ("query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0",
               "mlpwi_1", "mlpwo", "decoder_layer_input"):
    assert f"name={name}" in jaxpr, name


def test_out_of_vocabulary_ids_are_rejected(micro_params):
  model = model_lib.from_params(MICRO, micro_params)
  tokens = np.zeros((2, 10), np.int32)
  tokens[1, 7] = MICRO.vocab_size  # a padding row: valid index, invalid token
  with pytest.raises(ValueError, match=r"token id 500 at index \(1, 7\) is outside the vocabulary"):
    model(tokens)
  with pytest.raises(ValueError, match="token id -1"):
    model(np.full((1, 3), -1))
  # Under jit the ids are abstract: a bad id must poison the output, never read a padding row.
  logits = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens))
  assert np.isnan(np.asarray(logits[1, 7])).all() and np.isfinite(np.asarray(logits[0])).all()


@pytest.mark.parametrize("shape", [{"data": 2, "fsdp": 4}, {"fsdp": 4, "sequence": 2}],
                         ids=["data2_fsdp4", "fsdp4_sequence2"])
@pytest.mark.seconds(10)
def test_sharded_on_8_devices_equals_one_device(micro_params, shape):
  tokens = _tokens(MICRO, 8, 32)
  ref = model_lib.from_params(MICRO, micro_params)(tokens)
  mesh = sharding.make_mesh(shape)
  with sharding.use_mesh(mesh):
    model = model_lib.Transformer(MICRO, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.State(micro_params))
    state = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(state)
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)
    nnx.update(model, jax.device_put(state, shardings))
    assert model.layers.mlp.gate_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec(
        None, ("fsdp", "sequence"), "tensor")
    out = nnx.jit(lambda m, t: m(t))(model, tokens)
  np.testing.assert_allclose(out, ref, atol=5e-5, rtol=1e-5)


# --- context parallelism --------------------------------------------------------------------------


def _cp_inputs(cfg, batch, seq_len):
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (batch, seq_len)), jnp.int32)
  labels = jnp.asarray(rng.integers(-1, cfg.vocab_size, (batch, seq_len)), jnp.int32)
  # Documents of uneven lengths crossing the shards' boundaries (and the window).
  segments = jnp.asarray(np.sort(rng.integers(0, 5, (batch, seq_len)), axis=1), jnp.int32)
  return tokens, labels, segments


def _loss_and_grads(sm, params, tokens, labels, segments):
  """Each position's loss and the gradient of their sum, on `sm`'s mesh, fetched to the host."""
  def f(p, t, l, s):
    per_token = sm.token_losses(p, t, l, s)
    return per_token.nll_BT.sum() + 1e-2 * per_token.lse_BT.sum(), per_token.nll_BT

  with sm.context():
    (_, nll), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params, tokens, labels, segments)
  return jax.device_get((nll, grads))


@functools.lru_cache(maxsize=None)
def _one_device(cfg, seq_len):
  """(parameters, inputs, one device's losses and gradients) for `cfg`: shared by the cases
  of one model (the context-parallel strategy does not matter on one device)."""
  one = ShardedModel(cfg, sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
  params = jax.device_get(one.init_params(0))
  inputs = _cp_inputs(cfg, 2, seq_len)
  return params, inputs, _loss_and_grads(one, params, *inputs)


MHA = {"n_kv_heads": 8}  # all-to-all context parallelism splits the key/value heads 4 or 8 ways
# Splash runs in interpret mode here: one group of layers (3 sliding, 1 global) is enough.
ONE_GROUP = {"n_layers": 4}


@pytest.mark.parametrize("kernel, shape, seq_len, cp, heads", [
    ("xla", {"fsdp": 2, "sequence": 4}, 64, "all_gather", {}),
    ("xla", {"data": 2, "sequence": 2, "tensor": 2}, 64, "all_gather", {}),
    ("xla", {"sequence": 8}, 64, "all_gather", {}),
    ("dot_product", {"fsdp": 2, "sequence": 4}, 64, "all_gather", {}),
    # Splash (interpret mode) tiles 128 queries a block: 1024 tokens over 4 shards, chunks of
    # 128 (the sliding layers read a halo, the global ones gather).
    ("splash", {"sequence": 4, "tensor": 2}, 1024, "all_gather", ONE_GROUP),
    ("xla", {"fsdp": 4, "sequence": 2}, 64, "all_to_all", {}),  # grouped-query: 2 kv heads
    ("xla", {"fsdp": 2, "sequence": 4}, 64, "all_to_all", MHA),
    ("xla", {"data": 2, "sequence": 2, "tensor": 2}, 64, "all_to_all", MHA),
    ("splash", {"sequence": 4, "tensor": 2}, 256, "all_to_all", {**MHA, **ONE_GROUP}),
    # (All-to-all over 8 is tests/test_context_parallel.py's, in float64 through the step.)
])
@pytest.mark.seconds(8)
def test_context_parallel_equals_one_device(kernel, shape, seq_len, cp, heads):
  """Per-token losses and gradients with the sequence split over the mesh (and the batch or
  heads over other axes) equal one device's, for both strategies: packed documents,
  per-document RoPE positions, sliding and global layers, every query shard balanced
  (gathering) or the sequence whole for a share of the heads (all-to-all). A mask that ignores
  a shard's place in the sequence, keys that stay sharded, or heads swapped out of order, fail
  this."""
  cfg = MICRO.replace(attention=AttentionKernel(kernel), splash_block=128,
                      rope_positions=config.RopePositions.DOCUMENT,
                      context_parallel=config.ContextParallel(cp), **heads)
  params, inputs, (ref_nll, ref_grads) = _one_device(
      cfg.replace(context_parallel=config.ContextParallel.ALL_GATHER), seq_len)
  nll, grads = _loss_and_grads(ShardedModel(cfg, sharding.make_mesh(shape)), params, *inputs)
  np.testing.assert_allclose(nll, ref_nll, rtol=2e-5, atol=2e-5)
  for path, g, ref in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(grads),
                          jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(),
                               err_msg=jax.tree_util.keystr(path[0]))


def _gathered_and_swapped(cfg, mesh, seq_len=64):
  """The compiled loss-and-gradient program on `mesh`: the element types of its all-gathers,
  and how many all-to-alls it runs."""
  sm = ShardedModel(cfg, mesh)
  params = jax.device_get(ShardedModel(cfg, sharding.make_mesh(
      {"fsdp": 1}, devices=jax.devices()[:1])).init_params(0))

  def f(p, t, l, s):
    return sm.token_losses(p, t, l, s).nll_BT.sum()

  with sm.context():
    text = jax.jit(jax.grad(f)).lower(params, *_cp_inputs(cfg, 2, seq_len)).compile().as_text()
  return (re.findall(r"= (\w+)\[[\d,]*\]\S* all-gather\(", text),
          len(re.findall(r" all-to-all\(", text)))


@pytest.mark.parametrize("kernel", ["xla"])
def test_all_to_all_context_parallelism_swaps_sequence_for_heads_and_gathers_no_keys(kernel):
  """What the compiled program moves, forward and backward: all-to-all context parallelism
  swaps the split with all-to-alls and gathers no activation along the sequence (only the
  documents' ids, for the mask); gathering keys and values is the other strategy's. (Left
  free, the partitioner gathered the attention output's gradient whole along the heads.)"""
  cfg = MICRO.replace(attention=AttentionKernel(kernel), **MHA,
                      context_parallel=config.ContextParallel.ALL_TO_ALL)
  mesh = sharding.make_mesh({"sequence": 8})  # no fsdp: parameters are never gathered
  gathered, swaps = _gathered_and_swapped(cfg, mesh)
  assert swaps > 0 and set(gathered) <= {"s32"}, (gathered, swaps)
  gathered, swaps = _gathered_and_swapped(
      cfg.replace(context_parallel=config.ContextParallel.ALL_GATHER), mesh)
  assert swaps == 0 and "f32" in gathered, (gathered, swaps)  # keys and values, all-gathered


def test_all_to_all_refuses_a_degree_that_does_not_divide_the_kv_heads_in_one_line():
  cfg = MICRO.replace(context_parallel=config.ContextParallel.ALL_TO_ALL)  # 2 kv heads
  sm = ShardedModel(cfg, sharding.make_mesh({"fsdp": 2, "sequence": 4}))
  tokens, labels, _ = _cp_inputs(cfg, 2, 64)
  with sm.context(), pytest.raises(ValueError, match=r"mesh axes \('sequence',\): all-to-all "
                                   r"context parallelism splits the heads 4 ways .* which does "
                                   r"not divide 2 heads"):
    jax.eval_shape(sm.token_losses, sm.param_shapes, tokens, labels)


def _causal_pairs(positions, window=None):
  keys = positions + 1 if window is None else np.minimum(positions + 1, window)
  return int(keys.sum())


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_the_balanced_order_gives_every_shard_the_same_causal_work(shards):
  order = sharding.balanced_order(64, shards)
  assert sorted(order.tolist()) == list(range(64))
  per_shard = order.reshape(shards, -1)
  assert len({_causal_pairs(p) for p in per_shard}) == 1
  # The mesh's contiguous split is what it balances: the last shard does shards² / ... more.
  contiguous = np.arange(64).reshape(shards, -1)
  assert _causal_pairs(contiguous[-1]) > 2 * _causal_pairs(contiguous[0])
  with pytest.raises(ValueError, match="multiple of 16"):
    sharding.balanced_order(72, 8)


def _received(halo, shards, slots):
  """Which chunks (by place in the sequence) each shard's slots receive, hop by hop, running
  the halo's permutes on the chunk numbers as the devices would (-1: none)."""
  order = sharding.balanced_order(shards * slots * halo.chunk, shards)
  held = order[::halo.chunk].reshape(shards, slots) // halo.chunk
  got = -np.ones((shards, slots, halo.hops), int)
  for to_slot, hop, from_slot, pairs in halo.permutes:
    for source, dest in pairs:
      assert got[dest, to_slot, hop - 1] == -1  # one sender a chunk
      got[dest, to_slot, hop - 1] = held[source, from_slot]
  return held, got


@pytest.mark.parametrize("seq_len, shards, window, chunk, hops", [
    (65536, 8, 4096, 4096, 1),  # the 7B's stage 3: one chunk a slot, a seventh of gathering
    (64, 4, 16, 8, 2), (512, 8, 128, 32, 4)])
def test_a_sliding_layer_receives_exactly_the_chunks_its_window_reaches(seq_len, shards, window,
                                                                          chunk, hops):
  plan = halo_lib.plan(sharding.balanced_order(seq_len, shards), shards, window)
  assert (plan.chunk, plan.hops, plan.slots) == (chunk, hops, 2)
  held, got = _received(plan, shards, 2)
  for hop in range(1, hops + 1):
    expected = np.where(held - hop >= 0, held - hop, -1)
    np.testing.assert_array_equal(got[..., hop - 1], expected)
    np.testing.assert_array_equal(np.asarray(plan.present)[..., hop - 1], expected >= 0)
  # The window's first key is within the chunks read, the last one read is needed.
  assert (hops - 1) * chunk < window - 1 <= hops * chunk


def test_layers_a_halo_would_not_save_gather_whole():
  order = sharding.balanced_order(64, 4)
  assert halo_lib.plan(order, 4, None) is None  # a global layer reads every key
  assert halo_lib.plan(order, 4, 17).hops == 2  # 16 keys back: two chunks of 8
  assert halo_lib.plan(order, 4, 18) is None  # 17: three chunks, as many as gathering reads
  assert halo_lib.plan(np.arange(64), 1, 16) is None
  assert halo_lib.plan(np.arange(64), 4, 16).slots == 1  # the mesh's contiguous split


def test_sliding_layers_move_a_halo_not_the_whole_sequence(monkeypatch):
  """What the compiled program moves with the sequence over 8 and gathering: sliding layers
  permute the chunks their window reaches; gathering them whole (the halo switched off) moves
  more, by over 1.5 times what the halo moves. Equal losses are
  test_context_parallel_equals_one_device's."""
  from olmo3.train import aot

  cfg = MICRO.replace(context_parallel=config.ContextParallel.ALL_GATHER)
  mesh = sharding.make_mesh({"sequence": 8})

  def moved():
    sm = ShardedModel(cfg, mesh)
    with sm.context():
      text = jax.jit(jax.grad(lambda p, t, l, s: sm.token_losses(p, t, l, s).nll_BT.sum())).lower(
          sm.param_shapes, *_cp_inputs(cfg, 2, 128)).compile().as_text()
    return aot.collective_bytes(text)[0]

  halo = moved()
  monkeypatch.setattr(halo_lib, "plan", lambda *args: None)
  whole = moved()
  permuted = halo["collective-permute"]
  assert permuted > 0 and whole["collective-permute"] == 0, (halo, whole)
  # (The parameters' gathers, the same in both, are most of either at this size.)
  assert sum(whole.values()) - sum(halo.values()) > 1.5 * permuted, (halo, whole)


def test_splash_skips_the_same_number_of_blocks_on_every_query_shard():
  """What splash computes per shard is its mask's non-empty blocks: on the full-attention
  layers, the same count on every shard. (A sliding layer's queries see `window` keys each but
  the first `window` positions', fewer: shard 0 holds those, and the order cannot help it.)"""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  t, shards, block = 2048, 4, 128
  order = sharding.balanced_order(t, shards)
  for layout in (order, np.arange(t)):
    mask = attention_lib._splash_mask(t, None, layout)  # pylint: disable=protected-access
    kernel = sk.make_splash_mha(sm.MultiHeadMask([mask]), block_sizes=sk.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block), head_shards=1,
        q_seq_shards=shards, interpret=True)
    blocks = np.asarray(kernel.fwd_mask_info.block_mask)[0] > 0  # [q blocks, kv blocks]
    per_shard = blocks.reshape(shards, -1, blocks.shape[-1]).sum(axis=(1, 2))
    assert (per_shard.min() == per_shard.max()) == (layout is order), per_shard


def test_token_losses_lay_the_sequence_out_balanced():
  """The train step's and evaluation's loss gives the model the balanced layout, and returns
  each position's loss in position order."""
  seen = []

  class Spy(ShardedModel):
    def features(self, params, tokens, segments=None, order=None):
      seen.append(order)
      return super().features(params, tokens, segments, order)

  cfg = MICRO
  sm = Spy(cfg, sharding.make_mesh({"fsdp": 2, "sequence": 4}))
  tokens, labels, _ = _cp_inputs(cfg, 2, 64)
  with sm.context():
    jax.eval_shape(sm.token_losses, sm.param_shapes, tokens, labels)
  np.testing.assert_array_equal(seen[-1], sharding.balanced_order(64, 4))
  # All-to-all attends the whole sequence on each device: no layout, the mesh's own split.
  sm = Spy(cfg.replace(context_parallel=config.ContextParallel.ALL_TO_ALL),
           sharding.make_mesh({"fsdp": 4, "sequence": 2}))
  with sm.context():
    jax.eval_shape(sm.token_losses, sm.param_shapes, tokens, labels)
  assert seen[-1] is None


def test_cudnn_refuses_a_split_sequence_in_one_line():
  cfg = MICRO.replace(attention=AttentionKernel.CUDNN)
  sm = ShardedModel(cfg, sharding.make_mesh({"fsdp": 4, "sequence": 2}))
  tokens, labels, _ = _cp_inputs(cfg, 4, 64)
  with sm.context(), pytest.raises(ValueError, match=r"model.attention='cudnn' cannot run with "
                                   r"the sequence split over mesh axes \('sequence',\)"):
    jax.eval_shape(sm.token_losses, sm.param_shapes, tokens, labels)


# --- packed documents ----------------------------------------------------------------------------


def _packed_row(cfg, lengths, pad, seed=0):
  """One row packing documents of `lengths` then `pad` padding tokens, its segment ids (one per
  document, the padding its own) and each document's tokens alone."""
  rng = np.random.default_rng(seed)
  docs = [rng.integers(2, cfg.vocab_size, n) for n in lengths]
  tokens = np.concatenate(docs + [np.full(pad, cfg.pad_token_id)])
  segments = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)]
                            + [np.full(pad, len(lengths))])
  return jnp.asarray(tokens[None]), jnp.asarray(segments[None], jnp.int32), docs


@pytest.fixture(scope="module")
def packed_row(micro_params):
  """A 128-token row packing three documents (longer than the sliding window, so both masks
  act) and padding; its segment ids; each document's start and its logits alone (XLA)."""
  lengths = (40, 23, 49)
  tokens, segments, docs = _packed_row(MICRO, lengths, pad=16)
  alone = nnx.jit(lambda m, t: m(t))
  model = model_lib.from_params(MICRO, micro_params)
  starts = np.cumsum((0,) + lengths)[:-1]
  return tokens, segments, [(start, np.asarray(alone(model, jnp.asarray(doc[None])))[0])
                            for doc, start in zip(docs, starts)]


@pytest.mark.parametrize("kernel, positions", [
    (AttentionKernel.XLA, config.RopePositions.DOCUMENT),
    (AttentionKernel.XLA, config.RopePositions.INSTANCE),
    *((k, config.RopePositions.DOCUMENT) for k in _kernels_on_this_backend())])
@pytest.mark.seconds(3)
def test_packed_documents_never_attend_across_a_boundary(kernel, positions, micro_params,
                                                          packed_row):
  """Each document of a packed row gives the logits it gives alone, in every kernel; without
  its segment ids it does not (it would see the documents before it). Positions reset per
  document or not: RoPE is relative, so both equal the document alone (to the rounding of
  larger angles)."""
  tokens, segments, alone = packed_row
  model = model_lib.from_params(MICRO.replace(attention=kernel, rope_positions=positions),
                                micro_params)
  forward = nnx.jit(lambda m, t, s: m(t, s))
  packed = np.asarray(forward(model, tokens, segments))[0]
  tol = 2e-5 if positions == config.RopePositions.DOCUMENT else 2e-4
  for start, logits in alone:
    np.testing.assert_allclose(packed[start:start + len(logits)], logits, atol=tol, rtol=1e-4)
  if kernel == AttentionKernel.XLA and positions == config.RopePositions.DOCUMENT:
    unmasked = np.asarray(forward(model, tokens, None))[0]
    second = slice(alone[1][0], alone[1][0] + len(alone[1][1]))
    assert np.abs(unmasked[second] - packed[second]).max() > 1e-2


def test_document_positions_restart_at_each_document():
  segments = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 7]], jnp.int32)
  assert attention_lib.document_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3],
                                                              [0, 1, 2, 3, 4, 5, 6, 7, 0]]


def test_cudnn_refuses_documents_in_one_line():
  q = jnp.zeros((1, 8, 2, 8))
  with pytest.raises(ValueError, match="'cudnn' cannot mask documents"):
    attention_lib.attend(q, q, q, None, AttentionKernel.CUDNN, jnp.zeros((1, 8), jnp.int32))
