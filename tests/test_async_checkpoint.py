"""Asynchronous epochs (Runtime.checkpoint_async) over host regions, with real logs.

The snapshot is the state at the call (writes after it belong to the next epoch); async epochs are byte for
byte the epochs a synchronous twin writes; at most one epoch is ever in flight (the next call waits: the
backpressure); a failure in the background is raised by the next call, earlier epochs stay readable and the
lost epoch's changes are logged again; close() drains. Fault injection (``faults.FaultyLog``) wraps a real log;
one test makes a real write fail (a file-size limit in a child process).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import concordia_ft as cft
from concordia_ft.core.format import SEGMENT_HEADER_BYTES
from concordia_ft.errors import CheckpointError, ConfigError
from faults import FaultyLog
from support import PYTHON, subprocess_env

torch = pytest.importorskip("torch")

PAGE = 512
KV_BLOCK = 2 * PAGE
SIZES = {"opq": 7 * PAGE + 100, "hsh": 5 * PAGE, "dense": 2 * PAGE + 1, "wide": 4 * PAGE, "kv": 8 * KV_BLOCK,
         "imm": 3 * PAGE}  # "wide": a dense region of whole pages (the host tracker's zero-copy gather)


class State:
    """One region of every kind (numpy, plus a torch CPU tensor hashed), and the ways a test changes them."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.arrays = {n: rng.integers(0, 256, s, dtype=np.uint8) for n, s in SIZES.items()}
        self.arrays["kv"][:] = 0
        self.t_hsh = torch.from_numpy(rng.standard_normal(1000).astype(np.float32))  # 4000 B: 8 pages, a tail
        self.flags = np.zeros(SIZES["kv"] // KV_BLOCK, np.uint8)

    def register(self, rt: cft.Runtime) -> None:
        a = self.arrays
        rt.register("opq", a["opq"], "opaque", diff="shadow")
        rt.register("hsh", a["hsh"], "opaque", diff="hash")
        rt.register("t_hsh", self.t_hsh, "opaque", diff="hash")
        rt.register("dense", a["dense"], "dense")
        rt.register("wide", a["wide"], "dense")
        rt.register("kv", a["kv"], "paged", block_bytes=KV_BLOCK, dirty_blocks=self.flags, initially_zero=True)
        rt.register("imm", a["imm"], "immutable")

    def poke(self, name: str, page: int, value: int) -> None:
        if name == "t_hsh":
            raw = self.t_hsh.view(torch.uint8).numpy()
        else:
            raw = self.arrays[name]
        off = min(page * PAGE + 7, raw.size - 1)
        raw[off] = value
        if name == "kv":
            self.flags[off // KV_BLOCK] = 1

    def digests(self) -> dict[str, str]:
        out = {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in self.arrays.items()}
        out["t_hsh"] = hashlib.sha256(self.t_hsh.numpy().tobytes()).hexdigest()
        return out


def _runtime(path: Path, **kw: object) -> cft.Runtime:
    return cft.Runtime(path, fsync="never", page_bytes=PAGE, compact_after_bytes=None, **kw)


def _recovered_digests(path: Path) -> tuple[int, dict[str, str]]:
    rec = cft.recover(path)
    return rec.epoch, {n: hashlib.sha256(d.tobytes()).hexdigest() for n, d in rec.regions.items()}


def _epoch_bytes(log_dir: Path) -> bytes:
    """Every epoch of the log, without the segment headers (those carry the random log id and a timestamp)."""
    manifest = json.loads((log_dir / "MANIFEST").read_text().split("\ncrc32c")[0])
    return b"".join((log_dir / n).read_bytes()[SEGMENT_HEADER_BYTES:] for n in manifest["incr"])


# ------------------------------------------------------------------------------ same bytes as sync epochs
POKE = st.tuples(st.sampled_from(["opq", "hsh", "t_hsh", "dense", "wide", "kv"]), st.integers(0, 15), st.integers(0, 255))
OP = st.one_of(st.tuples(st.just("poke"), POKE), st.tuples(st.sampled_from(["sync", "async", "wait"]), st.none()))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OP, min_size=1, max_size=40))
def test_async_epochs_are_the_bytes_a_sync_twin_writes(shm_dir: Path, ops: list) -> None:
    """Random pokes, sync and async checkpoints and waits. A twin runtime gets the same pokes and a sync
    checkpoint at each checkpoint call: the two logs hold identical epochs. After every wait, a reader
    recovers exactly the state of the last call."""
    run = shm_dir / f"run-{time.monotonic_ns()}"
    a, b = State(), State()
    rt, twin = _runtime(run / "async"), _runtime(run / "twin")
    a.register(rt)
    b.register(twin)
    model: dict[int, dict[str, str]] = {}
    epoch = 0
    try:
        for op, arg in ops:
            if op == "poke":
                a.poke(*arg)
                b.poke(*arg)
            elif op == "wait":
                assert rt.wait() == (epoch or None)
                if epoch:
                    assert _recovered_digests(run / "async") == (epoch, model[epoch])
            else:
                epoch += 1
                model[epoch] = a.digests()
                assert twin.checkpoint({"e": epoch}) == epoch
                if op == "sync":
                    assert rt.checkpoint({"e": epoch}) == epoch
                else:
                    assert rt.checkpoint_async({"e": epoch}).epoch == epoch
                    assert not a.flags.any()  # the flags were taken with the snapshot
    finally:
        rt.close()
        twin.close()
    try:
        assert _epoch_bytes(run / "async") == _epoch_bytes(run / "twin")
        if epoch:
            assert _recovered_digests(run / "async") == (epoch, model[epoch])
    finally:
        shutil.rmtree(run, ignore_errors=True)  # each example reserves tmpfs space ahead: never let them pile up


