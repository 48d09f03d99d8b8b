"""olmo3.io.storage and everything a run keeps in object storage, against real servers started
here: an HTTP server with Range support and injected latency / failures (AI2 serves its token
files over HTTP), fake-gcs-server for gs:// and moto's S3 server for s3://."""

import asyncio
import dataclasses
import gc
import json
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from olmo3.data.serve import RangeServer
from olmo3.io import checkpoint, clients, conditional, errors, file_sizes, orbax_s3, pathnames
from olmo3.io import retry, settings, storage
from olmo3.io import metrics as metrics_lib
from olmo3.data.heldout import HeldoutDocs
from olmo3.data.tokens import DataError, TokenFiles, write_token_file
from harness import storage_servers
from tests.test_reliability import MAIN, ROOT, TINY, _env, straight  # noqa: F401  (a fixture)

VOCAB = 1000


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch):
  monkeypatch.setattr(retry, "_FIRST_BACKOFF_S", 0.001)
  monkeypatch.setenv(settings.RETRY_ENV, "0.5")  # an outage outlasts the budget in half a second


@pytest.fixture
def token_dir(tmp_path):
  rng = np.random.default_rng(0)
  for i, n in enumerate((5000, 5100, 70)):  # the last holds no whole instance of 128
    write_token_file(tmp_path / f"{i}.npy", rng.integers(0, VOCAB, n, dtype=np.uint32))
  return tmp_path


def test_http_token_files_read_the_local_bytes_by_range_concurrently_with_sizes_recorded(
    token_dir, tmp_path):
  local = TokenFiles([token_dir / f"{i}.npy" for i in range(3)], 128, VOCAB)
  instances = np.random.default_rng(1).permutation(len(local))
  cache = tmp_path / "sizes.json"
  with storage_servers.InstrumentedRangeServer(os.fspath(token_dir), latency_s=0.02) as server:
    urls = [f"{server.url}/{i}.npy" for i in range(3)]
    sizes = file_sizes.SizeCache(cache)
    remote = TokenFiles(urls, 128, VOCAB, size_cache=sizes)
    assert not cache.exists()  # looked up, not yet saved (a launcher's checks write nothing)
    sizes.save()
    assert remote.file_tokens.tolist() == local.file_tokens.tolist()
    assert json.loads(cache.read_text()) == {u: [int(n) * 4, None] for u, n in
                                             zip(urls, local.file_tokens)}
    looked_up = server.get_requests()
    assert looked_up == 3  # a size is a GET of the file's first byte (which proves Range works)
    server.max_in_flight = 0  # the size lookups above do not count
    np.testing.assert_array_equal(remote.read(instances), local.read(instances))
    # One ranged GET per instance, in flight together (the 20 ms each keeps them overlapping),
    # never more at once than the per-host bound.
    assert server.get_requests() == looked_up + len(instances)
    assert 1 < server.max_in_flight <= settings.concurrency(), server.max_in_flight
    again = TokenFiles(urls, 128, VOCAB, size_cache=file_sizes.SizeCache(cache))  # a resumed run
    # ... checks the sizes again, all at once, against the record.
    assert server.get_requests() == 2 * looked_up + len(instances)
    assert again.file_tokens.tolist() == local.file_tokens.tolist()


@pytest.mark.seconds(3, waits=True)
def test_transient_errors_are_retried_and_lasting_ones_are_named(token_dir):
  local = TokenFiles([token_dir / "0.npy"], 128, VOCAB)
  # 503, 503, 503, then fine
  with storage_servers.InstrumentedRangeServer(os.fspath(token_dir), fail_first=3) as server:
    remote = TokenFiles([f"{server.url}/0.npy"], 128, VOCAB)
    np.testing.assert_array_equal(remote.read([0, 5, 9]), local.read([0, 5, 9]))
  # A flaky host (HTTP 500 for a random fifth of all requests): retried all the same.
  with storage_servers.InstrumentedRangeServer(os.fspath(token_dir), error_rate=0.2,
                                               seed=3) as server:
    remote = TokenFiles([f"{server.url}/0.npy"], 128, VOCAB)
    np.testing.assert_array_equal(remote.read(list(range(10))), local.read(list(range(10))))
    assert server.errors_injected > 0
  with storage_servers.InstrumentedRangeServer(os.fspath(token_dir), fail_first=100) as server:
    with pytest.raises(errors.StorageError, match=rf"{server.url}/0.npy failed: .*503.*after "
                       rf"\d+ attempts in \d+ s"):
      TokenFiles([f"{server.url}/0.npy"], 128, VOCAB)
  with RangeServer(os.fspath(token_dir)) as server:
    with pytest.raises(DataError, match=rf"token file {server.url}/nope.npy does not exist"):
      TokenFiles([f"{server.url}/0.npy", f"{server.url}/nope.npy"], 128, VOCAB)
  with storage_servers.InstrumentedRangeServer(os.fspath(token_dir), honour_range=False) as server:
    url = f"{server.url}/0.npy"
    with pytest.raises(errors.StorageError, match=f"{url}: the server does not support HTTP "
                       "Range requests"):  # at the first look at the file
      TokenFiles([url], 128, VOCAB)
    # A size recorded by an earlier launch (the server replaced since): refused all the same.
    cache = token_dir / "sizes.json"
    cache.write_text(json.dumps({url: [os.path.getsize(token_dir / "0.npy"), None]}))
    with pytest.raises(errors.StorageError, match="support HTTP Range"):
      TokenFiles([url], 128, VOCAB, size_cache=file_sizes.SizeCache(cache))
  with pytest.raises(DataError, match="unsupported scheme ftp://"):
    TokenFiles(["ftp://host/0.npy"], 128, VOCAB)


