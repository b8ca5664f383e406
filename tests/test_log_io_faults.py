"""I/O errors injected UNDER the log (``faults.FaultyOS``, the writer's table of OS calls): every call of a
checkpoint (write, pwritev, fdatasync, fsync, ftruncate, rename, close, open, unlink, msync; segment rollover
and the manifest write included) fails in turn, with EIO and ENOSPC, once or until the fault clears.

Checked against a model of what each checkpoint was given (each attempt's metadata names its exact bytes):
no epoch that ``checkpoint()`` returned is ever lost; what is recovered is exactly one attempt's state, never a
mixture; the failing call raises ``CheckpointError`` (never a bare ``OSError``); the log stays readable by
``recover()``, in this process and in a fresh one; after the fault clears, the same Runtime (or, when the log
failed, a reopened one) goes on with consecutive epoch numbers. core/DESIGN.md, "When a write or a sync
fails", is the contract these tests hold the writer to.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import concordia_ft as cft
from concordia_ft.core.log import RecoveryLog
from concordia_ft.core.regions import RegionKind, RegionSpec
from concordia_ft.core.tracking import RegionDelta
from concordia_ft.errors import CheckpointError
from faults import FaultyOS
from support import PYTHON, subprocess_env

PAGE = 4096
BIG = 384 * 1024  # a dense region this size makes the third epoch roll over into a new 1 MiB segment
FOREVER = 1 << 30


class Workload:
    """Registered host buffers changed at random between checkpoints; ``attempts`` maps each checkpoint
    attempt's id (its metadata) to the exact bytes it was given."""

    def __init__(self, seed: int, roll: bool) -> None:
        self.rng = np.random.default_rng(seed)
        self.arrays = {"opq": np.zeros(10 * PAGE + 100, np.uint8), "kv": np.zeros(4 * 2 * PAGE, np.uint8),
                       "dense": np.zeros(3 * PAGE, np.uint8)}
        if roll:
            self.arrays["big"] = np.zeros(BIG, np.uint8)
        self.flags = np.zeros(4, np.uint8)
        self.attempts: dict[int, dict[str, bytes]] = {}

    def open(self, path: Path, io: FaultyOS | None, fsync: str = "always", backend: str = "file",
             interval_ms: int = 100) -> cft.Runtime:
        rt = cft.Runtime(path, fsync=fsync, backend=backend, page_bytes=PAGE, segment_max_bytes=1 << 20,
                         compact_after_bytes=None, fsync_interval_ms=interval_ms, log_io=io)
        rt.register("opq", self.arrays["opq"], "opaque")
        rt.register("kv", self.arrays["kv"], "paged", block_bytes=2 * PAGE, dirty_blocks=self.flags)
        rt.register("dense", self.arrays["dense"], "dense")
        if "big" in self.arrays:
            rt.register("big", self.arrays["big"], "dense")
        return rt

    def change(self) -> None:
        a, rng = self.arrays, self.rng
        for i in rng.integers(0, a["opq"].size, 3):
            a["opq"][i] ^= np.uint8(int(rng.integers(1, 256)))
        block = int(rng.integers(0, 4))
        a["kv"][block * 2 * PAGE : (block + 1) * 2 * PAGE] = rng.integers(0, 256, 2 * PAGE, dtype=np.uint8)
        self.flags[block] = 1
        a["dense"][:] = rng.integers(0, 256, a["dense"].size, dtype=np.uint8)
        if "big" in a:
            a["big"][rng.integers(0, BIG, 8)] = rng.integers(0, 256, 8, dtype=np.uint8)

    def attempt(self) -> dict[str, int]:
        """Metadata naming this checkpoint attempt; records the bytes it is given."""
        key = len(self.attempts) + 1
        self.attempts[key] = {n: a.tobytes() for n, a in self.arrays.items()}
        return {"attempt": key}

    def state(self) -> dict[str, bytes]:
        return {n: a.tobytes() for n, a in self.arrays.items()}


@dataclass
class Outcome:
    calls: int  # counted OS calls the faulted checkpoint made (the failing one included)
    error: CheckpointError | None
    committed: dict[int, int] = field(default_factory=dict)  # epoch -> attempt, for every epoch returned
    ops: list[str] = field(default_factory=list)  # the counted calls, in order


def _checkpoint(rt: cft.Runtime, meta: dict[str, int], mode: str) -> int:
    if mode == "async":
        return rt.checkpoint_async(meta).wait()
    return rt.checkpoint(meta)


