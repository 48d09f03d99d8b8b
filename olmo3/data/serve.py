"""python -m olmo3.data.serve DIR [--port N] [--host H]: serves DIR's files over HTTP as AI2
serves its token files, so that a cluster without a bucket (or a test) reads prepared
directories, mix files and token files from this machine with `http://HOST:PORT/...`:

  python -m olmo3.data.serve data --port 8000 --host 0.0.0.0   # every interface
  python launch/main.py ... --fdl_set=data.mix='"http://HOST:8000/mine"'   # data/mine

It binds 127.0.0.1 (this machine only) unless `--host` says otherwise, and prints the URLs to
use: for an address of every interface (0.0.0.0, ::), this machine's name as others reach it.

GET with `Range: bytes=a-b` (206; every read of a remote file is one, olmo3.io.storage), HEAD
with the size, keep-alive, many requests at once. Only regular files inside DIR are served (no
listings, no symbolic link out of it), read-only, without authentication: bind it where only
the machines that should read the data reach it. `python -m http.server` is no substitute: it
ignores Range requests, and a run refuses such a server at its first request.

`RangeServer` is the same server in a thread (a test's or benchmark's), with what they need
besides: a fixed latency added to every request (a far-away host), transient failures injected
on purpose (HTTP 503 for the first k requests of each file; HTTP 500 for a random fraction of
all requests, seeded: a flaky host), Range requests ignored (a plain file server), request
counts and the most requests it served at once.

  with RangeServer(directory, latency_s=0.02) as server:
      server.url  # http://127.0.0.1:PORT ; file DIR/a/b.npy is server.url + "/a/b.npy"
"""

from __future__ import annotations

import argparse
import collections
import http.server
import os
import random
import re
import signal
import socket
import sys
import threading
import time

