"""`concordia log` against a corpus of damaged logs built here: every subcommand, every case.

The contract under test (cli/logcmds.py): exit codes 0/1/2 as documented; no traceback in stdout or stderr,
ever (and the last-resort "internal error" handler never fires); in text mode, whenever something is left
wrong, exactly one ``next step:`` line; a fix never loses a committed epoch it could keep (after a successful
``--fix`` the log recovers the exact bytes of at least every epoch that the damage left verifiable), a refused
or impossible fix changes no byte, and what ``--drop-after-damage`` drops is set aside, not deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import concordia_ft as cft
from concordia_ft.cli.main import main
from concordia_ft.core import format as F
from concordia_ft.core.manifest import MANIFEST_NAME, load_manifest
from concordia_ft.core.replay import replay
from concordia_ft.errors import ConcordiaError

PAGE = 4096
REGION = 128 * PAGE


# ------------------------------------------------------------------------------------------- the corpus
@dataclass
class Epoch:
    number: int
    segment: str
    start: int
    end: int
    header: int  # offset of its header; descriptors follow
    payload: int  # offset of its first payload
    marker: int  # offset of its commit marker


@dataclass
class Model:
    dir: Path
    digests: dict[int, str]  # epoch -> sha256 of the region's exact bytes after it
    segments: list[str]  # manifest order
    epochs: list[Epoch]

    @property
    def last(self) -> int:
        return max(self.digests)

    def before(self, segment: str, offset: int) -> int | None:
        """The last epoch that ends at or before (segment, offset), in log order (None: none)."""
        i = self.segments.index(segment)
        done = [e.number for e in self.epochs if self.segments.index(e.segment) < i
                or (e.segment == segment and e.end <= offset)]
        return max(done) if done else None

    def in_segment(self, segment: str) -> list[Epoch]:
        return [e for e in self.epochs if e.segment == segment]


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def build(d: Path) -> Model:
    """A base (epochs 1-3 compacted) + 3 incremental segments of random sparse epochs (1 MiB segments)."""
    rng = np.random.default_rng(7)
    a = rng.integers(0, 256, REGION, dtype=np.uint8)
    digests: dict[int, str] = {}
    with cft.Runtime(d, fsync="never", page_bytes=PAGE, segment_max_bytes=1 << 20, compact_after_bytes=None) as rt:
        rt.register("a", a)
        for i in range(20):
            if i == 3:
                rt.compact()
            pages = rng.choice(REGION // PAGE, size=int(rng.integers(20, 80)), replace=False)
            for p in pages:
                a[p * PAGE : p * PAGE + 64] = rng.integers(0, 256, 64, dtype=np.uint8)
            e = rt.checkpoint({"i": i})
            digests[e] = _sha(a)
    m = load_manifest(d)
    assert m is not None
    epochs: list[Epoch] = []
    for s in replay(d, collect_summaries=True, materialize=False).epochs:
        buf = (d / s.segment).read_bytes()[s.offset : s.offset + s.total_bytes]
        h = F.EpochHeader.decode(buf[: F.EPOCH_HEADER_BYTES])
        payload = s.offset + F.align_up(s.offset + F.EPOCH_HEADER_BYTES + h.desc_bytes) - s.offset
        epochs.append(Epoch(s.epoch, s.segment, s.offset, s.offset + s.total_bytes, s.offset, payload,
                            s.offset + s.total_bytes - F.COMMIT_BYTES))
    model = Model(d, digests, m.segments(), epochs)
    assert model.segments[0].startswith("base.") and len(model.segments) >= 4, model.segments
    assert all(len(model.in_segment(s)) >= 2 for s in model.segments[1:]), "every incr segment holds 2+ epochs"
    return model


@pytest.fixture(scope="module")
def corpus_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return build(tmp_path_factory.mktemp("cli") / "log")


# A case damages a copy of the log and says what a fix may keep: the newest epoch that stays verifiable
# (``keep``), whether plain --fix may repair it (``fixable``), or only --fix --drop-after-damage.
@dataclass
class Case:
    name: str
    damage: Callable[[Path, Model], None]
    keep: Callable[[Model], int | None]
    fixable: bool  # plain --fix repairs it (a tail, a damaged manifest); False: needs --drop-after-damage
    clean: bool = False  # a valid log (healthy, or cut exactly at an epoch boundary): check says 0


def _write_manifest(data: bytes) -> Callable[[Path, Model], None]:
    return lambda d, m: (d / MANIFEST_NAME).write_bytes(data)


def _truncate_manifest(n: int) -> Callable[[Path, Model], None]:
    return lambda d, m: (d / MANIFEST_NAME).write_bytes((d / MANIFEST_NAME).read_bytes()[:n])


def _flip_manifest_json(d: Path, m: Model) -> None:
    data = bytearray((d / MANIFEST_NAME).read_bytes())
    data[data.index(b'"incr"') + 2] ^= 0x20  # the JSON still parses, the CRC does not match
    (d / MANIFEST_NAME).write_bytes(bytes(data))


def _remove(which: int) -> Callable[[Path, Model], None]:
    return lambda d, m: (d / m.segments[which]).unlink()


def _truncate(which: int, where: Callable[[Model, str], int]) -> Callable[[Path, Model], None]:
    def damage(d: Path, m: Model) -> None:
        seg = m.segments[which]
        os.truncate(d / seg, where(m, seg))
    return damage


def _flip(which: int, where: Callable[[Model, str], int], bit: int = 3) -> Callable[[Path, Model], None]:
    def damage(d: Path, m: Model) -> None:
        seg = m.segments[which]
        off = where(m, seg)
        with open(d / seg, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ (1 << bit)]))
    return damage


def _epoch_at(k: int, field: str, plus: int = 0) -> Callable[[Model, str], int]:
    return lambda m, seg: int(getattr(m.in_segment(seg)[k], field)) + plus


def _keep_before(which: int, where: Callable[[Model, str], int]) -> Callable[[Model], int | None]:
    return lambda m: m.before(m.segments[which], where(m, m.segments[which]))


def _cases() -> list[Case]:
    last = lambda m: m.last  # noqa: E731
    cases = [
        Case("healthy", lambda d, m: None, last, True, clean=True),
        Case("manifest-empty", _write_manifest(b""), last, True),
        Case("manifest-garbage", _write_manifest(bytes(range(256)) * 3), last, True),
        Case("manifest-json-no-crc", _write_manifest(b'{"format": 1}'), last, True),
        Case("manifest-bad-crc", _flip_manifest_json, last, True),
        Case("manifest-missing", lambda d, m: (d / MANIFEST_NAME).unlink(), last, True),
        Case("missing-last-segment", _remove(-1), lambda m: m.before(m.segments[-1], 0), True),
        Case("missing-middle-segment", _remove(2), lambda m: m.before(m.segments[2], 0), False),
        Case("missing-base", _remove(0), lambda m: None, False),
    ]
    for n in (1, 10, 40, 80):
        cases.append(Case(f"manifest-truncated-{n}", _truncate_manifest(n), last, True))
    # truncations of the last segment (a torn tail) and of a sealed one (damage before the tail)
    for label, field, plus in [("header", "header", 0), ("header+20", "header", 20), ("desc", "header", 70),
                               ("payload", "payload", 100), ("marker", "marker", 5), ("end-1", "end", -1)]:
        for k in (0, -1):
            w = _epoch_at(k, field, plus)
            cases.append(Case(f"truncate-last-{k}-{label}", _truncate(-1, w), _keep_before(-1, w), True,
                              clean=label == "header"))
        w = _epoch_at(-1, field, plus)
        cases.append(Case(f"truncate-sealed-{label}", _truncate(1, w), _keep_before(1, w), False))
    for n in (0, 100, 4095):
        cases.append(Case(f"truncate-last-segment-header-{n}", _truncate(-1, lambda m, s, n=n: n),
                          lambda m: m.before(m.segments[-1], 0), n == 0))
    cases.append(Case("truncate-last-segment-to-its-header", _truncate(-1, lambda m, s: F.SEGMENT_HEADER_BYTES),
                      lambda m: m.before(m.segments[-1], 0), True, clean=True))
    # bit flips: headers, descriptors, payloads, commit markers; in the last epoch (a damaged tail), in an
    # earlier epoch of the last segment and in a sealed segment (damage before the tail), in segment headers
    for label, field, plus in [("header", "header", 17), ("desc", "header", 60), ("payload", "payload", 33),
                               ("marker", "marker", 9)]:
        w_last = _epoch_at(-1, field, plus)
        cases.append(Case(f"flip-last-epoch-{label}", _flip(-1, w_last),
                          lambda m, w=w_last: m.before(m.segments[-1], w(m, m.segments[-1])), True))
        w0 = _epoch_at(0, field, plus)
        cases.append(Case(f"flip-first-epoch-of-last-{label}", _flip(-1, w0), _keep_before(-1, w0), False))
        cases.append(Case(f"flip-sealed-{label}", _flip(1, w0), _keep_before(1, w0), False))
        cases.append(Case(f"flip-base-{label}", _flip(0, w0), lambda m: None, False))
    cases.append(Case("flip-segment-header-sealed", _flip(1, lambda m, s: 20), lambda m: m.before(m.segments[1], 0),
                      False))
    return cases


CASES = _cases()


def _files(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != "LOCK"}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``concordia ARGV`` in this process: an exception escaping it fails the test (that IS a traceback)."""
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's usage errors
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    text = out + err
    assert "Traceback" not in text and "internal error" not in text, text
    return rc, text


