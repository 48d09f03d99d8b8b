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

`RangeServer` is the same server in a thread (the command's, a test's or a benchmark's; the
tests' and benchmarks' latency, injected failures and request counts are a subclass of theirs,
harness/storage_servers.py's `InstrumentedRangeServer`):

  with RangeServer(directory) as server:
      server.url  # http://127.0.0.1:PORT ; file DIR/a/b.npy is server.url + "/a/b.npy"
"""

from __future__ import annotations

import dataclasses
import http.server
import os
import re
import signal
import socket
import sys
import threading
import time

from olmo3 import program
from olmo3.data.manifest import MANIFEST_FILE

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclasses.dataclass(frozen=True)
class Span:
  """The bytes a response carries: `length` bytes of the file `path` from `start`."""
  path: str
  start: int
  length: int


class RangeServer:
  """Serves `directory` on `host`:`port` (0: a free port) from a thread, between `__enter__`
  and `__exit__`."""

  def __init__(self, directory: str, host: str = "127.0.0.1", port: int = 0):
    self.directory = os.path.realpath(directory)

    class Server(http.server.ThreadingHTTPServer):
      request_queue_size = 1024  # the default listen backlog (5) stalls concurrent clients 1 s
      address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
      daemon_threads = True

      def handle_error(self, request, client_address):  # a client that hung up: not news
        pass

    self._server = Server((host, port), self.handler())
    # Polled for shutdown 20 times a second (the default, twice a second, held every
    # stop, a test's or Ctrl-C's, for up to half a second).
    self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                    daemon=True)

  def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
    """The request handler class (a subclass may extend its `_serve` and `_reply`)."""
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

      def _reply(self, status: int, headers: dict[str, str], body: Span | None = None
                 ) -> None:
        self.send_response(status)
        for k, v in headers.items():
          self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD" and body is not None and body.length:
          # Streamed from the file (sendfile where the system has it): a response is never
          # held in memory whole, so unread large GETs cost a socket's buffers, not their size.
          with open(body.path, "rb") as f:
            self.connection.sendfile(f, body.start, body.length)

      def _serve(self) -> None:
        path = self._file()
        if path is None:
          self._reply(404, {"Content-Length": "0"})
          return
        size = os.path.getsize(path)
        match = _RANGE.match(self.headers.get("Range", ""))
        if match and self.command == "GET":
          start = int(match[1])
          end = min(int(match[2]) + 1 if match[2] else size, size)
          if start >= size or start >= end:
            self._reply(416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"})
            return
          self._reply(206, {"Content-Length": str(end - start), "Accept-Ranges": "bytes",
                            "Content-Range": f"bytes {start}-{end - 1}/{size}",
                            "Content-Type": "application/octet-stream"},
                      Span(path, start, end - start))
          return
        self._reply(200, {"Content-Length": str(size), "Content-Type": "application/octet-stream",
                          "Accept-Ranges": "bytes"}, Span(path, 0, size))

      def do_GET(self) -> None:  # noqa: N802
        self._serve()

      do_HEAD = do_GET  # noqa: N815

    return Handler

  @property
  def url(self) -> str:
    """The server's URL as other machines name it (this host's name when bound to all
    interfaces)."""
    host, port = self._server.server_address[:2]
    if host in ("0.0.0.0", "::"):
      host = public_name()
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"

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
  parser = program.parser("python -m olmo3.data.serve", __doc__)
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
