"""A local HTTP server for token files, as AI2 serves them: GET with `Range: bytes=a-b` (206),
HEAD with the size, keep-alive; plus what a test or benchmark of remote reading needs: a fixed
latency added to every request (a far-away host), transient failures injected on purpose
(HTTP 503 for the first k requests of each file), request counts and the most requests it
served at once.

Used by tests/test_storage.py and benchmarks/data_loader.py. Binds 127.0.0.1 only.

  with RangeServer(directory, latency_s=0.02) as server:
      server.url  # http://127.0.0.1:PORT ; file DIR/a/b.npy is server.url + "/a/b.npy"
"""

from __future__ import annotations

import collections
import http.server
import os
import re
import threading
import time

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeServer:
  def __init__(self, directory: str, latency_s: float = 0.0, fail_first: int = 0,
               honour_range: bool = True):
    self.directory = os.path.abspath(directory)
    self.latency_s, self.fail_first, self.honour_range = latency_s, fail_first, honour_range
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
      daemon_threads = True

      def handle_error(self, request, client_address):  # a client that hung up: not news
        pass

    self._server = Server(("127.0.0.1", 0), Handler)
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self._server.server_address[1]}"

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
