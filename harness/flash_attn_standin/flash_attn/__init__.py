"""A stand-in for the `flash_attn` package (flash-attn 2), for parity runs on a CPU.

OLMo-core masks attention within documents (the batch's `doc_lens`, AI2's stage 3) only through
flash-attn's variable-length kernel: its torch SDPA backend refuses document lengths, and
flash-attn is CUDA-only. With this directory first on sys.path, `import flash_attn` inside
OLMo-core's `flash_attn_api` finds this module, and its own FlashAttention2Backend (the backend
AI2's stage-3 script names) runs on the CPU, down the same code path it takes on a GPU: q, k, v
flattened to [total tokens, heads, head_dim] and cut by `cu_seqlens`. Only
harness/stage3_parity_olmo_core.py puts it there (as harness/slurm_standin stands in for srun;
tests/test_flash_attn_standin.py loads it under a name of its own); nothing installs it.

What it computes is flash-attn's documented result, exactly, in plain torch (autograd gives
the backward pass): softmax(scale · q kᵀ + mask) v per sequence, where
- `softmax_scale` defaults to 1 / sqrt(head_dim);
- grouped-query attention: query head h reads key/value head h // (H / H_kv);
- `causal` and `window_size=(left, right)` (-1: unbounded) are aligned to the bottom right:
  query i of a sequence of Sq queries over Sk keys sees key j iff
  i + Sk - Sq - left <= j <= i + Sk - Sq + right, with right = 0 when causal (flash-attn sets
  it so); a query that sees no key returns zeros, as flash-attn's kernels do;
- scores, softmax and the weighted sum run in float32, or float64 for float64 inputs (the
  real kernels take only fp16 / bf16 and accumulate in float32); the output has q's dtype.
Variable-length calls check every sequence against max_seqlen_q / max_seqlen_k (the real
kernel would silently read wrongly past them). What it does not honour it refuses: dropout,
softcap, ALiBi, attention probabilities, paged KV caches.
"""

from __future__ import annotations

import math

import torch

__version__ = "2.8.3+cpu-standin"  # the flash-attn 2 API it follows

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_qkvpacked_func"]


def _refuse(dropout_p: float, softcap: float, alibi_slopes, return_attn_probs: bool,
            block_table=None) -> None:
  if dropout_p:
    raise NotImplementedError(f"flash_attn stand-in: dropout_p={dropout_p} (only 0)")
  if softcap:
    raise NotImplementedError(f"flash_attn stand-in: softcap={softcap} (only 0)")
  if alibi_slopes is not None:
    raise NotImplementedError("flash_attn stand-in: alibi_slopes (only None)")
  if return_attn_probs:
    raise NotImplementedError("flash_attn stand-in: return_attn_probs (only False)")
  if block_table is not None:
    raise NotImplementedError("flash_attn stand-in: block_table (paged KV cache)")


def _visible(n_q: int, n_k: int, causal: bool, window_size: tuple[int, int],
             device: torch.device) -> torch.Tensor:
  """[n_q, n_k] bool: which keys each query sees (bottom-right aligned, as flash-attn)."""
  left, right = (int(w) for w in window_size)
  if causal:
    right = 0
  i = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)  # the query's key-aligned index
  j = torch.arange(n_k, device=device)[None, :]
  visible = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
  if right >= 0:
    visible &= j <= i + right
  if left >= 0:
    visible &= j >= i - left
  return visible


def _attend(q_SHK: torch.Tensor, k_SGK: torch.Tensor, v_SGK: torch.Tensor,
            softmax_scale: float | None, causal: bool,
            window_size: tuple[int, int]) -> torch.Tensor:
  """One sequence: q [Sq, H, K], k and v [Sk, G, K] with G dividing H -> [Sq, H, K]."""
  n_q, heads, head_dim = q_SHK.shape
  n_k, groups = k_SGK.shape[:2]
  if heads % groups:
    raise ValueError(f"flash_attn stand-in: {heads} query heads over {groups} key/value heads")
  scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
  dtype = torch.promote_types(q_SHK.dtype, torch.float32)
  q, k, v = (x.to(dtype) for x in (q_SHK, k_SGK, v_SGK))
  # Query head h reads key/value head h // (heads / groups): each group's heads are adjacent.
  k = k.repeat_interleave(heads // groups, dim=1)
  v = v.repeat_interleave(heads // groups, dim=1)
  scores_HQS = torch.einsum("qhk,shk->hqs", q, k) * scale
  visible_QS = _visible(n_q, n_k, causal, window_size, q.device)
  # The most negative finite value, not -inf: a row that sees nothing stays finite (it is
  # zeroed below), and exp() of a masked score is exactly 0 next to any visible one.
  scores_HQS = scores_HQS.masked_fill(~visible_QS, torch.finfo(dtype).min)
  probs_HQS = torch.softmax(scores_HQS, dim=-1) * visible_QS.any(dim=-1)[:, None].to(dtype)
  return torch.einsum("hqs,shk->qhk", probs_HQS, v).to(q_SHK.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
  """q [B, Sq, H, K], k and v [B, Sk, G, K] -> [B, Sq, H, K]."""
  del deterministic  # this computation has one order
  _refuse(dropout_p, softcap, alibi_slopes, return_attn_probs)
  return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal, window_size)
                      for b in range(q.shape[0])])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
  """q [total_q, H, K], k and v [total_k, G, K]; sequence b's queries are rows
  cu_seqlens_q[b]:cu_seqlens_q[b + 1], its keys cu_seqlens_k[b]:cu_seqlens_k[b + 1]
  -> [total_q, H, K] (rows past cu_seqlens_q[-1] are zeros)."""
  del deterministic
  _refuse(dropout_p, softcap, alibi_slopes, return_attn_probs, block_table)
  cu_q = [int(x) for x in cu_seqlens_q.tolist()]
  cu_k = [int(x) for x in cu_seqlens_k.tolist()]
  if len(cu_q) != len(cu_k):
    raise ValueError(f"flash_attn stand-in: {len(cu_q) - 1} query sequences but "
                     f"{len(cu_k) - 1} key sequences")
  pieces = []
  for b in range(len(cu_q) - 1):
    n_q, n_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
    if n_q > max_seqlen_q or n_k > max_seqlen_k:
      raise ValueError(f"flash_attn stand-in: sequence {b} has {n_q} queries and {n_k} keys, "
                       f"past max_seqlen_q={max_seqlen_q} / max_seqlen_k={max_seqlen_k}")
    pieces.append(_attend(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]],
                          v[cu_k[b]:cu_k[b + 1]], softmax_scale, causal, window_size))
  if cu_q[-1] < q.shape[0]:
    pieces.append(q.new_zeros(q.shape[0] - cu_q[-1], *q.shape[1:]))
  return torch.cat(pieces)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
  """qkv [B, S, 3, H, K] -> [B, S, H, K]."""
  return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                         causal, window_size, softcap, alibi_slopes, deterministic,
                         return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
  """qkv [total, 3, H, K] -> [total, H, K]."""
  return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
                                max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                                window_size, softcap, alibi_slopes, deterministic,
                                return_attn_probs)
