"""A small experiment on synthetic token files, for training tests."""

import numpy as np

from olmo3 import config
from olmo3.config import (CheckpointConfig, DataConfig, Experiment, OptimizerConfig, Schedule,
                          TrainConfig)
from olmo3.data import tokens


def write_corpus(directory, vocab=500, n_tokens=40_000, seed=0):
  """Token files with learnable structure (a noisy repeating sequence)."""
  rng = np.random.default_rng(seed)
  base = rng.integers(2, vocab, 97)
  data = np.tile(base, n_tokens // 97 + 1)[:n_tokens]
  noise = rng.random(n_tokens) < 0.1
  data[noise] = rng.integers(2, vocab, noise.sum())
  path = directory / "train.npy"
  tokens.write_token_file(path, data)
  return str(path)


def micro_experiment(path, steps=8, every=2, **train) -> Experiment:
  return Experiment(
      model=config.olmo3_micro().replace(max_seq_len=64),
      # Single instances shuffled (OLMo-core's default): AI2's runs of 8192 tokens would be 256
      # instances of this corpus's 1250.
      data=DataConfig(paths=(path,), seq_len=32, max_target_seq_len=None, global_batch_size=8,
                      seed=1),
      optimizer=OptimizerConfig(peak_lr=1e-2, warmup_steps=2, final_lr=1e-3, decay_steps=20,
                                schedule=Schedule.COSINE),
      train=TrainConfig(steps=steps, log_every=1, eval_every=0, **train),
      checkpoint=CheckpointConfig(every=every, keep=10, async_save=True))