def _check_recovered(path: Path, w: Workload, committed: dict[int, int], maybe: tuple[int, int] | None) -> int:
    """recover() returns the last returned epoch exactly, or (only when ``maybe``: the log failed with that
    epoch's fate unknown) that epoch's attempt exactly. Returns the recovered epoch."""
    rec = cft.recover(path)
    last = max(committed)
    attempt = rec.meta["attempt"]
    if maybe is not None and rec.epoch == maybe[0]:
        assert attempt == maybe[1]
    else:
        assert rec.epoch == last, (rec.epoch, last, maybe)
        assert attempt == committed[last]
    got = {n: bytes(rec.regions[n].tobytes()) for n in w.arrays}
    assert got == w.attempts[attempt], "recovered bytes are not exactly one checkpoint's"
    return rec.epoch


def run_case(path: Path, *, at: int | None, count: int = 1, err: int = errno.EIO, roll: bool = False,
             mode: str = "sync", fsync: str = "always", backend: str = "file", partial: bool = True,
             drop: bool = False, seed: int = 0, reserve: bool = False) -> Outcome:
    """Two clean checkpoints, a third with calls ``at`` .. ``at+count-1`` of it failing, then the fault clears
    and checkpointing goes on; every invariant of the module docstring is asserted on the way. ``reserve``
    False: fallocate fails (EOPNOTSUPP, as on a filesystem without it), so segments reserve no space ahead
    (64 MiB of tmpfs zeroing per segment otherwise: most of a case's time)."""
    w = Workload(seed, roll)
    fos = FaultyOS()
    fos.fail_fallocate = not reserve
    rt = w.open(path, fos, fsync, backend)
    committed: dict[int, int] = {}
    for _ in range(2):
        w.change()
        meta = w.attempt()
        committed[_checkpoint(rt, meta, mode)] = meta["attempt"]
    assert sorted(committed) == [1, 2]
    w.change()
    meta = w.attempt()
    fos.arm(at, count=count, err=err, partial=partial, drop_unsynced=drop)
    error: CheckpointError | None = None
    try:
        committed[_checkpoint(rt, meta, mode)] = meta["attempt"]
    except CheckpointError as e:
        error = e
    calls = len(fos.calls)
    fos.clear()
    out = Outcome(calls, error, committed, list(fos.calls))
    if error is None:  # the fault lay past this checkpoint's calls, or hit a close that has nothing at stake
        assert all(op == "close" for _, op in fos.failed) and sorted(committed) == [1, 2, 3], fos.failed
        rt.close()
        _check_recovered(path, w, committed, None)
        return out
    assert not error.committed and error.epoch == 3 and error.last_committed == 2, error
    assert errno.errorcode[err] in error.cause, error.cause
    maybe = (3, meta["attempt"]) if error.log_failed else None
    _check_recovered(path, w, committed, maybe)  # readable while the writer still holds it
    if not error.log_failed:  # the epoch's bytes were taken back: the same Runtime goes on, from epoch 3
        for want in (3, 4):
            w.change()
            meta = w.attempt()
            assert _checkpoint(rt, meta, mode) == want
            committed[want] = meta["attempt"]
        rt.close()
    else:  # failed until reopened: says so on every call, then a reopened Runtime goes on
        w.change()
        with pytest.raises(CheckpointError) as again:
            _checkpoint(rt, w.attempt(), mode)
        assert again.value.log_failed and again.value.epoch == 3
        rt.close()  # reported already: close does not raise it again
        rt = w.open(path, None, fsync, backend)
        assert rt.epoch in (2, 3)
        rec = rt.recover_into()
        assert w.state() == w.attempts[rec.meta["attempt"]]
        if rt.epoch == 3:
            committed[3] = meta["attempt"]
        for want in (rt.epoch + 1, rt.epoch + 2):
            w.change()
            m = w.attempt()
            assert _checkpoint(rt, m, mode) == want
            committed[want] = m["attempt"]
        rt.close()
    assert _check_recovered(path, w, committed, None) == max(committed)
    return out


def _count_calls(path: Path, **kw: Any) -> int:
    return run_case(path, at=None, **kw).calls


