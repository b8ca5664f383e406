"""The Runtime API on the CPU: every region kind over numpy arrays and torch CPU tensors, dirty detection
against a numpy reference, registration errors, commit semantics, recovery (in a fresh process too),
compaction while appending, fsync policies, the DRAM backend, and the `concordia log` commands."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import concordia_ft as cft
from concordia_ft.core.regions import DiffMode, RegionKind, RegionSpec
from concordia_ft.core.replay import Outcome, replay
from concordia_ft.cpu.trackers import CpuTracker
from concordia_ft.errors import ConfigError, LogCorruptError, RecoveryError, RegionError
from support import PYTHON, subprocess_env

torch = pytest.importorskip("torch")

PAGE = 4096


def _sha(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        a = a.contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()).hexdigest()


def _rand(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


def _touch_pages(rng: np.random.Generator, raw: np.ndarray, pages: np.ndarray, page_bytes: int) -> None:
    """Change one random byte in each of ``pages`` (xor with a non-zero value: always a real change)."""
    for p in pages:
        lo = int(p) * page_bytes
        hi = min(lo + page_bytes, raw.size)
        raw[int(rng.integers(lo, hi))] ^= np.uint8(int(rng.integers(1, 256)))


# ------------------------------------------------------------------------------------- every kind, both types
class Regions:
    """One region of each kind, numpy and torch (f32, bf16, int64), with a model of what should be recovered."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.np_opq = rng.standard_normal(3 * 1024 + 17).astype(np.float32)  # not a page multiple
        self.t_hash = torch.from_numpy(rng.standard_normal(5000).astype(np.float32)).to(torch.bfloat16)
        self.t_dense = torch.from_numpy(rng.integers(-(2**40), 2**40, 1500, dtype=np.int64))
        self.kv = torch.from_numpy(rng.standard_normal(8 * 2048).astype(np.float32)).to(torch.bfloat16)  # 8 blocks of 4 KiB
        self.kv_bitmap = torch.zeros(8, dtype=torch.bool)
        self.np_imm = rng.integers(0, 2**31, 2000, dtype=np.int32)
        self.scratch = rng.standard_normal(4096).astype(np.float32)

    def register(self, rt: cft.Runtime) -> None:
        rt.register("np_opq", self.np_opq, "opaque")
        rt.register("t_hash", self.t_hash, "opaque", diff="hash")
        rt.register("t_dense", self.t_dense, "dense")
        rt.register("kv", self.kv, "paged", block_bytes=PAGE, dirty_blocks=self.kv_bitmap)
        rt.register("np_imm", self.np_imm, "immutable")
        rt.register("scratch", self.scratch, "scratch")

    def mutate(self) -> dict[str, int]:
        """Change a random set of pages of each mutable region; return the dirty page counts expected."""
        r = self.rng
        raw = self.np_opq.view(np.uint8)
        n = -(-raw.size // PAGE)
        opq = np.unique(r.integers(0, n, int(r.integers(1, n + 1))))
        _touch_pages(r, raw, opq, PAGE)
        hraw = self.t_hash.view(torch.uint8).numpy()
        nh = -(-hraw.size // PAGE)
        hp = np.unique(r.integers(0, nh, int(r.integers(1, nh + 1))))
        _touch_pages(r, hraw, hp, PAGE)
        self.t_dense.add_(1)
        blocks = np.unique(r.integers(0, 8, int(r.integers(1, 4))))
        for b in blocks:
            self.kv[b * 2048 : (b + 1) * 2048] = torch.randn(2048).to(torch.bfloat16)
            self.kv_bitmap[int(b)] = True
        self.scratch += 1
        return {"np_opq": len(opq), "t_hash": len(hp), "t_dense": -(-self.t_dense.numel() * 8 // PAGE),
                "kv": len(blocks)}

    def digests(self) -> dict[str, str]:
        return {"np_opq": _sha(self.np_opq), "t_hash": _sha(self.t_hash), "t_dense": _sha(self.t_dense),
                "kv": _sha(self.kv), "np_imm": _sha(self.np_imm)}


def test_every_kind_numpy_and_torch_round_trip_with_exact_dirty_counts(shm_dir: Path) -> None:
    rng = np.random.default_rng(1)
    regs = Regions(rng)
    with cft.Runtime(shm_dir / "log", compact_after_bytes=None) as rt:
        regs.register(rt)
        assert rt.checkpoint({"step": 0}) == 1
        first = rt.last_stats
        assert first is not None and set(first.region_pages) == {"np_opq", "t_hash", "t_dense", "kv", "np_imm"}
        assert not regs.kv_bitmap.any()  # cleared after the commit
        for step in range(1, 6):
            want = regs.mutate()
            imm_before = regs.np_imm.copy()
            assert rt.checkpoint({"step": step}) == step + 1
            st = rt.last_stats
            assert st is not None
            assert st.region_pages == want, (st.region_pages, want)  # scratch and immutable never appear
            assert st.payload_bytes >= sum(want.values()) * PAGE
            assert not regs.kv_bitmap.any()
            assert (regs.np_imm == imm_before).all()
    rec = cft.recover(shm_dir / "log")
    assert rec.epoch == 6 and rec.meta == {"step": 5} and rec.outcome is Outcome.OK
    assert "scratch" not in rec.regions
    got = {n: hashlib.sha256(rec.regions[n].tobytes()).hexdigest() for n in rec.regions}
    assert got == regs.digests()
    assert rec.array("np_opq").dtype == np.float32 and rec.array("np_opq").shape == regs.np_opq.shape
    assert torch.equal(rec.tensor("t_hash"), regs.t_hash) and rec.tensor("t_hash").dtype == torch.bfloat16
    assert torch.equal(rec.tensor("t_dense"), regs.t_dense)
    with pytest.raises(ConfigError, match="use .tensor"):
        rec.array("t_hash")


def test_recover_in_a_fresh_process_gives_exact_bytes(shm_dir: Path) -> None:
    rng = np.random.default_rng(2)
    regs = Regions(rng)
    with cft.Runtime(shm_dir / "log") as rt:
        regs.register(rt)
        rt.checkpoint()
        for _ in range(3):
            regs.mutate()
            rt.checkpoint({"k": "v"})
    code = ("import sys, json, hashlib, concordia_ft as cft\n"
            "rec = cft.recover(sys.argv[1])\n"
            "print(json.dumps({'epoch': rec.epoch, 'meta': rec.meta, 'd': {n: hashlib.sha256(a.tobytes()).hexdigest()"
            " for n, a in rec.regions.items()}}))\n")
    p = subprocess.run([PYTHON, "-c", code, str(shm_dir / "log")], capture_output=True, text=True,
                       env=subprocess_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc == {"epoch": 4, "meta": {"k": "v"}, "d": regs.digests()}


def test_immutable_is_logged_in_the_first_epoch_only(shm_dir: Path) -> None:
    w = np.arange(50_000, dtype=np.float32)
    x = np.zeros(100, dtype=np.float32)
    with cft.Runtime(shm_dir / "log") as rt:
        rt.register("w", w, "immutable")
        rt.register("x", x, "opaque")
        rt.checkpoint()
        assert rt.last_stats is not None and rt.last_stats.region_pages["w"] == -(-w.nbytes // PAGE)
        w_orig = w.copy()
        w[:] = -1  # breaking the promise: not logged
        x[0] = 1
        rt.checkpoint()
        assert rt.last_stats is not None and "w" not in rt.last_stats.region_pages
    rec = cft.recover(shm_dir / "log")
    assert (rec.array("w") == w_orig).all() and rec.array("x")[0] == 1


# ------------------------------------------------------------------------------- dirty detection vs numpy
@pytest.mark.parametrize("diff", ["shadow", "hash"])
@pytest.mark.parametrize("nbytes", [64 * PAGE, 64 * PAGE + 1000, 3 * 512 + 7])
def test_opaque_dirty_pages_match_a_numpy_reference(diff: str, nbytes: int) -> None:
    rng = np.random.default_rng(nbytes + len(diff))
    page = 512 if nbytes < PAGE else PAGE
    buf = _rand(rng, nbytes)
    spec = RegionSpec("r", RegionKind.OPAQUE, nbytes, page, diff=DiffMode(diff))
    tr = CpuTracker(spec, buf)
    d = tr.collect(full=False)  # not synced yet: everything
    assert len(d.pages) == spec.n_pages
    tr.advance(d)
    committed = buf.copy()
    for _ in range(25):
        k = int(rng.integers(0, spec.n_pages + 1))
        dirty = np.unique(rng.integers(0, spec.n_pages, k)) if k else np.zeros(0, np.int64)
        _touch_pages(rng, buf, dirty, page)
        if rng.random() < 0.3 and len(dirty):  # a write that restores the old bytes is not a change
            p = int(dirty[0])
            buf[p * page : (p + 1) * page] = committed[p * page : (p + 1) * page]
        padded_now = np.zeros(spec.n_pages * page, np.uint8)
        padded_now[:nbytes] = buf
        padded_old = np.zeros(spec.n_pages * page, np.uint8)
        padded_old[:nbytes] = committed
        ref = np.flatnonzero((padded_now.reshape(-1, page) != padded_old.reshape(-1, page)).any(axis=1))
        d = tr.collect(full=False)
        assert d.pages.tolist() == ref.tolist()
        assert bytes(d.payload) == padded_now.reshape(-1, page)[ref].tobytes()
        if rng.random() < 0.2:
            continue  # the epoch "failed to commit": the same pages must be found again next time
        tr.advance(d)
        committed = buf.copy()


def test_paged_logs_only_dirty_blocks_and_clears_the_bitmap(shm_dir: Path) -> None:
    rng = np.random.default_rng(3)
    kv = _rand(rng, 32 * 4 * PAGE)  # 32 blocks of 4 pages
    bitmap = np.zeros(32, dtype=np.uint8)
    with cft.Runtime(shm_dir / "log") as rt:
        rt.register("kv", kv, "paged", block_bytes=4 * PAGE, dirty_blocks=bitmap)
        rt.checkpoint()
        for _ in range(5):
            blocks = np.unique(rng.integers(0, 32, 5))
            for b in blocks:
                kv[b * 4 * PAGE : (b + 1) * 4 * PAGE] = _rand(rng, 4 * PAGE)
                bitmap[b] = 1
            kv[31 * 4 * PAGE] ^= 1 if 31 not in blocks else 0  # a write nobody marked is NOT logged (by contract)
            marked = kv.copy()
            rt.checkpoint()
            assert rt.last_stats is not None and rt.last_stats.region_pages == {"kv": 4 * len(blocks)}
            assert not bitmap.any()
            kv[31 * 4 * PAGE] = marked[31 * 4 * PAGE]
            if 31 not in blocks:
                kv[31 * 4 * PAGE] ^= 1  # undo the unmarked write so the model stays the marked state
    rec = cft.recover(shm_dir / "log")
    assert rec.epoch == 6


# ------------------------------------------------------------------------------------------ registration
def test_registration_errors(shm_dir: Path) -> None:
    a = np.zeros(10 * PAGE, dtype=np.uint8)
    with cft.Runtime(shm_dir / "log") as rt:
        rt.register("a", a[: 5 * PAGE])
        with pytest.raises(RegionError, match="overlaps"):
            rt.register("b", a[4 * PAGE :])
        with pytest.raises(RegionError, match="already registered"):
            rt.register("a", np.zeros(10))
        with pytest.raises(RegionError, match="0 bytes|empty"):
            rt.register("z", np.zeros(0))
        with pytest.raises(RegionError, match="unknown region kind"):
            rt.register("k", np.zeros(10), kind="sparse")
        with pytest.raises(RegionError, match="multiple"):
            rt.register("p", np.zeros(8 * PAGE, np.uint8), "paged", block_bytes=PAGE + 512,
                        dirty_blocks=np.zeros(4, np.uint8))
        with pytest.raises(RegionError, match="whole number"):
            rt.register("p", np.zeros(3 * PAGE, np.uint8), "paged", block_bytes=2 * PAGE,
                        dirty_blocks=np.zeros(1, np.uint8))
        with pytest.raises(RegionError, match="dirty_blocks"):
            rt.register("p", np.zeros(4 * PAGE, np.uint8), "paged", block_bytes=PAGE)
        with pytest.raises(RegionError, match="bitmap"):
            rt.register("p", np.zeros(4 * PAGE, np.uint8), "paged", block_bytes=PAGE, dirty_blocks=np.zeros(3))
        for bad in ("a/b", "..", "x..y", "", "é" * 150, "/abs"):
            with pytest.raises(RegionError):
                rt.register(bad, np.zeros(10))
        with pytest.raises(RegionError, match="contiguous"):
            rt.register("nc", np.zeros((10, 10))[:, 0])
        with pytest.raises(RegionError, match="contiguous"):
            rt.register("nct", torch.zeros(10, 10).t())
        with pytest.raises(RegionError, match="numpy array or a torch tensor"):
            rt.register("l", [1, 2, 3])
        with pytest.raises(RegionError, match="diff mode"):
            rt.register("d", np.zeros(10), diff="crc")
        with pytest.raises(RegionError, match="page size"):
            rt.register("pg", np.zeros(10), page_bytes=1000)
        t = torch.zeros(100)
        rt.register("t", t)
        with pytest.raises(RegionError, match="overlaps"):
            rt.register("t2", t[50:])
        # nothing half-registered survives an error: the log holds only 'a' and 't'
        rt.checkpoint()
    assert sorted(cft.recover(shm_dir / "log").regions) == ["a", "t"]


def test_bad_runtime_options(shm_dir: Path) -> None:
    with pytest.raises(ConfigError, match="fsync"):
        cft.Runtime(shm_dir / "a", fsync="sometimes")
    with pytest.raises(ConfigError, match="backend"):
        cft.Runtime(shm_dir / "b", backend="tape")
    with pytest.raises(ConfigError, match="page size|power of two"):
        cft.Runtime(shm_dir / "c", page_bytes=3000)
    with cft.Runtime(shm_dir / "d"):
        with pytest.raises(cft.LogError, match="in use"):
            cft.Runtime(shm_dir / "d")  # one writer per log


def test_dram_backend_needs_tmpfs(shm_dir: Path, tmp_path: Path) -> None:
    a = np.arange(1000, dtype=np.int64)
    with cft.Runtime(shm_dir / "log", backend="dram", fsync="never") as rt:
        rt.register("a", a)
        rt.checkpoint()
        a[3] = -3
        rt.checkpoint()
    assert (cft.recover(shm_dir / "log").array("a") == a).all()
    if not str(tmp_path).startswith("/dev/shm"):
        with pytest.raises(ConfigError, match="tmpfs"):
            cft.Runtime(tmp_path / "log", backend="dram")


# -------------------------------------------------------------------------------------- commit & recovery
@pytest.mark.parametrize("fsync", ["always", "interval", "never"])
def test_checkpoint_returns_committed_epochs_under_every_fsync_policy(tmp_path: Path, fsync: str) -> None:
    rng = np.random.default_rng(4)
    a = _rand(rng, 20 * PAGE + 3)
    with cft.Runtime(tmp_path / "log", fsync=fsync, fsync_interval_ms=5) as rt:
        rt.register("a", a)
        for e in range(1, 6):
            _touch_pages(rng, a, rng.integers(0, 21, 3), PAGE)
            assert rt.checkpoint({"e": e}) == e
            res = replay(tmp_path / "log")  # another reader sees it while the writer is still open
            assert res.epoch == e and res.outcome is Outcome.OK and bytes(res.regions["a"].data) == a.tobytes()
    assert cft.recover(tmp_path / "log").meta == {"e": 5}


def test_recover_into_restores_and_the_next_checkpoint_is_a_small_delta(shm_dir: Path) -> None:
    rng = np.random.default_rng(5)
    a = rng.standard_normal(200_000).astype(np.float32)
    t = torch.from_numpy(rng.standard_normal(50_000).astype(np.float32)).to(torch.bfloat16)
    with cft.Runtime(shm_dir / "log") as rt:
        rt.register("a", a)
        rt.register("t", t, diff="hash")
        rt.checkpoint()
        a[7] = 7
        rt.checkpoint()
    a2 = np.zeros_like(a)
    t2 = torch.zeros_like(t)
    with cft.Runtime(shm_dir / "log") as rt:
        assert rt.epoch == 2 and rt.open_report.last_epoch == 2
        rt.register("a", a2)
        rt.register("t", t2, diff="hash")
        rec = rt.recover_into()
        assert rec.epoch == 2
        assert (a2 == a).all() and torch.equal(t2, t)
        a2[100_000] = 1.5
        t2[3] = 2
        assert rt.checkpoint() == 3  # numbering continues
        assert rt.last_stats is not None and rt.last_stats.region_pages == {"a": 1, "t": 1}
        assert rt.last_stats.payload_bytes == 2 * PAGE
    rec = cft.recover(shm_dir / "log")
    assert (rec.array("a") == a2).all() and torch.equal(rec.tensor("t"), t2)


def test_recover_into_mismatch_and_empty_log_errors(shm_dir: Path) -> None:
    with cft.Runtime(shm_dir / "log") as rt:
        rt.register("a", np.zeros(100))
        with pytest.raises(RecoveryError, match="nothing to recover"):
            rt.recover_into()
        rt.checkpoint()
    with cft.Runtime(shm_dir / "log") as rt:
        rt.register("a", np.zeros(200))
        with pytest.raises(RecoveryError, match="register a buffer of the logged size"):
            rt.recover_into()
    with pytest.raises(RecoveryError, match="does not exist"):
        cft.recover(shm_dir / "nope")


def test_unregister_drops_the_region_from_recovery(shm_dir: Path) -> None:
    with cft.Runtime(shm_dir / "log") as rt:
        rt.register("a", np.ones(100))
        rt.register("b", np.ones(100))
        rt.checkpoint()
        rt.unregister("b")
        rt.checkpoint()
    assert sorted(cft.recover(shm_dir / "log").regions) == ["a"]


def test_background_compaction_while_appending_keeps_replay_exact(shm_dir: Path) -> None:
    rng = np.random.default_rng(6)
    a = _rand(rng, 256 * PAGE)
    d = _rand(rng, 16 * PAGE)
    with cft.Runtime(shm_dir / "log", fsync="never", compact_after_bytes=200 * PAGE) as rt:
        rt.register("a", a)
        rt.register("d", d, "dense")
        for e in range(1, 80):
            _touch_pages(rng, a, rng.integers(0, 256, 8), PAGE)
            d[:] = _rand(rng, d.size)
            assert rt.checkpoint({"e": e}) == e
            if e % 10 == 0:  # a reader in the middle of it all sees exactly the last epoch
                res = replay(shm_dir / "log")
                assert res.epoch == e and bytes(res.regions["a"].data) == a.tobytes()
        rt._join_compactor()
        assert rt.compaction_error is None
        assert rt.last_compaction is not None and rt.last_compaction.compacted
        assert rt.log.manifest.base is not None
    rec = cft.recover(shm_dir / "log")
    assert rec.epoch == 79 and rec.meta == {"e": 79}
    assert rec.regions["a"].tobytes() == a.tobytes() and rec.regions["d"].tobytes() == d.tobytes()


# Regression: before 922aed0 replay() loaded the manifest once and opened segments one by one, so a reader
# racing a compaction raised 'segment named in the manifest is missing' on a healthy log.
def test_a_reader_racing_a_compaction_still_gets_a_committed_state(shm_dir: Path) -> None:
    a = np.arange(5000, dtype=np.int64)
    with cft.Runtime(shm_dir / "log", compact_after_bytes=None) as rt:
        rt.register("a", a)
        rt.checkpoint()
        rt.compact()  # manifest: [base, incr]
        for i in range(3):
            a[i] = -i
            rt.checkpoint()
        compacted: list[bool] = []

        def compact_mid_replay(summary: Any) -> None:
            if not compacted:  # the reader has replayed the base; the writer compacts under its feet
                compacted.append(bool(rt.compact().compacted))

        res = replay(shm_dir / "log", on_epoch=compact_mid_replay)
        assert compacted == [True]
        assert res.epoch in (1, 4) and res.outcome is Outcome.OK


def test_explicit_compaction_then_reopen_and_continue(shm_dir: Path) -> None:
    a = np.arange(5000, dtype=np.int64)
    with cft.Runtime(shm_dir / "log", compact_after_bytes=None) as rt:
        rt.register("a", a)
        for i in range(4):
            a[i * 100] = -i
            rt.checkpoint()
        r = rt.compact()
        assert r is not None and r.compacted and r.epoch == 4
        a[1] = 99
        rt.checkpoint()
    with cft.Runtime(shm_dir / "log") as rt:
        b = np.zeros_like(a)
        rt.register("a", b)
        rt.recover_into()
        assert (b == a).all() and rt.epoch == 5
    r2 = cft.recover(shm_dir / "log")
    assert r2.epoch == 5 and (r2.array("a") == a).all()


# ------------------------------------------------------------------------------------------------- CLI
def cli(*argv: str) -> int:
    """`concordia ...` through cli.main when it is complete, else through the log commands' own parser."""
    if importlib.util.find_spec("concordia_ft.cli.demo") is not None:
        from concordia_ft.cli.main import main

        try:
            return int(main(list(argv)))
        except SystemExit as e:
            return int(e.code or 0)
    from concordia_ft.cli import logcmds

    p = argparse.ArgumentParser(prog="concordia")
    sub = p.add_subparsers(dest="cmd", required=True)
    logcmds.add_arguments(sub)
    try:
        args = p.parse_args(list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    return logcmds.run(args)


def _small_log(d: Path, epochs: int = 4) -> np.ndarray:
    a = np.arange(20_000, dtype=np.int32)
    with cft.Runtime(d) as rt:
        rt.register("a", a)
        for i in range(epochs):
            a[i * 3000] = -i - 1
            rt.checkpoint({"i": i})
    return a


def test_cli_check_inspect_compact_exit_codes(shm_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = shm_dir / "log"
    a = _small_log(d)
    assert cli("log", "check", str(d)) == 0
    assert cli("log", "inspect", str(d)) == 0
    capsys.readouterr()
    assert cli("log", "inspect", str(d), "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["last_epoch"] == 4 and doc["n_epochs"] == 4 and doc["outcome"] == "ok"
    assert cli("log", "check", str(shm_dir / "missing")) == 2
    assert cli("log", "frobnicate", str(d)) == 2
    assert cli("log", "check") == 2
    # a torn tail: check says 1, --fix cuts it and says 0, check is then clean
    seg = d / sorted(p.name for p in d.iterdir() if p.name.startswith("incr."))[-1]
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(b"CFTEPOCH" + os.urandom(100))
    assert cli("log", "check", str(d)) == 1
    assert seg.stat().st_size == size + 108  # a check without --fix changes nothing
    assert cli("log", "check", str(d), "--fix") == 0
    assert seg.stat().st_size == size
    assert cli("log", "check", str(d)) == 0
    assert cli("log", "compact", str(d)) == 0
    assert cli("log", "check", str(d)) == 0
    rec = cft.recover(d)
    assert rec.epoch == 4 and (rec.array("a") == a).all()
    with cft.Runtime(d):  # a writer holds the log: compact must refuse (not wait, not corrupt)
        assert cli("log", "compact", str(d)) == 1


def test_cli_check_reports_damage_before_the_tail(shm_dir: Path) -> None:
    d = shm_dir / "log"
    _small_log(d)
    seg = d / "incr.000001.cft"
    spans = [s for s in replay(d, collect_summaries=True).epochs]
    with open(seg, "r+b") as f:  # flip a bit in the commit marker of epoch 2 (epochs 3, 4 follow)
        off = spans[1].offset + spans[1].total_bytes - 5
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 4]))
    assert cli("log", "check", str(d)) == 1
    assert cli("log", "check", str(d), "--fix") == 1  # damage before the tail is not cut without consent
    with pytest.raises(LogCorruptError) as ei:
        replay(d)
    assert ei.value.offset == spans[1].offset and ei.value.path.endswith("incr.000001.cft")
    assert cli("log", "check", str(d), "--fix", "--drop-after-damage") == 0  # the operator's choice
    res = replay(d)
    assert res.outcome is Outcome.OK and res.epoch == 1


def test_writer_refuses_a_log_with_damage_before_the_tail(shm_dir: Path) -> None:
    d = shm_dir / "log"
    _small_log(d)
    spans = replay(d, collect_summaries=True).epochs
    with open(d / "incr.000001.cft", "r+b") as f:
        f.seek(spans[0].offset + 20)
        b = f.read(1)
        f.seek(spans[0].offset + 20)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(LogCorruptError):
        cft.Runtime(d)


def test_writer_refuses_a_damaged_tail_until_fixed(shm_dir: Path) -> None:
    d = shm_dir / "log"
    a = _small_log(d)
    spans = replay(d, collect_summaries=True).epochs
    last = spans[-1]
    with open(d / last.segment, "r+b") as f:  # flip a payload bit of the last epoch: whole but failing its CRC
        f.seek(last.offset + last.total_bytes - 100)
        b = f.read(1)
        f.seek(last.offset + last.total_bytes - 100)
        f.write(bytes([b[0] ^ 1]))
    res = replay(d)
    assert res.outcome is Outcome.DAMAGED_TAIL and res.epoch == 3
    with pytest.raises(LogCorruptError, match="--fix"):
        cft.Runtime(d)
    assert cli("log", "check", str(d), "--fix") == 0
    with cft.Runtime(d) as rt:
        assert rt.epoch == 3
        b2 = np.zeros_like(a)
        rt.register("a", b2)
        rt.recover_into()
        a3 = a.copy()
        a3[3 * 3000] = 3 * 3000  # epoch 4 (which wrote -4 there) is lost
        assert (b2 == a3).all()
        b2[0] = 5
        assert rt.checkpoint() == 4


def test_cli_in_a_subprocess_when_the_entry_point_is_complete(shm_dir: Path) -> None:
    if importlib.util.find_spec("concordia_ft.cli.demo") is None:
        pytest.skip("cli/main.py imports cli/demo.py, which is not written yet (the log commands are tested "
                    "through logcmds above)")
    d = shm_dir / "log"
    _small_log(d)
    p = subprocess.run([PYTHON, "-m", "concordia_ft.cli.main", "log", "check", str(d)], capture_output=True,
                       text=True, env=subprocess_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    shutil.rmtree(d)


def test_initially_zero_paged_region_logs_only_flagged_blocks_from_the_first_epoch(shm_dir: Path) -> None:
    block = 4 * 4096
    arena = np.zeros(64 * block, dtype=np.uint8)
    flags = np.zeros(64, dtype=np.uint8)
    rng = np.random.default_rng(5)
    with cft.Runtime(shm_dir / "log") as rt:
        rt.register("kv", arena, kind="paged", block_bytes=block, dirty_blocks=flags, initially_zero=True)
        arena[3 * block : 3 * block + 100] = rng.integers(1, 255, 100, dtype=np.uint8)
        flags[3] = 1
        rt.checkpoint()
        assert rt.last_stats.region_pages == {"kv": 4}  # one block, not the 256-page arena
        arena[9 * block + 7] = 42
        flags[9] = 1
        rt.checkpoint()
        assert rt.last_stats.region_pages == {"kv": 4}
    rec = cft.recover(shm_dir / "log")
    assert rec.regions["kv"].tobytes() == arena.tobytes()  # unflagged blocks come back as zeros
    busy = np.ones(4 * block, dtype=np.uint8)
    with cft.Runtime(shm_dir / "other") as rt, pytest.raises(cft.RegionError, match="nonzero"):
        rt.register("kv", busy, kind="paged", block_bytes=block, dirty_blocks=np.zeros(4, np.uint8),
                    initially_zero=True)
    with cft.Runtime(shm_dir / "third") as rt, pytest.raises(cft.RegionError, match="paged regions only"):
        rt.register("d", np.zeros(4096, np.uint8), kind="dense", initially_zero=True)
