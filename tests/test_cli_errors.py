"""No traceback reaches a CLI user: each bad input or missing piece is one line and an exit code.

The CLI runs as a real subprocess (``python -m concordia_ft.cli.main``), as a user would run it."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from concordia_ft.cli.output import describe_error, guarded
from concordia_ft.core.segment import is_tmpfs
from concordia_ft.errors import ConfigError, LogError
from support import subprocess_env


def concordia(*args: str, code: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "concordia_ft.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env())


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    out = (r.stdout + r.stderr).strip()
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out
    return lines[0]


def test_no_command_prints_the_help_with_the_commands() -> None:
    r = concordia()
    assert r.returncode == 2
    assert "arguments are required" not in r.stderr
    for cmd in ("demo", "log", "doctor"):
        assert f"    {cmd} " in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(("args", "expect"), [
    (("--model", "/nonexistent/model"), "is not a local model directory (no config.json there)"),
    (("--device", "gpu0"), "--device 'gpu0' is not a device; use cpu, cuda or cuda:N"),
    (("--device", "cuda:7"), "--device cuda:7: this machine has"),
    (("--kill-after", "50", "--max-new-tokens", "40"), "--kill-after 50 must be between 1 and"),
    (("--max-new-tokens", "0"), "must be at least 1"),
])
def test_bad_demo_arguments_are_one_line_before_any_model_loads(args: tuple[str, ...], expect: str) -> None:
    r = concordia("demo", *args)
    assert r.returncode == 2
    line = one_line(r)
    assert line.startswith("concordia demo: ") and expect in line, line


def test_a_demo_log_dir_off_tmpfs_is_refused(tmp_path: Path) -> None:
    if is_tmpfs(tmp_path):
        pytest.skip("the test directory is on tmpfs, where the demo's DRAM log is allowed")
    r = concordia("demo", "--log-dir", str(tmp_path / "log"))
    assert r.returncode == 2 and "needs a directory on tmpfs" in one_line(r)


def test_demo_without_torch_says_what_to_install() -> None:
    code = ("import sys; sys.modules['torch'] = None; sys.argv[0] = 'concordia'; "
            "from concordia_ft.cli.main import main; sys.exit(main(sys.argv[1:]))")
    r = concordia("demo", code=code)
    assert r.returncode == 2
    assert "the demo needs torch, which is not installed: pip install 'concordia-ft[llm]'" in one_line(r)


def test_a_writer_failure_is_reported_by_its_cause(tmp_path: Path) -> None:
    """A model directory the writer cannot load: the demo says why in one line (the child's exception), not
    "the writer finished before the kill point" followed by the child's traceback."""
    pytest.importorskip("transformers")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no_such_architecture"}')
    r = concordia("demo", "--model", str(model))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out and "finished before the kill point" not in out
    failed = [ln for ln in out.splitlines() if ln.startswith("demo failed:")]
    assert len(failed) == 1, out
    assert "the writer failed before the kill point" in failed[0]
    assert "ValueError" in failed[0] and "no_such_architecture" in failed[0]
    r2 = concordia("--debug", "demo", "--model", str(model))  # --debug shows the child's traceback
    assert r2.returncode == 1 and "Traceback" in r2.stdout + r2.stderr


def test_every_error_kind_becomes_one_line_and_an_exit_code() -> None:
    cases = [
        (ConfigError("bad flag\nsecond line"), 2, "concordia log: error: bad flag (+1 more lines)"),
        (LogError("the log is locked"), 1, "concordia log: error: the log is locked"),
        (ModuleNotFoundError("No module named 'peft'", name="peft"), 2, "pip install 'concordia-ft[llm]'"),
        (ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib"), 2, "pip install matplotlib"),
        (PermissionError(errno.EACCES, "Permission denied", "/srv/log"), 1, "Permission denied (/srv/log)"),
        (KeyboardInterrupt(), 130, "interrupted"),
        (RuntimeError("boom"), 70, "internal error (RuntimeError: boom); this is a bug"),
    ]
    for exc, code, text in cases:
        line, got = describe_error(exc, "log")
        assert got == code and text in line and "\n" not in line, (exc, line)


def test_guarded_prints_one_line_and_debug_lets_the_traceback_through(capsys: pytest.CaptureFixture[str]
                                                                      ) -> None:
    def fails() -> int:
        raise LogError("segment incr.000002.cft is missing; run `concordia log check DIR`")

    assert guarded(fails, "log", debug=False) == 1
    assert capsys.readouterr().err == ("concordia log: error: segment incr.000002.cft is missing; run "
                                       "`concordia log check DIR`\n")
    with pytest.raises(LogError):
        guarded(fails, "log", debug=True)


def test_bench_plot_skips_a_results_file_it_cannot_read(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "benchmarks" / "results" / "broken.json").write_text("{not json")
    plot = Path(__file__).resolve().parents[1] / "benchmarks" / "plot.py"
    (tmp_path / "benchmarks" / "plot.py").write_bytes(plot.read_bytes())
    (tmp_path / "benchmarks" / "benchreport.py").write_bytes((plot.parent / "benchreport.py").read_bytes())
    r = subprocess.run([sys.executable, str(tmp_path / "benchmarks" / "plot.py"), "--root", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert r.returncode == 1
    line = one_line(r)
    assert line.startswith("skipped benchmarks/results/broken.json: not a results file") and "JSONDecodeError" in line