def _sweep(root: Path, *, errs: tuple[int, ...], counts: tuple[int, ...], **kw: Any) -> dict[str, int]:
    """Fail every position N of the third checkpoint for every (errno, count); returns what was seen."""
    n_calls = _count_calls(root / "count", **kw)
    assert n_calls >= 1
    seen = {"cases": 0, "healthy": 0, "failed": 0, "returned": 0}
    for err in errs:
        for count in counts:
            for at in range(1, n_calls + 1):
                case = root / f"e{err}-c{count}-at{at}"
                out = run_case(case, at=at, count=count, err=err, **kw)
                shutil.rmtree(case)  # segments reserve 64 MiB ahead each: keep tmpfs use to one case
                seen["cases"] += 1
                if out.error is None:  # the close of a synced file or of the directory: nothing at stake
                    assert all(op == "close" for op in out.ops[at - 1 : at - 1 + count]), (at, out.ops)
                    seen["returned"] += 1
                else:
                    seen["failed" if out.error.log_failed else "healthy"] += 1
    return seen


# ------------------------------------------------------------------------------------- the reported bug
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_one_failed_fdatasync_loses_nothing_and_the_log_goes_on(shm_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                err: int) -> None:
    """The issue's reproducer, at the real os module: os.fdatasync fails once during the third checkpoint of a
    fsync="always" log; the server catches it and keeps checkpointing. Before the fix the call raised a bare
    OSError, the next epoch reused number 3, and recover() raised "epoch 3 follows epoch 3"."""
    w = Workload(1, roll=False)
    rt = w.open(shm_dir / "log", None)
    real = os.fdatasync
    fault = {"armed": False}

    def fdatasync(fd: int) -> None:
        if fault["armed"]:
            fault["armed"] = False
            raise OSError(err, os.strerror(err))
        real(fd)

    committed: dict[int, int] = {}
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    raised = []
    for i in range(6):
        fault["armed"] = i == 2
        w.change()
        meta = w.attempt()
        try:
            committed[rt.checkpoint(meta)] = meta["attempt"]
        except CheckpointError as e:
            raised.append(e)
    monkeypatch.setattr(os, "fdatasync", real)
    rt.close()
    assert len(raised) == 1 and raised[0].epoch == 3 and not raised[0].log_failed
    assert sorted(committed) == [1, 2, 3, 4, 5]  # consecutive: the failed attempt's number was not skipped
    assert _check_recovered(shm_dir / "log", w, committed, None) == 5


# ------------------------------------------------------------------------------ every call of an epoch
@pytest.mark.parametrize("roll", [False, True], ids=["same-segment", "rollover"])
def test_every_call_of_a_checkpoint_failing_once_or_for_good(shm_dir: Path, roll: bool) -> None:
    seen = _sweep(shm_dir, errs=(errno.EIO,), counts=(1, FOREVER), roll=roll)
    assert seen["healthy"] and seen["failed"]  # both answers of the contract are exercised


def test_enospc_and_a_failing_cut_at_every_call(shm_dir: Path) -> None:
    """ENOSPC everywhere; counts 2 and 3 make the cut after the first failure fail at its truncate or its
    fsync, which must fail the log, never leave the bytes behind."""
    seen = _sweep(shm_dir, errs=(errno.ENOSPC,), counts=(1, 2, 3), roll=True)
    assert seen["failed"]


def test_rollover_sweep_async(shm_dir: Path) -> None:
    _sweep(shm_dir, errs=(errno.EIO,), counts=(1, FOREVER), roll=True, mode="async")


