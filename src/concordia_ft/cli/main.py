"""`concordia`: the command line. Subcommands: demo, serve, log (check/inspect/compact), doctor, dist.

No Python traceback reaches the user: :func:`main` turns every error into one line that says what happened
and what to do, with an exit code (2: bad input or a missing dependency, 1: the operation failed, 130:
interrupted, 70: a bug in concordia). ``concordia --debug CMD ...`` lets the traceback through instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from . import demo, dist, doctor, logcmds, serve
from .output import guarded


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="concordia", description="Concordia-FT: crash-proof LLM sessions.")
    p.add_argument("--version", action="version", version=f"concordia-ft {__version__}")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    d = sub.add_parser("demo", help="kill a generating LLM session with SIGKILL and recover it token-exactly")
    demo.add_arguments(d)
    logcmds.add_arguments(sub)
    serve.add_arguments(sub)
    doctor.add_arguments(sub)
    dist.add_arguments(sub)
    return p


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "demo":
        return int(demo.run(args))
    if args.cmd == "log":
        return logcmds.run(args)
    if args.cmd == "serve":
        return serve.run(args)
    if args.cmd == "dist":
        return dist.run(args)
    return doctor.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        return 2
    return guarded(lambda: _dispatch(args), args.cmd, args.debug)


if __name__ == "__main__":
    sys.exit(main())
