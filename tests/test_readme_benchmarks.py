"""The README's Benchmarks table is traceable: every row names exactly one results JSON of benchmarks/results/
that exists and is a stamped results document, every results JSON there is named by a row (one JSON per row,
not a notebook of runs) and by benchmarks/README.md with the command that writes it, every figure has its JSON
beside it, and no row is longer than 300 characters.

experiments/README.md's Lab measurements table (the lab code's numbers, kept out of the product's table) is held
to the same rules against experiments/results/, and its other tables may name a results file there only if it
exists, each file in one row at most; no results file is in both directories."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LAB_RESULTS = ROOT / "experiments" / "results"
MAX_ROW = 300
_JSON = re.compile(r"[A-Za-z0-9_.-]+\.json")


def tables(text: str) -> list[list[str]]:
    """Every table of a markdown text, as its lines (header, separator, data rows)."""
    out: list[list[str]] = []
    prev = False
    for ln in text.splitlines():
        is_row = ln.startswith("|")
        if is_row and not prev:
            out.append([])
        if is_row:
            out[-1].append(ln)
        prev = is_row
    return out


def benchmark_rows(readme: str, heading: str = "Benchmarks") -> list[str]:
    """The data rows of the first table under '## <heading>' (header and separator left out)."""
    section = readme.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    found = tables(section)
    rows = found[0] if found else []
    assert len(rows) > 2 and set(rows[1].replace("|", "").strip()) <= {"-", ":", " "}, f"no table under {heading}"
    return rows[2:]


def named_file(row: str) -> str:
    names = set(_JSON.findall(row))
    assert len(names) == 1, f"a row names exactly one results file, this one {sorted(names) or 'none'}: {row[:90]}"
    return names.pop()


def check_rows(rows: list[str], results: Path) -> None:
    for row in rows:
        assert len(row) <= MAX_ROW, f"{len(row)} characters (> {MAX_ROW}): {row[:90]}"
        name = named_file(row)
        path = results / name
        assert path.is_file(), f"{name} is not in {results.relative_to(ROOT)}/: {row[:90]}"
        doc = json.loads(path.read_text())
        assert {"benchmark", "date", "git_commit", "device", "rows"} <= doc.keys(), f"{name} is not stamped"
        assert doc["rows"], f"{name} holds no measurement"


def lab_rows() -> list[str]:
    return benchmark_rows((ROOT / "experiments" / "README.md").read_text(), "Lab measurements")


def command_rows(text: str) -> list[str]:
    """The data rows of the 'results file | written by' tables."""
    return [r for t in tables(text) if t[0].startswith("| results file | written by") for r in t[2:]]


def times_named(text: str) -> dict[str, int]:
    """How many rows of the text's tables, other than the command tables, name each results file."""
    counts: dict[str, int] = {}
    for t in tables(text):
        if t[0].startswith("| results file | written by"):
            continue
        for row in t[2:]:
            for name in set(_JSON.findall(row)):
                counts[name] = counts.get(name, 0) + 1
    return counts


def test_every_row_is_short_and_names_one_existing_results_file() -> None:
    check_rows(benchmark_rows((ROOT / "README.md").read_text()), RESULTS)


def test_every_results_file_belongs_to_a_row_and_every_figure_to_a_results_file() -> None:
    named = {named_file(r) for r in benchmark_rows((ROOT / "README.md").read_text())}
    on_disk = {p.name for p in RESULTS.glob("*.json")}
    assert on_disk - named == set(), "results no README row names (git keeps old runs; probes go to experiments/)"
    commands = set(_JSON.findall((ROOT / "benchmarks" / "README.md").read_text()))
    assert on_disk - commands == set(), "results files benchmarks/README.md gives no command for"
    figures = {p.with_suffix(".json").name for p in RESULTS.glob("*.png")}
    assert figures - on_disk == set(), "figures without their results JSON"


def test_every_lab_row_is_short_and_names_one_existing_results_file() -> None:
    check_rows(lab_rows(), LAB_RESULTS)


def test_experiments_results_are_named_once_with_their_commands_and_figures() -> None:
    text = (ROOT / "experiments" / "README.md").read_text()
    on_disk = {p.name for p in LAB_RESULTS.glob("*.json")}
    counts = times_named(text)
    assert {n for n, c in counts.items() if c > 1} == set(), "results files named by more than one row"
    assert set(counts) - on_disk == set(), "rows of experiments/README.md name results not in experiments/results/"
    lab = {named_file(r) for r in lab_rows()}
    commands = {named_file(r) for r in command_rows(text)}
    assert lab - commands == set(), "lab results experiments/README.md gives no command for"
    assert commands - lab == set(), "commands for results no Lab measurements row names"
    figures = {p.with_suffix(".json").name for p in LAB_RESULTS.glob("*.png")}
    assert figures - on_disk == set(), "figures without their results JSON"
    both = on_disk & {p.name for p in RESULTS.glob("*.json")}
    assert both == set(), "results files in both benchmarks/results/ and experiments/results/"


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
    doc = ("x\n## Lab measurements\n\n| what | measured | target | results file |\n|---|---|---|---|\n"
           "| a | 1 ms | - | `a-cpu.json` |\n\n| results file | written by |\n|---|---|\n| `a-cpu.json` | `a.py` |\n"
           "\n| script | result |\n|---|---|\n| `b.py` | `results/a-cpu.json` |\n")
    assert benchmark_rows(doc, "Lab measurements") == ["| a | 1 ms | - | `a-cpu.json` |"]
    assert command_rows(doc) == ["| `a-cpu.json` | `a.py` |"]
    assert times_named(doc) == {"a-cpu.json": 2}  # the command table does not count; the probe row does
