"""The dram backend's mapped segments: payloads placed into the log's own pages before the epoch's header and
commit marker (the path GPU payloads take, DMA'd by the driver), and what a crash at each point leaves."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from concordia_ft.core.log import LogOptions, RecoveryLog
from concordia_ft.core.mapped import HostPayload, MappedSegment
from concordia_ft.core.regions import RegionKind, RegionSpec
from concordia_ft.core.replay import Outcome, replay
from concordia_ft.core.tracking import RegionDelta
from support import PYTHON, subprocess_env

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs a tmpfs at /dev/shm")
PAGE = 4096
SPARE_THREADS = ("concordia-spare-segment", "concordia-segment-worker")  # a thread per spare; the worker (ahead)
SPEC = RegionSpec(name="r", kind=RegionKind.PAGED, nbytes=64 * PAGE, page_bytes=PAGE, block_bytes=PAGE)


@pytest.fixture()
def shm() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="cft-mapped-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _opts(**kw: object) -> LogOptions:
    return LogOptions(**{"fsync": "never", "backend": "dram", "mapped_segment_bytes": 2 << 20, **kw})  # type: ignore[arg-type]


class Recording(HostPayload):
    """A host payload that also reads the segment FILE at the placed offset when the log waits for it: the
    bytes must be in the log's pages before the header exists (placed, not staged and copied later)."""

    def __init__(self, data: np.ndarray, path_of: object) -> None:
        super().__init__(memoryview(data))
        self.data = data
        self.seen_in_file: bytes | None = None
        self.path_of = path_of

    def wait(self) -> None:
        log = self.path_of
        seg = log._segment  # type: ignore[attr-defined]
        off = self.placed_at - seg.address
        with open(seg.path, "rb") as f:
            f.seek(off)
            self.seen_in_file = f.read(self.nbytes)


def _delta(pages: list[int], payload: object) -> RegionDelta:
    return RegionDelta(SPEC, np.asarray(pages, dtype=np.int64), payload)  # type: ignore[arg-type]


def test_placed_payload_lands_in_the_segment_pages_and_replays(shm: Path) -> None:
    rng = np.random.default_rng(1)
    log = RecoveryLog.open(shm / "log", _opts())
    assert log.accepts_placed
    expect = np.zeros(SPEC.nbytes, np.uint8)
    for e in range(1, 6):
        pages = sorted(rng.choice(64, size=int(rng.integers(1, 9)), replace=False).tolist())
        data = rng.integers(0, 256, len(pages) * PAGE, dtype=np.uint8)
        p = Recording(data, log)
        res = log.append(defs=[SPEC] if e == 1 else [], deltas=[_delta(pages, p)], meta={"e": e})
        assert res.epoch == e
        assert p.seen_in_file == data.tobytes()  # in the file at its final offset before the header was written
        for k, pg in enumerate(pages):
            expect[pg * PAGE:(pg + 1) * PAGE] = data[k * PAGE:(k + 1) * PAGE]
    log.close()
    r = replay(shm / "log")
    assert r.outcome is Outcome.OK and r.epoch == 5 and r.meta == {"e": 5}
    assert np.array_equal(r.regions["r"].data, expect)


def test_large_placed_payload_rolls_to_a_segment_of_its_size_and_checksums_in_pieces(shm: Path) -> None:
    rng = np.random.default_rng(2)
    big = RegionSpec(name="big", kind=RegionKind.DENSE, nbytes=40 << 20, page_bytes=PAGE)
    data = rng.integers(0, 256, big.nbytes, dtype=np.uint8)
    log = RecoveryLog.open(shm / "log", _opts())
    log.append(defs=[big], deltas=[RegionDelta(big, np.arange(big.n_pages, dtype=np.int64),
                                               HostPayload(memoryview(data)))])  # type: ignore[arg-type]
    data2 = data.copy()
    data2[::4096] ^= 0xFF
    log.append(deltas=[RegionDelta(big, np.arange(big.n_pages, dtype=np.int64),
                                   HostPayload(memoryview(data2)))])  # type: ignore[arg-type]
    log.close()
    r = replay(shm / "log")  # every payload CRC verified against the (combined, threaded) one written
    assert r.outcome is Outcome.OK and r.epoch == 2
    assert np.array_equal(r.regions["big"].data, data2)


class Failing(HostPayload):
    def wait(self) -> None:
        raise OSError("DMA failed (test)")


