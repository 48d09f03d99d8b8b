"""AI2's OLMo-core checkpoints into olmo3: the import (weights, Adam's state, trainer state; read
over HTTP too), continuing them in AI2's two ways as OLMo-core continues them, and the runs that
would not be AI2's, refused."""

import dataclasses
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest
import torch

from olmo3 import config, model as model_lib
from olmo3.config import (CheckpointConfig, ConfigError, DataConfig, Experiment, InitMode,
                          OptimizerConfig, TrainConfig)
from olmo3.convert import olmo_core_params, olmo_core_import, parity
from olmo3.convert.__main__ import main as convert_main
from olmo3.data import tokens
from olmo3.data.tokens import DataError
from olmo3.io import checkpoint, olmo_core_checkpoints
from olmo3.run.plan import InitFromError, RunPlan, data_identity
from olmo3.placement import ShardedModel
from olmo3.train import continuation
from olmo3.train.run_checkpoints import RunCheckpoints
from olmo3.train.state import StateLayout, restore_or_init

import forked
from conftest import benchmark_result, random_params
from harness.storage_servers import InstrumentedRangeServer

MICRO = config.olmo3_micro()
SEQ, BATCH, SEED, STEP = 32, 4, 5, 3  # the fixture's run: 3 steps of 4 instances of 32 tokens
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # tests/test_launch.py's
# A model of no preset's shape: 5 layers, grouped-query attention (6 heads, 2 for keys and
# values), windows of 8 with every third layer and the last full, RoPE theta 10,000 with YaRN on
# the full-attention layers, norm eps 1e-5, and its own tokenizer (300 ids).
OTHER = config.ModelConfig(
    vocab_size=300, padded_vocab_size=384, d_model=48, n_layers=5, n_heads=6, n_kv_heads=2,
    mlp_hidden=80, sliding_window=8, global_every=3, rope_theta=10_000.0,
    rope_scaling=config.Yarn(factor=4.0, beta_fast=16.0, beta_slow=2.0, original_context=16),
    norm_eps=1e-5, max_seq_len=64, eos_token_id=0, pad_token_id=1)


@pytest.fixture(scope="module")
def ai2(tmp_path_factory):
  """An OLMo-core checkpoint written by OLMo-core's own Checkpointer: its train module (the
  micro model, SkipStepAdamW with AI2's groups) after 3 updates of random gradients, and a
  trainer state with its data loader's own state 3 batches into token files. Returns (the step
  directory, the token files, OLMo-core's state dict as numpy)."""
  from olmo_core.data import (NumpyDataLoaderConfig, NumpyDatasetDType, NumpyFSLDatasetConfig,
                              TokenizerConfig)
  from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig
  from olmo_core.train.checkpoint import Checkpointer
  from olmo_core.train.train_module import TransformerTrainModuleConfig
  from olmo_core.train.utils import EnvRngStates

  root = tmp_path_factory.mktemp("ai2")
  rng = np.random.default_rng(0)
  paths = []
  for i, n in enumerate([40, 25]):  # instances per file
    paths.append(str(root / f"part-{i}.npy"))
    tokens.write_token_file(paths[-1], rng.integers(2, MICRO.vocab_size, n * SEQ))
  torch.manual_seed(0)
  module = TransformerTrainModuleConfig(
      rank_microbatch_size=BATCH * SEQ, max_sequence_length=SEQ,
      optim=SkipStepAdamWConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                group_overrides=[OptimGroupOverride(
                                    params=["embeddings.weight"], opts=dict(weight_decay=0.0))]),
  ).build(olmo_core_params.transformer_config(MICRO).build(init_device="cpu"))
  for _ in range(STEP):
    for p in module.model.parameters():
      p.grad = torch.randn_like(p)
    module.optim.latest_loss, module.optim.latest_grad_norm = torch.tensor(5.0), torch.tensor(1.0)
    module.optim.step()
  tokenizer = TokenizerConfig(vocab_size=MICRO.vocab_size, eos_token_id=MICRO.eos_token_id,
                              pad_token_id=MICRO.pad_token_id)
  dataset = NumpyFSLDatasetConfig(paths=paths, sequence_length=SEQ, tokenizer=tokenizer,
                                  dtype=NumpyDatasetDType.uint32, work_dir=str(root)).build()
  loader = NumpyDataLoaderConfig(global_batch_size=BATCH * SEQ, seed=SEED, num_workers=0,
                                 work_dir=str(root)).build(dataset)
  loader.reshuffle(epoch=1)
  loader.batches_processed, loader.tokens_processed = STEP, STEP * BATCH * SEQ
  state = {"global_step": STEP, "global_train_tokens_seen": STEP * BATCH * SEQ,
           "global_train_petaflops": 0.0, "max_steps": 10, "data_loader": loader.state_dict(),
           "epoch": 1, "world_size": 1, "rng": EnvRngStates.current_state().as_dict(),
           "callbacks": {}}
  step_dir = root / "save" / f"step{STEP}"
  Checkpointer(work_dir=root / "work").save(step_dir, module, state)
  saved = {"model": {k: v.numpy().copy() for k, v in module.model.state_dict().items()},
           "optim": {name: {k: v.numpy().copy() for k, v in module.optim.state[p].items()}
                     for name, p in module.model.named_parameters()}}
  return str(step_dir), paths, saved


