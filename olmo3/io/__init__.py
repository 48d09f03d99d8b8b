"""The lowest layer: bytes in and out, knowing nothing of models or configs. `storage` (files,
local, gs://, s3://, http(s)://) on `pathnames` (their spelling), `clients` (the stores' clients
and their patches), `retry` (the one retry loop), `settings` (OLMO3_STORAGE_*) and `errors`;
`file_sizes` (the sizes a run recorded), `conditional` (conditional writes), `orbax_s3` (the one
Orbax workaround), `checkpoint` (verified checkpoints: items, checksums, damage), `metrics`
(metric writers and metrics.jsonl)."""
