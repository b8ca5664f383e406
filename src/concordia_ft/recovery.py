"""Recovery: what a replayed log hands back (``Recovered``), ``recover()`` in any process, and the checks a
restore makes before it copies anything (``plan_restore``). ``Runtime.recover_into`` restores registered
buffers with these.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .buffers import host_bytes
from .core.options import coerce_options
from .core.regions import RegionSpec
from .core.replay import Outcome, RegionImage, ReplayOptions, ReplayResult, ReplayTimings, TailInfo, replay
from .errors import ConfigError, RecoveryError


@dataclass(frozen=True)
class RecoveryOptions:
    """How replay and restore use the machine. What is recovered, and every check on the way, is the same
    under every option: these trade only time (benchmarks compare them in one run)."""

    threads: int | None = None  # replay's checksum and copy threads (None: automatic, 1: the calling thread)
    parallel_verify: bool = True  # False: payload checksums one after another on one thread
    pinned: bool = True  # GPU regions: replay into page-locked host memory, restored with one DMA per region
    # paged GPU regions restored with keep_images=False: streamed from the log's mapped segments through a ring
    # of ``ring_slots`` pinned slots of ``slot_bytes`` straight to the device (core/streamed.py), no host image
    streamed: bool = True
    ring_slots: int = 16
    slot_bytes: int = 16 << 20
    # regions whose page checksums are not run at the log's open but by their streamed restore, on the bytes as
    # it copies them (every byte read once; still checked before the restore returns, so before any is used).
    # None: the component decides (a serving engine defers its GPU KV pool); (): every checksum at open
    defer_verify: tuple[str, ...] | None = None
    # where a streamed restore runs those deferred checksums: "device" (a CRC32C kernel on the bytes after their
    # DMA, cuda/crc.py; the host threads only copy), "host" (on the copy threads, as they copy)
    stream_verify: str = "device"
    # helper threads mapping the log's pages ahead of the copy threads (MADV_POPULATE_READ); 0: none
    prefault: int = 0
    # threads mapping the log's segments into the process while the log is opened (ReplayOptions.populate), so a
    # streamed restore's copy threads take no first-touch page faults; 0: none. Off by default: on the H200 host
    # 8 of them took 0.25 s for 15-19 GB and stretched the open from ~0.1 to 0.28 s (serve/DESIGN.md, Recovery)
    populate: int = 0
    # streamed restores: the copy threads write the ring's slots with streaming (non-temporal) stores instead of
    # memcpy, so the host's memory is not read for the slot lines each fill overwrites (glibc's memcpy streams only
    # above ~150 MiB on the H200 host, and a fill copies at most a 16 MiB slot). None (the default): on where the
    # C extension is built; True: required (ConfigError where it is not). On the H200 (5 rounds) the copy phase
    # reached 37.2 GB/s vs 34.7 with memcpy at Qwen3-8B dims, 35.9 vs 33.4 at 0.6B (serve/DESIGN.md, Recovery)
    nontemporal: bool | None = None
    # streamed restores to a GPU: a pinned mirror of the log (cuda/mirror.py), held by the log's keeper process,
    # that the chunks of one run are DMA'd from instead of through the ring (no host copy). None/False: none;
    # True: attach the keeper's mirror of the log being recovered, if one runs; a ``cuda.mirror.MirrorAttach``
    # started earlier (beside the model's load): use it. Every byte taken from it is checksummed on the device
    # against the log file's record, and a mismatch restores again from the log alone.
    mirror: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.ring_slots, int) or self.ring_slots < 2:
            raise ConfigError(f"RecoveryOptions.ring_slots={self.ring_slots!r}: use an int >= 2")
        if not isinstance(self.slot_bytes, int) or self.slot_bytes < 64 << 10:
            raise ConfigError(f"RecoveryOptions.slot_bytes={self.slot_bytes!r}: use an int >= 65536")
        if self.stream_verify not in ("device", "host"):
            raise ConfigError(f"RecoveryOptions.stream_verify={self.stream_verify!r}: use 'device' or 'host'")
        if not isinstance(self.prefault, int) or self.prefault < 0:
            raise ConfigError(f"RecoveryOptions.prefault={self.prefault!r}: use an int >= 0")
        if self.nontemporal is not None and not isinstance(self.nontemporal, bool):
            raise ConfigError(f"RecoveryOptions.nontemporal={self.nontemporal!r}: use None (automatic), True or False")
        if not isinstance(self.populate, int) or self.populate < 0:
            raise ConfigError(f"RecoveryOptions.populate={self.populate!r}: use an int >= 0")
        if not (self.mirror is None or isinstance(self.mirror, bool) or hasattr(self.mirror, "result")):
            raise ConfigError(f"RecoveryOptions.mirror={self.mirror!r}: use None, True/False or a MirrorAttach")
        if self.defer_verify is not None:
            if isinstance(self.defer_verify, list):
                object.__setattr__(self, "defer_verify", tuple(self.defer_verify))
            if not isinstance(self.defer_verify, tuple) or not all(isinstance(n, str) for n in self.defer_verify):
                raise ConfigError(f"RecoveryOptions.defer_verify={self.defer_verify!r}: use a tuple of region names")

    @classmethod
    def coerce(cls, value: RecoveryOptions | Mapping[str, Any] | None) -> RecoveryOptions:
        return coerce_options(cls, value, "recovery")

    def replay_options(self) -> ReplayOptions:
        return ReplayOptions(threads=self.threads, parallel_verify=self.parallel_verify,
                             defer=tuple(self.defer_verify or ()), populate=self.populate)


@dataclass
class Recovered:
    """A verified state from the log: the last committed epoch, its regions' exact bytes and its metadata."""

    epoch: int
    outcome: Outcome
    meta: Any
    images: dict[str, RegionImage]
    tail: TailInfo | None = None
    seconds: float = 0.0
    timings: ReplayTimings = field(default_factory=ReplayTimings)  # the replay's passes (verify may predate)
    restore_s: float = 0.0  # recover_into: copying the images into the registered buffers
    streamed: dict[str, Any] = field(default_factory=dict)  # region -> StreamedStats of a streamed restore

    @property
    def regions(self) -> dict[str, npt.NDArray[np.uint8]]:
        return {n: img.data for n, img in self.images.items()}

    @property
    def specs(self) -> dict[str, RegionSpec]:
        return {n: img.spec for n, img in self.images.items()}

    def array(self, name: str) -> npt.NDArray[Any]:
        """The region as a numpy array of its registered dtype and shape (numpy dtypes only)."""
        spec = self.images[name].spec
        if spec.dtype.startswith("torch."):
            raise ConfigError(f"region {name!r} holds {spec.dtype}; use .tensor({name!r}) for torch dtypes")
        return self.images[name].data.view(np.dtype(spec.dtype)).reshape(spec.shape)

    def tensor(self, name: str, device: str | None = None) -> Any:
        """The region as a torch tensor of its registered dtype and shape (a copy, on ``device``)."""
        import torch

        spec = self.images[name].spec
        raw = torch.from_numpy(self.images[name].data.copy())
        dtype = getattr(torch, spec.dtype.removeprefix("torch.")) if spec.dtype else torch.uint8
        t = raw.view(dtype).reshape(spec.shape)
        return t.to(device) if device else t


