"""Shared helpers for data tests."""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from olmo3 import sharding
from olmo3.data import tokens


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
