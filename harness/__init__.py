"""What tests/ and benchmarks/ both run, imported by both (olmo3/ never imports it; nothing here
imports tests/ or benchmarks/).

- OLMo-core's own code beside ours on the same inputs: its TransformerTrainModule stepped as
  its Trainer steps it (`train_parity_olmo_core`), stage 3's packed documents and YaRN
  (`stage3_parity_olmo_core`), its Trainer continued and restarted (`continue_olmo_core`,
  `restart_olmo_core`), its held-out evaluator (`heldout_ce_olmo_core`); and
  `flash_attn_standin/`, a CPU flash-attn 2 that lets its document attention run here.
- The 7B's prices: evaluation (`eval_price_7b`) and a restart (`restart_7b`).
- `storage_servers`: real object stores on 127.0.0.1.
- `launch_race`: two launchers racing for one workdir on a local disk, S3 and GCS.

benchmarks/ runs them at full length and records the results (each its command there:
`python benchmarks/<name>.py`); tests/ runs them shortened and asserts, in process (the
two longest OLMo-core comparisons as their benchmark commands, in the slow tier).
"""
