"""python -m olmo3.convert merge: a weighted average of checkpoints' parameters (a "soup"), as
AI2 made the final OLMo 3 Think SFT checkpoint (32B: two runs at LRs 1e-4 and 5e-5) with
mergekit's `linear` method.

mergekit's `linear`: merged = sum_i(w_i * theta_i) / sum_i(w_i), per tensor, the division made
because its `normalize` defaults to true (so weights 2,1 mean 2/3 and 1/3). Done here the same,
each parameter accumulated in float64 and stored as float32, so weights 1,0 give the first
checkpoint bit for bit. Every checkpoint must hold the same parameter shapes (a CheckpointError
names the first parameter that differs) and model config.

What is written: an olmo3 checkpoint of parameters only (the first checkpoint's model config;
its tokenizer and chat template kept in the meta, so `export-hf` writes them): no optimizer
moments, which have no meaning averaged. `checkpoint.init_from` starts a new stage from it with
fresh moments (olmo3.train.state.StateLayout.restore_init); `init_mode=continue` is refused.
Memory: the float64 sum and one checkpoint at a time, about 3x the model's float32 size (87 GB
for the 7B).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import numpy as np
from etils import epath

from olmo3 import model as model_lib
from olmo3.config import ModelConfig
from olmo3.convert import tokenizer_files
from olmo3.io import checkpoint


def weights(text: str | None, n: int) -> tuple[float, ...]:
  """--weights "0.5,0.5" (one per --ckpt; default: equal), each finite and >= 0, their sum > 0;
  a CheckpointError naming the flag otherwise."""
  if text is None:
    return (1.0,) * n
  try:
    out = tuple(float(w) for w in text.split(","))
  except ValueError:
    raise checkpoint.CheckpointError(f"--weights {text!r}: not comma-separated numbers") from None
  if len(out) != n:
    raise checkpoint.CheckpointError(f"--weights {text!r}: {len(out)} weights for {n} --ckpt")
  if not all(math.isfinite(w) and w >= 0 for w in out) or sum(out) <= 0:
    raise checkpoint.CheckpointError(f"--weights {text!r}: each must be >= 0 and their sum > 0")
  return out


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  return {".".join(str(k.key) for k in path): tuple(x.shape) for path, x in
          jax.tree_util.tree_leaves_with_path(model_lib.param_shapes(cfg))}


def _check_alike(step_dirs: list[epath.Path], cfgs: list[ModelConfig]) -> None:
  """The checkpoints hold the same parameters (names and shapes) and model config."""
  first = _shapes(cfgs[0])
  for step_dir, cfg in zip(step_dirs[1:], cfgs[1:]):
    shapes = _shapes(cfg)
    for name in sorted(set(first) | set(shapes)):
      if first.get(name) != shapes.get(name):
        raise checkpoint.CheckpointError(
            f"{step_dir}: parameter {name} has shape {shapes.get(name)}, {step_dirs[0]}'s "
            f"{first.get(name)}: only checkpoints of one model merge")
    differ = [f.name for f in dataclasses.fields(cfg)
              if getattr(cfg, f.name) != getattr(cfgs[0], f.name)]
    if differ:
      raise checkpoint.CheckpointError(
          f"{step_dir}: model config differs from {step_dirs[0]}'s in {', '.join(differ)}: "
          "the merge would be neither model")


def merge(ckpts: list[str], given: tuple[float, ...], out: str) -> dict[str, Any]:
  """Writes the weighted average of `ckpts` (step directories or run workdirs: their latest
  step) to `out`; returns its meta's record of the merge."""
  if os.path.exists(out):
    raise checkpoint.CheckpointError(f"{out} already exists; refusing to overwrite")
  step_dirs = [checkpoint.resolve_step_dir(c) for c in ckpts]
  metas = [checkpoint.load_meta(d) for d in step_dirs]
  cfgs = [ModelConfig(**m["model_config"]) for m in metas]
  _check_alike(step_dirs, cfgs)
  target = checkpoint.host_target(model_lib.param_shapes(cfgs[0]))
  total: Any = None
  for step_dir, w in zip(step_dirs, given):
    if w == 0:  # adds nothing (and would turn a -0.0 of another into 0.0)
      continue
    params = checkpoint.restore_params(step_dir, target)
    term = jax.tree.map(lambda x, w=w: np.asarray(x, np.float64) * w, params)
    total = term if total is None else jax.tree.map(np.add, total, term)
    del params, term
  scale = sum(given)
  merged = jax.tree.map(lambda x: (x / scale).astype(np.float32), total)
  record = {"merged": [{"ckpt": os.fspath(d), "weight": w} for d, w in zip(step_dirs, given)],
            "normalized": True}
  kept = tokenizer_files.carried(step_dirs[0], metas[0])
  meta = {**record, **kept.meta(),
          **({"hf_dtype": metas[0]["hf_dtype"]} if "hf_dtype" in metas[0] else {})}
  checkpoint.save_model(out, cfgs[0], merged, meta=meta)
  return record
