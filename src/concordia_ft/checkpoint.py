"""What a checkpoint reports, and the asynchronous epoch pipeline behind ``Runtime.checkpoint_async``.

On the calling thread an asynchronous epoch only snapshots its pages in order after the caller's work (the
``StagePlan`` says how: dense regions of one backend and device as one batch, every other region by its own
tracker); one background ``EpochWriter`` per runtime then finishes it (DtoH, append, commit, advance) as a
``PendingEpoch``. The runtime applies a finished epoch's bookkeeping once, through the ``settle`` callback it
hands each epoch; the epoch tells it what it named through ``EpochContents``. Neither reads the other's
private state.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .core.format import JSONText, encode_json
from .core.log import RecoveryLog
from .core.regions import RegionKind, RegionSpec
from .core.tracking import DenseBatch, RegionDelta, StagedBatch, StagedDelta, Tracker
from .errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from .backends import Backend

log = logging.getLogger("concordia_ft.runtime")


@dataclass
class CheckpointStats:
    epoch: int
    pages: int
    payload_bytes: int
    total_bytes: int
    full_bytes: int  # bytes of every recovered region: what a full copy would write
    seconds: float  # from the call to the epoch committed and the trackers advanced
    detect_seconds: float  # sync: collect; async: stage on the caller + waiting for the snapshot and its DtoH
    append_seconds: float
    region_pages: dict[str, int] = field(default_factory=dict)
    mode: str = "sync"  # "sync" (checkpoint) or "async" (checkpoint_async)
    call_seconds: float = 0.0  # time the calling thread spent in checkpoint() / checkpoint_async()
    backpressure_seconds: float = 0.0  # part of call_seconds spent waiting for the previous async epoch
    commit_latency_seconds: float = 0.0  # from the call to the epoch committed (durable per the fsync policy)
    snapshot_device_bytes: int = 0  # device memory held for asynchronous snapshots, all regions

    @property
    def reduction(self) -> float:
        return self.full_bytes / max(1, self.payload_bytes)


# ----------------------------------------------------------------------------------------- the plan
class StagePlan:
    """How an asynchronous epoch stages the registry (built once per registry state): the dense regions of each
    backend (and device) as one ``DenseBatch``, every other region by its own tracker; immutable regions only
    until their full epoch has committed. Indices are registration order, the order of an epoch's regions."""

    def __init__(self, trackers: Iterable[tuple[str, Tracker, Backend]]) -> None:
        dense: dict[str, tuple[Backend, list[Tracker]]] = {}
        self.singles: list[tuple[int, str, Tracker]] = []  # opaque and paged regions
        self.immutables: list[tuple[int, str, Tracker]] = []
        index: dict[str, int] = {}
        for i, (name, t, backend) in enumerate(trackers):
            index[name] = i
            if t.spec.kind is RegionKind.DENSE:
                dense.setdefault(backend.name, (backend, []))[1].append(t)
            elif t.spec.kind is RegionKind.IMMUTABLE:
                self.immutables.append((i, name, t))
            else:
                self.singles.append((i, name, t))
        batches: list[DenseBatch] = [b for backend, ts in dense.values() for b in backend.batch_dense(ts)]
        self.batches = [(tuple(index[sp.name] for sp in b.specs), tuple(sp.name for sp in b.specs), b)
                        for b in batches]
        # what holds device memory for snapshots (dense members hold none: their batch does)
        self.holders: list[Any] = [*batches, *(t for _, _, t in self.singles)]

    @property
    def snapshot_device_bytes(self) -> int:
        """Device memory the dense batches hold for snapshots."""
        return sum(b.snapshot_device_bytes for _, _, b in self.batches)

    def close(self) -> None:
        for _, _, b in self.batches:
            b.close()


# ------------------------------------------------------------------------------------- metadata
@dataclass(frozen=True)
class FrozenMeta:
    """An epoch's metadata as JSON text, taken on the caller's thread (the caller may change its dict next);
    the writer thread decodes it (``value``), off the training step's critical path."""

    text: bytes

    @property
    def value(self) -> Any:
        return json.loads(self.text)

    @property
    def encoded(self) -> Any:
        """What the log appends: the text itself (encode_json's output already; not decoded and encoded again)."""
        return JSONText(self.text)


