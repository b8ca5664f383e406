"""`concordia doctor`: a line per check as it finishes (never silent while torch imports), a verdict line, the
same report as JSON, and a verdict that names the extra to install when torch is missing."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

import pytest

from support import PYTHON, subprocess_env

DOCTOR = "import sys; from concordia_ft.cli.main import main; sys.exit(main(['doctor', *sys.argv[1:]]))"
NO_TORCH = "import sys; sys.modules['torch'] = None; " + DOCTOR  # `import torch` raises ImportError


def _env() -> dict[str, str]:
    env = subprocess_env()
    env.pop("PYTHONUNBUFFERED")  # what a user's pipe gets: the lines must be flushed by the doctor itself
    return env


@dataclass
class TextRun:
    first: str  # the first line, as it arrived
    still_running: bool  # whether the doctor was still at work when it arrived
    lines: list[str]
    err: str


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> TextRun:
    """`concordia doctor` read line by line from a pipe (one run serves the tests below)."""
    with open(tmp_path_factory.mktemp("doctor") / "stderr", "w+") as errf:
        p = subprocess.Popen([PYTHON, "-c", DOCTOR], stdout=subprocess.PIPE, stderr=errf, text=True, env=_env())
        assert p.stdout is not None
        first = p.stdout.readline()
        still_running = p.poll() is None  # the package check is done; torch (seconds to import) is not yet
        out = p.stdout.read()
        assert p.wait(timeout=300) == 0
        errf.seek(0)
        return TextRun(first, still_running, (first + out).splitlines(), errf.read())


def test_each_check_prints_as_it_finishes_then_a_verdict(text_run: TextRun) -> None:
    first, lines = text_run.first, text_run.lines
    assert first.startswith("ok  concordia-ft ") and first.rstrip().endswith(" s)"), first
    assert text_run.still_running, "the first line came only when the doctor had finished"
    assert [ln.split()[1] for ln in lines[:6]] == ["concordia-ft", "DRAM", "C", "torch", "serve:", "CUDA:"], lines
    assert all(ln[:4] in ("ok  ", "--  ") and ln.endswith(" s)") for ln in lines[:6]), lines
    assert lines[-1].startswith("verdict: works here: logs and recovery"), lines
    assert "sessions" in lines[-1]  # torch and transformers are in this environment
    assert "Traceback" not in "\n".join(lines) + text_run.err


def test_json_is_the_same_report(text_run: TextRun) -> None:
    p = subprocess.run([PYTHON, "-c", DOCTOR, "--json"], capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    for key in ("concordia_ft", "python", "numpy", "crc32c_hardware", "dram_backend", "torch", "cuda_devices",
                "epoch_writer", "restore_loop", "works", "missing", "hints", "verdict"):
        assert key in doc, key
    assert doc["torch"] and doc["verdict"].startswith("works here: ")
    assert all(set(m) == {"what", "how"} for m in doc["missing"])
    assert text_run.lines[-1] == "verdict: " + doc["verdict"]


def test_without_torch_the_verdict_names_the_extra() -> None:
    p = subprocess.run([PYTHON, "-c", NO_TORCH], capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr
    assert "--  torch: not importable" in p.stdout, p.stdout
    verdict = p.stdout.splitlines()[-1]
    assert verdict.startswith("verdict: works here: logs and recovery"), verdict
    assert "for tensors, sessions and the demo: pip install 'concordia-ft[llm]'" in verdict, verdict
    assert "sessions, LoRA" not in verdict and "Traceback" not in p.stdout + p.stderr
