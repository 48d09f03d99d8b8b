"""An OLMo-core checkpoint's own config (config.json) as olmo3's ModelConfig: AI2's models are
the presets, in 3.0.0's layout and 2.4.0's, and what olmo3's model cannot express is refused in
one line naming the field and its value."""

import copy
import json

import pytest
from olmo_core.data import TokenizerConfig
from olmo_core.nn.rope import ABFRoPEScalingConfig, YaRNRoPEScalingConfig
from olmo_core.nn.transformer import TransformerConfig

from olmo3 import config
from olmo3.convert import olmo_core_config
from olmo3.convert.hf import ConversionError

WHERE = "save/step30/config.json"


def _experiment(model: TransformerConfig, length: int = 8192) -> dict:
  """config.json as OLMo-core's trainer writes it for AI2's scripts (the experiment's
  `as_config_dict()`, through JSON), the parts olmo3 reads."""
  return json.loads(json.dumps({
      "run_name": "run", "model": model.as_config_dict(),
      "dataset": {"tokenizer": TokenizerConfig.dolma2().as_config_dict(),
                  "sequence_length": length},
      "train_module": {"max_sequence_length": length}}))


def _as_2_4(experiment: dict) -> dict:
  """The same config as ai2-olmo-core 2.4.0 writes it (seen in its wheel's `as_config_dict()`
  of the same models): the block's attention under `attention`, no registered `type`, and
  without the fields 3.0.0 added (RoPE's no_global_rope and partial_rotary_factor, the
  attention's use_head_qk_norm / scalable_softmax / attention_sinks, the feed-forward's
  activation, tie_word_embeddings)."""
  out = copy.deepcopy(experiment)
  model = out["model"]
  model.pop("tie_word_embeddings")
  for block in [model["block"], *(model.get("block_overrides") or {}).values()]:
    attention = block["attention"] = block.pop("sequence_mixer")
    for key in ("type", "use_head_qk_norm", "scalable_softmax", "attention_sinks"):
      attention.pop(key)
    for key in ("no_global_rope", "partial_rotary_factor"):
      attention["rope"].pop(key)
    block["feed_forward"].pop("activation")
  return out


SEVEN_B = TransformerConfig.olmo3_7B(vocab_size=100_352)
LONG = SEVEN_B.with_rope_scaling(YaRNRoPEScalingConfig(factor=8, beta_fast=32, beta_slow=1,
                                                       old_context_len=8192))


@pytest.mark.parametrize("layout", [lambda e: e, _as_2_4], ids=["3.0.0", "2.4.0"])
def test_ai2s_models_are_the_presets(layout):
  """OLMo-core's own configs of AI2's models (and dolma2's tokenizer, the stages' lengths) map
  onto olmo3's presets field for field, in either version's layout."""
  for theirs, length, preset in (
      (SEVEN_B, 8192, "olmo3_7b"), (LONG, 65_536, "olmo3_7b_long_context"),
      (TransformerConfig.olmo3_32B(vocab_size=100_352), 8192, "olmo3_32b")):
    ours = olmo_core_config.model_config(layout(_experiment(theirs, length)), WHERE)
    assert olmo_core_config.differences(config.PRESETS[preset](), ours) == [], preset
    assert olmo_core_config.describe(ours, config.PRESETS) == preset


def test_other_shapes_map_field_by_field():
  """A model of no preset's shape: every field the config sets lands in its place; without a
  tokenizer the vocabulary is the embedding's rows."""
  from olmo_core.nn.attention import SlidingWindowAttentionConfig
  from olmo_core.nn.feed_forward import FeedForwardConfig
  from olmo_core.nn.transformer import TransformerBlockType

  theirs = TransformerConfig.llama_like(
      d_model=48, vocab_size=384, n_layers=7, n_heads=6, n_kv_heads=3, qk_norm=True,
      layer_norm_eps=1e-5, rope_theta=10_000, block_name=TransformerBlockType.reordered_norm,
      sliding_window=SlidingWindowAttentionConfig(pattern=[8, 8, -1],
                                                  force_full_attention_on_first_layer=False),
      feed_forward=FeedForwardConfig(hidden_size=80, bias=False),
  ).with_rope_scaling(YaRNRoPEScalingConfig(factor=4.0, beta_fast=16, beta_slow=2,
                                            old_context_len=16), full_attn_layers_only=False)
  ours = olmo_core_config.model_config({"model": json.loads(json.dumps(
      theirs.as_config_dict()))}, WHERE)
  assert ours == config.ModelConfig(
      vocab_size=384, padded_vocab_size=384, d_model=48, n_layers=7, n_heads=6, n_kv_heads=3,
      mlp_hidden=80, sliding_window=8, global_every=3, rope_theta=10_000.0,
      rope_scaling=config.Yarn(factor=4.0, beta_fast=16.0, beta_slow=2.0, original_context=16,
                               layers=config.ScaledLayers.ALL),
      norm_eps=1e-5, eos_token_id=None, pad_token_id=None)
  assert ours.layer_is_global == (False, False, True, False, False, True, True)
  assert olmo_core_config.describe(ours, config.PRESETS).startswith(
      "not a preset: vocab_size=384, padded_vocab_size=384, d_model=48, n_layers=7")


def _set(path: str, value):
  """A change of the 7B's 3.0.0 config: `value` at the dotted `path` (None removes it)."""
  def change(experiment: dict) -> dict:
    *parents, last = path.split(".")
    node = experiment["model"]
    for key in parents:
      node = node[key]
    if value is None:
      node.pop(last)
    else:
      node[last] = value
    return experiment
  return change


