"""Damaged logs built on purpose: every truncation offset, single-bit flips, a damaged manifest, hostile fields.

The property under test everywhere: replay never returns silently wrong data. Either it raises, or it returns
a named outcome together with the exact bytes some committed epoch held (checked against a model of what
each epoch committed), and a truncation recovers exactly the last whole epoch.

The sweeps run in two worker processes (fork), each on its own copy of the log on tmpfs; a truncation
sweep walks offsets downwards so each case is one ftruncate, never a copy.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import struct
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import concordia_ft as cft
from concordia_ft.core import format as F
from concordia_ft.core.epochs import decode_epoch
from concordia_ft.core.log import RecoveryLog
from concordia_ft.core.manifest import MANIFEST_NAME, Manifest, load_manifest
from concordia_ft.core.regions import RegionKind, RegionSpec
from concordia_ft.core.replay import Outcome, replay
from concordia_ft.errors import LogCorruptError, LogError

PAGE = 512


# ---------------------------------------------------------------------------------------------- the log
@dataclass
class Span:
    epoch: int
    start: int
    end: int
    header: tuple[int, int]  # [start, end) of the 56-byte epoch header
    desc: tuple[int, int]
    payloads: list[tuple[int, int]]
    commit: tuple[int, int]


@dataclass
class BuiltLog:
    dir: Path
    digests: dict[int | None, dict[str, str]]  # epoch -> region -> sha256 of its exact bytes
    segments: list[str]
    spans: dict[str, list[Span]] = field(default_factory=dict)  # segment -> epochs in it

    @property
    def last_segment(self) -> str:
        return self.segments[-1]

    @property
    def last_epoch(self) -> int:
        return max(e for e in self.digests if e is not None)

    def epoch_before_segment(self, segment: str) -> int | None:
        """The last epoch committed in the segments before ``segment`` (None: no epoch at all)."""
        i = self.segments.index(segment)
        earlier = [s.epoch for seg in self.segments[:i] for s in self.spans[seg]]
        return max(earlier) if earlier else None


def _digest(images: dict[str, Any]) -> dict[str, str]:
    return {n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for n, a in images.items()}


def build_log(log_dir: Path, *, seed: int, with_base: bool, n_delta_epochs: int = 3) -> BuiltLog:
    """A log of 1 full + ``n_delta_epochs`` multi-region epochs over random data (sparse + dense pages).

    Regions (512-byte pages): an opaque region of 10001 bytes (not a page multiple; sparse random pages ->
    PAGES records), a paged KV region (blocks of 2 pages -> RUNS records), a dense region of 3000 bytes, and a
    scratch region (never logged). ``with_base``: epoch 1 is compacted into a base segment first, so the last
    segment holds only delta epochs.
    """
    rng = np.random.default_rng(seed)
    opq = rng.integers(0, 256, 10_001, dtype=np.uint8)
    kv = rng.integers(0, 256, 8 * 2 * PAGE, dtype=np.uint8)
    bitmap = np.zeros(8, dtype=np.uint8)
    dense = rng.integers(0, 256, 3000, dtype=np.uint8)
    scratch = rng.integers(0, 256, 4096, dtype=np.uint8)
    digests: dict[int | None, dict[str, str]] = {None: {}}
    rt = cft.Runtime(log_dir, fsync="never", page_bytes=PAGE, compact_after_bytes=None)
    try:
        rt.register("opq", opq, "opaque")
        rt.register("kv", kv, "paged", block_bytes=2 * PAGE, dirty_blocks=bitmap)
        rt.register("dense", dense, "dense")
        rt.register("scratch", scratch, "scratch")
        e = rt.checkpoint({"step": 1})
        digests[e] = _digest({"opq": opq, "kv": kv, "dense": dense})
        if with_base:
            rt.compact()
        for i in range(n_delta_epochs):
            pages = rng.choice(opq.size // PAGE + 1, size=3 + i, replace=False)
            for p in pages:  # sparse: a few random bytes in random pages (the tail page included sometimes)
                lo = int(p) * PAGE
                hi = min(lo + PAGE, opq.size)
                opq[rng.integers(lo, hi, 3)] ^= rng.integers(1, 256, 3, dtype=np.uint8)
            blocks = rng.choice(8, size=2 + i, replace=False)
            for b in blocks:
                kv[b * 2 * PAGE : (b + 1) * 2 * PAGE] = rng.integers(0, 256, 2 * PAGE, dtype=np.uint8)
                bitmap[b] = 1
            dense[:] = rng.integers(0, 256, dense.size, dtype=np.uint8)
            scratch[:] = rng.integers(0, 256, scratch.size, dtype=np.uint8)
            e = rt.checkpoint({"step": e + 1, "note": "x" * i})
            digests[e] = _digest({"opq": opq, "kv": kv, "dense": dense})
    finally:
        rt.close()
    manifest = load_manifest(log_dir)
    assert manifest is not None
    built = BuiltLog(log_dir, digests, manifest.segments())
    for seg in built.segments:
        built.spans[seg] = _spans(log_dir / seg)
    return built


def _spans(path: Path) -> list[Span]:
    buf = memoryview(path.read_bytes())
    out: list[Span] = []
    pos = F.SEGMENT_HEADER_BYTES
    while pos < len(buf):
        ep = decode_epoch(buf, pos)
        h = F.EpochHeader.decode(buf[pos : pos + F.EPOCH_HEADER_BYTES])
        d0 = pos + F.EPOCH_HEADER_BYTES
        pays = [(pos + e.payload_off, pos + e.payload_off + e.payload_len) for e in ep.entries if e.payload_len]
        end = pos + ep.total_bytes
        out.append(Span(ep.epoch, pos, end, (pos, d0), (d0, d0 + h.desc_bytes), pays, (end - F.COMMIT_BYTES, end)))
        pos = end
    return out


@pytest.fixture(scope="module")
def built_logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, BuiltLog]:
    root = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path_factory.mktemp("logs")
    base = root / f"cft-damage-{os.getpid()}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir()
    logs = {
        "one-segment": build_log(base / "one", seed=11, with_base=False),
        "base+incr": build_log(base / "based", seed=12, with_base=True),
    }
    yield logs
    shutil.rmtree(base, ignore_errors=True)


def test_the_built_logs_are_what_the_sweeps_assume(built_logs: dict[str, BuiltLog]) -> None:
    one, based = built_logs["one-segment"], built_logs["base+incr"]
    assert len(one.segments) == 1 and [s.epoch for s in one.spans[one.last_segment]] == [1, 2, 3, 4]
    assert based.segments[0].startswith("base.") and [s.epoch for s in based.spans[based.last_segment]] == [2, 3, 4]
    for b in (one, based):
        res = replay(b.dir)
        assert res.outcome is Outcome.OK and res.epoch == 4
        assert _digest(res.regions and {n: img.data for n, img in res.regions.items()}) == b.digests[4]
        assert "scratch" not in res.regions
        # every delta epoch names several regions, and both record shapes occur
        for s in b.spans[b.last_segment]:
            assert len(s.payloads) >= 3
    kinds = set()
    buf = memoryview((one.dir / one.last_segment).read_bytes())
    for s in one.spans[one.last_segment]:
        kinds |= {e.rtype for e in decode_epoch(buf, s.start).entries}
    assert {F.REC_PAGES, F.REC_RUNS, F.REC_REGION, F.REC_META} <= kinds


# ------------------------------------------------------------------------------------- the sweep workers
@dataclass
class Case:
    kind: str  # "truncate" | "flip"
    segment: str
    offset: int
    bit: int = 0


@dataclass
class Verdict:
    case: Case
    what: str  # outcome name, or "raise:<ExceptionType>"
    epoch: int | None
    correct_state: bool  # the recovered bytes equal what that epoch committed
    error_offset: int | None = None
    error_path: str | None = None


def _observe(log_dir: Path, built: BuiltLog, case: Case) -> Verdict:
    try:
        res = replay(log_dir)
    except LogCorruptError as e:
        return Verdict(case, "raise:LogCorruptError", None, True, e.offset, e.path)
    except Exception as e:  # noqa: BLE001 - recorded: any raise counts as detected, the type is checked apart
        return Verdict(case, f"raise:{type(e).__name__}", None, True)
    got = _digest({n: img.data for n, img in res.regions.items()})
    want = built.digests.get(res.epoch)
    return Verdict(case, res.outcome.value, res.epoch, want is not None and got == want)


def _copy_log(built: BuiltLog, tag: str) -> Path:
    dst = built.dir.parent / f"{built.dir.name}-w{tag}-{os.getpid()}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(built.dir, dst)
    (dst / "LOCK").unlink(missing_ok=True)
    return dst


def _truncate_worker(args: tuple[BuiltLog, list[int], str]) -> list[Verdict]:
    built, offsets, tag = args
    d = _copy_log(built, tag)
    seg = d / built.last_segment
    out = []
    try:
        for off in sorted(offsets, reverse=True):
            os.truncate(seg, off)
            out.append(_observe(d, built, Case("truncate", built.last_segment, off)))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def _flip_worker(args: tuple[BuiltLog, list[Case], str]) -> list[Verdict]:
    built, cases, tag = args
    d = _copy_log(built, tag)
    out = []
    try:
        for c in cases:
            fd = os.open(d / c.segment, os.O_RDWR)
            try:
                old = os.pread(fd, 1, c.offset)
                os.pwrite(fd, bytes([old[0] ^ (1 << c.bit)]), c.offset)
                out.append(_observe(d, built, c))
                os.pwrite(fd, old, c.offset)
            finally:
                os.close(fd)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def run_parallel(worker: Any, built: BuiltLog, items: list[Any], n_workers: int = 2) -> list[Verdict]:
    chunks = [items[i::n_workers] for i in range(n_workers)]
    # forkserver, not fork: after NVRTC / cuda-bindings were loaded by an earlier test in this process, a
    # fork()ed worker saw its own 1-byte pwrite to a tmpfs file vanish (pread returned the old byte);
    # not root-caused (not reproduced outside pytest), so the workers never inherit that state
    ctx = mp.get_context("forkserver")
    with ctx.Pool(n_workers) as pool:
        parts = pool.map(worker, [(built, ch, str(i)) for i, ch in enumerate(chunks)])
    return [v for p in parts for v in p]


# ------------------------------------------------------------------------------------------- truncation
def expected_after_truncation(built: BuiltLog, offset: int) -> tuple[str, int | None]:
    """(outcome, epoch) the contract demands when the last segment is cut to ``offset`` bytes."""
    spans = built.spans[built.last_segment]
    whole = [s for s in spans if s.end <= offset]
    epoch = whole[-1].epoch if whole else built.epoch_before_segment(built.last_segment)
    at_boundary = offset == F.SEGMENT_HEADER_BYTES or any(s.end == offset for s in spans)
    if epoch is None:
        return ("empty" if at_boundary else "torn-tail"), None
    return ("ok" if at_boundary else "torn-tail"), epoch


def structural_offsets(built: BuiltLog, *, stride: int) -> list[int]:
    """Every offset in headers, descriptors, commit markers and +-40 bytes around every boundary; every
    ``stride``-th offset in payloads and zero padding (stride 1: every offset of the segment)."""
    spans = built.spans[built.last_segment]
    size = spans[-1].end
    keep = set(range(F.SEGMENT_HEADER_BYTES, size + 1, stride))
    for s in spans:
        for lo, hi in [s.header, s.desc, s.commit, *s.payloads]:
            for edge in (lo, hi):
                keep.update(range(max(F.SEGMENT_HEADER_BYTES, edge - 40), min(size, edge + 40) + 1))
        keep.update(range(s.header[0], s.desc[1]))
        keep.update(range(s.commit[0], s.commit[1] + 1))
    return sorted(keep)


def _check_truncations(built: BuiltLog, offsets: list[int]) -> None:
    verdicts = run_parallel(_truncate_worker, built, offsets)
    assert len(verdicts) == len(offsets)
    bad = []
    for v in verdicts:
        want = expected_after_truncation(built, v.case.offset)
        if (v.what, v.epoch) != want or not v.correct_state:
            bad.append((v.case.offset, want, v.what, v.epoch, v.correct_state))
    assert not bad, f"{len(bad)} of {len(verdicts)} truncations recovered the wrong thing, first: {bad[:5]}"


@pytest.mark.parametrize("layout", ["one-segment", "base+incr"])
def test_truncation_recovers_exactly_the_last_whole_epoch(built_logs: dict[str, BuiltLog], layout: str) -> None:
    """CI: every offset of every header, descriptor and commit marker and +-40 bytes around every boundary;
    every 13th offset inside payloads and zero padding (each payload-interior offset takes the same code path;
    the slow test below does every single offset)."""
    built = built_logs[layout]
    offsets = structural_offsets(built, stride=13)
    assert len(offsets) > 4000
    _check_truncations(built, offsets)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one-segment", "base+incr"])
def test_truncation_at_every_single_offset(built_logs: dict[str, BuiltLog], layout: str) -> None:
    built = built_logs[layout]
    size = built.spans[built.last_segment][-1].end
    _check_truncations(built, list(range(F.SEGMENT_HEADER_BYTES, size + 1)))


def test_truncation_inside_the_segment_header_is_never_silently_wrong(built_logs: dict[str, BuiltLog]) -> None:
    """A segment header is fsynced before the manifest names the segment, so a crash cannot cut it; a cut
    there is damage. Replay must then raise, or report a tail with the state before the segment."""
    built = built_logs["base+incr"]
    offsets = list(range(0, F.SEGMENT_HEADER_BYTES, 1))
    verdicts = run_parallel(_truncate_worker, built, offsets)
    prev = built.epoch_before_segment(built.last_segment)
    for v in verdicts:
        if v.what.startswith("raise:"):
            continue
        assert v.what == "torn-tail" and v.epoch == prev and v.correct_state, v


def test_a_writer_reopening_cuts_the_torn_tail_and_continues(built_logs: dict[str, BuiltLog], shm_dir: Path) -> None:
    built = built_logs["one-segment"]
    spans = built.spans[built.last_segment]
    rng = np.random.default_rng(5)
    cuts = [spans[-1].start + 1, spans[-1].end - 1, spans[2].commit[0] + 7, spans[1].start + 56]
    cuts += [int(x) for x in rng.integers(spans[0].end + 1, spans[-1].end, 6)]
    for off in cuts:
        d = shm_dir / f"cut{off}"
        shutil.copytree(built.dir, d)
        os.truncate(d / built.last_segment, off)
        want_outcome, want_epoch = expected_after_truncation(built, off)
        log = RecoveryLog.open(d, {"fsync": "never"})
        try:
            whole_end = max([s.end for s in spans if s.end <= off], default=F.SEGMENT_HEADER_BYTES)
            assert log.last_epoch == want_epoch
            assert log.report.outcome.value == want_outcome
            assert log.report.cut_bytes == off - whole_end
            assert os.path.getsize(d / built.last_segment) == whole_end
            spec = RegionSpec("extra", RegionKind.OPAQUE, 100, PAGE)
            payload = np.arange(PAGE, dtype=np.uint8)
            from concordia_ft.core.tracking import RegionDelta

            log.append(defs=[spec], deltas=[RegionDelta(spec, np.array([0], np.int64), memoryview(payload))])
        finally:
            log.close()
        res = replay(d)
        assert res.outcome is Outcome.OK and res.epoch == (want_epoch or 0) + 1
        assert bytes(res.regions["extra"].data) == bytes(payload[:100])
        got = _digest({n: img.data for n, img in res.regions.items() if n != "extra"})
        assert got == built.digests[want_epoch]


# --------------------------------------------------------------------------------------------- bit flips
def flip_cases(built: BuiltLog, *, desc_bits: tuple[int, ...] | None = tuple(range(8))) -> list[Case]:
    """Every bit of every segment header field and epoch header / commit marker byte; ``desc_bits`` of every
    descriptor byte (None: one bit per byte, rotating, so each bit position is hit); in every segment."""
    cases = []
    for seg in built.segments:
        for off in range(0, F._SEG.size + 4):
            cases += [Case("flip", seg, off, b) for b in range(8)]
        for s in built.spans[seg]:
            for lo, hi in (s.header, s.commit):
                for off in range(lo, hi):
                    cases += [Case("flip", seg, off, b) for b in range(8)]
            for off in range(*s.desc):
                bits = desc_bits if desc_bits is not None else ((off * 3) % 8,)
                cases += [Case("flip", seg, off, b) for b in bits]
    return cases


def expected_after_flip(built: BuiltLog, case: Case) -> tuple[str, int | None, int | None]:
    """(what, epoch, error offset) for a flip in a checksummed byte of ``case.segment``."""
    if case.offset < F.SEGMENT_HEADER_BYTES:
        return "raise:LogCorruptError", None, 0
    span = next(s for s in built.spans[case.segment] if s.start <= case.offset < s.end)
    if case.segment == built.last_segment and span is built.spans[case.segment][-1]:
        prev = [s.epoch for s in built.spans[case.segment] if s.end <= span.start]
        epoch = prev[-1] if prev else built.epoch_before_segment(case.segment)
        return "damaged-tail", epoch, None
    return "raise:LogCorruptError", None, span.start


def _flip_sweep(built: BuiltLog, cases: list[Case]) -> list[Verdict]:
    verdicts = run_parallel(_flip_worker, built, cases)
    assert len(verdicts) == len(cases)
    silent = [v for v in verdicts if not v.what.startswith("raise:") and not v.correct_state]
    assert not silent, f"{len(silent)} flips returned silently wrong data, first: {silent[:3]}"
    return verdicts


def _assert_detected(built: BuiltLog, verdicts: list[Verdict], *, strict_errors: bool) -> None:
    bad = []
    for v in verdicts:
        what, epoch, err_off = expected_after_flip(built, v.case)
        if what.startswith("raise:"):
            ok = v.what.startswith("raise:")
            if strict_errors:
                ok = v.what == what and v.error_offset == err_off and v.error_path is not None \
                    and v.error_path.endswith(v.case.segment)
        else:
            ok = (v.what, v.epoch) == (what, epoch) and v.correct_state
        if not ok:
            bad.append((v.case, (what, epoch, err_off), (v.what, v.epoch, v.error_offset)))
    assert not bad, f"{len(bad)} of {len(verdicts)} flips not detected as required, first: {bad[:4]}"


@pytest.mark.parametrize("layout", ["one-segment", "base+incr"])
def test_every_bit_flip_in_headers_descriptors_and_commit_markers_is_detected(
        built_logs: dict[str, BuiltLog], layout: str) -> None:
    """Every bit of headers and commit markers; one bit of every descriptor byte, rotating through the bit
    positions (the slow test does all 8). Detected = an error raised, or the flipped epoch is the tail and is
    refused with the state of the epoch before it."""
    built = built_logs[layout]
    cases = flip_cases(built, desc_bits=None)
    verdicts = _flip_sweep(built, cases)
    _assert_detected(built, verdicts, strict_errors=False)


@pytest.mark.slow
def test_every_bit_of_every_descriptor_byte(built_logs: dict[str, BuiltLog]) -> None:
    built = built_logs["one-segment"]
    verdicts = _flip_sweep(built, flip_cases(built))
    _assert_detected(built, verdicts, strict_errors=False)


# Regression: at c894ca3 replay() closed its mmap while the exception's traceback held views of it, so
# mmap.close() raised BufferError and replaced every LogCorruptError raised inside a segment.
def test_damage_before_the_tail_raises_LogCorruptError_naming_file_and_offset(
        built_logs: dict[str, BuiltLog]) -> None:
    built = built_logs["base+incr"]
    cases = [c for c in flip_cases(built, desc_bits=(5,)) if c.bit == 5]
    verdicts = run_parallel(_flip_worker, built, cases)
    _assert_detected(built, verdicts, strict_errors=True)


def test_payload_bit_flips_are_caught_by_the_payload_crc(built_logs: dict[str, BuiltLog]) -> None:
    built = built_logs["one-segment"]
    rng = np.random.default_rng(3)
    cases = []
    for s in built.spans[built.last_segment]:
        for lo, hi in s.payloads:
            offs = {lo, hi - 1, *[int(x) for x in rng.integers(lo, hi, 12)]}
            cases += [Case("flip", built.last_segment, o, int(rng.integers(8))) for o in sorted(offs)]
    verdicts = _flip_sweep(built, cases)
    _assert_detected(built, verdicts, strict_errors=False)


def test_flips_in_zero_padding_never_give_wrong_data(built_logs: dict[str, BuiltLog]) -> None:
    """Padding is not covered by a checksum: a flip there may go unnoticed, but the data must stay exact."""
    built = built_logs["one-segment"]
    rng = np.random.default_rng(4)
    seg = built.last_segment
    cases = [Case("flip", seg, int(o), int(rng.integers(8))) for o in rng.integers(F._SEG.size + 4, 4096, 40)]
    for s in built.spans[seg]:
        covered = [s.header, s.desc, s.commit, *s.payloads]
        pad = [o for o in range(s.start, s.end) if not any(lo <= o < hi for lo, hi in covered)]
        cases += [Case("flip", seg, int(o), int(rng.integers(8))) for o in rng.choice(pad, 40, replace=False)]
    _flip_sweep(built, cases)


# --------------------------------------------------------------------------------------------- manifest
def test_every_manifest_byte_flip_is_detected_or_harmless(built_logs: dict[str, BuiltLog], shm_dir: Path) -> None:
    built = built_logs["base+incr"]
    d = shm_dir / "m"
    shutil.copytree(built.dir, d)
    path = d / MANIFEST_NAME
    good = path.read_bytes()
    detected = harmless = 0
    for off in range(len(good)):
        for bit in range(8):
            bad = bytearray(good)
            bad[off] ^= 1 << bit
            path.write_bytes(bad)
            try:
                res = replay(d)
            except (LogCorruptError, LogError):
                detected += 1
                continue
            # undetected only where the flip does not change meaning (e.g. hex digit case, trailing space)
            assert res.outcome is Outcome.OK and res.epoch == built.last_epoch, (off, bit)
            assert _digest({n: img.data for n, img in res.regions.items()}) == built.digests[built.last_epoch]
            harmless += 1
    path.write_bytes(good)
    assert detected >= 8 * len(good) - 64, (detected, harmless)


def test_a_missing_or_truncated_manifest_is_reported(built_logs: dict[str, BuiltLog], shm_dir: Path) -> None:
    built = built_logs["base+incr"]
    d = shm_dir / "m"
    shutil.copytree(built.dir, d)
    good = (d / MANIFEST_NAME).read_bytes()
    for n in (0, 1, len(good) // 2, len(good) - 3):
        (d / MANIFEST_NAME).write_bytes(good[:n])
        with pytest.raises(LogCorruptError, match="manifest"):
            replay(d)
    (d / MANIFEST_NAME).unlink()
    with pytest.raises(LogError, match="no MANIFEST"):
        replay(d)


# ------------------------------------------------------------------------------------------ hostile logs
Record = tuple  # (rtype, name, var, count, payload | None[, {entry field: value} overrides])


def _encode_entry(r: Record, poff: int) -> bytes:
    rtype, name, var, count, payload = r[:5]
    f = {"rtype": rtype, "flags": 0, "name_len": len(name), "count": count, "vlen": len(name) + len(var),
         "poff": poff, "plen": len(payload) if payload is not None else 0,
         "pcrc": F.crc32c(payload) if payload is not None else 0}
    f.update(r[5] if len(r) > 5 else {})
    real = len(name) + len(var)
    return (F._ENTRY.pack(f["rtype"], f["flags"], f["name_len"], f["count"], f["vlen"], f["poff"], f["plen"],
                          f["pcrc"], 0) + name + var + bytes(F.align_up(real, 8) - real))


def craft_epoch(epoch: int, start: int, records: list[Record], *, flags: int = 0,
                header_override: dict[str, int] | None = None) -> bytes:
    """Bytes of one epoch with CORRECT checksums around whatever hostile fields ``records`` carry, so the
    decoder's bounds (not its CRC checks) are what is tested."""
    desc_len = sum(F.entry_size(len(r[1]), len(r[2])) for r in records)
    cursor = F.align_up(start + F.EPOCH_HEADER_BYTES + desc_len) - start
    area = cursor
    offs = []
    for r in records:
        if r[4] is not None:
            cursor = F.align_up(start + cursor) - start
            offs.append(cursor)
            cursor += len(r[4])
        else:
            offs.append(0)
    total = cursor + F.COMMIT_BYTES
    desc = b"".join(_encode_entry(r, o) for r, o in zip(records, offs, strict=True))
    dcrc = F.crc32c(desc)
    fields = {"n_records": len(records), "epoch": epoch, "desc_bytes": len(desc), "total_bytes": total,
              "payload_bytes": cursor - area, "version": F.FORMAT_VERSION, "flags": flags}
    fields.update(header_override or {})
    body = F._EPOCH.pack(F.EPOCH_MAGIC, fields["version"], fields["flags"], fields["n_records"], fields["epoch"],
                         fields["desc_bytes"], fields["total_bytes"], fields["payload_bytes"])
    out = bytearray(total)
    out[: F.EPOCH_HEADER_BYTES] = body + struct.pack("<II", F.crc32c(body), dcrc)
    out[F.EPOCH_HEADER_BYTES : F.EPOCH_HEADER_BYTES + len(desc)] = desc
    for r, o in zip(records, offs, strict=True):
        if r[4] is not None:
            out[o : o + len(r[4])] = r[4]
    out[total - F.COMMIT_BYTES :] = F.encode_commit(epoch, total, dcrc)
    return bytes(out)


