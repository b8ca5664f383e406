"""Replay on several threads gives exactly what replay on one thread gives: the same bytes, the same named
outcome, and for damage the same error (file, offset, reason), the earliest damage winning, also when the
damaged bytes sit in a chunk of a large payload that a worker thread checksums.

Also: CRC32C combination (what makes one huge payload checkable in parallel), the deferred copy pass and
its allocators, and the Runtime restoring from the replay it verified when it opened the log.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import concordia_ft as cft
from concordia_ft.core import format as F
from concordia_ft.core.checksums import ChecksumItem, crc32c_combine, crc32c_shift, first_mismatch
from concordia_ft.core.epochs import decode_epoch
from concordia_ft.core.replay import Outcome, ReplayOptions, replay
from concordia_ft.errors import ConfigError, LogCorruptError, LogError, RecoveryError

SERIAL = ReplayOptions(threads=1)
# every segment and copy goes to 3 threads, and payloads are cut into 64 KiB pieces
PARALLEL = ReplayOptions(threads=3, parallel_min_bytes=0, chunk_bytes=64 << 10)
PAGE = 4096


# ------------------------------------------------------------------------------------------- CRC32C
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32c_combine_equals_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert crc32c_combine(_crc32c.crc32c(a), _crc32c.crc32c(b), len(b)) == _crc32c.crc32c(a + b)
    assert crc32c_combine(_crc32c.crc32c(a), _crc32c.crc32c(b), len(b), crc32c_shift(len(b))) == \
        _crc32c.crc32c(a + b)


@pytest.mark.parametrize("len_b", [1 << 16, (1 << 20) + 17, 8 << 20])
def test_crc32c_combine_for_long_pieces(len_b: int) -> None:
    a = os.urandom(1000)
    b = os.urandom(len_b)
    assert crc32c_combine(_crc32c.crc32c(a), _crc32c.crc32c(b), len_b) == _crc32c.crc32c(a + b)


def test_crc32c_shift_refuses_negative_lengths() -> None:
    with pytest.raises(ValueError, match="negative"):
        crc32c_shift(-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20_000), min_size=1, max_size=12), st.data())
def test_first_mismatch_on_threads_equals_the_serial_scan(sizes: list[int], data: st.DataObject) -> None:
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(len(sizes))
    blobs = [memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in sizes]
    bad = data.draw(st.sets(st.integers(0, len(sizes) - 1)))
    keys = data.draw(st.permutations(range(len(sizes))))  # items arrive in any order; keys decide
    items = [ChecksumItem((keys[i],), b, _crc32c.crc32c(b) ^ (1 if i in bad else 0)) for i, b in enumerate(blobs)]
    want = min((keys[i] for i in bad), default=None)
    serial = first_mismatch(items)
    with ThreadPoolExecutor(3) as pool:
        threaded = first_mismatch(items, pool=pool, workers=3, chunk_bytes=997)  # many odd-sized pieces
    assert (serial.key[0] if serial else None) == want
    assert (threaded.key[0] if threaded else None) == want


# --------------------------------------------------------------------------------------- random logs
def build_random_log(log_dir: Path, seed: int, n_epochs: int = 6) -> dict[int, dict[str, str]]:
    """Regions with payloads from one page to ~600 KiB (several 64 KiB checksum pieces), PAGES and RUNS
    records, an unwritten tail of a paged region, a region dropped and one redefined on the way. Returns
    epoch -> region -> sha256 of the exact bytes it committed."""
    rng = np.random.default_rng(seed)
    big = rng.integers(0, 256, int(rng.integers(150, 400)) * PAGE + int(rng.integers(1, PAGE)), dtype=np.uint8)
    n_blocks = 64
    kv = np.zeros(n_blocks * 2 * PAGE, dtype=np.uint8)
    flags = np.zeros(n_blocks, dtype=np.uint8)
    dense = rng.integers(0, 256, 5 * PAGE + 123, dtype=np.uint8)
    extra = rng.integers(0, 256, 3 * PAGE, dtype=np.uint8)
    want: dict[int, dict[str, str]] = {}
    rows = 0
    with cft.Runtime(log_dir, fsync="never", compact_after_bytes=None) as rt:
        rt.register("big", big, "opaque")
        rt.register("kv", kv, "paged", block_bytes=2 * PAGE, dirty_blocks=flags, initially_zero=True)
        rt.register("dense", dense, "dense")
        rt.register("extra", extra, "opaque")
        for e in range(1, n_epochs + 1):
            if e > 1:
                for p in rng.choice(big.size // PAGE, size=int(rng.integers(1, 40)), replace=False):
                    big[int(p) * PAGE + int(rng.integers(PAGE))] ^= 0x5A
                if e % 2 == 0:  # a long contiguous change: RUNS, several checksum pieces
                    lo = int(rng.integers(0, big.size // 2))
                    big[lo : lo + 300_000] = rng.integers(0, 256, min(300_000, big.size - lo), dtype=np.uint8)
                dense[:] = rng.integers(0, 256, dense.size, dtype=np.uint8)
            new_rows = int(rng.integers(1, 12)) if rows < n_blocks - 12 else 0
            kv[rows * 2 * PAGE : (rows + new_rows) * 2 * PAGE] = rng.integers(0, 256, new_rows * 2 * PAGE,
                                                                             dtype=np.uint8)
            flags[rows : rows + new_rows] = 1
            rows += new_rows
            if e == 3:
                rt.unregister("extra")
            if e == 4:  # redefined with another size: starts from these bytes, not from the old ones
                extra = rng.integers(0, 256, 2 * PAGE + 5, dtype=np.uint8)
                rt.register("extra", extra, "opaque")
            assert rt.checkpoint({"epoch": e, "rows": rows}) == e
            regions = {"big": big, "kv": kv, "dense": dense} | ({} if e == 3 else {"extra": extra})
            want[e] = {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in regions.items()}
    return want


def _digests(res: Any) -> dict[str, str]:
    return {n: hashlib.sha256(img.data.tobytes()).hexdigest() for n, img in res.regions.items()}


def _run(log_dir: Path, opts: ReplayOptions) -> tuple[str, Any]:
    """('ok', comparable result) or ('raise', (type, path, offset, reason))."""
    try:
        res = replay(log_dir, options=opts, collect_summaries=True)
    except LogCorruptError as e:
        return "raise", (type(e).__name__, e.path, e.offset, e.reason)
    except LogError as e:
        return "raise", (type(e).__name__, str(e))
    tail = None if res.tail is None else (res.tail.segment, res.tail.offset, res.tail.kind, res.tail.reason)
    return "ok", (res.outcome, res.epoch, res.meta, _digests(res), tail, res.end_segment, res.end_offset,
                  res.bytes_read, res.trailing_zero_bytes, [vars(s) for s in res.epochs])


def _spans(path: Path) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(epoch start, epoch end, payload [start, end) list) of every epoch in a segment."""
    buf = memoryview(path.read_bytes())
    pos, out = F.SEGMENT_HEADER_BYTES, []
    while pos < len(buf):
        ep = decode_epoch(buf, pos)
        out.append((pos, pos + ep.total_bytes,
                    [(pos + e.payload_off, pos + e.payload_off + e.payload_len) for e in ep.entries if e.payload_len]))
        pos += ep.total_bytes
    return out


