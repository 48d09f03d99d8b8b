import numpy as np
import pytest

from olmo3 import config
from olmo3 import flops as flops_lib
from olmo3 import attention as attention_lib


def test_one_document_per_instance_counts_what_the_causal_count_does():
  cfg = config.olmo3_7b_long_context()
  assert flops_lib.within_document_flops_per_token(cfg, [65_536]) == pytest.approx(
      cfg.flops_per_token(65_536), rel=1e-15)


def test_within_document_pairs_are_the_masks_visible_pairs():
  """The count equals the (query, key) pairs the model's own causal, window and document masks
  leave visible, layer by layer: a wrong window edge or a pair across documents fails it."""
  cfg = config.olmo3_micro()  # sliding window 16, 6 layers (5 sliding counted by their window)
  lengths = [40, 3, 17, 64, 4]
  segments = np.repeat(np.arange(len(lengths)), lengths)[None]
  per_key = 12 * cfg.n_heads * cfg.head_dim
  visible = sum(
      int((np.asarray(attention_lib.attention_mask(sum(lengths), cfg.layer_window(i)))[None]
           & np.asarray(attention_lib.document_mask(segments))).sum())
      for i in range(cfg.n_layers))
  expected = 6 * cfg.matmul_param_count + per_key * visible / sum(lengths)
  assert flops_lib.within_document_flops_per_token(cfg, lengths) == pytest.approx(expected,
                                                                                  rel=1e-12)
  assert expected < cfg.flops_per_token(sum(lengths))
