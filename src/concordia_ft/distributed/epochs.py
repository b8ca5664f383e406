"""Distributed epochs: a rank's prepare records (its own Runtime log) and the coordinator's commit records.

Two-phase, cut at a collective boundary (DESIGN.md §3):

1. prepare: at the boundary collective that opens step ``c`` (cut ``c``), each rank copies its state into slot
   ``c % 2`` and commits ONE local epoch whose metadata names the cut held by each slot; then it publishes
   ``prep/<gen>/<c>/<rank>`` in the store.
2. commit: when every member's prepare of ``c`` is in the store, the coordinator commits ONE epoch of its own
   log (``CommitLog``) saying "cut c is committed" and only then publishes ``commit/<c>``.

A rank prepares cut ``c`` only after ``commit/<c-1>`` is published, so its log never holds more than one cut past
the committed one, and the slot it does not write holds the committed cut. Recovery takes the newest cut with
a commit record (the coordinator's log) and reads that slot: a prepared-but-uncommitted cut is rolled back on
every rank, the dead one included, since nothing depends on it. The slots are opaque regions diffed against
a shadow, so an epoch logs only the slot it rewrote.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import RecoveryError
from ..runtime import Runtime

META_KEY = "dist"


class RankEpochs:
    """One rank's prepare log: two slots per state tensor, the live state copied into one per prepare."""

    def __init__(self, log_dir: str | Path, state: dict[str, Any], *, fsync: str = "always",
                 lock_wait_s: float = 10.0) -> None:
        self.state = state
        self.rt = _open_runtime(Path(log_dir), fsync, lock_wait_s)
        self.slots: list[dict[str, Any]] = [{n: t.detach().clone() for n, t in state.items()} for _ in range(2)]
        for i, slot in enumerate(self.slots):
            for name, buf in slot.items():
                self.rt.register(f"{name}:slot{i}", buf, "opaque")
        self.slot_cuts: list[int | None] = [None, None]
        self.last_prepare_ms = 0.0

    def restore(self) -> list[int | None]:
        """Load both slots from the log (if it holds an epoch); returns the cut each slot holds."""
        if self.rt.epoch is None:
            return self.slot_cuts
        rec = self.rt.recover_into()
        meta = rec.meta.get(META_KEY) if isinstance(rec.meta, dict) else None
        if meta is None:
            raise RecoveryError(f"{self.rt.log_dir}: the last epoch holds no distributed-epoch metadata")
        self.slot_cuts = [None if c is None else int(c) for c in meta["slot_cuts"]]
        return self.slot_cuts

    def rewind(self, cut: int, fresh: dict[str, Any] | None = None) -> None:
        """Make the live state the state at ``cut`` (-1: ``fresh``, the workload's initial state)."""
        if cut < 0:
            assert fresh is not None, "cut -1 needs the initial state"
            for name, t in self.state.items():
                t.copy_(fresh[name])
            return
        if cut not in self.slot_cuts:
            raise RecoveryError(f"{self.rt.log_dir}: no slot holds cut {cut} (slots hold {self.slot_cuts}); the "
                                "rank's log is behind the coordinator's commit record: it was not written by "
                                "this job, or it was truncated")
        slot = self.slots[self.slot_cuts.index(cut)]
        for name, t in self.state.items():
            t.copy_(slot[name])

    def prepare(self, cut: int, *, before_append: Any = None) -> int:
        """Copy the live state into slot ``cut % 2`` and commit it as one local epoch; returns the epoch."""
        t0 = time.perf_counter()
        i = cut % 2
        for name, t in self.state.items():
            self.slots[i][name].copy_(t)
        self.slot_cuts[i] = cut
        if before_append is not None:
            before_append()
        epoch = self.rt.checkpoint({META_KEY: {"cut": cut, "slot_cuts": list(self.slot_cuts)}})
        self.last_prepare_ms = (time.perf_counter() - t0) * 1e3
        return epoch

    def close(self) -> None:
        self.rt.close()


# A replacement's restore replays the rank's log: base + the epochs since. Compacting after 16 MiB of
# epochs bounds that replay (each prepare logs one slot's changed pages; dp_lora: ~0.5 MB) at the cost of a
# background rewrite every ~30 steps (bench_distributed: restore grew to 0.15-0.67 s with 64 MiB).
COMPACT_AFTER_BYTES = 16 << 20


def _open_runtime(path: Path, fsync: str, lock_wait_s: float,
                  compact_after_bytes: int = COMPACT_AFTER_BYTES) -> Runtime:
    """A dead rank's lock goes with its process; a process killed a moment ago may still hold it briefly."""
    from ..errors import LogLockedError

    deadline = time.monotonic() + lock_wait_s
    while True:
        try:
            return Runtime(path, fsync=fsync, compact_after_bytes=compact_after_bytes, on_compaction_error="warn")
        except LogLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


class CommitLog:
    """The coordinator's commit records: one epoch per committed cut, region ``commit`` = [cut, gen]."""

    def __init__(self, log_dir: str | Path, *, fsync: str = "always") -> None:
        self.rt = _open_runtime(Path(log_dir), fsync, 10.0)
        self.record = np.full(2, -1, dtype=np.int64)
        self.rt.register("commit", self.record, "opaque")
        self.cut = -1
        self.gen = -1
        self.history: list[int] = []
        self.final = False  # the committed cut is the job's last (a replicated job learns it at the commit)
        if self.rt.epoch is not None:
            self.rt.recover_into()
            self.cut, self.gen = int(self.record[0]), int(self.record[1])
            meta = self.rt.opened_meta or {}
            self.history = list(meta.get("history", []))[-64:]
            self.final = bool(meta.get("final", False))

    def commit(self, cut: int, gen: int, *, final: bool = False) -> float:
        """Make ``cut`` committed (durable per the fsync policy when this returns); returns the ms it took.
        ``final``: it is the job's last cut (recorded, so a restarted coordinator knows the job is done)."""
        if cut != self.cut + 1:
            raise AssertionError(f"commit of cut {cut} after cut {self.cut}: cuts commit one after another")
        t0 = time.perf_counter()
        self.record[:] = (cut, gen)
        self.history = [*self.history[-63:], cut]
        self.rt.checkpoint({"cut": cut, "gen": gen, "history": self.history, "final": final})
        self.cut, self.gen, self.final = cut, gen, final
        return (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        self.rt.close()
