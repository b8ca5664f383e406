"""The serving engine: many requests over ONE paged KV pool, continuous batching, one epoch per step.

A step: admit waiting requests in ``(priority, arrival)`` order while a sampler row and the blocks of their
tokens are there (a cached prefix of whole blocks is shared, not recomputed; a running request of strictly lower
priority is preempted for a head that does not fit), run ONE forward over every running request's new tokens
(decodes 1 token each, prefills in chunks within ``max_batch_tokens``), sample one token for every request whose
feed reached its last token, register the blocks that became full in the prefix cache, retire finished requests
(their blocks go back to the free list or, cached, to the LRU list), give each running request the block its new
token crossed into (preempting the lowest-priority, latest-arrived request when the pool is out), then commit one
epoch through the Runtime:

- ``kv``     (paged) the pool's rows written this step, flagged by the attention's slots (freed rows are
                     never flagged again until a new owner writes them);
- ``tokens`` (paged) int32 token id per pool slot: every running request's ids live at its block table's slots;
- ``rng``    (paged) one row per running request: its generator's state, flagged when it drew;
- ``meta``           block tables, per-request counters, settings and API info, the waiting queue (with prompt
                     ids), finished outputs not yet evicted, the step counter, the pool geometry, a model
                     fingerprint.

Tokens are handed out (``StepOutput``) only after their epoch committed, so a client never holds a token the
log lacks. The batch order is ``(admitted step, digest, id)``: a pure function of what was admitted, so the
packed arithmetic of a step is the same in an uninterrupted engine and in one recovered from the log.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.format import JSONText, encode_json
from ..errors import ConfigError, ContextLengthError, QueueFullError, RecoveryError
from ..session import model_fingerprint
from . import attention
from .blocks import BlockPool, blocks_for, chain_hashes
from .graphs import DecodeGraphs, scratch_blocks_for
from .kv import (
    KVPool,
    PoolGeometry,
    build_batch,
    build_kernel_batch,
    install,
    kernel_attention,
    plan_pool,
    sdpa_backends,
)
from .sampling import LP_WORDS, RngRows, Sampler, SamplingParams, StopStrings, TokenLogprobs, new_generator

META_KEY = "concordia.serve"
META_VERSION = 2
TOKEN_BLOCK = 128  # int32 ids per 512-byte block of the tokens region
# the options that shape a step's batch, its arithmetic or its scheduling: logged, and taken from the log by
# Engine.recover
LOGGED_OPTIONS = ("max_running", "max_waiting", "max_model_len", "max_batch_tokens", "keep_finished", "graphs",
                  "invariant", "prefix_caching", "admission")
# what a log written before an option existed ran with: cuBLAS and torch's norms, no prefix cache, whole-budget
# reservation
OPTION_BEFORE = {"invariant": False, "prefix_caching": False, "admission": "reserve"}
SPARE_SEGMENTS = 2  # log segments kept prepared ahead (a mapped log)
# a finished output kept (keep_finished) lives in a slot of the ``done`` region, written once when it finished:
# a 16-byte header (magic, generated ids, JSON bytes), the ids as int32, the request's JSON; the epochs' metadata
# names only [slot, collected] (an output larger than a slot stays whole in the metadata)
DONE_MAGIC = 0x44544643  # b"CFTD"
DONE_HEAD = 16
DONE_JSON_BYTES = 4096


@dataclass(frozen=True)
class EngineOptions:
    num_blocks: int = 256
    block_size: int = 16
    max_running: int = 64
    max_waiting: int = 256
    max_model_len: int = 2048
    max_batch_tokens: int = 2048
    keep_finished: int = 256  # finished outputs kept for fetching / reconnecting (oldest collected go first)
    checkpoint: bool = True  # False: no log at all (the benchmark's baseline)
    fsync: str = "never"  # a SIGKILL loses nothing the page cache holds; "always" for power loss
    backend: str = "file"
    kv_dtype: str | None = None  # default: the model's dtype
    # decode steps: "auto" (CUDA graphs on a CUDA model, else eager), "on" (graphs; CUDA only), "padded" (the
    # graphs' static padded step run uncaptured: same kernels and shapes, the exactness reference), "off"
    graphs: str = "auto"
    # batch-invariant linear layers and RMSNorm (serve/invariant.py; the attention kernel is batch-invariant
    # always): a request's tokens do not depend on what else is in the batch, so a request resumed after a crash
    # equals the one run alone whatever arrives after the recovery. None (the default): on for a CUDA model (its
    # Triton GEMM is faster than cuBLAS at these shapes: results/serve_throughput-h200.json), off on the CPU,
    # where True runs torch ops built to be row-invariant (0.24-0.48x the default's tokens/s on the tiny test
    # model: serve/DESIGN.md) or, under Triton's interpreter, the Triton kernels. False: cuBLAS and torch's norms.
    # Logged.
    invariant: bool | None = None
    # True: the epoch of step N is written by the runtime's background writer while step N+1 computes
    # (Runtime.checkpoint_async); step() then returns step N's output once its epoch is committed, one step late
    async_epochs: bool = False
    # how a step's epoch is written: "runtime" (Runtime.checkpoint / checkpoint_async: a scan of the pool's dirty
    # flags, the whole state as JSON, the log written on this thread or by the runtime's Python writer) or "c"
    # (serve/stepepochs.py: the step's rows gathered on the device into a pinned ring before the sampler's sync,
    # cached metadata fragments, the epoch laid out, checksummed and stored by the GIL-free C writer; steps that
    # do not fit fall back to "runtime"); "auto": "c" for a CUDA model where the C writer is built, else
    # "runtime". Not logged (like async_epochs).
    step_epochs: str = "auto"
    # async_epochs on step epochs: the most steps whose outputs wait for their epochs to commit at once (the step
    # waits for the oldest when more are held; outputs committed by a step's end leave then, merged); the
    # generic path holds one; a ring slot of pinned memory per held step. Not logged.
    async_depth: int = 24
    # a fresh engine prepares at construction what its first steps would otherwise wait for or run beside: the
    # log's next segment (created, faulted in, registered with the driver: ~0.25 s on the H200 host for 0.5 GiB,
    # which beside the first decode steps cost them throughput and p99) and the step epochs' pinned bulk buffer
    # for a full prefill. Construction takes that much longer (benchmarks report it apart). Not logged.
    prepare_ahead: bool = True
    # eager forwards on a side stream before each decode graph's capture (lazy initialisation: cuBLAS handles and
    # workspaces, SDPA backend choice). Each is a Python forward on the host; a recovering engine captures the
    # first step's graph beside the restore's copy threads (serve/DESIGN.md, "The restore's critical path").
    # Not logged.
    capture_warmups: int = 2
    # a pinned mirror of the log (cuda/mirror.py): a follower thread copies each committed epoch into host memory
    # the GPU reads directly, held by a keeper process (core/keeper.py) that outlives this one; Engine.recover then
    # DMAs the pool from it (attached beside the log's open) instead of through a pinned ring filled from tmpfs.
    # Costs a second copy of the log in pinned host memory. CUDA models only.
    mirror: bool = False
    # full blocks shared between requests by content (a chained hash of their token ids): a request whose prompt
    # starts with cached blocks skips their prefill. Logged (the cache is part of the scheduling state).
    prefix_caching: bool = True
    # "grow": a request holds the blocks of the tokens it has (its prompt at admission, one more block when a
    # decode crosses a block boundary); when the pool runs out the lowest-priority, latest-arrived running
    # request is preempted (its blocks released, recomputed when it is admitted again). "reserve": the whole
    # budget (prompt + max_new_tokens) is taken at admission and nothing is ever preempted, at the price of
    # holding blocks a request may never use. Logged.
    admission: str = "grow"

    @classmethod
    def coerce(cls, value: EngineOptions | dict[str, Any] | None) -> EngineOptions:
        if value is None:
            return cls()
        if isinstance(value, EngineOptions):
            return value
        try:
            return cls(**dict(value))
        except TypeError as e:
            raise ConfigError(f"unknown engine option: {e}") from None


def _check_mirror(opts: EngineOptions, device: Any, *, runtime_given: bool = False) -> None:
    """EngineOptions.mirror refused up front where it cannot work: a model off the GPU, no log, or a log
    backend other than 'dram' (a Runtime handed in is checked by the engine once its log is open)."""
    if opts.mirror and (device.type != "cuda" or not opts.checkpoint or
                        (not runtime_given and opts.backend != "dram")):
        raise ConfigError("EngineOptions.mirror keeps a copy of a DRAM log for the GPU to restore from: it needs a "
                          f"CUDA model, a log and backend='dram' (this engine: {device}, backend "
                          f"{opts.backend!r}, checkpoint={opts.checkpoint})")


@dataclass
class Request:
    id: str
    ids: list[int]  # prompt + generated
    n_prompt: int
    params: SamplingParams
    key: str | None = None
    digest: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # the API layer's (kind, model, created...)
    seq: int = 0  # arrival order
    priority: int = 0  # lower runs first and is preempted last (vLLM's convention); FIFO (seq) within one
    preemptions: int = 0  # times its blocks were taken back (it was then recomputed)
    admitted: int = -1  # the step that admitted it
    n_computed: int = 0  # positions whose KV is in the pool
    row: int = -1  # sampler row
    slots: list[int] = field(default_factory=list)
    table: torch.Tensor | None = None  # the block table as a CPU int64 tensor (for the batch builder)
    status: str = "waiting"  # waiting | running | finished
    finish_reason: str | None = None
    collected: bool = False
    gen: torch.Generator | None = None
    hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of its first full blocks (derived)
    cached_upto: int = 0  # blocks of its table registered in (or shared from) the prefix cache
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per generated token (params.logprobs set)
    _params_dict: dict[str, Any] | None = None
    _lp_admitted: tuple[int, list[Any]] | None = None  # (admitted step, its log-probabilities then) for the meta
    _frag_key: Any = None  # the cached JSON fragment of this request in the epoch metadata, and what it holds
    _frag: bytes = b""

    @property
    def generated(self) -> list[int]:
        return self.ids[self.n_prompt:]

    def params_dict(self) -> dict[str, Any]:
        if self._params_dict is None:
            self._params_dict = self.params.to_dict()
        return self._params_dict


@dataclass
class StepOutput:
    step: int
    epoch: int | None
    new_tokens: dict[str, list[int]]  # request id -> tokens this step (committed)
    finished: list[str]
    batch_tokens: int = 0
    forward_s: float = 0.0
    checkpoint_s: float = 0.0
    epoch_bytes: int = 0
    graph: bool = False  # the forward was a static decode step (captured or padded)
    steps: int = 1  # engine steps this output covers (async_epochs: several held steps leave together)
    starts: dict[str, int] = field(default_factory=dict)  # request id -> index of its first new token here
    reasons: dict[str, str] = field(default_factory=dict)  # request id -> finish reason (finished here)


class _WarmCapture:
    """A decode graph captured on a helper thread while the main thread restores the pool. The capture holds the
    GIL for most of its ~0.2 s (a Python forward traced three times); the switch interval is cut to 0.2 ms
    meanwhile so the restore's driving thread and its copy threads get the GIL back promptly between chunks."""

    SWITCH_S = 2e-4

    def __init__(self, graphs: DecodeGraphs, n: int, keys: int, device: torch.device) -> None:
        import sys
        import threading

        self.ok = False
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._sys = sys
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, self.SWITCH_S))

        def run() -> None:
            t = time.perf_counter()
            try:
                # the grad mode is per thread: the step captures under inference_mode (_forward_and_sample)
                with torch.cuda.device(device), torch.inference_mode():
                    self.ok = graphs.prepare(n, keys)
            except BaseException as e:  # noqa: BLE001 - the bucket then captures lazily at the first step
                self.error = e
            self.seconds = time.perf_counter() - t

        self._thread = threading.Thread(target=run, name="concordia-warm-capture", daemon=True)
        self._thread.start()

    def join(self) -> dict[str, float]:
        self._thread.join()
        self._sys.setswitchinterval(self._switch)
        return {"warm_capture_s": self.seconds, "warm_captured": float(self.ok)}


