"""A transformers 5.x KV cache whose layers live in ONE pre-allocated arena, registered as a paged region.

Layout (token-major, so one decode step writes one contiguous row span and dirty blocks are a pure function of
append positions):

    arena (uint8, a whole number of blocks)
      section "full":    [max_cache_len rows][full-attention layers: K0 V0 K1 V1 ...]     (B*H*D elements each)
      section "sliding": [window rows       ][sliding-window layers: K V ...]

Each layer's ``keys``/``values`` are strided views ``[B, H, rows, D]`` of its columns of a section, built once.
The layers are subclasses of transformers' ``StaticLayer`` / ``StaticSlidingWindowLayer``: the arithmetic is
exactly StaticCache's (same in-place ``index_copy_``, same masks, compile-friendly, no per-token Python hook);
only the storage differs.

Dirty blocks are derived at checkpoint time from each layer's cumulative length: rows ``[marked, current)``
of the full section, or the whole window of a sliding layer once it has rolled (StaticSlidingWindowLayer rolls
the window in place, rewriting every row). ``crop`` and ``reset`` lower the mark. The "block table" of this
cache is its geometry: token ``t`` of a full layer lives at byte ``section_start + t * row_bytes + column``; it
is recorded in the session metadata (``ArenaGeometry.describe()``) together with each layer's length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, StaticLayer, StaticSlidingWindowLayer

from ..errors import ConfigError

try:
    from transformers.cache_utils import get_layer_types_and_kwargs as _hf_layer_types
except ImportError:  # transformers 5.x before per-layer configs
    _hf_layer_types = None


def layer_types_and_windows(config: Any) -> tuple[list[str], list[int]]:
    """Per layer: its attention type and sliding window (0 if none). Uses transformers' own resolution when
    it exists and agrees in length (5.2x), else the config fields every 5.x version has."""
    n = int(config.num_hidden_layers)
    if _hf_layer_types is not None:
        try:
            types, kws = _hf_layer_types(config)
            if len(types) == n and len(kws) == n:
                return list(types), [int(k.get("sliding_window") or 0) for k in kws]
        except (AttributeError, TypeError):
            pass
    types = list(getattr(config, "layer_types", None) or [])
    if not types:
        sw = getattr(config, "sliding_window", None)
        types = ["sliding_attention" if sw else "full_attention"] * n
    windows = [int(getattr(config, "sliding_window", 0) or 0) if t == "sliding_attention"
               else int(getattr(config, "attention_chunk_size", 0) or 0) if t == "chunked_attention" else 0
               for t in types]
    return types, windows


FULL_TYPES = ("full_attention",)
SLIDING_TYPES = ("sliding_attention", "chunked_attention")
DEFAULT_BLOCK_BYTES = 4096

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"unsupported KV dtype {name!r}; use one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class LayerSlot:
    """Where one layer's K and V live: section, first column (elements) and shape."""

    layer: int
    kind: str  # "full" | "sliding"
    section: int
    k_col: int
    v_col: int
    heads: int
    k_dim: int
    v_dim: int
    rows: int  # max_cache_len for full layers, min(window, max_cache_len) for sliding ones
    window: int = 0


@dataclass(frozen=True)
class Section:
    start_bytes: int
    rows: int
    row_elems: int
    row_bytes: int


@dataclass(frozen=True)
class ArenaGeometry:
    """Pure description of the arena: enough to rebuild identical views in another process."""

    dtype: str
    batch_size: int
    max_cache_len: int
    block_bytes: int
    nbytes: int
    sections: tuple[Section, ...]
    slots: tuple[LayerSlot, ...]
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def n_blocks(self) -> int:
        return self.nbytes // self.block_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one new token adds across every full-attention layer (K and V)."""
        return self.sections[0].row_bytes if self.sections else 0

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d

    @classmethod
    def from_description(cls, d: dict[str, Any]) -> ArenaGeometry:
        return cls(
            dtype=str(d["dtype"]), batch_size=int(d["batch_size"]), max_cache_len=int(d["max_cache_len"]),
            block_bytes=int(d["block_bytes"]), nbytes=int(d["nbytes"]),
            sections=tuple(Section(**s) for s in d["sections"]),
            slots=tuple(LayerSlot(**s) for s in d["slots"]),
        )


