"""python -m olmo3.convert {import-hf,import-olmo-core,export-hf,parity} ...

  import-hf --hf_dir DIR --out CKPT          HF OLMo 3 directory -> Orbax checkpoint (its
                                             tokenizer and chat template kept for export-hf)
  import-olmo-core --src SRC --out CKPT [--model PRESET]
                                             AI2's OLMo-core checkpoint (weights, Adam's state,
                                             trainer state) -> Orbax checkpoint; SRC: a step
                                             directory (local, gs://, s3://, https://), a save
                                             folder (its newest complete step) or a name --list
                                             shows (olmo3-7b/stage2/step10000); the model is
                                             the checkpoint's own (its config.json)
  import-olmo-core --list                    AI2's published OLMo-3-1025-7B checkpoints
  export-hf --ckpt CKPT --out DIR [--dtype] [--chat_template NAME|FILE]
                                             Orbax checkpoint -> directory transformers loads
                                             (CKPT: a step directory, or a run's workdir:
                                             its latest step; a run's tokenizer comes along,
                                             with the chat template its data was made with)
  merge --ckpt A --ckpt B [--weights 0.5,0.5] --out CKPT
                                             the weighted average of checkpoints' parameters
                                             (mergekit's linear merge; weights normalised)
  parity --hf_dir DIR --ckpt CKPT [--dtype float32|bfloat16] [--max_kl X] [--seq_len T]
                                             exits 1 when max per-token KL exceeds --max_kl
                                             or the installed transformers builds any
                                             layer's RoPE otherwise than ours (it names how)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from olmo3 import model as model_lib, program
from olmo3.config import PRESETS, ModelConfig
from olmo3.convert import hf, merge, olmo_core_config, parity, tokenizer_files
from olmo3.data.tokens import DataError
from olmo3.io import checkpoint, olmo_core_checkpoints


def _restore_host(ckpt: str):
  cfg = ModelConfig(**checkpoint.load_meta(ckpt)["model_config"])
  target = checkpoint.host_target(model_lib.param_shapes(cfg))
  return cfg, checkpoint.restore_params(ckpt, target)


def import_hf(args: argparse.Namespace) -> int:
  if os.path.exists(args.out):
    raise checkpoint.CheckpointError(f"{args.out} already exists; refusing to overwrite")
  # Stage the float32 arrays on disk beside the output: the 7B is 29 GB, more than many RAMs.
  parent = os.path.dirname(os.path.abspath(args.out))
  os.makedirs(parent, exist_ok=True)
  kept = tokenizer_files.of_hf_dir(args.hf_dir)  # read first: a bad template stops it early
  with tempfile.TemporaryDirectory(prefix=".import-", dir=parent) as staging:
    cfg, params, dtype = hf.read_hf_dir(args.hf_dir, alloc=hf.memmap_allocator(staging))
    checkpoint.save_model(args.out, cfg, params,
                          meta={"source": str(args.hf_dir), "hf_dtype": dtype, **kept.meta()})
  print(f"imported {args.hf_dir} ({dtype}, {cfg.param_count:,} parameters with the vocabulary "
        f"padded to {cfg.padded_vocab_size}) -> {args.out}")
  print(_kept_line(kept))
  return 0


def _kept_line(kept: tokenizer_files.Carried) -> str:
  """What travels with the weights, in one line."""
  template = "no chat template" if kept.template is None else (
      f"chat template {kept.template.name} (sha256 {kept.template.sha256[:12]})")
  tokenizer = "no tokenizer" if kept.tokenizer_json is None else "tokenizer"
  return f"kept: {tokenizer}, {template}"


def import_olmo_core(args: argparse.Namespace) -> int:
  if args.list:
    for official in olmo_core_checkpoints.official().values():
      print(f"{official.name:32} {official.tokens:>17,} tokens  {official.url}")
    return 0
  if not args.src or not args.out:
    raise hf.ConversionError("import-olmo-core needs --src and --out (or --list)")
  if os.path.exists(args.out):
    raise checkpoint.CheckpointError(f"{args.out} already exists; refusing to overwrite")
  from olmo3.convert import olmo_core_import  # pylint: disable=import-outside-toplevel

  located = olmo_core_import.located_or_refused(args.src)
  if located.folder is not None:
    print(located.picked())
  cfg, name, how = olmo_core_params(located, args.model, default_preset(args.src))
  print(f"model: {how}")
  meta = olmo_core_import.import_checkpoint(located.root, args.out, cfg, staging=args.staging)
  print(f"imported {meta['source']} ({name}: {cfg.param_count:,} parameters; "
        f"{olmo_core_import.describe(meta)}) -> {args.out}")
  return 0


def olmo_core_params(located: olmo_core_checkpoints.OlmoCoreCheckpoint, preset: str | None,
                    default: str) -> tuple[ModelConfig, str, str]:
  """The model config of the OLMo-core checkpoint `located`, its name (a preset's, or "its own
  model") and how it was found: the checkpoint's config.json (`preset`, when given, must agree
  with it), else `preset`, else `default`."""
  own, where = olmo_core_config.read(located), olmo_core_config.config_file(located)
  if own is None:
    chosen = preset or default
    return PRESETS[chosen](), chosen, f"{chosen} (no {where}" + (
        ")" if preset else "; --model names another)")
  if preset is not None:
    differ = olmo_core_config.differences(PRESETS[preset](), own)
    if differ:
      raise hf.ConversionError(f"--model {preset} differs from {where}: {'; '.join(differ)} "
                               "(leave --model out to take the checkpoint's own)")
    return PRESETS[preset](), preset, f"{preset} (as {where} says)"
  described = olmo_core_config.describe(own, PRESETS)
  name = described if described in PRESETS else "its own model"
  return own, name, f"{described} (from {where})"


def default_preset(src: str) -> str:
  """The model an OLMo-core checkpoint holds when neither --model nor its config.json says:
  AI2's stage-3 checkpoints hold the long-context model (YaRN), every other one OLMo 3 7B as
  stages 1-2."""
  # AI2's names and URLs alike: olmo3-7b/stage3/step11921, .../Olmo-3-1025-7B/stage3/step1000
  return "olmo3_7b_long_context" if "/stage3/" in f"/{src.rstrip('/')}/" else "olmo3_7b"


def export_hf(args: argparse.Namespace) -> int:
  ckpt = checkpoint.resolve_step_dir(args.ckpt)
  meta = checkpoint.load_meta(ckpt)
  kept = tokenizer_files.carried(ckpt, meta).with_template(args.chat_template)
  cfg, params = _restore_host(ckpt)
  dtype = args.dtype or meta.get("hf_dtype", "float32")
  files = tokenizer_files.hf_files(kept, cfg)
  hf.write_hf_dir(args.out, cfg, params, dtype=dtype, extra_files=files)
  print(f"exported {ckpt} -> {args.out} ({dtype}, vocabulary cut to {cfg.vocab_size})")
  differently = hf.hf_runs_differently(cfg)
  if differently:
    print(f"warning: {differently}", file=sys.stderr)
  if files:
    print(f"tokenizer: {kept.source} (tokenizer.json, tokenizer_config.json)")
  elif kept.source != os.fspath(ckpt):  # a hub name: AutoTokenizer loads it from there
    print(f"tokenizer: not copied; the run's is the hub's {kept.source!r}")
  if kept.template is not None:
    print(f"chat template: {kept.template.name} (sha256 {kept.template.sha256[:12]})" + (
        f" in tokenizer_config.json and {tokenizer_files.JINJA_FILE}" if files else
        ": not written, no tokenizer file to write it with"))
  return 0


def merge_checkpoints(args: argparse.Namespace) -> int:
  if len(args.ckpt) < 2:
    raise checkpoint.CheckpointError("merge needs two --ckpt or more")
  record = merge.merge(args.ckpt, merge.weights(args.weights, len(args.ckpt)), args.out)
  total = sum(m["weight"] for m in record["merged"])
  for m in record["merged"]:
    print(f"{m['weight'] / total:.6g} x {m['ckpt']}")
  print(f"merged {len(record['merged'])} checkpoints -> {args.out} (parameters only: a run "
        "initialised from it starts its optimizer moments fresh)")
  return 0


def check_parity(args: argparse.Namespace) -> int:
  cfg, params = _restore_host(checkpoint.resolve_step_dir(args.ckpt))
  ref_cfg = hf.read_hf_config(args.hf_dir)
  shape_fields = ("vocab_size", "padded_vocab_size", "d_model", "n_layers", "n_heads",
                  "n_kv_heads", "mlp_hidden", "sliding_window", "global_every", "rope_theta",
                  "rope_scaling", "norm_eps")
  diff = [f for f in shape_fields if getattr(cfg, f) != getattr(ref_cfg, f)]
  if diff:
    print("checkpoint and HF config differ in " + ", ".join(
        f"{f} ({getattr(cfg, f)} vs {getattr(ref_cfg, f)})" for f in diff), file=sys.stderr)
    return 2
  report = parity.check(cfg, params, args.hf_dir, dtype=args.dtype, ref_dtype=args.ref_dtype,
                        batch=args.batch, seq_len=args.seq_len, seed=args.seed)
  print(report.format())
  if args.json:
    print(report.to_json())
  close = report.max_kl <= args.max_kl
  # A RoPE read otherwise is another model whatever the KL: it fails under any --max_kl.
  ok = close and not report.rope_differences
  print(f"{'PASS' if ok else 'FAIL'}: max KL {report.max_kl:.3e} "
        f"{'<=' if close else '>'} {args.max_kl:.1e}" + (
            "" if not report.rope_differences else
            f"; transformers {report.transformers} reads this config's RoPE otherwise "
            "(above)"))
  return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
  parser = program.parser("python -m olmo3.convert", __doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("import-hf", help="HF OLMo 3 directory -> Orbax checkpoint")
  p.add_argument("--hf_dir", required=True)
  p.add_argument("--out", required=True)
  p.set_defaults(run=import_hf)
  p = sub.add_parser("import-olmo-core",
                     help="AI2's OLMo-core checkpoint -> Orbax checkpoint (weights, optimizer "
                          "and trainer state)")
  p.add_argument("--src", help="a step directory (local, gs://, s3://, https://), an "
                               "OLMo-core save folder (its newest complete step) or a name "
                               "--list shows")
  p.add_argument("--out")
  p.add_argument("--model", choices=sorted(PRESETS),
                 help="the model config the checkpoint holds (a preset of olmo3.config). "
                      "Default: the checkpoint's own config.json (OLMo-core's trainer writes "
                      "one into each step); without one, olmo3_7b_long_context for AI2's "
                      "stage-3 checkpoints, else olmo3_7b. Given with a config.json, it must "
                      "agree with it")
  p.add_argument("--staging", help="where the float32 arrays are staged before they are "
                                   "written (default: beside a local --out, else the temporary "
                                   "directory); about 3x the model's float32 size")
  p.add_argument("--list", action="store_true", help="list AI2's published checkpoints")
  p.set_defaults(run=import_olmo_core)
  p = sub.add_parser("export-hf", help="Orbax checkpoint -> HF directory")
  p.add_argument("--ckpt", required=True,
                 help="a checkpoint step directory, or a run's workdir (its latest step)")
  p.add_argument("--out", required=True)
  p.add_argument("--dtype", choices=sorted(hf.DTYPES),
                 help="tensor dtype (default: the dtype the checkpoint was imported from)")
  p.add_argument("--chat_template",
                 help="the chat template to write (a template olmo3 ships, 'tokenizer': the "
                      "tokenizer's own, or a .jinja file); default: the one the run's data was "
                      "prepared with, or the one an imported or merged checkpoint kept")
  p.set_defaults(run=export_hf)
  p = sub.add_parser("merge", help="weighted average of checkpoints' parameters")
  p.add_argument("--ckpt", action="append", required=True,
                 help="a checkpoint step directory or a run's workdir (its latest step); "
                      "repeated, two or more")
  p.add_argument("--weights", help="comma-separated, one per --ckpt (default: equal); "
                                   "normalised to sum to 1, as mergekit's linear merge")
  p.add_argument("--out", required=True)
  p.set_defaults(run=merge_checkpoints)
  p = sub.add_parser("parity", help="compare logits with transformers' Olmo3ForCausalLM")
  p.add_argument("--hf_dir", required=True)
  p.add_argument("--ckpt", required=True)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="our compute dtype")
  p.add_argument("--ref_dtype", default="float32", choices=["float32", "bfloat16"],
                 help="the reference's dtype")
  p.add_argument("--max_kl", type=float, default=1e-6)
  p.add_argument("--seq_len", type=int, default=None,
                 help="tokens per sequence (default: 3.5 sliding windows + 1)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", action="store_true", help="also print the report as one JSON line")
  p.set_defaults(run=check_parity)
  args = parser.parse_args(argv)
  try:
    return args.run(args)
  except (hf.ConversionError, checkpoint.CheckpointError, DataError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(program.reported(main, lambda: ())())  # Ctrl-C and settings: one line
