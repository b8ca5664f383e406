"""`concordia demo --model DIR` on a tiny random Llama (the fast run's demo): the writer subprocess is SIGKILLed
mid-answer, a new process recovers it, and every token equals an uninterrupted run. The same run on the real
demo model (SmolLM2-135M-Instruct, minutes on a CPU) is tests/test_demo_smollm2.py, in the slow suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serve_helpers import make_tiny_model_dir

pytest.importorskip("transformers")


def test_demo_on_a_tiny_model_kills_recovers_and_matches(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from concordia_ft.cli import demo

    model = make_tiny_model_dir(tmp_path / "tiny")
    rc = demo.main(["--model", str(model), "--max-new-tokens", "32", "--kill-after", "8", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out[-4000:]
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["ok"] and doc["recovered"] == doc["reference"]
    assert len(doc["reference"]) == 2 and all(len(t) > 8 for t in doc["reference"])  # the kill inside answer 2
    phases = [p for p, _, _ in doc["timeline"]]
    for p in ("load", "prefill", "decode", "kill", "detect", "restore", "resume"):
        assert p in phases
    assert 0 < doc["median_epoch_bytes"] < doc["full_bytes"] / 50  # per-token epochs are a tiny delta
