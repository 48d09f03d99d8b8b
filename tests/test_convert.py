import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

from olmo3 import config
from olmo3 import model as model_lib
from olmo3.convert import hf
from olmo3.convert.__main__ import main as convert_main
from olmo3.io import checkpoint

from hf_reference import save_transformers_model

MICRO = config.olmo3_micro()


def _tensors(path) -> dict[str, np.ndarray]:
  out = {}
  for file in sorted(os.listdir(path)):
    if file.endswith(".safetensors"):
      with safe_open(os.path.join(path, file), framework="numpy") as f:
        out.update({k: f.get_tensor(k) for k in f.keys()})
  return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_import_export_round_trip_is_bit_exact(tmp_path, dtype):
  src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "exported"
  save_transformers_model(src, MICRO, dtype=dtype)
  assert convert_main(["import-hf", "--hf_dir", str(src), "--out", str(ckpt)]) == 0
  assert convert_main(["export-hf", "--ckpt", str(ckpt), "--out", str(out)]) == 0
  before, after = _tensors(src), _tensors(out)
  assert sorted(before) == sorted(after)
  for name, x in before.items():
    assert after[name].dtype == x.dtype, name
    assert after[name].tobytes() == x.tobytes(), name  # bit-exact
  # The exported directory is one transformers loads, with the same config.
  reloaded = json.loads((out / "config.json").read_text())
  assert hf.model_config_from_hf(reloaded) == hf.read_hf_config(src)


def test_vocabulary_is_padded_on_import(tmp_path):
  save_transformers_model(tmp_path / "hf", MICRO)
  cfg, params, dtype = hf.read_hf_dir(tmp_path / "hf")
  assert dtype == "float32"
  assert (cfg.vocab_size, cfg.padded_vocab_size) == (500, 512)
  emb, head = params["embed_tokens"]["embedding"], params["lm_head"]["kernel"]
  assert emb.shape == (512, MICRO.d_model) and head.shape == (MICRO.d_model, 512)
  assert (emb[500:] == 0).all() and (head[:, 500:] == 0).all()
  assert np.abs(emb[:500]).min(axis=1).max() > 0
  assert params["layers"]["self_attn"]["q_proj"]["kernel"].shape == (6, 64, 64)  # stacked, (in, out)


def _hf_dir(tmp_path):
  path = tmp_path / "hf"
  save_transformers_model(path, MICRO)
  return path


def _edit_config(path, **changes):
  cfg = json.loads((path / "config.json").read_text())
  cfg.update(changes)
  (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "llama"}, r"model_type is 'llama', not 'olmo3'"),
    ({"tie_word_embeddings": True}, r"tie_word_embeddings=True is not supported"),
    ({"layer_types": ["sliding_attention"] * 3 + ["full_attention"] * 3},
     r"layer_types\[4\]='full_attention' breaks OLMo 3's pattern"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 5e5},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}},
     r"\(yarn\) lacks \['factor', 'original_max_position_embeddings'\]"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}},
     r"rope_type 'dynamic'; only 'default' and 'yarn'"),
    ({"num_key_value_heads": 3}, r"ModelConfig\.n_kv_heads=3"),
])
def test_bad_config_is_named(tmp_path, changes, message, capsys):
  path = _hf_dir(tmp_path)
  _edit_config(path, **changes)
  with pytest.raises(hf.ConversionError, match=message):
    hf.read_hf_dir(path)
  assert convert_main(["import-hf", "--hf_dir", str(path), "--out", str(tmp_path / "c")]) == 2
  assert "config.json" in capsys.readouterr().err
  assert not (tmp_path / "c").exists()  # nothing written


def test_missing_and_misshapen_tensors_are_named(tmp_path):
  path = _hf_dir(tmp_path)
  tensors = _tensors(path)
  from safetensors.numpy import save_file

  missing = dict(tensors)
  del missing["model.layers.4.mlp.up_proj.weight"]
  save_file(missing, str(path / "model.safetensors"))
  with pytest.raises(hf.ConversionError, match=r"missing tensors \['model.layers.4.mlp.up_proj"):
    hf.read_hf_dir(path)
  misshapen = dict(tensors)
  misshapen["model.layers.2.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
  save_file(misshapen, str(path / "model.safetensors"))
  with pytest.raises(hf.ConversionError,
                     match=r"'model.layers.2.self_attn.k_proj.weight' has shape \(64, 64\), "
                           r"expected \(16, 64\)"):
    hf.read_hf_dir(path)
  extra = dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})
  save_file(extra, str(path / "model.safetensors"))
  with pytest.raises(hf.ConversionError, match=r"not in an OLMo 3 model: \['model.layers.0"):
    hf.read_hf_dir(path)


