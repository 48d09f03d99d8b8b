"""Continuing AI2's own run: an OLMo-core checkpoint, continued by OLMo-core and by olmo3.

The run is harness/continue_olmo_core.py (its docstring says what it runs and prints), shared with
tests/test_olmo_core_import.py, which runs this command shortened (slow tier).

  python benchmarks/continue_olmo_core.py [--steps 10] [--continue_steps 20] [--spike_at 15]
  python benchmarks/continue_olmo_core.py --stage3 [--steps 10] [--continue_steps 20]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # harness/

from harness.continue_olmo_core import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(0 if main()["ok"] else 1)