# --------------------------------------------------------------------------- the snapshot is the call's state
def test_writes_after_the_call_belong_to_the_next_epoch(shm_dir: Path) -> None:
    s = State(1)
    rt = _runtime(shm_dir / "log", device_handlers="cpu")
    rt.log = FaultyLog(rt.log, delay_s=0.2)  # every epoch stays in flight while this test writes
    s.register(rt)
    rt.checkpoint({"e": 1})
    opq0 = s.arrays["opq"][3 * PAGE + 7]
    s.poke("opq", 3, opq0 ^ 0xFF)
    s.poke("hsh", 1, s.arrays["hsh"][PAGE + 7] ^ 0xFF)
    s.poke("kv", 2, 9)
    at_call = s.digests()
    h2 = rt.checkpoint_async({"e": 2})
    assert not h2.done() and not s.flags.any()
    # while epoch 2 is in flight: opq page 3 goes BACK to its epoch-1 value (so it differs only from the
    # in-flight epoch), hsh page 4 and the dense region change, and kv block 2 is written and flagged again
    s.poke("opq", 3, opq0)
    s.poke("hsh", 4, 1)
    s.arrays["dense"] += 1
    s.arrays["wide"] += 1
    s.poke("kv", 2, 10)
    assert h2.wait() == 2
    assert _recovered_digests(shm_dir / "log") == (2, at_call)
    assert h2.stats is not None and h2.stats.region_pages == {"opq": 1, "hsh": 1, "dense": 3, "wide": 4, "kv": 2}
    h3 = rt.checkpoint_async({"e": 3})
    h3.wait()
    # compared against the in-flight epoch's bytes, not the epoch before it: opq page 3 is logged again
    assert h3.stats is not None and h3.stats.region_pages == {"opq": 1, "hsh": 1, "dense": 3, "wide": 4, "kv": 2}
    rt.close()
    assert _recovered_digests(shm_dir / "log") == (3, s.digests())


def test_metadata_is_copied_and_checked_at_the_call(shm_dir: Path) -> None:
    rt = _runtime(shm_dir / "log")
    rt.register("a", np.zeros(100, np.uint8))
    meta = {"step": 1, "tags": ["x"]}
    h = rt.checkpoint_async(meta)
    meta["step"] = 2
    meta["tags"].append("y")
    assert h.wait() == 1
    with pytest.raises(ConfigError, match="JSON-able"):
        rt.checkpoint_async({"bad": object()})
    assert rt.in_flight is None and rt.wait() == 1  # nothing was submitted
    rt.close()
    assert cft.recover(shm_dir / "log").meta == {"step": 1, "tags": ["x"]}


