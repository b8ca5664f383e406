"""Real writer and compactor processes SIGKILLed at random moments, many times on the same log.

Under fsync=always: no epoch a writer reported (printed after checkpoint() returned) is ever lost, replay
never raises, and the replayed state equals the model of the last committed epoch byte for byte (so a torn
epoch is never applied). The next writer reopens the same log (cutting a torn tail) and continues.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import crash_writer as W
from concordia_ft.core.manifest import load_manifest
from concordia_ft.core.replay import Outcome, replay
from support import PYTHON, REPO, subprocess_env

HELPER = str(REPO / "tests" / "crash_writer.py")


class Model:
    """Digests of the state after each epoch, computed on demand from crash_writer's deterministic writes."""

    def __init__(self, seed: int) -> None:
        self._it = W.model_states(seed)
        self.digests: dict[int, dict[str, str]] = {}

    def digest(self, epoch: int) -> dict[str, str]:
        while epoch not in self.digests:
            e, state = next(self._it)
            self.digests[e] = {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in state.items()}
        return self.digests[epoch]


def _digest_replayed(log_dir: Path) -> tuple[int | None, dict[str, str], object, Outcome]:
    res = replay(log_dir)
    dig = {n: hashlib.sha256(img.data.tobytes()).hexdigest() for n, img in res.regions.items()}
    return res.epoch, dig, res.meta, res.outcome


def _run_and_kill(args: list[str], delay_s: float) -> tuple[list[str], int]:
    """Start a child, SIGKILL it ``delay_s`` after it has opened the log (unless it ended first); return its
    stdout lines and rc. The delay counts from the child's OPEN line, not from its start, so a loaded machine
    (slow interpreter start-up) still kills writers mid-run rather than before their first epoch."""
    p = subprocess.Popen([PYTHON, HELPER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=subprocess_env())
    lines: list[str] = []
    opened = threading.Event()

    def pump() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line.strip())
            if line.startswith("OPEN "):
                opened.set()
        opened.set()  # the child ended without opening: nothing to wait for

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    opened.wait(timeout=120)
    try:
        p.wait(timeout=delay_s)
    except subprocess.TimeoutExpired:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    t.join(timeout=10)
    if p.returncode not in (0, -signal.SIGKILL):
        err = p.stderr.read() if p.stderr else ""
        raise AssertionError(f"child {args} failed with rc {p.returncode}:\n{err[-2000:]}")
    if p.stderr:
        p.stderr.close()
    return lines, p.returncode


def _kill_loop(log_dir: Path, *, n_kills: int, seed: int, rng: np.random.Generator,
               compact_after: int | None, max_delay_s: float, backend: str = "file") -> dict[str, int]:
    model = Model(seed)
    reported = 0  # the highest epoch any writer said checkpoint() returned
    stats = {"kills": 0, "torn_tails_seen": 0, "unreported_commits": 0, "epochs": 0, "cuts_on_open": 0}
    for _ in range(n_kills):
        args = ["write", str(log_dir), str(seed)]
        if compact_after is not None:
            args += ["--compact-after", str(compact_after)]
        if backend != "file":
            args += ["--backend", backend]
        lines, rc = _run_and_kill(args, float(rng.uniform(0.0, max_delay_s)))
        stats["kills"] += rc == -signal.SIGKILL
        expect = None
        for line in lines:
            if line.startswith("OPEN "):
                opened = int(line.split()[1])
                assert opened == reported, f"a writer opened at epoch {opened}, the log was at {reported}"
                stats["cuts_on_open"] += not line.endswith("cut=0")
                expect = opened + 1
            elif line.startswith("E "):
                e = int(line.split()[1])
                assert e == expect, f"writer reported epoch {e}, expected {expect}"
                reported, expect = e, e + 1
        epoch, dig, meta, outcome = _digest_replayed(log_dir)
        stats["torn_tails_seen"] += outcome is Outcome.TORN_TAIL
        assert outcome in (Outcome.OK, Outcome.TORN_TAIL, Outcome.EMPTY), outcome
        got = epoch or 0
        assert got >= reported, f"epoch {reported} was reported committed but replay ends at {epoch}: LOST"
        assert got <= reported + 1, f"replay ends at {epoch}, two past the last reported {reported}"
        stats["unreported_commits"] += got == reported + 1
        reported = got  # an unreported but committed epoch is committed: the next writer continues after it
        if epoch is not None:
            assert dig == model.digest(epoch), f"replayed state of epoch {epoch} differs from the model"
            assert meta == {"epoch": epoch}
    stats["epochs"] = reported
    return stats


