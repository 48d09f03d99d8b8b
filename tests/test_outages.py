"""Storage outages through the real launcher, its workdir in a bucket of a server started here
(fake-gcs-server, moto), the server stopped while the run trains: a store that stays down past
the retry budget ends the run non-zero within the budget + 60 s, in one `error:` line naming
the operation and the URL, never a traceback; a store that comes back within the budget loses
nothing (the run ends with the uninterrupted run's losses).

The test process makes no client of these servers (its own cached clients may point at the
session's servers): buckets are made with one plain HTTP request, and the run's progress is
read from its log."""

import contextlib
import json
import os
import time
import urllib.request

import pytest

from olmo3.io import settings
from olmo3.run import lease as lease_lib
from harness import storage_servers
from tests import forked
from tests.test_reliability import TINY, _env, straight  # noqa: F401

BUDGET_S = 4  # OLMO3_STORAGE_RETRY_S in these runs
LIMITS = {settings.RETRY_ENV: str(BUDGET_S), settings.TIMEOUT_ENV: "3",
          lease_lib.TAKEOVER_ENV: "40"}


class _S3Server:
  """moto's S3 server in a thread of this process."""

  def __init__(self):
    from moto.server import ThreadedMotoServer  # pylint: disable=import-outside-toplevel

    self.port = storage_servers._free_port()  # pylint: disable=protected-access
    self.url = f"http://127.0.0.1:{self.port}"
    self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
    self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

  def start(self):
    self.server.start()
    storage_servers._wait(self.url)  # pylint: disable=protected-access

  def make_bucket(self, name):
    urllib.request.urlopen(urllib.request.Request(f"{self.url}/{name}", method="PUT"),
                           timeout=10).close()

  def stop(self):
    self.server.stop()

  close = stop


def _launch(args, env) -> forked.Running:
  return forked.background("main", [*TINY, *args], env)


@pytest.mark.parametrize("store", ["gs", "s3"])
@pytest.mark.slow(seconds=25, waits=True)
def test_a_store_down_past_the_budget_ends_the_run_in_one_line(store, tmp_path):
  server = storage_servers.GcsServer(tmp_path / "gcs") if store == "gs" else _S3Server()
  server.start()
  try:
    server.make_bucket("olmo3-outage")
    workdir = f"{store}://olmo3-outage/run"
    # No AWS config or credentials file where the SDK looks (as on most machines): the
    # run's log says nothing about them.
    missing = {"AWS_CONFIG_FILE": os.fspath(tmp_path / "no" / "config"),
               "AWS_SHARED_CREDENTIALS_FILE": os.fspath(tmp_path / "no" / "credentials")}
    run = _launch(["--fdl_set=train.steps=100000", f"--workdir={workdir}"],
                  dict(_env(1), **{**server.env, **LIMITS, **(missing if store == "s3" else {})}))
    run.wait_for("saving the checkpoint of step 6")
  finally:
    server.stop()
  down = time.monotonic()
  try:
    code = run.finish(BUDGET_S + 60 + 30)
    log = run.log(10**6)
  finally:
    server.close()
  took = time.monotonic() - down
  assert code == 1, log[-3000:]
  assert took < BUDGET_S + 60, (took, log[-3000:])
  last = log.strip().splitlines()[-1]
  assert last.startswith("error: ") and f"{store}://olmo3-outage/run" in last, log[-3000:]
  assert "Traceback" not in log, log[-6000:]
  assert "aws-error" not in log and ".aws" not in log, log[-6000:]


@pytest.mark.slow(seconds=12, waits=True)
def test_a_store_back_within_the_budget_loses_nothing(tmp_path, straight):
  server = storage_servers.GcsServer(tmp_path / "gcs")
  server.start()
  with contextlib.ExitStack() as stack:
    stack.callback(server.close)
    server.make_bucket("olmo3-blip")
    env = dict(_env(1), **server.env, **dict(LIMITS, **{settings.RETRY_ENV: "60"}))
    run = _launch(["--fdl_set=train.steps=9", "--workdir=gs://olmo3-blip/run"], env)
    run.wait_for("saving the checkpoint of step 3")
    server.stop()
    time.sleep(4)  # the run goes on meanwhile, into its next save
    server.start()
    code = run.finish(300)
    log = run.log(10**6)
    assert code == 0, log[-3000:]
    rows = [json.loads(line) for line in
            server.read("olmo3-blip", "run/metrics.jsonl").decode().splitlines()]
  assert {r["step"]: r["loss"] for r in rows if "loss" in r} == straight
  assert "Traceback" not in log


# A store that hangs: short limits, so the run's own waits are short; the bound is the same.
STALL_BUDGET_S = 3
STALL_LIMITS = {settings.RETRY_ENV: str(STALL_BUDGET_S), settings.TIMEOUT_ENV: "3",
                lease_lib.TAKEOVER_ENV: "40"}


@pytest.mark.parametrize("store", ["gs", "s3"])
@pytest.mark.slow(seconds=25, waits=True)
def test_a_store_that_stalls_during_a_save_ends_the_run_in_one_line(store, tmp_path):
  """A store that accepts connections and never answers (moto stopped by SIGSTOP in its own
  process; the GCS emulator's front holding every connection) from just after the launcher
  says it is saving: the run ends non-zero within the budget + 60 s, its last line one
  `error:` line naming the run's URL. Before the fix an S3 run waited there for minutes:
  TensorStore's retries were counted without their request timeouts, and s3fs and botocore
  each retried every request of the cleanup again."""
  server = (storage_servers.GcsServer(tmp_path / "gcs") if store == "gs"
            else storage_servers.S3Process())
  server.start()
  try:
    server.make_bucket("olmo3-stall")
    run = _launch(["--fdl_set=train.steps=100000", f"--workdir={store}://olmo3-stall/run"],
                  dict(_env(1), **server.env, **STALL_LIMITS))
    run.wait_for("saving the checkpoint of step 6")
    time.sleep(0.05)  # into the save
    server.stall()
    stalled = time.monotonic()
    code = run.finish(STALL_BUDGET_S + 60 + 30)
    log = run.log(10**6)
  finally:
    server.close()
  took = time.monotonic() - stalled
  assert code == 1, log[-3000:]
  assert took < STALL_BUDGET_S + 60, (took, log[-3000:])
  last = log.strip().splitlines()[-1]
  assert last.startswith("error: ") and f"{store}://olmo3-stall/run" in last, log[-3000:]
  assert "Traceback" not in log, log[-6000:]
