"""`concordia`: the command line. Subcommands: demo, serve, log (check/inspect/compact), bench, doctor."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="concordia", description="Concordia-FT: crash-proof LLM sessions.")
    p.add_argument("--version", action="version", version=f"concordia-ft {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="kill a generating LLM session with SIGKILL and recover it token-exactly")
    from . import demo

    demo.add_arguments(d)
    from . import logcmds

    logcmds.add_arguments(sub)
    from . import bench, doctor, serve

    serve.add_arguments(sub)
    bench.add_arguments(sub)
    doctor.add_arguments(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        from . import demo

        return int(demo.run(args))
    if args.cmd == "log":
        from . import logcmds

        return logcmds.run(args)
    if args.cmd == "serve":
        from . import serve

        return serve.run(args)
    if args.cmd == "bench":
        from . import bench

        return bench.run(args)
    from . import doctor

    return doctor.run(args)


if __name__ == "__main__":
    sys.exit(main())
