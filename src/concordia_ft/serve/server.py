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
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..errors import ConcordiaError, ConfigError, QueueFullError, ServeError
from . import api
from .engine import Engine, Request, StepOutput
from .sampling import TokenLogprobs


@dataclass
class Stream:
    """What the event loop knows of one request (one choice): its committed generated tokens (and their
    log-probabilities when asked for) and whether it finished."""

    rid: str
    kind: str
    model: str
    created: int
    n_prompt: int
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop: tuple[str, ...] = ()
    view: api.TextView | None = None  # built on the loop when first needed

    def wake(self) -> None:
        for w in self.waiters:
            if not w.done():
                w.set_result(None)
        self.waiters.clear()

    @property
    def events(self) -> int:
        """Events a client of this choice can have had: one per token, one for the finish."""
        return len(self.tokens) + (self.finish is not None)


async def _wait_any(streams: list[Stream], timeout_s: float) -> None:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    for s in streams:
        s.waiters.append(fut)
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
    # one JSON line per request (None: none); the CLI writes them to stderr
    request_log: Callable[[dict[str, Any]], None] | None = None


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
        elif self._stop.is_set():
            fut.set_exception(ShuttingDown())
        else:
            self.inbox.put((op, arg, fut))
        return fut

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """The engine stops after the step it is in (its epoch committed and its tokens published); commands
        not applied yet are answered with ``ShuttingDown``."""
        self._stop.set()
        self.inbox.put(("noop", None, Future()))
        self.thread.join(timeout=30)
        while True:
            try:
                _, _, fut = self.inbox.get_nowait()
            except queue.Empty:
                return
            if not fut.done():
                fut.set_exception(ShuttingDown())

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

    def _op_submit(self, arg: tuple[api.ParsedRequest, str | None, list[int]]) -> list[Stream]:
        """The request's ``n`` choices as engine requests (choice i > 0 under the key ``"K i"``), or the ones a
        same-key request made before; ``start`` (from Last-Event-ID) checked against what they delivered."""
        p, key, start = arg
        eng = self.engine
        if key is not None:
            old = eng.get_by_key(key)
            if old is not None:
                if old.digest != p.digest:
                    raise api.ApiError(422, f"Idempotency-Key {key!r} was used with a different request body; "
                                       "use a new key for a new request", "idempotency_key_reused")
                reqs = [old] + [eng.get_by_key(f"{key} {i}") for i in range(1, p.n)]
                if any(r is None for r in reqs):
                    raise api.ApiError(404, f"part of the output of Idempotency-Key {key!r} was evicted (the "
                                       f"server keeps the last {eng.opts.keep_finished} finished outputs)",
                                       "request_not_found")
                for i, (r, k) in enumerate(zip(reqs, start, strict=True)):
                    assert r is not None
                    toks, reason = eng.delivered(r)
                    have = len(toks) + (reason is not None)
                    if k > have:
                        raise api.ApiError(400, f"Last-Event-ID is past the end: choice {i} of this request has "
                                           f"delivered {have} events, the header says {k}", "invalid_value",
                                           "Last-Event-ID")
                self._attached.update(r.id for r in reqs if r is not None)
                return [self.stream_for(r) for r in reqs if r is not None]
        if any(start):
            raise api.ApiError(400, "Last-Event-ID names events of a request this server does not have (a new "
                               "request starts at 0; resend with the Idempotency-Key it was sent with)",
                               "invalid_value", "Last-Event-ID")
        if len(eng.waiting) + p.n > eng.opts.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({eng.opts.max_waiting} requests); retry later")
        made: list[Request] = []
        try:
            for i in range(p.n):
                info = {"kind": p.kind, "model": p.model, "created": api.now(), "token_ids": p.return_token_ids,
                        "choice": i, **p.info}
                made.append(eng.submit(p.prompt_ids, p.choice_params(i), digest=p.choice_digest(i), info=info,
                                       key=None if key is None else key if i == 0 else f"{key} {i}"))
        except BaseException:
            for r in made:
                eng.abort(r.id)
            raise
        return [self.stream_for(r) for r in made]

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


class ShuttingDown(ServeError):
    status = 503
    code = "server_shutting_down"

    def __init__(self, message: str = "the server is shutting down; retry in a moment (a request sent with an "
                 "Idempotency-Key resumes where it was, on this log)") -> None:
        super().__init__(message)


RESUME_HINT = ("the server is shutting down before this request finished; send it again with the same "
               "Idempotency-Key and Last-Event-ID: {ids} to receive the rest once it is back")


