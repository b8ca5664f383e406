"""The OpenAI-compatible HTTP server (aiohttp) in front of one Engine.

Threads: aiohttp's event loop serves HTTP; ONE engine thread owns the Engine. Handlers never touch the engine:
they send commands (submit, attach, collect, abort) through an inbox that the engine thread drains between
steps, and wait on ``asyncio`` futures. After each committed step the engine thread publishes the step's tokens
to the per-request ``Stream`` objects on the event loop, so a client only ever receives committed tokens.

Reconnecting: a request sent with ``Idempotency-Key: K`` is bound to K (and to a digest of its body) in the
logged engine state. The same POST with the same K, after a restart or not, attaches to that request instead of
starting a new one; ``Last-Event-ID: n`` (the SSE standard header; ``n`` = tokens the client holds, the ``id:``
of the last event it got) resumes the stream at token ``n``, so no token is repeated or lost. A streaming client
without a key that disconnects aborts its request; with a key the request runs on, for the reconnect.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..errors import ConcordiaError, ConfigError, ServeError
from . import api
from .engine import Engine, Request, StepOutput


@dataclass
class Stream:
    """What the event loop knows of one request: its committed generated tokens and whether it finished."""

    rid: str
    kind: str
    model: str
    created: int
    n_prompt: int
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def wake(self) -> None:
        for w in self.waiters:
            if not w.done():
                w.set_result(None)
        self.waiters.clear()

    async def wait(self, timeout_s: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            pass


@dataclass
class ServerOptions:
    served_model_name: str = "concordia"
    # an idle engine waits this long for more arrivals before its first step; a recovered engine waits as long
    # for the clients of its in-flight keyed requests to reconnect before it runs on (their tokens then stream
    # live rather than pile up behind a reconnect)
    batch_wait_ms: int = 0
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    stream_idle_timeout_s: float = 600.0


class EngineThread:
    """Runs ``Engine.step()`` while there is work; applies inbox commands between steps."""

    def __init__(self, engine: Engine, opts: ServerOptions, publish: Callable[[StepOutput], None],
                 stream_for: Callable[[Request], Stream]) -> None:
        self.engine, self.opts, self.publish, self.stream_for = engine, opts, publish, stream_for
        self.inbox: queue.Queue[tuple[str, Any, Future[Any]]] = queue.Queue()
        self.error: BaseException | None = None
        self.metrics: dict[str, float] = {"steps": 0, "epochs": 0, "epoch_bytes": 0, "tokens": 0, "finished": 0,
                                          "forward_s": 0.0, "checkpoint_s": 0.0}
        self._stop = threading.Event()
        self._attached: set[str] = set()  # requests a client reattached to (same Idempotency-Key)
        self.thread = threading.Thread(target=self._loop, name="concordia-engine", daemon=True)

    def call(self, op: str, arg: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        if self.error is not None:
            fut.set_exception(ServeError(f"the engine stopped: {self.error}"))
        else:
            self.inbox.put((op, arg, fut))
        return fut

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("noop", None, Future()))
        self.thread.join(timeout=30)

    def _drain(self, block_s: float | None) -> None:
        try:
            item = self.inbox.get(timeout=block_s) if block_s else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, op: str, arg: Any, fut: Future[Any]) -> None:
        try:
            fut.set_result(getattr(self, "_op_" + op)(arg))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting handler
            fut.set_exception(e)

    def _op_noop(self, arg: Any) -> None:
        return None

    def _op_submit(self, arg: tuple[api.ParsedRequest, str | None]) -> Stream:
        p, key = arg
        eng = self.engine
        if key is not None:
            old = eng.get_by_key(key)
            if old is not None:
                if old.digest != p.digest:
                    raise api.ApiError(422, f"Idempotency-Key {key!r} was used with a different request body; "
                                       "use a new key for a new request", "idempotency_key_reused")
                self._attached.add(old.id)
                return self.stream_for(old)
        info = {"kind": p.kind, "model": p.model, "created": api.now(), "token_ids": p.return_token_ids}
        return self.stream_for(eng.submit(p.prompt_ids, p.params, key=key, digest=p.digest, info=info))

    def _op_get(self, rid: str) -> Stream | None:
        r = self.engine.get(rid)
        return None if r is None else self.stream_for(r)

    def _op_collect(self, rid: str) -> None:
        self.engine.collect(rid)

    def _op_abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def _await_reconnects(self) -> None:
        """A recovered engine: until every in-flight request with an Idempotency-Key was reattached to, at most
        ``batch_wait_ms`` (commands are applied meanwhile)."""
        eng = self.engine
        if eng.recovered_epoch is None or self.opts.batch_wait_ms <= 0:
            return
        want = {r.id for r in eng.running.values() if r.key is not None}
        deadline = time.monotonic() + self.opts.batch_wait_ms / 1000
        while want - self._attached and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._drain(min(left, 0.5))
            want &= set(eng.running)  # (an abort ends the wait for its request)

    def _loop(self) -> None:
        eng = self.engine
        try:
            self._await_reconnects()
            while not self._stop.is_set():
                if not eng.has_work:
                    self._drain(0.5)
                    if eng.has_work and not eng.running and self.opts.batch_wait_ms > 0:
                        self._gather()
                    continue
                self._drain(None)
                out = eng.step()
                self._count(out)
                self.publish(out)
        except BaseException as e:  # noqa: BLE001 - reported through /health and every later call
            self.error = e
            self.publish(StepOutput(-1, None, {}, []))

    def _gather(self) -> None:
        deadline = time.monotonic() + self.opts.batch_wait_ms / 1000
        while len(self.engine.waiting) < self.engine.opts.max_running and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._drain(left)

    def _count(self, out: StepOutput) -> None:
        m = self.metrics
        m["steps"] += out.steps  # engine steps whose outputs left (pipelined: several may leave together)
        m["epochs"] += out.epoch is not None
        m["epoch_bytes"] += out.epoch_bytes
        m["tokens"] += sum(len(t) for t in out.new_tokens.values())
        m["finished"] += len(out.finished)
        m["forward_s"] += out.forward_s
        m["checkpoint_s"] += out.checkpoint_s


class Server:
    def __init__(self, engine: Engine, tokenizer: Any, opts: ServerOptions) -> None:
        self.engine, self.tok, self.opts = engine, tokenizer, opts
        self.streams: dict[str, Stream] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        cfg = engine.model.config
        self.vocab = int(getattr(cfg.get_text_config(decoder=True), "vocab_size", 0) or cfg.vocab_size)
        self.eos = _eos_ids(engine.model, tokenizer)
        self.started = time.time()
        for r in [*engine.running.values(), *engine.finished.values(), *engine.waiting]:
            self._stream_for(r)
        self.worker = EngineThread(engine, opts, self._publish_threadsafe, self._stream_for)

    # -- engine -> loop ----------------------------------------------------------------------------------
    def _stream_for(self, r: Request) -> Stream:
        """Engine thread (or before it starts): the stream of ``r``, created from the engine's state."""
        s = self.streams.get(r.id)
        if s is None:
            toks, reason = self.engine.delivered(r)  # committed tokens only
            s = self.streams[r.id] = Stream(r.id, r.info.get("kind", "completion"), r.info.get("model", ""),
                                            int(r.info.get("created", api.now())), r.n_prompt, toks, reason)
        return s

    def _publish_threadsafe(self, out: StepOutput) -> None:
        """On the engine thread, after the step's epoch committed: hand its tokens to the event loop as
        ``(rid, index of the first new token, tokens, finish reason)``, applied idempotently there."""
        eng, updates = self.engine, []
        for rid, toks in out.new_tokens.items():  # the output's own indices: with async epochs the engine
            if eng.get(rid) is not None:  # is a step ahead of it
                updates.append((rid, out.starts[rid], list(toks), out.reasons.get(rid)))
        self._trim_streams()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._publish, updates)

    def _publish(self, updates: list[tuple[str, int, list[int], str | None]]) -> None:
        for rid, start, toks, reason in updates:
            s = self.streams.get(rid)
            if s is None:
                continue
            if len(s.tokens) == start:
                s.tokens.extend(toks)
            if reason is not None and len(s.tokens) >= start + len(toks):
                s.finish = reason
            s.wake()
        if self.worker.error is not None:
            for s in list(self.streams.values()):
                s.wake()

    def _trim_streams(self) -> None:
        """Engine thread: drop streams of requests the engine no longer holds (it is the only writer)."""
        eng = self.engine
        gone = [rid for rid in list(self.streams) if eng.get(rid) is None]
        for rid in gone:
            self.streams.pop(rid, None)

    # -- app ---------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.opts.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/requests/{rid}", self.fetch)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.loop = asyncio.get_running_loop()
        self.worker.start()

    async def _on_shutdown(self, app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except api.ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPRequestEntityTooLarge as e:
            return _err(413, f"the request body is over {self.opts.max_body_bytes} bytes ({e.text})",
                        "request_too_large")
        except web.HTTPException as e:
            if e.status >= 400:
                return _err(e.status, f"{e.reason}: {request.method} {request.path}",
                            "not_found" if e.status == 404 else None)
            raise
        except ServeError as e:
            return _err(e.status, str(e), e.code)
        except ConfigError as e:
            return _err(400, str(e), "invalid_value")
        except ConcordiaError as e:
            return _err(500, str(e), "engine_error", type_="server_error")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.opts.served_model_name, "object": "model", "created": int(self.started),
             "owned_by": "concordia-ft", "max_model_len": self.engine.opts.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        if self.worker.error is not None:
            return _err(503, f"the engine stopped: {self.worker.error}", "engine_dead", type_="server_error")
        return web.json_response({"status": "ok", "recovered_epoch": self.engine.recovered_epoch})

    async def metrics(self, request: web.Request) -> web.Response:
        m, eng = dict(self.worker.metrics), self.engine
        lines = []

        def metric(name: str, kind: str, help_: str, value: float) -> None:
            lines.extend([f"# HELP concordia_{name} {help_}", f"# TYPE concordia_{name} {kind}",
                          f"concordia_{name} {value}"])

        metric("requests_running", "gauge", "Requests in the batch.", len(eng.running))
        metric("requests_waiting", "gauge", "Requests queued for admission.", len(eng.waiting))
        metric("kv_blocks_free", "gauge", "Free KV blocks.", eng.blocks.n_free)
        metric("kv_blocks_total", "gauge", "KV blocks in the pool.", eng.geo.num_blocks)
        metric("engine_steps_total", "counter", "Engine steps run.", m["steps"])
        metric("epochs_total", "counter", "Epochs committed to the log.", m["epochs"])
        metric("epoch_bytes_total", "counter", "Bytes appended to the log by epochs.", m["epoch_bytes"])
        metric("generation_tokens_total", "counter", "Tokens generated.", m["tokens"])
        metric("requests_finished_total", "counter", "Requests finished.", m["finished"])
        metric("forward_seconds_total", "counter", "Seconds in model forwards and sampling.", m["forward_s"])
        metric("checkpoint_seconds_total", "counter", "Seconds committing epochs.", m["checkpoint_s"])
        metric("recovered", "gauge", "1 if this process recovered its state from the log.",
               int(eng.recovered_epoch is not None))
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def fetch(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        s = await asyncio.wrap_future(self.worker.call("get", rid))
        if s is None:
            raise api.ApiError(404, f"no request {rid!r} on this server (finished outputs are kept for the last "
                               f"{self.engine.opts.keep_finished})", "request_not_found")
        text = self.tok.decode(s.tokens, skip_special_tokens=True) if self.tok is not None else ""
        return web.json_response({"id": rid, "status": "finished" if s.finish else "running", "finish_reason": s.finish, "text": text,
                                  "token_ids": s.tokens, "usage": api.usage(s.n_prompt, len(s.tokens))})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        if self.worker.error is not None:
            raise api.ApiError(503, f"the engine stopped: {self.worker.error}", "engine_dead", type_="server_error")
        raw = await request.read()
        p = api.parse(kind, raw, served=self.opts.served_model_name, tokenizer=self.tok, vocab_size=self.vocab,
                      eos=self.eos, default_max_tokens=self.opts.default_max_tokens)
        key = request.headers.get("Idempotency-Key") or None
        start = _last_event_id(request.headers.get("Last-Event-ID"))
        s = await asyncio.wrap_future(self.worker.call("submit", (p, key)))
        if p.stream:
            return await self._stream(request, s, p, start, abort_on_disconnect=key is None)
        while s.finish is None:
            self._check_alive()
            await s.wait(self.opts.stream_idle_timeout_s)
        text = self.tok.decode(s.tokens, skip_special_tokens=True) if self.tok is not None else ""
        self.worker.call("collect", s.rid)
        return web.json_response(api.full_response(kind, s.rid, s.created, p.model, text, s.tokens, s.finish,
                                                   s.n_prompt, p.return_token_ids))

    def _check_alive(self) -> None:
        if self.worker.error is not None:
            raise api.ApiError(503, f"the engine stopped: {self.worker.error}", "engine_dead", type_="server_error")

    async def _stream(self, request: web.Request, s: Stream, p: api.ParsedRequest, start: int, *,
                      abort_on_disconnect: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": s.rid})
        await resp.prepare(request)
        n = min(start, len(s.tokens))
        try:
            while True:
                while n < len(s.tokens):
                    tok = s.tokens[n]
                    text = api.token_text(self.tok, s.tokens, n)
                    c = api.chunk(p.kind, s.rid, s.created, p.model, text=text, n=n, tok=tok, finish=None,
                                  token_ids=p.return_token_ids)
                    n += 1
                    await resp.write(f"id: {n}\ndata: {json.dumps(c)}\n\n".encode())
                if s.finish is not None:
                    break
                if self.worker.error is not None:
                    err = api.ApiError(503, f"the engine stopped: {self.worker.error}", "engine_dead",
                                       type_="server_error")
                    await resp.write(f"data: {json.dumps(err.body())}\n\n".encode())
                    return resp
                await s.wait(self.opts.stream_idle_timeout_s)
            last = api.chunk(p.kind, s.rid, s.created, p.model, text=None if p.kind == "chat" else "", n=n,
                             tok=None, finish=s.finish, token_ids=False)
            await resp.write(f"data: {json.dumps(last)}\n\n".encode())
            if p.include_usage:
                u = {"id": s.rid, "object": last["object"], "created": s.created, "model": p.model, "choices": [],
                     "usage": api.usage(s.n_prompt, len(s.tokens))}
                await resp.write(f"data: {json.dumps(u)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.worker.call("collect", s.rid)
        except (ConnectionResetError, asyncio.CancelledError):
            if abort_on_disconnect and s.finish is None:
                self.worker.call("abort", s.rid)
            raise
        return resp


def _err(status: int, message: str, code: str | None, type_: str = "invalid_request_error") -> web.Response:
    return web.json_response(api.ApiError(status, message, code, type_=type_).body(), status=status)


def _last_event_id(v: str | None) -> int:
    if v is None or v == "":
        return 0
    try:
        n = int(v)
    except ValueError:
        raise api.ApiError(400, f"Last-Event-ID must be the number of tokens already received, got {v!r}",
                           "invalid_value", "Last-Event-ID") from None
    if n < 0:
        raise api.ApiError(400, f"Last-Event-ID={n} must be >= 0", "invalid_value", "Last-Event-ID")
    return n


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