def _merge(outs: list[StepOutput]) -> StepOutput:
    """Consecutive steps' outputs as one (async_epochs: held steps whose epochs committed together)."""
    m = StepOutput(outs[-1].step, outs[-1].epoch, {}, [], graph=all(o.graph for o in outs), steps=0)
    for o in outs:
        for rid, toks in o.new_tokens.items():
            if rid in m.new_tokens:
                m.new_tokens[rid] = m.new_tokens[rid] + list(toks)
            else:
                m.new_tokens[rid] = list(toks)
                m.starts[rid] = o.starts[rid]
        m.finished += o.finished
        m.reasons.update(o.reasons)
        m.batch_tokens += o.batch_tokens
        m.forward_s += o.forward_s
        m.checkpoint_s += o.checkpoint_s
        m.epoch_bytes += o.epoch_bytes
        m.steps += o.steps
    return m


class Engine:
    """``Engine(model, log_dir, options)``; ``submit()`` requests, ``step()`` until idle; after a crash,
    ``Engine.recover(log_dir, model)`` continues every request from the last committed step."""

    def __init__(self, model: Any, log_dir: str | Path | None, options: EngineOptions | dict[str, Any] | None = None,
                 *, tokenizer: Any = None, _recovering: dict[str, Any] | None = None, _runtime: Any = None) -> None:
        from .. import runtime as _rt

        self.opts = opts = EngineOptions.coerce(options)
        if opts.checkpoint and log_dir is None:
            raise ConfigError("an engine that checkpoints needs a log directory (or options checkpoint=False)")
        fresh_dir = _runtime is None or _runtime.epoch is not None  # a Runtime handed in opened the dir itself
        if (_recovering is None and log_dir is not None and fresh_dir and Path(log_dir).is_dir()
                and any(Path(log_dir).iterdir())):
            raise ConfigError(f"{log_dir} already holds a log; continue it with Engine.recover(log_dir, model) "
                              "or pass an empty directory")
        self.model = model
        p = next(model.parameters())
        self.device = p.device
        if _recovering is not None:
            self.geo = PoolGeometry(**_recovering["geometry"])
        else:
            dt = getattr(torch, opts.kv_dtype) if opts.kv_dtype else p.dtype
            self.geo = plan_pool(model.config, num_blocks=opts.num_blocks, block_size=opts.block_size, dtype=dt)
        if opts.max_model_len > self.geo.slots:
            raise ConfigError(f"max_model_len={opts.max_model_len} is more than the pool's {self.geo.slots} slots; "
                              "raise num_blocks or lower max_model_len")
        install(model)
        if opts.invariant is None:
            self.opts = opts = dataclasses.replace(opts, invariant=self.device.type == "cuda")
        if opts.invariant:
            if self.device.type not in ("cuda", "cpu"):
                raise ConfigError(f"invariant=True runs Triton kernels on a CUDA GPU or torch ops on the CPU; the "
                                  f"model is on {self.device}")
            from . import invariant

            invariant.install(model)
        # the paged attention kernel on CUDA (batch-invariant, no gather); on the CPU its batches computed by torch
        # ops in the invariant mode (invariant.TorchAttention); gather + SDPA otherwise
        self.kernel = kernel_attention(self.device, bool(opts.invariant))
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.attn_bq = attention.block_q(int(cfg.num_attention_heads) // self.geo.kv_heads) if self.kernel else 0
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        mode = opts.graphs
        if mode not in ("auto", "on", "padded", "off"):
            raise ConfigError(f"graphs={mode!r}; use auto, on, padded or off")
        if mode == "on" and self.device.type != "cuda":
            raise ConfigError(f"graphs='on' captures CUDA graphs; the model is on {self.device}: use 'auto', "
                              "'padded' or 'off'")
        if mode == "auto":
            mode = "on" if self.device.type == "cuda" else "off"
        scratch = 0 if mode == "off" else scratch_blocks_for(opts.max_running, self.geo.block_size)
        self.pool = KVPool(self.geo, self.device, zeroed=_recovering is None, scratch_blocks=scratch)
        self.graphs = None if mode == "off" else DecodeGraphs(self, mode)
        self.blocks = BlockPool(self.geo.num_blocks, self.geo.block_size)
        self.tokens = np.zeros(-(-self.geo.slots // TOKEN_BLOCK) * TOKEN_BLOCK, np.int32)
        self.tokens_dirty = np.zeros(len(self.tokens) // TOKEN_BLOCK, np.uint8)
        self.rng = RngRows(opts.max_running, self.device)
        # the sampler's rules, and each generated token's log-probabilities (requests asking for them) per slot
        self.sampler = Sampler(opts.max_running, int(self.lm_head.weight.shape[0]), self.device, opts.max_model_len)
        self.tokenizer = tokenizer  # stop strings are matched in its text (not logged: pass the same to recover)
        self.stops = StopStrings(tokenizer) if tokenizer is not None else None
        self.lp = np.zeros(self.geo.slots * LP_WORDS, np.float32)
        self.lp_dirty = np.zeros(-(-self.lp.nbytes // 512), np.uint8)
        self.done_slot_bytes = -(-(DONE_HEAD + 4 * opts.max_model_len + DONE_JSON_BYTES) // 512) * 512
        self.done = np.zeros(max(1, opts.keep_finished) * self.done_slot_bytes, np.uint8)
        self.done_dirty = np.zeros(len(self.done) // 512, np.uint8)
        self._done_of: dict[str, int] = {}  # finished request id -> its slot of ``done`` (-1: kept in the metadata)
        self._done_free = list(range(max(1, opts.keep_finished) - 1, -1, -1))
        self.fingerprint = model_fingerprint(model) if _recovering is None else str(_recovering["fingerprint"])
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.finished: dict[str, Request] = {}  # insertion order = finish order
        self.by_key: dict[str, str] = {}
        self.step_no = 0
        self._seq = itertools.count()
        self.recovered_epoch: int | None = None
        self.recovered: Any = None  # the Runtime's Recovered (timings) after Engine.recover
        self.recover_phases: dict[str, float] = {}  # Engine.recover: seconds per phase
        # async_epochs: the steps whose epochs are being written, oldest first: (output, PendingEpoch/StepPending)
        self._held: deque[tuple[StepOutput, Any]] = deque()
        self._meta_static: bytes | None = None
        self.runtime = None
        self.fast: Any = None  # StepEpochs (step_epochs="c")
        self.mirror: Any = None  # cuda.mirror.LogMirror (EngineOptions.mirror)
        self._fast_rows: Any = None  # this step's feeds when it may take the step-epoch path
        if opts.step_epochs not in ("runtime", "c", "auto"):
            raise ConfigError(f"step_epochs={opts.step_epochs!r}; use runtime, c or auto")
        if opts.async_depth < 1:
            raise ConfigError(f"async_depth={opts.async_depth}; it must be at least 1")
        if opts.admission not in ("grow", "reserve"):
            raise ConfigError(f"admission={opts.admission!r}; use grow or reserve")
        self.preempted = 0  # preemptions by this engine (not logged: a counter for metrics and benchmarks)
        if opts.capture_warmups < 0:
            raise ConfigError(f"capture_warmups={opts.capture_warmups}; it must be 0 or more")
        _check_mirror(opts, self.device, runtime_given=_runtime is not None)
        if opts.checkpoint:
            from . import stepepochs

            use_c = opts.step_epochs == "c" or (opts.step_epochs == "auto" and self.device.type == "cuda"
                                                and stepepochs.available())
            self.runtime = _runtime if _runtime is not None else _rt.Runtime(
                str(log_dir), fsync=opts.fsync, backend=opts.backend, on_compaction_error="warn",
                compact_after_bytes=max(256 << 20, 2 * self.geo.nbytes), log_options=self._log_options())
            self._register(fresh=_recovering is None)
            # the next segments of a mapped (dram) log made ahead by the log's worker, never by a roll on the
            # step's path (a GPU's registered ones pinned too): two, since a prefill chunk's epoch fills one
            self.runtime.log.prepare_spares(SPARE_SEGMENTS)
            # a compaction keeps only what the compacted step's requests still need (their blocks' rows, token
            # pages and generator rows): a finished request's rows are dead, and the base is <= the live bytes
            self.runtime.set_compaction_live(self._live_pages)
            if opts.step_epochs == "c" and not stepepochs.available():
                raise ConfigError("step_epochs='c' needs the C epoch writer, which is not built here "
                                  "(scripts/build_ext.sh, or pip install with a C compiler); use 'auto' or 'runtime'")
            if use_c:
                # pipelined: a ring slot per held step, one being gathered, one spare
                self.fast = stepepochs.StepEpochs(
                    self, slots=opts.async_depth + 2 if opts.async_epochs else stepepochs.SLOTS)
            if _recovering is None:
                # a fresh log's first epoch: the region definitions and the empty engine (step 0), so the first
                # step's epoch (a prefill, the largest) need not carry the definitions and may take the step path
                self.runtime.checkpoint(meta=JSONText(self._meta_json()))
                if opts.prepare_ahead:
                    if self.fast is not None:
                        self.fast.prepare_bulk(opts.max_batch_tokens)
                    self.runtime.log.wait_spare(timeout_s=60.0)
                self._start_mirror()

    def _start_mirror(self) -> None:
        """EngineOptions.mirror: the follower of this engine's log (a recovered engine starts it once its pool
        is restored: the mirror it was restored from stays as it was until then)."""
        if not self.opts.mirror or self.runtime is None:
            return
        lo = getattr(self.runtime.log, "options", None)
        if lo is None or not lo.uses_mapped:
            raise ConfigError("EngineOptions.mirror follows a DRAM log of preallocated segments: use backend='dram' "
                              f"(a tmpfs directory); this log's backend is {getattr(lo, 'backend', '?')!r}")
        from ..cuda.mirror import LogMirror

        self.mirror = LogMirror(self.runtime.log_dir, self.device.index)

    def _log_options(self) -> dict[str, Any] | None:
        """The mapped log segments hold the engine's largest step's epoch (a full prefill of ``max_batch_tokens``
        rows) with room to spare, so that epoch lands in a segment prepared ahead (created, faulted in and, on a
        GPU, registered off the step) rather than in one made on the spot: 256 MiB to 1 GiB on a GPU, 16 MiB to
        1 GiB on the CPU (the active segment and two spares are allocated tmpfs memory)."""
        if self.opts.backend != "dram":
            return None
        if self.device.type != "cuda":
            big = self.opts.max_batch_tokens * self.geo.row_bytes * 5 // 4
            return {"mapped_segment_bytes": min(1 << 30, max(16 << 20, -(-big // (16 << 20)) * (16 << 20)))}
        big = self.opts.max_batch_tokens * self.geo.row_bytes + (64 << 20)
        return {"mapped_segment_bytes": min(1 << 30, max(256 << 20, -(-big // (64 << 20)) * (64 << 20)))}

    def _live_pages(self, meta: Any) -> dict[str, np.ndarray] | None:
        """The pages of ``kv``, ``tokens`` and ``rng`` that the engine state logged as ``meta`` needs: every block
        a running request's table names or the block cache keeps (its rows, their token pages) and the running
        requests' generator rows. None (keep everything) for metadata this code does not read."""
        m = meta.get(META_KEY) if isinstance(meta, dict) else None
        if not isinstance(m, dict) or m.get("version") != META_VERSION:
            return None
        geo, bs = self.geo, self.geo.block_size
        blocks = {int(b) for d in m.get("running", ()) for b in d["table"]}
        cache = m.get("blocks")
        if isinstance(cache, dict):  # the prefix cache's blocks outlive their requests
            blocks.update(int(e[0]) for e in cache.get("cached", ()))
        b = np.array(sorted(blocks), dtype=np.int64)
        slots = (b[:, None] * bs + np.arange(bs)).ravel()
        ppr = geo.row_bytes // geo.page_bytes
        kv = (slots[:, None] * ppr + np.arange(ppr)).ravel()
        tok = np.unique(slots // TOKEN_BLOCK)
        rng_ppr = self.rng.row_bytes // 512
        rows = np.array(sorted({int(d["row"]) for d in m.get("running", ())}), dtype=np.int64)
        rng = (rows[:, None] * rng_ppr + np.arange(rng_ppr)).ravel()
        pps = self.done_slot_bytes // 512
        kept = np.array(sorted(int(d[0]) for d in m.get("finished", ()) if isinstance(d, list)), dtype=np.int64)
        done = (kept[:, None] * pps + np.arange(pps)).ravel()
        return {"kv": kv.astype(np.int64), "tokens": tok.astype(np.int64), "rng": rng.astype(np.int64),
                "done": done.astype(np.int64)}

    def page_regions(self) -> list[tuple[bytes, np.ndarray, np.ndarray]]:
        """The host regions of 512-byte pages after ``rng``, in registration order: (name, bytes, dirty flags)."""
        return [(b"logprobs", self.lp.view(np.uint8), self.lp_dirty), (b"done", self.done, self.done_dirty)]

    def _register(self, *, fresh: bool) -> None:
        rt, geo = self.runtime, self.geo
        assert rt is not None
        rt.register("kv", self.pool.arena, kind="paged", page_bytes=geo.page_bytes, block_bytes=geo.row_bytes,
                    dirty_blocks=self.pool.dirty, initially_zero=fresh)
        rt.register("tokens", self.tokens, kind="paged", page_bytes=512, block_bytes=512,
                    dirty_blocks=self.tokens_dirty, initially_zero=fresh)
        rt.register("rng", self.rng.buf, kind="paged", page_bytes=512, block_bytes=self.rng.row_bytes,
                    dirty_blocks=self.rng.dirty, initially_zero=fresh)
        rt.register("logprobs", self.lp, kind="paged", page_bytes=512, block_bytes=512,
                    dirty_blocks=self.lp_dirty, initially_zero=fresh)
        rt.register("done", self.done, kind="paged", page_bytes=512, block_bytes=512, dirty_blocks=self.done_dirty,
                    initially_zero=fresh)

    # -- requests ----------------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, *, request_id: str | None = None,
               key: str | None = None, digest: str = "", info: dict[str, Any] | None = None,
               priority: int = 0) -> Request:
        """Queue a request (it joins the batch at the next step); raises ContextLengthError / QueueFullError.
        ``priority``: lower values are admitted first and preempted last; FIFO among equal priorities."""
        self._materialize()
        params.check()
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigError(f"priority={priority!r} must be an integer (lower runs first)")
        if params.stop and self.stops is None:
            raise ConfigError("stop strings are matched in the text: this engine has no tokenizer "
                              "(Engine(..., tokenizer=...))")
        if not prompt:
            raise ConfigError("the prompt is empty: a request needs at least one token")
        total = len(prompt) + params.max_new_tokens
        if total > self.opts.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.opts.max_model_len} tokens; the request has "
                f"{len(prompt)} prompt tokens + max_tokens {params.max_new_tokens} = {total}: shorten the "
                "prompt or lower max_tokens")
        if len(self.waiting) >= self.opts.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.opts.max_waiting} requests); retry later")
        if key is not None and key in self.by_key:
            raise ConfigError(f"Idempotency-Key {key!r} already names request {self.by_key[key]}")
        rid = request_id or f"req-{uuid.uuid4().hex[:20]}"
        if rid in self.running or rid in self.finished or any(r.id == rid for r in self.waiting):
            raise ConfigError(f"request id {rid!r} is in use")
        r = Request(rid, [int(t) for t in prompt], len(prompt), params, key, digest, dict(info or {}),
                    seq=next(self._seq), priority=int(priority))
        self._enqueue(r)
        if key is not None:
            self.by_key[key] = rid
        return r

    def get(self, request_id: str) -> Request | None:
        return self.running.get(request_id) or self.finished.get(request_id) or next(
            (r for r in self.waiting if r.id == request_id), None)

    def get_by_key(self, key: str) -> Request | None:
        rid = self.by_key.get(key)
        return None if rid is None else self.get(rid)

    def collect(self, request_id: str) -> None:
        """The caller delivered this finished output; it may now be evicted first (logged at the next step)."""
        self._materialize()
        r = self.finished.get(request_id)
        if r is not None:
            r.collected = True

    def abort(self, request_id: str) -> None:
        self._materialize()
        r = self.running.get(request_id)
        if r is not None:
            self._retire(r, "abort")
            return
        for w in list(self.waiting):
            if w.id == request_id:
                self.waiting.remove(w)
                self._forget_key(w)

    def delivered(self, r: Request) -> tuple[list[int], str | None]:
        """``r``'s generated tokens and finish reason as of the last output that left the engine (with
        ``async_epochs`` the engine is one step ahead of it: that step's tokens are not committed yet)."""
        for held, _ in self._held:  # the oldest held step with tokens of r: those and later ones are not out
            if r.id in held.new_tokens:
                return r.generated[: held.starts[r.id]], None
        return list(r.generated), r.finish_reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._held)

    # -- the step ----------------------------------------------------------------------------------------
    def _enqueue(self, r: Request) -> None:
        """Into the waiting queue in ``(priority, seq)`` order (a preempted request keeps its place by arrival)."""
        key = (r.priority, r.seq)
        i = len(self.waiting)
        while i and (self.waiting[i - 1].priority, self.waiting[i - 1].seq) > key:
            i -= 1
        self.waiting.insert(i, r)

    def _admit(self) -> None:
        """The step's admission, a pure function of the logged state (running requests already hold the blocks
        of their tokens: ``_grow`` ran at the end of the last step): the waiting queue is admitted head first
        while a sampler row and its blocks are there (its cached prefix shared, the rest allocated); a head that
        does not fit waits and nobody overtakes it, unless a running request of strictly lower priority can be
        preempted for it (``grow`` only)."""
        grow = self.opts.admission == "grow"
        while self.waiting:
            r = self.waiting[0]
            hit = self._lookup(r)
            need = self._blocks_needed(r, len(hit))
            if need + len(hit) > self.geo.num_blocks:
                raise AssertionError(f"request {r.id} needs {need} blocks of {self.geo.num_blocks}: submit checks")
            avail = self.blocks.n_available - sum(1 for b in hit if self.blocks.ref(b) == 0)
            if len(self.running) < self.opts.max_running and need <= avail:
                self.waiting.popleft()
                self._start(r, hit, need)
                continue
            victim = self._victim() if grow else None
            if victim is None or victim.priority <= r.priority:
                break  # the head waits for blocks (or a row), nobody overtakes it
            self._preempt(victim)

    def _blocks_needed(self, r: Request, hits: int) -> int:
        total = len(r.ids) if self.opts.admission == "grow" else r.n_prompt + r.params.max_new_tokens
        return blocks_for(total, self.geo.block_size) - hits

    def _lookup(self, r: Request) -> list[int]:
        """The cached blocks of ``r``'s prefix it may share: whole blocks, never the one holding its last token
        (that token's KV is computed, so the request has logits to sample from), each block's token ids compared
        with the tokens region (the key covers the chain before it)."""
        if not self.opts.prefix_caching:
            return []
        bs = self.geo.block_size
        n = (len(r.ids) - 1) // bs
        if len(r.hashes) < n:
            r.hashes = chain_hashes(r.ids, bs, n, r.hashes)
        hit = self.blocks.lookup(r.hashes[:n])
        for i, b in enumerate(hit):
            if not np.array_equal(self.tokens[b * bs: (b + 1) * bs], r.ids[i * bs: (i + 1) * bs]):
                return hit[:i]  # a stale key would be a bookkeeping bug; a miss is always safe
        return hit

    def _start(self, r: Request, hit: list[int], need: int) -> None:
        self.blocks.share(r.id, hit)
        self.blocks.allocate(r.id, need)
        r.n_computed = len(hit) * self.geo.block_size
        r.cached_upto = len(hit)
        self._bind_slots(r)
        r.status, r.admitted, r.row = "running", self.step_no, self.rng.take()
        r._frag_key = None
        self._write_tokens(r, r.n_computed, len(r.ids))
        if not r.params.greedy:
            if r.gen is None:  # a preempted request goes on with the generator it had
                r.gen = new_generator(self.device, r.params.seed)
            self.rng.save(r.row, r.gen)
        self.running[r.id] = r

    def _grow(self) -> None:
        """Each running request (best priority first) gets a block when its tokens crossed into a new one; when
        none is free or evictable the worst running request is preempted (possibly the one asking). Run at the
        end of every step, after sampling, so each epoch's tables hold every token its requests have."""
        bs = self.geo.block_size
        for r in sorted(self.running.values(), key=lambda q: (q.priority, q.seq)):
            if r.id not in self.running:
                continue  # preempted for an earlier one
            need = blocks_for(len(r.ids), bs) - len(self.blocks.tables[r.id])
            if need <= 0:
                continue
            while need > self.blocks.n_available:
                victim = self._victim()
                assert victim is not None
                self._preempt(victim)
                if victim is r:
                    break
            if r.id in self.running:
                have = len(r.slots)
                self.blocks.allocate(r.id, need)
                self._bind_slots(r)
                self._write_tokens(r, have, len(r.ids))  # the sampled token that crossed into the new block
                r._frag_key = None  # its logged table changed

    def _victim(self) -> Request | None:
        """The running request preempted first: the lowest priority (largest value), the latest arrival."""
        return max(self.running.values(), key=lambda q: (q.priority, q.seq), default=None)

    def _preempt(self, r: Request) -> None:
        """Recompute preemption: ``r``'s blocks are released (its full ones stay in the prefix cache until
        evicted) and it waits again with every token it has; its generator goes with it."""
        del self.running[r.id]
        self.blocks.free(r.id)
        self.rng.give_back(r.row)
        r.status, r.row, r.slots, r.table, r.n_computed, r.cached_upto = "waiting", -1, [], None, 0, 0
        r.preemptions += 1
        self.preempted += 1
        self._enqueue(r)

    def _cache_blocks(self, r: Request) -> None:
        """Register ``r``'s blocks whose every position's KV is now in the pool (after a forward)."""
        if not self.opts.prefix_caching:
            return
        bs = self.geo.block_size
        n = r.n_computed // bs
        if n <= r.cached_upto:
            return
        r.hashes = chain_hashes(r.ids, bs, n, r.hashes)
        table = self.blocks.tables[r.id]
        for i in range(r.cached_upto, n):
            self.blocks.cache(table[i], r.hashes[i])
        r.cached_upto = n

    def _bind_slots(self, r: Request) -> None:
        table = self.blocks.tables[r.id]
        bs = self.geo.block_size
        r.table = torch.as_tensor(table, dtype=torch.long)
        have = len(r.slots) // bs
        r.slots = r.slots[: have * bs] + (np.asarray(table[have:], dtype=np.int64)[:, None] * bs
                                          + np.arange(bs)).ravel().tolist()

    def _write_tokens(self, r: Request, lo: int, hi: int) -> None:
        s = r.slots[lo:hi]
        self.tokens[s] = r.ids[lo:hi]
        for b in {x // TOKEN_BLOCK for x in s}:
            self.tokens_dirty[b] = 1
        if r.params.logprobs is not None:
            for i in range(max(lo, r.n_prompt), min(hi, len(r.slots))):  # the generated tokens' beside them
                slot = r.slots[i]
                self.lp[slot * LP_WORDS: (slot + 1) * LP_WORDS] = r.logprobs[i - r.n_prompt].pack()
                self.lp_dirty[slot * LP_WORDS * 4 // 512] = 1

    def order(self) -> list[Request]:
        return sorted(self.running.values(), key=lambda r: (r.admitted, r.digest, r.id))

    def _plan_feeds(self, reqs: list[Request]) -> list[tuple[Request, int, int]]:
        budget = self.opts.max_batch_tokens - sum(1 for r in reqs if len(r.ids) - r.n_computed == 1)
        feeds = []
        for r in reqs:
            left = len(r.ids) - r.n_computed
            n = 1 if left == 1 else min(left, max(budget, 0))
            if left > 1:
                budget -= n
            if n > 0:
                feeds.append((r, r.n_computed, r.n_computed + n))
        return feeds

    def step(self) -> StepOutput:
        """Admit, run one forward over the batch, sample, retire, commit one epoch; returns what it produced.
        With ``async_epochs``: returns what the previous step produced, once its epoch committed (this step's
        epoch is written in the background while the next step computes; ``has_work`` stays True until the
        last step's output was returned)."""
        out = self._step()
        f = self.fast
        if f is not None and f.writer is not None and (not self.has_work or self.runtime.log.lease_wanted):
            # idle, or a compaction waits to seal the log: the step-epoch writer's lease ends now (not at the next
            # step, which may be long in coming); the next step that fits takes it again
            f.suspend()
        return out

    def _step(self) -> StepOutput:
        if self.opts.async_epochs and self.runtime is not None:
            return self._step_async()
        out = self._advance()
        t1 = time.perf_counter()
        if self._fast_ready(out.step):
            t2 = time.perf_counter()
            meta = self._meta_json()
            self.fast.t["meta"] += time.perf_counter() - t2
            p = self.fast.submit(out.step, meta)
            out.epoch = p.wait()
            out.epoch_bytes = int(p.stats.total_bytes)
            out.checkpoint_s = time.perf_counter() - t1
            return out
        out.epoch = self.checkpoint()
        out.checkpoint_s = time.perf_counter() - t1
        if self.runtime is not None and self.runtime.last_stats is not None:
            out.epoch_bytes = int(self.runtime.last_stats.total_bytes)
        return out

    def _fast_ready(self, step: int) -> bool:
        return self._fast_rows is not None and self.fast.ready(step)

    def _materialize(self) -> None:
        """A deferred step epoch (pipelined) is prepared before the engine's state changes."""
        if self.fast is not None and self.fast.deferred is not None:
            self.fast.materialize()

    def _advance(self) -> StepOutput:
        if self.waiting:
            self._materialize()  # an admission changes the state
        self._admit()
        out = StepOutput(self.step_no + 1, None, {}, [])
        feeds = self._plan_feeds(self.order())
        if not feeds:
            self._materialize()  # no forward to overlap: this step's end changes the state
        # a step writing log-probabilities (a host region the step-epoch writer does not carry) takes the
        # generic epoch
        self._fast_rows = self.fast.plan(feeds) if self.fast is not None else None
        if self._fast_rows is not None and not feeds:
            self.fast.gather(out.step, self._fast_rows)
        if feeds:
            t0 = time.perf_counter()
            toks, out.graph = self._forward_and_sample(feeds)
            out.forward_s = time.perf_counter() - t0
            out.batch_tokens = sum(e - s for _, s, e in feeds)
            for (r, _, end), tok in zip(feeds, toks, strict=True):
                r.n_computed = end
                self._cache_blocks(r)
                if tok is None:
                    continue
                r.ids.append(tok)
                self._write_tokens(r, len(r.ids) - 1, len(r.ids))
                if r.gen is not None:
                    self.rng.save(r.row, r.gen)
                out.new_tokens[r.id] = [tok]
                out.starts[r.id] = len(r.ids) - 1 - r.n_prompt
                reason = self._finish_reason(r, tok)
                if reason is not None:
                    self._retire(r, reason)
                    out.finished.append(r.id)
                    out.reasons[r.id] = reason
        if self.opts.admission == "grow":
            self._grow()
        self.step_no += 1
        self._evict_finished()
        return out

    def _step_async(self) -> StepOutput:
        """Step N+1's forward runs while the writer commits step N's epoch (a step epoch is handed to the C
        writer right after N+1's forward was launched); outputs leave once their epochs committed."""
        assert self.runtime is not None
        if not self.waiting and not self.running and self._held:
            return self._out(self._release(0))  # nothing left to run: the last epochs, then their outputs
        out = self._advance()
        t1 = time.perf_counter()
        released: list[StepOutput] = []
        if self._held and not hasattr(self._held[-1][1], "poll"):
            released += self._release(0)  # a generic epoch in flight commits first (the step path leases after it)
        if self._fast_ready(out.step):
            # prepared when the state is about to change, or after the next forward's launch (_gather_rows)
            self._held.append((out, self.fast.defer(out.step, self._meta_json)))
            out.checkpoint_s = time.perf_counter() - t1
            released += self._release(self.opts.async_depth)
        else:
            released += self._release(0)  # the generic path: one epoch in flight at a time
            if self.fast is not None:
                self.fast.suspend()
            self._held.append((out, self.runtime.checkpoint_async(meta=JSONText(self._meta_json()))))
            out.checkpoint_s = time.perf_counter() - t1
        return self._out(released)

    def _release(self, depth: int) -> list[StepOutput]:
        """The held steps' outputs that may leave, oldest first: every one whose epoch committed (polled, no
        wait), after waiting for the oldest while more than ``depth`` are held (a generic epoch is waited for)."""
        out: list[StepOutput] = []
        while self._held:
            held, pending = self._held[0]
            poll = getattr(pending, "poll", None)
            if len(self._held) <= depth and poll is not None and not poll():
                break
            t0 = time.perf_counter()
            held.epoch = int(pending.wait())
            held.checkpoint_s += time.perf_counter() - t0
            stats = getattr(pending, "stats", None)
            if stats is not None:
                held.epoch_bytes = int(stats.total_bytes)
            self._held.popleft()
            out.append(held)
        return out

    def _out(self, released: list[StepOutput]) -> StepOutput:
        if not released:
            first = self._held[0][0].step if self._held else self.step_no + 1
            return StepOutput(first - 1, None, {}, [], steps=0)
        return released[0] if len(released) == 1 else _merge(released)

    @torch.inference_mode()
    def _forward_and_sample(self, feeds: list[tuple[Request, int, int]]) -> tuple[list[int | None], bool]:
        if self.graphs is not None and all(e - s == 1 and e == len(r.ids) for r, s, e in feeds):
            logits = self.graphs.run(feeds)  # a decode-only step: the static (graph) path, if a bucket holds it
            if logits is not None:
                self._gather_rows()
                toks = self.sampler.sample(logits, [r for r, _, _ in feeds])
                return list(toks), True
        dev = self.device
        ids = [t for r, s, e in feeds for t in r.ids[s:e]]
        batch: Any
        if self.kernel:
            batch, positions, last = build_kernel_batch(
                self.pool, [self.blocks.tables[r.id] for r, _, _ in feeds], [r.slots for r, _, _ in feeds],
                [s for _, s, _ in feeds], [e for _, _, e in feeds], self.attn_bq, dev)
        else:
            batch, positions, last = build_batch(
                self.pool, [r.table for r, _, _ in feeds], [s for _, s, _ in feeds],  # type: ignore[misc]
                [e for _, _, e in feeds], dev)
        with sdpa_backends(dev):
            h = self.decoder(input_ids=torch.as_tensor([ids], device=dev), position_ids=positions.unsqueeze(0),
                             use_cache=False, concordia_batch=batch).last_hidden_state
        self.pool.dirty.index_fill_(0, batch.write_slots, 1)
        self._gather_rows()
        sampling = [i for i, (r, _, e) in enumerate(feeds) if e == len(r.ids)]
        result: list[int | None] = [None] * len(feeds)
        if not sampling:
            return result, False
        rows = last[torch.as_tensor(sampling, device=dev)]
        logits = self.lm_head(h[0, rows]).float()
        toks = self.sampler.sample(logits, [feeds[i][0] for i in sampling])
        for i, t in zip(sampling, toks, strict=True):
            result[i] = t
        return result, False

    def _gather_rows(self) -> None:
        """Step epochs: the rows the forward just wrote go to the ring in stream order, before the sampler's
        sync (which then covers the copy)."""
        if self._fast_rows is not None:
            self.fast.gather(self.step_no + 1, self._fast_rows)
        if self.fast is not None and (self.fast.prepared is not None or self.fast.deferred is not None):
            self.fast.send(wait_copy=False)  # the previous step's epoch (pipelined), while this forward computes

    def _finish_reason(self, r: Request, tok: int) -> str | None:
        n = len(r.ids) - r.n_prompt
        if n >= r.params.min_tokens:
            if not r.params.ignore_eos and tok in r.params.eos_token_ids:
                return "stop"
            if r.params.stop and self.stops is not None and self.stops.hit(r.params, r.ids[r.n_prompt:]):
                return "stop"
        if len(r.ids) - r.n_prompt >= r.params.max_new_tokens or len(r.ids) >= self.opts.max_model_len:
            return "length"
        return None

    def _retire(self, r: Request, reason: str) -> None:
        del self.running[r.id]
        self.blocks.free(r.id)
        self.rng.give_back(r.row)
        r.status, r.finish_reason, r.row, r.slots, r.gen, r.table = "finished", reason, -1, [], None, None
        r.hashes = []
        self.finished[r.id] = r

    def _forget_key(self, r: Request) -> None:
        if r.key is not None and self.by_key.get(r.key) == r.id:
            del self.by_key[r.key]

    def _evict_finished(self) -> None:
        extra = len(self.finished) - self.opts.keep_finished
        if extra <= 0:
            return
        order = [r for r in self.finished.values() if r.collected] + [
            r for r in self.finished.values() if not r.collected]
        for r in order[:extra]:
            del self.finished[r.id]
            self._forget_key(r)
            k = self._done_of.pop(r.id, -1)
            if k >= 0:
                self._done_free.append(k)  # its bytes stay until a new output takes the slot (compaction drops them)

    # -- epochs ------------------------------------------------------------------------------------------
    def checkpoint(self) -> int | None:
        if self.runtime is None:
            return None
        if self.fast is not None:
            self.fast.suspend()  # the generic path appends: the step-epoch writer's lease ends first
        return int(self.runtime.checkpoint(meta=JSONText(self._meta_json())))

    def _meta_json(self) -> bytes:
        """``encode_json({META_KEY: self._meta()})`` up to key order and the time, from cached fragments: the
        static part once, each request's once per state (running: its counters spliced in)."""
        if self._meta_static is None:
            self._meta_static = encode_json({
                "version": META_VERSION, "geometry": self.geo.describe(), "fingerprint": self.fingerprint,
                "options": {k: getattr(self.opts, k) for k in LOGGED_OPTIONS}})[1:-1]
        parts = [b'{"%s":{' % META_KEY.encode(), self._meta_static,
                 b',"step":%d,"next_seq":%d,"time":%s,"running":[' % (self.step_no, self._peek_seq(),
                                                                     repr(time.time()).encode())]
        frags = []
        for r in self.running.values():
            if r._frag_key != "running":
                r._frag_key, r._frag = "running", encode_json({
                    **self._common(r), "row": r.row, "admitted": r.admitted,
                    "table": self.blocks.tables[r.id], "prompt_rows": "logged",
                    **self._admitted_logprobs(r)})[:-1] + b',"n_tokens":'
            frags.append(b'%s%d,"n_computed":%d}' % (r._frag, len(r.ids), r.n_computed))
        parts.append(b",".join(frags))
        parts.append(b'],"blocks":')
        parts.append(self.blocks.state_json())
        parts.append(b',"waiting":[')
        frags = []
        for r in self.waiting:
            if r._frag_key != "waiting":
                r._frag_key, r._frag = "waiting", encode_json(self._waiting_dict(r))
            frags.append(r._frag)
        parts.append(b",".join(frags))
        parts.append(b'],"finished":[')
        frags = []
        for r in self.finished.values():
            key = ("finished", r.collected)
            if r._frag_key != key:
                r._frag_key, r._frag = key, encode_json(self._finished_entry(r))
            frags.append(r._frag)
        parts.append(b",".join(frags))
        parts.append(b"]}}")
        return b"".join(parts)

    def _finished_entry(self, r: Request) -> Any:
        """A finished output in the metadata: ``[slot, collected]`` of the ``done`` slot that holds it (written
        the first time it is asked for, its pages flagged for the next epoch), or the whole entry when it is
        larger than a slot or no slot is free."""
        k = self._done_of.get(r.id)
        if k is None:
            k = self._done_of[r.id] = self._write_done(r)
        if k < 0:
            return {**self._common(r), "generated": r.generated, "reason": r.finish_reason, "collected": r.collected,
                    **self._finished_logprobs(r)}
        return [k, int(r.collected)]

    def _write_done(self, r: Request) -> int:
        doc = encode_json({**self._common(r), "reason": r.finish_reason, **self._finished_logprobs(r)})
        ids = np.asarray(r.generated, dtype=np.int32)
        n = DONE_HEAD + 4 * len(ids) + len(doc)
        if n > self.done_slot_bytes or not self._done_free:
            return -1
        k = self._done_free.pop()
        at = k * self.done_slot_bytes
        self.done[at: at + DONE_HEAD].view(np.uint32)[:] = (DONE_MAGIC, len(ids), len(doc), 0)
        self.done[at + DONE_HEAD: at + DONE_HEAD + 4 * len(ids)] = ids.view(np.uint8)
        self.done[at + DONE_HEAD + 4 * len(ids): at + n] = np.frombuffer(doc, np.uint8)
        self.done_dirty[at // 512: -(-(at + n) // 512)] = 1
        return k

    def _read_done(self, k: int) -> dict[str, Any]:
        """The finished entry slot ``k`` of ``done`` holds (as ``_finished_entry`` wrote it whole)."""
        at = k * self.done_slot_bytes
        magic, n_ids, n_doc, _ = (int(x) for x in self.done[at: at + DONE_HEAD].view(np.uint32))
        if magic != DONE_MAGIC or DONE_HEAD + 4 * n_ids + n_doc > self.done_slot_bytes:
            raise RecoveryError(f"finished output slot {k} of the log's 'done' region is not one this engine "
                                "wrote (damaged, or a log of other code)")
        ids = self.done[at + DONE_HEAD: at + DONE_HEAD + 4 * n_ids].view(np.int32).tolist()
        d = json.loads(bytes(self.done[at + DONE_HEAD + 4 * n_ids: at + DONE_HEAD + 4 * n_ids + n_doc]))
        d["generated"] = ids
        return dict(d)

    @staticmethod
    def _common(r: Request) -> dict[str, Any]:
        return {"id": r.id, "key": r.key, "digest": r.digest, "n_prompt": r.n_prompt, "seq": r.seq,
                "params": r.params_dict(), "info": r.info, "priority": r.priority, "preemptions": r.preemptions}

    @classmethod
    def _waiting_dict(cls, r: Request) -> dict[str, Any]:
        """A waiting request: its tokens (a preempted one's prompt and what it generated) and, if it was
        preempted after drawing, its generator's state (it has no sampler row while it waits)."""
        d = {**cls._common(r), "prompt": r.ids, **cls._finished_logprobs(r)}
        if r.gen is not None:
            d["rng"] = base64.b64encode(r.gen.get_state().numpy().tobytes()).decode("ascii")
        return d

    def _meta(self) -> dict[str, Any]:
        common = self._common

        return {
            "version": META_VERSION, "step": self.step_no, "next_seq": self._peek_seq(),
            "geometry": self.geo.describe(), "fingerprint": self.fingerprint,
            "options": {k: getattr(self.opts, k) for k in LOGGED_OPTIONS},
            "running": [{**common(r), "n_tokens": len(r.ids), "n_computed": r.n_computed, "row": r.row,
                         "admitted": r.admitted, "table": self.blocks.tables[r.id], "prompt_rows": "logged",
                         **self._admitted_logprobs(r)}
                        for r in self.running.values()],
            "blocks": self.blocks.state(),
            "waiting": [self._waiting_dict(r) for r in self.waiting],
            "finished": [self._finished_entry(r) for r in self.finished.values()],
            "time": time.time(),
        }

    @staticmethod
    def _finished_logprobs(r: Request) -> dict[str, Any]:
        """A finished or waiting (preempted) request's log-probabilities: it holds no slots, the metadata keeps
        them."""
        return {"logprobs": [lp.to_list() for lp in r.logprobs]} if r.params.logprobs is not None else {}

    @staticmethod
    def _admitted_logprobs(r: Request) -> dict[str, Any]:
        """A running request's log-probabilities of the tokens it had when it was admitted (a preempted one's;
        taken once per admission). Those of later tokens are in the ``logprobs`` region at their slots, which are
        its own: a block shared through the prefix cache may hold another request's rows."""
        if r.params.logprobs is None:
            return {}
        if r._lp_admitted is None or r._lp_admitted[0] != r.admitted:
            r._lp_admitted = (r.admitted, [lp.to_list() for lp in r.logprobs])
        return {"logprobs": r._lp_admitted[1]}

    def _peek_seq(self) -> int:
        n = next(self._seq)
        self._seq = itertools.count(n)
        return n

    # -- recovery ----------------------------------------------------------------------------------------
    @classmethod
    def recover(cls, log_dir: str | Path, model: Any, options: EngineOptions | dict[str, Any] | None = None,
                *, recovery: Any = None, runtime_options: dict[str, Any] | None = None,
                warm_graphs: bool = True, tokenizer: Any = None) -> Engine:
        """A new engine from the last committed step of ``log_dir``: every request continues where it was.
        Every checksum of the log is verified before any restored byte is used (at the open, or, for a GPU
        pool, by the streamed restore on the bytes it copies: on the device after each chunk's DMA by default;
        a mismatch raises ``LogCorruptError`` from here, so no engine exists to serve a block). A GPU pool is
        streamed from the log's segments to the device through a ring of pinned slots (``recovery``: the
        Runtime's RecoveryOptions, or a dict of them; ``{"streamed": False}`` restores through a host image;
        ``runtime_options``: more keyword arguments of the Runtime that continues the log). ``warm_graphs``:
        capture the decode graph the first step will replay while the pool is being restored (scratch rows
        only), so the first token is a replay. ``tokenizer``: the one the engine matched stop strings with."""
        from ..recovery import RecoveryOptions
        from ..runtime import open_to_recover

        opts = EngineOptions.coerce(options)
        rec_opts = RecoveryOptions.coerce(recovery)
        dev = next(model.parameters()).device
        cuda = dev.type == "cuda"
        _check_mirror(opts, dev)
        if opts.mirror and rec_opts.mirror is None and rec_opts.streamed:
            # the keeper's mirror, attached on a helper thread while the log opens
            from ..cuda.mirror import MirrorAttach

            rec_opts = dataclasses.replace(rec_opts, mirror=MirrorAttach(
                log_dir, dev.index if dev.index is not None else torch.cuda.current_device()))
        if rec_opts.defer_verify is None:
            # a GPU pool is streamed to the device with its checksums run on the bytes as they arrive (read
            # once); a CPU pool is replayed into its own buffer after every checksum passed at the open
            rec_opts = dataclasses.replace(rec_opts, defer_verify=("kv",) if cuda and rec_opts.streamed else ())
        t0 = time.perf_counter()
        rt, m = open_to_recover(log_dir, META_KEY, "concordia serve", fsync=opts.fsync, backend=opts.backend,
                                runtime_options={**(runtime_options or {}), "recovery": rec_opts})
        try:
            return cls._recover_open(log_dir, model, opts, rt, m, t0, warm_graphs, tokenizer)
        except BaseException:
            rt.close()
            raise

    @classmethod
    def _recover_open(cls, log_dir: str | Path, model: Any, opts: EngineOptions, rt: Any, m: dict[str, Any],
                      t0: float, warm_graphs: bool, tokenizer: Any = None) -> Engine:
        if m.get("version") != META_VERSION:
            raise RecoveryError(f"serve metadata version {m.get('version')}; this code reads {META_VERSION}")
        fp = model_fingerprint(model)
        if fp != m["fingerprint"]:
            raise RecoveryError(f"the model is not the one that wrote {log_dir} (fingerprint {fp} != "
                                f"{m['fingerprint']}); start the server with the same --model")
        geo = PoolGeometry(**m["geometry"])
        want = plan_pool(model.config, num_blocks=geo.num_blocks, block_size=geo.block_size,
                         dtype=getattr(torch, geo.dtype))
        if want != geo:
            raise RecoveryError(f"the model's KV rows are {want}; the log's are {geo}: same model needed")
        logged = {**OPTION_BEFORE, **m["options"]}
        opts = EngineOptions(**{**opts.__dict__, **logged, "num_blocks": geo.num_blocks,
                                "block_size": geo.block_size, "kv_dtype": geo.dtype})
        t1 = time.perf_counter()
        eng = cls(model, log_dir, opts, tokenizer=tokenizer, _recovering=m, _runtime=rt)
        t2 = time.perf_counter()
        warm = eng._start_warm_capture(m) if warm_graphs else None
        try:
            eng._load(m)
        finally:
            t3 = time.perf_counter()
            capture = warm.join() if warm is not None else None
        # where recover() spent its time: the log's open (replay pass 1: every checksum not deferred), the engine
        # (pool allocation), the restore (regions into the pool, requests from the metadata), the wait for the
        # first step's graph capture running beside the restore
        eng.recover_phases = {"open_s": t1 - t0, "construct_s": t2 - t1, "load_s": t3 - t2,
                              "capture_wait_s": time.perf_counter() - t3}
        if capture is not None:
            eng.recover_phases.update(capture)
        eng._start_mirror()
        return eng

    def _start_warm_capture(self, m: dict[str, Any]) -> _WarmCapture | None:
        """The capture of the first step's decode graph on a helper thread, when that step is decode-only
        (every running request has fed all but its last sampled token, nothing waits to be admitted)."""
        g = self.graphs
        running = m["running"]
        if g is None or g.mode != "on" or not running or m["waiting"]:
            return None
        if any(int(d["n_computed"]) != int(d["n_tokens"]) - 1 for d in running):
            return None
        keys = max(int(d["n_computed"]) for d in running) + 1
        if g.bucket(len(running), keys) is None:
            return None
        return _WarmCapture(g, len(running), keys, self.device)

    def _load(self, m: dict[str, Any]) -> None:
        assert self.runtime is not None
        rec = self.runtime.recover_into(keep_images=False)
        self.recovered_epoch, self.recovered = rec.epoch, rec
        self.step_no, self._seq = int(m["step"]), itertools.count(int(m["next_seq"]))
        bs = self.geo.block_size
        state = m.get("blocks") or {}
        try:
            self.blocks = BlockPool.restore(self.geo.num_blocks, bs, {d["id"]: list(d["table"]) for d in m["running"]},
                                            state.get("cached", ()), state.get("lru", ()))
        except ValueError as e:
            raise RecoveryError(f"the block tables of epoch {rec.epoch} in {self.runtime.log_dir} are inconsistent "
                                f"({e}); the log was not written by a correct engine: nothing was restored from "
                                "it") from None
        self.rng.free = [i for i in range(self.opts.max_running) if i not in {d["row"] for d in m["running"]}]
        for d in m["running"]:
            if d.get("prompt_rows", "logged") != "logged":
                # the hook of recompute-at-recovery (serve/DESIGN.md, "Rows or recompute"): a request whose
                # prompt KV was not logged would be re-prefilled here; no engine writes such a log yet
                raise RecoveryError(f"request {d['id']}: its prompt's KV rows are not in the log "
                                    f"(prompt_rows={d.get('prompt_rows')!r}) and this engine does not recompute them")
            r = self._request(d, [])
            table = self.blocks.tables[r.id]  # _bind_slots' table and slots, vectorised (132k slots at 64 x 2k)
            r.table = torch.as_tensor(table, dtype=torch.long)
            r.slots = (np.asarray(table, dtype=np.int64)[:, None] * bs + np.arange(bs)).ravel().tolist()
            r.ids = self.tokens[r.slots[: int(d["n_tokens"])]].tolist()  # Python ints
            if r.params.logprobs is not None:
                r.logprobs = [TokenLogprobs.from_list(v) for v in d.get("logprobs", ())]
                r.logprobs += [TokenLogprobs.unpack(self.lp[s * LP_WORDS: (s + 1) * LP_WORDS])
                               for s in r.slots[r.n_prompt + len(r.logprobs): len(r.ids)]]
            r.status, r.n_computed, r.row, r.admitted = "running", int(d["n_computed"]), int(d["row"]), int(d["admitted"])
            self._check_shared(r, rec.epoch)
            if not r.params.greedy:
                r.gen = self.rng.load(r.row)
            self.running[r.id] = r
        for d in m["waiting"]:
            r = self._request(d, [int(t) for t in d["prompt"]])
            r.logprobs = [TokenLogprobs.from_list(v) for v in d.get("logprobs", ())]
            if d.get("rng") is not None:  # preempted after drawing: its generator waits with it
                r.gen = torch.Generator(device=self.device)
                r.gen.set_state(torch.frombuffer(bytearray(base64.b64decode(d["rng"])), dtype=torch.uint8))
            self.waiting.append(r)
        self._done_of, taken = {}, set()
        for e in m["finished"]:
            d = e if isinstance(e, dict) else {**self._read_done(int(e[0])), "collected": bool(e[1])}
            r = self._request(d, [])
            r.ids = [0] * r.n_prompt + [int(t) for t in d["generated"]]  # the prompt of a finished one is not kept
            r.status, r.finish_reason, r.collected = "finished", d["reason"], bool(d["collected"])
            r.logprobs = [TokenLogprobs.from_list(v) for v in d.get("logprobs", ())]
            self.finished[r.id] = r
            self._done_of[r.id] = -1 if isinstance(e, dict) else int(e[0])
            taken.add(self._done_of[r.id])
        self._done_free = [k for k in range(len(self.done) // self.done_slot_bytes - 1, -1, -1) if k not in taken]
        self.done_dirty[:] = 0
        self.pool.dirty.zero_()
        self.tokens_dirty[:] = 0
        self.rng.dirty[:] = 0
        self.lp_dirty[:] = 0

    def _check_shared(self, r: Request, epoch: int) -> None:
        """A recovered running request's cached blocks: only whole blocks it has computed (nothing it still
        writes), each under the key its restored tokens give (the chain of its blocks before it)."""
        bs = self.geo.block_size
        full = r.n_computed // bs
        table = self.blocks.tables[r.id]
        keys = chain_hashes(r.ids, bs, full) if self.opts.prefix_caching else []
        for i, b in enumerate(table):
            key = self.blocks.hash_of(b)
            if key is None:
                continue
            if i >= full or not keys or key != keys[i]:
                raise RecoveryError(
                    f"block {b} (position {i} of request {r.id!r}'s table) is cached under a key its tokens in the "
                    f"log do not give, or holds positions the request has not computed (epoch {epoch} in "
                    f"{self.runtime.log_dir if self.runtime else '?'}): the log's prefix cache is inconsistent; "
                    "nothing was restored from it")
        r.hashes, r.cached_upto = keys, full

    def _request(self, d: dict[str, Any], ids: list[int]) -> Request:
        r = Request(str(d["id"]), ids, int(d["n_prompt"]), SamplingParams.from_dict(d["params"]), d.get("key"),
                    str(d.get("digest", "")), dict(d.get("info") or {}), seq=int(d["seq"]),
                    priority=int(d.get("priority", 0)), preemptions=int(d.get("preemptions", 0)))
        if r.key is not None:
            self.by_key[r.key] = r.id
        return r

    def close(self) -> None:
        """Close the log (an epoch still being written is committed first). A pinned mirror's follower stops;
        its keeper keeps the memory (``concordia_ft.core.keeper.stop_keeper(log_dir)`` frees it)."""
        if self.runtime is not None:
            try:
                if self.fast is not None:
                    self.fast.close()  # commits what the C writer was given, ends its lease
            finally:
                try:
                    self.runtime.close()
                finally:
                    if self.mirror is not None:
                        self.mirror.close()
                        self.mirror = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
