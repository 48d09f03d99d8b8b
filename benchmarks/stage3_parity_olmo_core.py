"""Stage 3's training steps against AI2's trainer code: YaRN, packed documents, attention within
each document, side by side with OLMo-core's own TransformerTrainModule.

The run is harness/stage3_parity_olmo_core.py (its docstring says what it runs and prints), shared
with tests/test_stage3_parity.py, which runs it shortened, in process.

  python benchmarks/stage3_parity_olmo_core.py [--dtype float32|float64] [--steps 30]
      [--batch 4] [--seq_len 256] [--original_context 64] [--rope_positions instance|document]
      [--peak_lr 2.0712352850360292e-4] [--ranks 1|2]

--ranks 2: OLMo-core's train module on 2 data-parallel ranks (processes over gloo), each
dividing its loss by its own count of trained labels, against ours with train.loss_ranks=2.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # harness/

from harness.stage3_parity_olmo_core import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(0 if main()["within"] else 1)
