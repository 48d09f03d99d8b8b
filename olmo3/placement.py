"""The model laid out on a mesh: what training, evaluation and compilation share.

`ShardedModel(cfg, mesh, rules)` holds the parameter tree's shardings and restore targets, the
batch sharding, and `apply(params, tokens)`: the model as a function of a parameter tree (the
layout checkpoints use). It allocates nothing; parameters come from a checkpoint or from
`init_params`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from olmo3 import loss
from olmo3 import model as model_lib
from olmo3 import sharding as sharding_lib
from olmo3.config import ContextParallel, Experiment, ModelConfig


class ShardedModel:
  def __init__(self, cfg: ModelConfig, mesh: jax.sharding.Mesh,
               rules: sharding_lib.Rules = sharding_lib.FSDP_RULES):
    self.cfg, self.mesh, self.rules = cfg, mesh, rules
    with self.context():
      self.graphdef, abstract_state = nnx.split(model_lib.abstract_model(cfg))
      specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))
      self.param_shapes = nnx.to_pure_dict(abstract_state)
    self.param_shardings = jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, spec), specs,
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    # Where a restored checkpoint goes: Orbax reshards onto these, whatever mesh saved it.
    self.param_target = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), self.param_shapes,
        self.param_shardings)
    self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # [batch, seq] inputs: rows over the data-parallel axes, positions over `sequence`.
    self.batch_sharding = jax.sharding.NamedSharding(
        mesh, sharding_lib.logical_to_spec(("batch", "seq"), rules))

  @classmethod
  def for_experiment(cls, exp: Experiment, devices: Sequence[jax.Device] | None = None
                     ) -> ShardedModel:
    """The experiment's mesh over `devices` (default: all) and its rules."""
    return cls(exp.model, sharding_lib.experiment_mesh(exp.mesh, devices),
               exp.mesh.rules or sharding_lib.FSDP_RULES)

  @contextlib.contextmanager
  def context(self) -> Iterator[None]:
    """Trace and run jitted functions of this model inside this context (mesh and rules)."""
    with sharding_lib.use_mesh(self.mesh, self.rules):
      yield

  def apply(self, params: Any, tokens_BT: jax.Array, segments_BT: jax.Array | None = None
            ) -> jax.Array:
    """Logits [B, T, V] of a parameter tree (traced inside `context()`: the logical rules there
    shard the activations). `segments_BT`: documents of packed instances (Transformer)."""
    return nnx.merge(self.graphdef, params)(tokens_BT, segments_BT)

  def features(self, params: Any, tokens_BT: jax.Array, segments_BT: jax.Array | None = None,
               order_T: np.ndarray | None = None) -> jax.Array:
    """[B, T, D]: the final hidden states the LM head reads (columns laid out as `order_T`
    says: model.Transformer.features)."""
    return nnx.merge(self.graphdef, params).features(tokens_BT, segments_BT, order_T)

  def head(self, params: Any, h_xD: jax.Array) -> jax.Array:
    """The LM head's logits [..., V] of final hidden states [..., D] (any leading shape)."""
    return nnx.merge(self.graphdef, params).lm_head(h_xD)

  def token_losses(self, params: Any, tokens_BT: jax.Array, labels_BT: jax.Array,
                   segments_BT: jax.Array | None = None) -> loss.PerToken:
    """Each position's cross-entropy, log-partition and mask: what training and held-out
    evaluation score. Fused over vocabulary chunks of `cfg.vocab_chunk` columns (never the
    full float32 logits), or from the full logits when it is None; the same to float32
    rounding. Both read `features`. `segments_BT`: documents of packed instances.

    With context parallelism by gathering (the mesh splits the sequence; ContextParallel.
    ALL_GATHER) the rows are laid out so that causal attention costs every shard the same
    (olmo3.sharding.balanced_order): tokens, labels and documents go in laid out, the
    per-token losses come back in position order. All-to-all context parallelism attends the
    whole sequence on every device, so its split stays contiguous."""
    order_T = None
    if (sharding_lib.sequence_shards() > 1
        and self.cfg.context_parallel is ContextParallel.ALL_GATHER):
      order_T = sharding_lib.balanced_order(tokens_BT.shape[1], sharding_lib.sequence_shards())
      lay_out = lambda x_BT: sharding_lib.constrain(x_BT[:, order_T], ("batch", "seq"))
      tokens_BT, labels_BT = lay_out(tokens_BT), lay_out(labels_BT)
      segments_BT = None if segments_BT is None else lay_out(segments_BT)
    h_BTD = self.features(params, tokens_BT, segments_BT, order_T)
    if self.cfg.vocab_chunk is None:
      logits_BTV = sharding_lib.constrain(self.head(params, h_BTD), ("batch", "seq", "act_vocab"))
      per_token = loss.token_nll(logits_BTV, labels_BT)
    else:
      per_token = loss.fused_token_nll(h_BTD, params["lm_head"]["kernel"], labels_BT,
                                       self.cfg.vocab_chunk, sharding_lib.constrain)
    if order_T is None:
      return per_token
    inverse_T = np.argsort(order_T)
    return loss.PerToken(*(sharding_lib.constrain(x_BT[:, inverse_T], ("batch", "seq"))
                           for x_BT in per_token))

  def logits_at(self, params: Any, tokens_BT: jax.Array, position_B: jax.Array) -> jax.Array:
    """[B, V]: each row's logits at one position (the LM head applied there alone)."""
    h_BTD = self.features(params, tokens_BT)
    return self.head(params, jnp.take_along_axis(h_BTD, position_B[:, None, None], axis=1)[:, 0])

  def init_params(self, seed: int) -> Any:
    """Freshly initialised parameters (OLMo's init), created sharded: no device holds them all."""
    cfg = self.cfg

    def fresh():
      return nnx.to_pure_dict(nnx.state(model_lib.Transformer(cfg, rngs=nnx.Rngs(seed)),
                                        nnx.Param))

    with self.context():
      return jax.jit(fresh, out_shardings=self.param_shardings)()