ATTN = "block.sequence_mixer"
REFUSED = [
    (_set("block.name", "default"), "model.block.name='default': olmo3's blocks normalise each "
                                    "sublayer's output (OLMo 2 and 3's reordered_norm)"),
    (_set(f"{ATTN}.bias", None), "model.block.sequence_mixer.bias absent (True): olmo3's "
                                 "projections have no bias"),
    (_set("block.feed_forward.bias", True), "model.block.feed_forward.bias=True: olmo3's "
                                            "feed-forward has no bias"),
    (_set("block.feed_forward.activation", "gelu_tanh"), "activation='gelu_tanh'"),
    (_set("block.layer_norm.name", "default"), "model.block.layer_norm.name='default': "
                                               "olmo3's norms are RMSNorm"),
    (_set("lm_head.layer_norm.bias", None), "model.lm_head.layer_norm.bias absent (True)"),
    (_set("lm_head.layer_norm", None), "model.lm_head.layer_norm absent (no norm)"),
    (_set("lm_head.bias", True), "model.lm_head.bias=True"),
    (_set("tie_word_embeddings", True), "model.tie_word_embeddings=True: olmo3's LM head is its "
                                        "own matrix"),
    (_set("embedding_norm", {"name": "rms", "eps": 1e-6, "bias": False}),
     "model.embedding_norm={"),
    (_set("block_pattern", ["attn", "gdn"]), "model.block_pattern=['attn', 'gdn']"),
    (_set(f"{ATTN}.type", "gated_delta_net"), "model.block.sequence_mixer.type='gated_delta_net': "
                                              "olmo3's layers are attention layers"),
    (_set(f"{ATTN}.name", "fused"), "model.block.sequence_mixer.name='fused'"),
    (_set(f"{ATTN}.head_dim", 256), "model.block.sequence_mixer.n_heads=32, head_dim=256: "
                                    "olmo3's head dimension is d_model / n_heads"),
    (_set(f"{ATTN}.qk_norm", None), "model.block.sequence_mixer.qk_norm absent (no QK norm)"),
    (_set(f"{ATTN}.use_head_qk_norm", True), "use_head_qk_norm=True: olmo3's QK norm is over "
                                             "all heads at once"),
    (_set(f"{ATTN}.clip_qkv", 8.0), "model.block.sequence_mixer.clip_qkv=8.0"),
    (_set(f"{ATTN}.rope.name", "complex"), "model.block.sequence_mixer.rope.name='complex'"),
    (_set(f"{ATTN}.rope.partial_rotary_factor", 0.25), "rope.partial_rotary_factor=0.25"),
    (_set(f"{ATTN}.rope.no_global_rope", True), "rope.no_global_rope=True"),
    (_set(f"{ATTN}.rope.scaling", ABFRoPEScalingConfig().as_config_dict()),
     "model.block.sequence_mixer.rope.scaling='olmo_core.nn.rope.ABFRoPEScalingConfig': "
     "olmo3's RoPE scaling is YaRN"),
    (_set("block.layer_norm.eps", 1e-5), "model.block.sequence_mixer.qk_norm.eps=1e-06, "
                                         "model.block.layer_norm.eps=1e-05, "
                                         "model.lm_head.layer_norm.eps=1e-06: olmo3's norms "
                                         "share one eps"),
    (_set(f"{ATTN}.sliding_window.pattern", [4096, -1, 4096, 4096]),
     "model.block.sequence_mixer.sliding_window: windows per layer [4096, -1, 4096, 4096, "),
    (_set(f"{ATTN}.sliding_window.pattern", [4096, 2048, 4096, -1]), "windows per layer "
                                                                     "[4096, 2048, 4096, -1, "),
    (_set(f"{ATTN}.sliding_window.force_full_attention_on_first_layer", True),
     "windows per layer [-1, 4096, 4096, 4096, -1, "),
    (_set(f"{ATTN}.a_future_setting", 2), "model.block.sequence_mixer.a_future_setting=2: a "
                                          "setting olmo3 does not know"),
    (_set("block_overrides", {"0": LONG.as_config_dict()["block_overrides"][3]}),
     "model.block_overrides: YaRN on layers [0], 1 kind(s): olmo3 scales RoPE one way, on "
     "every layer or on the full-attention ones"),
    (_set("block_overrides", {"5": {**SEVEN_B.as_config_dict()["block"],
                                    "feed_forward": {"hidden_size": 512, "bias": False}}}),
     "model.block_overrides.5: mlp_hidden 512, layer 0's 11008: olmo3's layers share one "
     "mlp_hidden"),
]


@pytest.mark.parametrize("change, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_what_olmo3_cannot_express_is_refused_by_name(change, message):
  with pytest.raises(ConversionError) as refused:
    olmo_core_config.model_config(change(_experiment(SEVEN_B)), WHERE)
  text = str(refused.value)
  assert text.startswith(f"{WHERE}: ") and "\n" not in text
  assert message in text and text.endswith("olmo3's model cannot express it"), text


def test_settings_of_the_machine_and_switched_off_features_are_read_past():
  """Kernels, dtypes, initialisation, an unknown feature left off: the 7B still."""
  experiment = _experiment(SEVEN_B)
  for change in (_set(f"{ATTN}.backend", "te"), _set("dtype", "bfloat16"),
                 _set("init_method", "fan_in"), _set(f"{ATTN}.mxfp8_projections", True),
                 _set(f"{ATTN}.a_future_setting", False), _set("freeze_params", ["blocks.*"])):
    experiment = change(experiment)
  ours = olmo_core_config.model_config(experiment, WHERE)
  assert olmo_core_config.describe(ours, config.PRESETS) == "olmo3_7b"