def test_remote_data_that_changed_is_named_with_its_record(token_dir, tmp_path):
  """A token file changed on its server is a DataError naming the file: at a resumed launch,
  when its size differs from the run's record (data.allow_changed_data accepts and records
  the new one); mid-run, when a read comes back short or starts past the new end."""
  cache = tmp_path / "sizes.json"
  with RangeServer(os.fspath(token_dir)) as server:
    url = f"{server.url}/1.npy"
    sizes = file_sizes.SizeCache(cache)
    files = TokenFiles([url], 128, VOCAB, size_cache=sizes)
    sizes.save()
    assert len(files) == 39  # 5100 tokens
    tokens = np.fromfile(token_dir / "1.npy", np.uint32)
    tokens[:4000].tofile(token_dir / "1.npy")  # cut short: 31 whole instances now
    with pytest.raises(DataError, match=(
        rf"token file {url}: bytes \[16,384, 16,896\) start past the file's end .* it changed "
        r"after this launch counted its tokens. Restore the file; or continue deliberately")):
      files.read([32])
    with pytest.raises(DataError, match=(
        rf"token file {url}: asked for bytes \[15,872, 16,384\), got 128: the file is shorter")):
      files.read([31])  # its last 32 tokens are gone
    with pytest.raises(DataError, match=(
        rf"token file {url} changed since this run recorded it in {cache}: 20,400 bytes then, "
        r"16,000 bytes now. Restore the file; or continue deliberately on the data as it is now "
        r"with data.allow_changed_data=True")):
      TokenFiles([url], 128, VOCAB, size_cache=file_sizes.SizeCache(cache))  # the next launch
    accepting = file_sizes.SizeCache(cache, accept_changes=True)
    assert len(TokenFiles([url], 128, VOCAB, size_cache=accepting)) == 31
    accepting.save()
    assert json.loads(cache.read_text()) == {url: [16000, None]}


def test_an_object_replaced_with_one_of_the_same_size_is_named_by_its_version(s3_env, tmp_path):
  url = "s3://olmo3-changed/0.npy"
  storage_servers.make_bucket(url)
  write_token_file(url, np.arange(512, dtype=np.uint32))
  cache = tmp_path / "sizes.json"
  sizes = file_sizes.SizeCache(cache)
  TokenFiles([url], 128, VOCAB, size_cache=sizes)
  sizes.save()
  write_token_file(url, np.arange(512, dtype=np.uint32)[::-1])  # same size, other tokens
  with pytest.raises(DataError, match=rf"token file {url} changed since this run recorded it "
                     r"in .*: 2,048 bytes \(version .*\) then, 2,048 bytes \(version .*\) now"):
    TokenFiles([url], 128, VOCAB, size_cache=file_sizes.SizeCache(cache))


def test_held_out_documents_over_http_equal_local(tmp_path):
  docs = np.concatenate([np.arange(1, 40), [0], np.arange(5, 300), [0]]).astype(np.uint32)
  write_token_file(tmp_path / "h.npy", docs)
  local = HeldoutDocs([tmp_path / "h.npy"], 64, eos_id=0, pad_id=1)
  with storage_servers.InstrumentedRangeServer(os.fspath(tmp_path), latency_s=0.01) as server:
    remote = HeldoutDocs([f"{server.url}/h.npy"], 64, eos_id=0, pad_id=1)
  assert len(remote) == len(local) == 2
  a, b = (docs.rows(range(len(docs)), docs.seq_len, len(docs)) for docs in (remote, local))
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])


