"""Terminal output shared by the CLI commands: one rich console, human-readable sizes, and the one line (with
an exit code) that every error becomes: no Python traceback reaches the user (2: bad input or a missing
dependency, 1: the operation failed, 130: interrupted, 70: a bug in concordia; ``--debug`` lets the traceback
through instead)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import lru_cache

from rich.console import Console

from ..errors import ConcordiaError, ConfigError

# which extra brings which import
_EXTRAS = {"torch": "llm", "transformers": "llm", "peft": "llm", "gguf": "llm", "accelerate": "llm",
           "cuda": "cuda", "triton": "cuda", "aiohttp": "serve", "rich": "", "crc32c": "", "numpy": ""}


@lru_cache(maxsize=1)
def console() -> Console:
    return Console(highlight=False)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def describe_error(e: BaseException, cmd: str | None = None) -> tuple[str, int]:
    """The one line a user sees for ``e``, and the exit code."""
    what = f"concordia {cmd}" if cmd else "concordia"
    if isinstance(e, KeyboardInterrupt):
        return f"{what}: interrupted", 130
    if isinstance(e, ConfigError):
        return f"{what}: error: {_one_line(str(e))}", 2
    if isinstance(e, ConcordiaError):
        return f"{what}: error: {_one_line(str(e))}", 1
    if isinstance(e, ImportError):
        name = (e.name or "").split(".")[0] or "a module"
        extra = _EXTRAS.get(name)
        if extra:
            how = f"pip install 'concordia-ft[{extra}]'"
        elif extra == "":  # a dependency of the package itself
            how = "reinstall concordia-ft (pip install --force-reinstall concordia-ft)"
        else:
            how = f"pip install {name}"
        return f"{what}: needs {name}, which is not installed ({_one_line(str(e))}): {how}", 2
    if isinstance(e, OSError):
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return f"{what}: error: {e.strerror or _one_line(str(e))}{where}", 1
    return (f"{what}: internal error ({type(e).__name__}: {_one_line(str(e))}); this is a bug in concordia: "
            "rerun with --debug for the traceback and report it with `concordia doctor --json`", 70)


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0] + (f" (+{len(lines) - 1} more lines)" if len(lines) > 1 else "") if lines else "(no message)"


def guarded(fn: Callable[[], int], cmd: str | None, debug: bool) -> int:
    """Run ``fn``; print one line and return an exit code for anything it raises (unless ``debug``)."""
    try:
        return fn()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the CLI's last line of defence: every error becomes one line
        if debug:
            raise
        line, code = describe_error(e, cmd)
        print(line, file=sys.stderr)
        return code
