"""Ahead-of-time compilation of the real train step: for the local devices, or for a TPU
topology from a CPU machine (`kind:AxBxC`, needs the `tpu` extra's libtpu). Reports per-device
memory, whether it fits the chip's HBM, compiled vs analytic FLOPs and the compile time; the
experiment's LIBTPU_INIT_ARGS are parsed by the compiler, so a bad flag fails here.
`compile_eval_batch` does the same for the evaluator's programs at one batch shape
(benchmarks/eval_price_7b.py prices the 7B's evaluation with it)."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from olmo3 import flops as flops_lib
from olmo3.config import AttentionKernel, Experiment
from olmo3.data.pipeline import batch_only
from olmo3.eval.evaluator import scoring_functions
from olmo3.placement import ShardedModel
from olmo3.train.state import StateLayout
from olmo3.train.step import abstract_inputs, jit_train_step


def topology_devices(topology: str) -> list:
  """Abstract devices of a TPU topology, e.g. tpu7x:4x8x8, v5p:8x8x8, v6e:16x16; `*N` for N
  slices joined over DCN (multi-slice), e.g. 'v5p:8x8x8*4'."""
  from jax.experimental import topologies

  # Compile-only holds no TPU; without this, libtpu refuses to load beside another process's.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # Nor is it on a TPU VM: libtpu's queries to the VM's metadata server would wait about 4 s
  # for an answer that never comes.
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  name, _, slices = topology.partition("*")
  try:
    num_slices = int(slices) if slices else 1
    return list(topologies.get_topology_desc(platform="tpu", topology_name=name,
                                             num_slices=num_slices).devices)
  except Exception as e:  # libtpu missing, or a name it does not know
    raise ValueError(f"--compile_only={topology}: no TPU topology of that name ({e}); install "
                     "the tpu extra (pip install -e '.[tpu]') and use kind:AxBxC or "
                     "kind:AxBxC*SLICES") from None


class DoesNotFit(RuntimeError):
  """The step needs more device memory than the target has (the compiler's own verdict)."""


@dataclasses.dataclass(frozen=True)
class CompileReport:
  target: str
  devices: int
  device_kind: str
  mesh: dict
  argument_gb: float
  temp_gb: float
  output_gb: float
  alias_gb: float
  total_gb: float  # arguments + temporaries + outputs - donated (aliased) buffers, per device
  hbm_gb: float | None
  fits: bool | None
  compiled_tflops_per_step: float | None
  analytic_tflops_per_step: float
  compile_s: float
  flops_caveat: str = ""  # why the compiled count understates the step, when it does
  # Per device per step, by collective kind (`collective_bytes`); and whether every loop's
  # trip count was known (else a loop's collectives are counted once).
  collective_gb: dict[str, float] = dataclasses.field(default_factory=dict)
  collective_trips_known: bool = True
  collective_mb_per_token: float = 0.0  # all kinds, per device, per token the device holds
  memory_traffic_gb: float = 0.0  # per device per step (`memory_traffic_bytes`)
  bound: StepBound | None = None  # None where the target's peaks are unknown (CPUs)

  def format(self) -> str:
    fit = ("unknown HBM" if self.fits is None else
           f"{'FITS' if self.fits else 'DOES NOT FIT'} in {self.hbm_gb:.0f} GB")
    compiled = ("n/a" if self.compiled_tflops_per_step is None
                else f"{self.compiled_tflops_per_step:,.4g}")
    return "\n".join([
        f"compiled train step for {self.target}: {self.devices} x {self.device_kind}, "
        f"mesh {self.mesh}, in {self.compile_s:.1f} s",
        f"per-device memory: arguments {self.argument_gb:.2f} GB + temporaries "
        f"{self.temp_gb:.2f} GB + outputs {self.output_gb:.2f} GB - donated "
        f"{self.alias_gb:.2f} GB = {self.total_gb:.2f} GB -> {fit}",
        f"TFLOP per step: compiled {compiled} vs analytic {self.analytic_tflops_per_step:,.4g} "
        "(exact causal + sliding-window count; XLA counts masked attention in full)"
        + (f"; {self.flops_caveat}" if self.flops_caveat else ""),
        "collectives per device per step: " + ", ".join(
            f"{kind} {gb:,.2f} GB" for kind, gb in self.collective_gb.items())
        + f"; {self.collective_mb_per_token:.2f} MB per token a device holds"
        + " (result sizes; loops counted per trip"
        + ("" if self.collective_trips_known else "; a loop of unknown trip count counted once")
        + ")",
        f"memory traffic per device per step: {self.memory_traffic_gb:,.1f} GB (each "
        "instruction's operands and result, outside fusions; an estimate)",
        self.bound.format() if self.bound else
        f"step-time bound: no published peaks for {self.device_kind}"])


def _compile(lowered: Any, topology: str | None) -> Any:
  try:
    return lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise DoesNotFit(f"{topology or 'local devices'}: the compiler ran out of device memory: "
                     f"{str(e).splitlines()[0]}") from None


def _memory_gb(compiled: Any) -> tuple[float, float, float, float]:
  """Per-device (arguments, temporaries, outputs, donated) in GB, as the compiler reports."""
  mem = compiled.memory_analysis()
  gb = lambda name: getattr(mem, name, 0) / 1e9 if mem is not None else 0.0
  return (gb("argument_size_in_bytes"), gb("temp_size_in_bytes"),
          gb("output_size_in_bytes"), gb("alias_size_in_bytes"))


def _compiled_flops(compiled: Any) -> float | None:
  """XLA's FLOPs per device (a scanned layer group counted once, Pallas kernels as zero)."""
  cost: Any = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return (cost or {}).get("flops")


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
          "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "s4": 1, "u4": 1}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*(.*?)\s([a-z][\w\-]*)\(")
