"""Failures that used to end in a traceback (or to read a file they should not) end in one
`error:` line through the real programs, run by tests/test_launch_errors.py's driver (one
interpreter, a forked child per case): a prepared directory whose manifest names a file
outside it, a store that stays down past the retry budget, a missing file over HTTP, a run
record python -m olmo3.eval cannot use. OLMO3_TRACEBACK=1 brings the traceback back."""

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from olmo3.data.serve import RangeServer
from olmo3.data import embedded
from olmo3 import program
from olmo3.io import settings
from harness import storage_servers
from tests import forked, test_launch_errors

TINY = test_launch_errors.TINY


def _prepared(tmp, name, entry=None, link_to=None):
  """A copy of the built-in corpus's prepared directory, its training file listed as `entry`
  (or replaced by a symbolic link to `link_to`)."""
  directory = tmp / name
  shutil.copytree(embedded.corpus_dir(), directory, ignore=shutil.ignore_patterns(".lock"))
  manifest = json.loads((directory / "manifest.json").read_text())
  if entry is not None:
    manifest["splits"]["train"]["files"] = [entry]
  (directory / "manifest.json").write_text(json.dumps(manifest))
  if link_to is not None:
    (directory / "train" / "part-00000.npy").unlink()
    (directory / "train" / "part-00000.npy").symlink_to(link_to)
  return os.fspath(directory)


def _drive(tmp_path, cases, env=()):
  spec = tmp_path / "cases.json"
  cwd = tmp_path / "cwd"
  cwd.mkdir(exist_ok=True)
  spec.write_text(json.dumps([{"program": c["program"], "argv": c["argv"],
                               "cwd": c.get("cwd", os.fspath(cwd))} for c in cases]))
  base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run([sys.executable, test_launch_errors.__file__, os.fspath(spec),
                         os.fspath(tmp_path)], capture_output=True, text=True,
                        cwd=test_launch_errors.ROOT, env=dict(base, **dict(env)), timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout)


def _check(cases, results):
  failures = []
  for case, result in zip(cases, results):
    output, lines = result["output"], result["output"].strip().splitlines()
    problems = []
    if result["rc"] != case.get("rc", 1):
      problems.append(f"exit code {result['rc']}")
    if "Traceback" in output:
      problems.append("a traceback")
    if not lines or not lines[-1].startswith(case["last"]):
      problems.append(f"last line {lines[-1:]}, expected it to start {case['last']!r}")
    problems += [f"missing {t!r}" for t in case.get("contains", ()) if t not in lines[-1:][0]]
    problems += [f"left {p} behind" for p in case.get("absent", ()) if os.path.exists(p)]
    if problems:
      failures.append(f"{case['name']}: {'; '.join(problems)}\n{output[-1500:]}")
  assert not failures, "\n\n".join(failures)


@pytest.mark.slow(seconds=10)
def test_manifest_entries_outside_their_directory_are_refused_naming_the_entry(tmp_path):
  secret = tmp_path / "secret.npy"
  np.arange(5000, dtype=np.uint32).tofile(secret)
  mix = lambda d: f"--fdl_set=data.mix='{d}'"
  work = lambda name: os.fspath(tmp_path / name)
  cases = [
      dict(name="..", program="main", argv=[TINY, mix(_prepared(tmp_path, "up", "../secret.npy")),
                                            f"--workdir={work('w1')}"],
           last=f"error: {tmp_path / 'up' / 'manifest.json'}: file '../secret.npy' of split "
                "'train' is not a plain path inside its directory", absent=[work("w1")]),
      dict(name="absolute", program="main",
           argv=[TINY, mix(_prepared(tmp_path, "abs", os.fspath(secret))),
                 f"--workdir={work('w2')}"],
           last=f"error: {tmp_path / 'abs' / 'manifest.json'}: file '{secret}' of split "
                "'train' is not a plain path", absent=[work("w2")]),
      dict(name="a URL", program="main",
           argv=[TINY, mix(_prepared(tmp_path, "url", "http://127.0.0.1:9/x.npy")),
                 f"--workdir={work('w3')}"],
           last=f"error: {tmp_path / 'url' / 'manifest.json'}: file 'http://127.0.0.1:9/x.npy'",
           absent=[work("w3")]),
      dict(name="symlink", program="main",
           argv=[TINY, mix(_prepared(tmp_path, "link", link_to=secret)),
                 f"--workdir={work('w4')}"],
           last=f"error: {tmp_path / 'link' / 'manifest.json'}: file 'train/part-00000.npy' of "
                f"split 'train' leads outside its directory through a symbolic link (to "
                f"{secret})", absent=[work("w4")]),
  ]
  _check(cases, _drive(tmp_path, cases))


def _recorded(workdir, url):
  """A workdir whose record of remote sizes says the served training file held 4096 bytes."""
  workdir.mkdir()
  (workdir / "file_sizes.json").write_text(json.dumps(
      {f"{url}/mine/train/part-00000.npy": [4096, None]}))
  return workdir


