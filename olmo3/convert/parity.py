"""Logit and hidden-state parity between our model and Hugging Face's Olmo3ForCausalLM.

The reference runs in torch on CPU (the `test` extra); ours in JAX. Both see the same token
ids. Metrics over the real vocabulary (padded rows excluded), computed in float64:
per-token KL(reference || ours) max and mean, top-1 agreement, max |Δlogit|, and per layer the
max |Δh| relative to the reference's RMS, so a failure points at the layer that broke. And
each layer's RoPE as transformers built it from config.json (the cos and sin its attention is
handed), against ours: transformers versions read different config keys (4.57 `rope_theta` and
`rope_scaling`, 5.0-5.3 flat `rope_parameters`, later 5.x per layer type), and one that reads
another theta or YaRN runs another model, which the report then names, whatever the KL bound.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from olmo3 import attention, model as model_lib
from olmo3.config import ModelConfig, Yarn
from olmo3.convert.hf import ConversionError

_CHUNK = 512  # tokens per float64 chunk when comparing logits (bounds memory at 7B vocab)
# RoPE is compared over the first positions: a misread theta or YaRN shows there (YaRN's
# attention factor at position 0 already), and past them float32 angles lose digits.
_ROPE_POSITIONS = 1024
# Max |Δcos|, |Δsin| of one RoPE: rounding is ~1e-4 in float32 over those positions and below
# 5e-3 in bfloat16; theta 10,000 for 500,000, or YaRN where there is none, gives 0.1 and more.
_ROPE_TOLERANCE = 1e-2
_TRANSFORMERS_THETA = 10_000.0  # what transformers takes when it does not read a config's theta


@dataclasses.dataclass(frozen=True)
class ParityReport:
  dtype: str
  ref_dtype: str
  batch: int
  seq_len: int
  max_kl: float
  mean_kl: float
  top1_agreement: float
  max_abs_logit_diff: float
  ref_logit_std: float
  layer_rel_diff: tuple[float, ...]  # per layer: max |Δh| / RMS(reference h)
  transformers: str  # its version
  rope_differences: tuple[str, ...]  # the layers whose RoPE transformers built otherwise

  def format(self) -> str:
    lines = [
        f"parity: ours ({self.dtype}) vs Hugging Face transformers {self.transformers} "
        f"({self.ref_dtype}), {self.batch} x {self.seq_len} tokens",
        f"  KL(ref||ours) per token  max {self.max_kl:.3e}  mean {self.mean_kl:.3e}",
        f"  top-1 agreement          {100 * self.top1_agreement:.4f}%",
        f"  max |Δlogit|             {self.max_abs_logit_diff:.3e}  (reference logit std "
        f"{self.ref_logit_std:.2f})",
        "  per layer max|Δh|/rms(h): " + " ".join(f"{d:.1e}" for d in self.layer_rel_diff),
        "  RoPE per layer           " + ("as ours" if not self.rope_differences else
                                         "NOT as ours:"),
        *(f"    {line}" for line in self.rope_differences),
    ]
    return "\n".join(lines)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))


def _log_softmax64(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare_logits(ref_BTV: np.ndarray, ours_BTV: np.ndarray) -> dict[str, float]:
  """KL / top-1 / |Δ| over the reference's vocabulary (ours may carry padded columns)."""
  vocab = ref_BTV.shape[-1]
  ref = ref_BTV.reshape(-1, vocab)
  ours = ours_BTV.reshape(-1, ours_BTV.shape[-1])[:, :vocab]
  kls, agree, max_abs = [], 0, 0.0
  for start in range(0, ref.shape[0], _CHUNK):
    r, o = ref[start:start + _CHUNK], ours[start:start + _CHUNK]
    lp_r, lp_o = _log_softmax64(r), _log_softmax64(o)
    kls.append((np.exp(lp_r) * (lp_r - lp_o)).sum(-1))
    agree += int((r.argmax(-1) == o.argmax(-1)).sum())
    max_abs = max(max_abs, float(np.abs(r.astype(np.float64) - o).max()))
  kl = np.concatenate(kls)
  return {"max_kl": float(kl.max()), "mean_kl": float(kl.mean()),
          "top1_agreement": agree / ref.shape[0], "max_abs_logit_diff": max_abs,
          "ref_logit_std": float(ref.astype(np.float64).std())}


@dataclasses.dataclass(frozen=True)
class Reference:
  """What transformers computed: logits [B, T, vocab], each decoder layer's output, and each
  layer's RoPE as its attention received it ([2 (cos, sin), T', K] for the first row and
  T' = min(T, _ROPE_POSITIONS) positions), all float32 numpy."""
  logits: np.ndarray
  hidden: list[np.ndarray]
  ropes: list[np.ndarray]
  version: str