def test_the_loader_reads_a_mix_under_an_http_root_as_it_reads_it_from_disk(tmp_path):
  """An OLMo-layout mix (relative paths, `{TOKENIZER}`) under an HTTP root with 20 ms per
  request: the trainer's loader yields the same steps as from a local root, with one ranged
  request per instance of this process's rows."""
  from olmo3.config import DataConfig
  from olmo3.data import pipeline
  from tests.data_helpers import batch_sharding

  root = tmp_path / "root"
  rng = np.random.default_rng(2)
  lines = []
  for i, n in enumerate((3000, 2500, 4100)):
    rel = f"preprocessed/src{i % 2}/dolma2-tokenizer/part-{i}.npy"
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    write_token_file(root / rel, rng.integers(0, VOCAB, n, dtype=np.uint32))
    lines.append(f"src{i % 2},{rel.replace('dolma2-tokenizer', '{TOKENIZER}')}")
  mix = tmp_path / "mix.txt"
  mix.write_text("\n".join(lines) + "\n")
  cfg = DataConfig(mix=os.fspath(mix), root=os.fspath(root), tokenizer_id="dolma2-tokenizer",
                   seq_len=64, max_target_seq_len=None, global_batch_size=8, seed=7,
                   validate_tokens=False)

  def steps(cfg):
    loader = pipeline.Loader(cfg, batch_sharding(4), start_step=2, num_steps=4,
                             vocab_size=VOCAB)
    return list(loader.host_batches())

  local = steps(cfg)
  with storage_servers.InstrumentedRangeServer(os.fspath(root), latency_s=0.02) as server:
    remote = steps(dataclasses.replace(cfg, root=server.url))
    # The 3 files' sizes, then one ranged request per instance.
    assert server.get_requests() == 3 + sum(len(b["instance"]) for b in local)
  assert len(remote) == len(local) == 4
  for a, b in zip(remote, local):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_a_tokenizer_file_in_a_bucket_or_behind_http_is_copied_to_the_cache(tmp_path,
                                                                           monkeypatch):
  from olmo3.data import sources

  monkeypatch.setenv("OLMO3_CACHE", os.fspath(tmp_path / "cache"))
  (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
  with RangeServer(os.fspath(tmp_path)) as server:
    local = sources.tokenizer_file(f"{server.url}/tokenizer.json")
    with pytest.raises(DataError, match="tokenizer file .*/nope.json does not exist"):
      sources.tokenizer_file(f"{server.url}/nope.json")
  assert local.startswith(os.fspath(tmp_path / "cache"))
  assert open(local).read() == '{"version": "1.0"}'


def test_join_keeps_urls():
  assert pathnames.join("http://h/root", "a/b.npy") == "http://h/root/a/b.npy"
  assert pathnames.join("gs://b/", "/x", "y") == "gs://b/x/y"
  assert pathnames.join("/tmp", "a") == "/tmp/a"
  with pytest.raises(ValueError, match="read-only"):
    clients.check_supported("https://h/run", writable=True, what="workdir")


@pytest.mark.parametrize("durability", list(storage.Durability))
def test_a_whole_file_write_is_whole_uniquely_staged_and_synced_when_asked(
    tmp_path, monkeypatch, durability):
  """The one whole-file writer: the content whole, through a temporary of its own in the same
  directory (never a fixed name two writers would share), fsync of the file and its directory
  only when SYNCED; a failed write leaves the old file and no temporary."""
  path = tmp_path / "sub" / "f.json"
  renamed, synced = [], []
  real_replace, real_fsync = os.replace, os.fsync
  monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(a), real_replace(a, b))[1])
  monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
  for content in (b"old", b"new contents"):
    storage.write_bytes_atomic(path, content, durability=durability)
  assert path.read_bytes() == b"new contents" and os.listdir(path.parent) == ["f.json"]
  assert len(set(renamed)) == 2 and all(os.path.dirname(t) == str(path.parent) for t in renamed)
  assert not any(t.endswith(("f.json.tmp", ".tmp-" + str(os.getpid()))) for t in renamed)
  assert len(synced) == (4 if durability is storage.Durability.SYNCED else 0)  # file, dir: x2
  array = np.arange(6, dtype=np.uint32)
  storage.write_bytes_atomic(path, memoryview(array).cast("B"), durability=durability)
  assert np.array_equal(np.fromfile(path, np.uint32), array)  # a buffer, not copied to bytes

  def refused(a, b):
    raise PermissionError("the rename failed")

  monkeypatch.setattr(os, "replace", refused)
  with pytest.raises(PermissionError):
    storage.write_bytes_atomic(path, b"never", durability=durability)
  with pytest.raises(TypeError):  # failing while it writes
    storage.write_bytes_atomic(path, "not bytes", durability=durability)  # type: ignore[arg-type]
  assert np.array_equal(np.fromfile(path, np.uint32), array)
  assert os.listdir(path.parent) == ["f.json"]  # no temporary left behind

  def disk_full(a, b):  # as the kernel says it: an errno, no file named
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, "replace", disk_full)
  with pytest.raises(OSError) as full:
    storage.write_bytes_atomic(path, b"never", durability=durability)
  assert full.value.errno == errno.ENOSPC and str(full.value) == (
      f"[Errno {errno.ENOSPC}] writing {path}: No space left on device")
  assert os.listdir(path.parent) == ["f.json"]


# Session-scoped: a server restarted on a new port would leave fsspec's (and etils') cached
# filesystems pointing at the old one. Under xdist a worker interleaves modules, which would
# tear module-scoped servers down and up again.
@pytest.fixture(scope="session")
def s3_env():
  with storage_servers.s3_server() as env, storage_servers.environment(env):
    storage_servers.make_bucket("s3://olmo3-test")
    yield env


def test_a_file_another_process_removed_does_not_exist_for_this_one(s3_env):
  """A listing this process made earlier does not answer for files another process changed
  since (fsspec's default keeps listings for ever: `exists` said yes to a removed file, and
  reading it failed a 2-process save in the pod rehearsal)."""
  import fsspec

  clients.configure_clients()
  url = "s3://olmo3-test/listed/array_metadatas"
  for name in ("process_0", "process_1"):
    storage.write_bytes_atomic(f"{url}/{name}", b"{}", durability=storage.Durability.FLUSHED)
  here = clients.filesystem(url)
  assert len(here.ls(url)) == 2  # a listing of the directory
  elsewhere = fsspec.filesystem("s3", skip_instance_cache=True)  # another process's client
  elsewhere.rm(f"{url}/process_1")
  assert not here.exists(f"{url}/process_1")
  assert [p.rsplit("/", 1)[1] for p in here.ls(url)] == ["process_0"]
  assert clients.client_options()["gcs"]["use_listings_cache"] is False  # gs:// the same


@pytest.mark.seconds(3, waits=True)
def test_without_any_google_credentials_gcs_is_anonymous_at_once(tmp_path, monkeypatch):
  """Where no source of Google credentials can exist (no key file, no gcloud login, not a
  Google Cloud machine), gcsfs is asked for anonymous access, and never waits on the metadata
  server: left to itself it asks it (google-auth's backoff: about 15 s a process) and ends
  anonymous all the same. Any one source present leaves the choice to gcsfs."""
  import gcsfs
  from google.auth.compute_engine import _metadata

  asked = []

  def metadata_get(*args, **kwargs):
    asked.append(args[1:2])
    raise _metadata.exceptions.TransportError("no metadata server here")

  monkeypatch.setattr(_metadata, "get", metadata_get)
  monkeypatch.setattr(clients, "_DMI", os.fspath(tmp_path / "dmi"))
  monkeypatch.setenv("HOME", os.fspath(tmp_path))
  monkeypatch.setenv("CLOUDSDK_CONFIG", os.fspath(tmp_path / "gcloud"))
  for name in ("GOOGLE_APPLICATION_CREDENTIALS", "K_SERVICE", "CLOUD_RUN_JOB",
               "FUNCTION_TARGET", "GAE_APPLICATION"):
    monkeypatch.delenv(name, raising=False)
  assert not clients.google_credentials_possible()
  options = clients.client_options()["gcs"]
  assert options["token"] == "anon"
  fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **options)
  assert (fs.credentials.method, asked) == ("anon", [])
  # gcsfs left to choose: the metadata server asked first (the wait spared above)
  fs = gcsfs.GCSFileSystem(skip_instance_cache=True, token=None, requests_timeout=1)
  assert fs.credentials.method == "anon" and asked
  # a Google Cloud machine by its DMI vendor; a gcloud login; a key file
  (tmp_path / "dmi").mkdir()
  (tmp_path / "dmi" / "sys_vendor").write_text("Google\n")
  assert clients.google_credentials_possible() and "token" not in clients.client_options()["gcs"]
  (tmp_path / "dmi" / "sys_vendor").write_text("QEMU\n")
  assert not clients.google_credentials_possible()
  (tmp_path / "gcloud").mkdir()
  (tmp_path / "gcloud" / "application_default_credentials.json").write_text("{}")
  assert clients.google_credentials_possible()
  (tmp_path / "gcloud" / "application_default_credentials.json").unlink()
  monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", os.fspath(tmp_path / "key.json"))
  assert clients.google_credentials_possible()


