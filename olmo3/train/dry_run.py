"""What `--dry_run` prints after the config (the launcher prints Fiddle's flattened config
first), every line of it: the numbers the config implies (parameters, FLOPs per token, tokens
per step, steps, peak LR; RoPE scaling and packed documents when the run has them), the plan
(`RunPlan.describe`: the data, its epoch, where the run starts), what is evaluated (each
held-out mix's sets, sized when the plan is known; the downstream tasks), the mesh on this
machine or on a TPU topology and how the starting checkpoint's layout changes onto it, the
compilation cache, and a finished run's closing summary (`olmo3.train.closing.lines`, what the
launch of a finished run prints, from the next stage the launcher found).

It reads the data and the workdir as a launch would and writes nothing. What cannot be read
from here (AI2's data on a laptop) is said in one line, and the rest is printed. Lines come
as they are worked out (a generator): the numbers show while remote files are sized.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import jax

from olmo3 import sharding
from olmo3.config import INT32_MAX, Experiment, LossMean, Schedule
from olmo3.data import sources
from olmo3.data.tokens import DataError
from olmo3.io import checkpoint
from olmo3.io.checkpoint import CheckpointError
from olmo3.run.plan import CARRIED, RunPlan, Start
from olmo3.train import closing


def lines(exp: Experiment, workdir: str, name: str, *, topology: str | None = None,
          topology_devices: Callable[[str], list] | None = None,
          compilation_cache: str | None = None,
          next_stage: closing.NextStage | None = None) -> Iterator[str]:
  """The dry run of `exp` in `workdir` (`name`: its reference). `topology` (kind:AxBxC): the
  mesh on that TPU topology, whose devices `topology_devices` gives (else on this machine's);
  `compilation_cache`: the directory the launch would use (None: off); `next_stage`: the stage
  after this one, as the launcher found it (in a finished run's closing summary)."""
  yield from numbers(exp)
  yield from long_context(exp)
  yield from chat(exp)
  try:  # held-out sets and tokenizer as the run takes them
    resolved = sources.resolve(exp)
  except DataError as e:
    yield f"data                cannot be resolved here: {e}"
    resolved = None
  plan = None
  try:  # the files' sizes and the start, when the data is reachable from here
    if resolved is not None:
      plan = RunPlan.from_resolved(resolved, workdir, name)
      yield from plan.describe()
  except (DataError, CheckpointError) as e:  # e.g. AI2's data on a laptop
    yield f"plan                unknown here: {e}"
  if plan is None and exp.checkpoint.init_from:  # where it starts, as far as the config says
    yield (f"start               from {exp.checkpoint.init_from} "
           f"(checkpoint.init_mode={exp.checkpoint.init_mode.value}: "
           f"{CARRIED[exp.checkpoint.init_mode]}) unless {workdir} holds a checkpoint of its "
           "own")
  yield from evaluated(exp, resolved, plan)
  mesh = None
  try:
    if topology:
      devices = topology_devices(topology)
      where = f"{len(devices)} {devices[0].device_kind} devices ({topology})"
    else:
      devices, where = None, f"{jax.device_count()} {jax.default_backend()} devices"
    mesh = sharding.experiment_mesh(exp.mesh, devices)
    dcn = f" x DCN {dict(exp.mesh.dcn)}" if exp.mesh.dcn else ""
    yield f"mesh                {dict(exp.mesh.shape)}{dcn} -> {dict(mesh.shape)} on {where}"
  except ValueError as e:
    yield (f"mesh                {dict(exp.mesh.shape)} -> does not fit the "
           f"{where if topology is None else topology} ({e})")
  start = plan.start_checkpoint() if plan is not None else None
  if start is not None and mesh is not None:
    try:
      written = checkpoint.load_meta(start).get("written_on")
      yield f"checkpoint layout   {sharding.layout_change(written, mesh)}"
    except CheckpointError as e:
      yield f"checkpoint layout   unknown: {e}"
  yield (f"compilation cache   "
         f"{os.path.expanduser(compilation_cache) if compilation_cache else 'off'}")
  if plan is not None and plan.resume.start is Start.COMPLETE:
    yield ""
    yield from closing.lines(plan, next_stage)


def numbers(exp: Experiment) -> list[str]:
  """The config's numbers: size, FLOPs, batch, steps and schedule, peak LR."""
  m, d, o = exp.model, exp.data, exp.optimizer
  over = (f"stitched: part 1 aimed at {o.stitch_first_steps:,}, part 2 from update "
          f"{o.stitch_resumed_at + 1:,} aimed at {o.stitch_second_steps:,}"
          if o.schedule is Schedule.STITCHED_COSINE
          else "schedule over the stage's epochs" if o.decay_steps is None
          else f"schedule over {o.decay_steps:,}")
  warmup = (f"{o.warmup_fraction:.0%} of the schedule" if o.warmup_fraction is not None
            else o.warmup_steps)
  t = exp.train
  steps = (f"until the end of epoch {t.stop_at_epoch}" if t.steps == INT32_MAX
           and t.stop_at_epoch is not None else f"{t.steps:,}")
  loss = (f"each of {t.loss_ranks} data-parallel ranks' token mean, averaged (OLMo-core's)"
          if t.loss_mean is LossMean.PER_RANK and t.loss_ranks > 1 else "the token mean")
  z_loss = f" + z-loss x {t.z_loss_weight:g}" if t.z_loss_weight else ", no z-loss"
  return [f"parameters          {m.param_count:,}",
          f"FLOPs per token     {m.flops_per_token(d.seq_len) / 1e9:.3f} G (training, exact "
          "causal + sliding-window count)",
          f"tokens per step     {d.global_batch_size} x {d.seq_len} = {exp.tokens_per_step:,}",
          f"steps               {steps} ({over})",
          f"peak LR             {o.peak_lr!r} ({o.schedule.value}, warmup {warmup})",
          f"loss                cross-entropy: {loss}{z_loss}"]


def chat(exp: Experiment) -> list[str]:
  """The chat template a run on conversations checks its data against (SFT)."""
  if exp.data.chat_template is None:
    return []
  return [f"chat template       {exp.data.chat_template} (the data's manifest must record it); "
          "the loss on the assistant's tokens only (the data's label masks)"]


def long_context(exp: Experiment) -> list[str]:
  """RoPE scaling and packed documents (stage 3), when the run has them."""
  m, packing = exp.model, exp.data.packing
  out = []
  if m.rope_scaling is not None:
    y = m.rope_scaling
    scaled = [i for i in range(m.n_layers) if m.layer_rope_scaled(i)]
    out.append(f"RoPE                YaRN x{y.factor:g} over {y.original_context:,} tokens "
               f"(beta_fast {y.beta_fast:g}, beta_slow {y.beta_slow:g}, attention factor "
               f"{y.attention_factor:.6f}) on {len(scaled)} of {m.n_layers} layers "
               f"({y.layers.value}: {', '.join(map(str, scaled))}); the others plain, theta "
               f"{m.rope_theta:g}")
  if packing is not None:
    order = ("in mix order" if packing.source_permutation_seed is None
             else f"shuffled with seed {packing.source_permutation_seed}")
    out.append(f"packing             documents packed into {exp.data.seq_len:,}-token "
               f"instances (best-fit decreasing in groups of {packing.source_group_size} "
               f"files, {order}; long documents: "
               f"{packing.long_documents.value}); attention within each document, RoPE "
               f"positions per {m.rope_positions.value}")
  return out


def evaluated(exp: Experiment, resolved: sources.Resolved | None,
              plan: RunPlan | None) -> list[str]:
  """A line per held-out mix (its sets, how often, and their files and tokens when the plan
  sized them), or why there is none; then the downstream tasks."""
  ev = exp.eval if resolved is None else resolved.exp.eval
  cadence = (f"every {exp.train.eval_every:,} steps" if exp.train.eval_every
             else "never (train.eval_every=0)")
  sized = {p: n for s in plan.heldout for p, n in zip(s.paths, s.tokens)} if plan else {}
  out = []
  for mix, files in resolved.heldout if resolved is not None else ():
    labels = list(sources.by_set(list(files)))
    out.append(f"held-out            {mix}: {len(labels)} sets, {cadence}: {', '.join(labels)}"
               + (f"; {len(files):,} files, {sum(sized.get(f.path, 0) for f in files):,} tokens"
                  if sized else ""))
  if plan is not None and plan.alarm_off:
    out.append(f"held-out            none: {plan.alarm_off}")
  elif plan is None and ev.heldout is None:
    out.append("held-out            the training data's held-out split, once the data is found")
  elif plan is None and not ev.heldout:
    out.append("held-out            none (eval.heldout=()): the generalization-gap alarm is off")
  out.append(f"downstream tasks    {len(ev.tasks)}, {cadence}"
             + (f" ({ev.task_limit} documents each)" if ev.task_limit and ev.tasks else "")
             + (": " + ", ".join(ev.tasks) if ev.tasks else ""))
  if ev.ruler.enabled:
    out.append(f"RULER               {len(ev.ruler.tasks)} tasks x {ev.ruler.samples} instances at "
               f"{', '.join(map(str, ev.ruler.lengths))} tokens, {cadence}"
               + (" and on the starting checkpoint" if exp.checkpoint.init_from else "")
               + "; the long-context alarm")
  return out
