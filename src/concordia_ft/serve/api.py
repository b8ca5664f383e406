"""OpenAI request parsing and response shapes (pure: no server, no engine). Every bad input raises
``ApiError`` with the HTTP status and OpenAI error code the server answers with; every parameter of OpenAI's
chat-completions and completions references is either honoured or refused with a 400 that names it
(``PARAMETERS``; serve/DESIGN.md has the table), and a parameter no reference has is refused too."""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_N = 16  # choices per request
MAX_STOP = 16  # stop strings per request
MAX_LOGIT_BIAS = 1024


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str
    prompt_ids: list[int]
    params: SamplingParams  # choice 0's; choice i's is ``choice_params(i)``
    stream: bool
    include_usage: bool
    return_token_ids: bool
    digest: str  # what an Idempotency-Key is bound to: the request body, canonical
    n: int = 1
    info: dict[str, Any] = field(default_factory=dict)  # labels the request log shows (user, metadata)

    def choice_params(self, i: int) -> SamplingParams:
        """Choice ``i`` of ``n``: the same settings, its own stream of draws (seed + i when seeded)."""
        if i == 0 or self.params.seed is None:
            return self.params
        return replace(self.params, seed=(self.params.seed + i) & ((1 << 63) - 1))

    def choice_digest(self, i: int) -> str:
        return self.digest if i == 0 else f"{self.digest}/{i}"


# ------------------------------------------------------------------------------------------- the parameters
def _null_or(*ok: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == o and type(v) is type(o) for o in ok)


# parameter -> (where, what this server does). "honoured": parsed and applied below; a refusal rule accepts
# the values that change nothing (a default) and refuses the rest with a 400 naming the parameter
BOTH, CHAT, COMPLETION = ("chat", "completion"), ("chat",), ("completion",)
HONOURED: dict[str, tuple[tuple[str, ...], str]] = {
    "model": (BOTH, "must be the served model's name"),
    "messages": (CHAT, "roles system, developer (as system), user, assistant; text content (a string or text parts); "
                       "`name` is given to the chat template"),
    "prompt": (COMPLETION, "a string, a list of token ids, or a batch of one of either"),
    "max_tokens": (BOTH, "generated tokens at most"),
    "max_completion_tokens": (CHAT, "as max_tokens (wins over it)"),
    "temperature": (BOTH, "0 to 2; 0 is greedy"),
    "top_p": (BOTH, "0 to 1 (generate()'s top-p)"),
    "n": (BOTH, f"1 to {MAX_N}: n requests sharing the prompt, choice i seeded with seed + i"),
    "stream": (BOTH, "server-sent events; every event has an id for Last-Event-ID"),
    "stream_options": (BOTH, "include_usage; include_obfuscation false only"),
    "stop": (BOTH, f"a string or up to {MAX_STOP}: the output ends before the first one (held back while a "
                   "stream's text could still become one)"),
    "seed": (BOTH, "per-request generator (logged: a resumed stream draws the same)"),
    "frequency_penalty": (BOTH, "-2 to 2, over the generated tokens"),
    "presence_penalty": (BOTH, "-2 to 2, over the generated tokens"),
    "logit_bias": (BOTH, "token id -> -100 to 100, added to the logits"),
    "logprobs": (BOTH, "chat: true/false; completions: 0 to 20 most likely tokens (the model's log-softmax)"),
    "top_logprobs": (CHAT, f"0 to {MAX_TOP_LOGPROBS}, with logprobs true"),
    "user": (BOTH, "a label: shown in the request log"),
    "safety_identifier": (CHAT, "a label: shown in the request log"),
    "metadata": (CHAT, "labels (string -> string): shown in the request log"),
    "prompt_cache_key": (CHAT, "accepted: the prefix cache is addressed by content, a key changes nothing"),
    "store": (CHAT, "false only (nothing is stored beyond the log's finished outputs)"),
    "service_tier": (CHAT, "auto or default only"),
    "modalities": (CHAT, '["text"] only'),
    "response_format": (CHAT, '{"type": "text"} only'),
    "tool_choice": (CHAT, '"none" only'),
    "parallel_tool_calls": (CHAT, "accepted without tools (it changes nothing then)"),
    "best_of": (COMPLETION, "equal to n only"),
    "echo": (COMPLETION, "false only"),
    # extensions (vLLM's names)
    "top_k": (BOTH, "extension: 0 or -1 off"),
    "min_tokens": (BOTH, "extension: no end token and no stop string before this many tokens"),
    "repetition_penalty": (BOTH, "extension: generate()'s (over the prompt and the generated tokens)"),
    "ignore_eos": (BOTH, "extension: run to max_tokens"),
    "return_token_ids": (BOTH, "extension: each choice's token ids"),
}
REFUSED: dict[str, tuple[tuple[str, ...], str]] = {
    "tools": (CHAT, "tool calling is not supported by this server"),
    "functions": (CHAT, "function calling is not supported by this server"),
    "function_call": (CHAT, "function calling is not supported by this server"),
    "audio": (CHAT, "audio output is not supported by this server"),
    "prediction": (CHAT, "predicted outputs are not supported by this server"),
    "reasoning_effort": (CHAT, "this server runs no reasoning models"),
    "verbosity": (CHAT, "this server runs no reasoning models"),
    "web_search_options": (CHAT, "web search is not supported by this server"),
    "prompt_cache_retention": (CHAT, "the prefix cache keeps blocks while the pool has room; no retention policy"),
    "suffix": (COMPLETION, "insertion (suffix) is not supported by this server"),
}
# accepted values of the parameters that are refused unless they change nothing
_ONLY: dict[str, Callable[[Any], bool]] = {
    "store": _null_or(False),
    "service_tier": _null_or("auto", "default"),
    "modalities": lambda v: v is None or v == ["text"],
    "response_format": lambda v: v is None or v == {"type": "text"},
    "tool_choice": _null_or("none"),
    "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "echo": _null_or(False),
    "tools": lambda v: v is None or v == [],
    "functions": lambda v: v is None or v == [],
}
PARAMETERS = {**HONOURED, **REFUSED}


