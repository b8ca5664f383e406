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

A step with more rows than a slot (a prefill chunk) goes to a pinned bulk buffer, or, on a GPU whose log segments
are mapped and registered, through the generic path, which DMAs its rows straight into the segment
(``placed_steps``). A step with more rows than the bulk buffer may hold, or a runtime with something pending (a
region definition, a full epoch after a failure) also goes through the generic path (``fallbacks``, by reason in
``fallback_reasons``): the lease is ended first (the writer drains), and taken again at the next step that fits.
A compaction's seal does not end the lease: the writer rolls to a new segment before its next epoch.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..core import slotlog
from ..errors import CheckpointError, ConfigError

log = logging.getLogger("concordia_ft.serve")

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


# pinned bulk buffers of closed engines, kept for the next one in this process (page-locking half a GiB takes
# ~0.3 s on the H200's host: a server pays it once, not at every engine it builds)
_SPARE_BULK: list[torch.Tensor] = []
_SPARE_BULK_MAX = 2


def _take_bulk(size: int, pinned: bool) -> torch.Tensor:
    for i, t in enumerate(_SPARE_BULK):
        if t.numel() >= size and t.is_pinned() == pinned:
            return _SPARE_BULK.pop(i)
    return torch.empty(size, dtype=torch.uint8, pin_memory=pinned)


def _give_bulk(t: torch.Tensor) -> None:
    _SPARE_BULK.append(t)
    _SPARE_BULK.sort(key=lambda x: -x.numel())
    del _SPARE_BULK[_SPARE_BULK_MAX:]


class StepPending:
    """One step epoch for the C writer: ``wait()`` returns its number once committed. A pipelined engine
    ``prepare``s it at the end of its step (the host parts copied, the flags cleared) and ``send``s it after the
    next step's forward was launched; ``wait()`` sends it first if nobody did."""

    def __init__(self, owner: StepEpochs, seq: int, epoch: int, taken: tuple[Any, Any, Any, Any]) -> None:
        self.owner, self.seq, self.epoch = owner, seq, epoch
        self.taken = taken  # (kv rows, token pages, rng rows, [(flags, pages)] of page_regions) whose flags it cleared
        self.stats: Any = None
        self.done = False
        self.sent = False
        self.records: list[tuple[int, bytes, bytes, int, int, int]] = []
        self.event: Any = None  # the side stream's copy of its rows (CUDA), None when done or none
        self.keep: list[Any] = []  # host memory its records name that is not the ring's (kept until committed)
        self.bulk = False  # its rows are in the bulk buffer (a step larger than a ring slot)
        self.gathered: Any = None  # deferred: the step's gathered rows, until ``materialize``
        self.meta_fn: Any = None  # deferred: builds the metadata JSON (the engine's state is still the step's)

    def wait(self) -> int:
        if not self.done:
            self.owner.wait(self)
        return self.epoch

    def poll(self) -> bool:
        """Committed (its bookkeeping then done, as ``wait``'s), without waiting."""
        if self.done:
            return True
        w = self.owner.writer
        if not self.sent or w is None or not w.reached(self.seq):
            return False
        self.owner.wait(self)
        return True


class _Bytes:
    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes


# phase timers (host seconds, summed over steps): ``gather`` (rows to the ring, enqueued after the forward),
# ``prepare`` (the host pages into the slot, flags cleared, at the step's end), ``copy_wait`` (send: the side
# stream's copy of the rows not done yet), ``send`` (blob + hand-off to the C writer, copy_wait included),
# ``wait`` (for the writer's commit), ``roll`` (segment rolls on the engine's thread), ``meta`` (the engine's
# metadata JSON), ``alloc`` (the pinned bulk buffer, inside ``gather``)
PHASES = ("gather", "prepare", "copy_wait", "send", "wait", "roll", "meta", "alloc")
BULK_MAX_BYTES = 2 << 30
COUNT_BYTES = 32 << 20  # the writer's bytes go to the runtime's compaction count at least this often