def test_a_failed_placement_leaves_nothing_behind(shm: Path) -> None:
    rng = np.random.default_rng(3)
    log = RecoveryLog.open(shm / "log", _opts())
    good = rng.integers(0, 256, 2 * PAGE, dtype=np.uint8)
    log.append(defs=[SPEC], deltas=[_delta([3, 4], HostPayload(memoryview(good)))], meta=1)
    end = log._segment.end
    with pytest.raises(OSError):
        log.append(deltas=[_delta([5], Failing(memoryview(rng.integers(1, 256, PAGE, dtype=np.uint8))))], meta=2)
    seg = log._segment
    assert seg.end == end and not np.frombuffer(seg._view[end:end + 3 * PAGE], np.uint8).any()
    later = rng.integers(0, 256, PAGE, dtype=np.uint8)
    log.append(deltas=[_delta([9], HostPayload(memoryview(later)))], meta=2)
    log.close()
    r = replay(shm / "log")
    assert r.outcome is Outcome.OK and r.epoch == 2 and r.meta == 2
    assert bytes(r.regions["r"].data[9 * PAGE:10 * PAGE]) == later.tobytes()


_CHILD = r'''
import os, signal, sys
import numpy as np
from concordia_ft.core.log import LogOptions, RecoveryLog
from concordia_ft.core.mapped import HostPayload
from concordia_ft.core.regions import RegionKind, RegionSpec
from concordia_ft.core.tracking import RegionDelta
PAGE = 4096
spec = RegionSpec(name="r", kind=RegionKind.PAGED, nbytes=64 * PAGE, page_bytes=PAGE, block_bytes=PAGE)
class KillAfterPlacing(HostPayload):
    def wait(self):
        os.kill(os.getpid(), signal.SIGKILL)  # the bytes are in the mapping; header and marker never come
log = RecoveryLog.open(sys.argv[1], LogOptions(fsync="never", backend="dram", mapped_segment_bytes=2 << 20))
first = log.last_epoch is None
rng = np.random.default_rng(int(sys.argv[2]))
data = rng.integers(1, 256, 4 * PAGE, dtype=np.uint8)
if first:
    log.append(defs=[spec], deltas=[RegionDelta(spec, np.arange(4, dtype=np.int64), HostPayload(memoryview(data)))], meta="one")
    print("E", log.last_epoch, flush=True)
log.append(deltas=[RegionDelta(spec, np.arange(8, 12, dtype=np.int64), KillAfterPlacing(memoryview(data)))], meta="never")
'''


def test_sigkill_after_the_dma_before_the_header_is_a_torn_tail(shm: Path) -> None:
    d = shm / "log"
    for round_ in range(2):
        p = subprocess.run([PYTHON, "-c", _CHILD, str(d), str(round_)], capture_output=True, text=True,
                           env=subprocess_env(), timeout=120)
        assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
        r = replay(d)
        # nonzero payload bytes behind a zero epoch header: torn, not damage
        assert r.outcome is Outcome.TORN_TAIL and r.epoch == 1 and r.meta == "one", (r.outcome, r.tail)
        assert not r.regions["r"].data[8 * PAGE:].any()
    log = RecoveryLog.open(d, _opts())  # cuts (zeroes) the torn bytes, appends after epoch 1
    assert log.report.cut_bytes > 0 and log.last_epoch == 1
    log.append(meta="two")
    log.close()
    r = replay(d)
    assert r.outcome is Outcome.OK and r.epoch == 2 and r.meta == "two"
    assert not r.regions["r"].data[8 * PAGE:].any()


def test_file_and_mapped_segments_read_each_other(shm: Path) -> None:
    rng = np.random.default_rng(4)
    d = shm / "log"
    a = rng.integers(0, 256, PAGE, dtype=np.uint8)
    b = rng.integers(0, 256, PAGE, dtype=np.uint8)
    log = RecoveryLog.open(d, _opts(mapped="off"))
    assert not log.accepts_placed
    log.append(defs=[SPEC], deltas=[_delta([1], memoryview(a))])
    log.close()
    log = RecoveryLog.open(d, _opts())  # continue the plain file segment as a mapped one
    assert isinstance(log._segment, MappedSegment)
    log.append(deltas=[_delta([2], HostPayload(memoryview(b)))])
    log.close()
    log = RecoveryLog.open(d, _opts(mapped="off"))  # and back: the preallocated zeros are cut off
    assert log.report.cut_reason in ("", "trailing zero bytes")
    log.close()
    r = replay(d)
    assert r.outcome is Outcome.OK and r.epoch == 2
    assert bytes(r.regions["r"].data[PAGE:2 * PAGE]) == a.tobytes()
    assert bytes(r.regions["r"].data[2 * PAGE:3 * PAGE]) == b.tobytes()
    assert os.path.getsize(d / log.manifest.incr[-1]) == log._segment.end


