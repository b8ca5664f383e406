"""Region kinds, region specs and the registry's validation rules.

A region is one contiguous range of bytes (host or device) that the application registers under a name.
Its *kind* says how dirty pages are found and whether it is recovered at all:

- ``immutable``: written once (weights). Logged in full at the first epoch only (or not at all when the
  owner can reload it), never diffed afterwards.
- ``paged``: the owner supplies a dirty-block bitmap (and a block table): only those blocks are logged.
- ``dense``: every page is rewritten each epoch (LoRA adapters, optimizer state): no scan.
- ``opaque``: nobody tells us what changed; pages are found by diff against a shadow copy or by a
  per-page 64-bit hash.
- ``scratch``: never recovered (activations, workspaces).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import RegionError

DEFAULT_PAGE_BYTES = 4096
MAX_NAME_BYTES = 200
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-\[\]]*$")


class RegionKind(str, enum.Enum):
    IMMUTABLE = "immutable"
    PAGED = "paged"
    DENSE = "dense"
    OPAQUE = "opaque"
    SCRATCH = "scratch"

    @classmethod
    def parse(cls, value: str | RegionKind) -> RegionKind:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(k.value for k in cls)
            raise RegionError(f"unknown region kind {value!r}; use one of: {names}") from None


class DiffMode(str, enum.Enum):
    """How an opaque region's dirty pages are found."""

    SHADOW = "shadow"  # exact: compare with a copy (100% memory overhead, 2x bytes read)
    HASH = "hash"  # 8 bytes per page, 1x bytes read; a 64-bit collision could hide a change

    @classmethod
    def parse(cls, value: str | DiffMode) -> DiffMode:
        try:
            return cls(value)
        except ValueError:
            raise RegionError(f"unknown diff mode {value!r}; use 'shadow' or 'hash'") from None


KIND_CODES = {
    RegionKind.IMMUTABLE: 1,
    RegionKind.PAGED: 2,
    RegionKind.DENSE: 3,
    RegionKind.OPAQUE: 4,
    RegionKind.SCRATCH: 5,
}
KIND_BY_CODE = {v: k for k, v in KIND_CODES.items()}


def validate_name(name: str) -> str:
    """Region names are path- and log-safe identifiers: no separators, no '..', at most 200 bytes."""
    if not isinstance(name, str) or not name:
        raise RegionError(f"region name must be a non-empty string, got {name!r}")
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise RegionError(f"region name is {len(name.encode())} bytes; the limit is {MAX_NAME_BYTES}")
    if not _NAME_RE.match(name) or ".." in name:
        raise RegionError(
            f"region name {name!r} has characters that are not allowed; use letters, digits and _ . : - [ ] "
            "(no path separators, no '..')"
        )
    return name


def check_page_bytes(page_bytes: int) -> int:
    if not isinstance(page_bytes, int) or page_bytes < 512 or page_bytes & (page_bytes - 1):
        raise RegionError(f"page size must be a power of two >= 512 bytes, got {page_bytes!r}")
    if page_bytes > 1 << 26:
        raise RegionError(f"page size {page_bytes} is over the 64 MiB limit")
    return page_bytes


@dataclass(frozen=True)
class RegionSpec:
    """What the log records about a region: enough to re-allocate and restore it anywhere."""

    name: str
    kind: RegionKind
    nbytes: int
    page_bytes: int = DEFAULT_PAGE_BYTES
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    block_bytes: int = 0  # paged regions: bytes per KV block (a multiple of page_bytes)
    diff: DiffMode = DiffMode.SHADOW  # opaque regions only
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        validate_name(self.name)
        check_page_bytes(self.page_bytes)
        if self.nbytes <= 0:
            raise RegionError(f"region {self.name!r} has {self.nbytes} bytes; a region needs at least one byte")
        if self.kind is RegionKind.PAGED:
            if self.block_bytes <= 0 or self.block_bytes % self.page_bytes:
                raise RegionError(
                    f"paged region {self.name!r}: block size {self.block_bytes} bytes is not a positive multiple "
                    f"of the page size {self.page_bytes}; pick page_bytes dividing the KV block size"
                )
            if self.nbytes % self.block_bytes:
                raise RegionError(
                    f"paged region {self.name!r}: {self.nbytes} bytes is not a whole number of "
                    f"{self.block_bytes}-byte blocks"
                )

    @property
    def n_pages(self) -> int:
        return -(-self.nbytes // self.page_bytes)

    @property
    def pages_per_block(self) -> int:
        return self.block_bytes // self.page_bytes if self.block_bytes else 0

    @property
    def n_blocks(self) -> int:
        return self.nbytes // self.block_bytes if self.block_bytes else 0

    @property
    def recovered(self) -> bool:
        return self.kind is not RegionKind.SCRATCH

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "nbytes": self.nbytes,
            "page_bytes": self.page_bytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "block_bytes": self.block_bytes,
            "diff": self.diff.value,
        }

    @classmethod
    def from_description(cls, d: dict[str, Any]) -> RegionSpec:
        try:
            return cls(
                name=str(d["name"]),
                kind=RegionKind.parse(d["kind"]),
                nbytes=int(d["nbytes"]),
                page_bytes=int(d["page_bytes"]),
                dtype=str(d["dtype"]),
                shape=tuple(int(x) for x in d["shape"]),
                block_bytes=int(d.get("block_bytes", 0)),
                diff=DiffMode.parse(d.get("diff", "shadow")),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, RegionError):
                raise
            raise RegionError(f"bad region description {d!r}: {e}") from None


@dataclass(frozen=True)
class MemoryRange:
    """Where a registered region lives: ``device`` is 'cpu' or 'cuda:N'."""

    device: str
    address: int
    nbytes: int

    def overlaps(self, other: MemoryRange) -> bool:
        return (
            self.device == other.device
            and self.address < other.address + other.nbytes
            and other.address < self.address + self.nbytes
        )


class RegionTable:
    """Names -> specs, with the registration rules (unique names, no overlapping memory)."""

    def __init__(self) -> None:
        self._specs: dict[str, RegionSpec] = {}
        self._ranges: dict[str, MemoryRange] = {}

    def add(self, spec: RegionSpec, where: MemoryRange | None = None) -> None:
        if spec.name in self._specs:
            raise RegionError(f"a region named {spec.name!r} is already registered; names must be unique")
        if where is not None:
            for other_name, other in self._ranges.items():
                if where.overlaps(other):
                    raise RegionError(
                        f"region {spec.name!r} [{where.address:#x}, +{where.nbytes}) on {where.device} overlaps "
                        f"region {other_name!r} [{other.address:#x}, +{other.nbytes}); register disjoint buffers"
                    )
            self._ranges[spec.name] = where
        self._specs[spec.name] = spec

    def remove(self, name: str) -> None:
        if name not in self._specs:
            raise RegionError(f"no region named {name!r} is registered")
        del self._specs[name]
        self._ranges.pop(name, None)

    def __getitem__(self, name: str) -> RegionSpec:
        return self._specs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def names(self) -> list[str]:
        return list(self._specs)
