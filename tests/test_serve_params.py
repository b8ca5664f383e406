"""The sampling parameters a client expects, through the real server and the official openai client: stop
strings (the streamed text, held back while it could still become one, equals the non-streamed answer, also
when the stream is resumed with Last-Event-ID), n choices (each equal to the single request with its seed),
logprobs in the chat and the completions shapes, the penalties changing the output."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from serve_helpers import ServerProc, make_tiny_model_dir

openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (dev extra)")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = make_tiny_model_dir(tmp_path_factory.mktemp("serve-model") / "tiny")
    srv = ServerProc(model, tmp_path_factory.mktemp("params") / "log", "--served-model-name", "tiny",
                     "--max-model-len", "256")
    yield srv
    assert srv.stop() == 0
    assert "Traceback" not in srv.stderr


def _sse(base: str, body: dict[str, Any], headers: dict[str, str], stop_after: int | None = None
         ) -> list[tuple[str | None, dict[str, Any] | str]]:
    """(id, data) of each event of a streamed request; ``stop_after``: hang up after that many events."""
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    out: list[tuple[str | None, dict[str, Any] | str]] = []
    with urllib.request.urlopen(req, timeout=60) as r:
        ev: dict[str, str] = {}
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line:
                k, _, v = line.partition(": ")
                ev[k] = v
                continue
            data = ev["data"]
            out.append((ev.get("id"), data if data == "[DONE]" else json.loads(data)))
            ev = {}
            if stop_after is not None and len(out) >= stop_after:
                break
    return out


def _text(events: list[tuple[str | None, Any]], index: int = 0) -> str:
    return "".join(d["choices"][0]["text"] for _, d in events
                   if isinstance(d, dict) and d.get("choices") and d["choices"][0]["index"] == index)


def test_stop_strings_streamed_resumed_and_whole(server: ServerProc) -> None:
    c = server.client(timeout=60)
    base = {"model": "tiny", "prompt": "The stop test:", "max_tokens": 40, "temperature": 0}
    plain = c.completions.create(**base).choices[0].text
    start = next(i for i in range(4, len(plain) - 3) if plain[i: i + 3].isprintable() and "\ufffd" not in
                 plain[i: i + 3] and plain.find(plain[i: i + 3]) == i)
    stop = plain[start: start + 3]
    whole = c.completions.create(**base, stop=[stop, "\x00never"])
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].text == plain[:start]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(**base, stop=stop, stream=True)
                       if ch.choices)
    assert streamed == plain[:start]
    # resumed mid-way: the pieces after the last event received complete the same text
    body = {**base, "stop": stop, "stream": True}
    first = _sse(server.base, body, {"Idempotency-Key": "stop-1"}, stop_after=3)
    rest = _sse(server.base, body, {"Idempotency-Key": "stop-1", "Last-Event-ID": str(first[-1][0])})
    assert _text(first) + _text(rest) == plain[:start] and rest[-1][1] == "[DONE]"
    assert [e for e, _ in rest[:-1]] == [str(int(first[-1][0] or 0) + 1 + i) for i in range(len(rest) - 1)]


def test_n_choices_equal_the_single_requests_with_their_seeds(server: ServerProc) -> None:
    c = server.client(timeout=60)
    base = {"model": "tiny", "prompt": "Choices:", "max_tokens": 12, "temperature": 0.9, "seed": 40}
    one = [c.completions.create(**{**base, "seed": 40 + i}).choices[0].text for i in range(3)]
    three = c.completions.create(**base, n=3)
    assert [ch.index for ch in three.choices] == [0, 1, 2] and [ch.text for ch in three.choices] == one
    assert len(set(one)) == 3 and three.usage.completion_tokens == 36
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                     max_tokens=8, temperature=0.8, seed=3)
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content
    events = _sse(server.base, {**base, "n": 3, "stream": True}, {"Idempotency-Key": "n3"})
    assert [_text(events, i) for i in range(3)] == one
    ids = [e for e, d in events if isinstance(d, dict)]
    assert ids[-1] == "13,13,13"  # 12 tokens and the finish, per choice
    cut = next(i for i, e in enumerate(ids) if e is not None and sum(map(int, e.split(","))) >= 10)
    rest = _sse(server.base, {**base, "n": 3, "stream": True}, {"Idempotency-Key": "n3", "Last-Event-ID": ids[cut]})
    for i in range(3):
        got = _text(events[: cut + 1], i) + _text(rest, i)
        assert got == one[i]


def test_logprobs_in_both_shapes(server: ServerProc) -> None:
    c = server.client(timeout=60)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "lp"}], max_tokens=6,
                                     temperature=0, logprobs=True, top_logprobs=3,
                                     extra_body={"return_token_ids": True})
    content = chat.choices[0].logprobs.content
    ids = chat.choices[0].model_extra["token_ids"]
    assert len(content) == 6 and all(len(e.top_logprobs) == 3 for e in content)
    for e in content:  # greedy: the chosen token is the most likely one
        assert e.logprob <= 0 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    streamed = [ch for ch in c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "lp"}],
                                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                                       stream=True) if ch.choices and ch.choices[0].logprobs]
    assert [ch.choices[0].logprobs.content[0].logprob for ch in streamed] == [e.logprob for e in content]
    comp = c.completions.create(model="tiny", prompt="lp", max_tokens=5, temperature=0.7, seed=1, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset == sorted(lp.text_offset)
    assert len(ids) == 6


def test_penalties_and_bias_change_the_output(server: ServerProc) -> None:
    c = server.client(timeout=60)
    base = {"model": "tiny", "prompt": "Repeat repeat repeat", "max_tokens": 64, "temperature": 0,
            "extra_body": {"return_token_ids": True}}
    plain = c.completions.create(**base).choices[0].model_extra["token_ids"]
    assert len(set(plain)) < len(plain)  # tokens repeat: the penalties have something to act on
    for kw in ({"frequency_penalty": 1.5}, {"presence_penalty": 2.0},
               {"logit_bias": {str(plain[0]): -100}},
               {"extra_body": {"return_token_ids": True, "repetition_penalty": 2.0}},
               {"extra_body": {"return_token_ids": True, "min_tokens": 64}}):
        got = c.completions.create(**{**base, **kw}).choices[0].model_extra["token_ids"]
        if "min_tokens" in kw.get("extra_body", {}):
            assert len(got) == 64
        else:
            assert got != plain, kw
    assert c.completions.create(**{**base, "logit_bias": {str(plain[0]): -100}}).choices[0].model_extra[
        "token_ids"][0] != plain[0]
    with pytest.raises(openai.BadRequestError, match="tool calling"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                  tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="unknown parameter 'frobnicate'"):
        c.completions.create(model="tiny", prompt="x", extra_body={"frobnicate": 1})
