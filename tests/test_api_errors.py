"""Bad input to the Python API gets the project's own errors, saying what happened and what to do, and loses
nothing already committed. Real files and directories throughout; the read-only case runs in a child process
that cannot write there (as an unprivileged user when the tests run as root, where permissions do not bind)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import concordia_ft as cf
from concordia_ft.core.segment import is_tmpfs
from concordia_ft.errors import ConfigError, LogLockedError, RecoveryError, RegionError
from concordia_ft.runtime import Runtime
from support import subprocess_env


def _roundtrip(e: BaseException) -> None:
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is type(e) and str(back) == str(e)


def _written_log(path: Path, epochs: int = 2) -> np.ndarray:
    rng = np.random.default_rng(3)
    a = rng.standard_normal(3000).astype(np.float32)
    with Runtime(path, fsync="never") as rt:
        rt.register("a", a)
        for i in range(epochs):
            a[i * 100:(i + 1) * 100] += 1
            rt.checkpoint(meta={"step": i})
    return a.copy()


def test_non_json_meta_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    a = np.random.default_rng(1).standard_normal(2000).astype(np.float32)
    with Runtime(tmp_path / "log", fsync="never") as rt:
        rt.register("a", a)
        assert rt.checkpoint(meta={"step": 0}) == 1
        a[:10] = 5
        for bad in ({"when": object()}, {"ids": {1, 2}}, {1: "a", "b": 2}):
            with pytest.raises(ConfigError, match="epoch 2 not written: its metadata must be JSON-able") as ei:
                rt.checkpoint(meta=bad)
            assert not isinstance(ei.value, TypeError)
            _roundtrip(ei.value)
            with pytest.raises(ConfigError, match="JSON-able"):
                rt.checkpoint_async(meta=bad)
        assert rt.epoch == 1
        assert rt.checkpoint(meta={"step": 1}) == 2  # the log goes on at the next number
    rec = cf.recover(tmp_path / "log")
    assert rec.epoch == 2 and rec.meta == {"step": 1}
    np.testing.assert_array_equal(rec.array("a"), a)


def test_a_file_path_is_refused_by_runtime_and_recover(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    with pytest.raises(ConfigError, match="is a file, not a log directory") as ei:
        Runtime(f)
    _roundtrip(ei.value)
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        Runtime(f / "log")
    with pytest.raises(RecoveryError, match="it is a file, not a log directory") as er:
        cf.recover(f)
    _roundtrip(er.value)
    assert f.read_text() == "keep me"


@pytest.fixture
def read_only_tree() -> Iterator[tuple[Path, np.ndarray]]:
    """A directory nobody but root may write, holding a committed log: (parent, final bytes of region a)."""
    root = Path(tempfile.mkdtemp(prefix="cft-ro-"))
    os.chmod(root, 0o755)
    expected = _written_log(root / "log")
    for d, _, files in os.walk(root):
        for name in files:
            os.chmod(Path(d) / name, 0o444)
        os.chmod(d, 0o555)
    try:
        yield root, expected
    finally:
        for d, _, _ in os.walk(root):
            os.chmod(d, 0o755)
        subprocess.run(["rm", "-rf", str(root)], check=False)


# Root bypasses permission bits through CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH / CAP_FOWNER: the child drops
# them (capset) first, so the directory is as read-only for it as for any user. Prints "no-capset" when the
# kernel refuses (then the test cannot be run here).
_DROP_DAC = r"""
import ctypes, os
if os.geteuid() == 0:
    class Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = Hdr(0x20080522, 0), (Data * 2)()
    ok = libc.capget(ctypes.byref(hdr), data) == 0
    for d in data[:1]:
        d.effective &= ~0b1110
        d.permitted &= ~0b1110
    if not ok or libc.capset(ctypes.byref(hdr), data) != 0:
        print("no-capset", ctypes.get_errno())
        raise SystemExit(0)