def _next_steps(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip().startswith("next step:")]


def _assert_recovers(d: Path, model: Model, at_least: int | None) -> int | None:
    try:
        rec = cft.recover(d)
    except ConcordiaError:
        assert at_least is None, f"nothing recovers, but epoch {at_least} was verifiable"
        return None
    assert rec.epoch in model.digests and _sha(rec.array("a")) == model.digests[rec.epoch]
    assert at_least is None or rec.epoch >= at_least, (rec.epoch, at_least)
    return rec.epoch


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_subcommand_on_the_damaged_log_corpus(case: Case, corpus_model: Model, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    model = corpus_model

    def fresh(tag: str) -> Path:
        d = tmp_path / tag
        shutil.copytree(model.dir, d)
        case.damage(d, model)
        return d

    keep = case.keep(model)
    # check: 0 on a valid log, 1 otherwise with one next step; nothing changes
    d = fresh("check")
    before = _files(d)
    rc, text = run_cli(capsys, "log", "check", str(d))
    assert rc == (0 if case.clean else 1), text
    assert len(_next_steps(text)) == (0 if case.clean else 1), text
    rc_json, text = run_cli(capsys, "log", "check", str(d), "--json")
    doc = json.loads(text)
    assert rc_json == rc and (doc["next_step"] is None) == case.clean
    assert _files(d) == before
    # inspect / inspect --json: read-only, 0 or 1, a next step when 1
    for extra in ((), ("--json",)):
        rc, text = run_cli(capsys, "log", "inspect", str(d), *extra)
        assert rc in (0, 1), text
        if rc == 1:
            assert len(_next_steps(text)) == 1, text
        elif extra:
            json.loads(text)
    assert _files(d) == before
    # check --fix: repairs what it may; otherwise exit 1, a next step, and not one byte changed
    rc, text = run_cli(capsys, "log", "check", str(d), "--fix")
    if case.fixable:
        assert rc == 0, text
        assert _assert_recovers(d, model, keep) == keep
        rc, text = run_cli(capsys, "log", "check", str(d))
        assert rc == 0, text
    else:
        assert rc == 1, text
        steps = _next_steps(text)
        assert len(steps) == 1 and ("--drop-after-damage" in steps[0] or "replica" in steps[0]), text
        assert _files(d) == before
    # check --fix --drop-after-damage: ends with a log that checks clean and keeps every epoch that verified
    # (or, when nothing verifies without a lost file, exits 1 saying to restore it)
    d = fresh("drop")
    before = _files(d)
    rc, text = run_cli(capsys, "log", "check", str(d), "--fix", "--drop-after-damage")
    if rc == 1:
        assert keep is None and "replica" in _next_steps(text)[0] and _files(d) == before, text
    else:
        assert rc == 0, text
        assert _assert_recovers(d, model, keep) == keep
        rc, text = run_cli(capsys, "log", "check", str(d))
        assert rc == 0, text
        if not case.clean and not case.name.startswith(("truncate", "manifest-missing")):
            assert (d / "set-aside").is_dir(), "what a repair takes out is set aside, not deleted"
    # compact: 0 on a log it can compact; a damaged one is refused with a next step and left as it was
    d = fresh("compact")
    before = _files(d)
    rc, text = run_cli(capsys, "log", "compact", str(d))
    if case.clean:
        assert rc == 0 and _assert_recovers(d, model, keep) == keep
    else:
        assert rc in (0, 1), text
        if rc == 1:
            assert len(_next_steps(text)) == 1 and _files(d) == before, text
        else:  # a torn tail of the active segment is not compacted: what was committed is intact
            _assert_recovers(d, model, keep)


@pytest.mark.parametrize("what", ["nonexistent", "file", "empty-dir", "dir-of-other-files"])
def test_paths_that_are_not_a_log_are_usage_errors(what: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "x"
    if what == "file":
        p.write_bytes(b"hello")
    elif what != "nonexistent":
        p.mkdir()
        if what == "dir-of-other-files":
            (p / "notes.txt").write_text("not a log")
            (p / "incr.txt").write_bytes(os.urandom(5000))
    for argv in (["check"], ["check", "--fix"], ["check", "--fix", "--drop-after-damage"], ["check", "--json"],
                 ["inspect"], ["inspect", "--json"], ["compact"]):
        rc, text = run_cli(capsys, "log", argv[0], str(p), *argv[1:])
        assert rc == 2, (argv, text)
        assert len(_next_steps(text)) == 1, text
    if p.is_dir():
        assert sorted(x.name for x in p.iterdir()) == sorted(
            [] if what == "empty-dir" else ["notes.txt", "incr.txt"]), "a usage error creates nothing"


def test_segments_of_another_log_are_left_out_of_a_rebuilt_manifest(corpus_model: Model, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "log"
    shutil.copytree(corpus_model.dir, d)
    other = tmp_path / "other"
    with cft.Runtime(other, fsync="never") as rt:
        rt.register("b", np.ones(5000, dtype=np.uint8))
        rt.checkpoint()
    shutil.copy(other / "incr.000001.cft", d / "incr.000001.cft")  # a stranger from another log
    shutil.copy(other / "incr.000001.cft", d / "incr.000099.cft")  # ... renamed: its header disagrees
    (d / MANIFEST_NAME).write_bytes(b"")
    rc, text = run_cli(capsys, "log", "check", str(d), "--fix")
    assert rc == 0 and "another log" in text and "its header says incr generation 1" in text, text
    assert _assert_recovers(d, corpus_model, corpus_model.last) == corpus_model.last
    for name in ("incr.000001.cft", "incr.000099.cft"):
        assert list((d / "set-aside").rglob(name)), "a stranger is set aside, not deleted"
    m = load_manifest(d)
    assert m is not None and m.next_generation == 100  # no new segment can collide with a set-aside one


def test_the_cli_in_a_subprocess_prints_no_traceback(corpus_model: Model, tmp_path: Path) -> None:
    d = tmp_path / "log"
    shutil.copytree(corpus_model.dir, d)
    (d / MANIFEST_NAME).write_bytes(b"\x00garbage")
    env = {**os.environ, "PYTHONPATH": str(Path(cft.__file__).parents[1])}
    for argv in (["check"], ["check", "--fix", "--drop-after-damage"], ["inspect"], ["compact"]):
        p = subprocess.run([sys.executable, "-m", "concordia_ft.cli.main", "log", argv[0], str(d), *argv[1:]],
                           capture_output=True, text=True, env=env, timeout=120)
        assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
        assert p.returncode in (0, 1), p.stdout + p.stderr
    assert _assert_recovers(d, corpus_model, corpus_model.last) == corpus_model.last


# ------------------------------------------------------------------------------------- read-only mount
def _unshare_ro() -> list[str] | None:
    """A command prefix that runs its tail with DIR bind-mounted read-only (a user + mount namespace)."""
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return ["unshare", "--user", "--map-root-user", "--mount"] if probe.returncode == 0 else None


def test_a_read_only_mount(corpus_model: Model, tmp_path: Path) -> None:
    prefix = _unshare_ro()
    if prefix is None:
        pytest.skip("no user+mount namespaces here (unshare): cannot make a real read-only mount")
    d = tmp_path / "log"
    shutil.copytree(corpus_model.dir, d)
    os.truncate(d / corpus_model.segments[-1], corpus_model.epochs[-1].end - 10)  # a torn tail to fix
    before = _files(d)
    env = {**os.environ, "PYTHONPATH": str(Path(cft.__file__).parents[1])}
    script = (f"mount --bind -o ro {d} {d} || exit 99; "
              + "; ".join(f"{sys.executable} -m concordia_ft.cli.main log {a} {d}; echo RC=$?"
                          for a in ("check", "check --fix", "check --fix --drop-after-damage", "inspect",
                                    "compact")))
    p = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if p.returncode == 99:
        pytest.skip(f"bind mount refused in the namespace: {p.stderr.strip()}")
    out = p.stdout + p.stderr
    assert "Traceback" not in out and "internal error" not in out, out
    rcs = [int(x.split("=")[1]) for x in out.split() if x.startswith("RC=")]
    assert rcs == [1, 1, 1, 0, 1], out
    assert out.count("not writable") >= 3, out  # each refusal says why, and what to do
    assert _files(d) == before


# ------------------------------------------------------------------------------------------ a live log
WRITER = """
import sys, time, numpy as np, concordia_ft as cft
from pathlib import Path
d, stop = Path(sys.argv[1]), Path(sys.argv[2])
rng = np.random.default_rng(3)
a = rng.integers(0, 256, 64 * 4096, dtype=np.uint8)
with cft.Runtime(d, fsync="never", segment_max_bytes=1 << 20, compact_after_bytes=2 << 20) as rt:
    rt.register("a", a)
    i = 0
    while not stop.exists():
        pages = rng.choice(64, size=int(rng.integers(1, 48)), replace=False)
        for p in pages:
            a[p * 4096 : p * 4096 + 512] = rng.integers(0, 256, 512, dtype=np.uint8)
        rt.checkpoint({"i": i})
        i += 1
        if i == 1:
            print("READY", flush=True)
    np.save(d.parent / "final.npy", a)
    print("EPOCH", rt.epoch, flush=True)
"""


def _has_base(d: Path) -> bool:
    m = load_manifest(d)
    return m is not None and m.base is not None


def test_check_of_a_live_log_is_not_a_damaged_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d, stop = tmp_path / "log", tmp_path / "stop"
    env = {**os.environ, "PYTHONPATH": str(Path(cft.__file__).parents[1])}
    w = subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(stop)], stdout=subprocess.PIPE, text=True,
                         env=env)
    try:
        assert w.stdout is not None and w.stdout.readline().strip() == "READY"
        results = []
        # 40 checks at least, and on until the writer has compacted once (a base in the MANIFEST), so that the
        # checks race a compaction however a loaded machine schedules the two processes
        deadline, i = time.monotonic() + 240, 0
        while i < 40 or not _has_base(d):
            assert time.monotonic() < deadline, "the writer did not compact within 240 s"
            i += 1
            rc, text = run_cli(capsys, "log", "check", str(d), *(["--json"] if i % 2 else []))
            results.append((rc, text))
            assert rc == 0, text
            if i % 2:
                doc = json.loads(text)
                assert doc["live"] == {"pid": w.pid} and doc["problems"] == [], text
            else:
                assert f"being written by pid {w.pid}" in text and "problem" not in text, text
        rc, text = run_cli(capsys, "log", "check", str(d), "--fix")
        assert rc == 1 and f"pid {w.pid}" in text and len(_next_steps(text)) == 1, text
        rc, text = run_cli(capsys, "log", "check", str(d), "--fix", "--drop-after-damage")
        assert rc == 1 and "live" in text, text
        rc, text = run_cli(capsys, "log", "compact", str(d))
        assert rc == 1 and f"pid {w.pid}" in text and len(_next_steps(text)) == 1, text
        rc, text = run_cli(capsys, "log", "inspect", str(d), "--json")
        assert rc == 0 and json.loads(text)["live"] == {"pid": w.pid}, text
        assert not (d / "set-aside").exists()
    finally:
        stop.touch()
        out, _ = w.communicate(timeout=120)
    assert w.returncode == 0
    last = int(out.split("EPOCH")[1].split()[0])
    rc, text = run_cli(capsys, "log", "check", str(d))
    assert rc == 0 and "being written" not in text, text
    rec = cft.recover(d)
    assert rec.epoch == last and (rec.array("a") == np.load(tmp_path / "final.npy")).all()
    m = load_manifest(d)
    assert m is not None and m.base is not None, "the writer compacted while the checks ran"


def test_a_repair_the_disk_refuses_is_reported_and_leaves_the_log_as_it_was(
        corpus_model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """EIO from every fsync at the OS boundary (the default OsCalls table the repair writes through)."""
    from concordia_ft.core.oscalls import REAL_OS

    def failing_fsync(fd: int) -> None:
        raise OSError(5, os.strerror(5))

    d = tmp_path / "log"
    shutil.copytree(corpus_model.dir, d)
    (d / MANIFEST_NAME).write_bytes(b"garbage")
    monkeypatch.setattr(REAL_OS, "fsync", failing_fsync)
    for as_json in (False, True):
        rc, text = run_cli(capsys, "log", "check", str(d), "--fix", *(["--json"] if as_json else []))
        assert rc == 1, text
        if as_json:
            doc = json.loads(text)
            assert any("repair failed" in x for x in doc["left"]) and doc["next_step"], doc
        else:
            assert "repair failed: Input/output error" in text and len(_next_steps(text)) == 1, text
    assert (d / MANIFEST_NAME).read_bytes() == b"garbage"  # the atomic replace never happened
    monkeypatch.undo()
    rc, text = run_cli(capsys, "log", "check", str(d), "--fix")
    assert rc == 0, text
    assert _assert_recovers(d, corpus_model, corpus_model.last) == corpus_model.last


@pytest.mark.parametrize("which", [-1, 2])
def test_truncation_sweep_check_and_fix(which: int, corpus_model: Model, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Truncations spread over a whole segment (the active one: a torn tail; a sealed one: damage before
    the tail): check says 1 unless the cut is at an epoch boundary of the active segment, and the fixes keep
    exactly the epochs the cut left whole."""
    model = corpus_model
    seg = model.segments[which]
    size = (model.dir / seg).stat().st_size
    ends = {e.end for e in model.in_segment(seg)} | {F.SEGMENT_HEADER_BYTES}
    offsets = sorted({int(x) for x in np.linspace(1, size - 1, 23)} | {F.SEGMENT_HEADER_BYTES + 1})
    for off in offsets:
        keep = model.before(seg, off)
        d = tmp_path / f"t{off}"
        shutil.copytree(model.dir, d)
        os.truncate(d / seg, off)
        boundary = off in ends and which == -1
        rc, text = run_cli(capsys, "log", "check", str(d))
        assert rc == (0 if boundary else 1) and len(_next_steps(text)) == (0 if boundary else 1), (off, text)
        before = _files(d)
        rc, text = run_cli(capsys, "log", "check", str(d), "--fix")
        if which == -1 and off >= F.SEGMENT_HEADER_BYTES:  # a torn tail (a cut header is damage: not a crash)
            assert rc == 0 and _assert_recovers(d, model, keep) == keep, (off, text)
        else:
            assert rc == 1 and _files(d) == before, (off, text)
            rc, text = run_cli(capsys, "log", "check", str(d), "--fix", "--drop-after-damage")
            assert rc == 0 and _assert_recovers(d, model, keep) == keep, (off, text)
        rc, text = run_cli(capsys, "log", "check", str(d))
        assert rc == 0, (off, text)
        shutil.rmtree(d)


def test_inspect_lists_every_region_of_a_real_log_in_text_and_json(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The regions table holds each region the last committed epoch knows, with kind, size, page geometry,
    dtype and shape (both outputs), and a region dropped before that epoch is not in it."""
    rng = np.random.default_rng(31)
    d = tmp_path / "log"
    w = rng.standard_normal((48, 1000)).astype(np.float32)
    ids = rng.integers(0, 50000, 7777, dtype=np.int64)
    gone = rng.integers(0, 256, 3 * PAGE, dtype=np.uint8)
    with cft.Runtime(d, fsync="never", page_bytes=PAGE) as rt:
        rt.register("weights", w, kind="dense")
        rt.register("ids", ids)
        rt.register("scratch", gone)
        rt.checkpoint()
        rt.unregister("scratch")
        w[3, :17] = rng.standard_normal(17)
        rt.checkpoint()
    want = {"weights": ("dense", w.nbytes, "float32", [48, 1000]), "ids": ("opaque", ids.nbytes, "int64", [7777])}
    rc, text = run_cli(capsys, "log", "inspect", str(d), "--json")
    assert rc == 0, text
    regions = {r["name"]: r for r in json.loads(text)["regions"]}
    assert set(regions) == set(want), regions
    for name, (kind, nbytes, dtype, shape) in want.items():
        r = regions[name]
        assert (r["kind"], r["nbytes"], r["page_bytes"], r["dtype"], list(r["shape"])) == (
            kind, nbytes, PAGE, dtype, shape), r
    rc, text = run_cli(capsys, "log", "inspect", str(d))
    assert rc == 0, text
    table = text.split("regions", 1)[1].split("epochs (last", 1)[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("│")]
    assert sorted(ln.split("│")[1].strip() for ln in rows) == ["ids", "weights"], table
    assert "float32" in table and "(48, 1000)" in table and "int64" in table and "scratch" not in table, table