from olmo3 import platforms
from olmo3.data.prepare import MANIFEST_FILE

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeServer:
  """Serves `directory` on `host`:`port` (0: a free port) from a thread, between `__enter__`
  and `__exit__`."""

  def __init__(self, directory: str, latency_s: float = 0.0, fail_first: int = 0,
               honour_range: bool = True, host: str = "127.0.0.1", port: int = 0,
               error_rate: float = 0.0, seed: int = 0):
    self.directory = os.path.realpath(directory)
    self.latency_s, self.fail_first, self.honour_range = latency_s, fail_first, honour_range
    self.error_rate, self._errors = error_rate, random.Random(seed)
    self.errors_injected = 0  # requests answered 500 for `error_rate`
    self.requests: collections.Counter[str] = collections.Counter()  # "GET /a.npy" -> count
    self.in_flight = self.max_in_flight = 0  # requests being served: now, and at most at once
    self._lock = threading.Lock()
    server = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections, as with a CDN

      def log_message(self, *args):  # quiet
        pass

      def _file(self) -> str | None:
        rel = self.path.split("?", 1)[0].lstrip("/")
        path = os.path.realpath(os.path.join(server.directory, rel))
        ok = path.startswith(server.directory + os.sep) and os.path.isfile(path)
        return path if ok else None

      def _count(self) -> int:
        with server._lock:
          server.requests[f"{self.command} {self.path}"] += 1
          return server.requests[f"{self.command} {self.path}"]

      def _reply(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in headers.items():
          self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD" and body:
          self.wfile.write(body)

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
        n = self._count()
        if n <= server.fail_first:
          self._reply(503, {"Content-Length": "0", "Retry-After": "0"})
          return
        if server.error_rate and server._fails():
          self._reply(500, {"Content-Length": "0"})
          return
        path = self._file()
        if path is None:
          self._reply(404, {"Content-Length": "0"})
          return
        size = os.path.getsize(path)
        match = _RANGE.match(self.headers.get("Range", ""))
        if match and server.honour_range and self.command == "GET":
          start = int(match[1])
          end = min(int(match[2]) + 1 if match[2] else size, size)
          if start >= size or start >= end:
            self._reply(416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"})
            return
          with open(path, "rb") as f:
            f.seek(start)
            body = f.read(end - start)
          self._reply(206, {"Content-Length": str(len(body)), "Accept-Ranges": "bytes",
                            "Content-Range": f"bytes {start}-{end - 1}/{size}",
                            "Content-Type": "application/octet-stream"}, body)
          return
        body = b""
        if self.command == "GET":
          with open(path, "rb") as f:
            body = f.read()
        self._reply(200, {"Content-Length": str(size), "Content-Type": "application/octet-stream",
                          **({"Accept-Ranges": "bytes"} if server.honour_range else {})}, body)

      do_GET = do_HEAD = _serve  # noqa: N815

    class Server(http.server.ThreadingHTTPServer):
      request_queue_size = 1024  # the default listen backlog (5) stalls concurrent clients 1 s
      address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
      daemon_threads = True

      def handle_error(self, request, client_address):  # a client that hung up: not news
        pass

    self._server = Server((host, port), Handler)
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

  @property
  def url(self) -> str:
    """The server's URL as other machines name it (this host's name when bound to all
    interfaces)."""
    host, port = self._server.server_address[:2]
    if host in ("0.0.0.0", "::"):
      host = public_name()
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"

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

  def __enter__(self) -> RangeServer:
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._server.shutdown()
    self._server.server_close()
    self._thread.join()


def public_name() -> str:
  """This machine's name as other machines reach it: its host name, or, where that is only a
  loopback name, the address of the interface that routes outwards. Why not socket.getfqdn():
  where the host name resolves to 127.0.0.1 (many containers and VMs) it says "localhost",
  which on every other machine means that machine."""
  for name in (socket.gethostname(), socket.getfqdn()):
    if name and not name.startswith("localhost") and not name.startswith("127."):
      return name
  try:  # the source address of a route outwards; a UDP "connection" sends nothing
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      s.connect(("10.255.255.255", 1))
      return s.getsockname()[0]
  except OSError:
    return socket.gethostname()


def announcement(directory: str, url: str) -> list[str]:
  """What the command prints once serving: where, and the mix setting of each prepared
  directory directly inside `directory`."""
  lines = [f"serving {os.path.abspath(directory)} at {url} (Ctrl-C stops it)"]
  for name in sorted(os.listdir(directory)):
    if os.path.isfile(os.path.join(directory, name, MANIFEST_FILE)):
      lines.append(f"  prepared directory {name}: --fdl_set=data.mix='\"{url}/{name}\"'")
  return lines


def main(argv: list[str] | None = None) -> int:
  platforms.choose()  # first, as every program (tests/test_imports.py): no TPU probing
  parser = argparse.ArgumentParser(prog="python -m olmo3.data.serve", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("directory", metavar="DIR", help="the directory whose files are served")
  parser.add_argument("--port", type=int, default=8000, help="0: any free port")
  parser.add_argument("--host", default="127.0.0.1",
                      help="the address to bind (default: this machine only; 0.0.0.0: every "
                      "interface, for the machines of a cluster)")
  args = parser.parse_args(argv)
  directory = args.directory
  if not os.path.isdir(directory):
    print(f"error: {directory} is not a directory", file=sys.stderr)
    return 2
  if os.path.isfile(os.path.join(directory, MANIFEST_FILE)):
    # Its URL would be the server's root, which has no name to label its source with.
    print(f"error: {directory} is a prepared directory: serve the directory it is in "
          f"({os.path.dirname(os.path.abspath(directory))}), so that its URL ends with its "
          "name, the label of its source", file=sys.stderr)
    return 2
  try:
    server = RangeServer(directory, host=args.host, port=args.port)
  except OSError as e:  # the port is taken, the address not this machine's
    print(f"error: cannot serve on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
    return 2
  # Ctrl-C must land in this thread: the kernel hands a process's signal to any thread that
  # does not block it, and one taken by the serving thread left this one waiting for good
  # (one stop in three hung). The server's threads inherit the mask they start with.
  # A parent may hand down SIGINT blocked or ignored (both survive exec): this program's way to
  # stop is Ctrl-C, so it takes SIGINT whatever it was given.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  with server:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # the serving thread started
    try:
      print("\n".join(announcement(directory, server.url)), flush=True)
      # Waits in short slices: a signal taken by a thread a library started before the mask
      # above still runs its Python handler here within half a second (an untimed wait would
      # sleep on, as one suite run saw).
      while True:
        time.sleep(0.5)
    except KeyboardInterrupt:  # Ctrl-C: the way to stop it
      pass
  return 0


if __name__ == "__main__":
  sys.exit(main())