def _head_dim(cfg: Any) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else int(cfg.hidden_size // cfg.num_attention_heads)


def plan_arena(config: Any, max_cache_len: int, *, batch_size: int = 1, dtype: torch.dtype = torch.float32,
               block_bytes: int = DEFAULT_BLOCK_BYTES) -> ArenaGeometry:
    """Lay out every attention layer of ``config`` in one arena (pure: no allocation)."""
    if max_cache_len <= 0 or batch_size <= 0:
        raise ConfigError(f"max_cache_len={max_cache_len} and batch_size={batch_size} must both be positive")
    if block_bytes < 512 or block_bytes & (block_bytes - 1):
        raise ConfigError(f"block_bytes={block_bytes} must be a power of two >= 512")
    cfg = config.get_text_config(decoder=True)
    layer_types, windows = layer_types_and_windows(cfg)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    hd = _head_dim(cfg)
    elem = torch.empty((), dtype=dtype).element_size()
    cols = [0, 0]
    rows = [max_cache_len, 0]
    raw: list[tuple[int, str, int, int, int, int]] = []
    for i, (lt, layer_window) in enumerate(zip(layer_types, windows, strict=True)):
        if lt in FULL_TYPES:
            kind, sec, window, nrows = "full", 0, 0, max_cache_len
        elif lt in SLIDING_TYPES:
            window = layer_window
            kind, sec, nrows = "sliding", 1, min(window, max_cache_len)
            rows[1] = max(rows[1], nrows)
        else:
            raise ConfigError(
                f"layer {i} has type {lt!r}; the arena cache holds full-attention and sliding-window layers only "
                "(linear-attention / KV-sharing models need a different cache)"
            )
        width = batch_size * heads * hd
        raw.append((i, kind, sec, cols[sec], window, nrows))
        cols[sec] += 2 * width
    sections, start = [], 0
    for sec in (0, 1):
        row_bytes = cols[sec] * elem
        sections.append(Section(start, rows[sec] if cols[sec] else 0, cols[sec], row_bytes))
        start += -(-(rows[sec] * row_bytes if cols[sec] else 0) // block_bytes) * block_bytes
    width = batch_size * heads * hd
    slots = tuple(LayerSlot(i, kind, sec, col, col + width, heads, hd, hd, nrows, window)
                  for i, kind, sec, col, window, nrows in raw)
    return ArenaGeometry(dtype_name(dtype), batch_size, max_cache_len, block_bytes, max(start, block_bytes),
                         tuple(sections), slots)


def _views(arena: torch.Tensor, geo: ArenaGeometry, slot: LayerSlot) -> tuple[torch.Tensor, torch.Tensor]:
    sec = geo.sections[slot.section]
    typed = arena[sec.start_bytes: sec.start_bytes + sec.rows * sec.row_bytes].view(parse_dtype(geo.dtype))
    table = typed.view(sec.rows, sec.row_elems)[: slot.rows]
    b, h = geo.batch_size, slot.heads
    k = table[:, slot.k_col: slot.k_col + b * h * slot.k_dim].view(slot.rows, b, h, slot.k_dim).permute(1, 2, 0, 3)
    v = table[:, slot.v_col: slot.v_col + b * h * slot.v_dim].view(slot.rows, b, h, slot.v_dim).permute(1, 2, 0, 3)
    return k, v


class _ArenaLayerMixin:
    """Shared by both arena layers: views instead of allocations, and a low-water mark for dirty rows."""

    keys: torch.Tensor
    values: torch.Tensor

    def _bind(self, keys: torch.Tensor, values: torch.Tensor, slot: LayerSlot) -> None:
        self._arena_k, self._arena_v, self.slot = keys, values, slot
        self.marked_rows = 0  # rows [0, marked_rows) are committed (a fresh arena is all zeros: clean)
        self.all_dirty = False  # set by reset(): every row must be logged again

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        k = self._arena_k
        if key_states.shape[:2] != k.shape[:2] or key_states.shape[-1] != k.shape[-1]:
            raise ConfigError(
                f"layer {self.slot.layer}: key states {tuple(key_states.shape)} do not fit the arena's "
                f"[B={k.shape[0]}, H={k.shape[1]}, *, D={k.shape[-1]}]; build the cache with the model's batch size"
            )
        if key_states.dtype != k.dtype or key_states.device != k.device:
            raise ConfigError(
                f"layer {self.slot.layer}: key states are {key_states.dtype} on {key_states.device}, the arena is "
                f"{k.dtype} on {k.device}; build the cache with the model's dtype and device"
            )
        self._init_from_arena()

    def _init_from_arena(self) -> None:
        k, v = self._arena_k, self._arena_v
        self.device = k.device
        self.batch_size, self.num_heads = k.shape[:2]
        self.k_head_dim, self.v_head_dim = k.shape[-1], v.shape[-1]
        self.keys, self.values = k, v
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():
            for t in (self.keys, self.values, self.cumulative_length):
                try:
                    torch._dynamo.mark_static_address(t)
                except Exception:  # noqa: BLE001 - only an optimisation hint for cudagraphs
                    pass
        self.is_initialized = True

    def reset(self) -> None:
        super().reset()  # type: ignore[misc]
        self.all_dirty = True


class ArenaFullLayer(_ArenaLayerMixin, StaticLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: LayerSlot) -> None:
        StaticLayer.__init__(self, max_cache_len=slot.rows)
        self._bind(keys, values, slot)
        self._init_from_arena()

    def length(self) -> int:
        return int(self.cumulative_length.item())

    def set_length(self, n: int) -> None:
        self.cumulative_length.fill_(n)

    def dirty_rows(self, n: int) -> tuple[int, int]:
        return (0, self.slot.rows) if self.all_dirty else (min(self.marked_rows, n), n)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.marked_rows = min(self.marked_rows, self.length())

    def mark_clean(self, n: int) -> None:
        self.marked_rows, self.all_dirty = n, False


class ArenaSlidingLayer(_ArenaLayerMixin, StaticSlidingWindowLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: LayerSlot, max_cache_len: int) -> None:
        StaticSlidingWindowLayer.__init__(self, max_cache_len=max_cache_len, sliding_window=slot.window)
        self._bind(keys, values, slot)
        self._init_from_arena()

    def length(self) -> int:
        return int(self.cumulative_length_int)

    def set_length(self, n: int) -> None:
        self.cumulative_length_int = n
        self.cumulative_length.fill_(min(n, self.max_cache_len))

    def dirty_rows(self, n: int) -> tuple[int, int]:
        if self.all_dirty or n > self.max_cache_len:  # rolled (or became full in one update): every row moved
            return (0, self.slot.rows) if (self.all_dirty or n != self.marked_rows) else (0, 0)
        return min(self.marked_rows, n), n

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.marked_rows = min(self.marked_rows, self.length())

    def mark_clean(self, n: int) -> None:
        self.marked_rows, self.all_dirty = n, False


class ArenaKVCache(Cache):
    """StaticCache semantics, one arena per model, dirty blocks from append positions.

    ``dirty_blocks`` (torch uint8 on the arena's device, one flag per block) is owned by this cache: ``mark_dirty()`` sets the blocks
    written since the last ``mark_clean()``; the runtime reads it at checkpoint and clears committed blocks.
    """

    def __init__(self, config: Any, max_cache_len: int, *, batch_size: int = 1, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", block_bytes: int = DEFAULT_BLOCK_BYTES,
                 geometry: ArenaGeometry | None = None, zeroed: bool = True) -> None:
        """``zeroed=False`` leaves the arena's bytes undefined: for a recovery, which overwrites every one of
        them (on the CPU, zeroing a 235 MB arena is a 40 ms pass for nothing)."""
        if geometry is None:
            dt = dtype or getattr(config, "dtype", None) or torch.float32
            if isinstance(dt, str):
                dt = parse_dtype(dt)
            geometry = plan_arena(config, max_cache_len, batch_size=batch_size, dtype=dt, block_bytes=block_bytes)
        self.geometry = geometry
        self.arena = (torch.zeros if zeroed else torch.empty)(geometry.nbytes, dtype=torch.uint8, device=device)
        # on the arena's device: the CUDA paged handler reads the flags there (the CPU runtime reads them as numpy)
        self.dirty_blocks = torch.zeros(geometry.n_blocks, dtype=torch.uint8, device=device)
        layers: list[Any] = []
        for slot in geometry.slots:
            k, v = _views(self.arena, geometry, slot)
            if slot.kind == "full":
                layers.append(ArenaFullLayer(k, v, slot))
            else:
                layers.append(ArenaSlidingLayer(k, v, slot, geometry.max_cache_len))
        super().__init__(layers=layers)
        # Every full layer's length counter is a view into ONE device tensor, so lengths() reads them all with
        # one copy (no stack kernel). The layers update their counters in place (add_/sub_/zero_/fill_), which
        # keeps the views; lengths() checks that they are still the views before trusting the shared tensor.
        self._full = [i for i, layer in enumerate(self.layers) if isinstance(layer, ArenaFullLayer)]
        self._full_lengths = torch.zeros(len(self._full), dtype=torch.int64, device=device)
        self._full_views = []
        for j, i in enumerate(self._full):
            layer = self.layers[i]
            view = self._full_lengths[j]
            view.copy_(layer.cumulative_length)
            layer.cumulative_length = view
            self._full_views.append(view)

    # -- lengths -------------------------------------------------------------------------------------------
    @property
    def full_lengths(self) -> torch.Tensor:
        """The full layers' length counters as the ONE device tensor they are views of (saved, restored in place)."""
        return self._full_lengths

    def lengths(self) -> list[int]:
        """Every layer's cumulative length, read with ONE device copy (not one sync per layer)."""
        out = [0] * len(self.layers)
        full = self._full
        if full:
            if all(self.layers[i].cumulative_length is v for i, v in zip(full, self._full_views, strict=True)):
                vals = self._full_lengths.tolist()
            else:  # a caller replaced a counter: read them one by one (still one sync)
                vals = torch.stack([self.layers[i].cumulative_length for i in full]).tolist()
            for i, v in zip(full, vals, strict=True):
                out[i] = int(v)
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, ArenaFullLayer):
                out[i] = layer.length()
        return out

    def set_lengths(self, lengths: list[int]) -> None:
        if len(lengths) != len(self.layers):
            raise ConfigError(f"{len(lengths)} layer lengths for a cache of {len(self.layers)} layers")
        for layer, n in zip(self.layers, lengths, strict=True):
            layer.set_length(int(n))

    # -- dirty tracking ------------------------------------------------------------------------------------
    def dirty_byte_ranges(self, lengths: list[int] | None = None) -> list[tuple[int, int]]:
        """Byte ranges of the arena written since the last ``mark_clean()`` (from lengths, not hooks)."""
        geo, out = self.geometry, []
        lengths = self.lengths() if lengths is None else lengths
        for layer, n in zip(self.layers, lengths, strict=True):
            lo, hi = layer.dirty_rows(n)
            if hi <= lo:
                continue
            sec = geo.sections[layer.slot.section]
            out.append((sec.start_bytes + lo * sec.row_bytes, sec.start_bytes + hi * sec.row_bytes))
        return out

    def mark_dirty(self, lengths: list[int] | None = None) -> int:
        """Set ``dirty_blocks`` for every block written since the last commit; return how many were marked."""
        bb = self.geometry.block_bytes
        spans: list[tuple[int, int]] = []
        for lo, hi in sorted(self.dirty_byte_ranges(lengths)):
            b0, b1 = lo // bb, -(-hi // bb)
            if spans and b0 <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], b1))
            else:
                spans.append((b0, b1))
        for b0, b1 in spans:  # one fill per contiguous span (a decode token is one span: rows hold every layer)
            self.dirty_blocks[b0:b1] = 1
        return sum(b1 - b0 for b0, b1 in spans)

    def mark_clean(self, lengths: list[int] | None = None) -> None:
        """After a commit: the committed lengths are the new marks (the runtime clears ``dirty_blocks``)."""
        lengths = self.lengths() if lengths is None else lengths
        for layer, n in zip(self.layers, lengths, strict=True):
            layer.mark_clean(n)

    def describe(self) -> dict[str, Any]:
        return {"geometry": self.geometry.describe(), "lengths": self.lengths()}