def recovered(res: ReplayResult, t0: float) -> Recovered:
    """The ``Recovered`` of a replay that found a committed epoch (``RecoveryError`` if it found none)."""
    check_epoch(res)
    assert res.epoch is not None
    return Recovered(res.epoch, res.outcome, res.meta, res.regions, res.tail, time.perf_counter() - t0,
                     res.timings)


def check_epoch(res: ReplayResult) -> None:
    if res.epoch is None:
        raise RecoveryError(f"nothing to recover: the log holds no committed epoch (outcome {res.outcome.value})")


def recover(log_dir: str | Path, *, verify: bool = True,
            options: RecoveryOptions | Mapping[str, Any] | None = None) -> Recovered:
    """Replay ``log_dir`` (base + committed suffix, checksums verified) into host arrays."""
    t0 = time.perf_counter()
    path = Path(log_dir)
    if not path.exists():
        raise RecoveryError(f"no log at {path}: the directory does not exist")
    if not path.is_dir():
        raise RecoveryError(f"no log at {path}: it is a file, not a log directory; pass the directory the "
                            "Runtime wrote (it holds MANIFEST and *.cft segments)")
    opts = RecoveryOptions.coerce(options)
    return recovered(replay(path, verify_payloads=verify, options=opts.replay_options()), t0)


def plan_restore(logged: Mapping[str, RegionSpec], registered: Mapping[str, RegionSpec],
                 targets: Mapping[str, Any] | None) -> list[str]:
    """The regions a restore copies (``targets``' names, else every registered region the log holds), each
    checked against the log's geometry before anything is copied."""
    names = list(targets) if targets is not None else [n for n in registered if n in logged]
    for name in names:
        if name not in logged:
            raise RecoveryError(f"region {name!r} is not in the log (it has: {sorted(logged)})")
        spec = logged[name]
        if targets is not None and name not in registered:
            nbytes = host_bytes(targets[name]).nbytes
            if nbytes != spec.nbytes:
                raise RecoveryError(f"region {name!r}: target has {nbytes} bytes, log has {spec.nbytes}")
            continue
        mine = registered[name]
        if mine.nbytes != spec.nbytes or mine.page_bytes != spec.page_bytes:
            raise RecoveryError(
                f"region {name!r}: registered as {mine.nbytes} bytes in {mine.page_bytes}-byte pages, the log "
                f"holds {spec.nbytes} bytes in {spec.page_bytes}-byte pages; register a buffer of the logged size")
    return names
