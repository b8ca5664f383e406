"""Step epochs (``EngineOptions(step_epochs="c")``): an engine step's epoch without the generic checkpoint path.

The generic path (``Runtime.checkpoint``) finds a step's KV rows by scanning the pool's dirty flags on the
device, learns their count on the host (a sync), gathers them, DMAs them, computes the CRCs and stores the
epoch on the calling thread, then does the same for the host regions, and encodes the whole state as JSON.
Here the engine knows which rows the step writes (its feeds' slots), so:

1. right after the forward, before the sampler's host sync, the rows are gathered on the device
   (``index_select`` at the step's slots, sorted) and copied in stream order into a slot of a ring of pinned
   host memory; the sampler's sync then covers the copy (no sync of its own);
2. after sampling, the step's dirty pages of ``tokens`` and ``rng`` are copied into the same slot (a few KiB),
   the flags the step set are cleared (the KV flags on the device, in stream order), and the metadata comes
   from cached per-request JSON fragments (engine.py ``_meta_json``);
3. the records (kv, tokens, rng pages as RUNS/PAGES records naming the slot's bytes, then META) go to the C
   writer (core/slotlog.py ``StepLogWriter``, ``_slotlog.StepWriter``): it lays the epoch out as
   ``RecoveryLog.append`` would, computes the CRC32Cs and stores it into the leased log tail (a mapped DRAM
   segment: payloads, header, commit marker, in that order), with the GIL released.

The epoch's bytes are the ones the generic path writes for the same pages and metadata (same records, same
layout), so recovery reads them unchanged. Durability is the engine's: with ``async_epochs=False`` a step
returns once its epoch committed (durable); with ``async_epochs=True`` the step's output is held until the
next step, which waits for it after its own forward (pipelined: a crash loses at most the last step, whose
tokens no client has seen; the recovered engine recomputes it).

A step whose rows or token pages do not fit a slot (a large prefill), the first epoch of a log (region
definitions), or a runtime with something pending (a full epoch after a failure) goes through the generic
path: the lease is ended first (the writer drains), and taken again at the next step that fits.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..core import slotlog
from ..errors import CheckpointError

SLOTS = 3  # ring slots: one being gathered, one being written (pipelined), one spare
ALIGN = 4096


def _up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def available() -> bool:
    return slotlog.available()


class StepPending:
    """One step epoch handed to the C writer: ``wait()`` returns its number once committed."""

    def __init__(self, owner: StepEpochs, seq: int, epoch: int, taken: tuple[Any, Any, Any]) -> None:
        self.owner, self.seq, self.epoch = owner, seq, epoch
        self.taken = taken  # (kv rows, token pages, rng rows) whose flags it cleared
        self.stats: Any = None
        self.done = False

    def wait(self) -> int:
        if not self.done:
            self.owner.wait(self)
        return self.epoch


class _Bytes:
    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes


class StepEpochs:
    """The ring, the device staging buffer and the C writer of one engine's step epochs."""

    def __init__(self, engine: Any, *, cap_rows: int | None = None, slots: int = SLOTS,
                 threads: int | None = None) -> None:
        eng = self.eng = engine
        # the C writer's copy + CRC threads for the rows (the decode thread and the GPU's feeder keep a core each)
        self.threads = int(threads) if threads else int(os.environ.get(
            "CONCORDIA_STEP_EPOCH_THREADS", max(1, min(4, (os.cpu_count() or 1) - 2))))
        geo = eng.geo
        self.device = eng.device
        self.cuda = self.device.type == "cuda"
        self.row_bytes = geo.row_bytes
        self.kv_pb = geo.page_bytes
        self.kv_ppb = geo.row_bytes // geo.page_bytes
        self.cap_rows = int(cap_rows or max(2 * eng.opts.max_running, 32))
        self.cap_tok = self.cap_rows + eng.opts.max_running  # 512-byte pages of ``tokens``
        self.rng_rb = eng.rng.row_bytes
        self.rng_pb = 512
        self.rng_ppb = self.rng_rb // self.rng_pb
        self.tok_off = _up(self.cap_rows * self.row_bytes)
        self.rng_off = self.tok_off + _up(self.cap_tok * 512)
        self.slot_bytes = self.rng_off + _up(eng.opts.max_running * self.rng_rb)
        self.n_slots = int(slots)
        self.ring = torch.empty(self.n_slots * self.slot_bytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.ring_np = self.ring.numpy()
        self.base = int(self.ring.data_ptr())
        self.kv_views = [self.ring[i * self.slot_bytes: i * self.slot_bytes + self.cap_rows * self.row_bytes]
                         .view(self.cap_rows, self.row_bytes) for i in range(self.n_slots)]
        self.arena2d = eng.pool.arena.view(geo.slots, self.row_bytes)
        if self.cuda:
            self.stage = torch.empty(self.cap_rows, self.row_bytes, dtype=torch.uint8, device=self.device)
            self.idx_host = torch.zeros(self.cap_rows, dtype=torch.long, pin_memory=True)
            self.idx_dev = torch.zeros(self.cap_rows, dtype=torch.long, device=self.device)
            self.copied = torch.cuda.Event()  # the ring slot's copy is done (a step that samples nothing has no sync)
        self.tok_u8 = eng.tokens.view(np.uint8).reshape(-1, 512)
        self.rng_rows = eng.rng.buf.reshape(-1, self.rng_rb)
        self.writer: slotlog.StepLogWriter | None = None
        self._bytes_seen = 0
        self.gathered: tuple[int, npt.NDArray[np.int64]] | None = None  # (seq, rows) of the step in flight
        self.committed_seq = -1
        self.bytes0 = 0  # the writer's bytes_written / epochs at the last count
        self.epochs0 = 0
        self.steps = 0  # step epochs committed by this engine
        self.fallbacks = 0  # steps that went through the generic path
        self.inflight: list[StepPending] = []

    # -- planning and the device side ----------------------------------------------------------------
    def plan(self, feeds: list[tuple[Any, int, int]]) -> npt.NDArray[np.int64] | None:
        """The sorted KV rows the step's feeds write, or None when this step takes the generic path."""
        rt = self.eng.runtime
        if rt is None or not rt.leasable(ignore_in_flight=True):
            return None
        n = sum(e - s for _, s, e in feeds)
        if n > self.cap_rows:
            return None
        if int(np.count_nonzero(self.eng.tokens_dirty)) + len(feeds) > self.cap_tok:
            return None
        if not feeds:
            return np.zeros(0, np.int64)
        rows = np.fromiter((x for r, s, e in feeds for x in r.slots[s:e]), dtype=np.int64, count=n)
        rows.sort()
        return rows

    def gather(self, seq: int, rows: npt.NDArray[np.int64]) -> None:
        """Copy the step's rows (written by the forward just enqueued) into ring slot ``seq``, in stream order."""
        self._free_slot(seq)
        n = len(rows)
        if n:
            view = self.kv_views[seq % self.n_slots][:n]
            if self.cuda:
                self.idx_host.numpy()[:n] = rows
                idx = self.idx_dev[:n]
                idx.copy_(self.idx_host[:n], non_blocking=True)
                torch.index_select(self.arena2d, 0, idx, out=self.stage[:n])
                view.copy_(self.stage[:n], non_blocking=True)
                self.copied.record()
            else:
                torch.index_select(self.arena2d, 0, torch.from_numpy(rows), out=view)
        self.gathered = (seq, rows)

    def _free_slot(self, seq: int) -> None:
        old = seq - self.n_slots
        if old > self.committed_seq:
            for p in list(self.inflight):
                if p.seq <= old:
                    p.wait()

    # -- the host side and the writer ------------------------------------------------------------------
    def ready(self, seq: int) -> bool:
        """The gathered step ``seq`` may go to the C writer (else the caller runs the generic path)."""
        rt = self.eng.runtime
        ok = self.gathered is not None and self.gathered[0] == seq and rt is not None and (
            self.writer is not None or rt.leasable())
        if not ok:
            self.gathered = None
            self.fallbacks += 1
        return ok

    def submit(self, seq: int, meta_json: bytes) -> StepPending:
        eng = self.eng
        assert self.gathered is not None and self.gathered[0] == seq
        rows = self.gathered[1]
        self.gathered = None
        if self.writer is None:
            self.writer = slotlog.StepLogWriter(eng.runtime.log, queue=self.n_slots + 2, threads=self.threads)
            st = self.writer.state()
            self.bytes0, self.epochs0 = int(st["bytes_written"]), int(st["epochs"])
            self._bytes_seen = self.bytes0
        k = seq % self.n_slots
        base = k * self.slot_bytes
        records = []
        n = len(rows)
        if n:
            records.append(slotlog.rows_record(b"kv", rows, self.kv_ppb, self.kv_pb, self.base + base))
            if self.cuda:
                eng.pool.dirty.index_fill_(0, self.idx_dev[:n], 0)  # after the forward set them, in stream order
                self.copied.synchronize()  # (already done when the step sampled: the sampler synced)
            else:
                eng.pool.dirty.index_fill_(0, torch.from_numpy(rows), 0)
        tb = np.flatnonzero(eng.tokens_dirty)
        if len(tb):
            off = base + self.tok_off
            self.ring_np[off: off + len(tb) * 512].reshape(-1, 512)[:] = self.tok_u8[tb]
            eng.tokens_dirty[tb] = 0
            records.append(slotlog.pages_record(b"tokens", tb.astype(np.int64), 512, self.base + off))
        rr = np.flatnonzero(eng.rng.dirty)
        if len(rr):
            off = base + self.rng_off
            self.ring_np[off: off + len(rr) * self.rng_rb].reshape(-1, self.rng_rb)[:] = self.rng_rows[rr]
            eng.rng.dirty[rr] = 0
            records.append(slotlog.rows_record(b"rng", rr.astype(np.int64), self.rng_ppb, self.rng_pb,
                                               self.base + off))
        records.append(slotlog.meta_record(meta_json))
        p = StepPending(self, seq, self.writer.next_epoch, (rows, tb, rr))
        try:
            self.writer.submit(seq, slotlog.step_blob(records))
        except BaseException:
            self._reflag(p)
            raise
        self.writer.next_epoch += 1
        self.inflight.append(p)
        return p

    def wait(self, p: StepPending) -> None:
        w = self.writer
        assert w is not None
        try:
            w.wait(p.seq)
        except CheckpointError:
            for q in self.inflight:  # this one and any submitted after it: their changes go in the next epoch
                self._reflag(q)
            self.inflight.clear()
            self._drop_writer()
            raise
        st = w.state()
        done = [q for q in self.inflight if q.seq <= p.seq]
        self.inflight = [q for q in self.inflight if q.seq > p.seq]
        nbytes = int(st["bytes_written"])
        for q in done:
            q.done = True
        p.stats = _Bytes(nbytes - self._bytes_seen)
        self._bytes_seen = nbytes
        self.committed_seq = max(self.committed_seq, p.seq)
        self.steps += len(done)

    def _reflag(self, p: StepPending) -> None:
        rows, tb, rr = p.taken
        eng = self.eng
        if len(rows):
            eng.pool.dirty.index_fill_(0, torch.from_numpy(rows).to(self.device), 1)
        eng.tokens_dirty[tb] = 1
        eng.rng.dirty[rr] = 1

    def suspend(self) -> None:
        """End the lease (the writer commits what it was given first); the generic path may append again."""
        if self.writer is None:
            return
        for p in list(self.inflight):
            p.wait()
        w = self.writer
        self.writer = None
        w.stop()
        self._count(w)

    def _count(self, w: slotlog.StepLogWriter) -> None:
        st = w.state()
        rt = self.eng.runtime
        if rt is not None:  # step epochs count toward the runtime's compaction threshold like its own
            rt._count_appended(int(st["bytes_written"]) - self.bytes0, int(st["epochs"]) - self.epochs0)
        self._bytes_seen = 0

    def _drop_writer(self) -> None:
        w, self.writer = self.writer, None
        if w is not None:
            try:
                w.stop()
            except CheckpointError:
                pass  # already raised to the caller

    def leased_bytes(self) -> int:
        if self.writer is None:
            return 0
        return int(self.writer.state()["bytes_written"]) - self.bytes0

    def close(self) -> None:
        self.suspend()


__all__ = ["StepEpochs", "StepPending", "available"]