@pytest.mark.seconds(15)
def test_orbax_checkpoints_on_s3_commit_by_file_and_restore(s3_env, tmp_path):
  """Orbax 0.12.8 cannot write s3:// (olmo3.io.orbax_s3 says why): a model checkpoint saved to
  the S3 server restores verified, and a step directory without its commit file is not listed
  (an object store names a step before it is complete)."""
  import jax
  import jax.numpy as jnp

  from olmo3.config import PRESETS

  params = {"w": jnp.arange(12.0).reshape(3, 4), "b": {"c": jnp.ones(3, jnp.bfloat16)}}
  url = "s3://olmo3-test/models/7"
  checkpoint.save_model(url, PRESETS["olmo3_tiny"](), params)
  assert storage.exists(pathnames.join(url, "commit_success.txt"))
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  restored = checkpoint.restore_params(url, checkpoint.host_target(target))
  jax.tree.map(np.testing.assert_array_equal, restored, params)
  # A step directory written but not committed (a crash mid-save) is not a checkpoint.
  storage.write_bytes_atomic("s3://olmo3-test/models/9/params/_METADATA", b"{}",
                             durability=storage.Durability.FLUSHED)
  assert checkpoint.run_steps("s3://olmo3-test/models") == [7]
  assert orbax_s3.is_committed(url) and not orbax_s3.is_committed("s3://olmo3-test/models/9")


@pytest.fixture(scope="session")
def gcs_env():
  with storage_servers.gcs_server() as env, storage_servers.environment(env):
    yield env


@pytest.mark.parametrize("store", ["gs", "s3"])
@pytest.mark.slow(seconds=30)
def test_a_run_kept_in_a_bucket_is_killed_resumes_from_it_and_matches_the_local_run(
    store, request, tmp_path):
  """Data (a prepared directory: training files and held-out split), checkpoints, metrics and
  the run record all in a bucket of a real GCS / S3 server: the launcher is SIGKILLed after
  its step-3 checkpoint, the same command resumes from the bucket, and every step's loss equals
  the uninterrupted local run's."""
  from olmo3.data import embedded

  env = request.getfixturevalue("gcs_env" if store == "gs" else "s3_env")
  bucket = f"{store}://olmo3-run"
  storage_servers.make_bucket(bucket)
  storage_servers.upload_tree(os.fspath(embedded.corpus_dir()), f"{bucket}/embedded")
  workdir = f"{bucket}/run"
  args = [sys.executable, MAIN, *TINY, f"--workdir={workdir}",
          f"--fdl_set=data.mix='{bucket}/embedded'", "--fdl_set=train.eval_every=9",
          "--fdl_set=eval.batch_size=8"]  # the evaluation program other launches compile
  run_env = dict(_env(1), **env)
  first = subprocess.Popen([*args, "--fdl_set=train.steps=1000"], cwd=ROOT, env=run_env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while not storage.exists(f"{workdir}/checkpoints/3/commit_success.txt"):
    assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
    time.sleep(0.1)
  first.send_signal(signal.SIGKILL)
  first.communicate(timeout=60)
  done = subprocess.run([*args, "--fdl_set=train.steps=9"], cwd=ROOT, env=run_env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "restor" in done.stderr  # it resumed, not started over
  rows = metrics_lib.read_jsonl(f"{workdir}/metrics.jsonl")
  uninterrupted = request.getfixturevalue("straight")  # only now: see test_reliability's
  assert {r["step"]: r["loss"] for r in rows if "loss" in r} == uninterrupted
  assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})  # no step twice
  heldout = [k for r in rows if r["step"] == 9 for k in r if k.startswith("eval/embedded/")]
  assert heldout, "the bucket's held-out split was not evaluated"
  assert checkpoint.run_steps(f"{workdir}/checkpoints")[-1] == 9
  for record in ("config.json", "experiment.json", "command.txt", "file_sizes.json"):
    assert storage.exists(f"{workdir}/{record}"), record
  fs = clients.filesystem(workdir)
  assert [p for p in fs.find(f"{workdir}/tensorboard") if "tfevents" in p]
  assert not [p for p in os.listdir(ROOT) if p.endswith(":")]  # no local 'gs:' / 's3:' dirs