# ---------------------------------------------------------------------------------------------- backpressure
def test_a_slow_append_makes_the_next_checkpoint_wait(shm_dir: Path) -> None:
    delay = 0.3
    s = State(2)
    rt = _runtime(shm_dir / "log")
    s.register(rt)
    rt.log = faulty = FaultyLog(rt.log, delay_s=delay)
    t0 = time.perf_counter()
    h1 = rt.checkpoint_async({"e": 1})
    first_call = time.perf_counter() - t0
    assert first_call < delay / 2 and not h1.done()  # the caller did not wait for the log
    s.poke("dense", 0, 1)
    t1 = time.perf_counter()
    h2 = rt.checkpoint_async({"e": 2})
    second_call = time.perf_counter() - t1
    assert h1.done() and h1.committed and not h2.done()  # epoch 1 finished before epoch 2 was staged
    assert second_call >= delay * 0.8 and h2.backpressure_seconds >= delay * 0.8
    assert h2.wait() == 2 and h2.stats is not None
    assert h2.stats.backpressure_seconds == h2.backpressure_seconds and h2.stats.mode == "async"
    assert h2.stats.commit_latency_seconds >= delay and h2.stats.call_seconds < h2.stats.commit_latency_seconds
    (e1, _, end1, ok1), (e2, start2, _, ok2) = faulty.appends
    assert (e1, e2, ok1, ok2) == (1, 2, True, True) and start2 >= end1 and faulty.max_concurrent == 1
    rt.close()


def test_register_and_sync_checkpoint_wait_for_the_epoch_in_flight(shm_dir: Path) -> None:
    rt = _runtime(shm_dir / "log")
    a = np.zeros(3000, np.uint8)
    rt.register("a", a)
    rt.log = FaultyLog(rt.log, delay_s=0.2)
    h1 = rt.checkpoint_async({"e": 1})
    b = np.ones(2000, np.uint8)
    rt.register("b", b)  # waits for epoch 1, which names only "a"
    assert h1.done() and h1.stats is not None and set(h1.stats.region_pages) == {"a"}
    h2 = rt.checkpoint_async({"e": 2})
    assert rt.checkpoint({"e": 3}) == 3 and h2.done()  # a sync checkpoint finishes the async one first
    rt.close()
    rec = cft.recover(shm_dir / "log")
    assert rec.epoch == 3 and (rec.array("b") == 1).all()


# -------------------------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("seen_by", ["next_async", "next_sync", "handle", "wait", "close"])
def test_a_background_failure_surfaces_once_and_loses_nothing_committed(shm_dir: Path, seen_by: str) -> None:
    s = State(3)
    rt = _runtime(shm_dir / "log")
    s.register(rt)
    rt.log = faulty = FaultyLog(rt.log, fail_epochs={3})
    rt.checkpoint_async({"e": 1})
    s.poke("opq", 2, 1)
    s.poke("kv", 5, 1)
    rt.checkpoint_async({"e": 2}).wait()
    committed = s.digests()
    s.poke("opq", 6, 2)
    s.poke("hsh", 0, 3)
    s.poke("kv", 0, 4)
    h3 = rt.checkpoint_async({"e": 3})
    assert not s.flags.any()  # taken by epoch 3's snapshot
    raised: list[CheckpointError] = []
    if seen_by == "close":
        with pytest.raises(CheckpointError) as ei:
            rt.close()
        raised.append(ei.value)
    else:
        with pytest.raises(CheckpointError) as ei:
            {"next_async": lambda: rt.checkpoint_async({"e": 3}), "next_sync": lambda: rt.checkpoint({"e": 3}),
             "handle": h3.wait, "wait": rt.wait}[seen_by]()
        raised.append(ei.value)
    err = raised[0]
    assert err is h3.error and (err.epoch, err.last_committed, err.committed) == (3, 2, False)
    assert "No space left on device" in str(err) and "epochs up to 2 are committed" in str(err)
    assert s.flags[0] == 1  # block 0 was flagged again: its bytes are not lost
    assert _recovered_digests(shm_dir / "log") == (2, committed)  # nothing committed was touched
    if seen_by == "close":
        return
    faulty.fail_epochs.clear()
    assert rt.wait() == 2  # raised once: not again
    h = rt.checkpoint_async({"e": 3})
    assert h.wait() == 3
    assert h.stats is not None and h.stats.region_pages == {"opq": 1, "hsh": 1, "kv": 2, "dense": 3, "wide": 4}
    rt.close()
    assert _recovered_digests(shm_dir / "log") == (3, s.digests())


