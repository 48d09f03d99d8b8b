"""The CPU stand-in of flash-attn 2 (harness/flash_attn_standin, through which
harness/stage3_parity_olmo_core.py runs OLMo-core's intra-document attention) against a dense
masked softmax (torch's scaled_dot_product_attention with a boolean mask built here over the
flattened tokens), outputs and gradients, and against flash-attn's documented conventions by
hand: window bounds, bottom-right alignment, grouped heads, zeros where nothing is visible."""

import importlib.util
import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

_INIT = (pathlib.Path(__file__).resolve().parent.parent / "harness" / "flash_attn_standin" /
         "flash_attn" / "__init__.py")


def _standin():
  """The stand-in as a module of its own name here: the test leaves sys.path and
  sys.modules["flash_attn"] as they were."""
  spec = importlib.util.spec_from_file_location("flash_attn_standin_under_test", _INIT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


fa = _standin()


def _dense(q, k, v, lengths, causal, window, scale=None):
  """SDPA over all tokens at once with a mask: same sequence, then flash-attn's window rule
  (equal query and key lengths here, so no alignment offset)."""
  doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
  start = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)[doc]
  pos = torch.arange(len(doc)) - start
  i, j = pos[:, None], pos[None, :]
  mask = doc[:, None] == doc[None, :]
  left, right = window
  right = 0 if causal else right
  if right >= 0:
    mask &= j <= i + right
  if left >= 0:
    mask &= j >= i - left
  heads, groups = q.shape[1], k.shape[1]
  out = F.scaled_dot_product_attention(  # [H, T, K]
      q.transpose(0, 1), k.repeat_interleave(heads // groups, 1).transpose(0, 1),
      v.repeat_interleave(heads // groups, 1).transpose(0, 1), attn_mask=mask, scale=scale)
  return out.transpose(0, 1)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (6, 0)), (False, (-1, -1)),
                                           (False, (3, 2))])
def test_varlen_equals_dense_masked_softmax(causal, window):
  """Documents of 9, 1, 17 and 5 tokens, 6 query heads over 2 key/value heads, float64:
  outputs and every input's gradient agree with the dense masked computation."""
  lengths = [9, 1, 17, 5]
  rng = np.random.default_rng(0)
  q, k, v = (torch.tensor(rng.standard_normal((sum(lengths), h, 8)), requires_grad=True)
             for h in (6, 2, 2))
  cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
  ours = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal,
                                   window_size=window, softmax_scale=0.3)
  dense = _dense(q, k, v, lengths, causal, window, scale=0.3)
  np.testing.assert_allclose(ours.detach().numpy(), dense.detach().numpy(), atol=1e-13)
  grad = torch.tensor(rng.standard_normal(ours.shape))
  mine = torch.autograd.grad(ours, (q, k, v), grad)
  theirs = torch.autograd.grad(dense, (q, k, v), grad)
  for a, b in zip(mine, theirs):
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-12)
  assert ours.dtype == torch.float64


def test_batched_and_packed_forms_agree_with_varlen():
  """flash_attn_func over [B, T] rows is varlen with equal-length sequences; the qkv-packed
  forms are the same calls; float32 stays float32."""
  rng = np.random.default_rng(1)
  q, k, v = (torch.tensor(rng.standard_normal((3, 12, h, 4)), dtype=torch.float32)
             for h in (4, 4, 4))
  rows = fa.flash_attn_func(q, k, v, causal=True, window_size=(4, 0))
  cu = torch.arange(0, 37, 12, dtype=torch.int32)
  flat = fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu,
                                   12, 12, causal=True, window_size=(4, 0))
  np.testing.assert_array_equal(rows.flatten(0, 1).numpy(), flat.numpy())
  qkv = torch.stack([q, k, v], dim=2)
  np.testing.assert_array_equal(fa.flash_attn_qkvpacked_func(qkv, causal=True,
                                                             window_size=(4, 0)).numpy(),
                                rows.numpy())
  np.testing.assert_array_equal(fa.flash_attn_varlen_qkvpacked_func(
      qkv.flatten(0, 1), cu, 12, causal=True, window_size=(4, 0)).numpy(), flat.numpy())
  assert rows.dtype == torch.float32
  # The default scale is 1/sqrt(head_dim).
  np.testing.assert_allclose(fa.flash_attn_func(q, k, v).numpy(),
                             fa.flash_attn_func(q, k, v, softmax_scale=0.5).numpy())


def test_conventions_by_hand():
  """Grouped heads: with 4 query heads over 2 key/value heads, heads 0-1 read group 0 only.
  Bottom-right alignment: 2 queries over 4 keys, causal, see keys 0-2 and 0-3. A query that
  sees no key (3 queries over 1 key, causal: the first two) gets zeros."""
  rng = np.random.default_rng(2)
  q = torch.tensor(rng.standard_normal((1, 5, 4, 4)))
  k, v = (torch.tensor(rng.standard_normal((1, 5, 2, 4))) for _ in range(2))
  out = fa.flash_attn_func(q, k, v, causal=True)
  k2, v2 = k.clone(), v.clone()
  k2[:, :, 1], v2[:, :, 1] = 7.0, -3.0
  moved = fa.flash_attn_func(q, k2, v2, causal=True)
  assert torch.equal(out[:, :, :2], moved[:, :, :2]) and not torch.equal(out[:, :, 2:],
                                                                         moved[:, :, 2:])
  v_unit = torch.eye(4, dtype=torch.float64)[None, :, None, :].expand(1, 4, 1, 4)
  zeros = torch.zeros(1, 4, 1, 4, dtype=torch.float64)  # equal scores: uniform weights
  weights = fa.flash_attn_func(zeros[:, :2], zeros, v_unit, causal=True)[0, :, 0]
  np.testing.assert_allclose(weights.numpy(), [[1 / 3, 1 / 3, 1 / 3, 0], [0.25] * 4])
  none = fa.flash_attn_func(zeros[:, :3], zeros[:, :1], v_unit[:, :1], causal=True)[0, :, 0]
  np.testing.assert_array_equal(none.numpy(), [[0] * 4, [0] * 4, [1, 0, 0, 0]])


def test_refuses_what_it_does_not_compute():
  x = torch.zeros(1, 4, 2, 4)
  cu = torch.tensor([0, 4], dtype=torch.int32)
  with pytest.raises(NotImplementedError, match="dropout_p"):
    fa.flash_attn_func(x, x, x, dropout_p=0.1)
  with pytest.raises(NotImplementedError, match="softcap"):
    fa.flash_attn_func(x, x, x, softcap=30.0)
  with pytest.raises(ValueError, match="max_seqlen"):
    fa.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 3, 3)
