"""A hypothesis state machine of append / compact / crash / reopen / replay against a dict model.

Crashes are simulated in-process the way the kernel would leave things: the writer is abandoned without
close() (no final sync, its flock released as process death would), optionally with its last epoch torn (the
active segment cut at a random offset inside that epoch, which then never committed).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import concordia_ft as cft
from concordia_ft.core.compaction import compact_offline
from concordia_ft.core.replay import Outcome, replay

PAGE = 512
SIZES = {"opq": 7 * PAGE + 100, "hsh": 5 * PAGE, "kv": 8 * PAGE, "dense": 2 * PAGE + 1}
KV_BLOCK = 2 * PAGE


def _digest(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    return {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in arrays.items()}


class LogMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        root = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path("/tmp")
        self.dir = root / f"cft-sm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.model: dict[int, dict[str, str]] = {}  # committed epoch -> digests
        self.last: int | None = None
        self.rng = np.random.default_rng(0)
        self.rt: cft.Runtime | None = None
        self._open()

    # ---------------------------------------------------------------------------------------- helpers
    def _open(self) -> None:
        self.arrays = {n: np.zeros(s, np.uint8) for n, s in SIZES.items()}
        self.bitmap = np.zeros(SIZES["kv"] // KV_BLOCK, np.uint8)
        rt = cft.Runtime(self.dir, fsync="never", page_bytes=PAGE, compact_after_bytes=None,
                         background_compaction=False)
        rt.register("opq", self.arrays["opq"], "opaque")
        rt.register("hsh", self.arrays["hsh"], "opaque", diff="hash")
        rt.register("kv", self.arrays["kv"], "paged", block_bytes=KV_BLOCK, dirty_blocks=self.bitmap)
        rt.register("dense", self.arrays["dense"], "dense")
        assert rt.epoch == self.last, (rt.epoch, self.last)
        if rt.epoch is not None:
            rt.recover_into()
            assert _digest(self.arrays) == self.model[rt.epoch]
        self.rt = rt

    def _abandon(self) -> None:
        """What SIGKILL leaves: no close, no final sync; the kernel drops the flock and the fds."""
        rt = self.rt
        assert rt is not None
        rt.log._stop.set()
        rt.log._segment.close()
        rt.log._lock.release()
        self.rt = None

    # ------------------------------------------------------------------------------------------ rules
    @precondition(lambda self: self.rt is not None)
    @rule(seed=st.integers(0, 2**32 - 1), n_opq=st.integers(0, 8), n_kv=st.integers(0, 4), hsh=st.booleans())
    def append(self, seed: int, n_opq: int, n_kv: int, hsh: bool) -> None:
        rng = np.random.default_rng(seed)
        a = self.arrays
        for p in rng.integers(0, 8, n_opq):
            i = int(rng.integers(p * PAGE, min((p + 1) * PAGE, a["opq"].size)))
            a["opq"][i] ^= np.uint8(int(rng.integers(1, 256)))
        if hsh:
            a["hsh"][int(rng.integers(0, a["hsh"].size))] ^= np.uint8(int(rng.integers(1, 256)))
        for b in rng.integers(0, 4, n_kv):
            a["kv"][b * KV_BLOCK : (b + 1) * KV_BLOCK] = rng.integers(0, 256, KV_BLOCK, dtype=np.uint8)
            self.bitmap[b] = 1
        a["dense"][:] = rng.integers(0, 256, a["dense"].size, dtype=np.uint8)
        assert self.rt is not None
        e = self.rt.checkpoint({"e": (self.last or 0) + 1})
        assert e == (self.last or 0) + 1
        self.last = e
        self.model[e] = _digest(a)

    @precondition(lambda self: self.rt is not None and self.last is not None)
    @rule(frac=st.floats(0.0, 0.999))
    def crash_tearing_the_last_epoch(self, frac: float) -> None:
        """The last append was in flight when the process died: cut its epoch at a random offset."""
        assert self.rt is not None
        stats = self.rt.last_stats
        seg = self.rt.log._segment
        if stats is None or stats.epoch != self.last or seg.end - stats.total_bytes < 4096:
            return  # this writer did not append the last epoch, or it is not at the end of the active segment
        total = stats.total_bytes
        path, start = seg.path, seg.end - total
        self._abandon()
        os.truncate(path, start + int(frac * total))
        del self.model[self.last]
        self.last = self.last - 1 if self.last > 1 else None

    @precondition(lambda self: self.rt is not None)
    @rule()
    def crash(self) -> None:
        self._abandon()

    @precondition(lambda self: self.rt is None)
    @rule()
    def reopen(self) -> None:
        self._open()

    @precondition(lambda self: self.rt is not None)
    @rule()
    def close_and_reopen(self) -> None:
        assert self.rt is not None
        self.rt.close()
        self.rt = None
        self._open()

    @precondition(lambda self: self.rt is not None)
    @rule()
    def compact_online(self) -> None:
        assert self.rt is not None
        self.rt.compact()

    @precondition(lambda self: self.rt is None)
    @rule()
    def compact_offline(self) -> None:
        r = compact_offline(self.dir)
        assert not r.compacted or r.epoch == self.last

    @rule()
    def replay_matches_the_model(self) -> None:
        res = replay(self.dir)
        assert res.epoch == self.last, (res.epoch, self.last)
        assert res.outcome in (Outcome.OK, Outcome.TORN_TAIL, Outcome.EMPTY)
        if self.last is not None:
            got = _digest({n: img.data for n, img in res.regions.items()})
            assert got == self.model[self.last]
            assert res.meta == {"e": self.last}

    @invariant()
    def epoch_numbering(self) -> None:
        if self.rt is not None:
            assert self.rt.epoch == self.last

    def teardown(self) -> None:
        if self.rt is not None:
            self.rt.close()
        shutil.rmtree(self.dir, ignore_errors=True)


LogMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
TestLogStateMachine = LogMachine.TestCase