def _experiment(paths, mode=InitMode.CONTINUE, init_from=None, **data):
  return Experiment(
      model=MICRO.replace(max_seq_len=SEQ),
      # (OLMo-core's datasets here are built without max_target_sequence_length.)
      data=DataConfig(**{"paths": tuple(paths), "seq_len": SEQ, "global_batch_size": BATCH,
                         "seed": SEED, "max_target_seq_len": None, **data}),
      optimizer=OptimizerConfig(peak_lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                no_decay=("embed_tokens",), warmup_steps=2, decay_steps=10),
      train=TrainConfig(steps=10, eval_every=0),
      checkpoint=CheckpointConfig(init_from=init_from, init_mode=mode, async_save=False))


def _start(exp, workdir):
  """The trainer's start: (state, data position)."""
  plan = RunPlan.build(exp, str(workdir))
  model = ShardedModel.for_experiment(exp, jax.devices()[:1])
  with model.context():
    return restore_or_init(StateLayout(exp, model),
                           RunCheckpoints(plan.workdir.checkpoints, 1, async_save=False), plan)


@pytest.mark.slow(seconds=20)
def test_both_modes_continue_as_olmo_core_does(tmp_path):
  """The benchmark command (benchmarks/continue_olmo_core.py), shortened: OLMo-core's Trainer
  trains 11 steps and saves; OLMo-core and olmo3 each continue it 4 steps (the stage, across
  the epoch's end at step 13; and a new stage on other data from the weights and optimizer
  state). Two trainers side by side are the slow tier's, not the edit loop's."""
  result = benchmark_result("continue_olmo_core", ["--steps", "11", "--continue_steps", "4",
                                                  "--spike_at", "0", "--workdir", str(tmp_path)])
  for mode in ("continue", "new_stage"):
    assert result[mode]["steps"] == result[mode]["steps_olmo_core"] == 4, mode
    assert result[mode]["instances_equal"] and result[mode]["skip_decisions_equal"], mode
    assert result[mode]["max_abs_loss_diff"] < 1e-5, mode
    assert result[mode]["max_abs_lr_diff"] < 1e-9, mode
  assert result["ok"]