def _segment(log_dir: Path) -> Path:
    (seg,) = sorted(log_dir.glob("incr.*.cft"))
    return seg


def _flip(path: Path, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_parallel_replay_equals_serial_replay_on_random_logs(shm_dir: Path, seed: int) -> None:
    want = build_random_log(shm_dir / "log", seed)
    serial, parallel = _run(shm_dir / "log", SERIAL), _run(shm_dir / "log", PARALLEL)
    assert serial[0] == "ok" and serial == parallel
    outcome, epoch, meta, digests, *_ = parallel[1]
    assert outcome is Outcome.OK and epoch == 6 and meta["epoch"] == 6 and digests == want[6]
    # the chunked path was exercised: some payload spans several checksum pieces
    assert max(hi - lo for _, _, pays in _spans(_segment(shm_dir / "log")) for lo, hi in pays) > 3 * (64 << 10)


def _large_payload(spans: list[tuple[int, int, list[tuple[int, int]]]], i: int) -> tuple[int, int]:
    lo, hi = max(spans[i][2], key=lambda p: p[1] - p[0])
    assert hi - lo > 2 * (64 << 10), "the test needs a payload of several checksum pieces"
    return lo, hi


@pytest.mark.parametrize("where", ["first-byte", "piece-boundary", "middle", "last-byte"])
def test_damage_in_a_worker_checked_piece_is_reported_at_its_epoch(shm_dir: Path, where: str) -> None:
    log = shm_dir / "log"
    build_random_log(log, 7)
    seg = _segment(log)
    spans = _spans(seg)
    i = next(k for k in range(len(spans) - 1) if max(h - lo for lo, h in spans[k][2]) > 2 * (64 << 10))
    lo, hi = _large_payload(spans, i)
    off = {"first-byte": lo, "piece-boundary": lo + (64 << 10), "middle": (lo + hi) // 2, "last-byte": hi - 1}[where]
    _flip(seg, off)
    serial, parallel = _run(log, SERIAL), _run(log, PARALLEL)
    assert parallel == serial
    assert parallel[0] == "raise"
    name, path, offset, reason = parallel[1]
    assert name == "LogCorruptError" and path.endswith(seg.name) and offset == spans[i][0]
    assert "payload checksum mismatch" in reason and "a valid epoch follows" in reason


def test_damage_in_the_last_epoch_payload_is_a_damaged_tail(shm_dir: Path) -> None:
    log = shm_dir / "log"
    want = build_random_log(log, 8)
    seg = _segment(log)
    spans = _spans(seg)
    lo, hi = max(spans[-1][2], key=lambda p: p[1] - p[0])
    _flip(seg, (lo + hi) // 2)
    serial, parallel = _run(log, SERIAL), _run(log, PARALLEL)
    assert parallel == serial and parallel[0] == "ok"
    outcome, epoch, _, digests, tail, *_ = parallel[1]
    assert outcome is Outcome.DAMAGED_TAIL and epoch == len(spans) - 1 and digests == want[epoch]
    assert tail[1] == spans[-1][0] and tail[2].value == "damaged"


def test_the_earliest_damage_wins(shm_dir: Path) -> None:
    log = shm_dir / "log"
    build_random_log(log, 9)
    seg = _segment(log)
    spans = _spans(seg)
    # payload damage in epoch 5 and 2 (2 is reported), then a header broken in epoch 4 (still 2)
    for i in (4, 1):
        lo, hi = max(spans[i][2], key=lambda p: p[1] - p[0])
        _flip(seg, hi - 1)
    serial, parallel = _run(log, SERIAL), _run(log, PARALLEL)
    assert parallel == serial and parallel[0] == "raise" and parallel[1][2] == spans[1][0]
    _flip(seg, spans[3][0] + 20)
    serial, parallel = _run(log, SERIAL), _run(log, PARALLEL)
    assert parallel == serial and parallel[0] == "raise" and parallel[1][2] == spans[1][0]


def test_structural_damage_before_payload_damage_wins(shm_dir: Path) -> None:
    log = shm_dir / "log"
    build_random_log(log, 10)
    seg = _segment(log)
    spans = _spans(seg)
    lo, hi = max(spans[4][2], key=lambda p: p[1] - p[0])
    _flip(seg, lo + 5)  # epoch 5's payload
    _flip(seg, spans[1][1] - 3)  # epoch 2's commit marker
    serial, parallel = _run(log, SERIAL), _run(log, PARALLEL)
    assert parallel == serial and parallel[0] == "raise" and parallel[1][2] == spans[1][0]


def test_random_damage_anywhere_gives_the_serial_verdict(shm_dir: Path) -> None:
    log = shm_dir / "log"
    build_random_log(log, 11, n_epochs=5)
    seg = _segment(log)
    size = seg.stat().st_size
    rng = np.random.default_rng(12)
    offsets = [int(o) for o in rng.integers(F.SEGMENT_HEADER_BYTES, size, 40)]
    offsets += [s for s, _, _ in _spans(seg)]  # every epoch header's first byte
    for off in offsets:
        _flip(seg, off)
        try:
            assert _run(log, PARALLEL) == _run(log, SERIAL), off
        finally:
            _flip(seg, off)


def test_torn_tail_and_trailing_zeros_on_threads(shm_dir: Path) -> None:
    log = shm_dir / "log"
    want = build_random_log(log, 13, n_epochs=4)
    seg = _segment(log)
    spans = _spans(seg)
    with open(seg, "ab") as f:
        f.write(bytes(3 * PAGE))  # preallocation zeros: still ok
    assert _run(log, PARALLEL) == _run(log, SERIAL)
    os.truncate(seg, spans[-1][0] + (spans[-1][1] - spans[-1][0]) // 2)  # the last epoch cut short
    serial, parallel = _run(log, SERIAL), _run(log, PARALLEL)
    assert parallel == serial and parallel[1][0] is Outcome.TORN_TAIL and parallel[1][3] == want[3]


def test_newer_epoch_version_on_threads_says_upgrade_unless_damage_comes_first(shm_dir: Path) -> None:
    log = shm_dir / "log"
    build_random_log(log, 14, n_epochs=4)
    seg = _segment(log)
    spans = _spans(seg)
    start = spans[2][0]  # epoch 3: version 2 with a valid header checksum
    raw = bytearray(seg.read_bytes()[start : start + F.EPOCH_HEADER_BYTES])
    raw[8:10] = struct.pack("<H", F.FORMAT_VERSION + 1)
    raw[48:52] = struct.pack("<I", _crc32c.crc32c(bytes(raw[:48])))
    with open(seg, "r+b") as f:
        f.seek(start)
        f.write(raw)
    serial, parallel = _run(log, SERIAL), _run(log, PARALLEL)
    assert parallel == serial and parallel[0] == "raise" and "upgrade" in parallel[1][1]
    lo, _ = max(spans[1][2], key=lambda p: p[1] - p[0])
    _flip(seg, lo)  # damage in epoch 2, before the newer epoch: that is what is reported
    serial, parallel = _run(log, SERIAL), _run(log, PARALLEL)
    assert parallel == serial and parallel[1][0] == "LogCorruptError" and parallel[1][2] == spans[1][0]


def test_replay_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="threads"):
        ReplayOptions(threads=0)
    with pytest.raises(ConfigError, match="chunk_bytes"):
        ReplayOptions(chunk_bytes=1000)
    with pytest.raises(ConfigError, match="unknown replay option"):
        ReplayOptions.coerce({"thread": 2})
    assert ReplayOptions.coerce({"threads": 2}).workers == 2


# ----------------------------------------------------------------------------- deferred copy, allocators
def test_deferred_copy_into_dirty_memory_equals_the_default_images(shm_dir: Path) -> None:
    log = shm_dir / "log"
    build_random_log(log, 15)
    ref = replay(log)
    for opts in (SERIAL, PARALLEL):
        res = replay(log, options=opts, materialize=False)
        assert res.regions == {} and res.pending is not None and res.epoch == ref.epoch and res.meta == ref.meta
        assert res.specs == ref.specs
        handed: list[np.ndarray] = []

        def dirty(nbytes: int, handed: list[np.ndarray] = handed) -> np.ndarray:
            a = np.full(nbytes + 100, 0xAB, dtype=np.uint8)  # larger than asked, and not zero
            handed.append(a)
            return a

        images = res.materialize({"kv": dirty, "big": dirty})
        assert res.pending is None and len(handed) == 2
        assert _digests(res) == _digests(ref)  # kv's unwritten blocks were zeroed
        assert np.shares_memory(images["kv"].padded, handed[0]) or np.shares_memory(images["kv"].padded, handed[1])
        assert res.materialize() is images  # once only; later calls return the same images


def test_a_released_deferred_replay_cannot_be_copied(shm_dir: Path) -> None:
    log = shm_dir / "log"
    build_random_log(log, 16, n_epochs=2)
    res = replay(log, materialize=False)
    res.close()
    res.close()
    with pytest.raises(LogError, match="released"):
        res.materialize()


@pytest.mark.parametrize("bad", ["small", "read-only", "not-a-buffer"])
def test_an_allocator_that_returns_unusable_memory_is_refused(shm_dir: Path, bad: str) -> None:
    log = shm_dir / "log"
    build_random_log(log, 17, n_epochs=2)

    def alloc(nbytes: int) -> Any:
        if bad == "small":
            return np.zeros(nbytes - 1, dtype=np.uint8)
        if bad == "read-only":
            return bytes(nbytes)
        return 42

    with pytest.raises(ConfigError, match="allocator for region 'dense'"):
        replay(log, allocs={"dense": alloc})


# --------------------------------------------------------------------------------------------- runtime
def test_recover_into_restores_from_the_replay_verified_at_open(shm_dir: Path) -> None:
    """No second replay: with the segment file gone after the open, the restore still has every byte (the
    open-time replay holds the mapped file), where a fresh replay would find the segment missing."""
    log = shm_dir / "log"
    build_random_log(log, 18)
    ref = replay(log)
    bufs = {n: np.zeros(sp.nbytes, dtype=np.uint8) for n, sp in ref.specs.items()}
    with cft.Runtime(log, fsync="never", recovery={"threads": 2}) as rt:
        for n, b in bufs.items():
            rt.register(n, b, "dense")
        _segment(log).unlink()
        with pytest.raises(LogCorruptError, match="missing"):
            replay(log)
        rec = rt.recover_into(keep_images=False)
        assert rec.epoch == ref.epoch and rec.images == {}
        assert rec.timings.verify_s > 0 and rec.timings.copy_bytes > 0 and rec.restore_s > 0
    for n, b in bufs.items():
        assert b.tobytes() == ref.regions[n].data.tobytes(), n


def test_recover_into_after_the_writer_cut_a_torn_tail(shm_dir: Path) -> None:
    log = shm_dir / "log"
    want = build_random_log(log, 19, n_epochs=4)
    seg = _segment(log)
    spans = _spans(seg)
    os.truncate(seg, spans[-1][1] - 100)  # epoch 4 torn
    ref = replay(log)
    assert ref.outcome is Outcome.TORN_TAIL
    bufs = {n: np.zeros(sp.nbytes, dtype=np.uint8) for n, sp in ref.specs.items()}
    with cft.Runtime(log, fsync="never") as rt:
        assert rt.open_report.cut_bytes > 0 and seg.stat().st_size == spans[-1][0]  # cut below the mapping's end
        for n, b in bufs.items():
            rt.register(n, b, "dense")
        rec = rt.recover_into()
        assert rec.epoch == 3
    assert {n: hashlib.sha256(b.tobytes()).hexdigest() for n, b in bufs.items()} == want[3]


def test_recover_into_after_a_checkpoint_replays_afresh(shm_dir: Path) -> None:
    log = shm_dir / "log"
    build_random_log(log, 20, n_epochs=2)
    with cft.Runtime(log, fsync="never") as rt:
        a = np.arange(1000, dtype=np.int64)
        rt.register("new", a, "dense")
        assert rt.checkpoint() == 3  # the open-time replay (epoch 2) is stale now
        a[:] = -1
        rec = rt.recover_into()
        assert rec.epoch == 3 and (a == np.arange(1000)).all()
        b = np.zeros(1000, dtype=np.int64)
        assert rt.recover_into({"dense": np.zeros(5 * PAGE + 123, np.uint8)}).epoch == 3  # and again
        with pytest.raises(RecoveryError, match="not in the log"):
            rt.recover_into({"nope": b})


def test_recovery_options_are_checked(shm_dir: Path) -> None:
    with pytest.raises(ConfigError, match="unknown recovery option"):
        cft.Runtime(shm_dir / "log", recovery={"pinnned": False})


def test_host_regions_are_replayed_in_place_when_no_image_is_kept(shm_dir: Path) -> None:
    import tracemalloc

    rng = np.random.default_rng(21)
    dense = rng.integers(0, 256, 2048 * PAGE, dtype=np.uint8)  # 8 MiB, whole pages
    kv = rng.integers(0, 256, 256 * 4 * PAGE, dtype=np.uint8)  # 4 MiB
    flags = np.ones(256, dtype=np.uint8)
    hashed = rng.integers(0, 256, 64 * PAGE, dtype=np.uint8)
    shadow = rng.integers(0, 256, 3 * PAGE + 17, dtype=np.uint8)  # partial last page: gets its own image

    def register(rt: cft.Runtime, bufs: dict[str, np.ndarray], fl: np.ndarray) -> None:
        rt.register("dense", bufs["dense"], "dense")
        rt.register("kv", bufs["kv"], "paged", block_bytes=4 * PAGE, dirty_blocks=fl)
        rt.register("hashed", bufs["hashed"], "opaque", diff="hash")
        rt.register("shadow", bufs["shadow"], "opaque", diff="shadow")

    want = {"dense": dense, "kv": kv, "hashed": hashed, "shadow": shadow}
    with cft.Runtime(shm_dir / "log", fsync="never") as rt:
        register(rt, want, flags)
        rt.checkpoint()
        for a in want.values():
            a[rng.integers(0, a.size, 50)] ^= 0x33
        flags[:] = 1
        rt.checkpoint()
    for keep in (True, False):
        got = {n: np.full_like(a, 0x5A) for n, a in want.items()}
        with cft.Runtime(shm_dir / "log", fsync="never") as rt:
            register(rt, got, np.zeros(256, dtype=np.uint8))
            tracemalloc.start()
            rec = rt.recover_into(keep_images=keep)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            for n in want:
                assert np.array_equal(got[n], want[n]), n
            if keep:  # an image of every region, besides the buffers
                assert peak > 12 << 20 and set(rec.images) == set(want)
            else:  # written in place: no image of the 12 MiB of whole-page regions was allocated
                assert peak < 2 << 20 and rec.images == {}
            rt.checkpoint()  # the restored bytes are the baseline: only the dense region is logged again
            assert rt.last_stats.region_pages == {"dense": 2048}


def test_a_large_replay_unmaps_its_segments_in_the_background(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setattr("concordia_ft.core.replay.BACKGROUND_UNMAP_DELAY_S", 0.2)  # the default waits 2 s

    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    a = np.random.default_rng(22).integers(0, 256, 70 << 20, dtype=np.uint8)  # past BACKGROUND_UNMAP_BYTES
    with cft.Runtime(shm_dir / "log", fsync="never") as rt:
        rt.register("a", a, "dense")
        rt.checkpoint()
    seg = str(_segment(shm_dir / "log"))
    for materialize in (True, False):
        res = replay(shm_dir / "log", options=PARALLEL, materialize=materialize)
        if not materialize:
            assert seg in maps.read_text()  # mapped until the deferred copy pass
            res.materialize()
        assert res.regions["a"].data.tobytes() == a.tobytes()
        deadline = time.monotonic() + 10
        while seg in maps.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seg not in maps.read_text(), "the segment mapping was never released"


def test_flush_unmaps_releases_queued_mappings_at_once(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay's large mappings wait BACKGROUND_UNMAP_DELAY_S (2 s) before they are unmapped; flush_unmaps()
    unmaps them now and returns once they are gone (what a benchmark's rounds call between recoveries). The
    delay is raised to 60 s here so that a loaded machine's stall between close() and the check cannot let the
    background unmapper get there first."""
    from concordia_ft.core.replay import flush_unmaps

    monkeypatch.setattr("concordia_ft.core.replay.BACKGROUND_UNMAP_DELAY_S", 60.0)
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    assert flush_unmaps()  # nothing queued: returns at once
    a = np.random.default_rng(23).integers(0, 256, 70 << 20, dtype=np.uint8)
    with cft.Runtime(shm_dir / "log", fsync="never") as rt:
        rt.register("a", a, "dense")
        rt.checkpoint()
    seg = str(_segment(shm_dir / "log"))
    for _ in range(2):
        res = replay(shm_dir / "log", options=PARALLEL, materialize=False)
        res.materialize()
        assert res.regions["a"].data.tobytes() == a.tobytes()
        res.close()
        assert seg in maps.read_text()  # queued: still mapped
        assert flush_unmaps(timeout=10.0)  # done within 10 s: flush_unmaps did it, not the background's 60 s
        assert seg not in maps.read_text()
