"""The README's Benchmarks table is traceable: every row names exactly one results JSON of benchmarks/results/
that exists and is a stamped results document, every results JSON there is named by a row (one JSON per row,
not a notebook of runs) and by benchmarks/README.md with the command that writes it, every figure has its JSON
beside it, and no row is longer than 300 characters."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MAX_ROW = 300
_JSON = re.compile(r"[A-Za-z0-9_.-]+\.json")


def benchmark_rows(readme: str) -> list[str]:
    """The data rows of the first table under '## Benchmarks' (header and separator left out)."""
    section = readme.split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("|")]
    assert len(rows) > 2 and set(rows[1].replace("|", "").strip()) <= {"-", ":", " "}, "no table under Benchmarks"
    return rows[2:]


def named_file(row: str) -> str:
    names = set(_JSON.findall(row))
    assert len(names) == 1, f"a row names exactly one results file, this one {sorted(names) or 'none'}: {row[:90]}"
    return names.pop()


def test_every_row_is_short_and_names_one_existing_results_file() -> None:
    rows = benchmark_rows((ROOT / "README.md").read_text())
    for row in rows:
        assert len(row) <= MAX_ROW, f"{len(row)} characters (> {MAX_ROW}): {row[:90]}"
        name = named_file(row)
        path = RESULTS / name
        assert path.is_file(), f"{name} is not in benchmarks/results/: {row[:90]}"
        doc = json.loads(path.read_text())
        assert {"benchmark", "date", "git_commit", "device", "rows"} <= doc.keys(), f"{name} is not stamped"
        assert doc["rows"], f"{name} holds no measurement"


def test_every_results_file_belongs_to_a_row_and_every_figure_to_a_results_file() -> None:
    named = {named_file(r) for r in benchmark_rows((ROOT / "README.md").read_text())}
    on_disk = {p.name for p in RESULTS.glob("*.json")}
    assert on_disk - named == set(), "results no README row names (git keeps old runs; probes go to experiments/)"
    commands = set(_JSON.findall((ROOT / "benchmarks" / "README.md").read_text()))
    assert on_disk - commands == set(), "results files benchmarks/README.md gives no command for"
    figures = {p.with_suffix(".json").name for p in RESULTS.glob("*.png")}
    assert figures - on_disk == set(), "figures without their results JSON"


def test_the_checks_fail_on_a_long_row_or_two_files() -> None:
    readme = ("x\n## Benchmarks\n\n| what | measured | target | results file |\n|---|---|---|---|\n"
              "| a | 1 ms | - | `a-cpu.json` and `b-cpu.json` |\n\n## Next\n")
    (row,) = benchmark_rows(readme)
    try:
        named_file(row)
    except AssertionError as e:
        assert "exactly one" in str(e)
    else:
        raise AssertionError("two files in a row went unnoticed")
    assert named_file("| a | " + "x" * 400 + " | - | `a-cpu.json` |") == "a-cpu.json"