@pytest.mark.seconds(3, waits=True)
def test_object_store_leases_are_taken_and_replaced_only_under_a_precondition(s3_env):
  """The workdir lease in a bucket: created only where none is, replaced only if unchanged
  since read (S3's If-None-Match / If-Match; GCS's ifGenerationMatch is exercised by the gs://
  runs above and in tests/test_outages.py, whose server is a process), renewed, released."""
  from olmo3.run import lease as lease_lib  # pylint: disable=import-outside-toplevel

  bucket = "s3://olmo3-lease"
  storage_servers.make_bucket(bucket)
  url = f"{bucket}/run/lease.json"
  conditional.create_exclusive(url, b"one")
  with pytest.raises(errors.PreconditionFailed):
    conditional.create_exclusive(url, b"two")
  first = conditional.read_versioned(url)
  conditional.replace_if(url, b"three", first)
  with pytest.raises(errors.PreconditionFailed):  # judged on what is no longer there
    conditional.replace_if(url, b"four", first)
  assert conditional.read_versioned(url).data == b"three"
  # An empty lease just written: taken once it is stale.
  storage.write_bytes_atomic(url, b"", durability=storage.Durability.FLUSHED)
  held = lease_lib.Lease(f"{bucket}/run", takeover=2.4)
  held.acquire()
  with pytest.raises(lease_lib.LeaseHeld, match="in use by pid"):
    lease_lib.Lease(f"{bucket}/run", takeover=2.4).acquire()
  time.sleep(0.5)
  assert held.lost() is None
  held.release()
  assert not storage.exists(url)


# --- prepared directories in buckets and over HTTP ------------------------------------------------


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
  """(a JSONL input, a small tokenizer.json) for `prepare`: a few thousand tokens."""
  from olmo3.data import embedded

  root = tmp_path_factory.mktemp("documents")
  texts = [f"note {i}: the river {i % 17} runs past {i * 3} mills and {i % 5} bridges"
           for i in range(240)]
  with open(root / "docs.jsonl", "w") as f:
    f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
  embedded.train_tokenizer(texts, vocab_size=300).save(os.fspath(root / "tokenizer.json"))
  return os.fspath(root / "docs.jsonl"), os.fspath(root / "tokenizer.json")


def _prepare_args(documents, out):
  return ["--input", documents[0], "--tokenizer", documents[1], "--out", out,
          "--heldout_fraction", "0.2"]


def _same_prepared(url, local) -> None:
  """The prepared directory at `url` holds what the one at `local` does, byte for byte."""
  from olmo3.data import manifest as manifest_lib

  manifest = manifest_lib.Manifest.load(url)  # its files checked against it, over the store
  assert manifest == manifest_lib.Manifest.load(local)
  names = [manifest_lib.MANIFEST_FILE, manifest_lib.TOKENIZER_FILE] + [
      f for split in manifest_lib.SPLITS for f in manifest.splits[split]["files"]]
  for name in names:
    assert storage.read_bytes(pathnames.join(url, name)) == storage.read_bytes(
        os.path.join(local, name)), name


@pytest.mark.seconds(4)
def test_prepare_writes_into_a_bucket_and_a_failed_run_leaves_no_prepared_directory(
    s3_env, documents, tmp_path, monkeypatch, capsys):
  """`python -m olmo3.data.prepare --out s3://...` (its main, in-process) writes the same files
  as to a disk, and no local `s3:` directory; a run that fails halfway leaves nothing that
  looks prepared (its manifest goes first, what it uploaded after it); `--out http://` is one
  error line."""
  from olmo3.data import prepare, sources

  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(prepare, "TOKENS_PER_FILE", 1000)  # several token files per split
  url = "s3://olmo3-test/prepared/mine"
  assert prepare.main(_prepare_args(documents, os.fspath(tmp_path / "mine"))) == 0
  assert prepare.main(_prepare_args(documents, url)) == 0
  assert f"wrote {url}/manifest.json" in capsys.readouterr().out
  assert os.listdir(tmp_path) == ["mine"]  # nothing written locally under a name like 's3:'
  _same_prepared(url, os.fspath(tmp_path / "mine"))
  assert {f.label for f in sources.read_mix(url)} == {"mine"}

  real_write, written = prepare.write_token_file, []

  def fail_on_the_third(path, tokens):
    written.append(path)
    if len(written) == 3:
      raise errors.StorageError(f"writing {path} failed: the store is down")
    real_write(path, tokens)

  monkeypatch.setattr(prepare, "write_token_file", fail_on_the_third)
  assert prepare.main(_prepare_args(documents, url)) == 2
  err = capsys.readouterr().err  # the progress bar's lines, then the error's
  assert err.strip().splitlines()[-1] == f"error: writing {written[2]} failed: the store is down"
  assert "Traceback" not in err
  assert not clients.filesystem(url).find(url)  # not the old files, nor the two new ones
  assert sources.prepared(url) is None

  assert prepare.main(_prepare_args(documents, "http://127.0.0.1:9/mine")) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: --out http://127.0.0.1:9/mine: http:// is read-only; a workdir or "
                 "anything written must be a local path, gs:// or s3://"], err


