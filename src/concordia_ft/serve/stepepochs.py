"""Step epochs (``EngineOptions(step_epochs="c")``): an engine step's epoch without the generic checkpoint path.

The generic path (``Runtime.checkpoint``) finds a step's KV rows by scanning the pool's dirty flags on the
device, learns their count on the host (a sync), gathers them, DMAs them, computes the CRCs and stores the
epoch on the calling thread, then does the same for the host regions, and encodes the whole state as JSON.
Here the engine knows which rows the step writes (its feeds' slots), so:

1. right after the forward is enqueued, the rows are gathered on the device (``index_select`` at the step's
   slots, sorted) and copied into a slot of a ring of pinned host memory, on a side stream that waits for the
   forward and runs beside the sampler; the host's part of it (the rows, their record) overlaps the GPU's
   work, and the submit waits for the copy's event (done, or nearly, once the sampler's sync returned);
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
import time
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


def _need(records: list[tuple[int, bytes, bytes, int, int, int]]) -> int:
    """An upper bound of the epoch's bytes (core/epochs.py layout_epoch: header, descriptors, each payload
    4 KiB-aligned, the commit marker)."""
    desc = sum(48 + -(-(len(r[1]) + len(r[2])) // 8) * 8 for r in records)
    pay = [r[5] for r in records if r[5]]
    return 56 + desc + ALIGN * (len(pay) + 1) + sum(pay) + 32


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
            # the gather and the copy run on a side stream after the forward, beside the sampler (not before it);
            # ``copied``: the slot is filled and the flags cleared (submit waits for it: mostly done by then)
            self.side = torch.cuda.Stream(device=self.device)
            self.forward_done = torch.cuda.Event()
            self.copied = torch.cuda.Event()
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
        self.t = {"gather": 0.0, "submit": 0.0, "wait": 0.0, "roll": 0.0}  # host seconds in each, all steps
        self.rolls = 0  # segment rolls done on the engine's thread

    # -- planning and the device side ----------------------------------------------------------------
    def plan(self, feeds: list[tuple[Any, int, int]]) -> list[tuple[Any, int, int]] | None:
        """The step's feeds when it may take the step-epoch path (decided in ``gather``, after the forward was
        enqueued: the host work overlaps the GPU's), or None."""
        return feeds if self.eng.runtime is not None else None

    def gather(self, seq: int, feeds: list[tuple[Any, int, int]]) -> None:
        """The sorted KV rows the feeds wrote (the forward just enqueued) into ring slot ``seq``, in stream
        order, and their record; or nothing when the step takes the generic path (too many rows or token pages,
        or the runtime has something pending)."""
        t0 = time.perf_counter()
        self.gathered = None
        rt = self.eng.runtime
        n = sum(e - s for _, s, e in feeds)
        if (n > self.cap_rows or not rt.leasable(ignore_in_flight=True)
                or int(np.count_nonzero(self.eng.tokens_dirty)) + len(feeds) > self.cap_tok):
            return
        rows = np.fromiter((x for r, s, e in feeds for x in r.slots[s:e]), dtype=np.int64, count=n)
        rows.sort()
        self._free_slot(seq)
        kv_rec = None
        if n:
            kv_rec = slotlog.rows_record(b"kv", rows, self.kv_ppb, self.kv_pb,
                                         self.base + (seq % self.n_slots) * self.slot_bytes)
            view = self.kv_views[seq % self.n_slots][:n]
            if self.cuda:
                self.idx_host.numpy()[:n] = rows
                self.forward_done.record()
                with torch.cuda.stream(self.side):
                    self.side.wait_event(self.forward_done)
                    idx = self.idx_dev[:n]
                    idx.copy_(self.idx_host[:n], non_blocking=True)
                    torch.index_select(self.arena2d, 0, idx, out=self.stage[:n])
                    view.copy_(self.stage[:n], non_blocking=True)
                    self._clear_kv_flags(rows)  # after the forward set them, in stream order
                    self.copied.record(self.side)
            else:
                torch.index_select(self.arena2d, 0, torch.from_numpy(rows), out=view)
                self._clear_kv_flags(rows)
        self.gathered = (seq, rows, kv_rec)
        self.t["gather"] += time.perf_counter() - t0

    def _clear_kv_flags(self, rows: npt.NDArray[np.int64]) -> None:
        if self.cuda:
            self.eng.pool.dirty.index_fill_(0, self.idx_dev[: len(rows)], 0)
        else:
            self.eng.pool.dirty.index_fill_(0, torch.from_numpy(rows), 0)

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
        g = self.gathered
        if g is None or g[0] != seq:
            self.gathered = None
            return False
        if rt is not None and (self.writer is not None or rt.leasable()):
            return True
        self.gathered = None  # gathered, but the generic path writes this one: it logs the rows again
        if len(g[1]):
            if self.cuda:
                self.copied.synchronize()  # the side stream cleared them
            self.eng.pool.dirty.index_fill_(0, torch.from_numpy(g[1]).to(self.device), 1)
        self.fallbacks += 1
        return False

    def submit(self, seq: int, meta_json: bytes) -> StepPending:
        eng = self.eng
        t0 = time.perf_counter()
        assert self.gathered is not None and self.gathered[0] == seq
        _, rows, kv_rec = self.gathered
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
            records.append(kv_rec)
            if self.cuda:
                self.copied.synchronize()  # the side stream's copy ran beside the sampler: done, or nearly
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
        blob = slotlog.step_blob(records)
        try:
            if not self.inflight:  # the writer is idle: a roll it needs happens here (the GIL is ours)
                t1 = time.perf_counter()
                if self.writer.roll_if_needed(_need(records)):
                    self.t["roll"] += time.perf_counter() - t1
                    self.rolls += 1
            self.writer.submit(seq, blob)
        except BaseException:
            self._reflag(p)
            if self.writer is not None and self.writer.lease_lost:
                self._drop_writer()
            raise
        self.writer.next_epoch += 1
        self.inflight.append(p)
        self.t["submit"] += time.perf_counter() - t0
        return p

    def wait(self, p: StepPending) -> None:
        w = self.writer
        assert w is not None
        t0 = time.perf_counter()
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
        self.t["wait"] += time.perf_counter() - t0

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
