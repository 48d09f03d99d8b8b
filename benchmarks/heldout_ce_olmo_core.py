"""Held-out CE by OLMo-core's own LM evaluator and by olmo3's definition, from the same
per-token losses: how far apart the two are at each evaluation batch size, and whether
`python -m olmo3.eval.compare` restates ours as OLMo-core's exactly where it says it can.

The run is harness/heldout_ce_olmo_core.py (its docstring says what it runs and prints), shared
with tests/test_eval_compare.py, which runs it shortened, in process.

  python benchmarks/heldout_ce_olmo_core.py [--batch_sizes 1,7,10,16,20,31,32,35] [--epoch 1]
      [--seq_len 256]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # harness/

from harness.heldout_ce_olmo_core import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(main())
