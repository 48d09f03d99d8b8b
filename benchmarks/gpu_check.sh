#!/usr/bin/env bash
# The GPU check in one command, under 8 minutes on one H100 or H200 (benchmarks/gpu_check.py
# says what it checks); on a CPU it runs its CPU part and lists what it skipped. One JSON line
# on stdout; record it, the command and the device in benchmarks/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 480 python benchmarks/gpu_check.py "$@"
