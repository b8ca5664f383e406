"""A client of `concordia serve` that resumes by itself: an HTTP transport for the official ``openai`` client.

    import openai
    from concordia_ft.client import resuming_http_client

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none",
                           http_client=resuming_http_client())

Every POST to a completions endpoint gets an ``Idempotency-Key`` (the caller's, or a fresh one). A streamed
answer is read event by event, remembering the ``id`` of the last one; when the connection drops (the server
was killed, restarted, or told its streams to resume while shutting down), the transport sends the same
request again with the same key and ``Last-Event-ID`` until the server answers, backing off while it
restarts, and goes on from the next event. The caller's iterator sees one stream: every token once, in order.
A non-streamed request is sent again with its key until it gets an answer (the server attaches to the request
it already runs, or returns its finished output). It gives up after ``retry_for_s`` without progress.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

try:  # the HTTP library the installed openai client is built on
    import httpx2 as httpx
except ImportError:  # pragma: no cover - openai releases built on httpx
    import httpx  # type: ignore[no-redef]

from .errors import ServeError

RESUMABLE = ("server_shutting_down", "engine_dead")  # error events after which the server may come back
RETRY_STATUS = (502, 503, 504)


class ResumeError(ServeError):
    """The server would not let the stream continue (it answered a resend with an error, or never came back
    within ``retry_for_s``); what the caller got so far is all it will get of this request."""

    status = 502
    code = "resume_failed"


class ResumingTransport(httpx.BaseTransport):
    """Wraps a transport (default ``httpx.HTTPTransport()``); only POSTs to ``.../completions`` are handled."""

    def __init__(self, transport: Any = None, *, retry_for_s: float = 120.0, backoff_s: float = 0.05,
                 max_backoff_s: float = 1.0) -> None:
        self.inner = transport if transport is not None else httpx.HTTPTransport()
        self.retry_for_s, self.backoff_s, self.max_backoff_s = retry_for_s, backoff_s, max_backoff_s
        self.reconnects = 0  # resends after a lost connection (all requests)

    def handle_request(self, request: Any) -> Any:
        if request.method != "POST" or not request.url.path.endswith("/completions"):
            return self.inner.handle_request(request)
        body = request.read()
        headers = dict(request.headers)
        if not any(k.lower() == "idempotency-key" for k in headers):
            headers["Idempotency-Key"] = f"cft-{uuid.uuid4().hex}"
        try:
            stream = bool(json.loads(body).get("stream"))
        except (ValueError, AttributeError):
            stream = False  # not ours to judge: the server answers it
        if not stream:
            return self._send(request, headers, body, None, read=True)
        first = self._send(request, headers, body, None)
        if first.status_code != 200:
            return first
        return httpx.Response(200, headers=first.headers, request=request,
                              stream=_ResumingStream(self, request, headers, body, first),
                              extensions=first.extensions)

    def _send(self, request: Any, headers: dict[str, str], body: bytes, last_id: str | None, *,
              read: bool = False) -> Any:
        """The request sent until the server answers with something other than a connection error or a 5xx
        that says it is restarting (``read``: and the whole body came); backoff between tries."""
        h = dict(headers)
        if last_id is not None:
            h["Last-Event-ID"] = last_id
        wait, deadline = self.backoff_s, time.monotonic() + self.retry_for_s
        while True:
            try:
                r = self.inner.handle_request(httpx.Request(request.method, request.url, headers=h, content=body,
                                                            extensions=request.extensions))
                if r.status_code not in RETRY_STATUS:
                    if read:
                        r.read()
                    return r
                r.read()
                r.close()
            except httpx.TransportError:
                if time.monotonic() >= deadline:
                    raise
            if time.monotonic() >= deadline:
                raise ResumeError(f"the server at {request.url} did not come back within {self.retry_for_s} s")
            time.sleep(wait)
            wait = min(wait * 2, self.max_backoff_s)

    def close(self) -> None:
        self.inner.close()


class _Events:
    """Server-sent events cut out of the bytes of a response, the ``id`` of the last one remembered."""

    def __init__(self) -> None:
        self.buf = b""
        self.last_id: str | None = None

    def feed(self, piece: bytes) -> Iterator[tuple[bytes, str]]:
        """``(event bytes, "event" | "done" | "resume")`` for each whole event in what came so far."""
        self.buf += piece
        while b"\n\n" in self.buf:
            raw, self.buf = self.buf.split(b"\n\n", 1)
            fields: dict[bytes, bytes] = {}
            for line in raw.split(b"\n"):
                name, _, value = line.partition(b": ")
                fields[name] = value
            data = fields.get(b"data", b"")
            if data.startswith(b"{") and b'"error"' in data[:12]:
                try:
                    code = json.loads(data)["error"].get("code")
                except (ValueError, KeyError, AttributeError):
                    code = None
                if code in RESUMABLE:
                    yield b"", "resume"
                    return
            if b"id" in fields:
                self.last_id = fields[b"id"].decode()
            yield raw + b"\n\n", "done" if data == b"[DONE]" else "event"


class _ResumingStream(httpx.SyncByteStream):
    def __init__(self, transport: ResumingTransport, request: Any, headers: dict[str, str], body: bytes,
                 first: Any) -> None:
        self.t, self.request, self.headers, self.body, self.resp = transport, request, headers, body, first
        self.last_id: str | None = None

    def __iter__(self) -> Iterator[bytes]:
        while True:
            done = yield from self._events()
            if done:
                return
            self.t.reconnects += 1
            self.resp = self.t._send(self.request, self.headers, self.body, self.last_id or "0")
            if self.resp.status_code != 200:
                self.resp.read()
                raise ResumeError(f"resuming the stream after event {self.last_id} was refused: "
                                  f"{self.resp.status_code} {self.resp.text[:300]}")

    def _events(self) -> Generator[bytes, None, bool]:
        """The current response's whole events; True once the stream is complete, False when it was cut."""
        events = _Events()
        try:
            for piece in self.resp.iter_raw():
                for raw, state in events.feed(piece):
                    if state == "resume":
                        return False  # the server told us to come back
                    yield raw
                    if state == "done":
                        return True
        except httpx.TransportError:
            pass
        finally:
            self.last_id = events.last_id or self.last_id
            self.resp.close()
        return False

    def close(self) -> None:
        self.resp.close()