def _region_json(**over: Any) -> bytes:
    d = RegionSpec("r", RegionKind.OPAQUE, 4 * 4096, 4096).describe()
    d.update(over)
    return F.encode_json(d)


def _fresh_log(d: Path) -> tuple[Path, int]:
    log = RecoveryLog.open(d, {"fsync": "never"})
    seg, end = log._segment.path, log._segment.end
    log.close()
    return seg, end


def _append_raw(seg: Path, data: bytes) -> int:
    with open(seg, "r+b") as f:
        f.seek(0, 2)
        start = f.tell()
        f.write(data)
    return start


def _good_epoch(seg: Path, epoch: int) -> bytes:
    start = os.path.getsize(seg)
    j = _region_json()
    return craft_epoch(epoch, start, [(F.REC_REGION, b"r", j, len(j), None),
                                      (F.REC_PAGES, b"r", np.array([1], "<i8").tobytes(), 1, bytes(range(256)) * 16)])


REC_REGION_OK = (F.REC_REGION, b"r", _region_json(), len(_region_json()), None)
HOSTILE_HEADERS = {
    "total_bytes=2^63": {"total_bytes": 2**63},
    "total_bytes=2^64-1": {"total_bytes": 2**64 - 1},
    "n_records=2^32-1": {"n_records": 2**32 - 1},
    "desc_bytes=2^62": {"desc_bytes": 2**62},
    "payload_bytes=2^63": {"payload_bytes": 2**63},
}
NEWER_VERSIONS = {"version=2": {"version": 2}, "version=65535": {"version": 65535}}
HOSTILE_RECORDS: dict[str, list[tuple[int, bytes, bytes, int, bytes | None]]] = {
    "payload_len=2^63": [REC_REGION_OK, (F.REC_PAGES, b"r", np.array([0], "<i8").tobytes(), 1, bytes(4096),
                                         {"plen": 2**63})],
    "payload_off=2^63": [REC_REGION_OK, (F.REC_PAGES, b"r", np.array([0], "<i8").tobytes(), 1, bytes(4096),
                                         {"poff": 2**63})],
    "var_len=2^63": [REC_REGION_OK, (F.REC_PAGES, b"r", np.array([0], "<i8").tobytes(), 1, bytes(4096),
                                     {"vlen": 2**63})],
    "payload crc wrong": [REC_REGION_OK, (F.REC_PAGES, b"r", np.array([0], "<i8").tobytes(), 1, bytes(4096),
                                          {"pcrc": 12345})],
    "pages count=2^62": [REC_REGION_OK, (F.REC_PAGES, b"r", np.array([0], "<i8").tobytes(), 2**62, bytes(4096))],
    "runs count=2^62": [REC_REGION_OK, (F.REC_RUNS, b"r", np.array([0, 1], "<i8").tobytes(), 2**62, bytes(4096))],
    "page index=2^63-1": [REC_REGION_OK, (F.REC_PAGES, b"r", np.array([2**63 - 1], "<i8").tobytes(), 1, bytes(4096))],
    "negative page index": [REC_REGION_OK, (F.REC_PAGES, b"r", np.array([-1], "<i8").tobytes(), 1, bytes(4096))],
    "run length=2^63-1": [REC_REGION_OK, (F.REC_RUNS, b"r", np.array([0, 2**63 - 1], "<i8").tobytes(), 1, bytes(4096))],
    "unknown record type": [REC_REGION_OK, (99, b"r", b"", 0, None)],
    "name with '/'": [(F.REC_REGION, b"a/b", _region_json(name="a/b"), 0, None)],
    "name '..'": [(F.REC_REGION, b"..", _region_json(name=".."), 0, None)],
    "name '../etc'": [(F.REC_REGION, b"../etc", _region_json(name="../etc"), 0, None)],
    "name not UTF-8": [(F.REC_REGION, b"\xff\xfe\x80", _region_json(), 0, None)],
    "name 4 GiB long": [(F.REC_REGION, b"r", _region_json(), 0, None, {"name_len": 2**32 - 1})],
    "pages for an undefined region": [(F.REC_PAGES, b"ghost", np.array([0], "<i8").tobytes(), 1, bytes(4096))],
    "region JSON not JSON": [(F.REC_REGION, b"r", b"{not json", 0, None)],
    "region kind unknown": [(F.REC_REGION, b"r", _region_json(kind="weird"), 0, None)],
    "region page_bytes=2^60": [(F.REC_REGION, b"r", _region_json(page_bytes=2**60), 0, None)],
    "region nbytes=-1": [(F.REC_REGION, b"r", _region_json(nbytes=-1), 0, None)],
}
ALLOC_BUGS = {  # hostile records that once escaped the bounds (crash, 1 TiB calloc, raw errors): regressions
    "runs whose lengths overflow int64": [
        REC_REGION_OK,
        (F.REC_RUNS, b"r", np.array([[0, 2**62], [2**62 + 5, 2**62], [2**63 - 10, 2**62], [2**63 - 5, 2**62]],
                                    "<i8").tobytes(), 4, bytes(4096))],
    "region nbytes=2^63": [(F.REC_REGION, b"r", _region_json(nbytes=2**63), 0, None)],
    "region nbytes=2^40 (1 TiB)": [(F.REC_REGION, b"r", _region_json(nbytes=2**40), 0, None)],
    "meta nested 100000 deep": [(F.REC_META, b"", b"[" * 100_000 + b"]" * 100_000, 0, None)],
    "meta integer of 5000 digits": [(F.REC_META, b"", b"9" * 5000, 0, None)],
}


