"""Helpers that build checkpoints with transformers itself (the `test` extra)."""

import torch
import transformers

from olmo3.config import ModelConfig
from olmo3.convert import hf


def save_transformers_model(path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                            std: float = 0.3, seed: int = 0) -> None:
  """An Olmo3ForCausalLM built and saved by transformers (its own names, layout and config)."""
  fields = {k: v for k, v in hf.model_config_to_hf(cfg).items()
            if k not in ("architectures", "model_type", "dtype")}
  fields["initializer_range"] = std
  torch.manual_seed(seed)
  model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**fields))
  with torch.no_grad():  # norms start at 1; perturb them so that each one matters
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.2 * torch.randn_like(p))
  model.to(dtype).save_pretrained(path)