def test_writers_sigkilled_at_random_moments_lose_nothing_committed(tmp_path: Path) -> None:
    """CI sample: 8 kills of real fsync=always writers on one log (background compaction every ~6 MiB); the
    slow run's test_two_hundred_sigkills_on_one_log is the same with 220."""
    stats = _kill_loop(tmp_path / "log", n_kills=8, seed=7, rng=np.random.default_rng(7),
                       compact_after=6 << 20, max_delay_s=0.9)
    assert stats["kills"] >= 5, stats  # the children were really killed, mostly mid-run
    assert stats["epochs"] >= 8, stats  # and made progress across restarts


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs a tmpfs at /dev/shm")
def test_mapped_dram_writers_sigkilled_at_random_moments_lose_nothing_committed() -> None:
    """The same on the dram backend's mapped segments (preallocated, MAP_SHARED, 4 MiB so they roll often):
    stores into the mapping, the commit marker last; a reopened log zeroes the torn bytes."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="cft-mapped-kill-"))
    try:
        stats = _kill_loop(root / "log", n_kills=6, seed=9, rng=np.random.default_rng(9),
                           compact_after=6 << 20, max_delay_s=0.9, backend="dram")
        assert stats["kills"] >= 4, stats
        assert stats["epochs"] >= 6, stats
        assert any(p.name.startswith("incr.") for p in (root / "log").iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_two_hundred_sigkills_on_one_log(tmp_path: Path) -> None:
    stats = _kill_loop(tmp_path / "log", n_kills=220, seed=8, rng=np.random.default_rng(8),
                       compact_after=4 << 20, max_delay_s=0.8)
    assert stats["kills"] >= 200, stats
    print("stats", stats)


def _write_epochs(log_dir: Path, seed: int, n: int) -> None:
    lines, rc = _run_and_kill(["write", str(log_dir), str(seed), "--epochs", str(n)], 120)
    assert rc == 0 and lines[-1].startswith("E "), lines


@pytest.mark.parametrize("point", ["base-writing", "base-written", "before-manifest", "after-manifest"])
def test_compactor_killed_at_each_step_leaves_the_same_state(tmp_path: Path, point: str) -> None:
    log_dir = tmp_path / "log"
    seed = 21
    model = Model(seed)
    _write_epochs(log_dir, seed, 6)
    before = sorted(p.name for p in log_dir.iterdir())
    lines, rc = _run_and_kill(["compact", str(log_dir), "--kill-at", point], 120)
    assert rc == -signal.SIGKILL, (rc, lines)  # it died at the named point, not after finishing
    epoch, dig, meta, outcome = _digest_replayed(log_dir)
    assert (epoch, outcome) == (6, Outcome.OK)
    assert dig == model.digest(6) and meta == {"epoch": 6}
    m = load_manifest(log_dir)
    assert m is not None
    if point == "after-manifest":
        assert m.base is not None and not m.incr
    else:
        assert sorted(p.name for p in log_dir.iterdir() if p.name.endswith(".cft")) != [] and m.base is None
        assert [n for n in before if n.endswith(".cft")] == m.segments()
    # the next writer removes the debris and continues; then a clean compaction and another writer
    _write_epochs(log_dir, seed, 3)
    assert not [p for p in log_dir.iterdir() if p.name.endswith(".tmp")]
    m = load_manifest(log_dir)
    assert m is not None
    assert sorted(p.name for p in log_dir.iterdir() if p.name.endswith(".cft")) == sorted(m.segments())
    lines, rc = _run_and_kill(["compact", str(log_dir)], 120)
    assert rc == 0 and lines == ["COMPACTED True 9"], lines
    _write_epochs(log_dir, seed, 2)
    epoch, dig, meta, outcome = _digest_replayed(log_dir)
    assert (epoch, outcome) == (11, Outcome.OK) and dig == model.digest(11)


def test_compactor_killed_at_random_moments(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    seed = 31
    model = Model(seed)
    rng = np.random.default_rng(31)
    total = 0
    for _ in range(4):
        _write_epochs(log_dir, seed, 4)
        total += 4
        _run_and_kill(["compact", str(log_dir)], float(rng.uniform(0.15, 0.6)))
        epoch, dig, _, outcome = _digest_replayed(log_dir)
        assert (epoch, outcome) == (total, Outcome.OK) and dig == model.digest(total)
