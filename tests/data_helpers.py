"""Shared helpers for data tests."""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from olmo3 import sharding
from olmo3.data import embedded, tokens

TURNS = ("<|im_start|>", "<|im_end|>")  # a chat template's turn markers


def write_files(directory, sizes, vocab=100, seed=0):
  """Token files of the given sizes (in tokens); returns their paths as strings."""
  rng = np.random.default_rng(seed)
  paths = []
  for i, n in enumerate(sizes):
    path = directory / f"{i:03d}.npy"
    tokens.write_token_file(path, rng.integers(0, vocab, n))
    paths.append(str(path))
  return paths


def batch_sharding(n_devices, shape=None):
  mesh = sharding.make_mesh(shape or {"data": -1}, devices=jax.devices()[:n_devices])
  return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))


def chat_tokenizer(path, turns_whole: bool = True) -> str:
  """A small BPE tokenizer (EOS id 0, PAD id 1) saved at `path`; `turns_whole`: <|im_start|> and
  <|im_end|> are one special token each (as in AI2's chat tokenizers), else several ordinary
  ones."""
  texts = [f"some words {i} and more {i * 3}, user assistant system" for i in range(200)]
  tok = embedded.train_tokenizer(texts, vocab_size=400)
  if turns_whole:
    tok.add_special_tokens(list(TURNS))
  tok.save(str(path))
  return str(path)