def test_a_real_write_failure_surfaces_and_the_log_stays_readable(shm_dir: Path) -> None:
    """A child process writes async epochs under a file-size limit: the append that crosses it fails for
    real (EFBIG from the kernel); the next checkpoint raises it, and the log replays to the epoch before."""
    code = textwrap.dedent(f"""
        import hashlib, resource, signal, sys
        import numpy as np
        import concordia_ft as cft
        from concordia_ft.errors import CheckpointError
        log_dir = {str(shm_dir / "log")!r}
        a = np.zeros(256 * 1024, np.uint8)
        rt = cft.Runtime(log_dir, fsync="never", compact_after_bytes=None)
        rt.register("a", a, "dense")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 * 1024 * 1024, resource.RLIM_INFINITY))
        digests = {{}}
        try:
            for i in range(1, 100):
                a[:] = i
                digests[i] = hashlib.sha256(a.tobytes()).hexdigest()
                rt.checkpoint_async({{"i": i}})
        except CheckpointError as e:
            print("FAILED", e.epoch, e.last_committed, digests[e.last_committed])
            print(e)
        rt.log.close()
    """)
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    head, message = out.stdout.splitlines()[:2]
    _, epoch, last, digest = head.split()
    assert int(epoch) == int(last) + 1 and int(last) >= 5
    assert "File too large" in message and f"epochs up to {last} are committed" in message
    rec = cft.recover(shm_dir / "log")
    assert rec.epoch == int(last) and rec.outcome.value == "ok"
    assert hashlib.sha256(rec.regions["a"].tobytes()).hexdigest() == digest


# ----------------------------------------------------------------------------------------------------- close
def test_close_drains_the_epoch_in_flight(shm_dir: Path) -> None:
    rt = _runtime(shm_dir / "log")
    a = np.arange(5000, dtype=np.int32)
    rt.register("a", a)
    rt.log = FaultyLog(rt.log, delay_s=0.3)
    h = rt.checkpoint_async({"e": 1})
    a[:] = -1  # after the call: not in epoch 1
    rt.close()
    assert h.done() and h.committed and h.wait() == 1
    rec = cft.recover(shm_dir / "log")
    assert rec.epoch == 1 and (rec.array("a") == np.arange(5000)).all()
    with pytest.raises(ConfigError, match="closed"):
        rt.checkpoint_async()
    with pytest.raises(ConfigError, match="closed"):
        rt.checkpoint()