def _hostile_outcome(d: Path) -> tuple[str, str]:
    """Replay ``d`` under tracemalloc; return (what happened, message) and assert the peak stayed small."""
    tracemalloc.start()
    try:
        try:
            res = replay(d)
            what, msg = res.outcome.value, (res.tail.reason if res.tail else "")
        except LogCorruptError as e:
            what, msg = "LogCorruptError", str(e)
        except LogError as e:
            what, msg = "LogError", str(e)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"replay of a hostile log allocated {peak / 2**20:.0f} MiB at its peak"
    return what, msg


def _plant(d: Path, data_fn: Any, *, followed_by_good: bool) -> Path:
    seg, _ = _fresh_log(d)
    _append_raw(seg, _good_epoch(seg, 1))
    _append_raw(seg, data_fn(os.path.getsize(seg)))
    if followed_by_good:
        _append_raw(seg, _good_epoch(seg, 3))
    return seg


@pytest.mark.parametrize("followed_by_good", [False, True], ids=["at-tail", "before-a-good-epoch"])
@pytest.mark.parametrize("name", sorted(HOSTILE_HEADERS))
def test_hostile_epoch_headers_are_refused_without_allocating(name: str, followed_by_good: bool, shm_dir: Path) -> None:
    over = HOSTILE_HEADERS[name]
    _plant(shm_dir, lambda start: craft_epoch(2, start, [REC_REGION_OK], header_override=over),
           followed_by_good=followed_by_good)
    what, msg = _hostile_outcome(shm_dir) if not followed_by_good else ("", "")
    if not followed_by_good:
        # at the tail: the epoch is refused (never applied) and the reason names what is wrong
        assert what == "damaged-tail", (what, msg)
        assert any(w in msg for w in ("bounds", "add up", "not supported")), msg
        assert replay(shm_dir).epoch == 1
        with pytest.raises(LogCorruptError):
            RecoveryLog.open(shm_dir, {"fsync": "never"}).close()
    else:
        with pytest.raises(LogCorruptError, match="a valid epoch follows") as ei:
            replay(shm_dir)
        assert ei.value.offset > F.SEGMENT_HEADER_BYTES


