"""The mirror keeper: a small process, with no CUDA context, that holds file descriptors for a log so that the
memory behind them outlives the server that made them.

A pinned log mirror (cuda/mirror.py) keeps a copy of each committed segment in host memory the GPU can read
directly (the driver's virtual memory API on the host, exported as a POSIX file descriptor). Such memory lives
as long as some process holds a descriptor for it, so it would die with a SIGKILLed server; the keeper holds one
instead. A restarted server asks the keeper for the descriptors, imports them and DMAs the pool straight from
them: no fill of a pinned ring from the tmpfs log.

The keeper knows nothing of CUDA or of the log's format: per segment it stores the name, the segment's header
bytes (the restarted server compares them with the file's before trusting the copy), the capacity, the
*mark* (the bytes known to equal the committed file bytes) and one descriptor. It listens on an abstract unix
socket named after the log directory's real path, and exits when told to (``stop_keeper``) or once the log
directory is gone. Each request is one message (JSON, descriptors as SCM_RIGHTS) and one reply.

    python -m concordia_ft.core.keeper LOG_DIR      # what ensure_keeper starts
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

MAX_MSG = 16 << 20  # a list of MAX_FDS entries with 4 KiB headers is ~2 MB of JSON
MAX_FDS = 250  # below the kernel's SCM_MAX_FD (253) per message


def keeper_address(log_dir: str | os.PathLike[str]) -> str:
    """The keeper's abstract socket name for ``log_dir`` (by its real path: two spellings share a keeper)."""
    real = os.path.realpath(os.fspath(log_dir))
    return "\0concordia-mirror-" + hashlib.sha256(real.encode()).hexdigest()[:24]


@dataclass
class Entry:
    name: str
    header: bytes
    capacity: int
    mark: int
    fd: int  # in the process that holds the entry (the keeper, or a client after ``list_entries``)


class KeeperError(ConfigError):
    """The keeper refused a request or could not be reached."""