# ------------------------------------------------------------------------------------------ dense batches
def test_plan_dense_copies_merges_only_adjacent_whole_page_regions() -> None:
    from concordia_ft.core.tracking import plan_dense_copies

    P = 4096
    # an arena: a (2 pages) | b (3 pages) | c (1.5 pages) | d right after c's real end; e elsewhere
    a, b = 1 << 20, (1 << 20) + 2 * P
    c = b + 3 * P
    d = c + P + P // 2
    e = 1 << 30
    plan = plan_dense_copies([(a, 2 * P, 2 * P), (b, 3 * P, 3 * P), (c, P + P // 2, 2 * P), (d, P, P),
                              (e, 100, P)])
    # a, b and c share one copy (c's pad is never written); d starts after c's pad in the buffer: its own copy
    assert plan == [(0, a, 6 * P + P // 2), (7 * P, d, P), (8 * P, e, 100)]
    assert plan_dense_copies([(b, 3 * P, 3 * P), (a, 2 * P, 2 * P)]) == [(0, b, 3 * P), (3 * P, a, 2 * P)]
    assert plan_dense_copies([]) == []
    with pytest.raises(AssertionError):
        plan_dense_copies([(a, 2 * P + 1, 2 * P)])


def test_dense_batch_follows_registry_changes_and_logs_what_a_sync_twin_logs(shm_dir: Path) -> None:
    """Dense host regions (slices of one torch arena, as LoraTrainer lays them out, and a numpy array) are
    staged as one batch; registering and unregistering rebuild it; every epoch equals a sync twin's."""
    arena = torch.arange(3 * 1024 + 200, dtype=torch.float32)  # p: 8 pages, m: 16 pages, t: 1.56 pages
    regions = {"p": arena[:1024], "m": arena[1024:3 * 1024], "t": arena[3 * 1024:], "n": np.arange(700, dtype=np.int16)}
    twin_arena = arena.clone()
    twin = {"p": twin_arena[:1024], "m": twin_arena[1024:3 * 1024], "t": twin_arena[3 * 1024:],
            "n": regions["n"].copy()}
    rt, tw = _runtime(shm_dir / "async"), _runtime(shm_dir / "twin")
    for r, bufs in ((rt, regions), (tw, twin)):
        for name in ("p", "m", "n"):
            r.register(name, bufs[name], "dense")

    def step(e: int) -> None:
        arena.mul_(1.5).add_(e)
        twin_arena.mul_(1.5).add_(e)
        regions["n"][:] += 3
        twin["n"][:] += 3
        h = rt.checkpoint_async({"e": e})
        arena.add_(1000.0)  # after the call: the next epoch's, never this one's
        regions["n"][:] -= 1
        assert h.wait() == e and tw.checkpoint({"e": e}) == e
        arena.sub_(1000.0)
        regions["n"][:] += 1

    step(1)
    step(2)
    for r, bufs in ((rt, regions), (tw, twin)):
        r.register("t", bufs["t"], "dense")
        r.unregister("p")
    step(3)
    step(4)
    assert rt.last_stats is not None and rt.last_stats.region_pages == {"m": 16, "n": 3, "t": 2}
    rt.close()
    tw.close()
    assert _epoch_bytes(shm_dir / "async") == _epoch_bytes(shm_dir / "twin")
    rec = cft.recover(shm_dir / "async")
    assert sorted(rec.regions) == ["m", "n", "t"]
    assert rec.regions["m"].tobytes() == regions["m"].numpy().tobytes()
    assert rec.regions["t"].tobytes() == regions["t"].numpy().tobytes()
    assert rec.regions["n"].tobytes() == regions["n"].tobytes()


def test_forget_drops_a_region_the_log_holds_but_nobody_registers(shm_dir: Path) -> None:
    old, keep = np.full(3000, 7, np.uint8), np.arange(5000, dtype=np.int32)
    rt = _runtime(shm_dir / "log")
    rt.register("old", old, "dense")
    rt.register("keep", keep, "dense")
    rt.checkpoint({"e": 1})
    rt.close()
    rt = _runtime(shm_dir / "log")  # a later process, with another layout: only "keep"
    rt.register("keep", keep, "dense")
    with pytest.raises(cft.RegionError, match="unregister"):
        rt.forget("keep")
    assert rt.checkpoint_async({"e": 2}).wait() == 2
    assert sorted(cft.recover(shm_dir / "log").regions) == ["keep", "old"]  # not forgotten: still replayed
    rt.forget("old")
    rt.forget("never-logged")  # harmless
    assert rt.checkpoint_async({"e": 3}).wait() == 3
    rt.close()
    rec = cft.recover(shm_dir / "log")
    assert sorted(rec.regions) == ["keep"] and (rec.array("keep") == keep).all()


def test_handed_over_metadata_is_not_copied_and_a_bad_one_fails_its_epoch_only(shm_dir: Path) -> None:
    rt = _runtime(shm_dir / "log")
    a = np.zeros(2000, np.uint8)
    rt.register("a", a, "dense")
    assert rt.checkpoint_async({"step": 1, "loss": 0.5}, copy_meta=False).wait() == 1
    a[:] = 1
    h = rt.checkpoint_async({"bad": object()}, copy_meta=False)  # not checked at the call: the writer finds it
    with pytest.raises(CheckpointError, match="not JSON serializable") as ei:
        rt.wait()
    assert ei.value is h.error and not h.committed and ei.value.last_committed == 1
    assert cft.recover(shm_dir / "log").epoch == 1
    assert rt.checkpoint_async({"step": 2}, copy_meta=False).wait() == 2
    rt.close()
    rec = cft.recover(shm_dir / "log")
    assert rec.meta == {"step": 2} and (rec.array("a") == 1).all()