"""

_RO_CHILD = _DROP_DAC + r"""
import sys, numpy as np, concordia_ft as cf
from concordia_ft.errors import LogError
from concordia_ft.runtime import Runtime
root = sys.argv[1]
for target in (root + "/log", root + "/new/log"):
    try:
        Runtime(target)
    except LogError as e:
        print("LogError:", e)
    else:
        print("opened", target)
rec = cf.recover(root + "/log")
print("recovered epoch", rec.epoch, "sum", float(rec.array("a").astype(np.float64).sum()))
"""


def test_a_read_only_directory_gets_a_log_error_and_can_still_be_recovered(
        read_only_tree: tuple[Path, np.ndarray]) -> None:
    root, expected = read_only_tree
    r = subprocess.run([sys.executable, "-c", _RO_CHILD, str(root)], capture_output=True, text=True, timeout=120,
                       env=subprocess_env(), cwd="/")
    assert r.returncode == 0, r.stderr
    if r.stdout.startswith("no-capset"):
        pytest.skip(f"running as root and the kernel refused to drop CAP_DAC_OVERRIDE ({r.stdout.strip()})")
    lines = r.stdout.splitlines()
    assert len([ln for ln in lines if ln.startswith("LogError:")]) == 2, r.stdout
    assert "cannot write to the log directory" in lines[0] and "concordia_ft.recover(DIR)" in lines[0]
    assert "cannot create the log directory" in lines[1] and "Permission denied" in lines[1]
    assert lines[2] == f"recovered epoch 2 sum {float(expected.astype(np.float64).sum())}"
    assert not (root / "new").exists()


def test_a_refused_backend_creates_nothing(tmp_path: Path) -> None:
    if is_tmpfs(tmp_path):
        pytest.skip("the test directory is on tmpfs, where backend='dram' is accepted")
    target = tmp_path / "a" / "b" / "log"
    with pytest.raises(ConfigError, match="backend 'dram' needs a directory on tmpfs") as ei:
        Runtime(target, backend="dram")
    assert str(target) in str(ei.value)
    with pytest.raises(ConfigError, match="unknown log backend"):
        Runtime(target, backend="nvme")
    assert list(tmp_path.iterdir()) == []


def test_a_refused_open_of_an_existing_log_leaves_it_whole(tmp_path: Path) -> None:
    expected = _written_log(tmp_path / "log")
    with Runtime(tmp_path / "log", fsync="never"):
        with pytest.raises(LogLockedError):
            Runtime(tmp_path / "log")
    np.testing.assert_array_equal(cf.recover(tmp_path / "log").array("a"), expected)


def test_register_after_close_is_refused(tmp_path: Path) -> None:
    rt = Runtime(tmp_path / "log", fsync="never")
    rt.register("a", np.zeros(100, np.float32))
    rt.checkpoint()
    rt.close()
    with pytest.raises(ConfigError, match="register\\('b'\\): the runtime of .* is closed") as ei:
        rt.register("b", np.zeros(100, np.float32))
    _roundtrip(ei.value)
    assert cf.recover(tmp_path / "log").specs.keys() == {"a"}


@pytest.mark.parametrize("kind", ["dense", "paged", "immutable", "scratch"])
@pytest.mark.parametrize("diff", ["hash", "shadow"])
def test_a_diff_mode_on_a_region_without_diffs_is_refused(tmp_path: Path, kind: str, diff: str) -> None:
    with Runtime(tmp_path / "log", fsync="never") as rt:
        extra = {"dirty_blocks": np.zeros(4, np.uint8), "block_bytes": 16384} if kind == "paged" else {}
        with pytest.raises(RegionError, match=f"diff='{diff}' applies to opaque regions only; a {kind} region"):
            rt.register("r", np.zeros(16384, np.uint8), kind, diff=diff, **extra)
        assert "r" not in rt.table
        rt.register("o", np.zeros(16384, np.uint8), "opaque", diff=diff)  # where it means something
