"""Comments and docstrings in the package say what is and why; what happened when belongs to git and
CHANGELOG.md. This fails on a history reference ("session 12", "issue 14") in a comment or docstring of a .py
file under src/, or anywhere in a DESIGN.md shipped with the package."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "concordia_ft"
HISTORY = re.compile(r"\b(session|issue)s?\s+\d+", re.IGNORECASE)

# Files whose owners are rewriting them (a file leaves this list when it is clean, and then stays clean): none
# now; test_every_allowed_file_exists keeps the list honest if one is added.
ALLOWED: set[str] = set()


def comment_and_docstring_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and every docstring line of a module's source."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                out += [(first.lineno + i, ln) for i, ln in enumerate(first.value.value.splitlines())]
    return out


def history_references(path: Path) -> list[str]:
    text = path.read_text()
    lines = comment_and_docstring_lines(text) if path.suffix == ".py" else list(enumerate(text.splitlines(), 1))
    return [f"{path.relative_to(PKG)}:{n}: {ln.strip()[:100]}" for n, ln in lines if HISTORY.search(ln)]


def test_no_history_references_in_the_package() -> None:
    files = sorted([*PKG.rglob("*.py"), *PKG.rglob("DESIGN.md")])
    assert len(files) > 50, "the package's sources were not found"
    found = [hit for p in files if p.relative_to(PKG).as_posix() not in ALLOWED for hit in history_references(p)]
    assert found == [], "history belongs to git and CHANGELOG.md, not the package:\n" + "\n".join(found)


def test_the_check_sees_comments_and_docstrings_but_not_code() -> None:
    src = ('"""Module docstring (session 12 found this)."""\n'
           "SESSIONS = 3  # measured in issue 7\n"
           "def f():\n    '''Since Session 16.'''\n    return 'session 4 is a string, not a comment'\n")
    hits = sorted(n for n, ln in comment_and_docstring_lines(src) if HISTORY.search(ln))
    assert hits == [1, 2, 4]


def test_every_allowed_file_exists() -> None:
    assert [a for a in sorted(ALLOWED) if not (PKG / a).is_file()] == [], "drop files that moved or went"
