"""A run restarted mid-way, by OLMo-core and by olmo3 with each spike_window_on_restart.

The run is harness/restart_olmo_core.py (its docstring says what it runs and prints), shared with
tests/test_parity_olmo_core.py, which runs this command shortened (slow tier).

  python benchmarks/restart_olmo_core.py [--restart_at 5] [--steps 13] [--spike_at 9]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # harness/

from harness.restart_olmo_core import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(0 if main()["ok"] else 1)
