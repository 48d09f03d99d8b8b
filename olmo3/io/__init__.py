"""The lowest layer: bytes in and out, knowing nothing of models or configs. `storage` (local
paths, gs://, s3://, http(s)://), `orbax_s3` (the one Orbax workaround), `checkpoint` (verified
checkpoints: items, checksums, damage), `metrics` (metric writers and metrics.jsonl)."""
