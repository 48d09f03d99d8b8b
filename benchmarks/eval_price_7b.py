"""What one in-loop evaluation of the 7B costs, against the 10,000 training steps between two.

The run is harness/eval_price_7b.py (its docstring says what it runs and prints), shared with
tests/test_perf.py, which runs it shortened, in process.

  python benchmarks/eval_price_7b.py [--tokenizer allenai/dolma2-tokenizer]
      [--requests_cache FILE] [--heldout_root DIR] [--heldout_tokens_per_set 1000000]
      [--mfu 0.445] [--compile tpu7x:4x8x8] [--smoke]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # harness/

from harness.eval_price_7b import main  # noqa: E402

if __name__ == "__main__":
  main()