@dataclass(frozen=True)
class HandedMeta:
    """An epoch's metadata handed over by a caller that never changes it again (``copy_meta=False``): no copy,
    and the writer encodes it (once, in the log append)."""

    value: Any

    @property
    def encoded(self) -> Any:
        return self.value


def freeze_meta(meta: Any, copy: bool = True) -> FrozenMeta | HandedMeta | None:
    """A private copy of an epoch's metadata, checked JSON-able now (or, ``copy=False``, the object itself)."""
    if meta is None:
        return None
    if not copy:
        return HandedMeta(meta)
    try:
        return FrozenMeta(encode_json(meta))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint metadata must be JSON-able: {e}") from None


# ------------------------------------------------------------------------------------- the epoch
@dataclass(frozen=True)
class EpochContents:
    """What an epoch names, for the registry's bookkeeping once it has committed or failed."""

    defs: tuple[RegionSpec, ...]  # region definitions it records
    drops: tuple[str, ...]  # regions it drops
    full: frozenset[str]  # regions it logs whole
    regions: tuple[str, ...]  # regions it snapshotted


class Settle(Protocol):
    def __call__(self, job: PendingEpoch, *, raised_to_caller: bool = False) -> None: ...


def _first(item: tuple[int, RegionDelta]) -> int:
    return item[0]


