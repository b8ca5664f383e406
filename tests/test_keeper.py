"""The mirror keeper (core/keeper.py): a process without CUDA that holds a log's descriptors across the death of
the server that made them. Real processes and real descriptors (memfd here; the driver's exported host memory on
a GPU, tests/gpu/test_mirror_gpu.py): the writer is SIGKILLed, a new process gets the same bytes back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from concordia_ft.core.keeper import KeeperClient, KeeperError, ensure_keeper, keeper_address, stop_keeper
from support import REPO

WRITER = textwrap.dedent("""
    import os, sys, time
    from concordia_ft.core.keeper import ensure_keeper
    log_dir, payload = sys.argv[1], bytes.fromhex(sys.argv[2])
    k = ensure_keeper(log_dir)
    for i in range(3):
        fd = os.memfd_create(f"seg{i}")
        os.ftruncate(fd, 1 << 16)
        os.pwrite(fd, payload + bytes([i]), 0)
        k.put(f"incr.{i:06d}.cft", bytes([i]) * 64, 1 << 16, fd, mark=len(payload) + 1)
        os.close(fd)
    k.drop("incr.000001.cft")
    k.mark("incr.000002.cft", 7)
    print("READY", flush=True)
    time.sleep(600)
""")


@pytest.fixture()
def log_dir(tmp_path: Path):  # type: ignore[no-untyped-def]
    d = tmp_path / "log"
    d.mkdir()
    yield d
    stop_keeper(d)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_descriptors_outlive_a_sigkilled_writer_and_come_back_byte_for_byte(log_dir: Path) -> None:
    payload = os.urandom(4096)
    w = subprocess.Popen([sys.executable, "-c", WRITER, str(log_dir), payload.hex()], stdout=subprocess.PIPE,
                         text=True, env=_env())
    assert w.stdout is not None
    assert w.stdout.readline().strip() == "READY"
    os.kill(w.pid, signal.SIGKILL)
    assert w.wait() == -signal.SIGKILL
    client = KeeperClient(log_dir)
    pid = client.ping()
    assert pid is not None and pid != w.pid
    entries = {e.name: e for e in client.list_entries()}
    try:
        assert sorted(entries) == ["incr.000000.cft", "incr.000002.cft"]  # 1 was dropped
        for i in (0, 2):
            e = entries[f"incr.{i:06d}.cft"]
            assert os.pread(e.fd, len(payload) + 1, 0) == payload + bytes([i])
            assert e.header == bytes([i]) * 64 and e.capacity == 1 << 16
        assert entries["incr.000000.cft"].mark == len(payload) + 1
        assert entries["incr.000002.cft"].mark == 7
    finally:
        for e in entries.values():
            os.close(e.fd)
    # a second client gets its own descriptors again: the keeper still holds them
    again = client.list_entries()
    assert len(again) == 2
    for e in again:
        os.close(e.fd)
    assert stop_keeper(log_dir)
    assert client.ping() is None


def test_ensure_keeper_reuses_the_running_keeper_and_refuses_a_missing_dir(log_dir: Path, tmp_path: Path) -> None:
    a = ensure_keeper(log_dir).ping()
    b = ensure_keeper(str(log_dir) + "/").ping()  # another spelling of the same directory
    assert a is not None and a == b
    assert keeper_address(log_dir) == keeper_address(str(log_dir) + "/.")
    with pytest.raises(KeeperError, match="not a directory"):
        ensure_keeper(tmp_path / "missing")


def test_the_keeper_refuses_bad_requests_and_exits_when_its_log_is_gone(log_dir: Path) -> None:
    client = ensure_keeper(log_dir)
    with pytest.raises(KeeperError, match="no entry"):
        client.mark("incr.000009.cft", 3)
    r, w = os.pipe()
    try:
        with pytest.raises(KeeperError, match="unknown request"):
            from concordia_ft.core.keeper import _request

            _request(client.address, {"op": "nonsense"}, [r])
    finally:
        os.close(r)
        os.close(w)
    assert client.list_entries() == []
    pid = client.ping()
    assert pid is not None
    log_dir.rmdir()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and client.ping() is not None:
        time.sleep(0.1)
    assert client.ping() is None  # it exited: nothing listens on its address any more


def test_a_list_larger_than_one_socket_read_arrives_whole(log_dir: Path) -> None:
    """A log of many segments: the keeper's answer spans many reads of the socket (the bench's 8B log broke an
    unframed first version at 33 kB)."""
    client = ensure_keeper(log_dir)
    n = 120
    for i in range(n):
        fd = os.memfd_create(f"s{i}")
        os.pwrite(fd, bytes([i]), 0)
        client.put(f"incr.{i:06d}.cft", os.urandom(4096), 1 << 21, fd, mark=i)  # 8 kB of hex each
        os.close(fd)
    entries = client.list_entries()
    try:
        assert [e.name for e in entries] == [f"incr.{i:06d}.cft" for i in range(n)]
        assert [e.mark for e in entries] == list(range(n))
        assert all(os.pread(e.fd, 1, 0) == bytes([i]) for i, e in enumerate(entries))
    finally:
        for e in entries:
            os.close(e.fd)