class PinLog:
    """A registrar that records what it was asked to pin and checks each range is one live segment mapping
    (the CUDA layer's is cuMemHostRegister; this one only keeps the books, so the log's side runs on a CPU)."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[tuple[int, int, str]] = []

    def __call__(self, address: int, nbytes: int) -> PinLog.Handle:
        import threading

        assert address % 4096 == 0 and nbytes > 0 and address not in self.live
        self.live[address] = nbytes
        self.calls.append((address, nbytes, threading.current_thread().name))
        return PinLog.Handle(self, address)

    class Handle:
        def __init__(self, owner: PinLog, address: int) -> None:
            self.owner, self.address = owner, address

        def close(self) -> None:
            del self.owner.live[self.address]


def test_segments_are_registered_and_the_next_one_is_prepared_off_the_append_path(shm: Path) -> None:
    import time

    rng = np.random.default_rng(5)
    pins = PinLog()
    log = RecoveryLog.open(shm / "log", _opts())
    log.set_mapping_registrar(pins)
    first = log._segment
    assert first.registered and len(pins.live) >= 1
    deadline = time.monotonic() + 20
    while len(pins.live) < 2 and time.monotonic() < deadline:  # the spare, registered on its own thread
        time.sleep(0.01)
    assert len(pins.live) == 2 and any(name in SPARE_THREADS for *_, name in pins.calls)
    assert [p.name for p in (shm / "log").iterdir() if p.name.endswith(".tmp")]  # the spare, not yet named
    big = RegionSpec(name="big", kind=RegionKind.DENSE, nbytes=1536 << 10, page_bytes=PAGE)
    datas = []
    for e in range(3):  # 1.5 MiB epochs into 2 MiB segments: every epoch after the first rolls
        data = rng.integers(0, 256, big.nbytes, dtype=np.uint8)
        datas.append(data)
        log.append(defs=[big] if e == 0 else [], deltas=[RegionDelta(
            big, np.arange(big.n_pages, dtype=np.int64), HostPayload(memoryview(data)))])  # type: ignore[arg-type]
        while len(pins.live) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert log._segment is not first and log._segment.registered
    assert len(log.manifest.incr) >= 3
    log.close()
    assert not pins.live  # every mapping unregistered before it was unmapped, the spare's too
    assert not [p.name for p in (shm / "log").iterdir() if p.name.endswith(".tmp")]
    r = replay(shm / "log")
    assert r.outcome is Outcome.OK and r.epoch == 3
    assert np.array_equal(r.regions["big"].data, datas[-1])


@pytest.mark.parametrize("mapped", ["off", "on"])
def test_a_first_open_killed_before_its_manifest_leaves_an_empty_log(shm: Path, mapped: str) -> None:
    """The first segment is created (header synced; a mapped one preallocated) before the manifest names it:
    a kill in between leaves a segment and no MANIFEST. Nothing was committed (the manifest comes before the
    first epoch), so replay says empty and the next open starts the log over."""
    from concordia_ft.core.log import _open_segment, segment_header
    from concordia_ft.core.manifest import Manifest
    from concordia_ft.core.oscalls import REAL_OS

    d = shm / "log"
    d.mkdir()
    m = Manifest(log_id="ab" * 16)
    name = m.new_segment_name("incr")
    _open_segment(d / name, _opts(mapped=mapped), REAL_OS, header=segment_header(m, name)).close()
    assert (d / name).exists() and not (d / "MANIFEST").exists()
    assert replay(d).outcome is Outcome.EMPTY
    log = RecoveryLog.open(d, _opts(mapped=mapped))
    assert log.report.created and log.last_epoch is None
    log.append(meta="first")
    log.close()
    r = replay(d)
    assert r.outcome is Outcome.OK and r.epoch == 1 and r.meta == "first"


@pytest.mark.parametrize("impl", ["c", "python"])
def test_placed_crc_in_c_and_on_the_pool_write_the_same_epochs(shm: Path, impl: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The placed append's CRC32Cs (the C extension's crc32c_buffers, or, where it is not built, the crc32c
    package on a pool) are what replay's own check recomputes: several payloads of odd sizes, pieces crossing
    every boundary."""
    from concordia_ft.core import checksums
    from concordia_ft.core import log as log_module

    if impl == "c" and not checksums.native_available():
        pytest.skip(f"the C extension is {checksums.native_status()}")
    if impl == "python":  # as in an install without a C compiler
        monkeypatch.setattr(log_module, "native_available", lambda: False)
    rng = np.random.default_rng(11)
    specs = [RegionSpec(name=f"d{i}", kind=RegionKind.DENSE, nbytes=n, page_bytes=PAGE)
             for i, n in enumerate((3 * PAGE + 5, 5 << 20, (17 << 20) + 123))]
    log = RecoveryLog.open(shm / "log", _opts(mapped_segment_bytes=64 << 20))
    want = {}
    for e in range(2):
        deltas = []
        for sp in specs:
            data = rng.integers(0, 256, sp.n_pages * PAGE, dtype=np.uint8)
            data[sp.nbytes:] = 0  # a region's tail page is zero-padded in the payload
            want[sp.name] = data[: sp.nbytes].copy()
            deltas.append(RegionDelta(sp, np.arange(sp.n_pages, dtype=np.int64), HostPayload(memoryview(data))))
        log.append(defs=specs if e == 0 else [], deltas=deltas)  # type: ignore[arg-type]
    log.close()
    r = replay(shm / "log")
    assert r.outcome is Outcome.OK and r.epoch == 2
    for name, data in want.items():
        assert np.array_equal(r.regions[name].data, data), name


def test_c_crc_of_buffers_equals_the_package() -> None:
    import crc32c

    from concordia_ft.core import checksums

    if not checksums.native_available():
        pytest.skip(f"the C extension is {checksums.native_status()}")
    rng = np.random.default_rng(3)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            for n in (0, 1, 7, 4096, 65535, 65536, 65537, (1 << 20) + 3, 3 << 20)]
    for threads in (1, 3, 8):
        for piece in (4096, 5000, 1 << 20):
            assert checksums.crc32c_buffers(bufs, threads=threads, piece=piece) == [crc32c.crc32c(b) for b in bufs]
    with pytest.raises(ValueError):
        checksums.crc32c_buffers(bufs, piece=100)


@pytest.mark.parametrize("fit", [0, 4])
def test_large_epochs_get_segments_that_hold_several(shm: Path, fit: int) -> None:
    """1.25 MiB epochs with 1 MiB mapped segments: each rolls unless the log grows its spares to hold
    ``mapped_fit_epochs`` of them; either way the log replays every epoch. The worker sizes the spare from the
    epochs seen, so from the third epoch on every roll takes a ready spare (registered on the worker, never on
    the appending thread)."""
    import threading
    import time

    rng = np.random.default_rng(8)
    log = RecoveryLog.open(shm / "log", _opts(mapped_segment_bytes=1 << 20, mapped_fit_epochs=fit))
    pins = PinLog()
    log.set_mapping_registrar(pins)
    big = RegionSpec(name="big", kind=RegionKind.DENSE, nbytes=1280 << 10, page_bytes=PAGE)
    n = 10
    on_path = []  # registrations on the appending thread, per epoch
    for e in range(n):
        data = rng.integers(0, 256, big.nbytes, dtype=np.uint8)
        before = len([c for c in pins.calls if c[2] == threading.current_thread().name])
        log.append(defs=[big] if e == 0 else [], deltas=[RegionDelta(
            big, np.arange(big.n_pages, dtype=np.int64), HostPayload(memoryview(data)))])  # type: ignore[arg-type]
        on_path.append(len([c for c in pins.calls if c[2] == threading.current_thread().name]) - before)
        time.sleep(0.05)
    segments = len(log.manifest.incr)
    log.close()
    # the spare is sized from two epochs seen: from the third epoch on no roll makes a segment
    assert on_path[2:] == [0] * (n - 2), on_path
    if fit:
        assert segments <= 6, segments  # the first, 2 rolls before large epochs recur, then 3 epochs a segment
    else:
        assert segments == n + 1, segments  # the empty first one, then every epoch in its own
    r = replay(shm / "log")
    assert r.outcome is Outcome.OK and r.epoch == n
    assert np.array_equal(r.regions["big"].data, data)


def test_a_roll_waits_for_the_spare_being_prepared_instead_of_making_another(shm: Path) -> None:
    """A slow registration (the driver pinning a big segment): the epoch that rolls meanwhile takes the spare
    when it is ready; no second segment is created and registered beside it."""
    import time

    class SlowPins(PinLog):
        def __call__(self, address: int, nbytes: int) -> PinLog.Handle:
            time.sleep(0.3)
            return super().__call__(address, nbytes)

    pins = SlowPins()
    log = RecoveryLog.open(shm / "log", _opts(mapped_segment_bytes=1 << 20, mapped_fit_epochs=0))
    log.set_mapping_registrar(pins)  # the active segment now; the spare on its thread, 0.3 s
    big = RegionSpec(name="big", kind=RegionKind.DENSE, nbytes=768 << 10, page_bytes=PAGE)
    data = np.ones(big.nbytes, dtype=np.uint8)
    log.append(defs=[big], deltas=[RegionDelta(big, np.arange(big.n_pages, dtype=np.int64),
                                               HostPayload(memoryview(data)))])  # type: ignore[arg-type]
    log.append(deltas=[RegionDelta(big, np.arange(big.n_pages, dtype=np.int64),
                                   HostPayload(memoryview(data)))])  # type: ignore[arg-type]  # rolls
    made = [c for c in pins.calls if c[2] not in SPARE_THREADS]
    log.close()
    assert len(made) == 1, pins.calls  # only the first segment was registered on the appending thread


class GatedPayload(HostPayload):
    """A host payload placed like a DMA in flight: a thread copies it in chunks and writes each chunk's host word
    after it (what the GPU's cuStreamWriteValue32 does for cuda.mapped.DevicePayload), so the log's C checksum
    reads every chunk only once its word says it landed."""

    CHUNK = 1 << 20

    def __init__(self, data: np.ndarray, flags: np.ndarray, first_word: int = 0, delay_s: float = 0.002) -> None:
        super().__init__(memoryview(data))
        self.data, self.flags, self.delay_s = data, flags, delay_s
        n = data.nbytes
        ends = list(range(self.CHUNK, n, self.CHUNK)) + [n]
        # every chunk of every payload has its own word and tag, as cuda.mapped's allocator hands them out
        self.gates = [(end, first_word + i, 1000 + first_word + i) for i, end in enumerate(ends)]
        self.flags_address = int(flags.ctypes.data)
        self._t: object = None

    def place(self, address: int) -> None:
        import ctypes
        import threading
        import time

        self.placed_at = address
        dst = np.frombuffer((ctypes.c_char * self.nbytes).from_address(address), dtype=np.uint8)
        dst[:] = 0xAB  # what is there before the copy lands: a checksum read early would see it

        def copy() -> None:
            done = 0
            for end, w, tag in self.gates:
                time.sleep(self.delay_s)
                dst[done:end] = self.data[done:end]
                self.flags[w] = tag
                done = end

        t = threading.Thread(target=copy)
        t.start()
        self._t = t

    def wait(self) -> None:
        self._t.join()  # type: ignore[attr-defined]


def test_gated_payloads_are_checksummed_as_their_copy_lands(shm: Path) -> None:
    from concordia_ft.core import checksums

    if not checksums.native_available():
        pytest.skip(f"the C extension is {checksums.native_status()}")
    rng = np.random.default_rng(4)
    specs = [RegionSpec(name=f"g{i}", kind=RegionKind.DENSE, nbytes=n, page_bytes=PAGE)
             for i, n in enumerate(((5 << 20) + 3 * PAGE, 3 << 20))]
    log = RecoveryLog.open(shm / "log", _opts(mapped_segment_bytes=32 << 20))
    flags = np.zeros(64, dtype=np.uint32)
    datas = [rng.integers(0, 256, sp.nbytes, dtype=np.uint8) for sp in specs]
    log.append(defs=specs, deltas=[RegionDelta(sp, np.arange(sp.n_pages, dtype=np.int64),
                                               GatedPayload(d, flags, 32 * i))  # type: ignore[arg-type]
                                   for i, (sp, d) in enumerate(zip(specs, datas, strict=True))])
    assert log.last_placed_phases["gated"] == 1.0
    log.close()
    r = replay(shm / "log")  # every payload CRC written equals the one replay computes from the file
    assert r.outcome is Outcome.OK and r.epoch == 1
    for sp, d in zip(specs, datas, strict=True):
        assert np.array_equal(r.regions[sp.name].data, d)


def test_a_gate_that_never_opens_gives_up_instead_of_hanging() -> None:
    from concordia_ft.core import checksums

    if not checksums.native_available():
        pytest.skip(f"the C extension is {checksums.native_status()}")
    buf = np.ones(3 << 20, dtype=np.uint8)
    flags = np.zeros(4, dtype=np.uint32)
    flags[0] = 7
    gates = [(0, 1 << 20, 0, 7), (0, 3 << 20, 1, 9)]  # the first chunk landed, the second never does
    assert checksums.crc32c_buffers([buf], threads=2, flags_address=int(flags.ctypes.data), gates=gates,
                                  timeout_s=0.2) is None
    flags[1] = 9
    import crc32c

    assert checksums.crc32c_buffers([buf], threads=2, flags_address=int(flags.ctypes.data),
                                  gates=gates) == [crc32c.crc32c(buf.tobytes())]


# ------------------------------------------------------------------------------ the prepared-spare path
_SPARE_CHILD = r'''
import os, signal, sys, threading
from pathlib import Path
import numpy as np
from concordia_ft.core.log import LogOptions, RecoveryLog
from concordia_ft.core.mapped import HostPayload
from concordia_ft.core.oscalls import OsCalls
from concordia_ft.core.regions import RegionKind, RegionSpec
from concordia_ft.core.tracking import RegionDelta
mode, d = sys.argv[1], sys.argv[2]
spec = RegionSpec(name="big", kind=RegionKind.DENSE, nbytes=1536 << 10, page_bytes=4096)
def die():
    os.kill(os.getpid(), signal.SIGKILL)
class Pins:  # bookkeeping registrar (the CUDA one is cuMemHostRegister)
    n = 0
    def __call__(self, address, nbytes):
        if threading.current_thread().name == "concordia-segment-worker":
            Pins.n += 1
            if mode == "register" and Pins.n == 2:
                die()  # the second spare: created and faulted in, being registered
        return self
    def close(self):
        pass
class KillingOS(OsCalls):
    took = False
    def replace(self, src, dst):
        super().replace(src, dst)
        if Path(src).name.startswith("spare."):
            KillingOS.took = True
            if mode == "rename":
                die()  # the spare renamed to the next segment's name; no header, not in the manifest
        elif Path(dst).name == "MANIFEST" and KillingOS.took and mode == "manifest":
            die()  # the manifest names the new segment; no epoch in it yet
log = RecoveryLog.open(d, LogOptions(fsync="never", backend="dram", mapped_segment_bytes=2 << 20,
                                     mapped_fit_epochs=0), io=KillingOS())
log.set_mapping_registrar(Pins())
for e in range(1, 6):
    data = np.random.default_rng(e).integers(0, 256, spec.nbytes, dtype=np.uint8)
    log.append(defs=[spec] if e == 1 else [], deltas=[RegionDelta(spec, np.arange(spec.n_pages, dtype=np.int64),
                                                                  HostPayload(memoryview(data)))], meta=e)
    print("E", e, flush=True)
    if e == 1:
        log.wait_spare(20.0)  # the first spare is ready
print("not killed", flush=True)
'''


def _epoch_data(e: int) -> np.ndarray:
    return np.random.default_rng(e).integers(0, 256, 1536 << 10, dtype=np.uint8)


@pytest.mark.parametrize("mode,committed", [("register", 2), ("rename", 1), ("manifest", 1)])
def test_sigkill_on_the_prepared_spare_path_keeps_the_committed_epochs(shm: Path, mode: str, committed: int) -> None:
    """A real process SIGKILLed (1.5 MiB epochs, 2 MiB mapped segments: every epoch after the first rolls onto the
    spare the segment worker prepared): ``register``: while the worker prepares the next spare (created,
    faulted in, being registered); ``rename``: as a roll took the spare (renamed to the next segment's name, no
    header yet, not in the manifest); ``manifest``: once the manifest names it, before its first epoch. Replay
    gives the last committed epoch; a spare or segment file left behind is never taken as committed data (the
    open removes it as an orphan) and the log goes on after the committed epochs."""
    d = shm / "log"
    p = subprocess.run([PYTHON, "-c", _SPARE_CHILD, mode, str(d)], capture_output=True, text=True,
                       env=subprocess_env(), timeout=120)
    assert p.returncode == -signal.SIGKILL, (p.stdout, p.stderr[-2000:])
    left = sorted(q.name for q in d.iterdir())
    r = replay(d)
    assert r.outcome is Outcome.OK and r.epoch == committed and r.meta == committed, (mode, r.outcome, r.tail)
    assert np.array_equal(r.regions["big"].data, _epoch_data(committed))
    named = set(r.manifest.segments())  # type: ignore[union-attr]
    debris = [n for n in left if n.endswith(".tmp") or (n.endswith(".cft") and n not in named)]
    if mode == "register":
        spares = [n for n in left if n.startswith("spare.") and n.endswith(".tmp")]
        assert spares, left  # the spare being prepared is on disk
        # left behind holding a valid segment with the next epoch (a copy of this log with epoch 3 appended):
        # still not committed data, since the manifest does not name it
        scratch = shm / "scratch"
        shutil.copytree(d, scratch)
        for n in spares:
            (scratch / n).unlink()
        other = RecoveryLog.open(scratch, _opts(mapped_fit_epochs=0))
        other.append(deltas=[RegionDelta(SPEC_BIG, np.arange(SPEC_BIG.n_pages, dtype=np.int64),
                                         HostPayload(memoryview(_epoch_data(3))))], meta=3)  # type: ignore[arg-type]
        seg_bytes = (scratch / other.manifest.incr[-1]).read_bytes()
        other.close()
        assert replay(scratch).epoch == 3
        (d / spares[0]).write_bytes(seg_bytes)
        assert replay(d).epoch == committed
    elif mode == "rename":
        assert debris, left  # the renamed spare: a segment name the manifest does not hold
    log = RecoveryLog.open(d, _opts(mapped_fit_epochs=0))
    assert log.last_epoch == committed
    assert set(debris) <= set(log.report.removed_orphans), (debris, log.report.removed_orphans)
    assert not [q for q in d.iterdir() if q.name.endswith(".tmp")]
    log.set_mapping_registrar(PinLog())
    nxt = _epoch_data(100)
    for e in (committed + 1, committed + 2):
        log.append(deltas=[RegionDelta(SPEC_BIG, np.arange(SPEC_BIG.n_pages, dtype=np.int64),
                                       HostPayload(memoryview(nxt)))], meta=e)  # type: ignore[arg-type]
    log.close()
    r = replay(d)
    assert r.outcome is Outcome.OK and r.epoch == committed + 2 and r.meta == committed + 2
    assert np.array_equal(r.regions["big"].data, nxt)


SPEC_BIG = RegionSpec(name="big", kind=RegionKind.DENSE, nbytes=1536 << 10, page_bytes=PAGE)


def test_damage_in_segments_from_prepared_spares_is_found(shm: Path) -> None:
    """Epochs in segments the worker prepared (each epoch rolls onto the ready spare): a flipped payload byte
    in the last epoch is a damaged tail (the writer refuses to append after it); in an earlier, sealed one it
    is corruption; and the spare's preallocated zero tail after the last epoch is no epoch."""
    from concordia_ft.errors import LogCorruptError

    d = shm / "log"
    log = RecoveryLog.open(d, _opts(mapped_fit_epochs=0))
    pins = PinLog()
    log.set_mapping_registrar(pins)
    for e in range(1, 5):
        log.append(defs=[SPEC_BIG] if e == 1 else [], deltas=[RegionDelta(
            SPEC_BIG, np.arange(SPEC_BIG.n_pages, dtype=np.int64), HostPayload(memoryview(_epoch_data(e))))],
            meta=e)  # type: ignore[arg-type]
    made = log._spare.stats["made"]  # type: ignore[union-attr]
    incr = list(log.manifest.incr)
    log.close()
    assert made >= 3 and len(incr) >= 4, (made, incr)
    r = replay(d)
    # the preallocated tail of the last segment (a prepared spare's) reads as zeros: no epoch, no tail
    assert r.outcome is Outcome.OK and r.epoch == 4 and r.trailing_zero_bytes > 0 and r.tail is None
    clean = shm / "clean"
    shutil.copytree(d, clean)

    def flip(name: str, before_end: int) -> None:
        """Flip a byte ``before_end`` bytes before the end of the segment's last epoch (its last nonzero byte:
        the commit marker; the preallocated tail after it is zeros)."""
        raw = np.fromfile(d / name, dtype=np.uint8)
        at = int(np.flatnonzero(raw)[-1]) - before_end
        raw[at] ^= 0x40
        raw.tofile(d / name)

    flip(incr[-1], 64 << 10)  # inside the last epoch's payload
    r = replay(d)
    assert r.outcome is Outcome.DAMAGED_TAIL and r.epoch == 3 and r.meta == 3
    with pytest.raises(LogCorruptError):
        RecoveryLog.open(d, _opts())
    shutil.rmtree(d)
    shutil.copytree(clean, d)
    flip(incr[-2], 64 << 10)  # epoch 3, in a sealed segment
    with pytest.raises(LogCorruptError):
        replay(d)


def test_spares_are_sized_from_the_epochs_seen(tmp_path: Path) -> None:
    """The worker's sizing: the configured capacity until two epochs were seen; a one-off huge epoch (weights
    logged once) does not count; recurring large epochs get spares that hold ``fit_epochs`` of them (at most
    the cap); recurring epochs larger than the cap still get a spare that holds one."""
    from concordia_ft.core.mapped import SparePreparer

    mib = 1 << 20
    sp = SparePreparer(tmp_path, 64 * mib, None, fit_epochs=4, max_capacity=256 * mib)
    assert sp.target_capacity([]) == sp.target_capacity([1000 * mib]) == 64 * mib
    assert sp.target_capacity([1000 * mib, 100_000]) == 64 * mib  # the prefill / weights epoch alone
    lora = 53 * mib
    cap = sp.target_capacity([1000 * mib, lora, lora, lora])
    assert 4 * lora < cap <= 256 * mib
    huge = 300 * mib
    cap = sp.target_capacity([huge, huge])
    assert huge < cap < huge + 2 * mib  # one of them (past the cap): every roll still takes a ready spare
    small = SparePreparer(tmp_path, 64 * mib, None, fit_epochs=0, max_capacity=256 * mib)
    assert small.target_capacity([lora, lora]) == 64 * mib  # fits one already
    assert small.target_capacity([80 * mib, 80 * mib]) > 80 * mib


def test_preparing_a_segment_does_not_hold_the_gil(shm: Path) -> None:
    """A segment is faulted in with the GIL released: Python's mmap(MAP_POPULATE) held it for the whole fault-in
    (~130 ms for 512 MiB on a 2-core CI machine), which stalled the training loop and the epoch writer whenever
    the segment worker prepared a spare. A thread that takes the GIL in a loop keeps running meanwhile."""
    import threading
    import time

    gaps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            time.sleep(0)

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.05)
        gaps.clear()
        seg = MappedSegment(shm / "big.tmp", 384 << 20, create_with=b"")
        made = list(gaps)
        seg.append([b"x" * 4096])
        seg.close()
    finally:
        stop.set()
        t.join()
    assert made and max(made) < 0.06, f"a {1e3 * max(made):.0f} ms stall while the segment was made"


def test_an_epoch_laid_out_once_with_cached_page_records_is_byte_identical() -> None:
    """``layout_epoch`` + ``assemble_epoch`` (a placed epoch's single layout pass, page records of read-only
    pages arrays reused) give exactly ``plan_epoch``'s bytes; a writable pages array is never cached, and a
    different array for the same region is encoded afresh."""
    from concordia_ft.core.epochs import assemble_epoch, layout_epoch, plan_epoch

    rng = np.random.default_rng(12)
    dense = RegionSpec(name="d", kind=RegionKind.DENSE, nbytes=40 * PAGE + 5, page_bytes=PAGE)
    fixed = np.arange(dense.n_pages, dtype=np.int64)
    fixed.flags.writeable = False
    cache: dict = {}
    for e, start in enumerate((4096, 4096 + 777, 3 * 4096 + 5)):
        sparse = np.sort(rng.choice(64, size=9, replace=False)).astype(np.int64)  # writable: not cached
        deltas = [RegionDelta(dense, fixed, rng.integers(0, 256, dense.n_pages * PAGE, dtype=np.uint8).data),
                  RegionDelta(SPEC, sparse, rng.integers(0, 256, len(sparse) * PAGE, dtype=np.uint8).data)]
        meta = {"step": e, "loss": 1.0 / (e + 1)}
        ref = plan_epoch(e + 1, start, defs=[dense, SPEC] if e == 0 else [], drops=[], deltas=deltas, meta=meta)
        lay = layout_epoch(e + 1, start, defs=[dense, SPEC] if e == 0 else [], drops=[],
                           pages_of=[(d.spec, d.pages) for d in deltas], meta=meta, record_cache=cache)
        import crc32c

        got = assemble_epoch(lay, deltas, [crc32c.crc32c(bytes(d.payload)) for d in deltas])
        assert b"".join(bytes(p) for p in got.parts) == b"".join(bytes(p) for p in ref.parts)
        assert got.total_bytes == ref.total_bytes and got.payload_offsets == ref.payload_offsets
        assert list(cache) == [("d", PAGE)]  # only the read-only array's record
    other = np.arange(dense.n_pages - 1, dtype=np.int64)
    other.flags.writeable = False
    lay = layout_epoch(9, 4096, defs=[], drops=[], pages_of=[(dense, other)], record_cache=cache)
    assert lay.records[0][5] == dense.n_pages - 1  # not the cached record of the other array


def test_an_epoch_waits_for_the_worker_at_most_one_piece(shm: Path) -> None:
    """The quiet gate: a worker taking it piece after piece (5 ms each) never holds an epoch off for longer than
    about one piece, and a spare prepared in pieces under it (``gate=``) is whole and zero."""
    import threading
    import time

    from concordia_ft.core.mapped import QuietGate

    gate = QuietGate()
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            with gate:
                time.sleep(0.005)

    t = threading.Thread(target=worker)
    t.start()
    waits = []
    try:
        for _ in range(20):
            time.sleep(0.003)
            t0 = time.perf_counter()
            gate.acquire()
            waits.append(time.perf_counter() - t0)
            time.sleep(0.002)  # the epoch's DMA + CRC
            gate.release()
    finally:
        stop.set()
        t.join()
    assert sorted(waits)[-2] < 0.03, waits  # about one 5 ms piece (scheduling noise aside), never the loop
    seg = MappedSegment(shm / "p.tmp", 20 << 20, create_with=b"", gate=gate)
    assert seg.capacity == 20 << 20 and not np.frombuffer(seg._view, np.uint8).any()
    seg.close()