def _reject_constant(name: str) -> Any:
    raise ApiError(400, f"the request body is not valid JSON: {name} is not a JSON number", "invalid_json")


def load_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply to be a request", "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:  # (a number of more than 4300 digits is a ValueError too)
        raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    return body


def text_value(v: Any, name: str, *, allow_empty: bool = True, max_chars: int | None = None) -> str:
    """A string parameter, valid Unicode (JSON's \\ud800 escapes decode to lone surrogates no encoder takes)."""
    if not isinstance(v, str):
        raise ApiError(400, f"'{name}' must be a string, got {type(v).__name__}", "invalid_type", name)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"'{name}' is not valid Unicode: a lone surrogate ({v[e.start]!a}) at character "
                       f"{e.start}; send UTF-8 text", "invalid_value", name) from None
    if not allow_empty and not v:
        raise ApiError(400, f"'{name}' must not be empty", "invalid_value", name)
    if max_chars is not None and len(v) > max_chars:
        raise ApiError(400, f"'{name}' is over {max_chars} characters", "invalid_value", name)
    return v


def _num(body: dict[str, Any], name: str, kind: type, default: Any, lo: float | None = None,
         hi: float | None = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise ApiError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got "
                       f"{_short(v)}", "invalid_type", name)
    if isinstance(v, float) and not math.isfinite(v):
        raise ApiError(400, f"'{name}' must be finite", "invalid_value", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(400, f"'{name}'={_short(v)} is out of range [{lo}, {hi}]", "invalid_value", name)
    return kind(v)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {_short(v)}", "invalid_type", name)
    return v


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _ids(v: Any) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return [int(t) for t in v]
    return None


def parse(kind: str, raw: bytes, *, served: str, tokenizer: Any, vocab_size: int, eos: tuple[int, ...],
          default_max_tokens: int) -> ParsedRequest:
    body = load_body(raw)
    for name in body:
        where = PARAMETERS.get(name)
        if where is None or kind not in where[0]:
            other = "" if where is None else f" (it is a {'/'.join(where[0])} parameter)"
            raise ApiError(400, f"unknown parameter '{_short(name)[1:-1]}' for /v1/"
                           f"{'chat/completions' if kind == 'chat' else 'completions'}{other}",
                           "unknown_parameter", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required (a string)", "missing_required_parameter", "model")
    if model != served:
        raise ApiError(404, f"The model '{_short(model)[1:-1]}' does not exist; this server serves '{served}'",
                       "model_not_found", "model", "invalid_request_error")
    for name, v in body.items():
        ok = _ONLY.get(name)
        if name in REFUSED and (ok is None or not ok(v)) and v is not None:
            raise ApiError(400, f"'{name}': {REFUSED[name][1]}", "unsupported_parameter", name)
        if ok is not None and not ok(v):
            raise ApiError(400, f"'{name}'={_short(v)} is not supported: {HONOURED[name][1]}",
                           "unsupported_parameter", name)
    n = _num(body, "n", int, 1, 1, MAX_N)
    if kind == "completion" and body.get("best_of") is not None and _num(body, "best_of", int, n) != n:
        raise ApiError(400, "'best_of' other than n is not supported (it would pick among more choices than it "
                       "returns)", "unsupported_parameter", "best_of")
    prompt = _chat_ids(body, tokenizer) if kind == "chat" else _completion_ids(body, tokenizer)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"token id {_short(bad[0])} is outside the vocabulary [0, {vocab_size})",
                       "invalid_value", "prompt")
    max_key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "invalid_type", "stream_options")
    opts = opts or {}
    for k in opts:
        if k not in ("include_usage", "include_obfuscation"):
            raise ApiError(400, f"unknown stream option '{_short(k)[1:-1]}'", "unknown_parameter",
                           f"stream_options.{k}" if isinstance(k, str) else "stream_options")
    include_usage = _bool(opts, "include_usage")
    if _bool(opts, "include_obfuscation"):
        raise ApiError(400, "'stream_options.include_obfuscation' is not supported (false only)",
                       "unsupported_parameter", "stream_options.include_obfuscation")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"'seed' must be an integer, got {_short(seed)}", "invalid_type", "seed")
    max_new = _num(body, max_key, int, default_max_tokens, 1, 1 << 20)
    top_k = _num(body, "top_k", int, 0, -1, vocab_size)
    params = SamplingParams(
        max_new_tokens=max_new,
        temperature=_num(body, "temperature", float, 1.0, 0.0, 2.0),
        top_k=max(top_k, 0), top_p=_num(body, "top_p", float, 1.0, 0.0, 1.0),
        seed=None if seed is None else int(seed) & ((1 << 63) - 1), eos_token_ids=eos,
        ignore_eos=_bool(body, "ignore_eos"), stop=_stop(body.get("stop")),
        min_tokens=_num(body, "min_tokens", int, 0, 0, max_new),
        repetition_penalty=_num(body, "repetition_penalty", float, 1.0, 1e-6, 100.0),
        frequency_penalty=_num(body, "frequency_penalty", float, 0.0, -2.0, 2.0),
        presence_penalty=_num(body, "presence_penalty", float, 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body.get("logit_bias"), vocab_size), logprobs=_logprobs(kind, body))
    if params.stop and tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: 'stop' strings cannot be matched", "unsupported_parameter",
                       "stop")
    info: dict[str, Any] = {}
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None:
            info[name] = text_value(body[name], name, max_chars=512)
    if body.get("metadata") is not None:
        info["metadata"] = _metadata(body["metadata"])
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
    return ParsedRequest(kind, model, prompt, params, stream, include_usage, _bool(body, "return_token_ids"),
                         digest, n, info)


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP} strings", "invalid_type",
                       "stop")
    return tuple(dict.fromkeys(text_value(s, "stop", max_chars=256) for s in items if s != ""))