class StepEpochs:
    """The ring, the device staging buffer and the C writer of one engine's step epochs."""

    def __init__(self, engine: Any, *, cap_rows: int | None = None, slots: int = SLOTS,
                 threads: int | None = None, bulk_max_bytes: int = BULK_MAX_BYTES) -> None:
        eng = self.eng = engine
        # the C writer's copy + CRC threads for the rows (the decode thread, the GPU's feeder and the log's
        # background work keep a core each): a prefill's epoch of hundreds of MB is written by all of them
        # (H200 host, 16 cores, 32 requests: 12 threads cut the whole-run cost 22.2 -> 17.0%)
        self.threads = int(threads) if threads else int(os.environ.get(
            "CONCORDIA_STEP_EPOCH_THREADS", max(1, min(12, (os.cpu_count() or 1) - 4))))
        # copy + CRC of a large payload fused in chunks of this many bytes (0: unfused, the layout before; the
        # benchmark's ablation ``:nofuse``)
        self.fuse_bytes = int(os.environ.get("CONCORDIA_STEP_EPOCH_FUSE", 256 << 10))
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
        # a step with more rows than a slot holds (a prefill): its rows go to one pinned buffer, grown on demand
        # (power-of-two bytes; torch's pinned allocator keeps freed ones), gathered in pieces of ``cap_rows``
        self.bulk_max_bytes = int(bulk_max_bytes)
        self.bulk: torch.Tensor | None = None
        self.bulk_p: StepPending | None = None  # the epoch whose rows the bulk buffer holds until it committed
        if self.cuda:
            self.stage = torch.empty(self.cap_rows, self.row_bytes, dtype=torch.uint8, device=self.device)
            self.idx_host = torch.zeros(self.n_slots * self.cap_rows, dtype=torch.long, pin_memory=True)
            self.bulk_idx = torch.zeros(0, dtype=torch.long, pin_memory=True)
            self.bulk_idx_dev = torch.zeros(0, dtype=torch.long, device=self.device)
            self.idx_dev = torch.zeros(self.cap_rows, dtype=torch.long, device=self.device)
            # the gather and the copy run on a side stream after the forward, beside the sampler (not before it);
            # ``copied[k]``: slot k is filled and the flags cleared (send waits for it: long done by then)
            self.side = torch.cuda.Stream(device=self.device)
            self.forward_done = torch.cuda.Event()
            self.copied = [torch.cuda.Event() for _ in range(self.n_slots)]
            self.bulk_copied = torch.cuda.Event()
        self.tok_u8 = eng.tokens.view(np.uint8).reshape(-1, 512)
        self.rng_rows = eng.rng.buf.reshape(-1, self.rng_rb)
        self.writer: slotlog.StepLogWriter | None = None
        self._bytes_seen = 0
        self.gathered: tuple[int, npt.NDArray[np.int64], Any, bool] | None = None  # the step in flight
        self.prepared: StepPending | None = None  # prepared, not sent yet (pipelined)
        self.deferred: StepPending | None = None  # not even prepared yet (pipelined: ``defer``)
        self.committed_seq = -1
        self.bytes0 = 0  # the writer's bytes_written / epochs at the last count
        self.epochs0 = 0
        self.steps = 0  # step epochs committed by this engine
        self.bulk_steps = 0  # ... of them through the bulk buffer
        self.fallbacks = 0  # steps that went through the generic path
        self.fallback_reasons: dict[str, int] = {}  # ... by reason (Runtime.lease_blocker's, "bulk_limit", ...)
        self._skipped: tuple[int, str] | None = None  # the step gather() left to the generic path, and why
        self.meta_bytes = 0  # metadata JSON bytes of every step epoch (summed)
        # a step with more rows than a ring slot (a prefill chunk) on a GPU whose log segments are mapped and
        # registered: its epoch goes through the generic path, whose CUDA tracker hands the log the rows on the
        # device and the log DMAs them straight into the segment at their final offsets (cuda/mapped.py), instead
        # of a DtoH into the pinned bulk buffer and the C writer's memcpy into the segment (two passes over host
        # memory at DRAM speed). CONCORDIA_STEP_EPOCH_BULK: "placed" / "c" (the bulk buffer) / "auto".
        self.bulk_mode = os.environ.get("CONCORDIA_STEP_EPOCH_BULK", "auto")
        if self.bulk_mode not in ("auto", "placed", "c"):
            raise ConfigError(f"CONCORDIA_STEP_EPOCH_BULK={self.bulk_mode!r}: use auto, placed or c")
        self.placed_steps = 0  # steps whose epoch the generic path placed (DMA'd) into the log (bulk_mode)
        self.inflight: list[StepPending] = []
        self.t = dict.fromkeys(PHASES, 0.0)  # host seconds in each phase, all steps
        self.rolls = 0  # segment rolls done on the engine's thread
        self.seal_rolls = 0  # rolls for a compaction's seal (now or by the writer before the next epoch)
        self.overlapped = 0  # deferred epochs prepared and sent while the next forward ran (pipelined)
        self.send_deferred = 0  # sends put off to the step's end: the rows' copy was still running (pipelined)
        # the largest epoch the writer stored (a prefill's): its bytes, the writer's time on it (start to commit)
        # and from its submit to its commit (ms), from the writer's stats at the end of each lease
        self.largest = {"bytes": 0.0, "write_ms": 0.0, "commit_ms": 0.0}
        # benchmark attribution only (bench_serve.py --modes c-async:nogpu / :nowriter): "gpu" skips the rows'
        # gather and copy, "writer" the C writer (the epoch counts as committed): the log is then WRONG
        self._ablate = os.environ.get("CONCORDIA_STEP_EPOCH_ABLATE", "")

    # -- planning and the device side ----------------------------------------------------------------
    def plan(self, feeds: list[tuple[Any, int, int]]) -> list[tuple[Any, int, int]] | None:
        """The step's feeds when it may take the step-epoch path (decided in ``gather``, after the forward was
        enqueued: the host work overlaps the GPU's), or None."""
        return feeds if self.eng.runtime is not None else None

    def gather(self, seq: int, feeds: list[tuple[Any, int, int]]) -> None:
        """The sorted KV rows the feeds wrote (the forward just enqueued) into ring slot ``seq`` (or the bulk
        buffer: more rows than a slot holds), in stream order, and their record; or nothing when the step takes
        the generic path (more rows than the bulk buffer may hold, or the runtime has something pending)."""
        t0 = time.perf_counter()
        self.gathered = None
        self._skipped = None
        rt = self.eng.runtime
        n = sum(e - s for _, s, e in feeds)
        if n * self.row_bytes > self.bulk_max_bytes:
            self._skipped = (seq, "bulk_limit")
            return
        why = rt.lease_blocker(ignore_in_flight=True)
        if why is not None:
            self._skipped = (seq, why)
            return
        if n > self.cap_rows and self._placed_bulk():
            self._skipped = (seq, "placed")  # a prefill: the generic path DMAs its rows into the log's pages
            return
        rows = np.fromiter((x for r, s, e in feeds for x in r.slots[s:e]), dtype=np.int64, count=n)
        rows.sort()
        self._free_slot(seq)
        kv_rec = None
        bulk = n > self.cap_rows
        if bulk:
            view = self._bulk_view(n)
            address = int(view.data_ptr())
        elif n:
            view = self.kv_views[seq % self.n_slots][:n]
            address = self.base + (seq % self.n_slots) * self.slot_bytes
        if n:
            kv_rec = slotlog.rows_record(b"kv", rows, self.kv_ppb, self.kv_pb, address)
            if self.cuda:
                self.forward_done.record()
                # the indices: a pinned buffer per slot (its last copy finished: that step committed) and one
                # for bulk steps (likewise), one transfer
                ih = self._idx_host(seq, n, bulk)
                ih.numpy()[:] = rows
                with torch.cuda.stream(self.side):
                    self.side.wait_event(self.forward_done)
                    idx_all = (self.bulk_idx_dev if bulk else self.idx_dev)[:n]
                    idx_all.copy_(ih, non_blocking=True)
                    for lo in range(0, n, self.cap_rows):  # a bulk step in pieces of a slot (the staging buffer)
                        hi = min(n, lo + self.cap_rows)
                        if self._ablate != "gpu":
                            torch.index_select(self.arena2d, 0, idx_all[lo:hi], out=self.stage[: hi - lo])
                            view[lo:hi].copy_(self.stage[: hi - lo], non_blocking=True)
                    self.eng.pool.dirty.index_fill_(0, idx_all, 0)  # after the forward set them, in stream order
                    (self.bulk_copied if bulk else self.copied[seq % self.n_slots]).record(self.side)
            else:
                torch.index_select(self.arena2d, 0, torch.from_numpy(rows), out=view)
                self.eng.pool.dirty.index_fill_(0, torch.from_numpy(rows), 0)
        self.gathered = (seq, rows, kv_rec, bulk)
        self.t["gather"] += time.perf_counter() - t0

    def _placed_bulk(self) -> bool:
        if self.bulk_mode != "auto":
            return self.bulk_mode == "placed"
        log = self.eng.runtime.log
        return self.cuda and log.accepts_placed and log.registers_segments

    def _idx_host(self, seq: int, n: int, bulk: bool) -> torch.Tensor:
        if bulk:
            return self.bulk_idx[:n]  # (sized by _bulk_view)
        k = seq % self.n_slots
        return self.idx_host[k * self.cap_rows: k * self.cap_rows + n]

    def _bulk_view(self, n: int) -> torch.Tensor:
        """The bulk buffer as ``n`` rows, once the epoch that last used it committed (a deferred one is sent
        first: gather runs right after the forward's launch, the state is still the deferred step's)."""
        self.send()
        if self.bulk_p is not None:
            self.bulk_p.wait()
            self.bulk_p = None
        self._ensure_bulk(n)
        assert self.bulk is not None
        return self.bulk[: n * self.row_bytes].view(n, self.row_bytes)

    def _ensure_bulk(self, n: int) -> None:
        """The bulk buffer (and the indices' buffers) for ``n`` rows (nothing of the last bulk step is in
        flight: it committed)."""
        need = n * self.row_bytes
        if self.bulk is None or self.bulk.numel() < need:
            t0 = time.perf_counter()
            if self.bulk is not None:
                _give_bulk(self.bulk)
            self.bulk = _take_bulk(1 << max(20, (need - 1).bit_length()), self.cuda)
            self.t["alloc"] += time.perf_counter() - t0
        if self.cuda and self.bulk_idx_dev.numel() < n:
            self.bulk_idx_dev = torch.empty(1 << (n - 1).bit_length(), dtype=torch.long, device=self.device)
        if self.cuda and self.bulk_idx.numel() < n:
            self.bulk_idx = torch.empty(1 << (n - 1).bit_length(), dtype=torch.long, pin_memory=True)

    def prepare_bulk(self, rows: int) -> None:
        """At construction (``EngineOptions.prepare_ahead``): the bulk buffer for a step of ``rows`` rows (a full
        prefill of ``max_batch_tokens``), so the first prefill does not page-lock it (~0.3 s for 0.5 GiB on the
        H200 host; a buffer a closed engine of this process left is taken instead). Nothing when such a step
        fits a ring slot or would take the generic path."""
        if (self.cap_rows < rows and rows * self.row_bytes <= self.bulk_max_bytes and self.bulk_p is None
                and not self._placed_bulk()):
            t = self.t["alloc"]
            self._ensure_bulk(rows)
            self.t["alloc"] = t  # construction's, not a step's

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
            skipped, self._skipped = self._skipped, None
            why = skipped[1] if skipped is not None and skipped[0] == seq else "not_gathered"
            if why == "placed":
                self.placed_steps += 1
            else:
                self._fell_back(why)
            return False
        why = None if self.writer is not None else rt.lease_blocker()
        if why is None:
            return True
        self.gathered = None  # gathered, but the generic path writes this one: it logs the rows again
        if len(g[1]):
            if self.cuda:
                (self.bulk_copied if g[3] else self.copied[seq % self.n_slots]).synchronize()  # flags cleared
            self.eng.pool.dirty.index_fill_(0, torch.from_numpy(g[1]).to(self.device), 1)
        self._fell_back(why)
        return False

    def _fell_back(self, why: str) -> None:
        """A step whose epoch the generic path writes: counted, by reason (``fallback_reasons``), and logged."""
        self.fallbacks += 1
        self.fallback_reasons[why] = self.fallback_reasons.get(why, 0) + 1
        log.debug("step epoch through the generic path: %s", why)

    def submit(self, seq: int, meta_json: bytes) -> StepPending:
        """``prepare`` + ``send`` (the durable engine: its step then waits for the commit)."""
        p = self.prepare(seq, meta_json)
        self.send()
        return p

    def defer(self, seq: int, meta_fn: Any) -> StepPending:
        """At the end of step ``seq`` (pipelined): its epoch, to be prepared later from the engine's state,
        which the engine keeps as the step left it until then: ``materialize`` runs before anything changes it
        (an admission, a submit, collect or abort, a step without a forward), else ``send`` after the next
        forward's launch (the host work then overlaps the GPU's)."""
        assert self.gathered is not None and self.gathered[0] == seq
        self.materialize()
        if self.prepared is not None:
            self.send()
        p = StepPending(self, seq, -1, ((), (), (), ()))
        p.gathered, p.meta_fn = self.gathered, meta_fn
        self.gathered = None
        self.deferred = p
        return p

    def materialize(self, *, overlapped: bool = False) -> None:
        """Prepare the deferred step epoch now (its metadata and host pages are the engine's state now)."""
        p = self.deferred
        if p is None:
            return
        self.deferred = None
        self.overlapped += overlapped
        t0 = time.perf_counter()
        meta = p.meta_fn()
        self.t["meta"] += time.perf_counter() - t0
        g, p.gathered, p.meta_fn = p.gathered, None, None
        self._prepare(p, g, meta)

    def prepare(self, seq: int, meta_json: bytes) -> StepPending:
        """At the end of step ``seq``: its host pages (``tokens``, ``rng``) into its slot, their flags cleared,
        its records; ``send()`` hands it to the writer."""
        assert self.gathered is not None and self.gathered[0] == seq
        self.materialize()
        if self.prepared is not None:  # (a step with no forward: the one before it was not sent yet)
            self.send()
        g, self.gathered = self.gathered, None
        p = StepPending(self, seq, -1, ((), (), (), ()))
        self._prepare(p, g, meta_json)
        return p

    def _prepare(self, p: StepPending, gathered: Any, meta_json: bytes) -> None:
        eng = self.eng
        t0 = time.perf_counter()
        seq, rows, kv_rec, bulk = gathered
        if self.writer is None:
            self.writer = slotlog.StepLogWriter(eng.runtime.log, queue=self.n_slots + 2, threads=self.threads,
                                                fuse_bytes=self.fuse_bytes)
            st = self.writer.state()
            self.bytes0, self.epochs0 = int(st["bytes_written"]), int(st["epochs"])
            self._bytes_seen = self.bytes0
        base = (seq % self.n_slots) * self.slot_bytes
        tb = np.flatnonzero(eng.tokens_dirty)
        rr = np.flatnonzero(eng.rng.dirty)
        p.epoch = self.writer.next_epoch
        records = p.records
        if len(rows):
            records.append(kv_rec)
            if self.cuda:
                p.event = self.bulk_copied if bulk else self.copied[seq % self.n_slots]
        if bulk:
            p.bulk = True
            self.bulk_p = p
        if len(tb):
            if len(tb) <= self.cap_tok:
                area, off = self.ring_np[base + self.tok_off: base + self.tok_off + len(tb) * 512], base + self.tok_off
                address = self.base + off
            else:  # more token pages than a slot holds (a large prefill): their own buffer, kept by the epoch
                area = np.empty(len(tb) * 512, np.uint8)
                p.keep.append(area)
                address = int(area.ctypes.data)
            area.reshape(-1, 512)[:] = self.tok_u8[tb]
            eng.tokens_dirty[tb] = 0
            records.append(slotlog.pages_record(b"tokens", tb.astype(np.int64), 512, address))
        if len(rr):
            off = base + self.rng_off
            self.ring_np[off: off + len(rr) * self.rng_rb].reshape(-1, self.rng_rb)[:] = self.rng_rows[rr]
            eng.rng.dirty[rr] = 0
            records.append(slotlog.rows_record(b"rng", rr.astype(np.int64), self.rng_ppb, self.rng_pb,
                                               self.base + off))
        # the other host regions of 512-byte pages, in registration order (the generic path's record order):
        # log-probabilities at their slots, finished outputs (a few pages each, once per output)
        extra = []
        for name, buf, dirty in eng.page_regions():
            dp = np.flatnonzero(dirty)
            if len(dp):
                area = np.empty(len(dp) * 512, np.uint8)
                p.keep.append(area)
                area.reshape(-1, 512)[:] = buf.reshape(-1, 512)[dp]
                dirty[dp] = 0
                extra.append((dirty, dp))
                records.append(slotlog.pages_record(name, dp.astype(np.int64), 512, int(area.ctypes.data)))
        p.taken = (rows, tb, rr, extra)
        records.append(slotlog.meta_record(meta_json))
        self.meta_bytes += len(meta_json)
        self.writer.next_epoch += 1
        self.prepared = p
        self.t["prepare"] += time.perf_counter() - t0

    def send(self, *, wait_copy: bool = True) -> None:
        """Hand the prepared (or deferred) epoch to the C writer (once its rows are in the ring: the side
        stream's copy). ``wait_copy=False`` (right after the next forward's launch): an epoch whose rows are
        still being copied (a prefill's hundreds of MB) stays prepared, and the step's end sends it (``defer``),
        instead of the decode thread waiting for the copy before the sampler."""
        self.materialize(overlapped=True)
        p = self.prepared
        if p is None:
            return
        if not wait_copy and p.event is not None and not p.event.query():
            self.send_deferred += 1
            return
        t0 = time.perf_counter()
        self.prepared = None
        w = self.writer
        assert w is not None
        if p.event is not None:
            if not p.event.query():
                t1 = time.perf_counter()
                p.event.synchronize()
                self.t["copy_wait"] += time.perf_counter() - t1
            p.event = None
        try:
            if self._ablate == "writer":
                self._ablated_commit(p)
                return
            if w.log.seal_wanted:  # a compaction waits for the segment to be sealed: it is, before this epoch
                t1 = time.perf_counter()
                if w.roll_for_seal(_need(p.records)) == "now":
                    self.t["roll"] += time.perf_counter() - t1
                    self.rolls += 1
                self.seal_rolls += 1
            elif not self.inflight:  # the writer is idle: a roll it needs happens here (the GIL is ours)
                t1 = time.perf_counter()
                if w.roll_if_needed(_need(p.records)):
                    self.t["roll"] += time.perf_counter() - t1
                    self.rolls += 1
            w.submit(p.seq, slotlog.step_blob(p.records))
        except BaseException:
            w.next_epoch -= 1  # nothing after it was prepared: its number is the next one again
            self._reflag(p)
            if self.bulk_p is p:
                self.bulk_p = None
            if w.lease_lost:
                self._drop_writer()
            raise
        p.sent = True
        self.inflight.append(p)
        self.t["send"] += time.perf_counter() - t0

    def _ablated_commit(self, p: StepPending) -> None:
        p.sent = p.done = True
        p.stats = _Bytes(0)
        if self.bulk_p is p:
            self.bulk_p = None
        self.committed_seq = max(self.committed_seq, p.seq)
        self.steps += 1

    def wait(self, p: StepPending) -> None:
        if not p.sent:
            assert self.prepared is p or self.deferred is p
            self.send()
            if p.done:
                return
        w = self.writer
        assert w is not None
        t0 = time.perf_counter()
        try:
            w.wait(p.seq)
        except CheckpointError:
            for q in self.inflight:  # this one and any submitted after it: their changes go in the next epoch
                self._reflag(q)
            self.inflight.clear()
            self.bulk_p = None
            self._drop_writer()
            raise
        st = w.state()
        done = [q for q in self.inflight if q.seq <= p.seq]
        self.inflight = [q for q in self.inflight if q.seq > p.seq]
        nbytes = int(st["bytes_written"])
        for q in done:
            q.done = True
            q.keep.clear()
            if self.bulk_p is q:
                self.bulk_p = None
        self.bulk_steps += sum(q.bulk for q in done)
        p.stats = _Bytes(nbytes - self._bytes_seen)
        self._bytes_seen = nbytes
        if nbytes - self.bytes0 >= self._count_every():
            self._count(w, reset=False)  # toward the compaction threshold while the lease lasts
        self.committed_seq = max(self.committed_seq, p.seq)
        self.steps += len(done)
        self.t["wait"] += time.perf_counter() - t0

    def _count_every(self) -> int:
        """The writer's bytes go to the runtime's compaction count this often: a compaction starts within an
        eighth of its threshold of being due, not only at the lease's end."""
        after = self.eng.runtime.compact_after_bytes if self.eng.runtime is not None else None
        return COUNT_BYTES if not after else max(16 << 10, min(COUNT_BYTES, after // 8))

    def _reflag(self, p: StepPending) -> None:
        rows, tb, rr, extra = p.taken
        eng = self.eng
        for dirty, dp in extra:
            dirty[dp] = 1
        if len(rows):
            eng.pool.dirty.index_fill_(0, torch.from_numpy(rows).to(self.device), 1)
        eng.tokens_dirty[tb] = 1
        eng.rng.dirty[rr] = 1

    def suspend(self) -> None:
        """End the lease (the writer commits what it was given first); the generic path may append again."""
        if self.writer is None:
            return
        self.send()
        for p in list(self.inflight):
            p.wait()
        w = self.writer
        self.writer = None
        w.stop()
        self._count(w)
        self._note_largest(w)

    def _note_largest(self, w: slotlog.StepLogWriter) -> None:
        st = w.stats()
        if len(st):
            i = int(np.argmax(st[:, 4]))
            if st[i, 4] > self.largest["bytes"]:
                self.largest = {"bytes": float(st[i, 4]), "write_ms": float(st[i, 3] - st[i, 2]) / 1e6,
                                "commit_ms": float(st[i, 3] - st[i, 1]) / 1e6}

    def _count(self, w: slotlog.StepLogWriter, *, reset: bool = True) -> None:
        """The writer's bytes and epochs since the last count go to the runtime's compaction threshold like its
        own (a compaction it starts waits for the lease: the next step then takes the generic path, which ends
        the lease first, and the log is sealed)."""
        st = w.state()
        rt = self.eng.runtime
        if rt is not None:
            rt.count_appended(int(st["bytes_written"]) - self.bytes0, int(st["epochs"]) - self.epochs0)
        self.bytes0, self.epochs0 = int(st["bytes_written"]), int(st["epochs"])
        if reset:
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
        if self.bulk is not None:  # the next engine of this process takes it (no copy into it left running)
            if self.cuda:
                self.bulk_copied.synchronize()
            _give_bulk(self.bulk)
            self.bulk = None


__all__ = ["StepEpochs", "StepPending", "available"]
