"""`concordia`: the command line. Subcommands: demo, serve, log (check/inspect/compact), bench, doctor, dist.

No Python traceback reaches the user: :func:`main` turns every error into one line that says what happened
and what to do, with an exit code (2: bad input or a missing dependency, 1: the operation failed, 130:
interrupted, 70: a bug in concordia). ``concordia --debug CMD ...`` lets the traceback through instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from .. import __version__

# which extra brings which import
_EXTRAS = {"torch": "llm", "transformers": "llm", "peft": "llm", "gguf": "llm", "accelerate": "llm",
           "cuda": "cuda", "triton": "cuda", "aiohttp": "serve", "rich": "", "crc32c": "", "numpy": ""}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="concordia", description="Concordia-FT: crash-proof LLM sessions.")
    p.add_argument("--version", action="version", version=f"concordia-ft {__version__}")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    d = sub.add_parser("demo", help="kill a generating LLM session with SIGKILL and recover it token-exactly")
    from . import demo

    demo.add_arguments(d)
    from . import logcmds

    logcmds.add_arguments(sub)
    from . import bench, doctor, serve

    serve.add_arguments(sub)
    bench.add_arguments(sub)
    doctor.add_arguments(sub)
    from . import dist

    dist.add_arguments(sub)
    return p


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "demo":
        from . import demo

        return int(demo.run(args))
    if args.cmd == "log":
        from . import logcmds

        return logcmds.run(args)
    if args.cmd == "serve":
        from . import serve

        return serve.run(args)
    if args.cmd == "dist":
        from . import dist

        return dist.run(args)
    if args.cmd == "bench":
        from . import bench

        return bench.run(args)
    from . import doctor

    return doctor.run(args)


def describe_error(e: BaseException, cmd: str | None = None) -> tuple[str, int]:
    """The one line a user sees for ``e``, and the exit code."""
    from ..errors import ConcordiaError, ConfigError

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        return 2
    return guarded(lambda: _dispatch(args), args.cmd, args.debug)


if __name__ == "__main__":
    sys.exit(main())