def test_restore_into_incompatible_model_names_parameter_and_shapes(tmp_path):
  save_transformers_model(tmp_path / "hf", MICRO)
  assert convert_main(["import-hf", "--hf_dir", str(tmp_path / "hf"),
                       "--out", str(tmp_path / "ckpt")]) == 0
  other = MICRO.replace(mlp_hidden=128)
  target = checkpoint.host_target(model_lib.param_shapes(other))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"\['layers'\]\['mlp'\]\['down_proj'\]\['kernel'\] has shape "
                           r"\(6, 96, 64\) in the checkpoint; the model expects \(6, 128, 64\)"):
    checkpoint.restore_params(tmp_path / "ckpt", target)


def test_export_refuses_to_overwrite(tmp_path, capsys):
  save_transformers_model(tmp_path / "hf", MICRO)
  assert convert_main(["import-hf", "--hf_dir", str(tmp_path / "hf"),
                       "--out", str(tmp_path / "ckpt")]) == 0
  assert convert_main(["import-hf", "--hf_dir", str(tmp_path / "hf"),
                       "--out", str(tmp_path / "ckpt")]) == 2
  assert "already exists" in capsys.readouterr().err


def test_large_exports_are_sharded_with_an_index(tmp_path, monkeypatch):
  monkeypatch.setattr(hf, "_SHARD_BYTES", 100_000)
  save_transformers_model(tmp_path / "hf", MICRO)
  cfg, params, _ = hf.read_hf_dir(tmp_path / "hf")
  hf.write_hf_dir(tmp_path / "out", cfg, params)
  files = sorted(os.listdir(tmp_path / "out"))
  assert "model.safetensors.index.json" in files and len(files) > 3
  assert sorted(_tensors(tmp_path / "out")) == sorted(_tensors(tmp_path / "hf"))
  reread = hf.SafetensorsDir(tmp_path / "out")  # reads through the index
  np.testing.assert_array_equal(reread.get("model.norm.weight"), params["norm"]["weight"])


def test_export_of_a_run_takes_its_latest_step_and_tokenizer(tmp_path, capsys):
  """export-hf --ckpt RUN_DIR: the newest step, the run's tokenizer beside the weights (one
  AutoTokenizer loads), a directory others can read; no checkpoint there: says what to pass."""
  from tokenizers import Tokenizer
  from transformers import AutoTokenizer

  from olmo3.data import embedded

  run, out = tmp_path / "run", tmp_path / "exported"
  tok_file = tmp_path / "tok.json"
  embedded.train_tokenizer([f"some words {i} and more {i * 3}" for i in range(200)],
                           vocab_size=400).save(str(tok_file))
  exp = config.Experiment(model=MICRO, data=config.DataConfig(paths=("x.npy",), seq_len=128),
                          eval=config.EvalConfig(tokenizer=str(tok_file)))
  run.mkdir()
  (run / "experiment.json").write_text(json.dumps(exp.to_dict()))
  save_transformers_model(tmp_path / "hf", MICRO)
  _, params, _ = hf.read_hf_dir(tmp_path / "hf")
  checkpoint.save_model(run / "checkpoints" / "4", MICRO, params)
  (run / "checkpoints" / "2").mkdir()  # an older step: not the one exported
  assert convert_main(["export-hf", "--ckpt", str(run), "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert f"exported {run / 'checkpoints' / '4'} -> {out}" in printed
  assert f"tokenizer: {tok_file}" in printed
  assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())
  modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}  # others can read
  assert modes == {name: oct(0o666 & ~_umask()) for name in modes} and "model.safetensors" in modes
  tokenizer = AutoTokenizer.from_pretrained(str(out))
  reference = Tokenizer.from_file(str(tok_file)).encode("some words 7", add_special_tokens=False)
  assert tokenizer("some words 7")["input_ids"] == reference.ids
  assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1)
  assert convert_main(["export-hf", "--ckpt", str(tmp_path / "hf"), "--out",
                       str(tmp_path / "o2")]) == 2
  assert "no checkpoint (expected a step directory" in capsys.readouterr().err


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask

