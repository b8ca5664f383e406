"""Graph decode's token-epoch writer in C (``_slotlog.c``): ring slots -> committed epochs with the GIL released.

The GPU writes each decoded token's epoch payload into a slot of a ring of host memory (cuda/graphs.py has the
slot layout: a ``slot_header``-byte header whose word 0, ``seq + 1``, is written last, then the pages of the
KV row). ``SlotLogWriter`` leases the log's active segment (``RecoveryLog.lease_tail``) and runs the C writer
on a Python thread that sits inside ``Writer.run()`` with the GIL released: it builds each epoch (the same
records, layout, CRC32C and commit marker as ``RecoveryLog.append`` of the same deltas and metadata), stores it
(mapped segment: payloads, then header, then marker; file segment: one pwritev, then fdatasync under
``always``, or every interval under ``interval``) and signals the decode thread. The thread takes the GIL only
to roll to the next segment (once per segment) or to report a failure.

Optional: without the compiled module (no compiler at install time), or with ``CONCORDIA_SLOTLOG_IMPL=python``,
graph decode uses its Python writer (integrations/graph_decode.py), which writes the same log.

The metadata is a JSON template (``meta_template``): the session's metadata encoded with sentinel numbers
where the per-token values go (n_tokens, n_new, done, each cache length, the time), split at them.
"""

from __future__ import annotations

import os
import re
import struct
import threading
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import CheckpointError, ConfigError
from .format import REC_META, REC_PAGES, REC_RUNS, encode_json
from .log import RecoveryLog, TailLease
from .regions import RegionSpec

try:
    from . import _slotlog  # type: ignore[attr-defined]
    _WHY = ""
except ImportError as _e:  # no compiler at install time: the Python writer runs instead
    _slotlog = None
    _WHY = f"not built: {_e}"

# hole kinds of the metadata template (the C writer's HOLE_*)
HOLE_N_TOKENS, HOLE_N_NEW, HOLE_DONE, HOLE_LENGTH, HOLE_TIME = range(5)
RUN_STOPPED, RUN_ROLL, RUN_FAILED = 0, 1, 2
# sentinels: 19-digit numbers no session metadata holds (checked: each must occur exactly as often as expected)
SENTINELS = {k: 7_391_046_582_000_000_000 + k for k in range(5)}
_TARGET = {"mapped": 1, "file": 2}


def available() -> bool:
    """True when the C writer is built and not switched off (``CONCORDIA_SLOTLOG_IMPL=python``)."""
    return _slotlog is not None and os.environ.get("CONCORDIA_SLOTLOG_IMPL", "c") != "python"


def status() -> str:
    """One line for ``concordia doctor`` and benchmark stamps."""
    if _slotlog is None:
        return f"python ({_WHY})"
    if not available():
        return "python (CONCORDIA_SLOTLOG_IMPL=python)"
    return f"c (crc32c: {_slotlog.crc_impl()})"


def meta_template(doc: Any, counts: Mapping[int, int]) -> tuple[list[bytes], list[int]] | None:
    """Split ``encode_json(doc)`` at the sentinel numbers (``SENTINELS``) into literal chunks and hole kinds.
    ``counts``: how often each hole kind must occur. None when the encoding does not match that (a sentinel in
    a string, a missing field): the caller then uses the Python writer."""
    raw = encode_json(doc)
    by_digits = {str(v).encode(): k for k, v in SENTINELS.items()}
    pat = re.compile(rb"(?<![0-9.\"])(" + b"|".join(re.escape(d) for d in by_digits) + rb")(?![0-9.eE\"])")
    chunks: list[bytes] = []
    holes: list[int] = []
    pos = 0
    for m in pat.finditer(raw):
        chunks.append(raw[pos:m.start()])
        holes.append(by_digits[m.group(1)])
        pos = m.end()
    chunks.append(raw[pos:])
    found = {k: holes.count(k) for k in SENTINELS}
    if any(found[k] != counts.get(k, 0) for k in SENTINELS):
        return None
    if sum(raw.count(d) for d in by_digits) != len(holes):  # one inside a string or a longer number
        return None
    return chunks, holes


class SlotLogWriter:
    """The C writer over one leased log tail, its Python thread, and the decode thread's side of it."""

    def __init__(self, log: RecoveryLog, *, ring_address: int, n_slots: int, slot_bytes: int, slot_header: int,
                 max_pages: int, kv: RegionSpec, tokens_image: npt.NDArray[np.int64], tokens: RegionSpec,
                 meta: tuple[list[bytes], list[int]]) -> None:
        if not available():
            raise ConfigError(f"the C token-epoch writer is {status()}")
        assert _slotlog is not None
        if tokens_image.dtype != np.int64 or not tokens_image.flags.c_contiguous:
            raise ConfigError("the tokens image must be a contiguous int64 array")
        lease = log.lease_tail()
        if lease is None:
            raise ConfigError(f"the log {log.dir} cannot be leased (a DAX segment, injected OS calls or a failed log)")
        self.log = log
        self._image: npt.NDArray[np.int64] | None = tokens_image  # the C writer stores token ids into it: kept alive
        try:
            self._w = _slotlog.Writer(
                ring=int(ring_address), n_slots=int(n_slots), slot_bytes=int(slot_bytes),
                slot_header=int(slot_header), max_pages=int(max_pages), kv_page_bytes=int(kv.page_bytes),
                kv_name=kv.name.encode(), tokens=int(tokens_image.ctypes.data), tokens_nbytes=int(tokens_image.nbytes),
                tokens_page_bytes=int(tokens.page_bytes), tokens_name=tokens.name.encode(), meta_chunks=meta[0],
                meta_holes=meta[1])
            self._target(lease)
        except BaseException:
            log.end_lease({"next_epoch": lease.next_epoch, "end": lease.end, "segment_epochs": lease.segment_epochs,
                           "synced_end": lease.synced_end, "durable_epoch": lease.durable_epoch})
            raise
        # the decode thread's per-token calls go straight to C (no Python frame in between)
        self.submit = self._w.submit  # type: ignore[method-assign]
        self.token = self._w.token  # type: ignore[method-assign]
        self.error: CheckpointError | None = None
        self._ended = False
        self._thread = threading.Thread(target=self._loop, name="concordia-token-epochs-c", daemon=True)
        self._thread.start()

    def _target(self, lease: TailLease) -> None:
        d = asdict(lease)
        d["kind"] = _TARGET[d["kind"]]
        d["address"], d["capacity"] = d.pop("address"), d.pop("capacity")
        self._w.set_target(**d)

    def _loop(self) -> None:
        err: CheckpointError | None = None
        try:
            while True:
                rc = self._w.run()
                if rc == RUN_ROLL:
                    st = self._w.state()
                    try:
                        lease = self.log.roll_leased(st, int(st["need"]))
                    except CheckpointError as e:
                        self._ended = True  # roll_leased ended the lease
                        err = e
                        break
                    self._target(lease)
                    continue
                if rc == RUN_FAILED:
                    failure = self._w.error()
                    if failure is not None:
                        err = self.log.end_lease(self._w.state(), failure)
                        self._ended = True
                break
        except BaseException as e:  # noqa: BLE001 - reported on the decode thread by its next wait
            err = CheckpointError((self.log.last_epoch or 0) + 1, self.log.last_epoch, False,
                                  f"{type(e).__name__}: {e}")
            err.__cause__ = e
        finally:
            if not self._ended:
                self.log.end_lease(self._w.state())
                self._ended = True
            if err is not None:
                self.error = err
                self._w.fail()  # wakes the decode thread's wait

    # -- the decode thread's side ---------------------------------------------------------------------------
    def submit(self, seq: int, n_tokens: int, n_new: int, done: bool) -> None:
        self._w.submit(seq, n_tokens, n_new, done)

    def token(self, seq: int) -> int | None:
        """The token of step ``seq`` from its slot (None when the slot does not hold it)."""
        return self._w.token(seq)  # type: ignore[no-any-return]

    def wait(self, seq: int) -> None:
        """Until the epoch of step ``seq`` committed (GIL released); raises the writer's failure. The log's
        ``last_epoch`` follows (what a caller reads to see what committed, also while the tail is leased)."""
        w = self._w
        while w.wait(seq, 0.5) < seq:
            if self.error is not None or not self._thread.is_alive():
                self._thread.join()
                if self.error is not None:
                    raise self.error
                raise CheckpointError((self.log.last_epoch or 0) + 1, self.log.last_epoch, False,
                                      f"the token-epoch writer stopped before step {seq} committed")
        e = w.last_epoch()
        if e > (self.log.last_epoch or 0):
            self.log.last_epoch = e

    def reached(self, seq: int) -> bool:
        """Whether the epoch of step ``seq`` has committed, without waiting (a failure is ``wait``'s to raise)."""
        return int(self._w.wait(seq, 0.0)) >= seq

    @property
    def committed(self) -> int:
        return int(self._w.state()["committed"])

    def stop(self) -> None:
        """Commit what was submitted, end the lease (the log takes the appended tail over); raises a failure."""
        self._w.stop()
        self._thread.join()
        if self.error is not None:
            raise self.error

    def stats(self) -> npt.NDArray[np.int64]:
        """One row per committed epoch: seq, submit / append start / commit (CLOCK_MONOTONIC ns), bytes, epoch."""
        return np.frombuffer(self._w.stats(), dtype=np.int64).reshape(-1, 6)

    def state(self) -> dict[str, Any]:
        return dict(self._w.state())


# ------------------------------------------------------------------------------------------ step epochs
_BLOB_HEAD = struct.Struct("<II")
_BLOB_ENTRY = struct.Struct("<HHIQQQQ")  # type, 0, name length, count, var length, payload address, payload bytes
_PAD = bytes(8)


def step_blob(records: list[tuple[int, bytes, bytes, int, int, int]]) -> bytes:
    """The records of one step epoch for ``StepLogWriter.submit``: ``(type, name, var, count, payload address,
    payload bytes)`` each, in file order (REC_PAGES / REC_RUNS with a host payload, REC_META last with none).
    ``var`` is what follows the name in the record's descriptor (int64 pages, int64 (start, length) pairs, the
    JSON); the writer lays the epoch out, checksums it and stores it as ``RecoveryLog.append`` would."""
    parts = [_BLOB_HEAD.pack(len(records), 0)]
    for rtype, name, var, count, address, nbytes in records:
        parts.append(_BLOB_ENTRY.pack(rtype, 0, len(name), count, len(var), address, nbytes))
        parts.append(name)
        parts.append(var)
        pad = -(len(name) + len(var)) % 8
        if pad:
            parts.append(_PAD[:pad])
    return b"".join(parts)


def pages_record(name: bytes, pages: npt.NDArray[np.int64], page_bytes: int, address: int
                 ) -> tuple[int, bytes, bytes, int, int, int]:
    """A region's pages (ascending) as one step-epoch record, RUNS or PAGES by core/epochs.py's rule."""
    n = len(pages)
    n_runs = 1 if n == 1 else 1 + int(np.count_nonzero(np.diff(pages) != 1))
    if n > 1 and n_runs * 2 <= n:
        from .tracking import pages_to_runs

        return (REC_RUNS, name, pages_to_runs(pages).astype("<i8").tobytes(), n_runs, address, n * page_bytes)
    return (REC_PAGES, name, pages.astype("<i8").tobytes(), n, address, n * page_bytes)


def rows_record(name: bytes, rows: npt.NDArray[np.int64], pages_per_row: int, page_bytes: int, address: int
                ) -> tuple[int, bytes, bytes, int, int, int]:
    """Whole rows (ascending) of ``pages_per_row`` pages each: ``pages_record`` of their pages, computed from the
    rows (a run per group of consecutive rows) without expanding them."""
    if pages_per_row == 1:
        return pages_record(name, rows, page_bytes, address)
    n = len(rows)
    brk = np.flatnonzero(np.diff(rows) != 1) + 1
    first = np.concatenate(([0], brk))
    count = np.diff(np.concatenate((first, [n])))
    runs = np.empty((len(first), 2), dtype="<i8")
    runs[:, 0] = rows[first] * pages_per_row
    runs[:, 1] = count * pages_per_row
    # n_runs * 2 <= n_pages always holds for rows of 2+ pages: core/epochs.py picks RUNS too
    return (REC_RUNS, name, runs.tobytes(), len(first), address, n * pages_per_row * page_bytes)


