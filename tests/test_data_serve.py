"""python -m olmo3.data.serve as a user starts it: the address it binds and the URLs it prints
agree (this machine only by default; `--host 0.0.0.0` prints a name other machines can use)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from olmo3.data import serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sigint_blocked_and_ignored() -> None:
  """What a parent may hand down (a test worker did, and Ctrl-C then never stopped the server)."""
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  signal.signal(signal.SIGINT, signal.SIG_IGN)


def _serving(directory, *flags: str, parent_blocks_sigint: bool = False
             ) -> tuple[subprocess.Popen, list[str]]:
  """The server started, and what it printed before serving (its announcement)."""
  proc = subprocess.Popen([sys.executable, "-m", "olmo3.data.serve", str(directory), "--port",
                           "0", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT,
                          preexec_fn=_sigint_blocked_and_ignored if parent_blocks_sigint else None)
  lines = [proc.stdout.readline().rstrip("\n")]
  lines.append(proc.stdout.readline().rstrip("\n"))  # the prepared directory's line
  return proc, lines


def _stop(proc: subprocess.Popen) -> None:
  proc.send_signal(signal.SIGINT)  # Ctrl-C, the documented way to stop it
  assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]


def _reaches(host: str, port: int) -> bool:
  try:
    socket.create_connection((host, port), timeout=5).close()
    return True
  except OSError:
    return False


@pytest.mark.slow(seconds=4)
def test_serve_binds_this_machine_by_default_and_prints_the_address_it_binds(tmp_path):
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "manifest.json").write_text("{}")
  proc, lines = _serving(tmp_path)
  try:
    url = lines[0].split(" at ", 1)[1].split(" ", 1)[0]
    parsed = urllib.parse.urlsplit(url)
    assert parsed.hostname == "127.0.0.1", lines  # before: every interface, "localhost" printed
    assert lines[1] == f"  prepared directory mine: --fdl_set=data.mix='\"{url}/mine\"'"
    with urllib.request.urlopen(f"{url}/mine/manifest.json", timeout=10) as reply:
      assert reply.read() == b"{}"  # the printed URL serves
    # Another loopback address is another interface: not served (it was, bound to 0.0.0.0).
    assert not _reaches("127.0.0.2", parsed.port)
  finally:
    _stop(proc)
  # --host 0.0.0.0: every interface, and the URL names this machine as others reach it; and
  # Ctrl-C stops it whatever SIGINT's state in the parent that started it.
  proc, lines = _serving(tmp_path, "--host", "0.0.0.0", parent_blocks_sigint=True)
  try:
    parsed = urllib.parse.urlsplit(lines[0].split(" at ", 1)[1].split(" ", 1)[0])
    assert parsed.hostname == serve.public_name(), lines
    assert parsed.hostname != "localhost" and not parsed.hostname.startswith("127."), lines
    assert _reaches("127.0.0.2", parsed.port)
  finally:
    _stop(proc)


def test_this_machine_s_public_name_is_never_a_loopback_name():
  name = serve.public_name()
  assert name and name != "localhost" and not name.startswith("127."), name


def _rss_mib(pid: int) -> float:
  with open(f"/proc/{pid}/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.slow(seconds=4)
def test_unread_large_responses_are_not_held_in_memory(tmp_path):
  """Four GETs of a 256 MiB file (whole, and a 256 MiB range) that their clients never read:
  the server streams each from the file, so its memory grows by a socket's buffers, not by
  1 GiB (it read each response whole into memory first: 46 -> 1,070 MiB)."""
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "manifest.json").write_text("{}")
  big = tmp_path / "mine" / "big.npy"
  with open(big, "wb") as f:
    f.truncate(256 << 20)  # sparse: costs no disk
  proc, lines = _serving(tmp_path)
  clients = []
  try:
    port = urllib.parse.urlsplit(lines[0].split(" at ", 1)[1].split(" ", 1)[0]).port
    before = _rss_mib(proc.pid)
    for request in ("GET /mine/big.npy HTTP/1.1\r\nHost: x\r\n\r\n",
                    f"GET /mine/big.npy HTTP/1.1\r\nHost: x\r\nRange: bytes=0-{(256 << 20) - 1}"
                    "\r\n\r\n") * 2:
      client = socket.create_connection(("127.0.0.1", port), timeout=10)
      client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
      client.sendall(request.encode())
      assert client.recv(12).startswith(b"HTTP/1.1 20")  # answered, its body left unread
      clients.append(client)
    time.sleep(1.0)  # what the server would read ahead, it has read by now
    grown = _rss_mib(proc.pid) - before
    assert grown < 64, f"the server grew by {grown:.0f} MiB for four unread responses"
  finally:
    for client in clients:
      client.close()
    _stop(proc)