@pytest.mark.parametrize("followed_by_good", [False, True], ids=["at-tail", "before-a-good-epoch"])
@pytest.mark.parametrize("name", sorted(NEWER_VERSIONS))
def test_a_newer_epoch_version_says_upgrade_and_is_never_cut(name: str, followed_by_good: bool,
                                                            shm_dir: Path) -> None:
    # a checksummed header with a version this build does not know was written by a newer writer: not damage,
    # so it is neither a torn nor a damaged tail that `check --fix` could cut
    seg = _plant(shm_dir, lambda start: craft_epoch(2, start, [REC_REGION_OK], header_override=NEWER_VERSIONS[name]),
                 followed_by_good=followed_by_good)
    size = os.path.getsize(seg)
    with pytest.raises(LogError, match="newer concordia-ft wrote it; upgrade") as ei:
        replay(shm_dir)
    assert not isinstance(ei.value, LogCorruptError)
    with pytest.raises(LogError, match="upgrade"):
        RecoveryLog.open(shm_dir, {"fsync": "never"}).close()
    assert os.path.getsize(seg) == size  # nothing was cut


@pytest.mark.parametrize("name", sorted(HOSTILE_RECORDS))
def test_hostile_records_are_refused_without_allocating(name: str, shm_dir: Path) -> None:
    recs = HOSTILE_RECORDS[name]

    def data(start: int) -> bytes:
        return craft_epoch(2, start, recs)

    _plant(shm_dir, data, followed_by_good=False)
    what, msg = _hostile_outcome(shm_dir)
    # refused: either as a damaged tail (decoder) or as corruption (geometry checked before applying)
    assert what in ("damaged-tail", "LogCorruptError"), (what, msg)
    if what == "damaged-tail":
        assert replay(shm_dir).epoch == 1