class Server:
    def __init__(self, engine: Engine, tokenizer: Any, opts: ServerOptions) -> None:
        self.engine, self.tok, self.opts = engine, tokenizer, opts
        self.streams: dict[str, Stream] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        cfg = engine.model.config
        self.vocab = int(getattr(cfg.get_text_config(decoder=True), "vocab_size", 0) or cfg.vocab_size)
        self.eos = _eos_ids(engine.model, tokenizer)
        self.started = time.time()
        self.draining = False  # SIGTERM: no new requests; those in flight have the grace to finish
        self.closing = False  # the grace is over: streams still open are told to resume, then end
        self._inflight = 0  # generation handlers running
        self._idle: asyncio.Event | None = None
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
                                            int(r.info.get("created", api.now())), r.n_prompt, toks, reason,
                                            logprobs=list(r.logprobs[: len(toks)]), stop=r.params.stop)
        return s

    def _publish_threadsafe(self, out: StepOutput) -> None:
        """On the engine thread, after the step's epoch committed: hand its tokens to the event loop as
        ``(rid, index of the first new token, tokens, finish reason, log-probabilities)``, applied idempotently
        there."""
        eng, updates = self.engine, []
        for rid, toks in out.new_tokens.items():  # the output's own indices: with async epochs the engine
            r = eng.get(rid)  # is a step ahead of it
            if r is not None:
                lo = out.starts[rid]
                lps = r.logprobs[lo: lo + len(toks)] if r.params.logprobs is not None else []
                updates.append((rid, lo, list(toks), out.reasons.get(rid), lps))
        self._trim_streams()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._publish, updates)

    def _publish(self, updates: list[tuple[str, int, list[int], str | None, list[TokenLogprobs]]]) -> None:
        for rid, start, toks, reason, lps in updates:
            s = self.streams.get(rid)
            if s is None:
                continue
            if len(s.tokens) == start:
                s.tokens.extend(toks)
                s.logprobs.extend(lps)
            if reason is not None and len(s.tokens) >= start + len(toks):
                s.finish = reason
            s.wake()
        if self.worker.error is not None:
            self._wake_all()

    def _wake_all(self) -> None:
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
        self._idle = asyncio.Event()
        self._idle.set()
        self.worker.start()

    async def _on_shutdown(self, app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)

    async def drain(self, grace_s: float, hurry: asyncio.Event | None = None) -> dict[str, Any]:
        """Graceful shutdown: refuse new requests (503, Retry-After), give the requests in flight up to
        ``grace_s`` to finish (``hurry`` set: no longer), stop the engine after the step it is in, then tell
        every stream still open where to resume (its ids so far) and end it. Every token a client received is
        in the log; a restart on it continues the rest."""
        t0 = time.monotonic()
        self.draining = True
        assert self._idle is not None
        waits = [asyncio.ensure_future(self._idle.wait())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        await asyncio.wait(waits, timeout=max(grace_s, 0.0), return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        cut = self._inflight
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        self.closing = True
        self._wake_all()
        for _ in range(200):  # the handlers write their last event and return (ms)
            if self._idle.is_set():
                break
            await asyncio.sleep(0.01)
        return {"drained_s": round(time.monotonic() - t0, 3), "cut": cut}

    def _enter(self) -> None:
        self._inflight += 1
        if self._idle is not None:
            self._idle.clear()

    def _leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        t0 = time.monotonic()
        request["log"] = log = {}
        resp: web.StreamResponse
        try:
            resp = await handler(request)
        except api.ApiError as e:
            resp = web.json_response(e.body(), status=e.status)
        except web.HTTPRequestEntityTooLarge as e:
            resp = _err(413, f"the request body is over {self.opts.max_body_bytes} bytes ({e.text})",
                        "request_too_large")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            resp = _err(e.status, f"{e.reason}: {request.method} {request.path}",
                        "not_found" if e.status == 404 else None)
        except ShuttingDown as e:
            resp = _err(e.status, str(e), e.code, type_="server_error")
            resp.headers["Retry-After"] = "1"
        except ServeError as e:
            resp = _err(e.status, str(e), e.code)
        except ConfigError as e:
            resp = _err(400, str(e), "invalid_value")
        except ConcordiaError as e:
            resp = _err(500, str(e), "engine_error", type_="server_error")
        except (ConnectionResetError, asyncio.CancelledError):
            log["error"] = "client_gone"
            self._log_request(request, 499, t0)
            raise
        except Exception as e:  # noqa: BLE001 - a bug: still the project's error shape, and said in the log
            traceback.print_exc(file=sys.stderr)
            resp = _err(500, f"internal error ({type(e).__name__}: {e}); this is a bug in concordia, please report "
                        "it", "internal_error", type_="server_error")
        if resp.status >= 400 and isinstance(resp, web.Response) and resp.body is not None:
            try:
                log["error"] = json.loads(bytes(resp.body))["error"]["code"]  # type: ignore[arg-type]
            except (ValueError, KeyError, TypeError):
                pass
        self._log_request(request, resp.status, t0)
        return resp

    def _log_request(self, request: web.Request, status: int, t0: float) -> None:
        if self.opts.request_log is None or (status < 400 and request.path in ("/health", "/metrics")):
            return
        line = {"ev": "request", "method": request.method, "path": request.path, "status": status,
                "s": round(time.monotonic() - t0, 4), **request.get("log", {})}
        try:
            self.opts.request_log(line)
        except Exception:  # noqa: BLE001 - a log line must never fail a request
            pass

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.opts.served_model_name, "object": "model", "created": int(self.started),
             "owned_by": "concordia-ft", "max_model_len": self.engine.opts.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        if self.worker.error is not None:
            return _err(503, f"the engine stopped: {self.worker.error}", "engine_dead", type_="server_error")
        if self.draining:
            return _err(503, "the server is shutting down", "server_shutting_down", type_="server_error")
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
        v = self._view(s)
        text = v.text[: v.safe(len(s.tokens), s.finish)]
        return web.json_response({"id": rid, "status": "finished" if s.finish else "running",
                                  "finish_reason": s.finish, "text": text, "token_ids": s.tokens,
                                  "usage": api.usage(s.n_prompt, len(s.tokens))})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    def _view(self, s: Stream) -> api.TextView:
        if s.view is None:
            s.view = api.TextView(self.tok, s.stop)
        s.view.extend(s.tokens)
        return s.view

    def _check_alive(self) -> None:
        if self.worker.error is not None:
            raise api.ApiError(503, f"the engine stopped: {self.worker.error}", "engine_dead", type_="server_error")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        self._check_alive()
        if self.draining:
            raise ShuttingDown()
        log = request["log"]
        raw = await request.read()
        p = api.parse(kind, raw, served=self.opts.served_model_name, tokenizer=self.tok, vocab_size=self.vocab,
                      eos=self.eos, default_max_tokens=self.opts.default_max_tokens)
        key = _idempotency_key(request.headers.get("Idempotency-Key"))
        start = _last_event_ids(request.headers.get("Last-Event-ID"), p.n)
        log.update(stream=p.stream, n=p.n, key=key is not None, **({"resume_at": start} if any(start) else {}),
                   **p.info)
        self._enter()
        try:
            streams = await asyncio.wrap_future(self.worker.call("submit", (p, key, start)))
            s0 = streams[0]
            log.update(id=s0.rid, prompt_tokens=s0.n_prompt)
            if p.stream:
                resp = await self._stream(request, streams, p, start, key)
            else:
                resp = await self._complete(streams, p, key)
            log.update(completion_tokens=sum(len(s.tokens) for s in streams),
                       finish=[s.finish for s in streams] if p.n > 1 else s0.finish)
            return resp
        finally:
            self._leave()

    async def _complete(self, streams: list[Stream], p: api.ParsedRequest, key: str | None) -> web.Response:
        while any(s.finish is None for s in streams):
            self._check_alive()
            if self.closing:
                if key is None:
                    raise ShuttingDown("the server shut down before this request finished (a request sent with an "
                                       "Idempotency-Key can be sent again to get its result once it is back)")
                raise ShuttingDown()
            await _wait_any(streams, self.opts.stream_idle_timeout_s)
        choices = []
        for i, s in enumerate(streams):
            v = self._view(s)
            lp = api.logprobs_block(p.kind, self.tok, s.tokens, s.logprobs, v.ends[:-1]) \
                if p.params.logprobs is not None else None
            choices.append(api.full_choice(p.kind, i, v.text[: v.safe(len(s.tokens), s.finish)], s.tokens,
                                           s.finish or "", p.return_token_ids, lp))
        for s in streams:
            self.worker.call("collect", s.rid)
        s0 = streams[0]
        return web.json_response(api.full_response(p.kind, s0.rid, s0.created, p.model, choices, s0.n_prompt,
                                                   sum(len(s.tokens) for s in streams)))

    async def _stream(self, request: web.Request, streams: list[Stream], p: api.ParsedRequest, start: list[int],
                      key: str | None) -> web.StreamResponse:
        """Server-sent events. Each event of choice i (one per token, one for its finish) advances its count;
        an event's ``id`` is the counts so far (``"k"``, or ``"k0,k1,..."`` for n > 1), which a client sends back
        as Last-Event-ID to resume after the last event it got."""
        s0 = streams[0]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": s0.rid})
        counts = list(start)

        def ids() -> str:
            return ",".join(str(c) for c in counts)

        def event(obj: dict[str, Any]) -> bytes:
            return f"id: {ids()}\ndata: {json.dumps(obj)}\n\n".encode()

        lp_on = p.params.logprobs is not None
        try:
            await resp.prepare(request)
            while True:
                for i, s in enumerate(streams):
                    out = []
                    v = self._view(s) if counts[i] < s.events else None
                    while v is not None and counts[i] < len(s.tokens):
                        k = counts[i]
                        last = k + 1 == len(s.tokens)
                        text = v.text[v.safe(k): v.safe(k + 1, s.finish if last else None)]
                        lp = api.logprobs_block(p.kind, self.tok, [s.tokens[k]], [s.logprobs[k]], [v.ends[k]]) \
                            if lp_on else None
                        c = api.chunk(p.kind, s0.rid, s0.created, p.model, index=i, text=text, first=k == 0,
                                      tok=s.tokens[k], finish=None, token_ids=p.return_token_ids, logprobs=lp)
                        counts[i] += 1
                        out.append(event(c))
                    if s.finish is not None and counts[i] == len(s.tokens):
                        counts[i] += 1
                        out.append(event(api.chunk(p.kind, s0.rid, s0.created, p.model, index=i,
                                                   text=None if p.kind == "chat" else "", first=False, tok=None,
                                                   finish=s.finish, token_ids=False)))
                    if out:
                        await resp.write(b"".join(out))
                if all(s.finish is not None and counts[i] == s.events for i, s in enumerate(streams)):
                    break
                if self.worker.error is not None or self.closing:
                    err = api.ApiError(503, f"the engine stopped: {self.worker.error}", "engine_dead",
                                       type_="server_error") if self.worker.error is not None else \
                        api.ApiError(503, RESUME_HINT.format(ids=ids()) if key is not None else
                                     "the server shut down before this request finished (send an Idempotency-Key "
                                     "to be able to resume a stream)", "server_shutting_down", type_="server_error")
                    await resp.write(event(err.body()))
                    request["log"]["error"] = err.code
                    return resp
                await _wait_any(streams, self.opts.stream_idle_timeout_s)
            if p.include_usage:
                u: dict[str, Any] = {"id": s0.rid, "object": "chat.completion.chunk" if p.kind == "chat" else "text_completion",
                     "created": s0.created, "model": p.model, "choices": [],
                     "usage": api.usage(s0.n_prompt, sum(len(s.tokens) for s in streams))}
                await resp.write(f"data: {json.dumps(u)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            for s in streams:
                self.worker.call("collect", s.rid)
        except ConnectionResetError:  # the client went away: not an error of ours, no traceback
            request["log"]["error"] = "client_gone"
            self._client_gone(streams, key)
        except asyncio.CancelledError:
            self._client_gone(streams, key)
            raise
        return resp

    def _client_gone(self, streams: list[Stream], key: str | None) -> None:
        """Without an Idempotency-Key nobody can come back for the rest: the request is aborted."""
        if key is None:
            for s in streams:
                if s.finish is None:
                    self.worker.call("abort", s.rid)


def _err(status: int, message: str, code: str | None, type_: str = "invalid_request_error") -> web.Response:
    return web.json_response(api.ApiError(status, message, code, type_=type_).body(), status=status)


def _idempotency_key(v: str | None) -> str | None:
    if v is None or v == "":
        return None
    if len(v) > 255 or not all("!" <= ch <= "~" for ch in v):
        raise api.ApiError(400, "Idempotency-Key must be 1 to 255 visible ASCII characters (no spaces)",
                           "invalid_value", "Idempotency-Key")
    return v


def _last_event_ids(v: str | None, n: int) -> list[int]:
    """Last-Event-ID: the ``id`` of the last event a client got: events per choice, ``"k"`` or ``"k0,k1,..."``."""
    if v is None or v.strip() == "":
        return [0] * n
    parts = v.split(",")
    try:
        counts = [int(x) for x in parts if len(x.strip()) <= 12]
    except ValueError:
        counts = []
    if len(counts) != len(parts) or any(c < 0 for c in counts):
        raise api.ApiError(400, f"Last-Event-ID must be the id of the last event received (events so far: a "
                           f"number, or n numbers separated by commas), got {v[:40]!r}", "invalid_value",
                           "Last-Event-ID")
    if len(counts) != n:
        raise api.ApiError(400, f"Last-Event-ID has {len(counts)} counts; this request has n={n} choices",
                           "invalid_value", "Last-Event-ID")
    return counts


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