def test_import_puts_adams_state_in_its_leaves(ai2, tmp_path, capsys):
  step_dir, paths, saved = ai2
  out = tmp_path / "imported"
  assert convert_main(["import-olmo-core", "--src", step_dir, "--out", str(out),
                       "--model", "olmo3_micro"]) == 0
  assert "global step 3, epoch 1" in capsys.readouterr().out
  exp = _experiment(paths, InitMode.NEW_STAGE)
  model = ShardedModel.for_experiment(exp, jax.devices()[:1])
  with model.context():
    params, opt_state, meta = StateLayout(exp, model).restore_init(out)
  adam = opt_state[1]  # optim.adamw: clip, Adam, decay, scale
  assert int(adam.count) == STEP  # every parameter's SkipStepAdamW step
  for source in olmo_core_params.sources(MICRO):
    for i, name in enumerate(source.names):
      for ours, theirs in ((params, saved["model"][name]),
                           (adam.mu, saved["optim"][name]["exp_avg"]),
                           (adam.nu, saved["optim"][name]["exp_avg_sq"])):
        value = np.asarray(olmo_core_params.leaf(ours, source.path))
        value = value[i] if source.stacked else value
        np.testing.assert_array_equal(value.T if source.transposed else value, theirs, name)
  groups = meta["olmo_core"]["optimizer"]
  assert groups["embed_tokens"]["weight_decay"] == 0.0  # AI2's group: no decay on the embedding
  assert {groups[g]["weight_decay"] for g in ("layers", "norm", "lm_head")} == {0.1}
  # The same checkpoint read as the 7B: one line naming the tensor and both shapes.
  assert convert_main(["import-olmo-core", "--src", step_dir, "--out", str(tmp_path / "x")]) == 2
  assert ("tensor model.embeddings.weight has shape (512, 64); the model config "
          "(7,298,617,344 parameters) expects (100352, 4096)") in capsys.readouterr().err


def test_import_over_http_is_the_local_import(ai2, tmp_path):
  step_dir, _, _ = ai2
  local = olmo_core_import.import_checkpoint(step_dir, str(tmp_path / "local"), MICRO)
  root, name = os.path.split(step_dir)
  with InstrumentedRangeServer(root) as server:
    remote = olmo_core_import.import_checkpoint(f"{server.url}/{name}", str(tmp_path / "http"),
                                                MICRO)
    assert server.requests  # every byte came over HTTP, by range
  assert remote["source"] == f"{server.url}/{name}"
  assert remote["olmo_core"] == local["olmo_core"]
  # Every array's checksum (the meta's records) is the local import's: the same values.
  records = [checkpoint.load_meta(tmp_path / d)[checkpoint.ARRAYS] for d in ("local", "http")]
  assert records[0] == records[1]


def test_continue_takes_step_and_data_position(ai2, tmp_path):
  step_dir, paths, _ = ai2
  state, position = _start(_experiment(paths, init_from=step_dir), tmp_path / "run")
  assert int(state.step) == STEP and position.data_step(STEP) == STEP  # batch 3 of epoch 1
  assert int(state.skip.recorded) == 0  # SkipStepAdamW's window is in no checkpoint
  assert os.path.isdir(tmp_path / "run" / "olmo_core_import")  # converted into the workdir once
  state, position = _start(_experiment(paths, InitMode.NEW_STAGE, init_from=step_dir),
                           tmp_path / "stage2")
  assert int(state.step) == 0 and position.data_step(0) == 0


@pytest.mark.parametrize("data, message", [
    (dict(global_batch_size=2), "trained with 4 instances per step, "
                                "DataConfig.global_batch_size=2"),
    (dict(seed=6), "data order has seed 5, DataConfig.seed=6"),
])
def test_other_data_is_refused_before_converting(ai2, tmp_path, data, message):
  step_dir, paths, _ = ai2
  with pytest.raises(DataError, match=message):
    _start(_experiment(paths, init_from=step_dir, **data), tmp_path)
  assert not os.path.exists(tmp_path / "olmo_core_import")  # nothing downloaded


def test_other_optimizer_settings_are_refused(ai2, tmp_path):
  step_dir, paths, _ = ai2
  exp = _experiment(paths, InitMode.NEW_STAGE, init_from=step_dir)
  exp = dataclasses.replace(exp, optimizer=dataclasses.replace(exp.optimizer, no_decay=()))
  with pytest.raises(ConfigError, match=r"OptimizerConfig.weight_decay=0.1, no_decay=\(\) "
                                        r".*has weight_decay 0.0 for 'embed_tokens'"):
    _start(exp, tmp_path)