# Regressions, all found at c894ca3 (records with valid checksums around hostile values):
# - RUNS lengths summed in int64 wrapped, then np.repeat got the huge lengths: the reading process SEGFAULTED;
# - a REGION record of nbytes=2^40 allocated 1 TiB (calloc), 2^63 raised a raw numpy error;
# - META JSON nested 100000 deep raised RecursionError, a 5000-digit integer ValueError, both raw.
@pytest.mark.parametrize("name", sorted(ALLOC_BUGS))
def test_hostile_records_that_once_escaped_the_bounds(name: str, tmp_path: Path) -> None:
    # run in a child: the int64-overflow case used to kill the reading process with SIGSEGV
    import subprocess

    d = tmp_path / "log"
    recs = ALLOC_BUGS[name]
    _plant(d, lambda start: craft_epoch(2, start, recs), followed_by_good=False)
    code = (
        "import sys, tracemalloc\n"
        "from concordia_ft.core.replay import replay\n"
        "from concordia_ft.errors import LogCorruptError\n"
        "tracemalloc.start()\n"
        "try:\n"
        "    r = replay(sys.argv[1]); print('OUTCOME', r.outcome.value)\n"
        "except LogCorruptError as e:\n"
        "    print('CORRUPT', e)\n"
        "print('PEAK', tracemalloc.get_traced_memory()[1])\n"
    )
    from support import PYTHON, subprocess_env

    p = subprocess.run([PYTHON, "-c", code, str(d)], capture_output=True, text=True, env=subprocess_env(),
                       timeout=120)
    assert p.returncode == 0, f"reader died with {p.returncode}: {p.stderr[-600:]}"
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    assert "CORRUPT" in lines or lines.get("OUTCOME") == "damaged-tail", p.stdout
    assert int(lines["PEAK"]) < 32 << 20, f"peak {int(lines['PEAK']) / 2**20:.0f} MiB"