_CALLEES = re.compile(r"(?:body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
                      r"|branch_computations=\{([^}]*)\}")


def _callees(line: str) -> list[str]:
  """The computations an instruction calls (a loop's body, a call's or reduction's
  computation, a fusion's, a conditional's branches)."""
  return [c for callee, branches in _CALLEES.findall(line)
          for c in ([callee] if callee else re.findall(r"%?([\w.\-]+)", branches))]


def _operands(line: str, op: re.Match) -> list[str]:
  """The names an instruction's operand list (after its opcode, `op`) refers to."""
  return re.findall(r"%([\w.\-]+)", line[op.end():].split(")", 1)[0])


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO result type: an array type, or every array of a tuple type."""
  return sum(_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
             for dtype, dims in re.findall(r"\b([a-z]\w*)\[([\d,]*)\]", shape))


def _trip_count(while_line: str, bodies: dict[str, list[str]]) -> int | None:
  """A while loop's iterations: XLA's `known_trip_count` (XLA:CPU writes it), else, as a JAX
  loop's condition reads (the TPU compiler's text), `i < N` with i from 0: N."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_line)
  if known:
    return int(known.group(1))
  condition = re.search(r"condition=%?([\w.\-]+)", while_line)
  body = bodies.get(condition.group(1), []) if condition else []
  limits = [int(c) for line in body for c in re.findall(r"= s32\[\]\S* constant\((\d+)\)", line)]
  compares_less = any("ROOT" in line and "compare(" in line and "direction=LT" in line
                      for line in body)
  return limits[0] if compares_less and len(limits) == 1 else None


def _computations(hlo_text: str) -> tuple[str | None, dict[str, list[str]]]:
  """The entry computation's name and every computation's instruction lines."""
  bodies: dict[str, list[str]] = {}
  entry, name = None, None
  for line in hlo_text.splitlines():
    found = _COMPUTATION.match(line) if not line.startswith(" ") else None
    if found:
      name = found.group(1)
      bodies[name] = []
      entry = name if line.startswith("ENTRY") else entry
    elif name is not None and line.startswith(" "):
      bodies[name].append(line)
  return entry, bodies


