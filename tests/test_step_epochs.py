"""Step epochs: the C StepWriter (core/_slotlog.c) writes the bytes RecoveryLog.append writes for the same records
(mapped DRAM and file segments, rolls included) and refuses malformed blobs; the serving engine's step-epoch path
(EngineOptions step_epochs="c", serve/stepepochs.py) logs exactly the state the generic path logs (the replayed
regions and metadata are equal after every step), clears the flags it logged, falls back to the generic path for
steps that do not fit, and a SIGKILLed engine on it recovers token-exact (durable and pipelined)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from concordia_ft.core import slotlog
from concordia_ft.core.format import encode_json
from concordia_ft.core.log import RecoveryLog
from concordia_ft.core.regions import RegionKind, RegionSpec
from concordia_ft.core.replay import Outcome, replay
from concordia_ft.core.tracking import RegionDelta
from concordia_ft.errors import CheckpointError
from concordia_ft.serve import Engine, SamplingParams
from llm_helpers import tiny_model
from serve_workload import OPTIONS, drive, workload

pytestmark = pytest.mark.skipif(not slotlog.available(), reason=f"C writer: {slotlog.status()}")

PAGE = 4096


def _specs() -> list[RegionSpec]:
    return [RegionSpec("kv", RegionKind.PAGED, 64 * 3 * PAGE, PAGE, block_bytes=3 * PAGE),
            RegionSpec("tokens", RegionKind.PAGED, 8 * 512, 512, block_bytes=512),
            RegionSpec("rng", RegionKind.PAGED, 4 * 1024, 512, block_bytes=1024)]


def _steps(n: int, seed: int = 3) -> list[tuple[list[RegionDelta], dict[str, object]]]:
    """Random step deltas: a few kv rows (3 pages each, sometimes adjacent: RUNS), token pages, rng rows, or
    none of some; the metadata."""
    rng = np.random.default_rng(seed)
    kv, tok, rg = _specs()
    out = []
    for i in range(n):
        deltas = []
        rows = np.sort(rng.choice(64, size=int(rng.integers(0, 9)), replace=False))
        if i % 5 == 1:
            rows = np.arange(10, 10 + int(rng.integers(1, 6)))  # consecutive rows: one run
        if len(rows):
            pages = (rows[:, None] * 3 + np.arange(3)).reshape(-1).astype(np.int64)
            deltas.append(RegionDelta(kv, pages, memoryview(rng.integers(0, 256, len(pages) * PAGE, np.uint8))))
        tp = np.sort(rng.choice(8, size=int(rng.integers(0, 3)), replace=False)).astype(np.int64)
        if len(tp):
            deltas.append(RegionDelta(tok, tp, memoryview(rng.integers(0, 256, len(tp) * 512, np.uint8))))
        rr = np.sort(rng.choice(4, size=int(rng.integers(0, 3)), replace=False))
        if len(rr):
            rp = (rr[:, None] * 2 + np.arange(2)).reshape(-1).astype(np.int64)
            deltas.append(RegionDelta(rg, rp, memoryview(rng.integers(0, 256, len(rp) * 512, np.uint8))))
        out.append((deltas, {"s": {"step": i, "name": "a\"b", "xs": list(range(i % 7))}}))
    return out


def _blob(deltas: list[RegionDelta], meta: object, keep: list[np.ndarray]) -> bytes:
    return slotlog.step_blob(_records(deltas, meta, keep))


def _records(deltas: list[RegionDelta], meta: object, keep: list[np.ndarray]) -> list:
    recs = []
    for d in deltas:
        a = np.frombuffer(d.payload, np.uint8).copy()
        keep.append(a)
        if d.spec.name == "kv":  # whole rows of 3 pages: the engine's record of its rows
            recs.append(slotlog.rows_record(b"kv", d.pages[::3] // 3, 3, PAGE, int(a.ctypes.data)))
        else:
            recs.append(slotlog.pages_record(d.spec.name.encode(), d.pages, d.spec.page_bytes, int(a.ctypes.data)))
    recs.append(slotlog.meta_record(encode_json(meta)))
    return recs


def _open(d: Path, backend: str, **kw: object) -> RecoveryLog:
    log = RecoveryLog.open(d, {"backend": backend, "fsync": "never", **kw})
    log.append(defs=_specs())
    return log


def _segments(d: Path) -> list[bytes]:
    return [p.read_bytes()[4096:].rstrip(b"\0") for p in sorted(d.glob("incr.*.cft"))]  # after the header (ids)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("backend", ["dram", "file"])
def test_step_writer_writes_the_bytes_append_writes(tmp_path: Path, backend: str, threads: int) -> None:
    """threads=3: payloads of 8 KiB and more are copied and checksummed in pieces (CRCs combined)."""
    root = Path("/dev/shm") if backend == "dram" else tmp_path
    a, b = root / f"cft-step-a-{os.getpid()}", root / f"cft-step-b-{os.getpid()}"
    kw = {"mapped_segment_bytes": 1 << 20, "segment_max_bytes": 1 << 20}  # rolls a few times
    try:
        la, lb = _open(a, backend, **kw), _open(b, backend, **kw)
        steps = _steps(60)
        w = slotlog.StepLogWriter(la, queue=8, threads=threads, parallel_min_bytes=8192)
        keep: list[np.ndarray] = []
        for i, (deltas, meta) in enumerate(steps):
            w.submit(i, _blob(deltas, meta, keep))
            if i % 4 == 3:
                w.wait(i)
            lb.append(deltas=deltas, meta=meta)
        w.wait(len(steps) - 1)
        assert la.last_epoch == lb.last_epoch == 61
        w.stop()
        la.append(meta={"after": 1})  # the log took the leased tail over
        lb.append(meta={"after": 1})
        la.close()
        lb.close()
        sa, sb = _segments(a), _segments(b)
        assert len(sa) > 1 and sa == sb
        ra, rb = replay(a), replay(b)
        assert ra.outcome is rb.outcome is Outcome.OK and ra.epoch == 62
        for name in ("kv", "tokens", "rng"):
            assert bytes(ra.regions[name].data) == bytes(rb.regions[name].data)
    finally:
        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)


def test_a_malformed_blob_fails_the_step_not_the_log(tmp_path: Path) -> None:
    log = _open(tmp_path / "log", "file")
    w = slotlog.StepLogWriter(log)
    keep: list[np.ndarray] = []
    deltas, meta = _steps(1)[0]
    w.submit(0, _blob(deltas, meta, keep))
    w.wait(0)
    bad = bytearray(_blob(deltas, meta, keep))
    bad[8] = 9  # record type 9
    w.submit(1, bytes(bad))
    with pytest.raises(CheckpointError, match="malformed"):
        w.wait(1)
    with pytest.raises(CheckpointError):
        w.stop()
    with pytest.raises(ValueError, match="increasing order"):
        _resubmit_out_of_order(log)  # (its first submit commits: epoch 3)
    log.append(meta={"after": 1})  # the log is usable: epoch 4 (1: defs, 2: the good step, 3: {})
    log.close()
    r = replay(tmp_path / "log")
    assert r.outcome is Outcome.OK and r.epoch == 4 and r.meta == {"after": 1}


def _resubmit_out_of_order(log: RecoveryLog) -> None:
    w = slotlog.StepLogWriter(log)
    try:
        w.submit(5, slotlog.step_blob([slotlog.meta_record(b"{}")]))
        w.submit(5, slotlog.step_blob([slotlog.meta_record(b"{}")]))
    finally:
        w.stop()


# ------------------------------------------------------------------------------------------- the engine
def _state(log: Path) -> tuple[dict[str, bytes], dict[str, object], int]:
    r = replay(log)
    assert r.outcome is Outcome.OK
    m = r.meta["concordia.serve"]
    m.pop("time")
    return {k: bytes(v.data) for k, v in r.regions.items()}, m, int(r.epoch)


# the fast run takes the two capped cases (each path, durable and pipelined); the slow run all five
@pytest.mark.parametrize(("pipelined", "depth", "cap"), [
    pytest.param(False, 1, 0, marks=pytest.mark.slow), pytest.param(True, 1, 0, marks=pytest.mark.slow),
    pytest.param(True, 8, 0, marks=pytest.mark.slow), (False, 1, 8), (True, 4, 8)])
def test_step_epochs_log_what_the_generic_path_logs(shm_dir: Path, pipelined: bool, depth: int, cap: int) -> None:
    """Both paths side by side, step by step: after every step the two logs replay to the same regions (kv,
    tokens, rng) and the same metadata; the step path's flags are clear after it logged them. Pipelined with
    depth 1 both hand out the same tokens at the same steps; deeper, the step path may hold several steps and
    hand them out together: what it handed out is always a prefix of what the generic one did, never more
    than it committed, and at the end both handed out everything, each token once. ``cap``: ring slots of that
    many rows, so the prefill chunks (24 rows) go through the bulk buffer."""
    opts = {**OPTIONS, "backend": "dram", "async_epochs": pipelined, "async_depth": depth}
    ga = Engine(tiny_model("llama"), shm_dir / "generic", {**opts, "step_epochs": "runtime"})
    ca = Engine(tiny_model("llama"), shm_dir / "c", {**opts, "step_epochs": "c"})
    if cap:
        from concordia_ft.serve.stepepochs import StepEpochs

        ca.fast = StepEpochs(ca, cap_rows=cap, slots=ca.fast.n_slots)
    seen: dict[Engine, dict[str, list[int]]] = {ga: {}, ca: {}}

    def take(e: Engine, out: object) -> None:
        for rid, toks in out.new_tokens.items():
            have = seen[e].setdefault(rid, [])
            assert out.starts[rid] == len(have)  # nothing repeated, nothing skipped
            have += toks

    arrivals = workload()
    for e in (ga, ca):
        for a in arrivals[:4]:
            e.submit(a[2], a[3], request_id=a[1])
    n = 0
    while ga.has_work or ca.has_work:
        for a in arrivals[4:]:
            if a[0] == ga.step_no and ga.get(a[1]) is None:
                for e in (ga, ca):
                    e.submit(a[2], a[3], request_id=a[1])
        og, oc = ga.step(), ca.step()
        take(ga, og)
        take(ca, oc)
        if depth == 1:
            assert og.new_tokens == oc.new_tokens and og.epoch == oc.epoch
        for rid, toks in seen[ca].items():
            assert seen[ga].get(rid, [])[: len(toks)] == toks  # never ahead of the generic one's (released at N+1)
        if oc.epoch is not None:
            assert ca.runtime.log.last_epoch >= oc.epoch  # handed out only once committed
        n += 1
        if n % 6 == 0 and og.epoch is not None:  # compare what each log holds (everything handed out is in it)
            ga.runtime.wait()  # (pipelined: the epoch in flight is committed first on both sides)
            ca.fast.suspend()  # (the lease ends: the log files are complete; the next step leases again)
            sg, sc = _state(shm_dir / "generic"), _state(shm_dir / "c")
            assert sg[2] == sc[2] >= og.epoch
            assert sg[1] == sc[1]
            for k in ("kv", "tokens", "rng"):
                assert sg[0][k] == sc[0][k], (k, n)
        # the flags the step epoch logged are cleared (none left for the generic path to log again), once it
        # took them (pipelined: a deferred epoch takes them after the next forward's launch)
        if ca.fast.deferred is None:
            assert not ca.pool.dirty.any() and not ca.tokens_dirty.any() and not ca.rng.dirty.any()
    assert ca.fast.steps > 0.7 * n, (ca.fast.steps, n)  # most steps took the C path
    assert (ca.fast.overlapped > 0.3 * n) == pipelined, (ca.fast.overlapped, n)
    assert (ca.fast.bulk_steps > 3) == bool(cap) and ca.fast.fallbacks == 0
    assert {r.id: r.generated for r in ga.finished.values()} == {r.id: r.generated for r in ca.finished.values()}
    assert seen[ga] == seen[ca] == {r.id: r.generated for r in ga.finished.values() if r.generated}
    ga.close()
    ca.close()
    sg, sc = _state(shm_dir / "generic"), _state(shm_dir / "c")
    assert sg[1] == sc[1] and sg[2] == sc[2]
    assert all(sg[0][k] == sc[0][k] for k in ("kv", "tokens", "rng"))


def test_meta_json_decodes_to_the_meta(shm_dir: Path) -> None:
    eng = Engine(tiny_model("llama"), shm_dir / "log", {**OPTIONS, "step_epochs": "c", "keep_finished": 3})
    seen = 0
    def check(_out: object) -> None:
        nonlocal seen
        a = json.loads(eng._meta_json())["concordia.serve"]
        b = json.loads(encode_json({"concordia.serve": eng._meta()}))["concordia.serve"]
        a.pop("time")
        b.pop("time")
        assert a == b
        seen += 1
        if eng.finished:
            eng.collect(next(iter(eng.finished)))  # a collected output's fragment changes
    arrivals = workload()
    while arrivals or eng.has_work:  # drive() without its result: outputs are evicted (keep_finished=3)
        for a in [a for a in arrivals if a[0] <= eng.step_no]:
            eng.submit(a[2], a[3], request_id=a[1])
            arrivals.remove(a)
        check(eng.step())
    eng.close()
    assert seen > 20


def test_steps_that_do_not_fit_take_the_generic_path(shm_dir: Path) -> None:
    from concordia_ft.serve.stepepochs import StepEpochs

    eng = Engine(tiny_model("llama"), shm_dir / "log", {**OPTIONS, "step_epochs": "c"})
    # prefill chunks of 24 rows are more than a slot and than the bulk buffer may hold: generic for those
    eng.fast = StepEpochs(eng, cap_rows=8, bulk_max_bytes=8 * eng.geo.row_bytes)
    ref = drive(Engine(tiny_model("llama"), None, {**OPTIONS, "checkpoint": False}), workload())
    got = drive(eng, workload())
    assert got == ref
    assert eng.fast.steps > 10 and eng.fast.bulk_steps == 0
    # every step the generic path wrote is counted, with its reason: here the prefill chunks over the bulk limit
    assert eng.fast.fallbacks > 0 and eng.fast.fallback_reasons == {"bulk_limit": eng.fast.fallbacks}
    generic = eng.runtime.last_stats  # the generic path ran too
    assert generic is not None
    eng.close()
    rec = Engine.recover(shm_dir / "log", tiny_model("llama"), OPTIONS)
    assert not rec.running and not rec.waiting and {r.id: r.generated for r in rec.finished.values()} == ref
    rec.close()


# slow: the fast run SIGKILLs the C step-epoch path durable (test_serve_waves, mid-compaction) and pipelined
# (test_serve_http's server)
@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True])
def test_sigkilled_engine_on_step_epochs_recovers_token_exact(shm_dir: Path, pipelined: bool) -> None:
    from test_serve_engine import _run_child

    ref = drive(Engine(tiny_model("llama"), None, {**OPTIONS, "checkpoint": False}), workload())
    log = shm_dir / "log"
    mode = "new-c-async" if pipelined else "new-c"
    rc, _, before = _run_child(log, mode, kill_after_steps=11)
    assert rc == -signal.SIGKILL
    rc, have, middle = _run_child(log, mode.replace("new", "recover"), kill_after_steps=6)
    assert rc == -signal.SIGKILL
    for rid, toks in before.items():  # what the killed process handed out was logged
        assert ref[rid][: len(toks)] == toks, rid
        assert have.get(rid, 0) >= len(toks), rid
    for rid, toks in middle.items():
        n = have.get(rid, 0)
        assert ref[rid][n: n + len(toks)] == toks, rid
    eng = Engine.recover(log, tiny_model("llama"), {**OPTIONS, "step_epochs": "c", "async_epochs": pipelined})
    got = drive(eng, workload())
    assert eng.fast.steps > 0
    eng.close()
    assert got == ref


def test_rolls_on_the_callers_thread_keep_the_log_whole(shm_dir: Path) -> None:
    """roll_if_needed (the engine's thread rolls while the writer is idle): the log replays to the same state as
    append's, with every epoch, over several segments."""
    from concordia_ft.serve.stepepochs import _need

    kw = {"mapped_segment_bytes": 1 << 20, "segment_max_bytes": 1 << 20}
    la, lb = _open(shm_dir / "a", "dram", **kw), _open(shm_dir / "b", "dram", **kw)
    w = slotlog.StepLogWriter(la, threads=2, parallel_min_bytes=8192)
    keep: list[np.ndarray] = []
    rolled = 0
    needs: list[int] = []
    for i, (deltas, meta) in enumerate(_steps(80, seed=9)):
        recs = _records(deltas, meta, keep)
        needs.append(_need(recs))
        rolled += w.roll_if_needed(needs[-1])
        w.submit(i, slotlog.step_blob(recs))
        w.wait(i)  # idle before the next one: the caller rolls
        lb.append(deltas=deltas, meta=meta)
    w.stop()
    assert (w.stats()[:, 4] <= np.array(needs)).all()  # _need bounds every epoch's bytes
    assert rolled >= 3 and w.lease_lost is False
    la.close()
    lb.close()
    ra, rb = replay(shm_dir / "a"), replay(shm_dir / "b")
    assert ra.outcome is Outcome.OK and ra.epoch == rb.epoch == 81 and ra.meta == rb.meta
    assert len(list((shm_dir / "a").glob("incr.*.cft"))) >= 4
    for name in ("kv", "tokens", "rng"):
        assert bytes(ra.regions[name].data) == bytes(rb.regions[name].data)


def test_auto_is_the_generic_path_on_cpu_and_depth_is_checked(shm_dir: Path) -> None:
    """step_epochs="auto" (the default) takes the C path only for a CUDA model (tests/gpu checks that side)."""
    from concordia_ft.errors import ConfigError

    eng = Engine(tiny_model("llama"), shm_dir / "log", OPTIONS)
    assert eng.opts.step_epochs == "auto" and eng.fast is None
    eng.close()
    with pytest.raises(ConfigError, match="async_depth"):
        Engine(tiny_model("llama"), None, {**OPTIONS, "checkpoint": False, "async_depth": 0})


@pytest.mark.parametrize("pipelined", [False, True])
def test_step_epochs_count_toward_compaction_while_the_lease_lasts(shm_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   pipelined: bool) -> None:
    """The writer's bytes reach the runtime's compaction threshold during the lease (not only when it ends): a
    compaction starts, the step path yields the lease to it, and the compacted log recovers token-exact."""
    from concordia_ft.runtime import Runtime
    from concordia_ft.serve import stepepochs

    monkeypatch.setattr(stepepochs, "COUNT_BYTES", 64 << 10)
    ref = drive(Engine(tiny_model("llama"), None, {**OPTIONS, "checkpoint": False}), workload())
    rt = Runtime(str(shm_dir / "log"), fsync="never", backend="dram", compact_after_bytes=256 << 10)
    eng = Engine(tiny_model("llama"), shm_dir / "log", {**OPTIONS, "step_epochs": "c", "async_epochs": pipelined},
                 _runtime=rt)
    got = drive(eng, workload())
    rt._join_compactor()
    assert got == ref and eng.fast.steps > 10
    assert rt.last_compaction is not None
    eng.close()
    assert list((shm_dir / "log").glob("base.*"))
    rec = Engine.recover(shm_dir / "log", tiny_model("llama"), OPTIONS)
    assert not rec.running and {r.id: r.generated for r in rec.finished.values()} == ref
    rec.close()


# ----------------------------------------------------------------------- large payloads, prepared segments
@pytest.mark.parametrize(("threads", "fuse"), [(1, 0), (1, 12352), (4, 0), (4, 12352), (4, 256 << 10)])
def test_large_payloads_fused_or_not_write_the_bytes_append_writes(shm_dir: Path, threads: int, fuse: int) -> None:
    """Prefill-sized kv records (several MiB: cut into pieces on the writer's threads, each copied and
    checksummed whole or in fused chunks of an odd size, the pieces' CRCs combined) next to small ones: the
    segments are byte for byte ``append``'s, and the log replays."""
    ppr = 3
    kv = RegionSpec("kv", RegionKind.PAGED, 4096 * ppr * PAGE, PAGE, block_bytes=ppr * PAGE)
    meta_spec = [kv]
    kw = {"mapped_segment_bytes": 32 << 20}
    a, b = shm_dir / "a", shm_dir / "b"
    la = RecoveryLog.open(a, {"backend": "dram", "fsync": "never", **kw})
    lb = RecoveryLog.open(b, {"backend": "dram", "fsync": "never", **kw})
    la.append(defs=meta_spec)
    lb.append(defs=meta_spec)
    rng = np.random.default_rng(11)
    w = slotlog.StepLogWriter(la, queue=8, threads=threads, parallel_min_bytes=1 << 20, fuse_bytes=fuse)
    keep: list[np.ndarray] = []
    sizes = [1700, 3, 513, 40, 2049]  # rows: 20 MiB, 36 KiB, 6 MiB, ...
    for i, n in enumerate(sizes):
        rows = np.sort(rng.choice(4096, size=n, replace=False)).astype(np.int64)
        pages = (rows[:, None] * ppr + np.arange(ppr)).reshape(-1)
        data = rng.integers(0, 256, len(pages) * PAGE, np.uint8)
        keep.append(data)
        recs = [slotlog.rows_record(b"kv", rows, ppr, PAGE, int(data.ctypes.data)),
                slotlog.meta_record(encode_json({"step": i}))]
        w.submit(i, slotlog.step_blob(recs))
        lb.append(deltas=[RegionDelta(kv, pages, memoryview(data))], meta={"step": i})
    w.wait(len(sizes) - 1)
    w.stop()
    la.close()
    lb.close()
    sa, sb = _segments(a), _segments(b)
    assert len(sa) > 1 and sa == sb  # (32 MiB segments: 50 MiB of epochs roll)
    ra = replay(a)
    assert ra.outcome is Outcome.OK and ra.epoch == len(sizes) + 1
    assert bytes(ra.regions["kv"].data) == bytes(replay(b).regions["kv"].data)


def test_fuse_bytes_is_checked(shm_dir: Path) -> None:
    log = RecoveryLog.open(shm_dir / "log", {"backend": "dram", "fsync": "never"})
    log.append(defs=_specs())
    with pytest.raises(ValueError, match="fuse_bytes"):
        slotlog.StepLogWriter(log, fuse_bytes=5000)
    assert log.lease_tail() is not None  # the failed writer gave the lease back


class _Pin:
    """Stands in for the CUDA layer's registrar on a host without a driver (records what it pinned)."""

    def __init__(self) -> None:
        self.pinned: list[int] = []
        self.closed = 0

    def __call__(self, address: int, nbytes: int) -> _Pin:
        self.pinned.append(nbytes)
        return self

    def close(self) -> None:
        self.closed += 1


def test_wait_spare_returns_once_the_next_segment_is_ready_and_the_roll_takes_it(shm_dir: Path) -> None:
    log = RecoveryLog.open(shm_dir / "log", {"backend": "dram", "fsync": "never", "mapped_segment_bytes": 4 << 20})
    assert log.wait_spare(0.1) is False  # nothing prepares one: not registered
    log.append(defs=_specs())
    pin = _Pin()
    log.set_mapping_registrar(pin)
    assert log.wait_spare(30.0) is True
    spare = log._spare
    assert spare is not None and spare.stats["made"] == 1 and len(pin.pinned) == 2  # active + spare
    w = slotlog.StepLogWriter(log, threads=2)
    keep: list[np.ndarray] = []
    rolled = False
    for i, (deltas, meta) in enumerate(_steps(40)):
        w.submit(i, _blob(deltas, meta, keep))
        w.wait(i)
        if not rolled and int(w.state()["end"]) > (3 << 19):  # 3 MiB more do not fit the 4 MiB segment
            assert w.roll_if_needed(3 << 20) is True
            rolled = True
    w.stop()
    assert rolled and len(list((shm_dir / "log").glob("incr.*.cft"))) == 2
    # the roll took the prepared segment (none made on the spot), and the worker made the next one right after
    # (a lessee's roll is followed by no append that would ask for it)
    assert spare.stats["taken"] == 1 and log.roll_stats["on_the_spot"] == 0
    assert log.wait_spare(30.0) is True and spare.stats["made"] == 2
    log.close()
    assert replay(shm_dir / "log").outcome is Outcome.OK


@pytest.mark.parametrize("ahead", [True, False])
def test_an_engine_prepares_its_bulk_buffer_at_construction(shm_dir: Path, ahead: bool) -> None:
    """max_batch_tokens 40 > a ring slot's 32 rows: prefill steps go through the bulk buffer; with
    ``prepare_ahead`` it exists once the engine is built and no step allocates it. Either way the log holds what
    the generic path's does."""
    opts = {**OPTIONS, "backend": "dram", "max_batch_tokens": 40, "async_epochs": True, "async_depth": 4,
            "prepare_ahead": ahead}
    ga = Engine(tiny_model("llama"), shm_dir / "generic", {**opts, "step_epochs": "runtime"})
    ca = Engine(tiny_model("llama"), shm_dir / "c", {**opts, "step_epochs": "c"})
    assert ca.fast.cap_rows == 32
    assert (ca.fast.bulk is not None) == ahead
    if ahead:
        assert ca.fast.bulk.numel() >= 40 * ca.geo.row_bytes and ca.fast.t["alloc"] == 0.0
    for e in (ga, ca):
        for a in workload():
            e.submit(a[2], a[3], request_id=a[1])
        while e.has_work:
            e.step()
    assert ca.fast.bulk_steps > 0 and ca.fast.fallbacks == 0
    assert (ca.fast.t["alloc"] == 0.0) == ahead
    assert ca.fast.largest["bytes"] > 32 * ca.geo.row_bytes and ca.fast.largest["write_ms"] > 0
    assert {r.id: r.generated for r in ga.finished.values()} == {r.id: r.generated for r in ca.finished.values()}
    ga.close()
    ca.close()
    sg, sc = _state(shm_dir / "generic"), _state(shm_dir / "c")
    assert sg[1] == sc[1] and sg[2] == sc[2]
    assert all(sg[0][k] == sc[0][k] for k in ("kv", "tokens", "rng"))


@pytest.mark.parametrize("pipelined", [False, True])
def test_prefill_chunks_take_the_placed_path_and_recover_token_exact(shm_dir: Path, pipelined: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with more rows than a ring slot goes through the generic path when the log places payloads
    (the default on a GPU with a registered DRAM log; CONCORDIA_STEP_EPOCH_BULK=placed here, where the CPU
    tracker copies them): counted as placed, not as a fallback; the decode steps around it keep the C path; the
    tokens are those of no log and a recovered engine continues token-exact."""
    monkeypatch.setenv("CONCORDIA_STEP_EPOCH_BULK", "placed")
    from concordia_ft.serve.stepepochs import StepEpochs

    opts = {**OPTIONS, "backend": "dram", "step_epochs": "c", "async_epochs": pipelined, "async_depth": 4}
    eng = Engine(tiny_model("llama"), shm_dir / "log", opts)
    eng.fast = StepEpochs(eng, cap_rows=8, slots=eng.fast.n_slots)
    ref = drive(Engine(tiny_model("llama"), None, {**OPTIONS, "checkpoint": False}), workload())
    arr = workload()
    half = drive(eng, arr, max_steps=18)
    assert eng.fast.placed_steps > 0 and eng.fast.fallbacks == 0 and eng.fast.bulk_steps == 0
    assert eng.fast.steps > 5
    eng.close()
    rec = Engine.recover(shm_dir / "log", tiny_model("llama"), {**opts})
    got = drive(rec, arr)
    rec.close()
    assert got == ref
    assert all(ref[rid][: len(t)] == t for rid, t in half.items())


def test_logprob_requests_take_the_step_path_and_their_region_is_logged(shm_dir: Path) -> None:
    """Requests asking for log-probabilities: their steps are step epochs too (no fallback), the ``logprobs``
    region's pages go in them, and the log replays to the engine's bytes; a recovered engine has the outputs'
    log-probabilities."""
    eng = Engine(tiny_model("llama"), shm_dir / "log", {**OPTIONS, "step_epochs": "c", "backend": "dram"})
    eng.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=2), request_id="a")
    eng.submit([9, 10, 11], SamplingParams(max_new_tokens=20, temperature=0.0, logprobs=1), request_id="b")
    for _ in range(8):
        eng.step()
    assert eng.fast.steps == 8 and eng.fast.fallbacks == 0 and np.count_nonzero(eng.lp)
    want = eng.lp.copy()
    lps = [x.to_list() for x in eng.finished["a"].logprobs]
    eng.close()
    r = replay(shm_dir / "log")
    assert np.array_equal(np.frombuffer(bytes(r.regions["logprobs"].data), np.float32)[: len(want)], want)
    rec = Engine.recover(shm_dir / "log", tiny_model("llama"), {**OPTIONS, "step_epochs": "c", "backend": "dram"})
    assert [x.to_list() for x in rec.finished["a"].logprobs] == lps
    rec.close()
