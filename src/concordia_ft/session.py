"""An LLM generation session whose every checkpoint holds exactly what is needed to finish it elsewhere.

One epoch commits, atomically:

- ``kv``      (paged)  the ArenaKVCache arena: only the blocks appended since the last epoch;
- ``tokens``  (paged)  every token id of the conversation (int64, 64 per 512-byte block);
- ``sampler`` (paged)  the sampler's torch.Generator state as a device-independent record of 5120 bytes
                       (integrations/generation.py), logged when it drew;
- ``meta``             token count, cache lengths per layer, the generation settings (a resolved
                       GenerationConfig), where the current
                       generate() started and whether it finished, chat turns, arena parameters, a model
                       fingerprint.

Weights are not logged by default: the model is reloadable from its own files, so logging ~GBs of immutable
bytes into the base snapshot would only slow the first epoch and the recovery; recovery checks a fingerprint
of the model instead. ``log_weights=True`` registers every parameter as an immutable region (base snapshot
once, never diffed) for models that cannot be reloaded. See integrations/LLM.md.

The decode loop is our own (greedy or sampled, the logits processors and stopping criteria transformers'
generate() builds, integrations/generation.py; ``torch.multinomial`` with a private generator): it reproduces ``model.generate()`` token for token, and a recovered session continues with
exactly the tokens the killed one would have produced, because the epoch is cut right after a token is sampled
and that token's KV is computed on the next step in both runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import ConfigError, RecoveryError
from .integrations.generation import (
    SAMPLER_BYTES,
    GenerationSettings,
    decode_sampler_state,
    encode_sampler_state,
    needs_ids,
    pick_token,
    plan_rules,
    resolve_settings,
    restore_sampler_state,
    should_stop,
)
from .integrations.graph_decode import META_KEY  # the Session metadata key, defined below this layer
from .integrations.transformers import ArenaKVCache, dtype_name, parse_dtype, plan_arena

SDPA_CHOICES = ("reproducible", "default")


def sdpa_backends(choice: str, device: Any) -> contextlib.AbstractContextManager[Any]:
    """The attention kernels a Session's steps (prefill, eager decode, the graph's capture) may use.
    "reproducible" on CUDA: torch's choice among flash, memory-efficient and math attention, never cuDNN
    attention, which torch 2.11 prefers on Hopper and which is not run-to-run reproducible at bf16 (two eager runs
    of one session diverged at token ~15 on the H200: integrations/LLM.md), so a recovered or pipelined session
    regenerates exactly the tokens a run without the crash would have, and graph decode equals eager decode.
    "default", or a CPU: unchanged."""
    if choice == "default" or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

# 2: the sampler is the device-independent ``sampler`` region (integrations/generation.py), the settings are a
# resolved GenerationConfig. 1: the raw generator state in ``rng`` (its size that of the writer's device), the
# Session's own settings fields. recover() reads both; a version-1 log continues in version 2.
META_VERSION = 2
READS_VERSIONS = (1, 2)
TOKEN_BLOCK_BYTES = 512  # 64 int64 token ids per block
DEFAULT_MAX_CACHE_LEN = 2048


@dataclass
class GenerationState:
    """The generate() call in progress (or the last one)."""

    settings: GenerationSettings
    start: int  # index in ``ids`` of its first new token
    n_new: int = 0
    done: bool = False
    turn: int | None = None  # index into ``turns`` when this is a chat reply


@dataclass
class SessionStats:
    epochs: int = 0
    checkpoint_s: list[float] = field(default_factory=list)
    epoch_bytes: list[int] = field(default_factory=list)
    epoch_full_bytes: list[int] = field(default_factory=list)
    epoch_pages: list[int] = field(default_factory=list)
    detect_s: list[float] = field(default_factory=list)  # the runtime's collect (find + stage dirty pages)
    append_s: list[float] = field(default_factory=list)  # the log append + commit
    step_s: list[float] = field(default_factory=list)
    prefill_s: float = 0.0


def model_fingerprint(model: Any) -> str:
    """A cheap identity check: config + a hash of a few bytes of a few parameters (no full weight read)."""
    cfg = model.config
    h = hashlib.sha256()
    h.update(type(model).__name__.encode())
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        h.update(f"{k}={getattr(cfg, k, None)};".encode())
    params = list(model.named_parameters())
    for name, p in params[:2] + params[-2:]:
        flat = p.detach().reshape(-1)
        sample = torch.cat([flat[:256], flat[-256:]]).float().cpu().numpy()
        h.update(name.encode())
        h.update(sample.tobytes())
    return h.hexdigest()[:32]


def _tokenizer_eos(model: Any, tokenizer: Any) -> list[int] | None:
    """The tokenizer's eos id when the model's generation_config names none (chat templates end with it)."""
    if getattr(model.generation_config, "eos_token_id", None) is not None or tokenizer is None:
        return None
    eos = getattr(tokenizer, "eos_token_id", None)
    return None if eos is None else [int(eos)]


class Session:
    """A crash-safe generation session over a transformers causal LM.

    ``s = Session(model, log_dir)``; ``s.generate(ids)`` returns the new token ids; after a crash,
    ``Session.recover(log_dir, model).resume()`` returns ALL the new tokens of the interrupted generate().
    """

    def __init__(self, model: Any, log_dir: str | Path, tokenizer: Any = None, checkpoint_every: int = 1, *,
                 max_cache_len: int = DEFAULT_MAX_CACHE_LEN, fsync: str = "never", backend: str = "file",
                 log_weights: bool = False, block_bytes: int = 4096, system_prompt: str | None = None,
                 runtime_options: dict[str, Any] | None = None,
                 decode: str = "auto", durability: str = "durable", pipeline_depth: int = 2,
                 sdpa: str = "reproducible", standby: Standby | None = None,
                 _recovering: dict[str, Any] | None = None, _runtime: Any = None) -> None:
        from . import runtime as _rt
        from .integrations.graph_decode import DURABILITY

        if _recovering is None and Path(log_dir).is_dir() and any(Path(log_dir).iterdir()):
            raise ConfigError(
                f"{log_dir} already holds a log; continue it with Session.recover(log_dir, model) or pass an "
                "empty directory for a new session"
            )
        if checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every={checkpoint_every} must be >= 1 (tokens per epoch)")
        if decode not in ("auto", "graph", "eager"):
            raise ConfigError(f"decode={decode!r}; use 'auto' (a CUDA graph where eligible), 'graph' or 'eager'")
        if durability not in DURABILITY:
            raise ConfigError(f"durability={durability!r}; use 'durable' (on_token after the token's epoch "
                              "committed) or 'pipelined' (commits lag at most pipeline_depth tokens)")
        if pipeline_depth < 1:
            raise ConfigError(f"pipeline_depth={pipeline_depth} must be >= 1")
        if sdpa not in SDPA_CHOICES:
            raise ConfigError(f"sdpa={sdpa!r}; use 'reproducible' (no cuDNN attention: the same tokens every run, "
                              "graph decode equal to eager) or 'default' (whatever torch picks)")
        self.sdpa = sdpa
        # graph decode (integrations/graph_decode.py): on CUDA the decode step is a captured CUDA graph whose
        # token epochs are gathered by the GPU and committed by a writer thread; eager decode otherwise
        self.decode, self.durability, self.pipeline_depth = decode, durability, int(pipeline_depth)
        self._graph: Any = None
        self._graph_failed: str | None = None
        self.model, self.tokenizer = model, tokenizer
        self.log_dir = Path(log_dir)
        self.checkpoint_every = int(checkpoint_every)
        # True: decode epochs are snapshotted on the GPU in stream order and logged by a background writer while
        # the next token is computed; on_token then runs before its epoch commits (it commits during the next
        # step; a kill loses at most the tokens since, which recovery regenerates identically). The prompt's
        # epoch and the last token's of every generate() stay synchronous: generate() returns durable.
        # eager decode under "pipelined": each token's epoch is written in the background (checkpoint_async)
        self.async_checkpoint = durability == "pipelined"
        self._pending: tuple[Any, float] | None = None  # (PendingEpoch, call seconds): stats not recorded yet
        self.log_weights = log_weights
        p = next(model.parameters())
        self.device, self.kv_dtype = p.device, p.dtype
        if _recovering is not None:
            max_cache_len, block_bytes = int(_recovering["max_cache_len"]), int(_recovering["block_bytes"])
            self.kv_dtype = parse_dtype(_recovering["kv_dtype"])
        if standby is not None:  # the warm arena (and decode graph) of a Standby: allocated before this session
            self.cache = standby._take(model, max_cache_len, self.kv_dtype, block_bytes, sdpa=sdpa,
                                       fresh=_recovering is None)
        else:
            # recovering: recover_into overwrites every byte of the arena, so it is not zeroed first
            self.cache = ArenaKVCache(model.config, max_cache_len, dtype=self.kv_dtype, device=self.device,
                                      block_bytes=block_bytes, zeroed=_recovering is None)
        self.max_cache_len = max_cache_len
        self.tokens = np.zeros(-(-(max_cache_len + 1) * 8 // TOKEN_BLOCK_BYTES) * TOKEN_BLOCK_BYTES // 8, np.int64)
        self.tokens_dirty = np.zeros(self.tokens.nbytes // TOKEN_BLOCK_BYTES, np.uint8)
        self.n_tokens = 0
        self._tokens_marked = 0
        self.generator = torch.Generator(device=self.device)
        if _recovering is None:
            self.generator.seed()  # unseeded sampling is random; its state is logged, so resume is exact
        self.rng = np.zeros(SAMPLER_BYTES, np.uint8)  # the sampler record: the same size on every device
        self.rng_bytes = SAMPLER_BYTES
        self.rng_exact = True  # False after recovering a log whose sampler ran on another device type
        self._sampler_blocks = -(-(64 + int(self.generator.get_state().numel())) // 512)
        self._rules: tuple[GenerationSettings, Any] | None = None
        self.rng_dirty = np.zeros(len(self.rng) // 512, np.uint8)  # set when the sampler drew (greedy: never)
        self.gen: GenerationState | None = None
        self._settings_cache: tuple[GenerationSettings, dict[str, Any]] | None = None
        self._rules = None
        self.turns: list[dict[str, Any]] = []
        if system_prompt is not None:
            self.turns.append({"role": "system", "content": system_prompt})
        # recovering: the caller checked the model against the log's fingerprint and _load() takes that one
        self.fingerprint = model_fingerprint(model) if _recovering is None else str(_recovering["fingerprint"])
        self.stats = SessionStats()
        self.recovery_phases: dict[str, Any] = {}  # Session.recover: where its time went (seconds)
        fwd = inspect.signature(model.forward).parameters
        self._logits_to_keep = "logits_to_keep" in fwd
        self.cache_kw = "cache" if "cache" in fwd else "past_key_values"  # transformers renamed it in 5.x
        self.cache_position_kw = "cache_position" in fwd  # whether the forward takes cache_position
        self.runtime = _runtime if _runtime is not None else _rt.Runtime(
            str(self.log_dir), fsync=fsync, backend=backend,
            **{"on_compaction_error": "warn", **_session_log_defaults(runtime_options)})  # a failed compaction never stops a chat
        self._register(fresh=_recovering is None)
        if standby is not None and standby.decoder is not None and decode != "eager":
            # the graph captured at warm-up reads and writes this arena: the first token needs no capture
            self._graph = standby._take_decoder()
            self._graph.bind(self, durability=durability, pipeline_depth=self.pipeline_depth)

    # -- registration ----------------------------------------------------------------------------------------
    def _register(self, *, fresh: bool) -> None:
        rt = self.runtime
        bb = self.cache.geometry.block_bytes
        # a new session's buffers start zeroed: their first epoch logs only what was written (the prompt's KV
        # blocks), not the whole arena. A recovering session restores all three from the log right away
        # (recover_into makes the restored bytes the baseline), so it skips register's check that they are
        # zero: a full pass over the arena that the restore overwrites anyway.
        rt.register("kv", self.cache.arena, kind="paged", page_bytes=min(bb, 4096), block_bytes=bb,
                    dirty_blocks=self.cache.dirty_blocks, initially_zero=fresh)
        rt.register("tokens", self.tokens, kind="paged", page_bytes=TOKEN_BLOCK_BYTES,
                    block_bytes=TOKEN_BLOCK_BYTES, dirty_blocks=self.tokens_dirty, initially_zero=fresh)
        rt.register("sampler", self.rng, kind="paged", page_bytes=512, block_bytes=512, dirty_blocks=self.rng_dirty,
                    initially_zero=fresh)
        if self.log_weights:
            for name, prm in self.model.named_parameters():
                rt.register(f"weights:{name}", prm.data, kind="immutable")

    # -- state -----------------------------------------------------------------------------------------------
    @property
    def ids(self) -> list[int]:
        return self.tokens[: self.n_tokens].tolist()

    def append_tokens(self, new: Sequence[int]) -> None:
        """Append token ids to the conversation (``ConfigError`` past ``max_cache_len``)."""
        n = len(new)
        if self.n_tokens + n > self.max_cache_len:
            raise ConfigError(
                f"the conversation would hold {self.n_tokens + n} tokens; this session's cache holds "
                f"{self.max_cache_len}: create the Session with a larger max_cache_len"
            )
        self.tokens[self.n_tokens: self.n_tokens + n] = np.asarray(new, dtype=np.int64)
        self.n_tokens += n

    def epoch_meta(self, lengths: list[int], *, n_tokens: int | None = None, n_new: int | None = None,
                   done: bool | None = None) -> dict[str, Any]:
        """The epoch's metadata. The graph decoder's writer passes the token count and the generate() progress
        of the token it commits (the decode thread is ahead of it by then)."""
        g = self.gen
        gen = None if g is None else {"settings": self._settings_dict(g.settings), "start": g.start,
                                      "n_new": g.n_new if n_new is None else n_new,
                                      "done": g.done if done is None else done, "turn": g.turn}
        return {META_KEY: {
            "version": META_VERSION,
            "n_tokens": self.n_tokens if n_tokens is None else n_tokens,
            "cache_lengths": lengths,
            "max_cache_len": self.max_cache_len,
            "block_bytes": self.cache.geometry.block_bytes,
            "kv_dtype": dtype_name(self.kv_dtype),
            "arena_nbytes": self.cache.geometry.nbytes,
            "fingerprint": self.fingerprint,
            "log_weights": self.log_weights,
            "rng_device": str(self.device.type),
            "gen": gen,
            "turns": self.turns,
            "time": time.time(),
        }}

    def _settings_dict(self, settings: GenerationSettings) -> dict[str, Any]:
        """``settings.to_dict()``, computed once per generate() (the settings are frozen)."""
        cached = self._settings_cache
        if cached is None or cached[0] is not settings:
            cached = self._settings_cache = (settings, settings.to_dict())
        return cached[1]

    def _mark(self) -> list[int]:
        """Flag what changed since the last epoch: new KV blocks (from the lengths), new token ids, the sampler."""
        lengths = self.cache.lengths()  # one device read
        self.cache.mark_dirty(lengths)
        bb = TOKEN_BLOCK_BYTES
        lo, hi = self._tokens_marked * 8, self.n_tokens * 8
        if hi > lo:
            self.tokens_dirty[lo // bb: -(-hi // bb)] = 1
        if self.rng_dirty.any():
            encode_sampler_state(self.generator, self.rng)
        return lengths

    def mark_logged(self, lengths: list[int]) -> None:
        """After a commit: the committed KV rows (``lengths``) and token ids are the new marks, nothing dirty."""
        self.cache.mark_clean(lengths)
        self._tokens_marked = self.n_tokens

    def _record(self, st: Any, seconds: float) -> None:
        self.stats.epochs += 1
        self.stats.checkpoint_s.append(seconds)
        self.stats.epoch_bytes.append(int(_stat(st, "total_bytes")))
        self.stats.epoch_full_bytes.append(int(_stat(st, "full_bytes")))
        self.stats.epoch_pages.append(int(_stat(st, "pages")))
        self.stats.detect_s.append(float(_stat(st, "detect_seconds")))
        self.stats.append_s.append(float(_stat(st, "append_seconds")))

    def _settle(self) -> None:
        """Record the stats of the async epoch before this one: the runtime call that just returned finished it
        first (a failure of it was raised by that call, and is not recorded)."""
        item, self._pending = self._pending, None
        if item is not None:
            p, seconds = item
            if p.done() and p.error is None and p.stats is not None:
                self._record(p.stats, seconds)

    def checkpoint(self) -> int:
        """Commit the session (new KV blocks, new token ids, sampler state, metadata) as ONE epoch."""
        t0 = time.perf_counter()
        lengths = self._mark()
        epoch = self.runtime.checkpoint(meta=self.epoch_meta(lengths))  # finishes an async epoch in flight first
        self._settle()
        self.mark_logged(lengths)
        self._record(self.runtime.last_stats, time.perf_counter() - t0)
        return int(epoch)

    def checkpoint_async(self) -> Any:
        """Start the session's epoch and return its ``PendingEpoch`` without waiting for the log: the KV pages
        are snapshotted on the device in stream order, the token ids, sampler state and metadata now; the
        background writer commits it (``Runtime.checkpoint_async``). The next checkpoint finishes it first."""
        t0 = time.perf_counter()
        lengths = self._mark()
        pending = self.runtime.checkpoint_async(meta=self.epoch_meta(lengths))
        self._settle()
        self.mark_logged(lengths)  # the snapshot took these marks; a failed epoch gives them back to the runtime
        self._pending = (pending, time.perf_counter() - t0)  # stats recorded once it has committed
        return pending

    def settings(self, max_new_tokens: int | None = None, do_sample: bool | None = None, *,
                 generation_config: Any = None, prompt_len: int | None = None, **kw: Any) -> GenerationSettings:
        """What ``model.generate(ids, generation_config, max_new_tokens=..., **kw)`` would run with for a prompt
        of ``prompt_len`` ids (default: the session's); a setting Session cannot reproduce raises ConfigError."""
        if max_new_tokens is not None:
            kw["max_new_tokens"] = max_new_tokens
        if do_sample is not None:
            kw["do_sample"] = do_sample
        if "eos_token_id" not in kw and "eos_token_ids" not in kw and generation_config is None:
            eos = _tokenizer_eos(self.model, self.tokenizer)
            if eos is not None:
                kw["eos_token_id"] = eos
        n = self.n_tokens if prompt_len is None else int(prompt_len)
        return resolve_settings(self.model, n, generation_config, **kw)

    def generate(self, input_ids: Any, max_new_tokens: int | None = None, do_sample: bool | None = None,
                 on_token: Callable[[int], Any] | None = None, *, generation_config: Any = None,
                 **settings: Any) -> list[int]:
        """Generate after ``input_ids`` (the whole sequence: when the session already holds a prefix of it, that
        prefix's KV is reused) with what ``model.generate()`` takes: a ``GenerationConfig`` and/or its keyword
        arguments (integrations/LLM.md lists them), merged with the model's ``generation_config`` as generate()
        merges them; without a generation_config, 64 new tokens, greedy. ``seed`` seeds the sampler. Returns the
        new token ids."""
        ids = _as_id_list(input_ids)
        if not ids:
            raise ConfigError("input_ids is empty: generate() needs at least one prompt token")
        s = self.settings(max_new_tokens, do_sample, generation_config=generation_config, prompt_len=len(ids),
                          **settings)
        self.rules_for(s, ids)  # a setting transformers refuses is refused before anything is logged
        self._start(ids, s)
        return self._run(on_token)

    def _start(self, ids: list[int], s: GenerationSettings, turn: int | None = None) -> None:
        keep = _common_prefix(self.ids, ids)
        cached = int(self.cache.get_seq_length())
        if cached > keep or cached >= len(ids):  # the cache holds KV the new sequence does not share
            self.cache.reset()  # marks every block dirty: the next epoch rewrites the arena
            keep = 0
        self.n_tokens = keep
        self._tokens_marked = min(self._tokens_marked, keep)
        self.append_tokens(ids[keep:])
        if s.seed is not None:
            self.generator.manual_seed(int(s.seed))
        self.rng_dirty[:] = 1  # the first epoch of every generate() records the sampler state
        self.gen = GenerationState(settings=s, start=self.n_tokens, turn=turn)
        self.checkpoint()  # the prompt is durable before any compute: a kill during prefill is resumable

    def _run(self, on_token: Callable[[int], Any] | None) -> list[int]:
        g = self.gen
        if g is None:
            raise RecoveryError("no generate() to run: this session has never generated")
        rules = self.rules_for(g.settings)
        with_ids = needs_ids(rules)
        # the first step of a run is eager unless the graph is captured already: a fresh generate()'s first step
        # is its prefill anyway; a resume() after a recovery gets its first token from one eager step (~40 ms
        # at Qwen3-0.6B dims) instead of after the capture (~100 ms), and captures before its second
        first = self._graph is None or self._graph.graph is None
        with torch.inference_mode(), sdpa_backends(self.sdpa, self.device):
            while not g.done:
                t0 = time.perf_counter()
                cached = int(self.cache.get_seq_length())
                if self.n_tokens - cached == 1 and not first and self._graph_decoder(rules) is not None:
                    n = self._graph.run(on_token)  # to the end of the generate(), or until the arena is full
                    if n:
                        self.stats.step_s.extend(self._graph.stats.token_s[-n:])
                    if g.done:
                        break
                    cached = int(self.cache.get_seq_length())  # the arena is full: the eager step reports it
                feed = torch.as_tensor(self.tokens[cached: self.n_tokens], device=self.device).unsqueeze(0)
                kw = {"logits_to_keep": 1} if self._logits_to_keep else {}
                kw[self.cache_kw] = self.cache
                out = self.model(input_ids=feed, use_cache=True, **kw)
                logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
                seq = self._ids_tensor() if with_ids else None
                tok, scores = pick_token(rules, seq, logits, self.generator)
                if rules.do_sample:  # the blocks of the record that hold the state (a CUDA generator's: one)
                    self.rng_dirty[: self._sampler_blocks] = 1
                self.append_tokens([tok])
                g.n_new += 1
                g.done = should_stop(rules, tok, g.n_new, self._ids_tensor() if with_ids else None, scores)
                if feed.shape[1] > 1:
                    self.stats.prefill_s = time.perf_counter() - t0
                else:
                    self.stats.step_s.append(time.perf_counter() - t0)
                if g.done or g.n_new % self.checkpoint_every == 0:
                    if self.async_checkpoint and not g.done:
                        self.checkpoint_async()
                    else:
                        self.checkpoint()  # the last token's epoch: generate() returns with every token durable
                first = False
                if on_token is not None:
                    on_token(tok)
        return self.tokens[g.start: g.start + g.n_new].tolist()

    def _graph_decoder(self, rules: Any) -> Any:
        """The session's graph decoder when this generate() decodes in graph mode (captured at first use)."""
        if self.decode == "eager" or self._graph_failed is not None:
            return None
        from .integrations.graph_decode import GraphDecoder, graph_ineligible

        why = graph_ineligible(self, rules)
        if why is not None:
            if self.decode == "graph":
                raise ConfigError(f"decode='graph' is not possible here: {why}; use decode='auto' or 'eager'")
            return None
        if self._graph is None:
            self.runtime.wait()  # an asynchronous epoch of the eager path commits before the writer appends
            try:
                self._graph = GraphDecoder(self, durability=self.durability, pipeline_depth=self.pipeline_depth)
            except Exception as e:  # noqa: BLE001 - no kernel / no capture: eager decode still works
                return self._graph_unusable(e)
        else:
            self.runtime.wait()
        if self._graph.graph is None:
            try:
                n = self.n_tokens
                self._graph.capture(int(self.tokens[n - 1]), n - 1)
            except Exception as e:  # noqa: BLE001
                return self._graph_unusable(e)
        return self._graph

    def _graph_unusable(self, e: BaseException) -> None:
        if self.decode == "graph":
            raise ConfigError(f"decode='graph': the decode step could not be captured: {type(e).__name__}: {e}"
                              ) from e
        self._graph_failed = f"{type(e).__name__}: {e}"
        import logging

        logging.getLogger("concordia_ft.session").warning(
            "graph decode is off for this session (decoding eagerly): %s", self._graph_failed)
        if self._graph is not None:
            self._graph.close()
            self._graph = None
        return None

    def _ids_tensor(self) -> torch.Tensor:
        return torch.as_tensor(self.tokens[: self.n_tokens], device=self.device).unsqueeze(0)

    def rules_for(self, settings: GenerationSettings, prompt: Sequence[int] | None = None) -> Any:
        """transformers' processors and stopping criteria for ``settings`` (built once per generate() call, and
        again after a recovery from the logged settings: they keep no per-token state). ``prompt``: the ids
        the call starts from (default: the first ``prompt_len`` ids the session holds)."""
        cached = self._rules
        if cached is None or cached[0] is not settings:
            src = self.tokens[: settings.prompt_len] if prompt is None else np.asarray(prompt, dtype=np.int64)
            ids = torch.as_tensor(src, device=self.device).unsqueeze(0)
            try:
                rules = plan_rules(self.model, settings, ids, self.tokenizer, device=self.device)
            except ValueError as e:
                if isinstance(e, ConfigError):
                    raise
                raise ConfigError(f"generation settings refused by transformers: {e}") from None
            cached = self._rules = (settings, rules)
        return cached[1]

    def resume(self, on_token: Callable[[int], Any] | None = None) -> list[int]:
        """Finish the interrupted generate() (or return the last one's tokens); returns ALL its new tokens."""
        if self.gen is None:
            raise RecoveryError(f"the log in {self.log_dir} holds no generate() call to resume")
        out = self._run(on_token)
        if self.gen.turn is not None:
            self._finish_turn()
        return out

    # -- chat ------------------------------------------------------------------------------------------------
    def chat(self, text: str, *, max_new_tokens: int | None = None, do_sample: bool | None = None,
             on_token: Callable[[int], Any] | None = None, **settings: Any) -> str:
        """One user turn through the tokenizer's chat template; returns the assistant's reply text."""
        if self.tokenizer is None:
            raise ConfigError("chat() needs a tokenizer: create the Session with tokenizer=...")
        self.turns.append({"role": "user", "content": text})
        ids = self._render_turns()
        s = self.settings(max_new_tokens, do_sample, prompt_len=len(ids), **settings)
        self.rules_for(s, ids)
        self.turns.append({"role": "assistant", "start": len(ids), "end": -1})  # end -1: being generated
        self._start(ids, s, turn=len(self.turns) - 1)
        self._run(on_token)
        return self._finish_turn()

    def _finish_turn(self) -> str:
        g = self.gen
        assert g is not None and g.turn is not None
        turn = self.turns[g.turn]
        turn["start"], turn["end"] = g.start, g.start + g.n_new
        return self.reply_text(g.turn)

    def reply_text(self, turn: int) -> str:
        t = self.turns[turn]
        if "content" in t:
            return str(t["content"])
        end = t["end"]
        if end < 0:  # the reply being generated
            end = t["start"] + (self.gen.n_new if self.gen is not None and self.gen.turn == turn else 0)
        return str(self.tokenizer.decode(self.tokens[t["start"]: end].tolist(), skip_special_tokens=True))

    def messages(self) -> list[dict[str, str]]:
        return [{"role": t["role"], "content": self.reply_text(i)} for i, t in enumerate(self.turns)]

    def _render_turns(self) -> list[int]:
        """Token ids of the conversation + generation prompt, reusing the cached ids as an exact prefix."""
        tok = self.tokenizer
        text_new = tok.apply_chat_template(self.messages(), add_generation_prompt=True, tokenize=False)
        if self.n_tokens:
            text_prev = tok.decode(self.ids, skip_special_tokens=False)
            if text_new.startswith(text_prev):
                suffix = tok(text_new[len(text_prev):], add_special_tokens=False)["input_ids"]
                return self.ids + list(suffix)
        return list(tok(text_new, add_special_tokens=False)["input_ids"])

    # -- recovery --------------------------------------------------------------------------------------------
    @classmethod
    def recover(cls, log_dir: str | Path, model: Any, tokenizer: Any = None, *, fsync: str = "never",
                backend: str = "file", checkpoint_every: int = 1,
                runtime_options: dict[str, Any] | None = None,
                decode: str = "auto", durability: str = "durable", pipeline_depth: int = 2,
                sdpa: str = "reproducible", standby: Standby | None = None) -> Session:
        """Rebuild the session from the last committed epoch (in a fresh process); then call resume().

        ``standby``: a warm ``Standby`` (arena allocated, decode graph captured at warm-up) to restore into; the
        first token of ``resume()`` is then one graph replay. ``recovery_phases`` of the result says where the
        time went (seconds)."""
        from .runtime import open_to_recover

        perf = time.perf_counter
        t0 = perf()
        rt, m = open_to_recover(log_dir, META_KEY, "concordia_ft.Session", fsync=fsync, backend=backend,
                                runtime_options=_recovery_defaults(_session_log_defaults(runtime_options)))
        t1 = perf()
        try:
            if m.get("version") not in READS_VERSIONS:
                raise RecoveryError(f"session metadata version {m.get('version')}; this version of concordia_ft "
                                    f"reads versions {READS_VERSIONS}: recover with the version that wrote it, or a "
                                    "newer one")
            fp = model_fingerprint(model)
            if fp != m["fingerprint"] and not m.get("log_weights"):
                raise RecoveryError(
                    f"the model passed to recover() is not the one that wrote {log_dir} (fingerprint {fp} != "
                    f"{m['fingerprint']}); load the same model files (weights are not in the log)"
                )
            geo = plan_arena(model.config, int(m["max_cache_len"]), dtype=parse_dtype(m["kv_dtype"]),
                             block_bytes=int(m["block_bytes"]))
            if geo.nbytes != int(m["arena_nbytes"]):
                raise RecoveryError(f"the model's KV arena would be {geo.nbytes} bytes; the log's is "
                                    f"{m['arena_nbytes']}: recover with the same model configuration")
            t2 = perf()
            s = cls(model, log_dir, tokenizer, checkpoint_every, log_weights=bool(m.get("log_weights")),
                    decode=decode, durability=durability,
                    pipeline_depth=pipeline_depth, sdpa=sdpa, standby=standby, _recovering=m, _runtime=rt)
            t3 = perf()
            s._load(m)
            t4 = perf()
            if s.gen is not None and not s.gen.done:
                s.rules_for(s.gen.settings)  # e.g. stop_strings without the tokenizer: refused here, log closed
        except BaseException:
            rt.close()
            raise
        t5 = perf()
        tm = s.recovered.timings
        s.recovery_phases = {
            "open_s": t1 - t0, "open_verify_s": tm.verify_s, "check_s": t2 - t1, "construct_s": t3 - t2,
            "load_s": t4 - t3, "recover_into_s": s.recovered.seconds, "rules_s": t5 - t4, "total_s": t5 - t0,
            "graph_ready": s._graph is not None and s._graph.graph is not None}
        for name, st in s.recovered.streamed.items():
            s.recovery_phases[f"streamed.{name}"] = {
                "seconds": st.seconds, "bytes": st.bytes, "plan_s": st.plan_s, "fill_wait_s": st.fill_wait_s,
                "slot_wait_s": st.slot_wait_s, "finish_s": st.finish_s, "threads": st.threads,
                "chunks": st.chunks, **st.extra}
        return s

    def _load(self, m: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        # the restored bytes live in the arena and the host buffers now: keep no second (pinned) host copy
        version = int(m["version"])
        if version == 1:
            # the raw state of the writer's generator in ``rng`` (its device's size): restored into a host buffer,
            # then dropped from the log; ``sampler`` is registered, not restored, so the next epoch logs it in full
            kind = str(m.get("rng_device", "cpu"))
            n = 16 if kind == "cuda" else int(torch.Generator().get_state().numel())
            old = np.zeros(-(-n // 512) * 512, np.uint8)
            self.recovered = self.runtime.recover_into(
                {"kv": self.cache.arena, "tokens": self.tokens, "rng": old}, keep_images=False)
            self.runtime.forget("rng")
            state: tuple[str, bytes] | None = (kind, bytes(old[:n]))
        else:
            self.recovered = self.runtime.recover_into(keep_images=False)
            state = decode_sampler_state(self.rng)
        self.n_tokens = self._tokens_marked = int(m["n_tokens"])
        self.cache.set_lengths(list(m["cache_lengths"]))
        self.cache.mark_clean()
        if state is not None:
            self.rng_exact = restore_sampler_state(self.generator, *state)
            if not self.rng_exact or version == 1:
                self.rng_dirty[:] = 1  # the next epoch logs this device's sampler
        self.turns = list(m["turns"])
        gd = m["gen"]
        if gd is not None:
            gd = dict(gd)
            settings = GenerationSettings.from_dict(gd.pop("settings"), prompt_len=int(gd["start"]))
            self.gen = GenerationState(settings=settings, **gd)
        self.fingerprint = str(m["fingerprint"])
        self.restore_s = time.perf_counter() - t0

    def close(self) -> None:
        if self._graph is not None:
            self._graph.close()
            self._graph = None
        self.runtime.close()  # an async epoch in flight is finished first

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Standby:
    """A serving process's warm, empty session slot: the KV arena allocated and (on CUDA, where graph decode is
    eligible) the decode step captured as a CUDA graph on it, before any log is read.

    ``Session.recover(log_dir, model, standby=sb)`` restores the log into THIS arena (same tensor, same length
    counters), so the graph captured here stays valid and the first token after the recovery is one graph
    replay (~5 ms at Qwen3-0.6B dims on the H200) instead of one eager step (~40-50 ms); the capture (~80-100 ms)
    is paid here, at warm-up, as a serving engine captures its decode graphs at start. ``Session(model, dir,
    standby=sb)`` starts a new session on it (the arena is zeroed first). A standby serves one session: the
    session owns the arena and the graph from then on (``consumed``). Its geometry (``max_cache_len``,
    ``block_bytes``, KV dtype) must be the log's; a mismatch raises ConfigError before anything is restored.

    On CUDA it also leaves the streamed restore's ring memory (256 MiB pinned + its device twin, the default
    ``RecoveryOptions`` ring) in torch's caching allocators, so the recovery does not page-lock memory.
    ``capture=False`` (or a CPU model, sampling-only use) keeps only the arena. ``capture_s`` is the capture's
    time, ``setup_s`` the whole warm-up's (arena, ring, capture, warm replay, restore memory)."""

    def __init__(self, model: Any, *, max_cache_len: int = DEFAULT_MAX_CACHE_LEN, block_bytes: int = 4096,
                 kv_dtype: Any = None, durability: str = "durable", pipeline_depth: int = 2,
                 sdpa: str = "reproducible", capture: bool = True) -> None:
        from .integrations.graph_decode import DURABILITY

        t0 = time.perf_counter()
        if sdpa not in SDPA_CHOICES:
            raise ConfigError(f"sdpa={sdpa!r}; use one of {', '.join(SDPA_CHOICES)}")
        if durability not in DURABILITY:
            raise ConfigError(f"durability={durability!r}; use one of {', '.join(DURABILITY)}")
        p = next(model.parameters())
        self.model, self.device = model, p.device
        self.kv_dtype = p.dtype if kv_dtype is None else (parse_dtype(kv_dtype) if isinstance(kv_dtype, str)
                                                          else kv_dtype)
        self.sdpa = sdpa
        self.cache: ArenaKVCache | None = ArenaKVCache(model.config, int(max_cache_len), dtype=self.kv_dtype,
                                                       device=self.device, block_bytes=int(block_bytes))
        self.geometry = self.cache.geometry
        self.decoder: Any = None
        self.why_no_graph: str | None = None  # why no graph was captured (None: it was)
        self.capture_s = 0.0
        if not capture:
            self.why_no_graph = "capture=False"
        else:
            self.why_no_graph = self._capture(durability, int(pipeline_depth))
        if self.device.type == "cuda":
            from .recovery import RecoveryOptions

            ro = RecoveryOptions()
            self._warm_restore_memory(ro.ring_slots, ro.slot_bytes)
        self.consumed = False
        self.setup_s = time.perf_counter() - t0

    def _capture(self, durability: str, depth: int) -> str | None:
        from .integrations.graph_decode import GraphDecoder, cache_ineligible

        assert self.cache is not None
        why = cache_ineligible(self.model, self.cache)
        if why is not None:
            return why
        try:
            dec = GraphDecoder.standalone(self.model, self.cache, durability=durability, pipeline_depth=depth)
        except Exception as e:  # noqa: BLE001 - no kernel: the session decodes eagerly (or captures later)
            return f"{type(e).__name__}: {e}"
        try:
            with torch.inference_mode(), sdpa_backends(self.sdpa, self.device):
                dec.capture(0, 0)  # position-independent: the graph reads the position from a device tensor
                # one replay now, so the first replay after a recovery does not pay for the graph's upload; its
                # row and ring slot are overwritten before they are read, the counters are put back
                saved = self.cache.full_lengths.clone()
                dec.graph.replay()
                self.cache.full_lengths.copy_(saved)
                dec.set_state(0, 0)
                torch.cuda.current_stream().synchronize()
        except Exception as e:  # noqa: BLE001
            dec.close()
            return f"{type(e).__name__}: {e}"
        self.decoder = dec
        self.capture_s = dec.stats.capture_s
        return None

    def _warm_restore_memory(self, slots: int, slot_bytes: int) -> None:
        """Leave blocks of the streamed restore's ring (cuda/streamed.py: pinned host slots + their device twins
        and page lists) in torch's caching allocators, so the recovery does not page-lock 256 MiB (~100 ms on
        the H200 host). Done after the capture: capturing a CUDA graph empties torch's caches first."""
        pb = min(self.geometry.block_bytes, 4096)
        slot_bytes = max(pb, slot_bytes // pb * pb)
        per = slot_bytes // pb
        held = [torch.empty((slots, slot_bytes), dtype=torch.uint8, pin_memory=True),
                torch.empty((slots, per), dtype=torch.int64, pin_memory=True),
                torch.empty((slots, slot_bytes), dtype=torch.uint8, device=self.device),
                torch.empty((slots, per), dtype=torch.int64, device=self.device)]
        del held

    def _take(self, model: Any, max_cache_len: int, kv_dtype: Any, block_bytes: int, *, sdpa: str,
              fresh: bool) -> ArenaKVCache:
        """The arena, handed to the session being built (checked against its geometry first)."""
        if self.consumed or self.cache is None:
            raise ConfigError("this Standby already serves a session; make one Standby per session")
        if model is not self.model:
            raise ConfigError("the Standby was warmed up with another model object; pass the same model")
        want = plan_arena(model.config, int(max_cache_len), dtype=kv_dtype, block_bytes=int(block_bytes))
        if want != self.geometry:
            raise ConfigError(
                f"the Standby's arena (max_cache_len={self.geometry.max_cache_len}, block_bytes="
                f"{self.geometry.block_bytes}, {self.geometry.dtype}) is not this session's (max_cache_len="
                f"{want.max_cache_len}, block_bytes={want.block_bytes}, {want.dtype}); make the Standby with the "
                "session's geometry")
        if self.decoder is not None and sdpa != self.sdpa:
            raise ConfigError(f"the Standby captured its graph with sdpa={self.sdpa!r}; this session asks for "
                              f"sdpa={sdpa!r}")
        cache, self.cache = self.cache, None
        self.consumed = True
        if fresh:  # a new session starts from a zeroed arena (the capture's warm-up wrote rows)
            cache.arena.zero_()
            cache.dirty_blocks.zero_()
            cache.set_lengths([0] * len(cache.layers))
            cache.mark_clean([0] * len(cache.layers))
        return cache

    def _take_decoder(self) -> Any:
        dec, self.decoder = self.decoder, None
        return dec

    def close(self) -> None:
        """Free an unused standby's graph and ring (a session that took it frees them itself)."""
        if self.decoder is not None:
            self.decoder.close()
            self.decoder = None
        self.cache = None


# The regions whose payload checksums a Session's recovery runs while it streams them to the device (their
# bytes read once, checked before the restore returns, so before any token), instead of at the log's open; the
# rest (token ids, sampler, metadata) are checked at the open. Where nothing is streamed (a CPU session, or
# RecoveryOptions(streamed=False)) the deferred checks run before the images are built: the same checks, in
# the same order relative to any use. See integrations/LLM.md "Recovery time".
SESSION_DEFER_VERIFY = ("kv",)


# Mapped DRAM segments of a Session's log: 8 MiB, not the log's 64 MiB default. A session's steady epochs are one
# token's KV rows (118 KB at Qwen3-0.6B dims: ~70 per segment); a prefill larger than a segment gets a segment of
# its own size either way. What the size costs is paid at every open of the log and by every live session:
# reopening the writer's tail (its unused preallocated tail is deallocated, the capacity allocated and faulted in
# again, then registered with the driver), replay's check that the tails past the last epoch are zeros, and the
# tmpfs held by each session's tail + prepared spare. On the H200 a 64 MiB tail made the log's open ~45 ms of a
# 2k-token recovery (integrations/LLM.md "Recovery time").
SESSION_MAPPED_SEGMENT_BYTES = 8 << 20


def _session_log_defaults(runtime_options: dict[str, Any] | None) -> dict[str, Any]:
    """``runtime_options`` with the Session's log defaults where the caller did not choose."""
    opts = dict(runtime_options or {})
    log_opts = dict(opts.get("log_options") or {})
    log_opts.setdefault("mapped_segment_bytes", SESSION_MAPPED_SEGMENT_BYTES)
    opts["log_options"] = log_opts
    return opts


def _recovery_defaults(runtime_options: dict[str, Any] | None) -> dict[str, Any]:
    """``runtime_options`` with the Session's recovery defaults where the caller did not choose."""
    from .recovery import RecoveryOptions

    opts = dict(runtime_options or {})
    rec = opts.get("recovery")
    if isinstance(rec, RecoveryOptions):
        if rec.defer_verify is None:
            import dataclasses

            opts["recovery"] = dataclasses.replace(rec, defer_verify=SESSION_DEFER_VERIFY)
        return opts
    rec = dict(rec or {})
    if rec.get("defer_verify") is None:
        rec["defer_verify"] = SESSION_DEFER_VERIFY
    opts["recovery"] = rec
    return opts


def _stat(st: Any, key: str) -> float:
    if st is None:
        return 0
    if isinstance(st, dict):
        return st.get(key, 0)
    return getattr(st, key, 0)


def _as_id_list(input_ids: Any) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ConfigError(f"input_ids has batch size {input_ids.shape[0]}; a Session holds one sequence")
            input_ids = input_ids[0]
        return [int(x) for x in input_ids.tolist()]
    if isinstance(input_ids, dict) or hasattr(input_ids, "keys"):
        return _as_id_list(input_ids["input_ids"])
    return [int(x) for x in input_ids]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


__all__ = ["GenerationSettings", "Session", "Standby", "model_fingerprint"]