def collective_bytes(hlo_text: str) -> tuple[dict[str, float], bool]:
  """Bytes each device moves through each kind of collective in one run of a compiled,
  SPMD-partitioned program (`compiled.as_text()`: per-device shapes), and whether every loop's
  trip count was known. A collective counts its result's size (an all-gather the gathered
  array, a reduce-scatter its scattered shard, an all-reduce its operand); an asynchronous one
  is counted at its `-done`. Ops inside a `while` body count once per iteration
  (`_trip_count`; a loop whose count cannot be read counts once, and the second value says so). JAX has no API for this: the optimized
  HLO text is what the compiler will run."""
  entry, bodies = _computations(hlo_text)
  known = True

  @functools.lru_cache(maxsize=None)
  def total(computation: str) -> tuple[tuple[str, float], ...]:
    nonlocal known
    sums = dict.fromkeys(COLLECTIVES, 0.0)
    for line in bodies.get(computation, ()):
      op = _OP.search(line)
      if op is None:
        continue
      kind = op.group(2).removesuffix("-done")
      if kind in sums and not op.group(2).endswith("-start"):
        sums[kind] += _shape_bytes(op.group(1))
      times = 1
      if op.group(2) == "while":
        trips = _trip_count(line, bodies)
        known = known and trips is not None
        times = trips or 1
      for c in _callees(line):
        for k, v in total(c):
          sums[k] += times * v
    return tuple(sums.items())

  return dict(total(entry)) if entry else dict.fromkeys(COLLECTIVES, 0.0), known


# Instructions that move no memory of their own (views, tuples, constants, control), and the
# collectives (counted as interconnect traffic by `collective_bytes`).
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
               "partition-id", "replica-id", "iota", "opt-barrier", "optimization-barrier",
               "add-dependency", "copy-start", "copy-done", "while", "conditional", "call",
               "call-start", "call-done", "async-start", "async-update", "async-done"}
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")


def _fusion_io(computation: str, bodies: dict[str, list[str]]
               ) -> tuple[dict[int, int | None], int | None]:
  """What a fused computation reads of each parameter and writes: a parameter used only as
  the sliced operand of (dynamic-)slices reads those slices, one used only as the buffer a
  dynamic-update-slice writes into reads nothing (updated in place), through nested fusions
  too (the TPU compiler nests them); None: the whole of it. A root that is a
  dynamic-update-slice (or a tuple of them) writes its updates only."""
  sizes: dict[str, int] = {}
  params: dict[str, int] = {}
  alias: dict[str, str] = {}  # the same bytes under another name
  uses: dict[str, list[int | None]] = {}  # bytes each use reads (None: all of it)
  defs: dict[str, tuple[str, list[str]]] = {}
  root = None
  for line in bodies.get(computation, []):
    name, op = _NAME.match(line), _OP.search(line)
    if name is None or op is None:
      continue
    name, opcode = name.group(1), op.group(2)
    sizes[name] = _shape_bytes(op.group(1))
    args = [alias.get(a, a) for a in _operands(line, op)]
    defs[name] = (opcode, args)
    nested = re.search(r"calls=%?([\w.\-]+)", line) if opcode == "fusion" else None
    nested_read = _fusion_io(nested.group(1), bodies)[0] if nested else {}
    if opcode == "parameter":
      params[name] = int(re.search(r"parameter\((\d+)\)", line).group(1))
    elif args and (opcode == "bitcast" or "output_to_operand_aliasing={{}: (0, {})}" in line):
      alias[name] = args[0]  # the operand's bytes, viewed or updated in place (TPU's nesting)
    else:
      for position, a in enumerate(args):
        if opcode in ("dynamic-slice", "slice") and position == 0:
          uses.setdefault(a, []).append(sizes[name])
        elif opcode == "dynamic-update-slice" and position == 0:
          uses.setdefault(a, []).append(0)
        else:
          uses.setdefault(a, []).append(nested_read.get(position))
    if line.lstrip().startswith("ROOT"):
      root = alias.get(name, name)
  read = {index: (None if not uses.get(name) or None in uses[name] else sum(uses[name]))
          for name, index in params.items()}

  def written(name: str) -> int | None:
    opcode, args = defs.get(name, ("", []))
    if opcode == "dynamic-update-slice":
      return sizes[args[1]]
    if opcode == "tuple":
      parts = [written(alias.get(a, a)) for a in args]
      return sum(p if p is not None else sizes[a] for p, a in zip(parts, args))
    return None

  return read, written(root) if root else None