def test_what_continuing_refuses(ai2, tmp_path):
  """The data a continuation checks, without a run: sequence length, token files, trainer state."""
  step_dir, paths, _ = ai2
  facts = olmo_core_import.facts(olmo_core_checkpoints.locate(step_dir), MICRO)

  def start(exp, files=paths, found=facts):
    source = tokens.TokenFiles(files, exp.data.seq_len)
    return continuation.olmo_core_start(found, exp, data_identity(exp.data, source),
                                        len(source) // exp.data.global_batch_size, step_dir)

  exp = _experiment(paths, init_from=step_dir)
  assert start(exp) == (STEP, STEP)
  with pytest.raises(DataError, match="trained at sequence length 32, DataConfig.seq_len=16"):
    start(_experiment(paths, init_from=step_dir, seq_len=16))
  other = str(tmp_path / "other.npy")
  shutil.copy(paths[0], other)
  with pytest.raises(DataError, match=r"other token files \(OLMo-core's data fingerprint"):
    start(_experiment([other, paths[1]], init_from=step_dir), files=[other, paths[1]])
  with pytest.raises(checkpoint.CheckpointError, match="holds no trainer state"):
    start(exp, found={**facts, "trainer": None})


def test_official_names_resolve_without_a_network():
  official = olmo_core_checkpoints.official()
  assert len(official) == 1475  # AI2's CSV: stage 1 every 1000 steps, stages 2 and 3
  end = official["olmo3-7b/stage1/step1413814"]
  assert (end.stage, end.step) == ("stage1_pretraining", 1_413_814)
  found = olmo_core_checkpoints.locate("olmo3-7b/stage2/step10000")
  base = "https://olmo-checkpoints.org/ai2-llm/Olmo-3-1025-7B/stage2/step10000"
  assert found == olmo_core_checkpoints.OlmoCoreCheckpoint(
      base, f"{base}/model_and_optim", f"{base}/train/rank0.pt")


def test_ai2s_stage3_checkpoints_import_as_the_long_context_model():
  """Without --model, AI2's stage-3 checkpoints (by name or URL) are read as the model stage 3
  trains: the 7B with YaRN, as experiments.olmo3_7b:stage3 builds it; others as the 7B."""
  import fiddle as fdl

  from experiments import olmo3_7b
  from olmo3.config import PRESETS
  from olmo3.convert.__main__ import default_preset
  from olmo3.io import olmo_core_checkpoints

  stage3 = olmo_core_checkpoints.official()["olmo3-7b/stage3/step11921"]
  assert default_preset(stage3.name) == default_preset(stage3.url) == "olmo3_7b_long_context"
  assert default_preset("olmo3-7b/stage2/step47684") == "olmo3_7b"
  trained = fdl.build(olmo3_7b.stage3()).model
  machine = ("compute_dtype", "attention", "remat", "remat_custom")  # not the checkpoint's
  assert (PRESETS["olmo3_7b_long_context"]().replace(**{f: getattr(trained, f) for f in machine})
          == trained)


def _other_shape_experiment(work):
  """OLMo-core's train module of OTHER, built from OLMo-core's own description of it
  (`llama_like`, `with_rope_scaling`: not from olmo3's mapping), and the experiment config its
  trainer would write beside each checkpoint (ConfigSaverCallback: the parts AI2's scripts'
  ExperimentConfig has that olmo3 reads)."""
  from olmo_core.data import NumpyFSLDatasetConfig, TokenizerConfig
  from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
  from olmo_core.nn.feed_forward import FeedForwardConfig
  from olmo_core.nn.rope import YaRNRoPEScalingConfig
  from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig
  from olmo_core.optim import SkipStepAdamWConfig
  from olmo_core.train.train_module import TransformerTrainModuleConfig

  model = TransformerConfig.llama_like(
      d_model=48, vocab_size=384, n_layers=5, n_heads=6, n_kv_heads=2, qk_norm=True,
      layer_norm_eps=1e-5, rope_theta=10_000, block_name=TransformerBlockType.reordered_norm,
      sliding_window=SlidingWindowAttentionConfig(pattern=[8, 8, -1],
                                                  force_full_attention_on_first_layer=False),
      attn_backend=AttentionBackendName.torch,
      feed_forward=FeedForwardConfig(hidden_size=80, bias=False),
  ).with_rope_scaling(YaRNRoPEScalingConfig(factor=4.0, beta_fast=16, beta_slow=2,
                                            old_context_len=16))
  train = TransformerTrainModuleConfig(rank_microbatch_size=2 * 64, max_sequence_length=64,
                                       optim=SkipStepAdamWConfig(lr=1e-3))
  dataset = NumpyFSLDatasetConfig(
      paths=[str(work / "part-0.npy")], sequence_length=64, work_dir=str(work),
      tokenizer=TokenizerConfig(vocab_size=300, eos_token_id=0, pad_token_id=1))
  torch.manual_seed(0)
  module = train.build(model.build(init_device="cpu"))
  experiment = {"run_name": "other", "model": model.as_config_dict(),
                "dataset": dataset.as_config_dict(), "train_module": train.as_config_dict()}
  return module, json.dumps(experiment)


@pytest.mark.slow(seconds=5, waits=True)
def test_a_save_folder_of_another_shape_imports_through_the_cli(tmp_path):
  """OLMo-core's Checkpointer saves a model of no preset's shape at steps 1 and 2 of a save
  folder, each with its config.json as OLMo-core's trainer writes it; step 3 is cut short
  (no .metadata.json yet). `python -m olmo3.convert import-olmo-core --src FOLDER` takes step 2
  and says so, reads the model from its config.json, and the imported model computes
  OLMo-core's logits at step 2's weights (wide ones, so a wrong window, RoPE or eps shows)."""
  from olmo_core.train.checkpoint import Checkpointer
  from olmo_core.train.utils import EnvRngStates

  module, experiment = _other_shape_experiment(tmp_path)
  module.model.load_state_dict(olmo_core_params.state_dict(OTHER, random_params(OTHER, seed=4)))
  save, checkpointer = tmp_path / "save", Checkpointer(work_dir=tmp_path / "work")
  for step in (1, 2):
    for p in module.model.parameters():
      p.grad = 1e-2 * torch.randn_like(p)
    module.optim.latest_loss, module.optim.latest_grad_norm = torch.tensor(5.0), torch.tensor(1.0)
    module.optim.step()
    state = {"global_step": step, "global_train_tokens_seen": step * 128, "max_steps": 10,
             "data_loader": {}, "epoch": 1, "world_size": 1,
             "rng": EnvRngStates.current_state().as_dict(), "callbacks": {}}
    checkpointer.save(save / f"step{step}", module, state)
    checkpointer.write_file(save / f"step{step}", "config.json", experiment)
  shutil.copytree(save / "step2", save / "step3")
  os.remove(save / "step3" / ".metadata.json")
  tokens = parity.random_tokens(OTHER, 2, parity.default_seq_len(OTHER))
  module.model.eval()
  with torch.no_grad():
    theirs = module.model(torch.from_numpy(tokens.astype(np.int64))).float().numpy()

  out = tmp_path / "imported"
  done = forked.completed("olmo3.convert", ["import-olmo-core", "--src", str(save),
                                            "--out", str(out)], ENV)
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stdout.splitlines()
  assert lines[0] == (f"{save} is an OLMo-core save folder: taking its newest complete step, "
                      "step2; passed over, incomplete (OLMo-core had not finished writing them): "
                      "step3 (no .metadata.json)")
  assert lines[1].startswith("model: not a preset: vocab_size=300, padded_vocab_size=384, "
                             "d_model=48, n_layers=5, n_heads=6, n_kv_heads=2, mlp_hidden=80, ")
  assert lines[1].endswith(f"(from {save / 'step2' / 'config.json'})")
  assert lines[2].startswith(f"imported {save / 'step2'} (its own model: ")
  meta = checkpoint.load_meta(out)
  cfg = config.ModelConfig(**meta["model_config"])
  assert cfg == OTHER and meta["step"] == 2
  params = checkpoint.restore_params(out, checkpoint.host_target(model_lib.param_shapes(cfg)))
  ours, _ = parity.our_forward(cfg.replace(compute_dtype=config.DType.FLOAT32), params, tokens)
  metrics = parity.compare_logits(theirs, ours)
  assert metrics["ref_logit_std"] > 2.0
  assert metrics["max_kl"] <= 1e-6 and metrics["top1_agreement"] == 1.0, metrics


def test_init_from_a_save_folder_takes_its_newest_complete_step(ai2, tmp_path, caplog):
  """checkpoint.init_from naming an OLMo-core save folder means its newest complete step, as
  OLMo-core's load_path does: step3 here, passing over step7 (no .metadata.json: OLMo-core had
  not finished writing it) and step9-tmp (where OLMo-core writes a step on a disk before naming
  it); the launch says which, and converts that step. A folder with no complete step is
  refused in one line naming what each lacks."""
  step_dir, paths, _ = ai2
  save = tmp_path / "save"
  for name in ("step0", "step3", "step7", "step9-tmp"):
    shutil.copytree(step_dir, save / name)
  os.remove(save / "step7" / ".metadata.json")
  exp = _experiment(paths, init_from=str(save))
  with caplog.at_level(logging.WARNING):
    plan = RunPlan.build(exp, str(tmp_path / "run"))
  assert plan.resume.olmo_core == str(save / "step3")
  assert (f"CheckpointConfig.init_from='{save}': {save} is an OLMo-core save folder: taking its "
          "newest complete step, step3; passed over, incomplete (OLMo-core had not finished "
          "writing them): step7 (no .metadata.json)") in caplog.text
  assert (f"initialised from {save / 'step3'} (checkpoint.init_mode=continue: its parameters, "
          "AdamW moments, step, schedule and data position)") in "\n".join(plan.describe())
  state, position = _start(exp, tmp_path / "run")
  assert int(state.step) == STEP and position.data_step(STEP) == STEP
  assert checkpoint.load_meta(tmp_path / "run" / "olmo_core_import")["source"] == str(
      save / "step3")
  for name in ("step0", "step3"):
    shutil.rmtree(save / name)
  with pytest.raises(InitFromError) as refused:
    RunPlan.build(exp, str(tmp_path / "other"))
  assert str(refused.value) == (
      f"CheckpointConfig.init_from='{save}': {save}: an OLMo-core save folder without a "
      "complete step (OLMo-core's marker is .metadata.json, written last): step7 (no "
      ".metadata.json)")


def test_a_model_olmo3_cannot_express_is_refused_before_converting(ai2, tmp_path, capsys):
  """A checkpoint whose config.json describes pre-norm blocks holds tensors of our names and
  shapes: read as ours, it would run as another model. init_from refuses it, naming the field,
  before any tensor is read; the CLI too, and --model must agree with a config.json."""
  step_dir, paths, _ = ai2
  source = tmp_path / "step3"
  shutil.copytree(step_dir, source)
  experiment = {"model": olmo_core_params.transformer_config(MICRO).as_config_dict(),
                "train_module": {"max_sequence_length": SEQ}}
  (source / "config.json").write_text(json.dumps(experiment))
  assert convert_main(["import-olmo-core", "--src", str(source), "--out", str(tmp_path / "a"),
                       "--model", "olmo3_micro"]) == 2
  assert (f"error: --model olmo3_micro differs from {source / 'config.json'}: vocab_size=500 "
          "(the checkpoint's: 512); max_seq_len=256 (the checkpoint's: 32); eos_token_id=0 "
          "(the checkpoint's: None); pad_token_id=1 (the checkpoint's: None) (leave --model out "
          "to take the checkpoint's own)\n") == capsys.readouterr().err
  experiment["model"]["block"]["name"] = "default"
  (source / "config.json").write_text(json.dumps(experiment))
  refusal = (f"{source / 'config.json'}: model.block.name='default': olmo3's blocks normalise "
             "each sublayer's output (OLMo 2 and 3's reordered_norm); olmo3's model cannot "
             "express it")
  with pytest.raises(checkpoint.CheckpointError) as refused:
    _start(_experiment(paths, init_from=str(source)), tmp_path / "run")
  assert str(refused.value) == f"checkpoint.init_from={str(source)!r}: {refusal}"
  assert not os.path.exists(tmp_path / "run" / "olmo_core_import")
  assert convert_main(["import-olmo-core", "--src", str(source), "--out",
                       str(tmp_path / "b")]) == 2
  assert capsys.readouterr().err == f"error: {refusal}\n"