@pytest.mark.slow(seconds=5)
def test_prepare_writes_into_a_gcs_bucket_from_its_command_line(gcs_env, documents, tmp_path):
  from olmo3.data import prepare

  bucket = "gs://olmo3-prepare"
  storage_servers.make_bucket(bucket)
  for out in (os.fspath(tmp_path / "mine"), f"{bucket}/mine"):
    assert prepare.main(_prepare_args(documents, out)) == 0
  # The command, over what is there: replaced.
  done = subprocess.run([sys.executable, "-m", "olmo3.data.prepare",
                         *_prepare_args(documents, f"{bucket}/mine")], cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"wrote {bucket}/mine/manifest.json" in done.stdout
  assert os.listdir(tmp_path) == ["mine"]
  _same_prepared(f"{bucket}/mine", os.fspath(tmp_path / "mine"))


@pytest.fixture
def served(documents, tmp_path):
  """DIR holding a prepared directory `mine` and a mix file naming its training file."""
  from olmo3.data import prepare

  served = tmp_path / "served"
  prepare.prepare([documents[0]], documents[1], os.fspath(served / "mine"), 0.2, progress=False)
  (served / "mix.txt").write_text("notes,mine/train/part-00000.npy\n")
  return served


def _tiny_on(mix):
  """The tiny stage 1 on data.mix=`mix`, with batches this data fills, its model's vocabulary
  the test tokenizer's (a prepared directory's tokenizer is the model's)."""
  import fiddle as fdl

  from experiments import olmo3_tiny
  from olmo3.data import manifest as manifest_lib

  exp = fdl.build(olmo3_tiny.stage1())
  vocab = manifest_lib.Manifest.load(os.fspath(mix)).vocab_size
  return dataclasses.replace(exp, data=exp.data.replace(mix=os.fspath(mix), seq_len=32,
                                                        global_batch_size=8),
                             model=exp.model.replace(vocab_size=vocab))


@pytest.mark.seconds(3)
def test_a_prepared_directory_and_a_mix_file_over_http_are_read_as_from_disk(
    served, tmp_path, monkeypatch):
  """Served by olmo3.data.serve: a launch's plan (RunPlan.build) over http:// finds the same
  training files, held-out set and tokenizer as on disk, and its loader yields the same
  batches; the held-out sets `python -m olmo3.eval` reads and a mix file over http too."""
  from olmo3.data import pipeline, serve, sources
  from olmo3.run.plan import RunPlan
  from tests.data_helpers import batch_sharding

  monkeypatch.setenv("OLMO3_CACHE", os.fspath(tmp_path / "cache"))
  local = RunPlan.build(_tiny_on(served / "mine"), os.fspath(tmp_path / "run-local"))
  with RangeServer(os.fspath(served)) as server:
    url = f"{server.url}/mine"
    assert serve.announcement(os.fspath(served), server.url)[1:] == [
        f"  prepared directory mine: --fdl_set=data.mix='\"{url}\"'"]
    plan = RunPlan.build(_tiny_on(url + "/"), os.fspath(tmp_path / "run"))
    assert plan.exp.eval.heldout == (f"{url}/heldout",)
    assert plan.exp.eval.tokenizer == f"{url}/tokenizer.json"
    assert plan.train_files.paths == [f"{url}/train/part-00000.npy"]
    assert plan.identity == {**local.identity, "mix": f"{url}/",
                             "files": [[f"{url}/train/part-00000.npy", n]
                                       for _, n in local.identity["files"]]}
    assert [(s.name, s.paths, s.tokens) for s in plan.heldout] == [
        ("mine", (f"{url}/heldout/part-00000.npy",), local.heldout[0].tokens)]
    assert sources.heldout_sets(plan.exp) == {"mine": plan.heldout[0].paths}

    def batches(plan):
      loader = pipeline.Loader(plan.exp.data, batch_sharding(4), start_step=0, num_steps=3,
                               source=plan.train_files)
      return list(loader.host_batches())

    for a, b in zip(batches(plan), batches(local), strict=True):
      for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    held = [HeldoutDocs(p.heldout[0].paths, 32, eos_id=0, pad_id=1) for p in (plan, local)]
    assert len(held[0]) == len(held[1])
    a, b = (docs.rows(range(len(docs)), docs.seq_len, len(docs)) for docs in held)
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    with open(sources.tokenizer_file(plan.exp.eval.tokenizer), "rb") as f:
      assert f.read() == (served / "mine" / "tokenizer.json").read_bytes()
    assert sources.read_mix(f"{server.url}/mix.txt") == [
        sources.MixFile("notes", f"{url}/train/part-00000.npy")]
    with pytest.raises(DataError, match=rf"DataConfig.mix='{server.url}/nope': no such mix "
                                        r"file or prepared directory$"):
      sources.read_mix(f"{server.url}/nope")


def test_inspect_lists_a_step_of_data_behind_http_as_of_the_same_data_on_disk(
    served, tmp_path, capsys, monkeypatch):
  """`python -m olmo3.inspect_step` on a run whose prepared directory is served over HTTP lists
  step 4's rows as on disk: the same instances at the same offsets (the URL for the path), the
  same text, with the run's tokenizer read from the server."""
  from tests.test_inspect_step import _workdir, inspect

  monkeypatch.setenv("OLMO3_CACHE", os.fspath(tmp_path / "cache"))
  local = _workdir(tmp_path, _tiny_on(served / "mine"), "local")
  with RangeServer(os.fspath(served)) as server:
    remote = _workdir(tmp_path, _tiny_on(f"{server.url}/mine/"), "remote")
    rows = [inspect(plan.workdir.root, "--step", "4", capsys=capsys,
                    monkeypatch=monkeypatch)["rows"] for plan in (remote, local)]
  url, path = remote.train_files.paths[0], local.train_files.paths[0]
  assert url.startswith("http://") and len(rows[0]) == 8
  for row in rows[0]:
    row["spans"] = [dict(s, file=s["file"].replace(url, path)) for s in row["spans"]]
  assert rows[0] == rows[1]


def test_a_server_without_range_requests_is_refused_at_the_first_request(served, tmp_path):
  """`python -m http.server` ignores Range requests: a launch's plan on a prepared directory
  it serves stops at its first request (the manifest), saying so."""
  from olmo3.run.plan import RunPlan

  with storage_servers.plain_http_server(served) as plain:
    url = f"{plain}/mine"
    with pytest.raises(errors.StorageError, match=rf"^{url}/manifest.json: the server does not "
                       r"support HTTP Range requests .* \(python -m olmo3.data.serve DIR\)$"):
      RunPlan.build(_tiny_on(url), os.fspath(tmp_path / "run"))


def test_serve_refuses_what_it_cannot_serve_in_one_line(served, capsys):
  from olmo3.data import serve

  for directory, message in (
      (served / "nope", f"error: {served / 'nope'} is not a directory"),
      (served / "mine", f"error: {served / 'mine'} is a prepared directory: serve the directory "
                        f"it is in ({served}), so that its URL ends with its name")):
    assert serve.main([os.fspath(directory), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


_STALLED_TENSORSTORE = """
import socket, sys, threading, time
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(16)
held = []
threading.Thread(target=lambda: [held.append(server.accept()) for _ in iter(int, 1)],
                 daemon=True).start()  # accepts connections and never answers
import os
os.environ["TENSORSTORE_GCS_HTTP_URL"] = f"http://127.0.0.1:{server.getsockname()[1]}"
from olmo3.io import clients
clients.configure_clients()
import tensorstore as ts
started = time.monotonic()
try:
  ts.open({"driver": "zarr", "kvstore": "gs://stalled/array",
           "context": clients.tensorstore_context({})}, open=True).result(timeout=30)
except Exception as e:
  print(round(time.monotonic() - started), str(e).splitlines()[0])
"""


def test_tensorstore_timeouts_follow_this_process_budget_unless_the_user_set_them(monkeypatch):
  """A value olmo3 derived in a parent (inherited) is derived again from this process's
  OLMO3_STORAGE_TIMEOUT_S; one the user set is kept, whichever of the three it is."""
  connect, low_speed = ("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS",
                        "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS")
  for key in (connect, low_speed, "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES",
              clients._DERIVED_ENV):  # pylint: disable=protected-access
    monkeypatch.delenv(key, raising=False)
  monkeypatch.setenv(connect, "77")  # the user's
  monkeypatch.setenv(settings.TIMEOUT_ENV, "30")
  clients.configure_clients()  # the parent
  assert (os.environ[connect], os.environ[low_speed]) == ("77", "30")
  monkeypatch.setenv(settings.TIMEOUT_ENV, "2")
  clients.configure_clients()  # a child, with the parent's environment and its own budget
  assert (os.environ[connect], os.environ[low_speed]) == ("77", "2")


@pytest.mark.slow(seconds=4, waits=True)
def test_a_stalled_store_fails_tensorstore_requests_within_the_budget():
  """Orbax reads and writes arrays through TensorStore, whose requests have no deadline from
  Python: a store that accepts connections and never answers fails them after the request
  timeout (1 s here), retried within the budget (1 s), not after TensorStore's minutes."""
  # This process's configure_clients (earlier tests) derived TENSORSTORE_CURL_* from the
  # default timeout; the child inherits them and must derive its own from its 1 s.
  clients.configure_clients()
  env = dict(os.environ, GOOGLE_AUTH_TOKEN_FOR_TESTING="test",
             **{settings.TIMEOUT_ENV: "1", settings.RETRY_ENV: "1"})
  done = subprocess.run([sys.executable, "-c", _STALLED_TENSORSTORE], capture_output=True,
                        text=True, cwd=ROOT, env=env, timeout=120)
  seconds, _, message = done.stdout.strip().partition(" ")
  assert seconds.isdigit() and int(seconds) <= 3 * 1 + 1 + 5, done.stdout + done.stderr[-2000:]
  assert "Timeout was reached" in message, message


@pytest.mark.seconds(3, waits=True)
def test_a_request_to_a_stalled_s3_store_is_one_attempt_of_one_timeout(monkeypatch):
  """s3fs's requests (botocore's) are each sent once, the budget being the only retrier: to a
  store that accepts connections and never answers, a read tried once (a run's cleanup)
  opens one connection and fails after one request timeout. botocore's retry option counted
  retries, not attempts, and every request was sent twice."""
  import fsspec

  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(16)
  held = []

  def accept():
    while True:
      try:
        held.append(server.accept())
      except OSError:  # closed
        return

  threading.Thread(target=accept, daemon=True).start()
  monkeypatch.setenv(settings.TIMEOUT_ENV, "1")
  clients.configure_clients()
  options = clients.client_options()["s3"]
  fs = fsspec.filesystem("s3", skip_instance_cache=True, key="test", secret="test",
                         endpoint_url=f"http://127.0.0.1:{server.getsockname()[1]}", **options)
  started = time.monotonic()
  try:
    with retry.attempts_once(), pytest.raises(OSError, match="Read timeout"):
      fs.cat_file("s3://stalled/key")
  finally:
    server.close()
    for connection, _ in held:
      connection.close()
  assert len(held) == 1, held
  assert time.monotonic() - started < 1.9


def test_a_request_a_library_abandoned_is_not_logged_with_its_traceback(caplog):
  """A request task a library started and never awaited (Orbax's save, another part of which
  failed first while the store stalled) ends in a StorageError of ours: asyncio's "Task
  exception was never retrieved", with its traceback, came before the run's own one-line
  error. Dropped; any other exception asyncio reports still is."""
  clients.configure_clients()

  async def fails(error):
    raise error

  def abandon(error):
    loop = asyncio.new_event_loop()
    try:
      task = loop.create_task(fails(error))
      loop.run_until_complete(asyncio.sleep(0.01))
      assert task.done()
      del task
      gc.collect()  # asyncio reports an exception no one retrieved when the task is collected
    finally:
      loop.close()

  with caplog.at_level("ERROR", logger="asyncio"):
    abandon(retry.OutOfBudget("listing gs://b/run/checkpoints/6", TimeoutError(), 1, 3.0))
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
    abandon(ValueError("a bug"))
    assert "Task exception was never retrieved" in caplog.text and "ValueError" in caplog.text


@pytest.mark.parametrize("budget, timeout", [(3, 1), (1, 1), (8, 5), (30, 10), (60, 5),
                                             (180, 60), (180, 10)])
def test_tensorstore_retries_end_within_the_budget_and_a_timeout_when_every_attempt_stalls(
    budget, timeout):
  """TensorStore retries a fixed number of times: counted with the request timeouts (and its
  up-to-1-s jitter per delay), the last retry of a stalled store starts within the budget; a
  store that refuses at once is still retried over about half the budget (or all the budget
  leaves after the attempts). Before, 30 s and 10 s gave 5 retries: 91 s."""
  retries, first = clients.tensorstore_retries(budget, timeout)
  delays = sum(first * 2 ** i for i in range(retries))
  assert retries >= 1
  assert retries * (timeout + 1) + delays <= max(budget, timeout + 1 + 0.5) + 1e-9
  assert delays >= min(budget / 2 - retries, budget - retries * (timeout + 1)) - 1e-9


def test_refused_or_missing_credentials_are_no_access_naming_the_operation():
  """What botocore raises without credentials, and S3's refusal of a key it does not know (as
  s3fs hands it: a PermissionError raised from botocore's ClientError), become NoAccess, which
  says what to set; other errors are left alone."""
  from botocore import exceptions

  refused = PermissionError("The AWS Access Key Id you provided does not exist in our records.")
  refused.__cause__ = exceptions.ClientError(
      {"Error": {"Code": "InvalidAccessKeyId", "Message": "no such key"}}, "GetObject")
  for error, says in ((exceptions.NoCredentialsError(), "no S3 credentials"),
                      (refused, "the store refused the S3 credentials (InvalidAccessKeyId")):
    found = retry._credentials_problem(error, "reading s3://b/k")  # pylint: disable=protected-access
    assert isinstance(found, errors.NoAccess), error
    assert str(found).startswith(f"reading s3://b/k failed: {says}"), str(found)
    assert "AWS_ACCESS_KEY_ID" in str(found)
  assert retry._credentials_problem(FileNotFoundError("s3://b/k"), "x") is None  # pylint: disable=protected-access


# GCS's emulator is a process of its own; S3's (moto) serves from a thread of this one.
@pytest.mark.parametrize("store", [pytest.param("gs", marks=pytest.mark.slow(seconds=6)),
                                   pytest.param("s3", marks=pytest.mark.seconds(3))])
def test_a_new_host_reads_the_order_kept_beside_the_run_and_never_a_damaged_or_foreign_copy(
    store, request, tmp_path, monkeypatch):
  """A run in a bucket keeps its epoch's global order beside it (WORKDIR/order: process 0 puts
  its machine's there). A host new to the run, its cache empty (a lost host's replacement),
  computes nothing: it reads the block its first step needs from the bucket, checked against
  the copy's sidecar. A block damaged in the bucket is never used (the order is computed on the
  host), nor a copy of another order (its sidecar another seed's)."""
  from olmo3.data import order as order_lib
  from olmo3.data.order import GlobalOrder

  request.getfixturevalue("gcs_env" if store == "gs" else "s3_env")
  bucket = f"{store}://olmo3-kept-order"
  storage_servers.make_bucket(bucket)
  beside = f"{bucket}/run/order"
  copy = f"{beside}/order-10000-7-1-1.u32"
  monkeypatch.setattr(order_lib, "_BLOCK_BYTES", 4096)  # 1,024 indices a block: 10 blocks
  order = order_lib.epoch_permutation(10_000, 7, 1)
  host = lambda name, **kw: GlobalOrder(10_000, 64, 7, 1, tmp_path / name, beside=beside, **kw)
  host("first", keeps_beside=True).prepare(1)  # process 0 computes it and keeps it beside
  assert storage.read_bytes(copy) == order.tobytes()
  computed = []
  compute = order_lib.epoch_permutation
  monkeypatch.setattr(order_lib, "epoch_permutation", lambda *a: computed.append(a) or compute(*a))
  new = host("new")
  new.prepare(1)
  np.testing.assert_array_equal(new.batch(3), order[3 * 64:4 * 64])
  np.testing.assert_array_equal(new.batch(100), order[100 * 64:101 * 64])
  assert computed == [] and set(new._epoch(1).fetched) == {0, 6}  # the blocks read, no more
  assert not (tmp_path / "new" / "order-10000-7-1-1.u32").exists()
  # Block 5 damaged in the bucket: steps outside it still read the copy; step 85 computes.
  data = bytearray(storage.read_bytes(copy))
  data[5 * 4096 + 8] ^= 1
  storage.write_bytes_atomic(copy, bytes(data), durability=storage.Durability.FLUSHED)
  damaged = host("damaged")
  np.testing.assert_array_equal(damaged.batch(3), order[3 * 64:4 * 64])
  assert computed == []
  np.testing.assert_array_equal(damaged.batch(85), order[85 * 64:86 * 64])
  assert len(computed) == 1
  # Another order's copy (its sidecar says seed 8): computed at once, the copy not read.
  sidecar = json.loads(storage.read_text(f"{beside}/order-10000-7-1-1.json"))
  storage.write_bytes_atomic(f"{beside}/order-10000-7-1-1.json", json.dumps(
      {**sidecar, "key": {**sidecar["key"], "seed": 8}}).encode(),
      durability=storage.Durability.FLUSHED)
  foreign = host("foreign")
  foreign.prepare(1)
  assert len(computed) == 2 and not foreign._epoch(1).reading_beside
  np.testing.assert_array_equal(foreign.batch(85), order[85 * 64:86 * 64])
  # Process 0 puts its order back beside the run where the copy is not this order's.
  host("foreign", keeps_beside=True).prepare(1)
  assert json.loads(storage.read_text(f"{beside}/order-10000-7-1-1.json"))["key"]["seed"] == 7
  assert storage.read_bytes(copy) == order.tobytes()