@pytest.mark.slow(seconds=20)
def test_storage_and_record_failures_are_one_line(tmp_path):
  """A store that refuses connections past the budget (2 s here), a token file missing over
  HTTP, a mix over HTTP that is not there, a prepared directory on a server that ignores Range
  requests (`python -m http.server`), a served token file unlike the workdir's record of it,
  and python -m olmo3.eval on a run whose experiment file
  holds an invalid value: one line each, naming the operation and URL or the field."""
  run = tmp_path / "run"
  (run / "checkpoints" / "4").mkdir(parents=True)
  (run / "experiment.json").write_text(json.dumps({"train": {"steps": -3}}))
  (tmp_path / "served").mkdir()
  (tmp_path / "plain").mkdir()
  _prepared(tmp_path / "plain", "mine")
  _prepared(tmp_path / "served", "mine")
  with RangeServer(os.fspath(tmp_path / "served")) as server, storage_servers.plain_http_server(
      tmp_path / "plain") as plain:
    cases = [
        dict(name="store down", program="main",
             argv=[TINY, "--fdl_set=data.mix=None",
                   "--fdl_set=data.paths=('http://127.0.0.1:9/tokens.npy',)",
                   f"--workdir={tmp_path / 'w1'}"],
             last="error: looking up http://127.0.0.1:9/tokens.npy failed: ClientConnectorError",
             contains=[f"{settings.RETRY_ENV}=2 s"], absent=[os.fspath(tmp_path / "w1")]),
        dict(name="missing over HTTP", program="main",
             argv=[TINY, "--fdl_set=data.mix=None",
                   f"--fdl_set=data.paths=('{server.url}/nope.npy',)",
                   f"--workdir={tmp_path / 'w2'}"],
             last=f"error: token file {server.url}/nope.npy does not exist"),
        dict(name="mix over HTTP", program="main",
             argv=[TINY, f"--fdl_set=data.mix='{server.url}/mix.txt'",
                   f"--workdir={tmp_path / 'w3'}"],
             last=f"error: DataConfig.mix='{server.url}/mix.txt': no such mix file or prepared "
                  "directory"),
        dict(name="no Range requests", program="main",
             argv=[TINY, f"--fdl_set=data.mix='{plain}/mine'", f"--workdir={tmp_path / 'w4'}"],
             last=f"error: {plain}/mine/manifest.json: the server does not support HTTP Range "
                  "requests", absent=[os.fspath(tmp_path / "w4")]),
        dict(name="data changed since recorded", program="main",
             argv=[TINY, f"--fdl_set=data.mix='{server.url}/mine'",
                   f"--workdir={_recorded(tmp_path / 'w5', server.url)}"],
             last=f"error: token file {server.url}/mine/train/part-00000.npy changed since this "
                  f"run recorded it in {tmp_path / 'w5'}/file_sizes.json: 4,096 bytes then,"),
        dict(name="eval of a bad experiment.json", program="olmo3.eval",
             argv=["--workdir", os.fspath(run)], last="error: TrainConfig.steps=-3"),
    ]
    results = _drive(tmp_path, cases, {settings.RETRY_ENV: "2"})
  _check(cases, results)
  # The traceback, on request.
  with RangeServer(os.fspath(tmp_path / "served")):
    shown = _drive(tmp_path, cases[-1:], {program.TRACEBACK_ENV: "1"})
  assert "Traceback" in shown[0]["output"] and "ConfigError" in shown[0]["output"]


@pytest.mark.slow(seconds=20)
def test_a_run_stopped_by_its_skip_limit_says_so_in_one_line(tmp_path):
  """train.max_consecutive_skips reached (every update non-finite at an absurd learning rate):
  exit 1 and one line, not TrainingStopped's traceback."""
  # pylint: disable-next=import-outside-toplevel
  from tests.test_reliability import TINY as RUN, _env

  done = forked.completed("main", [*RUN, "--fdl_set=train.steps=20",
                                   "--fdl_set=optimizer.peak_lr=1e30",
                                   "--fdl_set=optimizer.warmup_steps=0",
                                   "--fdl_set=train.max_consecutive_skips=2",
                                   f"--workdir={tmp_path / 'run'}"], _env(1))
  assert done.returncode == 1, done.stderr[-3000:]
  assert "Traceback" not in done.stderr, done.stderr[-3000:]
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "2 consecutive steps skipped" in last, last


_STUCK_PROGRAM = """
import pathlib, sys, threading, time
from absl import logging
from olmo3 import program

program.EXIT_GRACE_S = 2.0
def main():
  # A library's leftover (as Orbax's commit threads of a failed save): waits for ever.
  threading.Thread(target=threading.Event().wait, name="stuck").start()
  # One whose join raises when it times out, as Orbax's CommitFuture threads' does.
  class Raising(threading.Thread):
    def join(self, timeout=None):
      super().join(timeout)
      if self.is_alive():
        raise TimeoutError(f"{self.name} did not complete within {timeout} seconds")
  Raising(target=threading.Event().wait, name="raising").start()
  # Work that ends within the grace is waited for.
  threading.Thread(target=lambda: (time.sleep(0.5), pathlib.Path(sys.argv[2]).touch())).start()
  if sys.argv[1] == "fail":
    # Leftovers of the failure that speak after the error line (a commit thread's exception
    # and log record): the line stays the last one.
    def leftover():
      time.sleep(0.5)
      logging.error("the commit failed")
      try:  # a library's callback thread printing its exception (C code's PyErr_Print)
        raise RuntimeError("Event loop is closed")
      except RuntimeError:
        sys.excepthook(*sys.exc_info())
      raise PermissionError("the store refused the write")
    threading.Thread(target=leftover, name="leftover").start()
    raise OSError("the store is down")
program.reported(main, lambda: (OSError,))()
"""


