"""Graph decode for ``Session``: one decode step captured as a CUDA graph on the session's ArenaKVCache, the
token's epoch work inside the same graph, and a background writer that only appends and commits.

The graph (captured once per session, replayed per token) holds, in stream order:

1. the model's step on the static arena: ``ids`` (the token fed), ``pos`` (its position) are device tensors;
   the layers' lengths are the cache's own device counters, advanced by the captured ``update``;
2. float32 logits of the last position, argmax into ``tok`` (the eager loop's exact ops);
3. ``concordia_token_epoch`` (cuda/graphs.py): the arena pages of the KV row just written, the token, its row and
   a sequence word written last, into slot ``seq % n_slots`` of a ring of host-mapped pinned slots;
4. ``ids <- tok``, ``pos += 1``, ``seq += 1``: the next replay feeds the token it sampled, without the host.

The decode thread keeps two replays in flight (the GPU never waits for the host), waits on the older one's
event, reads the token from its slot, hands the slot to the writer and, per the durability contract, calls
``on_token``:

- ``durable``: after the epoch holding the token committed (the writer signals it while the GPU computes the
  next step, so it costs the step nothing as long as a commit is shorter than a step);
- ``pipelined``: at once; the writer may lag up to ``pipeline_depth`` tokens behind (then the decode thread
  waits: backpressure). A kill loses at most those tokens' epochs; recovery regenerates them token-exact,
  because the log is the same one eager decode writes.

The writer builds each epoch from the slot alone (KV pages, the token's page of the ``tokens`` region from its
own image, the session metadata): the same records, checksums and commit marker as ``Runtime.checkpoint``. By
default it is the C writer (core/slotlog.py, ``_NativeWriter`` here): the log's active segment is leased to it and
its thread works with the GIL released, so the decode thread never waits for the interpreter. ``_Writer`` is the
Python one (``writer="python"``, or where the C one cannot run: ``_start_writer`` says why), which appends with
``RecoveryLog.append``; both write the same bytes. The paged trackers' flags stay clear (the runtime's next epoch has
nothing of these tokens to log again), so synchronous epochs (the prompt's, ``chat``'s) continue the same log.

Eligible (``decode='auto'`` picks it, else the eager loop runs): a CUDA model, greedy decoding without logits
processors (repetition penalty 1), only full-attention layers (a sliding window rolls in place: every row
moves), a model whose forward takes ``logits_to_keep``. A capture that fails falls back to eager decode for
the session, with a warning that says why.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..core.regions import RegionSpec
from ..core.tracking import RegionDelta
from ..errors import CheckpointError, ConfigError

META_KEY = "concordia.session"  # a Session's metadata key in its epochs (session.py re-exports it)

log = logging.getLogger("concordia_ft.graph_decode")

DURABILITY = ("durable", "pipelined")
IN_FLIGHT = 2  # graph replays queued ahead of the one whose token the host reads


@dataclass
class GraphStats:
    """Per-token timings of graph decode (seconds)."""

    host_s: list[float] = field(default_factory=list)  # decode thread, excluding waits for the GPU / the writer
    token_s: list[float] = field(default_factory=list)  # wall time between tokens seen by the decode thread
    commit_s: list[float] = field(default_factory=list)  # slot handed to the writer -> epoch committed
    append_s: list[float] = field(default_factory=list)  # the writer's log append
    epochs: int = 0
    epoch_bytes: list[int] = field(default_factory=list)
    replay_s: list[float] = field(default_factory=list)  # per token: the decode thread in graph.replay + event record
    capture_s: float = 0.0
    backpressure_s: float = 0.0
    writer: str = ""  # "c" (core/slotlog.py, GIL released) or "python" (_Writer); "" for plain decode


def graph_ineligible(session: Any, rules: Any) -> str | None:
    """Why this session/generation (``rules``: integrations/generation.py's GenerationRules) cannot decode in
    graph mode (None: it can)."""
    if session.device.type != "cuda":
        return "the model is not on a CUDA device"
    if rules.do_sample:
        return "sampling (do_sample=True) decodes eagerly: the sampler draws from a host-seeded generator"
    if len(rules.processors):
        return "logits processors (repetition penalty, ...) read the whole token sequence (a growing shape)"
    if len(rules.criteria):
        return "stopping criteria beyond eos and max_new_tokens (stop strings) run on the host per token"
    return cache_ineligible(session.model, session.cache)


def cache_ineligible(model: Any, cache: Any) -> str | None:
    """Why ``model`` cannot decode on ``cache`` (an ArenaKVCache) in graph mode whatever the settings (None:
    it can)."""
    import inspect

    if cache.arena.device.type != "cuda":
        return "the model is not on a CUDA device"
    if any(sl.kind != "full" for sl in cache.geometry.slots):
        return "sliding-window layers roll their window in place (every row moves each token)"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return "the model's forward has no logits_to_keep"
    return None


class _Item:
    __slots__ = ("seq", "n_tokens", "n_new", "done", "handed")

    def __init__(self, seq: int, n_tokens: int, n_new: int, done: bool, handed: float) -> None:
        self.seq, self.n_tokens, self.n_new, self.done, self.handed = seq, n_tokens, n_new, done, handed


class _Writer:
    """The one background thread that turns ring slots into committed epochs, in order."""

    def __init__(self, dec: GraphDecoder) -> None:
        self.dec = dec
        self._q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self.committed = -1  # highest seq whose epoch committed
        self.freed = -1  # highest seq whose slot may be overwritten
        self.error: BaseException | None = None
        self._rows: dict[int, bytes] = {}  # checkpoint_every > 1: pages (index -> bytes) not committed yet
        self._first_token = -1  # index of the first token of the epoch being gathered
        self._thread = threading.Thread(target=self._loop, name="concordia-token-epochs", daemon=True)
        self._thread.start()

    def submit(self, seq: int, n_tokens: int, n_new: int, done: bool) -> None:
        self._q.put(_Item(seq, n_tokens, n_new, done, time.perf_counter()))

    def token(self, seq: int) -> int | None:
        rec = self.dec.ring.read(seq)
        return None if rec is None else int(rec.token)

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join()

    def wait(self, what: str, seq: int) -> None:
        """Block until ``committed`` (or ``freed``) reaches ``seq``; raise the writer's failure."""
        with self._cv:
            while getattr(self, what) < seq and self.error is None:
                self._cv.wait()
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            if self.error is not None:
                continue
            try:
                self._one(item)
            except BaseException as e:  # noqa: BLE001 - raised on the decode thread by its next wait
                err = CheckpointError(None, self.dec.session.runtime.log.last_epoch, False,
                                      f"{type(e).__name__}: {e}")
                err.__cause__ = e
                with self._cv:
                    self.error = err
                    self._cv.notify_all()

    def _one(self, item: _Item) -> None:
        dec = self.dec
        rec = dec.ring.read(item.seq)
        if rec is None:
            raise RuntimeError(f"ring slot of step {item.seq} does not hold it (sequence word mismatch)")
        idx = item.n_tokens - 1
        dec.tokens_image[idx] = rec.token
        if self._first_token < 0:
            self._first_token = idx
        every = dec.session.checkpoint_every
        pb = dec.kv_spec.page_bytes
        final = item.done or (item.n_new % every == 0)
        in_slot = every == 1 and not self._rows  # the epoch's payload is the slot itself (no copy)
        if in_slot:
            pages = np.arange(rec.page0, rec.page0 + rec.n_pages, dtype=np.int64)
            payload = rec.payload
        else:  # several tokens per epoch: keep each page's newest bytes (rows share boundary pages)
            for k in range(rec.n_pages):
                self._rows[rec.page0 + k] = bytes(rec.payload[k * pb:(k + 1) * pb])
            pages = payload = None  # type: ignore[assignment]
            self._free(item.seq)  # copied out: the GPU may reuse the slot
        if not final:
            return
        if pages is None:
            pages = np.asarray(sorted(self._rows), dtype=np.int64)
            payload = memoryview(b"".join(self._rows[p] for p in pages.tolist()))
            self._rows.clear()
        tb = dec.tok_spec.page_bytes
        t0, t1 = self._first_token * 8 // tb, -(-item.n_tokens * 8 // tb)
        tpages = np.arange(t0, t1, dtype=np.int64)
        tview = memoryview(dec.tokens_image.view(np.uint8)[t0 * tb:t1 * tb].copy())
        deltas = [RegionDelta(dec.kv_spec, pages, payload), RegionDelta(dec.tok_spec, tpages, tview)]
        meta = dec.session.epoch_meta([rec.row + 1] * len(dec.session.cache.layers), n_tokens=item.n_tokens,
                                      n_new=item.n_new, done=item.done)
        a0 = time.perf_counter()
        res = dec.session.runtime.log.append(deltas=deltas, meta=meta)
        a1 = time.perf_counter()
        self._first_token = -1
        st = dec.stats
        st.append_s.append(a1 - a0)
        st.commit_s.append(a1 - item.handed)
        st.epochs += 1
        st.epoch_bytes.append(int(res.total_bytes))
        with self._cv:
            self.committed = item.seq
            if in_slot:
                self.freed = item.seq
            self._cv.notify_all()

    def _free(self, seq: int) -> None:
        with self._cv:
            self.freed = seq
            self._cv.notify_all()


class _NativeWriter:
    """The C writer (core/slotlog.py) behind _Writer's interface: every == 1 epochs, built and committed with
    the GIL released, so the decode thread never waits for the interpreter."""

    def __init__(self, dec: GraphDecoder, template: tuple[list[bytes], list[int]]) -> None:
        from ..core.slotlog import SlotLogWriter
        from ..cuda.graphs import SLOT_HEADER

        ring = dec.ring
        self.dec = dec
        self.error: BaseException | None = None
        self._w = SlotLogWriter(dec.session.runtime.log, ring_address=ring.host_ptr, n_slots=ring.n_slots,
                                slot_bytes=ring.slot_bytes, slot_header=SLOT_HEADER, max_pages=ring.max_pages,
                                kv=dec.kv_spec, tokens_image=dec.tokens_image, tokens=dec.tok_spec, meta=template)
        self.submit = self._w.submit
        self.token = self._w.token

    def wait(self, what: str, seq: int) -> None:  # a slot is free once its epoch committed (every == 1)
        self._w.wait(seq)

    def stop(self) -> None:
        try:
            self._w.stop()
        except BaseException as e:  # noqa: BLE001 - raised by run() as the Python writer's is
            self.error = e
        st = self.dec.stats
        rows = self._w.stats()
        st.commit_s.extend(((rows[:, 3] - rows[:, 1]) / 1e9).tolist())
        st.append_s.extend(((rows[:, 3] - rows[:, 2]) / 1e9).tolist())
        st.epoch_bytes.extend(rows[:, 4].tolist())
        st.epochs += len(rows)


def native_template(session: Any) -> tuple[list[bytes], list[int]] | None:
    """The session's epoch metadata as the C writer's template (None: it cannot be expressed as one)."""
    from ..core import slotlog

    S = slotlog.SENTINELS
    n_layers = len(session.cache.layers)
    doc = session.epoch_meta([S[slotlog.HOLE_LENGTH]] * n_layers, n_tokens=S[slotlog.HOLE_N_TOKENS],
                             n_new=S[slotlog.HOLE_N_NEW], done=S[slotlog.HOLE_DONE])
    doc[META_KEY]["time"] = S[slotlog.HOLE_TIME]
    return slotlog.meta_template(doc, {slotlog.HOLE_N_TOKENS: 1, slotlog.HOLE_N_NEW: 1, slotlog.HOLE_DONE: 1,
                                       slotlog.HOLE_LENGTH: n_layers, slotlog.HOLE_TIME: 1})


WRITERS = ("auto", "c", "python")


class GraphDecoder:
    """The captured decode step of one Session, its ring of slots and its writer."""

    def __init__(self, session: Any, *, durability: str = "durable", pipeline_depth: int = 2,
                 with_epoch: bool = True, writer: str = "auto") -> None:
        self._setup(session.model, session.cache, durability=durability, pipeline_depth=pipeline_depth,
                    with_epoch=with_epoch, writer=writer, kv_page_bytes=session.runtime.table["kv"].page_bytes,
                    cache_kw=session.cache_kw, cache_position_kw=session.cache_position_kw)
        self.bind(session)

    @classmethod
    def standalone(cls, model: Any, cache: Any, *, durability: str = "durable", pipeline_depth: int = 2,
                   writer: str = "auto") -> GraphDecoder:
        """A decoder of ``model`` on ``cache`` before any session exists (a ``Standby``: captured at warm-up,
        then ``bind``-ed to the session that recovers into the same arena). Its ring pages are the Session's
        arena pages (``min(block_bytes, 4096)``)."""
        import inspect

        self = cls.__new__(cls)
        fwd = inspect.signature(model.forward).parameters
        self._setup(model, cache, durability=durability, pipeline_depth=pipeline_depth, with_epoch=True,
                    writer=writer, kv_page_bytes=min(cache.geometry.block_bytes, 4096),
                    cache_kw="cache" if "cache" in fwd else "past_key_values",
                    cache_position_kw="cache_position" in fwd)
        self.session = None
        return self

    def _setup(self, model: Any, cache: Any, *, durability: str, pipeline_depth: int, with_epoch: bool,
               writer: str, kv_page_bytes: int, cache_kw: str, cache_position_kw: bool) -> None:
        if writer not in WRITERS:
            raise ConfigError(f"writer={writer!r}; use one of {', '.join(WRITERS)}")
        self.writer = writer
        if durability not in DURABILITY:
            raise ConfigError(f"durability={durability!r}; use one of {', '.join(DURABILITY)}")
        if pipeline_depth < 1:
            raise ConfigError(f"pipeline_depth={pipeline_depth} must be >= 1 (tokens a commit may lag)")
        from ..cuda import driver
        from ..cuda.graphs import TokenEpochKernel, TokenRing, max_row_pages

        self.durability, self.depth, self.with_epoch = durability, int(pipeline_depth), with_epoch
        self.model, self.cache = model, cache
        self.max_cache_len = int(cache.geometry.max_cache_len)
        dev = cache.arena.device
        self.device_index = int(dev.index or 0)
        self._driver = driver
        geo = cache.geometry
        sec = geo.sections[0]
        self.row_bytes = sec.row_bytes
        self.page_bytes = int(kv_page_bytes)
        self.ids = torch.zeros((1, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((1,), dtype=torch.long, device=dev)
        self.seq = torch.zeros((1,), dtype=torch.long, device=dev)
        self.tok = torch.zeros((1,), dtype=torch.long, device=dev)
        # slots: two replays in flight, the writer's lag, the one it is writing, one spare
        self.n_slots = IN_FLIGHT + self.depth + 2
        pb = self.page_bytes
        self.ring = TokenRing(self.n_slots, max_row_pages(sec.row_bytes, pb), pb)
        self.kernel = TokenEpochKernel(arena_ptr=int(cache.arena.data_ptr()), section_start=sec.start_bytes,
                                       row_bytes=sec.row_bytes, page_bytes=pb, pos_ptr=int(self.pos.data_ptr()),
                                       tok_ptr=int(self.tok.data_ptr()), seq_ptr=int(self.seq.data_ptr()),
                                       ring=self.ring, device=self.device_index, with_pages=with_epoch)
        self.events = [torch.cuda.Event() for _ in range(self.n_slots)]
        self.graph: Any = None
        self.next_seq = 0
        self.stats = GraphStats()
        kw: dict[str, Any] = {"use_cache": True, "logits_to_keep": 1, cache_kw: cache}
        if cache_position_kw:
            kw["cache_position"] = self.pos
        self._kw = kw

    def bind(self, session: Any, *, durability: str | None = None, pipeline_depth: int | None = None) -> None:
        """Decode for ``session``, whose cache must be this decoder's (the captured graph reads and writes that
        arena and its length counters): its regions' specs, a token image of its size, fresh per-session stats
        (the capture time is kept)."""
        if session.cache is not self.cache or session.model is not self.model:
            raise ConfigError("a graph decoder decodes the model and the arena it was captured on; this session "
                              "has another cache or model")
        if durability is not None:
            if durability not in DURABILITY:
                raise ConfigError(f"durability={durability!r}; use one of {', '.join(DURABILITY)}")
            self.durability = durability
        if pipeline_depth is not None:
            if not 1 <= pipeline_depth <= self.n_slots - IN_FLIGHT - 2:
                raise ConfigError(f"pipeline_depth={pipeline_depth}: this decoder's ring of {self.n_slots} slots "
                                  f"holds a lag of 1 .. {self.n_slots - IN_FLIGHT - 2} tokens")
            self.depth = int(pipeline_depth)
        self.kv_spec: RegionSpec = session.runtime.table["kv"]
        self.tok_spec: RegionSpec = session.runtime.table["tokens"]
        if self.kv_spec.page_bytes != self.page_bytes:
            raise ConfigError(f"the session's KV region has {self.kv_spec.page_bytes}-byte pages; this decoder's "
                              f"ring holds {self.page_bytes}-byte pages")
        self.session = session
        self.tokens_image = np.zeros_like(session.tokens)
        capture_s = self.stats.capture_s
        self.stats = GraphStats(capture_s=capture_s)

    # -- the step ----------------------------------------------------------------------------------------
    def _step(self) -> None:
        out = self.model(input_ids=self.ids, **self._kw)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)  # the eager loop's exact ops
        self.tok.copy_(torch.argmax(logits, dim=-1))
        self.kernel.launch(self._driver.Stream.from_torch(self.device_index))
        self.ids.copy_(self.tok.view(1, 1))
        self.pos.add_(1)
        self.seq.add_(1)

    def set_state(self, last_token: int, length: int) -> None:
        """Set the graph's device inputs: the last token, the cache length and the next ring sequence number."""
        self.ids.fill_(int(last_token))
        self.pos.fill_(int(length))
        self.seq.fill_(int(self.next_seq))

    def capture(self, last_token: int, length: int) -> None:
        """Warm the step on a side stream (state restored after), then capture it."""
        t0 = time.perf_counter()
        cache = self.cache
        saved = cache.full_lengths.clone()
        self.set_state(last_token, length)
        warm = max(0, min(2, self.max_cache_len - 1 - length))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode():
            if warm:
                with torch.cuda.stream(side):
                    for _ in range(warm):
                        self._step()
                torch.cuda.current_stream().wait_stream(side)
            cache.full_lengths.copy_(saved)
            self.set_state(last_token, length)
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, capture_error_mode="thread_local"):
                    self._step()
            finally:
                cache.full_lengths.copy_(saved)
                self.set_state(last_token, length)
        torch.cuda.current_stream().synchronize()
        self.graph = g
        self.stats.capture_s = time.perf_counter() - t0

    # -- decoding ----------------------------------------------------------------------------------------
    def run(self, on_token: Callable[[int], Any] | None, *, plain: bool = False) -> int:
        """Decode the session's current generate() to its end (or until the arena is full), in graph mode.
        ``plain``: no epochs and no writer (the benchmark's graph decode without checkpoints)."""
        s = self.session
        g = s.gen
        rules = s.rules_for(g.settings)
        eos, max_new = set(rules.eos), int(rules.max_new_tokens)
        lengths = s.cache.lengths()
        length = lengths[0]
        if length != s.n_tokens - 1:
            raise ConfigError(f"graph decode needs the cache to hold every token but the newest ({length} rows "
                              f"for {s.n_tokens} tokens)")
        # the rows the steps write stay inside the arena; the eager loop reports what does not fit
        budget = min(max_new - g.n_new, s.max_cache_len - s.n_tokens)
        if budget <= 0 or g.done:
            return 0
        if self.graph is None:
            self.capture(int(s.tokens[s.n_tokens - 1]), length)
        else:
            self.set_state(int(s.tokens[s.n_tokens - 1]), length)
        writer: _Writer | _NativeWriter | None = None
        plain = plain or not self.with_epoch
        if not plain:
            self.tokens_image[:] = s.tokens
            writer = self._start_writer()
        stats = self.stats
        n_epochs0, n_bytes0 = stats.epochs, sum(stats.epoch_bytes)
        durable = self.durability == "durable"
        every = s.checkpoint_every
        lag = self.depth + every - 1
        base = self.next_seq
        inflight: deque[tuple[int, Any]] = deque()
        issued = 0
        stop = False
        overshoot = 0
        unshown: list[int] = []
        perf = time.perf_counter
        last = perf()
        replay = self.graph.replay
        read = writer.token if writer is not None else self._token
        try:
            with torch.inference_mode():
                while True:
                    busy0 = perf()
                    waited = 0.0
                    in_replay = 0.0
                    while not stop and issued < budget and len(inflight) < IN_FLIGHT:
                        seq = base + issued
                        if writer is not None and seq - self.n_slots >= base:
                            w0 = perf()
                            writer.wait("freed", seq - self.n_slots)  # its slot was written by seq - n_slots
                            waited += perf() - w0
                        r0 = perf()
                        replay()
                        ev = self.events[seq % self.n_slots]
                        ev.record()
                        in_replay += perf() - r0
                        inflight.append((seq, ev))
                        issued += 1
                    if not inflight:
                        break
                    seq, ev = inflight.popleft()
                    w0 = perf()
                    ev.synchronize()
                    waited += perf() - w0
                    if stop:
                        overshoot += 1
                        continue
                    tok = read(seq)
                    if tok is None:
                        raise CheckpointError(None, s.runtime.log.last_epoch, False,
                                              f"ring slot of step {seq} was not written by the graph")
                    s.append_tokens([tok])
                    g.n_new += 1
                    g.done = tok in eos or g.n_new >= max_new  # generation.should_stop without criteria
                    if writer is not None:
                        writer.submit(seq, s.n_tokens, g.n_new, g.done)
                    unshown.append(tok)
                    if writer is not None and (durable or seq - lag >= base):
                        w0 = perf()
                        if durable:
                            if g.done or g.n_new % every == 0:
                                writer.wait("committed", seq)
                        else:  # epochs close every ``every`` tokens: the bound is depth + every - 1
                            writer.wait("committed", seq - lag)
                        dw = perf() - w0
                        waited += dw
                        if not durable:
                            stats.backpressure_s += dw
                    if on_token is not None and (not durable or writer is None or g.done or g.n_new % every == 0):
                        for t in unshown:
                            on_token(t)
                        unshown.clear()
                    elif on_token is None:
                        unshown.clear()
                    now = perf()
                    stats.host_s.append(now - busy0 - waited)
                    stats.replay_s.append(in_replay)
                    stats.token_s.append(now - last)
                    last = now
                    if g.done:
                        stop = True
                if writer is not None:
                    writer.stop()
                    if writer.error is not None:
                        raise writer.error
                    writer = None
        finally:
            if writer is not None:  # an error on the decode thread: let the writer finish what it has
                writer.stop()
            self.next_seq = base + issued
            # replays queued after the last token (or still queued when on_token raised): their rows and lengths
            # are not the session's
            undo = overshoot + len(inflight)
            if undo:
                s.cache.full_lengths.sub_(undo)
        lengths = s.cache.lengths()
        if not plain:
            s.mark_logged(lengths)  # every row up to here is in the log (the flags were never set)
            # the token epochs count toward the runtime's compaction threshold like its own appends
            s.runtime.count_appended(sum(stats.epoch_bytes) - n_bytes0, stats.epochs - n_epochs0)
        if on_token is not None and unshown:
            for t in unshown:
                on_token(t)
        return issued - overshoot

    def _token(self, seq: int) -> int | None:
        rec = self.ring.read(seq)
        return None if rec is None else int(rec.token)

    def _start_writer(self) -> _Writer | _NativeWriter:
        """The C writer where it can run (built, every == 1, a leasable log, a metadata template), else the
        Python one; ``writer='c'`` makes a reason it cannot a ConfigError."""
        from ..core import slotlog

        why = None
        if self.writer == "python":
            why = "writer='python'"
        elif not slotlog.available():
            why = f"the C writer is {slotlog.status()}"
        elif self.session.checkpoint_every != 1:
            why = "checkpoint_every > 1 (the C writer commits one token per epoch)"
        template = native_template(self.session) if why is None else None
        if why is None and template is None:
            why = "the session metadata does not fit the C writer's template"
        if why is None:
            try:
                w = _NativeWriter(self, template)  # type: ignore[arg-type]
                self.stats.writer = "c"
                return w
            except ConfigError as e:
                why = str(e)
        if self.writer == "c":
            raise ConfigError(f"writer='c' is not possible here: {why}")
        self.stats.writer = "python"
        return _Writer(self)

    def close(self) -> None:
        self.graph = None
        self.kernel.close()
        self.ring.close()


__all__ = ["DURABILITY", "GraphDecoder", "GraphStats", "cache_ineligible", "graph_ineligible"]