def _logit_bias(v: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    if v is None:
        return ()
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids -> bias",
                       "invalid_type", "logit_bias")
    out = {}
    for k, b in v.items():
        try:
            t = int(k)
        except ValueError:
            t = -1
        if not 0 <= t < vocab or str(t) != k.strip():
            raise ApiError(400, f"'logit_bias' key {_short(k)} is not a token id in [0, {vocab})", "invalid_value",
                           "logit_bias")
        out[t] = _num({"logit_bias": b}, "logit_bias", float, 0.0, -100.0, 100.0)
    return tuple(sorted((t, b) for t, b in out.items() if b != 0.0))


def _logprobs(kind: str, body: dict[str, Any]) -> int | None:
    if kind == "chat":
        top = _num(body, "top_logprobs", int, None, 0, MAX_TOP_LOGPROBS)
        if not _bool(body, "logprobs"):
            if top is not None:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "invalid_value", "top_logprobs")
            return None
        return int(top or 0)
    k: int | None = _num(body, "logprobs", int, None, 0, MAX_TOP_LOGPROBS)
    return k


def _metadata(v: Any) -> dict[str, str]:
    if not isinstance(v, dict) or len(v) > 16:
        raise ApiError(400, "'metadata' must be an object of at most 16 string values", "invalid_type", "metadata")
    return {text_value(k, "metadata", max_chars=64): text_value(x, "metadata", max_chars=512) for k, x in v.items()}


def _tokenize(fn: Callable[[], list[int]], param: str) -> list[int]:
    try:
        return fn()
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - the input was checked; what the tokenizer or template refuses is the client's
        raise ApiError(400, f"the {param} could not be tokenized: {type(e).__name__}: {str(e)[:200]}",
                       "invalid_value", param) from None


def _completion_ids(body: dict[str, Any], tokenizer: Any) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    ids = _ids(p)
    if ids is not None:
        return ids
    if isinstance(p, str) and p:
        text = text_value(p, "prompt")
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send 'prompt' as a list of token ids",
                           "invalid_value", "prompt")
        return _tokenize(lambda: list(tokenizer(text, add_special_tokens=True)["input_ids"]), "prompt")
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise ApiError(400, "batched prompts are not supported: send one prompt per request",
                       "unsupported_parameter", "prompt")
    if p is None or p == "" or p == []:
        raise ApiError(400, "'prompt' is required: a non-empty string or a list of token ids",
                       "missing_required_parameter", "prompt")
    raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids", "invalid_type", "prompt")


MESSAGE_KEYS = {"role", "content", "name"}
ROLES = ("system", "user", "assistant", "developer")


def _chat_ids(body: dict[str, Any], tokenizer: Any) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' is required: a non-empty list of {role, content}",
                       "missing_required_parameter", "messages")
    clean = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with 'role' and 'content'", "invalid_type", where)
        role = m.get("role")
        if role in ("tool", "function"):
            raise ApiError(400, f"{where}: role '{role}': tool calling is not supported by this server",
                           "unsupported_parameter", f"{where}.role")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(400, f"{where} needs a 'role' of system, user, assistant or developer",
                           "invalid_value", f"{where}.role")
        for k in m:
            if k not in MESSAGE_KEYS:
                raise ApiError(400, f"{where}.{_short(k)[1:-1]} is not supported by this server (messages take "
                               "role, content and name)", "unsupported_parameter", f"{where}.{k}")
        c = m.get("content")
        if isinstance(c, list):
            texts = []
            for j, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") != "text":
                    what = part.get("type") if isinstance(part, dict) else None
                    raise ApiError(400, f"{where}.content[{j}]: only text parts are supported"
                                   + (f" (got '{_short(what)[1:-1]}')" if isinstance(what, str) else ""),
                                   "invalid_value", f"{where}.content")
                texts.append(text_value(part.get("text"), f"{where}.content[{j}].text"))
            c = "".join(texts)
        if not isinstance(c, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", "invalid_type",
                           f"{where}.content")
        msg = {"role": "system" if role == "developer" else role, "content": text_value(c, f"{where}.content")}
        if m.get("name") is not None:
            msg["name"] = text_value(m["name"], f"{where}.name", max_chars=256)
        clean.append(msg)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", "unsupported_model")

    def ids() -> list[int]:
        text = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return _tokenize(ids, "messages")


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


class TextView:
    """The text of one choice as its events deliver it. ``text`` is the concatenation of the tokens' pieces
    (``token_text``); after ``k`` tokens the events have delivered ``text[:safe(k)]``: all of it, less the
    longest end that could still grow into a stop string; at the finish, the text before the stop string the
    last token completed. Pure functions of the ids and the finish reason: a resumed stream, a non-streamed
    answer and an uninterrupted stream agree."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tok, self.stop = tokenizer, stop
        self.text = ""
        self.ends = [0]  # ends[k]: len(text of the first k tokens)

    def extend(self, ids: list[int]) -> None:
        for n in range(len(self.ends) - 1, len(ids)):
            self.text += token_text(self.tok, ids, n)
            self.ends.append(len(self.text))

    def safe(self, k: int, finish: str | None = None) -> int:
        end = self.ends[k]
        if finish is not None:
            return self.cut(k) if finish == "stop" else end
        if not self.stop:
            return end
        hold = 0
        for s in self.stop:
            for j in range(min(len(s) - 1, end), hold, -1):
                if self.text.endswith(s[:j], 0, end):
                    hold = j
                    break
        return end - hold

    def cut(self, k: int) -> int:
        """Where the text of a choice that finished after ``k`` tokens ends: before the stop string its last
        token completed (none: all of it)."""
        end, prev = self.ends[k], self.ends[max(k - 1, 0)]
        hits = [i for s in self.stop if 0 <= (i := self.text.find(s, max(0, prev - len(s) + 1), end))]
        return min(hits) if hits else end


def _token_str(tokenizer: Any, t: int) -> str:
    return tokenizer.decode([t], skip_special_tokens=False) if tokenizer is not None else ""


def _lp_entry(tokenizer: Any, t: int, lp: float) -> dict[str, Any]:
    s = _token_str(tokenizer, t)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}


def logprobs_block(kind: str, tokenizer: Any, toks: list[int], lps: list[TokenLogprobs],
                   offsets: list[int]) -> dict[str, Any]:
    """The ``logprobs`` of a choice (or of one chunk of it) in the endpoint's shape."""
    if kind == "chat":
        return {"content": [{**_lp_entry(tokenizer, t, lp.logprob),
                             "top_logprobs": [_lp_entry(tokenizer, a, b) for a, b in lp.top]}
                            for t, lp in zip(toks, lps, strict=True)], "refusal": None}
    return {"tokens": [_token_str(tokenizer, t) for t in toks], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token_str(tokenizer, a): b for a, b in lp.top} for lp in lps],
            "text_offset": list(offsets)}


def chunk(kind: str, rid: str, created: int, model: str, *, index: int, text: str | None, first: bool,
          tok: int | None, finish: str | None, token_ids: bool, logprobs: dict[str, Any] | None = None
          ) -> dict[str, Any]:
    if kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    if token_ids and tok is not None:
        choice["token_ids"] = [tok]
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage(n_prompt: int, n_gen: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def full_choice(kind: str, index: int, text: str, generated: list[int], reason: str, token_ids: bool,
                logprobs: dict[str, Any] | None) -> dict[str, Any]:
    if kind == "chat":
        choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": text},
                                  "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    if token_ids:
        choice["token_ids"] = list(generated)
    return choice


def full_response(kind: str, rid: str, created: int, model: str, choices: list[dict[str, Any]], n_prompt: int,
                  n_gen: int) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(n_prompt, n_gen)}


def now() -> int:
    return int(time.time())
