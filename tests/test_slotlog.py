"""The C token-epoch writer (core/_slotlog.c) on CPU, against the Python path: CRC32C equals the crc32c package
(SSE4.2 and the table fallback), the epochs it writes are byte-identical to RecoveryLog.append of the same deltas
and metadata (mapped DRAM and file segments), it rolls segments, syncs per policy, reports failures as
CheckpointError with the log still usable, and SIGKILLed writers leave a log that replays (torn tail cut) with
every reported commit in it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import slotlog_helpers as H
from concordia_ft.core import slotlog
from concordia_ft.core.log import RecoveryLog
from concordia_ft.core.replay import Outcome, replay
from concordia_ft.errors import CheckpointError, ConfigError
from support import PYTHON, REPO, subprocess_env

pytestmark = pytest.mark.skipif(not slotlog.available(), reason=f"C writer: {slotlog.status()}")

S = slotlog.SENTINELS
COUNTS = {slotlog.HOLE_N_TOKENS: 1, slotlog.HOLE_N_NEW: 1, slotlog.HOLE_DONE: 1, slotlog.HOLE_LENGTH: 3}


def _template(with_time: bool = False) -> tuple[list[bytes], list[int]]:
    t = S[slotlog.HOLE_TIME] if with_time else 1.5
    counts = {**COUNTS, **({slotlog.HOLE_TIME: 1} if with_time else {})}
    tm = slotlog.meta_template(H.meta(S[0], S[1], S[2], S[3], t=t), counts)  # type: ignore[arg-type]
    assert tm is not None
    return tm


@pytest.mark.parametrize("impl", ["sse4.2", "table"])
def test_crc32c_matches_the_package(impl: str) -> None:
    code = ("import sys, numpy as np, crc32c; from concordia_ft.core import checksums\n"
            f"assert checksums.native_status() == 'c (crc32c: {impl})', checksums.native_status()\n"
            "rng = np.random.default_rng(3)\n"
            "buf = rng.integers(0, 256, 70000, dtype=np.uint8).tobytes()\n"
            "for n in (0, 1, 7, 8, 9, 31, 32, 33, 4096, 65537):\n"
            "    for off in (0, 1, 3, 8):\n"
            "        b = buf[off:off + n]\n"
            "        assert checksums.crc32c_native(b) == crc32c.crc32c(b), (n, off)\n"
            "        assert checksums.crc32c_native(b, 0x1234567) == crc32c.crc32c(b, 0x1234567), (n, off)\n"
            "print('ok')\n")
    env = subprocess_env()
    if impl == "table":
        env["CONCORDIA_CRC_TABLE"] = "1"
    elif "sse4_2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no SSE4.2 on this CPU")
    p = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr


def test_meta_template_refuses_what_it_cannot_fill() -> None:
    assert _template()[1] == [0, 3, 3, 3, 1, 2] or sorted(_template()[1]) == [0, 1, 2, 3, 3, 3]
    doc = H.meta(S[0], S[1], S[2], S[3])
    doc["session"]["name"] = f"{S[0]}"  # the sentinel inside a string: not a hole
    assert slotlog.meta_template(doc, COUNTS) is None
    assert slotlog.meta_template(H.meta(S[0], 5, S[2], S[3]), COUNTS) is None  # n_new missing


def _run(log: RecoveryLog, n_steps: int, *, n_slots: int = 6, template: tuple[list[bytes], list[int]] | None = None,
         start_row: int = 0) -> tuple[H.FakeRing, np.ndarray]:
    kv, tok = H.specs()
    arena = np.zeros(kv.nbytes, np.uint8)
    image = np.zeros(tok.nbytes // 8, np.int64)
    ring = H.FakeRing(n_slots, arena)
    w = slotlog.SlotLogWriter(log, ring_address=ring.address, n_slots=n_slots, slot_bytes=ring.slot_bytes,
                              slot_header=H.SLOT_HEADER, max_pages=H.max_pages(), kv=kv, tokens_image=image,
                              tokens=tok, meta=template or _template())
    assert not w.reached(0)  # nothing submitted: nothing committed
    for i in range(n_steps):
        row = start_row + i
        if i >= n_slots:
            w.wait(i - n_slots)
        H.step(arena, row)
        ring.fill(i, row, 1000 + row)
        w.submit(i, row + 1, i + 1, i == n_steps - 1)
    w.wait(n_steps - 1)
    assert w.reached(n_steps - 1) and not w.reached(n_steps)
    assert log.last_epoch == w.stats()[-1, 5]  # the log sees what committed while its tail is leased
    w.stop()
    st = w.stats()
    assert st.shape == (n_steps, 6) and list(st[:, 0]) == list(range(n_steps))
    assert (st[:, 3] >= st[:, 2]).all() and (st[:, 2] >= st[:, 1]).all()
    return ring, arena


def _reference(log: RecoveryLog, n_steps: int, n_slots: int = 6) -> np.ndarray:
    """The same steps appended by RecoveryLog.append (what the Python writer does)."""
    kv, tok = H.specs()
    arena = np.zeros(kv.nbytes, np.uint8)
    image = np.zeros(tok.nbytes // 8, np.int64)
    ring = H.FakeRing(n_slots, arena)
    for i in range(n_steps):
        H.step(arena, i)
        ring.fill(i, i, 1000 + i)
        deltas = H.reference_deltas(kv, tok, ring, i, image, i + 1)
        log.append(deltas=deltas, meta=H.meta(i + 1, i + 1, i == n_steps - 1, i + 1))
    return arena


def _open(d: Path, backend: str, **kw: object) -> RecoveryLog:
    kv, tok = H.specs()
    log = RecoveryLog.open(d, {"backend": backend, "fsync": kw.pop("fsync", "never"), **kw})
    log.append(defs=[kv, tok])
    return log


def _epoch_bytes(d: Path) -> bytes:
    seg = sorted(p for p in d.iterdir() if p.name.endswith(".cft"))
    assert len(seg) == 1, seg
    raw = seg[0].read_bytes()[4096:]
    return raw.rstrip(b"\0")


@pytest.mark.parametrize("backend", ["dram", "file"])
def test_c_writer_writes_the_bytes_append_writes(tmp_path: Path, backend: str) -> None:
    root = Path("/dev/shm") if backend == "dram" else tmp_path
    a, b = Path(os.path.join(root, f"cft-slot-a-{os.getpid()}")), Path(os.path.join(root, f"cft-slot-b-{os.getpid()}"))
    try:
        la, lb = _open(a, backend), _open(b, backend)
        _run(la, 40)
        _reference(lb, 40)
        assert la.last_epoch == lb.last_epoch == 41
        # the log took the leased tail over: it appends after it
        la.append(meta={"after": 1})
        lb.append(meta={"after": 1})
        la.close()
        lb.close()
        assert _epoch_bytes(a) == _epoch_bytes(b)
        ra, rb = replay(a), replay(b)
        assert ra.outcome is rb.outcome is Outcome.OK and ra.epoch == 42
        for name in ("kv", "tokens"):
            assert np.array_equal(ra.regions[name].data, rb.regions[name].data)
        ra.close()
        rb.close()
    finally:
        import shutil

        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)


@pytest.mark.parametrize("backend,fsync", [("dram", "never"), ("file", "always"), ("file", "interval")])
def test_c_writer_rolls_segments_and_syncs(tmp_path: Path, backend: str, fsync: str) -> None:
    d = (Path("/dev/shm") if backend == "dram" else tmp_path) / f"cft-slot-roll-{os.getpid()}"
    try:
        # 1 MiB segments (mapped) / segment_max_bytes 1 MiB (file): 36 KiB epochs roll ~every 28
        log = _open(d, backend, fsync=fsync, mapped_segment_bytes=1 << 20, segment_max_bytes=1 << 20,
                    fsync_interval_ms=5)
        _, arena = _run(log, 120, template=_template(with_time=True))
        assert len(log.manifest.incr) >= 4
        if fsync == "always":
            assert log._durable_epoch == log.last_epoch == 121
        log.close()
        r = replay(d)
        assert r.outcome is Outcome.OK and r.epoch == 121
        kv = r.regions["kv"].data
        assert np.array_equal(kv[: 120 * H.ROW_BYTES], arena[: 120 * H.ROW_BYTES])
        assert list(r.regions["tokens"].data.view(np.int64)[:120]) == [1000 + i for i in range(120)]
        assert r.meta["session"]["n_tokens"] == 120 and r.meta["session"]["gen"]["done"] is True
        assert isinstance(r.meta["session"]["t"], float) and abs(r.meta["session"]["t"] - time.time()) < 600
        r.close()
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def test_a_bad_slot_fails_the_step_not_the_log(tmp_path: Path) -> None:
    kv, tok = H.specs()
    log = _open(tmp_path / "log", "file")
    arena = np.zeros(kv.nbytes, np.uint8)
    image = np.zeros(tok.nbytes // 8, np.int64)
    ring = H.FakeRing(4, arena)
    w = slotlog.SlotLogWriter(log, ring_address=ring.address, n_slots=4, slot_bytes=ring.slot_bytes,
                              slot_header=H.SLOT_HEADER, max_pages=H.max_pages(), kv=kv, tokens_image=image,
                              tokens=tok, meta=_template())
    with pytest.raises(ConfigError, match="graph decode"):
        log.append(meta={"x": 1})  # leased
    H.step(arena, 0)
    ring.fill(0, 0, 1000)
    w.submit(0, 1, 1, False)
    w.submit(1, 2, 2, False)  # slot 1 never filled
    with pytest.raises(CheckpointError, match="does not hold it"):
        w.wait(1)
    with pytest.raises(CheckpointError):
        w.stop()
    assert log.last_epoch == 2 and log.failed is None
    log.append(meta={"after": 1})  # the lease is over; epoch 3 is free
    log.close()
    r = replay(tmp_path / "log")
    assert r.outcome is Outcome.OK and r.epoch == 3
    r.close()


def test_c_writer_refuses_a_log_it_cannot_lease(tmp_path: Path) -> None:
    from faults import FaultyOS  # injected OS calls: only the Python writer goes through them

    kv, tok = H.specs()
    log = RecoveryLog.open(tmp_path / "log", {"backend": "file"}, io=FaultyOS())
    with pytest.raises(ConfigError, match="cannot be leased"):
        slotlog.SlotLogWriter(log, ring_address=1 << 20, n_slots=4, slot_bytes=H.SLOT_HEADER + H.max_pages() * 4096,
                              slot_header=H.SLOT_HEADER, max_pages=H.max_pages(), kv=kv,
                              tokens_image=np.zeros(256, np.int64), tokens=tok, meta=_template())
    log.append(defs=[kv, tok])  # not leased
    log.close()


def test_compaction_waits_for_the_lease(tmp_path: Path) -> None:
    log = _open(tmp_path / "log", "file")
    lease = log.lease_tail()
    assert lease is not None and log.lease_tail() is None
    sealed: list[list[str]] = []
    t = threading.Thread(target=lambda: sealed.append(log.seal_for_compaction()))
    t.start()
    time.sleep(0.2)
    assert not sealed  # waiting
    log.end_lease({"next_epoch": lease.next_epoch, "end": lease.end, "segment_epochs": lease.segment_epochs,
                   "synced_end": lease.synced_end, "durable_epoch": lease.durable_epoch})
    t.join(5)
    assert sealed and len(sealed[0]) == 1
    log.close()


@pytest.mark.parametrize("backend", ["dram", "file"])
def test_sigkilled_c_writers_leave_a_log_that_replays(tmp_path: Path, backend: str) -> None:
    """Writers SIGKILLed mid-stream, each reopening the log the last one left: replay never raises, holds
    every step a writer printed as committed, and the KV rows and token ids are exactly what was written."""
    d = (Path("/dev/shm") if backend == "dram" else tmp_path) / f"cft-slot-kill-{os.getpid()}"
    helper = str(REPO / "tests" / "slotlog_helpers.py")
    rng = np.random.default_rng(5)
    reported = 0
    try:
        for k in range(6):
            p = subprocess.Popen([PYTHON, helper, "child", str(d), backend, "400"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=subprocess_env())
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.startswith("OPEN"), (line, p.stderr.read() if p.stderr else "")
            # Killed after a random number of its commits (the child runs on meanwhile) plus up to 5 ms, so
            # every writer dies mid-stream however loaded the machine: a delay from OPEN alone can kill a
            # slow child before its first commit, every time.
            for _ in range(int(rng.integers(1, 30))):
                ln = p.stdout.readline()
                if not ln.startswith("COMMITTED "):
                    break  # DONE: the arena is full
                reported = max(reported, int(ln.split()[1]))
            time.sleep(float(rng.uniform(0.0, 0.005)))
            p.send_signal(signal.SIGKILL)
            out, err = p.communicate(timeout=60)
            for ln in out.split("\n")[:-1]:  # whole lines only: the kill may cut the last one short
                if ln.startswith("COMMITTED "):
                    reported = max(reported, int(ln.split()[1]))
            assert p.returncode in (-signal.SIGKILL, 0), err
            r = replay(d)
            assert r.outcome in (Outcome.OK, Outcome.TORN_TAIL), r.outcome
            n = int(r.meta["session"]["n_tokens"]) if r.meta else 0
            assert n >= reported, (k, n, reported)
            kv = r.regions["kv"].data
            for row in range(n):
                assert np.array_equal(kv[row * H.ROW_BYTES:(row + 1) * H.ROW_BYTES], H.row_bytes(row)), row
            assert list(r.regions["tokens"].data.view(np.int64)[:n]) == [1000 + i for i in range(n)]
            r.close()
            if n >= H.N_ROWS - 2:
                break
        assert reported > 0
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