def memory_traffic_bytes(hlo_text: str) -> float:
  """Bytes each device reads from and writes to its memory in one run of a compiled program,
  as the instructions outside fusions see them: each instruction's result plus its operands
  (a fusion's operands are what it reads from memory, a sliced operand only its slices, an
  operand updated in place only the update; what happens inside it stays on chip), loops once
  per iteration. An estimate, not a measurement: caches are not modelled, and a kernel that
  reads an operand twice counts it once."""
  entry, bodies = _computations(hlo_text)

  @functools.lru_cache(maxsize=None)
  def total(computation: str) -> float:
    sizes: dict[str, int] = {}
    moved = 0.0
    for line in bodies.get(computation, ()):
      name, op = _NAME.match(line), _OP.search(line)
      if name is None or op is None:
        continue
      result = _shape_bytes(op.group(1))
      sizes[name.group(1)] = result
      opcode = op.group(2)
      if opcode in ("while", "conditional", "call", "call-start", "async-start"):
        # A loop's body once per trip. (An asynchronous call, as the TPU compiler offloads
        # work to SparseCores, counts what its computation moves, once: its start's tuple
        # repeats the operands.)
        times = (_trip_count(line, bodies) or 1) if opcode == "while" else 1
        moved += times * sum(total(c) for c in _callees(line))
      if opcode in _NO_TRAFFIC or opcode.removesuffix("-start").removesuffix("-done") in \
          COLLECTIVES:
        continue
      operands = [sizes.get(a, 0) for a in _operands(line, op)]
      fused = re.search(r"calls=%?([\w.\-]+)", line) if opcode == "fusion" else None
      if fused:
        read, wrote = _fusion_io(fused.group(1), bodies)
        operands = [size if read.get(i) is None else min(size, read[i])
                    for i, size in enumerate(operands)]
        result = result if wrote is None else wrote
      moved += result + sum(operands)
    return moved

  return total(entry) if entry else 0.0


@dataclasses.dataclass(frozen=True)
class StepBound:
  """A lower bound on one step's time on a device from the compiled program and the device's
  published peaks (olmo3.flops.DevicePeaks), each term the time one resource alone needs: the
  step's FLOPs (the exact analytic count, per device) at peak FLOP/s, its memory traffic
  (`memory_traffic_bytes`) at peak HBM bandwidth, its collectives' bytes (`link_bytes` of
  `collective_bytes`) at the interconnect's bandwidth into the device. The step cannot be faster than the largest
  (the three overlapped perfectly); MFU cannot exceed compute_s / bound_s. A bound, not a
  prediction: latencies, imperfect overlap and kernels below peak all add to it."""

  compute_s: float
  memory_s: float
  collective_s: float

  @property
  def bound_s(self) -> float:
    return max(self.compute_s, self.memory_s, self.collective_s)

  @property
  def mfu_ceiling(self) -> float:
    return self.compute_s / self.bound_s

  @property
  def serial_s(self) -> float:
    """The three one after another, none overlapped: not a bound, a yardstick (a step that
    overlaps nothing and runs every kernel at peak)."""
    return self.compute_s + self.memory_s + self.collective_s

  @property
  def limit(self) -> str:
    return max((("compute", self.compute_s), ("memory", self.memory_s),
                ("collectives", self.collective_s)), key=lambda kv: kv[1])[0]

  def format(self) -> str:
    return (f"step time >= {self.bound_s:.3f} s (a lower bound; {self.limit} limits it: compute "
            f"{self.compute_s:.3f} s, memory {self.memory_s:.3f} s, collectives "
            f"{self.collective_s:.3f} s at the device's published peaks) -> MFU <= "
            f"{self.mfu_ceiling:.1%}; with nothing overlapped {self.serial_s:.3f} s, MFU "
            f"{self.compute_s / self.serial_s:.1%}")


def link_bytes(moved: dict[str, float]) -> float:
  """What a device's links carry for `collective_bytes`' result sizes: an all-reduce twice its
  result (a reduce-scatter, then an all-gather of the reduced shards), every other kind its
  result (an all-gather brings in (n - 1) / n of what it returns; a reduce-scatter, counted at
  its shard, sends more: an underestimate, as a bound may be)."""
  return sum(v * (2 if kind == "all-reduce" else 1) for kind, v in moved.items())


def step_bound(analytic_flops_per_device: float, memory_bytes: float, link_total: float,
               peaks: flops_lib.DevicePeaks) -> StepBound:
  return StepBound(compute_s=analytic_flops_per_device / peaks.flops,
                   memory_s=memory_bytes / peaks.hbm_bandwidth,
                   collective_s=link_total / peaks.link_bandwidth)


