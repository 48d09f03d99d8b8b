"""Supervised fine-tuning against AI2's trainer code: chat data with label masks, OLMo-core's
own NumpyPackedFSLDataset and TransformerTrainModule on 2 data-parallel ranks, side by side with
olmo3's launcher path and train step.

The run is harness/sft_parity_olmo_core.py (its docstring says what it runs and prints), shared
with tests/test_sft_parity.py, which runs it shortened, in process.

  python benchmarks/sft_parity_olmo_core.py [--dtype float64|float32] [--steps 30] [--ranks 2]
      [--batch 4] [--seq_len 256]

Exits 1 above the dtype's tolerance (float64: |loss diff| <= 1e-9; float32: <= 1e-5), when an
instance or label differs from OLMo-core's at 1, 2 or 4 ranks, or when a mutation (masks off;
one global token mean) passes.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # harness/

from harness.sft_parity_olmo_core import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(0 if main()["within"] else 1)
