"""A fork server for the job's new processes: torch imported once, every later rank or standby forked from it.

A new process pays the interpreter, ``import torch`` and the package's imports before it can build its model:
~1.5 s on an idle 2-core host, 7-11 s on the same host under load (measured: ``python -c "import torch"``
6.8-7.0 s at load 12), and that was most of a cold standby's repair. The coordinator starts one zygote per job
(``python -m concordia_ft.distributed.zygote``); it imports everything a worker needs, never touches a GPU or
starts a thread, prints ``ready``, and then forks a worker for each request line on its stdin (JSON: ``argv``,
``log``, ``env``, ``role``), answering with the child's pid. The child is a fresh worker process as far as the
job is concerned: its own model, CUDA context (initialised after the fork), store connections and log.

The children are not the coordinator's: it watches each by a pidfd (no exit status, the death is still an
event). The zygote ignores SIGCHLD, so the kernel reaps them. It dies with the coordinator (PDEATHSIG); a
rank it forked outlives both (a restarted coordinator keeps it, DESIGN.md §2), a standby dies with the zygote
(its own PDEATHSIG), as a standby does when its coordinator dies.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from typing import Any


def _serve() -> int:
    from . import worker  # noqa: F401 - torch and everything a worker imports, once

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel: no zombies here
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req, libc)  # never returns
        print(pid, flush=True)
    return 0


def _child(req: dict[str, Any], libc: ctypes.CDLL) -> None:
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if req.get("role") != "rank":
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a standby dies with the zygote (its coordinator)
        fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        sys.stdin = open(os.devnull)  # noqa: SIM115 - the process's stdin for its whole life
        os.environ.update(req.get("env", {}))
        from . import worker

        worker.STARTED_NS = time.monotonic_ns()  # a cold start is measured from the fork
        code = worker.main(req["argv"])
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - a child never returns into the zygote's loop
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


if __name__ == "__main__":
    sys.exit(_serve())
