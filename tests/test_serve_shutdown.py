"""`concordia serve` as a real subprocess against hostile clients and signals: every body in a corpus of hostile
requests gets a 4xx JSON error in the project's shape (never a 500); clients that go away leave no traceback;
SIGTERM with 32 keyed streams in flight exits 0 within 5 s, every stream either finished or told where to
resume, and after a restart on the same log every stream's tokens are exactly the request's, none repeated or
lost; a start that cannot bind its port fails at once and leaves no log directory; --help shows the defaults."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from serve_helpers import ServerProc, make_tiny_model_dir
from support import subprocess_env

pytest.importorskip("aiohttp")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("serve-model") / "tiny")


def _post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


DEEP = 100_000
C, X = "/v1/completions", "/v1/chat/completions"


def _corpus() -> list[tuple[str, bytes, dict[str, str], str | None]]:
    """(endpoint, raw body, headers, the error code expected (None: any 4xx))."""
    def j(**kw: Any) -> bytes:
        return json.dumps({"model": "tiny", **kw}).encode()

    def chat(content: Any, **kw: Any) -> bytes:
        return j(messages=[{"role": "user", "content": content}], **kw)

    rows: list[tuple[str, bytes, dict[str, str], str | None]] = [
        (C, b'{"model": "tiny", "prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", {}, "invalid_json"),
        (C, b'{"a": ' * DEEP + b"1" + b"}" * DEEP, {}, "invalid_json"),
        (X, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', {}, "invalid_value"),
        (X, b'{"model": "tiny", "messages": [{"role": "user", "content": "ok \\udfff then"}]}', {}, "invalid_value"),
        (X, b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
         {}, "invalid_value"),
        (C, b'{"model": "tiny", "prompt": "\\ud800"}', {}, "invalid_value"),
        (C, b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}', {}, "invalid_value"),
        (C, b'{"model": "tiny", "prompt": "hi", "user": "\\udc80"}', {}, "invalid_value"),
        (C, b'{"model": "tiny", "prompt": "\xff\xfe\xfd"}', {}, "invalid_json"),
        (C, b"", {}, "invalid_json"),
        (C, b"null", {}, "invalid_json"),
        (C, b'"a string"', {}, "invalid_json"),
        (C, b"12", {}, "invalid_json"),
        (C, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', {}, "invalid_json"),
        (C, b'{"model": "tiny", "prompt": "hi", "top_p": Infinity}', {}, "invalid_json"),
        (C, b'{"model": "tiny", "prompt": "hi", "temperature": 1e400}', {}, "invalid_value"),
        (C, b'{"model": "tiny", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", {}, "invalid_json"),
        (C, j(prompt="hi", max_tokens=10 ** 300), {}, "invalid_value"),
        (C, j(prompt="hi", max_tokens=-1), {}, "invalid_value"),
        (C, j(prompt="hi", max_tokens=4.0), {}, "invalid_type"),
        (C, j(prompt="hi", max_tokens=True), {}, "invalid_type"),
        (C, j(prompt="hi", n=0), {}, "invalid_value"),
        (C, j(prompt="hi", n=10 ** 30), {}, "invalid_value"),
        (C, j(prompt="hi", top_p=2), {}, "invalid_value"),
        (C, j(prompt="hi", top_k="a"), {}, "invalid_type"),
        (C, j(prompt="hi", seed="x"), {}, "invalid_type"),
        (C, j(prompt="hi", seed=1.5), {}, "invalid_type"),
        (C, j(prompt={"a": 1}), {}, "invalid_type"),
        (C, j(prompt=[True, False]), {}, "invalid_type"),
        (C, j(prompt=[1.5, 2]), {}, "invalid_type"),
        (C, j(prompt=[-1, 2]), {}, "invalid_value"),
        (C, j(prompt=[2 ** 70]), {}, "invalid_value"),
        (C, j(prompt=["a", "b"]), {}, "unsupported_parameter"),
        (C, j(prompt=""), {}, "missing_required_parameter"),
        (C, j(prompt=[]), {}, "missing_required_parameter"),
        (C, j(prompt="hi", stop=5), {}, "invalid_type"),
        (C, j(prompt="hi", stop=[1]), {}, "invalid_type"),
        (C, j(prompt="hi", stop=["a"] * 17), {}, "invalid_type"),
        (C, j(prompt="hi", logit_bias=[]), {}, "invalid_type"),
        (C, j(prompt="hi", logit_bias={"x": 1}), {}, "invalid_value"),
        (C, j(prompt="hi", logit_bias={"99999": 1}), {}, "invalid_value"),
        (C, j(prompt="hi", logit_bias={"5": "a"}), {}, "invalid_type"),
        (C, j(prompt="hi", logit_bias={"5": 1000}), {}, "invalid_value"),
        (C, j(prompt="hi", logprobs="yes"), {}, "invalid_type"),
        (C, j(prompt="hi", logprobs=21), {}, "invalid_value"),
        (C, j(prompt="hi", min_tokens=20, max_tokens=4), {}, "invalid_value"),
        (C, j(prompt="hi", repetition_penalty=0), {}, "invalid_value"),
        (C, j(prompt="hi", frequency_penalty=3), {}, "invalid_value"),
        (C, j(prompt="hi", presence_penalty="a"), {}, "invalid_type"),
        (C, j(prompt="hi", stream_options=[]), {}, "invalid_type"),
        (C, j(prompt="hi", stream_options={"include_usage": "yes"}), {}, "invalid_type"),
        (C, j(prompt="hi", stream_options={"bogus": 1}), {}, "unknown_parameter"),
        (C, j(prompt="hi", echo=True), {}, "unsupported_parameter"),
        (C, j(prompt="hi", user=5), {}, "invalid_type"),
        (C, j(messages=[{"role": "user", "content": "hi"}]), {}, "unknown_parameter"),
        (C, json.dumps({"model": 5, "prompt": "hi"}).encode(), {}, "missing_required_parameter"),
        (C, json.dumps({"model": None, "prompt": "hi"}).encode(), {}, "missing_required_parameter"),
        (C, json.dumps({"model": "x" * 100000, "prompt": "hi"}).encode(), {}, "model_not_found"),
        (X, j(messages="hi"), {}, "missing_required_parameter"),
        (X, j(messages=[1]), {}, "invalid_type"),
        (X, j(messages=[{"role": ["user"], "content": "hi"}]), {}, "invalid_value"),
        (X, j(messages=[{"role": {}, "content": "hi"}]), {}, "invalid_value"),
        (X, j(messages=[{"role": "tool", "content": "hi", "tool_call_id": "1"}]), {}, "unsupported_parameter"),
        (X, j(messages=[{"role": "assistant", "content": None, "tool_calls": []}]), {}, "unsupported_parameter"),
        (X, chat({"a": 1}), {}, "invalid_type"),
        (X, chat(None), {}, "invalid_type"),
        (X, chat([{"type": "image_url", "image_url": {"url": "x"}}]), {}, "invalid_value"),
        (X, chat([{"type": "text", "text": 5}]), {}, "invalid_type"),
        (X, chat(["text"]), {}, "invalid_value"),
        (X, chat("hi", logprobs=5), {}, "invalid_type"),
        (X, chat("hi", top_logprobs=3), {}, "invalid_value"),
        (X, chat("hi", logprobs=True, top_logprobs=21), {}, "invalid_value"),
        (X, chat("hi", tools=[{"type": "function", "function": {"name": "f"}}]), {}, "unsupported_parameter"),
        (X, chat("hi", response_format={"type": "json_object"}), {}, "unsupported_parameter"),
        (X, chat("hi", store=True), {}, "unsupported_parameter"),
        (X, chat("hi", service_tier="priority"), {}, "unsupported_parameter"),
        (X, chat("hi", metadata={"a": 1}), {}, "invalid_type"),
        (X, chat("hi", metadata=[1]), {}, "invalid_type"),
        (X, chat("hi", audio={"voice": "x"}), {}, "unsupported_parameter"),
        (X, chat("hi", reasoning_effort="high"), {}, "unsupported_parameter"),
        (X, chat("hi", prompt="x"), {}, "unknown_parameter"),
        (X, chat("hi", stream_options={"include_obfuscation": True}), {}, "unsupported_parameter"),
        (X, chat("x" * 200), {}, "context_length_exceeded"),
        (C, j(prompt="hi"), {"Idempotency-Key": "has space"}, "invalid_value"),
        (C, j(prompt="hi"), {"Idempotency-Key": "k" * 300}, "invalid_value"),
        (C, j(prompt="hi"), {"Last-Event-ID": "9" * 40}, "invalid_value"),
        (C, j(prompt="hi"), {"Last-Event-ID": "-1"}, "invalid_value"),
        (C, j(prompt="hi"), {"Last-Event-ID": "1,2"}, "invalid_value"),
        (C, j(prompt="hi", n=2), {"Last-Event-ID": "4"}, "invalid_value"),
        (C, j(prompt="hi"), {"Last-Event-ID": "2", "Idempotency-Key": "never-sent"}, "invalid_value"),
        (C, j(prompt="x" * (2 << 20)), {}, "request_too_large"),
    ]
    return rows


def test_hostile_body_corpus_gets_4xx_json_errors_and_no_tracebacks(model_dir: Path, tmp_path: Path) -> None:
    srv = ServerProc(model_dir, tmp_path / "log", "--served-model-name", "tiny", "--max-model-len", "128",
                     "--default-max-tokens", "4")
    try:
        statuses = []
        for path, body, headers, code in _corpus():
            status, raw = _post(srv.port, path, body, headers)
            statuses.append(status)
            err = json.loads(raw)["error"]
            assert 400 <= status < 500, (status, body[:80], err)
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            if code is not None:
                assert err["code"] == code, (body[:80], headers, err)
        assert 500 not in statuses and len(statuses) >= 90
        # a valid request still works, with a key; its resume past the end is refused, at the end is fine
        ok, raw = _post(srv.port, C, json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3,
                                                 "temperature": 0}).encode(), {"Idempotency-Key": "fine"})
        assert ok == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0,
                           "stream": True}).encode()
        ok, raw = _post(srv.port, C, body, {"Idempotency-Key": "s1"})
        assert ok == 200 and raw.rstrip().endswith(b"data: [DONE]")
        assert b"id: 3\n" in raw and b"id: 4\n" in raw  # three tokens, then the finish event
        status, raw = _post(srv.port, C, body, {"Idempotency-Key": "s1", "Last-Event-ID": "5"})
        assert status == 400 and json.loads(raw)["error"]["param"] == "Last-Event-ID"
        status, raw = _post(srv.port, C, body, {"Idempotency-Key": "s1", "Last-Event-ID": "4"})
        assert status == 200 and raw.strip().split(b"\n\n") == [b"data: [DONE]"]
        # clients that go away mid-stream (with and without a key): no traceback, the server goes on
        for key in ("gone", None):
            sock = socket.create_connection(("127.0.0.1", srv.port))
            req = json.dumps({"model": "tiny", "prompt": "bye", "max_tokens": 100, "stream": True,
                              "ignore_eos": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + (f"Idempotency-Key: {key}\r\n".encode() if key else b"")
                         + f"Content-Length: {len(req)}\r\n\r\n".encode() + req)
            got = b""
            while b"data:" not in got:
                more = sock.recv(4096)
                assert more, got
                got += more
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()  # RST
        time.sleep(1.0)
        ok, _ = _post(srv.port, C, json.dumps({"model": "tiny", "prompt": "after", "max_tokens": 2}).encode())
        assert ok == 200
    finally:
        assert srv.stop() == 0
    err = srv.stderr
    assert "Traceback" not in err and "Error handling request" not in err, err[-3000:]
    log = srv.events("request")
    assert len(log) >= len(_corpus()) and {e["status"] for e in log} >= {200, 400, 404, 413}
    gone = [e for e in log if e.get("error") == "client_gone"]
    assert len(gone) == 2, gone
    first = next(e for e in log if e["status"] == 200 and e.get("key"))
    assert first["completion_tokens"] == 3 and first["finish"] == "length" and first["prompt_tokens"] > 0


class Stream(threading.Thread):
    """One keyed streaming request over a raw HTTP connection: the token ids of every event it got, the last
    event id, and whether it ended with the finish or with the server's resume notice."""

    def __init__(self, port: int, i: int, max_tokens: int, start: int = 0,
                 tokens: list[int] | None = None) -> None:
        super().__init__(daemon=True)
        self.port, self.i, self.max_tokens, self.start_at = port, i, max_tokens, start
        self.tokens: list[int] = tokens if tokens is not None else []
        self.last_id, self.finished, self.resume_notice, self.error = start, False, None, None

    def run(self) -> None:
        body = json.dumps({"model": "tiny", "prompt": f"stream {self.i} says", "max_tokens": self.max_tokens,
                           "temperature": 0.7 if self.i % 2 else 0.0, "seed": self.i, "stream": True,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            c.request("POST", "/v1/completions", body=body, headers={
                "Content-Type": "application/json", "Idempotency-Key": f"drain-{self.i}",
                "Last-Event-ID": str(self.start_at)})
            r = c.getresponse()
            assert r.status == 200, r.read()
            ev: dict[str, str] = {}
            for raw in r:
                line = raw.decode().rstrip("\n")
                if line:
                    k, _, v = line.partition(": ")
                    ev[k] = v
                    continue
                if ev.get("data") == "[DONE]":
                    break
                d = json.loads(ev["data"])
                if "error" in d:
                    self.resume_notice = d["error"]
                else:
                    ch = d["choices"][0]
                    self.tokens.extend(ch.get("token_ids") or [])
                    self.finished |= ch["finish_reason"] is not None
                self.last_id = int(ev.get("id", self.last_id))
                ev = {}
        except Exception as e:  # noqa: BLE001 - kept for the assertion
            self.error = e
        finally:
            c.close()


# ~65 s of the fast run's 2 cores: slow; test_serve_client's SIGTERM notice is the fast run's drain check
@pytest.mark.slow
def test_sigterm_drains_32_streams_within_5_s_and_a_restart_resumes_them(model_dir: Path, tmp_path: Path) -> None:
    n, max_tokens = 32, 1200
    args = ("--served-model-name", "tiny", "--max-running", str(n), "--block-size", "16", "--num-blocks", "2600",
            "--max-model-len", "1280", "--batch-wait-ms", "20000")
    log = tmp_path / "log"
    srv = ServerProc(model_dir, log, *args)
    streams = [Stream(srv.port, i, max_tokens) for i in range(n)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and min(len(s.tokens) for s in streams) < 5:
        time.sleep(0.01)
    assert min(len(s.tokens) for s in streams) >= 5
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    rc = srv.proc.wait(timeout=30)
    took = time.monotonic() - t0
    for s in streams:
        s.join(timeout=30)
    assert rc == 0 and took <= 5.0, (rc, took, srv.stderr[-2000:])
    assert all(s.error is None for s in streams), [s.error for s in streams]
    assert all(s.finished or s.resume_notice for s in streams)
    cut = [s for s in streams if not s.finished]
    assert cut, "every stream finished within the grace: make them longer"
    assert all(s.resume_notice["code"] == "server_shutting_down" and f"Last-Event-ID: {s.last_id}"
               in s.resume_notice["message"] for s in cut)
    stopped = srv.events("stopped")
    assert stopped and "Traceback" not in srv.stderr
    print(f"SIGTERM with {n} streams in flight: exit 0 after {took:.2f} s ({stopped[0]}), {len(cut)} cut")

    srv = ServerProc(model_dir, log, *args)
    try:
        assert srv.ready["recovered"]
        resumed = [Stream(srv.port, s.i, max_tokens, s.last_id, s.tokens) for s in cut]
        for s in resumed:
            s.start()
        for s in resumed:
            s.join(timeout=300)
        assert all(s.finished and s.error is None for s in resumed), [(s.error, s.resume_notice) for s in resumed]
        for s in [*[x for x in streams if x.finished], *resumed]:
            status, raw = _get(srv.port, f"/v1/requests/{_rid(srv.port, s.i, max_tokens)}")
            assert len(s.tokens) == max_tokens and s.tokens == json.loads(raw)["token_ids"], s.i
    finally:
        srv.stop()


def _get(port: int, path: str) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def _rid(port: int, i: int, max_tokens: int) -> str:
    """The request id of stream i (a resend with its key and every event received: the last chunk only)."""
    body = json.dumps({"model": "tiny", "prompt": f"stream {i} says", "max_tokens": max_tokens,
                       "temperature": 0.7 if i % 2 else 0.0, "seed": i, "stream": True, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    status, raw = _post(port, C, body, {"Idempotency-Key": f"drain-{i}", "Last-Event-ID": str(max_tokens)})
    assert status == 200, raw
    return str(json.loads(raw.split(b"\n\n")[0].split(b"data: ", 1)[1])["id"])


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "concordia_ft.cli.main", "serve", *args], capture_output=True,
                          text=True, env=subprocess_env(), timeout=timeout)


def test_a_port_in_use_fails_at_once_and_leaves_no_log_dir(model_dir: Path, tmp_path: Path) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = _serve("--model", str(model_dir), "--log", str(tmp_path / "log"), "--port", str(port))
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith(f"concordia serve: error: cannot listen on 127.0.0.1:"
                                                            f"{port} (in use)")
        assert not (tmp_path / "log").exists() and time.monotonic() - t0 < 60
    finally:
        taken.close()
    help_text = " ".join(_serve("--help").stdout.split())
    for line in ("(default: 127.0.0.1)", "(default: 8000)", "(default: 512)", "(default: 3.0)", "(default: auto)"):
        assert line in help_text, line
    assert "(default: None)" not in help_text and "(default: False)" not in help_text