def reference_forward(hf_dir: str | os.PathLike, tokens_BT: np.ndarray, dtype: str = "float32"
                      ) -> Reference:
  """Runs transformers' Olmo3ForCausalLM (the installed version) on `tokens_BT`."""
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ImportError("the parity check runs the reference in torch: install the test extra "
                      "(pip install -e '.[test]')") from e
  model = transformers.Olmo3ForCausalLM.from_pretrained(
      os.fspath(hf_dir), dtype=getattr(torch, dtype), attn_implementation="sdpa")
  model.eval()
  hidden: list[np.ndarray] = []
  ropes: list[np.ndarray] = []

  def keep(_module, _inputs, output):
    out = output[0] if isinstance(output, tuple) else output
    hidden.append(out.float().numpy())

  def keep_rope(_module, _args, kwargs):
    # Every version with OLMo 3 (4.57 to 5.24 read) hands each layer's attention its
    # (cos, sin) as the keyword `position_embeddings`.
    if "position_embeddings" not in kwargs:
      raise ConversionError(f"transformers {transformers.__version__}'s Olmo3Attention takes "
                            "no position_embeddings keyword: parity cannot see its RoPE")
    ropes.append(np.stack([t[0, :_ROPE_POSITIONS].float().numpy()
                           for t in kwargs["position_embeddings"]]))

  hooks = [layer.register_forward_hook(keep) for layer in model.model.layers]
  hooks += [layer.self_attn.register_forward_pre_hook(keep_rope, with_kwargs=True)
            for layer in model.model.layers]
  try:
    with torch.no_grad():
      logits = model(torch.from_numpy(np.asarray(tokens_BT, np.int64))).logits
  finally:
    for h in hooks:
      h.remove()
  return Reference(logits.float().numpy(), hidden, ropes, transformers.__version__)


def _describe_rope(theta: float, scaling: Yarn | None) -> str:
  if scaling is None:
    return f"plain RoPE, theta {theta:,g}"
  return (f"YaRN (factor {scaling.factor:g}, original context {scaling.original_context}), "
          f"theta {theta:,g}")


def rope_differences(cfg: ModelConfig, ropes: list[np.ndarray], version: str
                     ) -> tuple[str, ...]:
  """One line per group of layers whose RoPE (`Reference.ropes`) is not ours, naming what
  transformers runs there (plain or YaRN, at our theta or its default 10,000) and ours."""
  tables: dict[tuple[float, Yarn | None], np.ndarray] = {}

  def table(theta: float, scaling: Yarn | None) -> np.ndarray:
    if (theta, scaling) not in tables:
      cos, sin = attention.rope_tables(ropes[0].shape[1], cfg.head_dim, theta, jnp.float32,
                                       scaling)
      tables[theta, scaling] = np.stack([np.asarray(cos), np.asarray(sin)])
    return tables[theta, scaling]

  def distance(got: np.ndarray, theta: float, scaling: Yarn | None) -> float:
    want = table(theta, scaling)
    return float(np.abs(got - want).max()) if got.shape == want.shape else float("inf")

  candidates = [(theta, scaling) for theta in dict.fromkeys([cfg.rope_theta, _TRANSFORMERS_THETA])
                for scaling in dict.fromkeys([None, cfg.rope_scaling])]
  groups: dict[tuple[str, str, str], list[int]] = {}
  for i, got in enumerate(ropes):
    ours = (cfg.rope_theta, cfg.rope_scaling if cfg.layer_rope_scaled(i) else None)
    if distance(got, *ours) <= _ROPE_TOLERANCE:
      continue
    theirs = min(candidates, key=lambda c: distance(got, *c))
    said = (_describe_rope(*theirs) if distance(got, *theirs) <= _ROPE_TOLERANCE else
            f"none of {'; '.join(_describe_rope(*c) for c in candidates)} (max |Δcos, Δsin| "
            f"{distance(got, *ours):.2g} from ours)")
    kind = "full-attention" if cfg.is_global(i) else "sliding-window"
    groups.setdefault((kind, said, _describe_rope(*ours)), []).append(i)
  return tuple(f"{kind} layers {layers}: transformers {version} runs {said}; ours {ours}"
               for (kind, said, ours), layers in groups.items())


def our_forward(cfg: ModelConfig, params: Any, tokens_BT: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
  """Our logits [B, T, V_padded] and per-layer outputs [L, B, T, D], in float32 numpy."""
  model = model_lib.from_params(cfg, params)
  forward = nnx.jit(lambda m, t: m(t, return_hidden=True))
  logits, hidden = forward(model, jnp.asarray(tokens_BT, jnp.int32))
  return (np.asarray(logits.astype(jnp.float32)), np.asarray(hidden.astype(jnp.float32)))


def random_tokens(cfg: ModelConfig, batch: int, seq_len: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq_len), np.int32)


def default_seq_len(cfg: ModelConfig) -> int:
  """Long enough to cross the sliding window several times (short prompts hide RoPE and window
  bugs), and not a multiple of it."""
  return 3 * cfg.sliding_window + cfg.sliding_window // 2 + 1


def check(cfg: ModelConfig, params: Any, hf_dir: str | os.PathLike, *, dtype: str = "float32",
          ref_dtype: str = "float32", batch: int = 1, seq_len: int | None = None,
          seed: int = 0) -> ParityReport:
  """Runs both models on the same random tokens and reports how far apart they are, and
  which layers' RoPE transformers built otherwise than ours."""
  seq_len = seq_len or default_seq_len(cfg)
  tokens = random_tokens(cfg, batch, seq_len, seed)
  ours_cfg = cfg.replace(compute_dtype=dtype)
  ref = reference_forward(hf_dir, tokens, ref_dtype)
  logits, hidden = our_forward(ours_cfg, params, tokens)
  rel = []
  for ref_h, h in zip(ref.hidden, hidden):
    rms = float(np.sqrt(np.mean(np.square(ref_h.astype(np.float64)))))
    rel.append(float(np.abs(ref_h.astype(np.float64) - h).max()) / max(rms, 1e-30))
  return ParityReport(dtype=dtype, ref_dtype=ref_dtype, batch=batch, seq_len=seq_len,
                      layer_rel_diff=tuple(rel), transformers=ref.version,
                      rope_differences=rope_differences(cfg, ref.ropes, ref.version),
                      **compare_logits(ref.logits, logits))
