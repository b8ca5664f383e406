"""Streamed restore (core/streamed.py): the chunks of a verified log, pushed through a ring into a buffer, give
exactly the bytes the image path gives: every page's newest committed version, superseded versions never
copied, pages no write supplied as zeros, a region redefined since starting from zeros; on any slot size, any
ring depth, one thread or several, and from a compacted log (a base + suffix). The device sink (cuda/streamed.py)
is checked against the same reference on the GPU (tests/gpu/test_serve_gpu.py)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import concordia_ft as cft
from concordia_ft.core import streamed as streamed_mod
from concordia_ft.core.replay import ReplayOptions, replay
from concordia_ft.core.streamed import HostSink, plan_streamed, run_streamed
from concordia_ft.errors import ConfigError, LogCorruptError
from concordia_ft.recovery import RecoveryOptions

PAGE = 512
ROW = 4 * PAGE  # a "row" of 4 pages, the paged region's block


def _write_log(log: Path, rng: np.random.Generator, *, steps: int, compact_at: int | None = None,
               redefine_at: int | None = None) -> dict[str, np.ndarray]:
    """A paged region written the way the engine writes a KV pool (prefill runs, one row per request per
    decode step, freed rows rewritten by a new owner), plus a dense one; returns the final bytes."""
    rows = 96
    kv = np.zeros(rows * ROW, dtype=np.uint8)
    flags = np.zeros(rows, dtype=np.uint8)
    small = np.zeros(3 * PAGE, dtype=np.uint8)
    with cft.Runtime(log, fsync="never", compact_after_bytes=None, page_bytes=PAGE) as rt:
        rt.register("kv", kv, "paged", block_bytes=ROW, dirty_blocks=flags, initially_zero=True)
        rt.register("small", small, "dense")
        for step in range(steps):
            if step == 0:  # a prefill: two long runs
                touched = list(range(0, 20)) + list(range(40, 57))
            else:  # decodes: one row each of 6 requests, sometimes a freed row rewritten
                touched = sorted({int(x) for x in rng.choice(rows - 5, 6, replace=False)})
            for r in touched:
                kv[r * ROW:(r + 1) * ROW] = rng.integers(1, 256, ROW, dtype=np.uint8)
                flags[r] = 1
            small[:] = rng.integers(0, 256, small.size, dtype=np.uint8)
            rt.checkpoint(meta={"step": step})
            if compact_at is not None and step == compact_at:
                rt.compact()
            if redefine_at is not None and step == redefine_at:
                rt.unregister("kv")
                kv[:] = 0
                flags[:] = 0
                kv[5 * ROW:6 * ROW] = 7
                flags[5] = 1
                rt.register("kv", kv, "paged", block_bytes=ROW, dirty_blocks=flags, initially_zero=False)
    return {"kv": kv.copy(), "small": small.copy()}


def _streamed(log: Path, name: str, *, slot_bytes: int, slots: int, threads: int) -> tuple[np.ndarray, object]:
    res = replay(log, materialize=False)
    assert res.pending is not None
    spec = res.specs[name]
    plan = res.pending.streamed_plan(name, slot_bytes)
    out = np.full(spec.n_pages * spec.page_bytes, 0xAB, dtype=np.uint8)  # garbage: every byte must be written
    stats = run_streamed(plan, HostSink(out, spec.page_bytes, slots=slots, slot_bytes=slot_bytes), threads=threads)
    res.close()
    return out[: spec.nbytes], (plan, stats)


@pytest.mark.parametrize(("slot_bytes", "slots", "threads"), [(PAGE, 2, 1), (3 * PAGE, 3, 2), (64 << 10, 4, 3),
                                                              (1 << 20, 2, 1)])
@pytest.mark.parametrize("shape", ["plain", "compacted", "redefined"])
def test_streamed_restore_equals_the_image_and_the_live_buffer(shm_dir: Path, slot_bytes: int, slots: int,
                                                               threads: int, shape: str) -> None:
    rng = np.random.default_rng(7)
    log = shm_dir / "log"
    kw = {"compact_at": 9} if shape == "compacted" else {"redefine_at": 12} if shape == "redefined" else {}
    final = _write_log(log, rng, steps=20, **kw)
    image = replay(log).regions["kv"].data
    assert np.array_equal(image, final["kv"])  # the reference: the image path
    got, (plan, stats) = _streamed(log, "kv", slot_bytes=slot_bytes, slots=slots, threads=threads)
    assert np.array_equal(got, final["kv"])
    assert plan.copy_bytes + plan.unfilled * PAGE == final["kv"].nbytes  # each live page copied exactly once
    # rows no one wrote (zeros) are written by the sink, not by a chunk; a redefinition logged every row anew
    assert (plan.unfilled > 0) == (shape != "redefined")
    assert stats.bytes == plan.copy_bytes
    assert all(c.nbytes <= slot_bytes for c in plan.chunks)


def test_superseded_versions_are_never_copied(shm_dir: Path) -> None:
    log = shm_dir / "log"
    kv = np.zeros(8 * ROW, dtype=np.uint8)
    flags = np.zeros(8, dtype=np.uint8)
    with cft.Runtime(log, fsync="never", compact_after_bytes=None, page_bytes=PAGE) as rt:
        rt.register("kv", kv, "paged", block_bytes=ROW, dirty_blocks=flags, initially_zero=True)
        for v in (1, 2, 3):  # row 2 three times, row 6 once (in the first epoch)
            kv[2 * ROW:3 * ROW] = v
            flags[2] = 1
            if v == 1:
                kv[6 * ROW:7 * ROW] = 9
                flags[6] = 1
            rt.checkpoint()
    res = replay(log, materialize=False)
    assert res.pending is not None
    plan = res.pending.streamed_plan("kv", 1 << 20)
    assert plan.records == 3
    assert plan.copy_bytes == 2 * ROW  # row 2's last version and row 6
    assert plan.superseded_bytes == 2 * ROW  # row 2's first two versions
    assert plan.unfilled == 6 * ROW // PAGE
    out = np.full(8 * ROW, 0xAB, dtype=np.uint8)
    run_streamed(plan, HostSink(out, PAGE, slots=2, slot_bytes=1 << 20), threads=1)
    res.close()
    assert np.array_equal(out, kv)
    assert (out[2 * ROW:3 * ROW] == 3).all()


def test_a_slot_smaller_than_a_page_is_refused(shm_dir: Path) -> None:
    log = shm_dir / "log"
    _write_log(log, np.random.default_rng(1), steps=2)
    res = replay(log, materialize=False)
    assert res.pending is not None
    spec = res.specs["kv"]
    with pytest.raises(ConfigError, match="smaller than region 'kv'"):
        plan_streamed(spec, 0, [], PAGE - 1)
    res.close()


def test_recovery_options_refuse_a_one_slot_ring() -> None:
    with pytest.raises(ConfigError, match="ring_slots"):
        RecoveryOptions(ring_slots=1)


# ------------------------------------------------------------------------------ deferred checksums
def _damage(log: Path, where: str) -> None:
    """Flip one byte of a 'kv' record: one whose pages the restore copies ("live") or one that is wholly
    superseded (never copied, only checksummed)."""
    res = replay(log, materialize=False, options=ReplayOptions(defer=("kv",)))
    assert res.pending is not None
    plan = res.pending.streamed_plan("kv", 1 << 20)
    copied = {plan.pieces[pid][0] for ch in plan.chunks for _, _, pid in ch.copies}
    pick = [c for i, c in enumerate(plan.checks) if (i in copied) == (where == "live")]
    assert pick, where
    c = pick[len(pick) // 2]
    path, offset, head, n = c.path, c.offset, bytes(c.data[:64]), c.data.nbytes
    del plan, pick, c
    res.close()
    raw = bytearray(Path(path).read_bytes())
    at = raw.find(head, offset)  # the payload's random bytes, after its epoch's header
    assert at >= 0
    raw[at + n // 2] ^= 0x20
    Path(path).write_bytes(bytes(raw))


@pytest.mark.parametrize("on_sink", [False, True], ids=["fill-threads", "sink"])
@pytest.mark.parametrize("where", ["live", "superseded"])
def test_a_deferred_checksum_failure_is_raised_by_the_streamed_restore(shm_dir: Path, where: str,
                                                                       on_sink: bool) -> None:
    log = shm_dir / "log"
    _write_log(log, np.random.default_rng(3), steps=30)
    _damage(log, where)
    with pytest.raises(LogCorruptError):  # the reference: pass 1 checking every payload
        replay(log)
    res = replay(log, materialize=False, options=ReplayOptions(defer=("kv",), threads=2))
    assert res.pending is not None and res.pending.deferred  # pass 1 let the kv records through unchecked
    plan = res.pending.streamed_plan("kv", 16 << 10)
    assert not res.pending.deferred  # handed to the plan
    out = np.zeros(plan.spec.n_pages * PAGE, dtype=np.uint8)
    # the sink checksums the copied pieces where they landed (the device sink's protocol), or the fill threads do
    with pytest.raises(LogCorruptError, match="'kv'.*checksum mismatch"):
        run_streamed(plan, HostSink(out, PAGE, slots=3, slot_bytes=16 << 10, verify=on_sink), threads=2)
    res.close()


@pytest.mark.parametrize(("on_sink", "prefault"), [(False, 0), (True, 0), (True, 2)])
def test_deferred_checks_of_an_undamaged_log_pass_and_cover_every_payload_byte(shm_dir: Path, on_sink: bool,
                                                                              prefault: int) -> None:
    log = shm_dir / "log"
    final = _write_log(log, np.random.default_rng(5), steps=30)
    res = replay(log, materialize=False, options=ReplayOptions(defer=("kv",)))
    assert res.pending is not None
    total = sum(c.data.nbytes for c in res.pending.deferred)
    plan = res.pending.streamed_plan("kv", 8 << 10)
    assert sum(n for _, _, n in plan.pieces) == total  # copied pieces + superseded pieces tile every record
    assert plan.crc_only  # some bytes are only checksummed (superseded rows)
    out = np.zeros(plan.spec.n_pages * PAGE, dtype=np.uint8)
    st = run_streamed(plan, HostSink(out, PAGE, slots=4, slot_bytes=8 << 10, verify=on_sink), threads=3,
                      prefault=prefault)
    res.close()
    assert st.extra["verified_bytes"] == total
    assert st.extra["verify_on_device"] == float(on_sink)
    if on_sink:  # every copied piece was checksummed by the sink, the superseded ones on the host
        assert st.extra["device_verified_pieces"] == len(plan.pieces) - len(plan.crc_only)
    assert np.array_equal(out[: final["kv"].nbytes], final["kv"])


def test_a_runtime_with_deferred_checks_refuses_damage_before_restoring_or_appending(shm_dir: Path) -> None:
    log = shm_dir / "log"
    _write_log(log, np.random.default_rng(6), steps=30)
    _damage(log, "live")
    rt = cft.Runtime(log, fsync="never", page_bytes=PAGE, recovery={"defer_verify": ("kv",)})  # opens: kv unchecked
    kv = np.zeros(96 * ROW, dtype=np.uint8)
    rt.register("kv", kv, "paged", block_bytes=ROW, dirty_blocks=np.zeros(96, dtype=np.uint8))
    rt.register("small", np.zeros(3 * PAGE, dtype=np.uint8), "dense")
    with pytest.raises(LogCorruptError, match="'kv'.*checksum mismatch"):
        rt.checkpoint()  # nothing is appended after an unchecked epoch
    with pytest.raises(LogCorruptError, match="'kv'.*checksum mismatch"):
        rt.recover_into(keep_images=False)  # a host region: checked before its image is built
    assert not kv.any()
    rt.close()


def _mapped_kib(path: Path) -> int:
    """Kilobytes of ``path``'s mappings that this process's page tables hold (``Rss`` in /proc/self/smaps)."""
    total, mine = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: its range, ..., its file
            mine = line.endswith(str(path))
        elif mine and line.startswith("Rss:"):
            total += int(head[1])
    return total


def _big_paged_log(log: Path) -> np.ndarray:
    pages = 2048  # 8 MiB of 4 KiB pages, one prefill-like epoch and a few decode-like ones
    kv = np.random.default_rng(11).integers(1, 256, pages * 4096, dtype=np.uint8)
    flags = np.ones(pages // 4, dtype=np.uint8)
    with cft.Runtime(log, fsync="never", compact_after_bytes=None, page_bytes=4096) as rt:
        rt.register("kv", kv, "paged", block_bytes=4 * 4096, dirty_blocks=flags)
        rt.checkpoint()
        for r in (3, 77, 300):
            kv[r * 16384:(r + 1) * 16384] ^= 0x5A
            flags[r] = 1
            rt.checkpoint()
    return kv.copy()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps (Linux)")
def test_populate_threads_map_the_deferred_payloads_in_during_the_open(shm_dir: Path) -> None:
    log = shm_dir / "log"
    final = _big_paged_log(log)
    segs = sorted(log.glob("*.cft"))
    seg_kib = sum(p.stat().st_size for p in segs) // 1024
    assert seg_kib > 8 << 10
    # without populate threads a deferred payload's pages are not touched by the open (the copy threads fault them;
    # segments of the engine's size are checked on several threads, so they are not mapped with MAP_POPULATE)
    res = replay(log, materialize=False, options=ReplayOptions(defer=("kv",), populate=0, threads=2,
                                                               parallel_min_bytes=0))
    assert res.pending is not None and res.pending.populate_stats() == {}
    cold = sum(_mapped_kib(p) for p in segs)
    res.close()
    assert cold < seg_kib // 4, (cold, seg_kib)
    res = replay(log, materialize=False, options=ReplayOptions(defer=("kv",), populate=2, threads=2,
                                                               parallel_min_bytes=0))
    assert res.pending is not None
    assert res.timings.populate_bytes == sum(p.stat().st_size for p in segs)
    for _ in range(200):  # best effort and asynchronous: wait for the two threads (milliseconds here)
        if res.pending.populate_stats()["populate_pending"] == 0:
            break
        time.sleep(0.01)
    st = res.pending.populate_stats()
    if st["populated_bytes"] == 0:
        res.close()
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")
    warm = sum(_mapped_kib(p) for p in segs)
    assert st["populated_bytes"] == res.timings.populate_bytes
    assert warm >= seg_kib - 8, (warm, seg_kib)  # every page of every segment is in this process's page tables
    plan = res.pending.streamed_plan("kv", 64 << 10)
    out = np.zeros(plan.spec.n_pages * 4096, dtype=np.uint8)
    run_streamed(plan, HostSink(out, 4096, slots=4, slot_bytes=64 << 10, verify=True), threads=2)
    res.close()  # stops the populate threads (idle by now) before the mappings go
    assert np.array_equal(out[: final.nbytes], final)


def test_a_replay_closed_while_populating_unmaps_cleanly(shm_dir: Path) -> None:
    log = shm_dir / "log"
    _big_paged_log(log)
    for _ in range(5):  # closed at once: queued pieces are cancelled, running ones finish before the unmap
        res = replay(log, materialize=False, options=ReplayOptions(defer=("kv",), populate=1))
        pending = res.pending
        assert pending is not None
        res.close()
        assert pending.populate_stats()["populate_pending"] == 0


def test_recovery_options_pass_the_populate_threads_to_the_replay() -> None:
    assert RecoveryOptions().replay_options().populate == 0  # off by default (slower on the H200 host)
    assert RecoveryOptions(populate=3).replay_options().populate == 3
    with pytest.raises(ConfigError, match="populate"):
        RecoveryOptions(populate=-1)
    with pytest.raises(ConfigError, match="populate"):
        ReplayOptions(populate=1.5)  # type: ignore[arg-type]


def test_without_a_verifying_sink_nothing_is_sent_around_the_fills(shm_dir: Path) -> None:
    """A mirror holding every byte, but a sink that does not checksum what lands: every chunk goes through the
    fills (which checksum), none straight from the mirror."""
    from concordia_ft.core.streamed import range_translator

    log = shm_dir / "log"
    final = _big_paged_log(log)
    res = replay(log, materialize=False, options=ReplayOptions(defer=("kv",)))
    assert res.pending is not None
    whole = range_translator([(a, a + ln, a, ln) for _, a, ln in res.pending.mapped_segments()])
    plan = res.pending.streamed_plan("kv", 64 << 10)
    out = np.zeros(plan.spec.n_pages * 4096, dtype=np.uint8)
    sink = HostSink(out, 4096, slots=2, slot_bytes=64 << 10, verify=False)
    st = run_streamed(plan, sink, threads=2, mirror=whole)
    res.close()
    assert "mirror_chunks" not in st.extra
    assert np.array_equal(out[: final.nbytes], final)


@pytest.mark.skipif(not streamed_mod.stream_copy_available(), reason="the C extension _ntcopy is not built")
def test_the_streaming_copy_equals_memcpy_at_every_alignment() -> None:
    from concordia_ft.core import _ntcopy  # type: ignore[attr-defined]

    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    for _ in range(200):  # heads and tails of every alignment, bodies from none to megabytes
        n = int(rng.choice([int(rng.integers(0, 300)), int(rng.integers(8000, 70000)), int(rng.integers(1, 3 << 20))]))
        so = int(rng.integers(0, src.size - n + 1))
        dst = np.full(n + 512, 0x5A, dtype=np.uint8)
        do = int(rng.integers(0, 256))
        _ntcopy.copy(dst[do:do + n], memoryview(src[so:so + n]))
        assert np.array_equal(dst[do:do + n], src[so:so + n])
        assert (dst[:do] == 0x5A).all() and (dst[do + n:] == 0x5A).all()  # nothing outside the destination
    with pytest.raises(ValueError, match="destination of 4 bytes, source of 5"):
        _ntcopy.copy(np.zeros(4, dtype=np.uint8), b"abcde")


@pytest.mark.skipif(not streamed_mod.stream_copy_available(), reason="the C extension _ntcopy is not built")
@pytest.mark.parametrize("damaged", [False, True])
def test_nontemporal_fills_restore_the_same_bytes_and_catch_the_same_damage(shm_dir: Path, damaged: bool) -> None:
    log = shm_dir / "log"
    final = _write_log(log, np.random.default_rng(8), steps=30)
    if damaged:
        _damage(log, "live")
    res = replay(log, materialize=False, options=ReplayOptions(defer=("kv",), threads=2))
    assert res.pending is not None
    plan = res.pending.streamed_plan("kv", 40 << 10)
    out = np.full(plan.spec.n_pages * PAGE, 0xAB, dtype=np.uint8)
    for on_sink in (False, True):
        sink = HostSink(out, PAGE, slots=3, slot_bytes=40 << 10, verify=on_sink)
        if damaged:
            with pytest.raises(LogCorruptError, match="'kv'.*checksum mismatch"):
                run_streamed(plan, sink, threads=3, nontemporal=True)
            continue
        st = run_streamed(plan, sink, threads=3, nontemporal=True)
        assert st.extra["nontemporal"] == 1.0
        assert np.array_equal(out[: final["kv"].nbytes], final["kv"])
        out[:] = 0xAB
    res.close()


def test_nontemporal_is_automatic_by_default_and_refuses_what_is_not_a_bool(shm_dir: Path) -> None:
    assert RecoveryOptions().nontemporal is None and RecoveryOptions(nontemporal=True).nontemporal
    with pytest.raises(ConfigError, match="nontemporal"):
        RecoveryOptions(nontemporal="yes")  # type: ignore[arg-type]
    # what a runtime's streamed restores use: streaming stores where the extension is built, unless told
    for nt, want in ((None, streamed_mod.stream_copy_available()), (False, False), (True, True)):
        with cft.Runtime(shm_dir / f"log-{nt}", fsync="never", recovery=RecoveryOptions(nontemporal=nt)) as rt:
            assert rt._nontemporal() == want


@pytest.mark.parametrize("case", ["whole", "half", "damaged"])
def test_mirrored_chunks_come_from_the_mirror_and_are_still_checked(shm_dir: Path, case: str) -> None:
    """``run_streamed(mirror=...)``: a copy of each segment in other memory (what cuda/mirror.py keeps pinned)
    serves the one-run chunks it holds below its mark; the rest go through the ring. A copy that disagrees with
    the log fails the checksum of the record it served (the log file's), so it is never taken for the log."""
    from concordia_ft.core.streamed import range_translator

    log = shm_dir / "log"
    final = _big_paged_log(log)
    res = replay(log, materialize=False, options=ReplayOptions(defer=("kv",), threads=2, parallel_min_bytes=0))
    assert res.pending is not None
    segs = res.pending.mapped_segments()
    assert segs and all(n.endswith(".cft") for n, _, _ in segs)
    copies = {n: np.fromfile(log / n, dtype=np.uint8) for n, _, _ in segs}
    if case == "damaged":  # a byte of the prefill's rows in the copy only: the log file itself is intact
        seg = max(copies, key=lambda n: copies[n].nbytes)
        at = copies[seg].tobytes().find(final[:64].tobytes())
        assert at >= 0
        copies[seg][at + 4096 * 100] ^= 0x01
    marks = {n: c.nbytes // (2 if case == "half" else 1) for n, c in copies.items()}
    translate = range_translator([(a, a + ln, int(copies[n].ctypes.data), marks[n]) for n, a, ln in segs])
    plan = res.pending.streamed_plan("kv", 64 << 10)
    out = np.zeros(plan.spec.n_pages * 4096, dtype=np.uint8)
    sink = HostSink(out, 4096, slots=2, slot_bytes=64 << 10, verify=True)
    try:
        if case == "damaged":
            with pytest.raises(LogCorruptError, match="'kv'.*checksum mismatch"):
                run_streamed(plan, sink, threads=2, mirror=translate)
            return
        st = run_streamed(plan, sink, threads=2, mirror=translate)
    finally:
        res.close()
    assert np.array_equal(out[: final.nbytes], final)
    one_run = sum(c.run_start >= 0 for c in plan.chunks)
    assert 0 < st.extra["mirror_chunks"] <= one_run
    if case == "whole":
        assert st.extra["mirror_chunks"] == one_run  # every one-run chunk, none through the ring
    else:
        assert st.extra["mirror_chunks"] < one_run  # the part past the marks came through the ring
    assert st.extra["mirror_bytes"] > 0


def test_the_translator_refuses_ranges_outside_or_past_the_mark() -> None:
    from concordia_ft.core.streamed import range_translator

    t = range_translator([(1000, 2000, 50_000, 600), (5000, 5100, 90_000, 100)])
    assert t(1000, 600) == 50_000 and t(1100, 10) == 50_100
    assert t(1100, 600) is None  # past the mark
    assert t(999, 2) is None and t(2000, 1) is None and t(4000, 1) is None  # outside every row
    assert t(5050, 50) == 90_050 and t(5050, 51) is None