def compile_train_step(exp: Experiment, topology: str | None = None) -> CompileReport:
  devices = topology_devices(topology) if topology else None
  model = ShardedModel.for_experiment(exp, devices)
  layout = StateLayout(exp, model)
  start = time.perf_counter()
  with model.context():
    lowered = jit_train_step(exp, model, layout).lower(*abstract_inputs(exp, model, layout))
  compiled = _compile(lowered, topology)
  seconds = time.perf_counter() - start
  args, temps, outs, alias = _memory_gb(compiled)
  total = args + temps + outs - alias
  kind = model.mesh.devices.flat[0].device_kind
  hbm = flops_lib.hbm_bytes_per_device(kind)
  per_device = _compiled_flops(compiled)
  text = compiled.as_text()
  moved, known = collective_bytes(text)
  traffic = memory_traffic_bytes(text)
  n = model.mesh.devices.size
  analytic = exp.model.flops_per_token(exp.data.seq_len) * exp.tokens_per_step
  peaks = flops_lib.device_peaks(kind)
  bound = None if peaks is None else step_bound(analytic / n, traffic, link_bytes(moved), peaks)
  caveats = []
  if exp.model.scan_layers and exp.model.n_layers >= exp.model.global_every:
    caveats.append("XLA's cost analysis counts the scanned layer group once, not once per "
                   "iteration")
  if exp.model.attention is AttentionKernel.SPLASH:
    caveats.append("Pallas attention kernels count as zero")
  return CompileReport(
      target=topology or f"local {jax.default_backend()}", devices=n, device_kind=kind,
      mesh=dict(model.mesh.shape), argument_gb=args, temp_gb=temps, output_gb=outs,
      alias_gb=alias, total_gb=total, hbm_gb=hbm / 1e9 if hbm else None,
      fits=None if hbm is None else total * 1e9 <= hbm,
      compiled_tflops_per_step=per_device * n / 1e12 if per_device else None,
      analytic_tflops_per_step=analytic / 1e12, compile_s=seconds, flops_caveat="; ".join(caveats),
      collective_gb={k: v / 1e9 for k, v in moved.items()}, collective_trips_known=known,
      collective_mb_per_token=sum(moved.values()) / (exp.tokens_per_step / n) / 1e6,
      memory_traffic_gb=traffic / 1e9, bound=bound)


@dataclasses.dataclass(frozen=True)
class EvalCompileReport:
  """One evaluation program (olmo3.eval.evaluator.scoring_functions) at one batch shape."""

  program: str  # row_logprob or choice_logprobs
  rows: int
  length: int
  devices: int
  total_gb: float  # arguments + temporaries + outputs per device
  temp_gb: float
  hbm_gb: float | None
  compiled_tflops: float | None  # XLA's count, whole batch (see _compiled_flops)
  compile_s: float


def compile_eval_batch(exp: Experiment, length: int, choices: int | None = None,
                       topology: str | None = None, model: ShardedModel | None = None
                       ) -> EvalCompileReport:
  """Compiles the evaluation program for one batch of eval.batch_size rows x `length` tokens:
  row log-probabilities, or with `choices` (K) the one-pass multiple-choice program."""
  model = model or ShardedModel.for_experiment(
      exp, topology_devices(topology) if topology else None)
  rows = exp.eval.batch_size
  vector = batch_only(model.batch_sharding)
  batch = {"input_ids": jax.ShapeDtypeStruct((rows, length), jnp.int32,
                                             sharding=model.batch_sharding)}
  if choices is None:
    batch["labels"] = batch["input_ids"]
  else:
    batch["position"] = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=vector)
    batch["choices"] = jax.ShapeDtypeStruct((rows, choices), jnp.int32, sharding=vector)
  row_logprob, choice_logprobs = scoring_functions(model)
  start = time.perf_counter()
  with model.context():
    lowered = (row_logprob if choices is None else choice_logprobs).lower(
        model.param_target, batch)
  compiled = _compile(lowered, topology)
  seconds = time.perf_counter() - start
  args, temps, outs, _ = _memory_gb(compiled)
  hbm = flops_lib.hbm_bytes_per_device(model.mesh.devices.flat[0].device_kind)
  per_device = _compiled_flops(compiled)
  moved, known = collective_bytes(compiled.as_text())
  n = model.mesh.devices.size
  return EvalCompileReport(
      program="row_logprob" if choices is None else "choice_logprobs", rows=rows,
      length=length, devices=n, total_gb=args + temps + outs, temp_gb=temps,
      hbm_gb=hbm / 1e9 if hbm else None,
      compiled_tflops=per_device * n / 1e12 if per_device else None, compile_s=seconds)
