"""`export-hf` read right by every transformers version the docs name: `convert parity` on a tiny
stage-2 and a tiny stage-3 (YaRN) export, in the venv's transformers (5.3.0, in process) and in
4.57.1 (the first with OLMo 3) and 5.24.0, each installed beside the venv (`pip install --target`,
kept under $OLMO3_CACHE) and put first on PYTHONPATH of the parity run.

What each reads (docs/architecture.md#hugging-face-parity-settings): 4.57 `rope_theta` and a flat
`rope_scaling` (YaRN on the full-attention layers only, as trained); 5.0-5.3 `rope_scaling`, else
the flat keys of `rope_parameters`, with one RoPE for every layer; 5.24 `rope_parameters` per
layer type.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import transformers

import forked
from conftest import random_params
from olmo3 import config
from olmo3.convert.__main__ import main as convert_main
from olmo3.io import checkpoint

STAGE_2 = config.olmo3_micro()
# Stage 3's shape shrunk: YaRN over an original context of 64 tokens, run at 4x that
# (max_seq_len = factor x original context, as the 7B's 65,536 = 8 x 8,192).
STAGE_3 = STAGE_2.replace(d_model=128, n_heads=4, n_kv_heads=2, n_layers=8, sliding_window=24,
                          max_seq_len=512,
                          rope_scaling=config.Yarn(factor=8.0, original_context=64))
SEQ_LEN = 4 * 64

# Each version beside the venv: only what must differ from it (--no-deps).
BESIDE = {"4.57.1": ["transformers==4.57.1", "huggingface-hub>=0.34,<1.0"],
          "5.24.0": ["transformers==5.24.0", "tokenizers>=0.23.1,<0.24"]}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
  """{stage: (checkpoint, export)}: random weights wide enough that a RoPE read otherwise
  changes predictions, exported by the real `export-hf`; plus "stage3_rope_parameters_only",
  the stage-3 export as it was written before `rope_theta` / `rope_scaling` (what 4.57.1
  read as theta 10,000 and no YaRN)."""
  root = tmp_path_factory.mktemp("exports")
  out = {}
  for stage, cfg in (("stage2", STAGE_2), ("stage3", STAGE_3)):
    ckpt, hf_dir = root / f"{stage}_ckpt", root / f"{stage}_hf"
    checkpoint.save_model(ckpt, cfg, random_params(cfg, seed=4))
    assert convert_main(["export-hf", "--ckpt", str(ckpt), "--out", str(hf_dir)]) == 0
    out[stage] = (ckpt, hf_dir)
  old = root / "stage3_rope_parameters_only_hf"
  shutil.copytree(out["stage3"][1], old)
  hf_config = json.loads((old / "config.json").read_text())
  for key in ("rope_theta", "rope_scaling"):
    hf_config.pop(key, None)
  (old / "config.json").write_text(json.dumps(hf_config))
  out["stage3_rope_parameters_only"] = (out["stage3"][0], old)
  return out


def _parity_args(exports, stage):
  ckpt, hf_dir = exports[stage]
  return ["parity", "--hf_dir", str(hf_dir), "--ckpt", str(ckpt), "--seq_len", str(SEQ_LEN)]


def test_parity_in_transformers_5_3_passes_stage_2_and_names_its_yarn_on_every_layer(
    exports, capsys):
  """The venv's transformers (the test extra's pin): stage 2 as ours; stage 3 fails loudly,
  naming what 5.3 runs (YaRN on the sliding layers too: one rotary embedding for every layer),
  which no config.json can change in 5.0-5.3."""
  assert transformers.__version__ == "5.3.0", "the test extra's pin moved: say what it runs"
  assert convert_main(_parity_args(exports, "stage2")) == 0
  out = capsys.readouterr().out
  assert "transformers 5.3.0" in out and "RoPE per layer           as ours" in out, out
  assert convert_main(_parity_args(exports, "stage3")) == 1
  out = capsys.readouterr().out
  assert ("sliding-window layers [0, 1, 2, 4, 5, 6]: transformers 5.3.0 runs YaRN (factor 8, "
          "original context 64), theta 500,000; ours plain RoPE, theta 500,000") in out, out
  assert "full-attention layers" not in out, out  # those it runs as trained
  # A RoPE read otherwise is another model: no KL bound lets it pass.
  assert convert_main(_parity_args(exports, "stage3") + ["--max_kl", "100"]) == 1
  assert "reads this config's RoPE otherwise" in capsys.readouterr().out


def _beside(version: str) -> str:
  """A directory holding transformers `version` and what it needs that the venv's packages do
  not satisfy, installed once under $OLMO3_CACHE (renamed into place when complete)."""
  cache = os.path.expanduser(os.environ.get("OLMO3_CACHE", "~/.cache/olmo3"))
  target = os.path.join(cache, "transformers", version)
  if not os.path.isdir(target):
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{version}-", dir=os.path.dirname(target))
    try:
      subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                      "--disable-pip-version-check", "--target", staging, *BESIDE[version]],
                     check=True, timeout=600)
      os.rename(staging, target)
    finally:
      shutil.rmtree(staging, ignore_errors=True)
  return target


@pytest.mark.slow(seconds=25)
@pytest.mark.parametrize("version", sorted(BESIDE))
def test_parity_passes_in_transformers_installed_beside(exports, version):
  """Each version reads both exports as ours (logits to float32 rounding, every layer's RoPE
  ours); and the stage-3 export without `rope_theta` / `rope_scaling` fails in 4.57.1, whose
  parity names theta 10,000 and no YaRN: what the check exists to catch."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [_beside(version), *filter(None, [os.environ.get("PYTHONPATH")])]))
  for stage in ("stage2", "stage3", "stage3_rope_parameters_only"):
    run = forked.completed("olmo3.convert", _parity_args(exports, stage), env, timeout=300)
    assert f"transformers {version}" in run.stdout, run.stdout + run.stderr
    if stage == "stage3_rope_parameters_only" and version == "4.57.1":
      assert run.returncode == 1, run.stdout + run.stderr
      assert ("full-attention layers [3, 7]: transformers 4.57.1 runs plain RoPE, theta 10,000; "
              "ours YaRN (factor 8, original context 64), theta 500,000") in run.stdout, run.stdout
      assert ("sliding-window layers [0, 1, 2, 4, 5, 6]: transformers 4.57.1 runs plain RoPE, "
              "theta 10,000; ours plain RoPE, theta 500,000") in run.stdout, run.stdout
    else:
      assert run.returncode == 0, run.stdout + run.stderr
      assert "RoPE per layer           as ours" in run.stdout and "PASS" in run.stdout, run.stdout