def meta_record(meta_json: bytes) -> tuple[int, bytes, bytes, int, int, int]:
    return (REC_META, b"", meta_json, len(meta_json), 0, 0)


class StepLogWriter(SlotLogWriter):
    """The C writer (``_slotlog.StepWriter``) over one leased log tail, for epochs whose records the caller
    describes (``step_blob``): the serving engine's step epochs (serve/stepepochs.py). The payloads are host
    memory the caller keeps unchanged until ``wait(seq)`` returned; ``submit(seq, blob)`` copies only the blob.

    ``threads`` > 1: a payload of ``parallel_min_bytes`` or more is cut into pieces that ``threads - 1`` helper
    threads and the writer copy (into a mapped segment) and checksum together, the pieces' CRCs combined.
    ``fuse_bytes`` > 0: a large payload is copied and checksummed in chunks of that many bytes (each chunk's
    CRC read from the cache right after its copy: DRAM is read once), in up to 4 pieces a thread taken in turn;
    0: each piece is copied whole, then checksummed (the layout before, kept for ablation)."""

    def __init__(self, log: RecoveryLog, *, queue: int = 64, threads: int = 1,
                 parallel_min_bytes: int = 1 << 20, fuse_bytes: int = 256 << 10) -> None:
        if not available():
            raise ConfigError(f"the C epoch writer is {status()}")
        assert _slotlog is not None
        lease = log.lease_tail(rollable=True)  # a compactor's seal: roll_for_seal, not the lease's end
        if lease is None:
            raise ConfigError(f"the log {log.dir} cannot be leased (a DAX segment, injected OS calls or a failed log)")
        self.log = log
        self._image = None
        try:
            self._w = _slotlog.StepWriter(queue=int(queue), threads=int(threads),
                                          parallel_min_bytes=int(parallel_min_bytes), fuse_bytes=int(fuse_bytes))
            self._target(lease)
        except BaseException:
            log.end_lease({"next_epoch": lease.next_epoch, "end": lease.end, "segment_epochs": lease.segment_epochs,
                           "synced_end": lease.synced_end, "durable_epoch": lease.durable_epoch})
            raise
        self.next_epoch = lease.next_epoch  # the number the next submitted step's epoch gets
        self.lease_lost = False
        self.submit = self._w.submit  # type: ignore[method-assign]
        self.error = None
        self._ended = False
        self._thread = threading.Thread(target=self._loop, name="concordia-step-epochs-c", daemon=True)
        self._thread.start()


    def _target(self, lease: TailLease) -> None:
        self.lease = lease
        super()._target(lease)

    def roll_if_needed(self, need: int, *, seal: bool = False) -> bool:
        """Roll to the next segment now, on the calling thread, when an epoch of up to ``need`` bytes would not
        fit the active one (or ``seal``: a compactor wants the segment sealed, and it holds an epoch) and the
        writer is idle (nothing queued): the writer's own thread would otherwise roll, and take the GIL from a
        busy caller to do it. True when it rolled. A failed roll raises ``CheckpointError`` (the lease is then
        over: ``lease_lost``)."""
        st = self._w.state()
        if st["queued"] or st["rolling"]:
            return False
        end, lease = int(st["end"]), self.lease
        epochs = int(st["segment_epochs"])
        if need <= lease.capacity - end and not (epochs > 0 and end + need > lease.soft_max) and not (
                seal and epochs > 0):
            return False
        try:
            new = self.log.roll_leased(st, need)
        except CheckpointError:
            self.lease_lost = True
            self._ended = True  # roll_leased ended the lease
            self._w.fail()
            raise
        self._target(new)
        return True

    def roll_for_seal(self, need: int) -> str:
        """A compactor waits for the active segment to be sealed (``RecoveryLog.seal_wanted``): roll now when
        the writer is idle ("now"), else have the writer roll before its next epoch ("requested")."""
        if self.roll_if_needed(need, seal=True):
            return "now"
        self._w.request_roll()
        return "requested"


__all__ = ["SENTINELS", "SlotLogWriter", "StepLogWriter", "available", "meta_record",
           "meta_template", "pages_record", "rows_record", "status", "step_blob"]
