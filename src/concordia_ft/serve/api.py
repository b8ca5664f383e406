"""OpenAI request parsing and response shapes (pure: no server, no engine). Every bad input raises
``ApiError`` with the HTTP status and OpenAI error code the server answers with."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from .sampling import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    digest: str  # what an Idempotency-Key is bound to: the request body, canonical


UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "tools", "tool_choice",
               "response_format", "functions", "function_call")


def _num(body: dict[str, Any], name: str, kind: type, default: Any, lo: float | None = None,
         hi: float | None = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise ApiError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {v!r}",
                       "invalid_type", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(400, f"'{name}'={v} is out of range [{lo}, {hi}]", "invalid_value", name)
    return kind(v)


def _ids(v: Any) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return [int(t) for t in v]
    return None


def parse(kind: str, raw: bytes, *, served: str, tokenizer: Any, vocab_size: int, eos: tuple[int, ...],
          default_max_tokens: int) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required (a string)", "missing_required_parameter", "model")
    if model != served:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served}'",
                       "model_not_found", "model", "invalid_request_error")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False):
            raise ApiError(400, f"'{name}' is not supported by this server", "unsupported_parameter", name)
    if body.get("stop") not in (None, [], ""):
        raise ApiError(400, "'stop' sequences are not supported by this server", "unsupported_parameter", "stop")
    if _num(body, "n", int, 1, 1, 1) != 1:
        raise ApiError(400, "only n=1 is supported", "unsupported_parameter", "n")
    prompt = _chat_ids(body, tokenizer) if kind == "chat" else _completion_ids(body, tokenizer)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "invalid_value",
                       "prompt")
    max_key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be a boolean, got {stream!r}", "invalid_type", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "invalid_type", "stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"'seed' must be an integer, got {seed!r}", "invalid_type", "seed")
    params = SamplingParams(
        max_new_tokens=_num(body, max_key, int, default_max_tokens, 1, 1 << 20),
        temperature=_num(body, "temperature", float, 1.0, 0.0, 2.0),
        top_k=_num(body, "top_k", int, 0, 0, vocab_size), top_p=_num(body, "top_p", float, 1.0, 1e-9, 1.0),
        seed=None if seed is None else int(seed) & ((1 << 63) - 1), eos_token_ids=eos,
        ignore_eos=bool(body.get("ignore_eos", False)))
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
    return ParsedRequest(kind, model, prompt, params, stream, bool(opts.get("include_usage")),
                         bool(body.get("return_token_ids", False)), digest)


def _completion_ids(body: dict[str, Any], tokenizer: Any) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    ids = _ids(p)
    if ids is not None:
        return ids
    if isinstance(p, str) and p:
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send 'prompt' as a list of token ids",
                           "invalid_value", "prompt")
        return list(tokenizer(p, add_special_tokens=True)["input_ids"])
    if isinstance(p, list) and len(p) > 1:
        raise ApiError(400, "batched prompts are not supported: send one prompt per request",
                       "unsupported_parameter", "prompt")
    raise ApiError(400, "'prompt' is required: a non-empty string or a list of token ids",
                   "missing_required_parameter", "prompt")


def _chat_ids(body: dict[str, Any], tokenizer: Any) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' is required: a non-empty list of {role, content}",
                       "missing_required_parameter", "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"messages[{i}] needs a 'role' of system, user, assistant or developer",
                           "invalid_value", f"messages[{i}].role")
        c = m.get("content")
        if isinstance(c, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in c):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "invalid_value",
                               f"messages[{i}].content")
            c = "".join(part["text"] for part in c)
        if not isinstance(c, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "invalid_type", f"messages[{i}].content")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", "unsupported_model")
    text = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# -------------------------------------------------------------------------------------------- responses
HOLD_WINDOW = 6  # tokens of context when turning one token into text


def token_text(tokenizer: Any, ids: list[int], n: int) -> str:
    """The text token ``n`` of ``ids`` adds: a pure function of ``ids[:n + 1]`` (so a resumed stream yields the
    same pieces); an incomplete UTF-8 character is held back until the token that completes it."""
    if tokenizer is None:
        return ""
    lo = max(0, n - HOLD_WINDOW)
    before = tokenizer.decode(ids[lo:n], skip_special_tokens=True).rstrip("\ufffd")
    after = tokenizer.decode(ids[lo: n + 1], skip_special_tokens=True).rstrip("\ufffd")
    return after[len(before):] if after.startswith(before) else after[len(before):] if len(after) > len(before) else ""


def chunk(kind: str, rid: str, created: int, model: str, *, text: str | None, n: int, tok: int | None,
          finish: str | None, token_ids: bool) -> dict[str, Any]:
    if kind == "chat":
        delta: dict[str, Any] = {}
        if n == 0 and tok is not None:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    if token_ids and tok is not None:
        choice["token_ids"] = [tok]
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage(n_prompt: int, n_gen: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def full_response(kind: str, rid: str, created: int, model: str, text: str, generated: list[int], reason: str,
                  n_prompt: int, token_ids: bool) -> dict[str, Any]:
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    if token_ids:
        choice["token_ids"] = list(generated)
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(n_prompt, len(generated))}


def now() -> int:
    return int(time.time())
