"""concordia_ft.client: the official openai client through the resuming transport, against the real server in a
subprocess SIGKILLed by pid twice mid-stream and restarted on the same log and port. The caller's iterators
(two streams at once, chat and completions, greedy and seeded) yield every token exactly once, equal to an
uninterrupted run; a non-streamed request sent while the server is down gets its answer once it is back; a
SIGTERM's resume notice is followed as a dropped connection is."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from serve_helpers import ServerProc, make_tiny_model_dir

openai = pytest.importorskip("openai", reason="the client tests use the official openai client (dev extra)")

from concordia_ft.client import (  # noqa: E402
    ResumingTransport,
    async_resuming_http_client,
    resuming_http_client,
)

ARGS = ("--served-model-name", "tiny", "--max-model-len", "512", "--batch-wait-ms", "3000", "--max-running", "2")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("serve-model") / "tiny")


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


# with the settings whose state must survive too: penalties over the tokens so far, log-probabilities of the
# tokens already delivered, a stop string that is never met (matched at every token)
SPECS: list[dict[str, Any]] = [
    {"kind": "chat", "messages": [{"role": "user", "content": "Tell me a long story."}], "temperature": 0.0,
     "presence_penalty": 0.4, "logprobs": True, "top_logprobs": 2, "stop": ["\u0001never"]},
    {"kind": "completion", "prompt": "Once upon a time", "temperature": 0.8, "top_p": 0.95, "seed": 77,
     "frequency_penalty": 0.3, "logit_bias": {"101": 2.0}, "logprobs": 1},
]
MAX_TOKENS = 300


class Reader(threading.Thread):
    """Iterates one stream of the openai client, keeping each chunk's token ids and text as the caller sees them."""

    def __init__(self, client: Any, spec: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.client, self.spec = client, dict(spec)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.text, self.finish, self.error = "", None, None
        self.ends: list[int] = []  # len(text) after each token

    def run(self) -> None:
        spec = dict(self.spec)
        kind = spec.pop("kind")
        fn = self.client.chat.completions.create if kind == "chat" else self.client.completions.create
        try:
            for ch in fn(model="tiny", max_tokens=MAX_TOKENS, stream=True, **spec,
                         extra_body={"return_token_ids": True, "ignore_eos": True}):
                if not ch.choices:
                    continue
                c = ch.choices[0]
                self.tokens.extend((c.model_extra or {}).get("token_ids") or [])
                self.text += (c.delta.content or "") if kind == "chat" else c.text
                self.ends += [len(self.text)] * len((c.model_extra or {}).get("token_ids") or [])
                if c.logprobs is not None:
                    self.logprobs += [e.logprob for e in c.logprobs.content] if kind == "chat" else \
                        list(c.logprobs.token_logprobs)
                self.finish = c.finish_reason or self.finish
        except Exception as e:  # noqa: BLE001 - kept for the assertion
            self.error = e


def _read_all(base: str, specs: list[dict[str, Any]] = SPECS) -> list[Reader]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", http_client=resuming_http_client())
    readers = [Reader(client, s) for s in specs]
    for r in readers:
        r.start()
    return readers


def test_the_openai_client_resumes_through_two_sigkills(model_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    ref = ServerProc(model_dir, tmp_path / "ref", *ARGS, "--port", str(port))
    try:
        want = _read_all(ref.base)
        for r in want:
            r.join(timeout=300)
        assert all(r.error is None and r.finish == "length" and len(r.tokens) == MAX_TOKENS for r in want)
    finally:
        ref.stop()

    # the completion again with a stop string its uninterrupted text meets late (after both kills)
    text = want[1].text
    # (ASCII: random bytes decode to replacement characters, which the stream holds back and the full decode has)
    cut = next(p for p in range(want[1].ends[200], len(text) - 2) if text.find(text[p: p + 2]) == p
               and all("!" <= ch <= "~" for ch in text[p: p + 2]))
    stop = text[cut: cut + 2]
    specs = [SPECS[0], {**SPECS[1], "stop": [stop]}]
    log = tmp_path / "log"
    srv = ServerProc(model_dir, log, *ARGS, "--port", str(port))
    readers = _read_all(srv.base, specs)
    for at in (40, 150):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and min(len(r.tokens) for r in readers) < at:
            time.sleep(0.005)
        assert all(at <= len(r.tokens) < MAX_TOKENS for r in readers), [len(r.tokens) for r in readers]
        os.kill(srv.proc.pid, signal.SIGKILL)  # by pid, from outside
        assert srv.proc.wait(timeout=30) == -9
        time.sleep(0.5)  # the clients find the server gone and back off
        srv = ServerProc(model_dir, log, *ARGS, "--port", str(port))
        assert srv.ready["recovered"] and srv.ready["running"] == 2
    try:
        for r in readers:
            r.join(timeout=300)
        chat, comp = readers
        assert chat.error is None and comp.error is None, (chat.error, comp.error)
        assert chat.tokens == want[0].tokens and chat.text == want[0].text and chat.finish == "length"
        assert chat.logprobs == pytest.approx(want[0].logprobs, abs=1e-5) and len(chat.logprobs) == MAX_TOKENS
        # the stop string met after the kills: the text before it, the tokens up to the one that completed it
        assert comp.finish == "stop" and comp.text == text[:cut] and 200 < len(comp.tokens) < MAX_TOKENS
        assert comp.tokens == want[1].tokens[: len(comp.tokens)] and want[1].ends[len(comp.tokens) - 1] >= cut + 2
        assert comp.logprobs == pytest.approx(want[1].logprobs[: len(comp.tokens)], abs=1e-5)
    finally:
        srv.stop()


def test_a_request_sent_while_the_server_is_down_and_a_sigterm_notice(model_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "log"
    transport = ResumingTransport(retry_for_s=180)
    import httpx2

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           http_client=httpx2.Client(transport=transport, timeout=300))
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(r=client.completions.create(
        model="tiny", prompt="late", max_tokens=5, temperature=0, extra_headers={"Idempotency-Key": "late-1"})))
    t.start()  # nothing listens yet: the transport backs off until the server is up
    time.sleep(1.0)
    srv = ServerProc(model_dir, log, *ARGS, "--port", str(port), "--shutdown-grace-s", "0.5")
    try:
        t.join(timeout=120)
        assert got["r"].choices[0].finish_reason == "length" and got["r"].usage.completion_tokens == 5
        reader = Reader(client, {**SPECS[0]})
        reader.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(reader.tokens) < 20:
            time.sleep(0.005)
        before = transport.reconnects
        assert srv.stop() == 0  # SIGTERM: the stream is told to resume, the transport waits for the restart
        srv = ServerProc(model_dir, log, *ARGS, "--port", str(port))
        reader.join(timeout=300)
        assert reader.error is None and len(reader.tokens) == MAX_TOKENS and transport.reconnects > before
    finally:
        srv.stop()


@pytest.mark.slow  # one more server start and stream: the sync transport above is the fast run's
def test_the_asyncio_client_resumes_through_a_sigkill(model_dir: Path, tmp_path: Path) -> None:
    """The asyncio client through its transport, its server SIGKILLed mid-stream: the same tokens as the
    synchronous client's uninterrupted stream of the same request."""
    port = _free_port()
    log = tmp_path / "log"
    srv = ServerProc(model_dir, log, *ARGS, "--port", str(port))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               http_client=resuming_http_client(retry_for_s=180))
        reader = Reader(client, {**SPECS[0]})
        reader.start()
        reader.join(timeout=300)
        assert reader.error is None and len(reader.tokens) == MAX_TOKENS
        got_async: list[int] = []

        async def read() -> None:
            aclient = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                         http_client=async_resuming_http_client(retry_for_s=180))
            spec = dict(SPECS[0])
            spec.pop("kind")
            async for ch in await aclient.chat.completions.create(
                    model="tiny", max_tokens=MAX_TOKENS, stream=True, **spec,
                    extra_body={"return_token_ids": True, "ignore_eos": True}):
                if ch.choices:
                    got_async.extend((ch.choices[0].model_extra or {}).get("token_ids") or [])

        t = threading.Thread(target=lambda: asyncio.run(read()), daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(got_async) < 30:
            time.sleep(0.005)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(timeout=30)
        srv = ServerProc(model_dir, log, *ARGS, "--port", str(port))
        t.join(timeout=300)
        assert got_async == reader.tokens
    finally:
        srv.stop()


def test_the_readmes_client_snippet_runs_as_written(model_dir: Path, tmp_path: Path) -> None:
    import re
    import subprocess

    from support import PYTHON, REPO, subprocess_env

    blocks = re.findall(r"^```python\n(.*?)^```$", (REPO / "README.md").read_text(), flags=re.S | re.M)
    code = next(b for b in blocks if "resuming_http_client" in b)
    assert len(code.strip().splitlines()) <= 5, code
    srv = ServerProc(model_dir, tmp_path / "log", "--served-model-name", "SmolLM2-135M-Instruct",
                     "--default-max-tokens", "16")
    try:
        code = code.replace("http://127.0.0.1:8000", srv.base)  # the only change: this server's port
        p = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=300)
        assert p.returncode == 0 and p.stdout, p.stdout + p.stderr
        deadline = time.monotonic() + 10  # the request's log line, read from the server's stderr
        while time.monotonic() < deadline and not any(e["path"] == "/v1/chat/completions"
                                                      for e in srv.events("request")):
            time.sleep(0.05)
        reqs = [e for e in srv.events("request") if e["path"] == "/v1/chat/completions"]
        assert [(e["status"], e["completion_tokens"], e["key"]) for e in reqs] == [(200, 16, True)]
    finally:
        srv.stop()