def test_a_failed_sync_that_drops_the_dirty_pages(shm_dir: Path) -> None:
    """fsyncgate: the failing fdatasync also loses what it could not write (it reads back as zeros)."""
    _sweep(shm_dir, errs=(errno.EIO,), counts=(1, FOREVER), roll=True, drop=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("roll", [False, True])
@pytest.mark.parametrize("drop", [False, True])
def test_exhaustive_sweep(shm_dir: Path, mode: str, roll: bool, drop: bool) -> None:
    _sweep(shm_dir, errs=(errno.EIO, errno.ENOSPC), counts=(1, 2, 3, FOREVER), roll=roll, mode=mode, drop=drop)


@pytest.mark.slow  # each replay of a 1 GiB preallocated DAX segment checks its trailing zeros
def test_dax_msync_failures_through_the_runtime(shm_dir: Path) -> None:
    seen = _sweep(shm_dir, errs=(errno.EIO,), counts=(1, FOREVER), backend="dax")
    assert seen["healthy"] and seen["failed"]


def test_dax_msync_failures(shm_dir: Path) -> None:
    """DAX commits are msync: one failing is cut back (zeroed + msync) and the log goes on; msync failing for
    good fails the log, and a reopened writer goes on after the epochs the disk holds."""
    fos = FaultyOS()
    opts = {"fsync": "always", "backend": "dax", "dax_segment_bytes": 4 << 20}
    spec = RegionSpec("r", RegionKind.OPAQUE, 2 * PAGE, PAGE)
    rng = np.random.default_rng(6)
    datas = [rng.integers(0, 256, 2 * PAGE, dtype=np.uint8) for _ in range(6)]

    def delta(i: int) -> RegionDelta:
        return RegionDelta(spec, np.arange(2, dtype=np.int64), memoryview(datas[i]))

    log = RecoveryLog.open(shm_dir / "log", opts, io=fos)
    assert log.append(defs=[spec], deltas=[delta(0)], meta={"i": 0}).epoch == 1
    fos.arm(1, err=errno.EIO)
    with pytest.raises(CheckpointError) as ei:
        log.append(deltas=[delta(1)], meta={"i": 1})
    assert not ei.value.log_failed and fos.calls == ["msync", "msync"]  # the commit, then the cut's
    assert log.append(deltas=[delta(2)], meta={"i": 2}).epoch == 2
    fos.arm(1, count=FOREVER, err=errno.EIO)
    with pytest.raises(CheckpointError) as ei:
        log.append(deltas=[delta(3)], meta={"i": 3})
    assert ei.value.log_failed and ei.value.epoch == 3 and ei.value.last_committed == 2
    log.close()
    fos.clear()
    rec = cft.recover(shm_dir / "log")
    assert (rec.epoch, rec.meta) in ((2, {"i": 2}), (3, {"i": 3}))  # epoch 3's fate is unknown: either
    assert rec.regions["r"].tobytes() == datas[rec.meta["i"]].tobytes()
    log = RecoveryLog.open(shm_dir / "log", opts, io=fos)
    assert log.append(deltas=[delta(4)], meta={"i": 4}).epoch == rec.epoch + 1
    log.close()
    assert cft.recover(shm_dir / "log").regions["r"].tobytes() == datas[4].tobytes()


def test_a_write_error_under_fsync_never_is_cut_back(shm_dir: Path) -> None:
    out = run_case(shm_dir / "log", at=1, err=errno.ENOSPC, fsync="never")
    assert out.error is not None and not out.error.log_failed and "ENOSPC" in out.error.cause
    assert "disk is full" in str(out.error)


# -------------------------------------------------------------------------------- not failures at all
def test_short_writes_and_failing_reservations_change_nothing(shm_dir: Path) -> None:
    """pwritev writing half of each request, and every fallocate reservation failing (ENOSPC): the log
    still commits every epoch exactly (a reservation only saves page faults)."""
    w = Workload(3, roll=True)
    fos = FaultyOS()
    fos.short_writes = True
    fos.fail_fallocate = True
    fos.arm(None, err=errno.ENOSPC)
    rt = w.open(shm_dir / "log", fos)
    committed = {}
    for _ in range(5):
        w.change()
        meta = w.attempt()
        committed[rt.checkpoint(meta)] = meta["attempt"]
    rt.close()
    assert fos.calls.count("pwritev") > 10 and not fos.failed
    assert _check_recovered(shm_dir / "log", w, committed, None) == 5


# ------------------------------------------------------------------- the interval background fsync
def _wait_for(cond: Any, timeout_s: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("seen_by", ["checkpoint", "close"])
def test_a_failed_background_fsync_surfaces_on_the_next_call(shm_dir: Path, seen_by: str) -> None:
    w = Workload(4, roll=False)
    fos = FaultyOS()
    rt = w.open(shm_dir / "log", fos, fsync="interval", interval_ms=5)
    committed = {}
    for _ in range(2):
        w.change()
        meta = w.attempt()
        committed[rt.checkpoint(meta)] = meta["attempt"]
    fos.arm(None)
    _wait_for(lambda: "fdatasync" in fos.calls)  # epochs 1-2 synced by the background thread
    fos.arm(1, count=FOREVER, err=errno.EIO, ops=("fdatasync",), drop_unsynced=True)
    w.change()
    meta = w.attempt()
    committed[rt.checkpoint(meta)] = meta["attempt"]  # returned: durable only once the next sync succeeds
    _wait_for(lambda: bool(fos.failed))
    fos.clear()
    with pytest.raises(CheckpointError) as ei:
        if seen_by == "checkpoint":
            w.change()
            rt.checkpoint(w.attempt())
        else:
            rt.close()
    e = ei.value
    assert e.log_failed and e.epoch == 3 and e.last_committed == 2 and "background fdatasync" in e.cause
    assert "EIO" in e.cause and "may not be on disk" in e.cause
    rt.close()  # closed, or reported already: nothing more
    # the kernel dropped epoch 3's bytes: the interval policy's loss window, and nothing before it is touched
    assert _check_recovered(shm_dir / "log", w, {1: committed[1], 2: committed[2]}, None) == 2
    rt = w.open(shm_dir / "log", None, fsync="interval", interval_ms=5)
    assert rt.epoch == 2
    w.change()
    assert rt.checkpoint(w.attempt()) == 3
    rt.close()


# ------------------------------------------------------------------------------ the raw RecoveryLog API
def test_recovery_log_append_raises_checkpoint_error_and_the_number_stays_free(shm_dir: Path) -> None:
    fos = FaultyOS()
    spec = RegionSpec("r", RegionKind.OPAQUE, 3 * PAGE, PAGE)
    log = RecoveryLog.open(shm_dir / "log", {"fsync": "always"}, io=fos)
    data = np.random.default_rng(5).integers(0, 256, 3 * PAGE, dtype=np.uint8)
    delta = RegionDelta(spec, np.arange(3, dtype=np.int64), memoryview(data))
    assert log.append(defs=[spec], deltas=[delta], meta={"n": 1}).epoch == 1
    fos.arm(2, err=errno.EIO)  # call 1 is the pwritev, call 2 its fdatasync
    with pytest.raises(CheckpointError) as ei:
        log.append(deltas=[delta], meta={"n": 2})
    assert ei.value.epoch == 2 and not ei.value.log_failed and fos.failed == [(2, "fdatasync")]
    assert fos.calls[2:4] == ["ftruncate", "fsync"]  # cut back to the epoch's start, durably
    assert log.append(deltas=[delta], meta={"n": 3}).epoch == 2
    log.close()
    rec = cft.recover(shm_dir / "log")
    assert rec.epoch == 2 and rec.meta == {"n": 3} and rec.regions["r"].tobytes() == data.tobytes()


# ------------------------------------------------------------------------------- a fresh process reads
def test_logs_left_by_faults_are_read_by_a_fresh_process(shm_dir: Path) -> None:
    ops = run_case(shm_dir / "count", at=None, roll=True).ops
    dir_fsync = next(i for i in range(len(ops)) if ops[i] == "fsync" and "replace" in ops[:i]) + 1
    cases = {"healthy": dict(at=2, count=1), "failed-cut": dict(at=2, count=FOREVER),
             "roll-dirsync": dict(at=dir_fsync, roll=True), "roll-dropped": dict(at=len(ops), roll=True, drop=True)}
    for name, kw in cases.items():
        out = run_case(shm_dir / name, **kw)
        assert out.error is not None
    assert run_case(shm_dir / "roll-dirsync2", at=dir_fsync, roll=True).error.log_failed  # type: ignore[union-attr]
    code = textwrap.dedent("""
        import hashlib, json, sys
        import concordia_ft as cft
        out = {}
        for d in sys.argv[1:]:
            rec = cft.recover(d)
            out[d] = [rec.epoch, rec.meta, {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in rec.regions.items()}]
        print(json.dumps(out))
    """)
    dirs = [str(shm_dir / n) for n in cases]
    res = subprocess.run([PYTHON, "-c", code, *dirs], capture_output=True, text=True, env=subprocess_env(),
                         timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    for d in dirs:
        rec = cft.recover(d)
        digests = {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in rec.regions.items()}
        assert got[d] == [rec.epoch, rec.meta, digests] and rec.epoch >= 4


# ------------------------------------------------------------------------------------- randomized
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), at=st.integers(1, 24), count=st.sampled_from([1, 2, 3, FOREVER]),
       err=st.sampled_from([errno.EIO, errno.ENOSPC]), roll=st.booleans(), drop=st.booleans(),
       partial=st.booleans(), mode=st.sampled_from(["sync", "async"]), reserve=st.booleans())
def test_random_faults(shm_dir: Path, seed: int, at: int, count: int, err: int, roll: bool, drop: bool,
                       partial: bool, mode: str, reserve: bool) -> None:
    case = shm_dir / f"h{seed}-{at}-{count}-{err}-{roll}-{drop}-{partial}-{mode}"
    try:
        run_case(case, at=at, count=count, err=err, roll=roll, drop=drop, partial=partial, mode=mode, seed=seed,
                 reserve=reserve)
    finally:
        shutil.rmtree(case, ignore_errors=True)
