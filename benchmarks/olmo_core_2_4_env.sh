#!/usr/bin/env bash
# A second environment with ai2-olmo-core 2.4.0, the version AI2 ran OLMo 3 7B's stage 3 with
# (the suite's environment has 3.0.0, which resets RoPE positions at document boundaries):
#
#   bash benchmarks/olmo_core_2_4_env.sh [VENV]        # default .venv-olmo-core-2.4
#   VENV/bin/python benchmarks/stage3_parity_olmo_core.py --dtype float64
#
# python3.11, torch==2.13.0 (the CPU build, as the main environment's), ai2-olmo-core==2.4.0 and
# olmo3 itself (editable, with its own pinned dependencies). ai2-olmo-core 2.4.0 bounds torch
# from below only, so torch goes in first and pinned: it is never resolved to a CUDA build.
# TORCH_INDEX is where the CPU wheel comes from (as the Dockerfile's build argument); set it
# empty where pip's own configuration already serves the CPU wheel (a --find-links directory).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-${repo}/.venv-olmo-core-2.4}"
torch_index="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"

python3.11 -m venv "${venv}"
# Keeps the environment out of git when it lies inside the repository (Python 3.13's venv
# writes this file itself; 3.11's does not).
echo '*' > "${venv}/.gitignore"
pip=("${venv}/bin/python" -m pip install --quiet)
if [[ -n "${torch_index}" ]]; then
  "${pip[@]}" --no-deps --index-url "${torch_index}" torch==2.13.0
fi
# One resolution for both: separately, pip leaves ai2-olmo-core's boto3 beside the older botocore
# that olmo3's s3fs pins.
"${pip[@]}" torch==2.13.0 ai2-olmo-core==2.4.0 -e "${repo}"
"${venv}/bin/python" - <<'EOF'
import importlib.metadata as m
versions = {p: m.version(p) for p in ("ai2-olmo-core", "torch", "jax", "olmo3")}
assert versions["ai2-olmo-core"] == "2.4.0" and versions["torch"].startswith("2.13.0"), versions
print(" ".join(f"{k}=={v}" for k, v in versions.items()))
EOF