class PendingEpoch:
    """An epoch handed to the background writer by ``Runtime.checkpoint_async``.

    Not durable yet: ``wait()`` returns the epoch number once it is committed (per the fsync policy) or raises
    ``CheckpointError``. ``epoch`` is the number it gets if it commits; ``stats`` is set once it has."""

    def __init__(self, log: RecoveryLog, epoch: int,
                 batches: list[tuple[tuple[int, ...], tuple[str, ...], StagedBatch]],
                 singles: list[tuple[int, str, StagedDelta]], *, plan: StagePlan,
                 defs: Iterable[RegionSpec], drops: Iterable[str], full: Iterable[str],
                 meta: FrozenMeta | HandedMeta | None, started: float, backpressure_seconds: float,
                 full_bytes: int, settle: Settle) -> None:
        self.epoch = epoch
        self.stats: CheckpointStats | None = None
        self.error: CheckpointError | None = None
        self.committed = False
        self.contents = EpochContents(tuple(defs), tuple(drops), frozenset(full),
                                      tuple(n for _, names, _ in batches for n in names)
                                      + tuple(n for _, n, _ in singles))
        self._log = log
        self._batches = batches
        self._singles = singles
        self._plan = plan
        self._meta = meta
        self._started = started
        self._backpressure = backpressure_seconds
        self._call_seconds = 0.0
        self._full_bytes = full_bytes
        self._settle = settle
        self._finished = False  # committed or failed; then the latch is released (a latch, not an Event:
        self._latch = threading.Lock()  # this is built on the training thread once per step)
        self._latch.acquire()
        self._claimed = False

    @property
    def call_seconds(self) -> float:
        """How long ``checkpoint_async`` held the calling thread (backpressure included)."""
        return self._call_seconds

    @property
    def backpressure_seconds(self) -> float:
        """How long ``checkpoint_async`` waited for the previous epoch to finish (0 when it had)."""
        return self._backpressure

    def done(self) -> bool:
        """True once the epoch has committed or failed (``wait()`` then returns or raises at once)."""
        return self._finished

    def wait(self, timeout_s: float | None = None) -> int:
        """Block until the epoch is committed; return its number. Raises its ``CheckpointError`` if it failed
        (the runtime then does not raise that failure again), ``TimeoutError`` if ``timeout_s`` passed first."""
        if not self.join(timeout_s):
            raise TimeoutError(f"epoch {self.epoch} is not committed after {timeout_s} s (still in flight)")
        self._settle(self, raised_to_caller=self.error is not None)
        if self.error is not None:
            raise self.error
        return self.epoch

    def join(self, timeout_s: float | None = None) -> bool:
        """Block until the epoch has finished (or ``timeout_s`` passed); True when it has. Takes no outcome."""
        if self._finished:
            return True
        if self._latch.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
            self._latch.release()  # the next waiter passes too
        return self._finished

    def claim(self) -> bool:
        """True the first time it is called on a finished epoch: the runtime applies its outcome once."""
        if self._claimed or not self._finished:
            return False
        self._claimed = True
        return True

    def submitted(self) -> None:
        """Called by the runtime as it hands the epoch to the writer: the caller's part ends here."""
        self._call_seconds = time.perf_counter() - self._started

    def __repr__(self) -> str:
        state = "failed" if self.error else "committed" if self.committed else "in flight"
        return f"PendingEpoch({self.epoch}, {state})"

    def _finish(self) -> None:
        self._finished = True
        self._latch.release()

    # ---- the background writer's part ----
    def run(self) -> None:
        """Finish the epoch: wait for its snapshots, append, commit, advance the trackers (writer thread)."""
        t0 = time.perf_counter()
        single_deltas: list[RegionDelta] = []
        try:
            ordered: list[tuple[int, RegionDelta]] = []
            for idx, _, sb in self._batches:
                ordered.extend(zip(idx, sb.results(), strict=True))
            for i, _, s in self._singles:
                d = s.result()
                single_deltas.append(d)
                ordered.append((i, d))
            ordered.sort(key=_first)  # registration order, as a synchronous epoch lays the regions out
            t1 = time.perf_counter()
            res = self._log.append(defs=list(self.contents.defs), drops=list(self.contents.drops),
                                   deltas=[d for _, d in ordered],
                                   meta=None if self._meta is None else self._meta.encoded)
            t2 = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's next call, never lost
            self._abandon()
            self._fail(e, committed=False)
            return
        self.epoch = res.epoch
        try:
            for _, _, sb in self._batches:
                sb.commit()
            for (_, _, s), d in zip(self._singles, single_deltas, strict=True):
                s.commit(d)
        except BaseException as e:  # noqa: BLE001
            self._fail(e, committed=True)
            return
        end = time.perf_counter()
        self.stats = CheckpointStats(
            res.epoch, res.n_pages, res.payload_bytes, res.total_bytes, self._full_bytes, end - self._started,
            (t1 - t0) + (self._call_seconds - self._backpressure), t2 - t1, res.region_pages, mode="async",
            call_seconds=self._call_seconds, backpressure_seconds=self._backpressure,
            commit_latency_seconds=t2 - self._started,
            snapshot_device_bytes=sum(h.snapshot_device_bytes for h in self._plan.holders))
        self.committed = True
        self._finish()

    def _abandon(self) -> None:
        for _, names, sb in self._batches:
            try:
                sb.abandon()
            except BaseException as e2:  # noqa: BLE001 - the first failure is the one to report
                log.error("giving back the snapshot of %s after epoch %d failed: %s", names, self.epoch, e2)
        for _, name, s in self._singles:
            try:
                s.abandon()
            except BaseException as e2:  # noqa: BLE001 - the first failure is the one to report
                log.error("giving back the snapshot of %r after epoch %d failed: %s", name, self.epoch, e2)

    def _fail(self, e: BaseException, *, committed: bool) -> None:
        if isinstance(e, CheckpointError) and not committed:  # the log's own account of its failure
            err = e
        else:
            last = self.epoch if committed else self._log.last_epoch
            err = CheckpointError(self.epoch, last, committed, f"{type(e).__name__}: {e}")
            err.__cause__ = e
        self.error, self.committed = err, committed
        log.error("%s", err)
        self._finish()


class EpochWriter:
    """The one background thread that finishes a runtime's asynchronous epochs, in submission order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[PendingEpoch | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: PendingEpoch) -> None:
        job.submitted()
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()
            del job  # hold nothing between epochs


# ------------------------------------------------------------------------------- interpreter exit
class _HasInFlight(Protocol):
    @property
    def in_flight(self) -> PendingEpoch | None: ...

    @property
    def log_dir(self) -> Any: ...


EXIT_DRAIN_S = 120.0
_with_writers: weakref.WeakSet[Any] = weakref.WeakSet()


def drain_at_exit(owner: _HasInFlight) -> None:
    """Let ``owner``'s in-flight epoch finish if the interpreter exits without close() (the writer thread is a
    daemon)."""
    _with_writers.add(owner)


@atexit.register
def _drain_at_exit() -> None:
    for rt in list(_with_writers):
        job = rt.in_flight
        if job is not None and not job.join(EXIT_DRAIN_S):
            log.error("exiting with epoch %d of %s still in flight after %.0f s: it is lost (not committed)",
                      job.epoch, rt.log_dir, EXIT_DRAIN_S)