@pytest.mark.slow(seconds=3, waits=True)
@pytest.mark.parametrize("how, code, last", [("fail", 1, "error: OSError: the store is down"),
                                             ("finish", 0, None)])
def test_a_program_ends_despite_a_thread_that_never_does(tmp_path, how, code, last):
  done = tmp_path / "done"
  started = time.monotonic()
  ended = subprocess.run([sys.executable, "-c", _STUCK_PROGRAM, how, os.fspath(done)],
                         capture_output=True, text=True, timeout=60,
                         cwd=test_launch_errors.ROOT)
  assert time.monotonic() - started < 30, "the grace is 2 s"
  assert ended.returncode == code, ended.stderr
  assert (ended.stderr.strip().splitlines()[-1:] or [None])[-1] == last, ended.stderr
  assert done.exists(), "a thread that ends within the grace was cut short"


class _Refusing(http.server.BaseHTTPRequestHandler):
  """Every request answered as GCS answers an anonymous caller on a private bucket."""

  def _refuse(self):
    body = json.dumps({"error": {"code": 401, "message": "Anonymous caller does not have "
                                 "storage.objects.get access to the Google Cloud Storage "
                                 "object."}}).encode()
    self.send_response(401)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _refuse

  def log_message(self, *args):
    pass


@pytest.mark.slow(seconds=7, waits=True)
def test_missing_credentials_are_one_line_naming_the_url_and_what_to_set(tmp_path):
  """Training into, and `prepare --out`, an S3 bucket without AWS credentials (none in the
  environment, no credentials or config file) end in one `error:` line, the last, naming the
  URL and the variables to set (botocore's NoCredentialsError was a 70- and an 87-line
  traceback); a GCS store refusing an anonymous caller (HTTP 401, as GCS answers one that
  found no credentials) too."""
  from olmo3.data import embedded

  docs = tmp_path / "docs.jsonl"
  docs.write_text("".join(json.dumps({"text": f"note {i} on the river"}) + "\n"
                          for i in range(40)))
  tokenizer = os.fspath(embedded.corpus_dir() / "tokenizer.json")
  credentials = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_DEFAULT_PROFILE")
  base = {k: v for k, v in os.environ.items() if k not in credentials and k != "XLA_FLAGS"}
  refusing = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
  threading.Thread(target=refusing.serve_forever, daemon=True).start()
  try:
    with storage_servers.s3_server() as s3_env:
      env = dict(base, **{k: v for k, v in s3_env.items() if k not in credentials})
      env.update({"AWS_CONFIG_FILE": os.fspath(tmp_path / "no" / "config"),
                  "AWS_SHARED_CREDENTIALS_FILE": os.fspath(tmp_path / "no" / "credentials"),
                  settings.RETRY_ENV: "2"})
      urllib.request.urlopen(urllib.request.Request(
          f"{s3_env['AWS_ENDPOINT_URL']}/olmo3-nocreds", method="PUT"), timeout=10).close()
      runs = {
          "s3://olmo3-nocreds/run": forked.completed(
              "main", [TINY, "--workdir=s3://olmo3-nocreds/run"], env),
          "s3://olmo3-nocreds/prepared": forked.completed(
              "olmo3.data.prepare", ["--input", os.fspath(docs), "--tokenizer", tokenizer,
                                     "--out", "s3://olmo3-nocreds/prepared"], env),
      }
    gcs_env = dict(base, STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{refusing.server_port}",
                   GCE_METADATA_HOST="127.0.0.1:9", GCE_METADATA_ROOT="127.0.0.1:9",
                   GCE_METADATA_IP="127.0.0.1:9", NO_GCE_CHECK="True",
                   GOOGLE_APPLICATION_CREDENTIALS="", CLOUDSDK_CONFIG=os.fspath(tmp_path / "no"))
    runs["gs://olmo3-private/run"] = forked.completed(
        "main", [TINY, "--workdir=gs://olmo3-private/run"], gcs_env)
  finally:
    refusing.shutdown()
    refusing.server_close()
  for url, done in runs.items():
    lines = done.stderr.strip().splitlines()
    assert done.returncode in (1, 2) and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors_said = [line for line in lines if line.startswith("error:")]
    assert errors_said == lines[-1:] and url in lines[-1], done.stderr[-3000:]
    hint = ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE"
            if url.startswith("s3") else "GOOGLE_APPLICATION_CREDENTIALS")
    assert hint in lines[-1], lines[-1]