def test_unknown_segment_version_says_upgrade(shm_dir: Path) -> None:
    seg, _ = _fresh_log(shm_dir)
    raw = bytearray(seg.read_bytes())
    struct.pack_into("<H", raw, 8, 2)
    struct.pack_into("<I", raw, F._SEG.size, F.crc32c(bytes(raw[: F._SEG.size])))
    seg.write_bytes(raw)
    with pytest.raises(LogCorruptError, match="version 2 is not supported.*upgrade") as ei:
        replay(shm_dir)
    assert ei.value.offset == 0 and ei.value.path == str(seg)


def test_unknown_manifest_version_and_hostile_segment_names(shm_dir: Path) -> None:
    _fresh_log(shm_dir)
    m = load_manifest(shm_dir)
    assert m is not None

    def store(doc: dict[str, Any]) -> None:
        body = json.dumps(doc, sort_keys=True).encode()
        (shm_dir / MANIFEST_NAME).write_bytes(body + b"\ncrc32c %08x\n" % F.crc32c(body))

    doc = {"format": 1, "log_id": m.log_id, "next_generation": 2, "base": None, "incr": m.incr}
    store({**doc, "format": 7})
    with pytest.raises(LogError, match="version 7 is not supported.*upgrade"):
        replay(shm_dir)
    for bad in ("../../etc/passwd", "incr.000001.cft/../x", "/abs/incr.000001.cft", "incr.1.cft", "MANIFEST"):
        store({**doc, "incr": [bad]})
        with pytest.raises(LogCorruptError, match="not a segment file name"):
            replay(shm_dir)
    store({**doc, "base": 12345})
    with pytest.raises(LogCorruptError):
        replay(shm_dir)
    store({**doc, "next_generation": "x" * 10})
    with pytest.raises(LogCorruptError, match="malformed"):
        replay(shm_dir)
    (shm_dir / MANIFEST_NAME).write_bytes(b"{" * (2 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(LogCorruptError, match="larger than 1 MiB"):
            replay(shm_dir)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()
    store(doc)
    assert replay(shm_dir).outcome is Outcome.EMPTY


def test_manifest_round_trip_and_log_id_mismatch(built_logs: dict[str, BuiltLog], shm_dir: Path) -> None:
    """A segment copied in from another log is refused, not replayed."""
    a, b = built_logs["one-segment"], built_logs["base+incr"]
    d = shm_dir / "mix"
    shutil.copytree(a.dir, d)
    shutil.copy(b.dir / b.last_segment, d / "incr.000009.cft")
    m = load_manifest(d)
    assert m is not None
    m2 = Manifest(m.log_id, 10, m.base, [*m.incr, "incr.000009.cft"])
    (d / MANIFEST_NAME).write_bytes(m2.encode())
    with pytest.raises(LogCorruptError, match="belongs to log"):
        replay(d)