def _send(s: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """One message: its length (4 bytes, big-endian) and JSON body; the descriptors ride on the first bytes."""
    body = json.dumps(msg).encode()
    if len(body) > MAX_MSG:
        raise KeeperError(f"mirror keeper: a message of {len(body)} bytes is over {MAX_MSG}")
    data = struct.pack(">I", len(body)) + body
    sent = socket.send_fds(s, [data], list(fds))
    if sent < len(data):
        s.sendall(data[sent:])


def _recv(s: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message (None: the peer closed first) and the descriptors that came with it."""
    data, fds, _, _ = socket.recv_fds(s, 1 << 16, MAX_FDS)
    if not data:
        return None, fds
    while len(data) < 4:
        more = s.recv(4 - len(data))
        if not more:
            return None, fds
        data += more
    (n,) = struct.unpack(">I", data[:4])
    if n > MAX_MSG:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a keeper message of {n} bytes")
    body = bytearray(data[4:])
    while len(body) < n:
        more = s.recv(min(1 << 20, n - len(body)))
        if not more:
            return None, fds
        body += more
    return json.loads(bytes(body)), fds


def _request(addr: str, msg: dict[str, Any], fds: Sequence[int] = (), timeout: float = 10.0
             ) -> tuple[dict[str, Any], list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(addr)
        _send(s, msg, fds)
        reply, got = _recv(s)
    if reply is None:
        reply = {"ok": False, "error": "the keeper closed the connection"}
    if not reply.get("ok"):
        for fd in got:
            os.close(fd)
        raise KeeperError(f"mirror keeper: {reply.get('error', 'refused')} ({msg.get('op')})")
    return reply, got


class KeeperClient:
    """Requests to the keeper of one log directory."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(log_dir)
        self.address = keeper_address(log_dir)

    def ping(self) -> int | None:
        """The keeper's pid, or None when none listens for this log."""
        try:
            reply, _ = _request(self.address, {"op": "ping"}, timeout=2.0)
        except (OSError, KeeperError):
            return None
        return int(reply["pid"])

    def put(self, name: str, header: bytes, capacity: int, fd: int, mark: int = 0) -> None:
        """Hand the keeper a descriptor for segment ``name`` (it keeps a duplicate: close yours when done).
        ``header``: what identifies the segment's file (cuda/mirror.py sends a digest of its header bytes)."""
        _request(self.address, {"op": "put", "name": name, "header": header.hex(), "capacity": int(capacity),
                                "mark": int(mark)}, [fd])

    def mark(self, name: str, mark: int) -> None:
        _request(self.address, {"op": "mark", "name": name, "mark": int(mark)})

    def drop(self, name: str) -> None:
        _request(self.address, {"op": "drop", "name": name})

    def list_entries(self) -> list[Entry]:
        """Every entry, each with a descriptor of this process's own (close them when done)."""
        reply, fds = _request(self.address, {"op": "list"})
        rows = reply["entries"]
        if len(rows) != len(fds):
            for fd in fds:
                os.close(fd)
            raise KeeperError(f"mirror keeper sent {len(fds)} descriptors for {len(rows)} entries")
        return [Entry(r["name"], bytes.fromhex(r["header"]), int(r["capacity"]), int(r["mark"]), fd)
                for r, fd in zip(rows, fds, strict=True)]

    def stop(self) -> bool:
        """Ask the keeper to exit (its descriptors close: the memory behind them is freed). False: none ran."""
        try:
            _request(self.address, {"op": "quit"}, timeout=2.0)
        except (OSError, KeeperError):
            return False
        return True


def ensure_keeper(log_dir: str | os.PathLike[str], timeout_s: float = 10.0) -> KeeperClient:
    """The keeper of ``log_dir``, started (in a session of its own, so a signal to the server's process group
    does not reach it) when none runs yet."""
    client = KeeperClient(log_dir)
    if client.ping() is not None:
        return client
    if not Path(log_dir).is_dir():
        raise KeeperError(f"{log_dir} is not a directory: a mirror keeper follows an existing log directory")
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # started through a short-lived launcher, so the keeper is nobody's child here (reparented when the launcher
    # exits): no zombie is left in this process when it exits, and no process group of ours includes it
    launcher = ("import subprocess, sys; subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, "
                "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)")
    subprocess.run([sys.executable, "-c", launcher, sys.executable, "-m", "concordia_ft.core.keeper",
                    os.fspath(log_dir)], env=env, check=False, timeout=timeout_s,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.ping() is not None:
            return client
        time.sleep(0.02)
    raise KeeperError(f"the mirror keeper for {log_dir} did not start within {timeout_s:.0f} s")


def stop_keeper(log_dir: str | os.PathLike[str]) -> bool:
    """Stop the keeper of ``log_dir`` if one runs (the mirror's memory is freed); True if one did."""
    return KeeperClient(log_dir).stop()


def serve(log_dir: str) -> int:
    """The keeper's loop (``python -m concordia_ft.core.keeper LOG_DIR``)."""
    entries: dict[str, Entry] = {}
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(keeper_address(log_dir))
    except OSError:
        return 0  # another keeper won the race for this log: it serves
    srv.listen(16)
    srv.settimeout(1.0)
    checked = time.monotonic()
    try:
        while True:
            if time.monotonic() - checked >= 1.0:
                checked = time.monotonic()
                if not os.path.isdir(log_dir):
                    return 0  # the log is gone: nothing left worth keeping
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10.0)
                try:
                    msg, fds = _recv(conn)
                    reply, out_fds, done = _handle(entries, msg or {}, fds)
                    _send(conn, reply, out_fds)
                except (OSError, ValueError, KeeperError):
                    continue  # a client that went away mid-request: the entries are as they were
                if done:
                    return 0
    finally:
        srv.close()
        for e in entries.values():
            with contextlib.suppress(OSError):
                os.close(e.fd)


def _handle(entries: dict[str, Entry], msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int], bool]:
    op = msg.get("op")
    name = str(msg.get("name", ""))
    if op == "ping":
        return {"ok": True, "pid": os.getpid(), "entries": len(entries)}, [], False
    if op == "put":
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return {"ok": False, "error": f"put needs one descriptor, got {len(fds)}"}, [], False
        old = entries.pop(name, None)
        if old is not None:
            os.close(old.fd)
        entries[name] = Entry(name, bytes.fromhex(msg["header"]), int(msg["capacity"]), int(msg.get("mark", 0)),
                              fds[0])
        return {"ok": True}, [], False
    for fd in fds:  # no other request carries descriptors
        os.close(fd)
    if op == "mark":
        e = entries.get(name)
        if e is None:
            return {"ok": False, "error": f"no entry {name!r}"}, [], False
        e.mark = int(msg["mark"])
        return {"ok": True}, [], False
    if op == "drop":
        e = entries.pop(name, None)
        if e is not None:
            os.close(e.fd)
        return {"ok": True}, [], False
    if op == "list":
        rows = list(entries.values())[:MAX_FDS]
        return ({"ok": True, "entries": [{"name": e.name, "header": e.header.hex(), "capacity": e.capacity,
                                          "mark": e.mark} for e in rows]}, [e.fd for e in rows], False)
    if op == "quit":
        return {"ok": True}, [], True
    return {"ok": False, "error": f"unknown request {op!r}"}, [], False


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m concordia_ft.core.keeper LOG_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(sys.argv[1]))
