"""Training-step parity with AI2's trainer code: the same small OLMo 3, trained side by side.

The run is harness/train_parity_olmo_core.py (its docstring says what it runs and prints), shared
with tests/test_parity_olmo_core.py, which runs it shortened, in process.

  python benchmarks/train_parity_olmo_core.py [--steps 100] [--batch 4] [--seq_len 64]
      [--peak_lr 1e-3] [--dtype float32|float64] [--spike_window 128] [--spike_step 90]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # harness/

from harness.train_parity_olmo_core import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(0 if main()["within"] else 1)
