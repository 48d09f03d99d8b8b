"""Bytes in and out, knowing nothing of models, configs or programs (only `olmo3.program`'s
settings readers and `olmo3.platforms` lie below). `storage` (files, local, gs://, s3://,
http(s)://; the one whole-file writer) on `pathnames` (their spelling), `clients` (the stores'
clients and their patches), `retry` (the one retry loop), `settings` (OLMO3_STORAGE_*) and
`errors` (StorageError and its kinds); `file_sizes` (the sizes a run recorded), `conditional`
(conditional writes), `orbax_s3` (the one Orbax workaround), `checkpoint` (verified
checkpoints: items, checksums, damage), `metrics` (metric writers and metrics.jsonl)."""