def resuming_http_client(*, timeout: float = 600.0, retry_for_s: float = 120.0, **kw: Any) -> Any:
    """An ``httpx`` client for ``openai.OpenAI(http_client=...)`` whose completions survive a server restart."""
    return httpx.Client(transport=ResumingTransport(retry_for_s=retry_for_s), timeout=timeout, **kw)


class AsyncResumingTransport(httpx.AsyncBaseTransport):
    """``ResumingTransport`` for ``openai.AsyncOpenAI`` (wraps ``httpx.AsyncHTTPTransport()`` by default)."""

    def __init__(self, transport: Any = None, *, retry_for_s: float = 120.0, backoff_s: float = 0.05,
                 max_backoff_s: float = 1.0) -> None:
        self.inner = transport if transport is not None else httpx.AsyncHTTPTransport()
        self.retry_for_s, self.backoff_s, self.max_backoff_s = retry_for_s, backoff_s, max_backoff_s
        self.reconnects = 0

    async def handle_async_request(self, request: Any) -> Any:
        if request.method != "POST" or not request.url.path.endswith("/completions"):
            return await self.inner.handle_async_request(request)
        body = await request.aread()
        headers = dict(request.headers)
        if not any(k.lower() == "idempotency-key" for k in headers):
            headers["Idempotency-Key"] = f"cft-{uuid.uuid4().hex}"
        try:
            stream = bool(json.loads(body).get("stream"))
        except (ValueError, AttributeError):
            stream = False
        if not stream:
            return await self._send(request, headers, body, None, read=True)
        first = await self._send(request, headers, body, None)
        if first.status_code != 200:
            return first
        return httpx.Response(200, headers=first.headers, request=request,
                              stream=_AsyncResumingStream(self, request, headers, body, first),
                              extensions=first.extensions)

    async def _send(self, request: Any, headers: dict[str, str], body: bytes, last_id: str | None, *,
                    read: bool = False) -> Any:
        import asyncio

        h = dict(headers)
        if last_id is not None:
            h["Last-Event-ID"] = last_id
        wait, deadline = self.backoff_s, time.monotonic() + self.retry_for_s
        while True:
            try:
                r = await self.inner.handle_async_request(httpx.Request(
                    request.method, request.url, headers=h, content=body, extensions=request.extensions))
                if r.status_code not in RETRY_STATUS:
                    if read:
                        await r.aread()
                    return r
                await r.aread()
                await r.aclose()
            except httpx.TransportError:
                if time.monotonic() >= deadline:
                    raise
            if time.monotonic() >= deadline:
                raise ResumeError(f"the server at {request.url} did not come back within {self.retry_for_s} s")
            await asyncio.sleep(wait)
            wait = min(wait * 2, self.max_backoff_s)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _AsyncResumingStream(httpx.AsyncByteStream):
    def __init__(self, transport: AsyncResumingTransport, request: Any, headers: dict[str, str], body: bytes,
                 first: Any) -> None:
        self.t, self.request, self.headers, self.body, self.resp = transport, request, headers, body, first
        self.last_id: str | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            events, done = _Events(), False
            try:
                async for piece in self.resp.aiter_raw():
                    for raw, state in events.feed(piece):
                        if state == "resume":
                            break
                        yield raw
                        if state == "done":
                            done = True
                            break
                    else:
                        continue
                    break
            except httpx.TransportError:
                pass
            finally:
                self.last_id = events.last_id or self.last_id
                await self.resp.aclose()
            if done:
                return
            self.t.reconnects += 1
            self.resp = await self.t._send(self.request, self.headers, self.body, self.last_id or "0")
            if self.resp.status_code != 200:
                await self.resp.aread()
                raise ResumeError(f"resuming the stream after event {self.last_id} was refused: "
                                  f"{self.resp.status_code} {self.resp.text[:300]}")

    async def aclose(self) -> None:
        await self.resp.aclose()


def async_resuming_http_client(*, timeout: float = 600.0, retry_for_s: float = 120.0, **kw: Any) -> Any:
    """``resuming_http_client`` for ``openai.AsyncOpenAI(http_client=...)``."""
    return httpx.AsyncClient(transport=AsyncResumingTransport(retry_for_s=retry_for_s), timeout=timeout, **kw)
