"""A pinned mirror of a DRAM log: the committed bytes of each segment copied into host memory that the GPU reads
directly and that outlives the server, so a restarted server restores its KV pool by DMA from it.

Why: a streamed restore from the tmpfs log moves every byte through host memory three times (read from the
mapped segment, written into a pinned ring, read again by the DMA): 34-38 GB/s on the H200 hosts against 55
GB/s of pinned host-to-device (serve/DESIGN.md). Registering the tmpfs pages for DMA in the new process runs at
8-16 GB/s. Memory from the driver's virtual memory API on the host (``cuMemCreate`` with a host NUMA location)
is pinned from birth, can be exported as a POSIX file descriptor, and lives as long as any descriptor does
(experiments/probe_host_vmm.py, experiments/results/host_vmm-h200.json: the writer SIGKILLed, a fresh process imports 8 GiB
in 0.3 ms, maps it for the device in 0.07 s, and DMAs from it at 55.3 GB/s, the pinned rate).

The pieces:
- ``LogMirror`` (the server): a thread that follows the log directory (its MANIFEST and each segment's committed
  epochs, read from its own read-only mapping with the log's own epoch walk), gives each segment an allocation of
  its capacity, copies the committed bytes in, and hands descriptor and *mark* (the bytes copied) to the keeper
  (core/keeper.py, a process without CUDA) after each copy. Segments the manifest no longer lists are dropped.
- ``MirrorAttach`` (the restarted server): asks the keeper for the entries, keeps those whose header bytes equal
  the segment file's, imports and maps them for the device (on a helper thread, beside the log's open or the
  model's load), and gives the streamed restore a translation from an address in a replay mapping to the mirror's
  device-visible address, valid below the mark.

Nothing is trusted: every KV payload the restore takes from the mirror is checksummed on the device against the
checksum in the log file's record, and a mismatch makes the restore run again from the log alone
(runtime.py). The mirror is only ever a faster copy of bytes the log file holds.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.format import SEGMENT_HEADER_BYTES
from ..core.keeper import Entry, KeeperClient, KeeperError, ensure_keeper
from ..core.manifest import load_manifest
from ..core.replay import walk_segment
from ..errors import DeviceError
from . import driver

_log = logging.getLogger(__name__)
COPY_PIECE = 64 << 20  # the follower copies at most this much before it publishes a mark


def _granularity(numa: int) -> int:
    drv = driver.bindings()
    p = _prop(numa)
    return int(driver.check(drv.cuMemGetAllocationGranularity(
        p, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity"))


def _prop(numa: int) -> Any:
    drv = driver.bindings()
    p = drv.CUmemAllocationProp()
    p.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    p.location.id = numa
    p.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return p


def _access(device: int, host: bool, dev: bool) -> list[Any]:
    drv = driver.bindings()
    out = []
    if host:
        a = drv.CUmemAccessDesc()
        a.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
        a.location.id = 0
        a.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        out.append(a)
    if dev:
        a = drv.CUmemAccessDesc()
        a.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        a.location.id = device
        a.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        out.append(a)
    return out


class _Mapped:
    """One allocation mapped into this process (host and/or device access)."""

    def __init__(self, handle: Any, nbytes: int, device: int, *, host: bool, dev: bool) -> None:
        drv = driver.bindings()
        self.handle, self.nbytes = handle, nbytes
        self.va = int(driver.check(drv.cuMemAddressReserve(nbytes, 0, 0, 0), "cuMemAddressReserve"))
        try:
            driver.check(drv.cuMemMap(self.va, nbytes, 0, handle, 0), "cuMemMap")
            acc = _access(device, host, dev)
            driver.check(drv.cuMemSetAccess(self.va, nbytes, acc, len(acc)), "cuMemSetAccess")
        except BaseException:
            drv.cuMemUnmap(self.va, nbytes)
            drv.cuMemAddressFree(self.va, nbytes)
            drv.cuMemRelease(handle)
            raise

    def host_view(self) -> np.ndarray:
        import ctypes

        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.va))

    def close(self) -> None:
        if self.va:
            drv = driver.bindings()
            drv.cuMemUnmap(self.va, self.nbytes)
            drv.cuMemAddressFree(self.va, self.nbytes)
            drv.cuMemRelease(self.handle)
            self.va = 0


def host_numa(device: int) -> int:
    try:
        return max(0, driver.device_attribute("HOST_NUMA_ID", device))
    except (DeviceError, AttributeError):
        return 0


def mirror_supported(device: int | None = None) -> str:
    """"" where this device can hold a pinned mirror (host NUMA memory through the virtual memory API, exportable
    as a file descriptor), else why not."""
    try:
        d = driver.ensure_context(device)
        for name in ("HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
            if not driver.device_attribute(name, d):
                return f"the device reports {name} = 0"
    except (DeviceError, AttributeError) as e:
        return f"the driver cannot be asked ({e})"
    return ""


class PinnedHostMemory:
    """The mirror's memory on a GPU host: ``cuMemCreate`` on the host NUMA node the device is attached to,
    exportable as a POSIX file descriptor, mapped here for the host (the follower's copies)."""

    def __init__(self, device: int | None = None) -> None:
        why = mirror_supported(device)
        if why:
            raise DeviceError(801, "CUDA_ERROR_NOT_SUPPORTED", False, f"pinned log mirror: {why}",
                              "run without the mirror (EngineOptions.mirror=False)")
        self.device = driver.ensure_context(device)
        self._numa = host_numa(self.device)
        self._gran = _granularity(self._numa)

    def attach(self) -> None:
        driver.ensure_context(self.device)

    def size(self, nbytes: int) -> int:
        return -(-nbytes // self._gran) * self._gran

    def create(self, nbytes: int) -> tuple[_Mapped, int]:
        drv = driver.bindings()
        handle = driver.check(drv.cuMemCreate(nbytes, _prop(self._numa), 0), "cuMemCreate (pinned log mirror)")
        mem = _Mapped(handle, nbytes, self.device, host=True, dev=False)
        try:
            fd = int(driver.check(drv.cuMemExportToShareableHandle(
                handle, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                "cuMemExportToShareableHandle"))
        except BaseException:
            mem.close()
            raise
        return mem, fd


@dataclass
class _Seg:
    name: str
    mem: Any  # _Mapped, or another provider's memory: nbytes, host_view() and close()
    mapping: mmap.mmap
    view: memoryview
    mark: int  # bytes copied (and published to the keeper)
    walked: int  # where the next epoch starts (the end of the last committed epoch seen)


class LogMirror:
    """Follows ``log_dir`` (a DRAM log this process writes) and keeps a pinned copy of every committed byte in
    memory the keeper holds. Start it after the log exists; ``close`` stops the thread and unmaps this
    process's views (the keeper keeps the memory: that is the point); ``stop_keeper(log_dir)`` frees it."""

    def __init__(self, log_dir: str | os.PathLike[str], device: int | None = None, *, poll_s: float = 0.02,
                 memory: Any = None) -> None:
        self.log_dir = Path(log_dir)
        # where the copies live: pinned host memory of the driver (the default), or any provider with
        # ``create(nbytes) -> (memory with nbytes, host_view() and close(), descriptor)``, ``size(nbytes)`` and
        # ``attach()`` (called on the follower's thread first)
        self.memory = memory if memory is not None else PinnedHostMemory(device)
        self.keeper = ensure_keeper(self.log_dir)
        self.poll_s = poll_s
        self._segs: dict[str, _Seg] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._began = 0  # follower passes over the log begun
        self._idle_began = 0  # the number of the last pass that found nothing new to copy
        self._cond = threading.Condition()
        self._drop_stale()
        self._thread = threading.Thread(target=self._run, name="concordia-mirror", daemon=True)
        self._thread.start()

    def _drop_stale(self) -> None:
        """Entries a killed server left for segments this log no longer has, or for another log of this path:
        dropped (their memory freed) before this process mirrors anything."""
        try:
            entries = self.keeper.list_entries()
        except KeeperError:
            return
        man = load_manifest(self.log_dir)
        live = set(man.segments()) if man is not None else set()
        for e in entries:
            os.close(e.fd)
            if e.name not in live or _file_header(self.log_dir / e.name) != e.header:
                self.keeper.drop(e.name)

    def _run(self) -> None:
        try:
            self.memory.attach()  # the follower thread's own CUDA context
            while not self._stop.is_set():
                with self._cond:
                    self._began += 1
                    began = self._began
                progressed = self._once()
                with self._cond:
                    if not progressed:
                        self._idle_began = began
                    self._cond.notify_all()
                if not progressed:
                    self._stop.wait(self.poll_s)
        except BaseException as e:  # noqa: BLE001 - reported by wait_caught_up(); the log itself is unaffected
            self.error = e
            with self._cond:
                self._cond.notify_all()
            _log.warning("pinned log mirror stopped: %s (the log is unaffected; a restart restores from it)", e)

    def _once(self) -> bool:
        man = load_manifest(self.log_dir)
        if man is None:
            return False
        names = man.segments()
        progressed = False
        for name in names:
            seg = self._segs.get(name)
            if seg is None:
                seg = self._add(name)
                if seg is None:
                    continue
                progressed = True
            epochs, stop = walk_segment(seg.view, seg.walked)
            if epochs:
                seg.walked = epochs[-1].offset + epochs[-1].total_bytes
            del epochs, stop  # views into the mapping (the stop's exception holds the walk's frame)
            end = min(seg.walked, seg.mem.nbytes)  # a file segment may grow past what was mapped at first
            if end <= seg.mark:
                continue
            dst = seg.mem.host_view()
            pos = seg.mark
            while pos < end and not self._stop.is_set():
                k = min(COPY_PIECE, end - pos)
                dst[pos:pos + k] = np.frombuffer(seg.view[pos:pos + k], dtype=np.uint8)
                pos += k
                self.keeper.mark(name, pos)
                seg.mark = pos
            progressed = True
        for name in [n for n in self._segs if n not in names]:  # compacted away
            self.keeper.drop(name)
            self._close_seg(self._segs.pop(name))
        return progressed

    def _add(self, name: str) -> _Seg | None:
        path = self.log_dir / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < SEGMENT_HEADER_BYTES:
                return None
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        view = memoryview(mapping)
        header = _digest(bytes(view[:SEGMENT_HEADER_BYTES]))
        nbytes = self.memory.size(size)
        mem, efd = self.memory.create(nbytes)
        try:
            self.keeper.put(name, header, nbytes, efd, mark=0)
        finally:
            os.close(efd)
        seg = _Seg(name, mem, mapping, view, 0, SEGMENT_HEADER_BYTES)
        self._segs[name] = seg
        return seg

    @staticmethod
    def _close_seg(seg: _Seg) -> None:
        seg.mem.close()
        try:
            seg.view.release()
            seg.mapping.close()
        except BufferError:
            # a view of the mapping still referenced (an epoch walk's exception holds its frame in a cycle)
            import gc

            gc.collect()
            try:
                seg.view.release()
                seg.mapping.close()
            except BufferError:
                pass  # unmapped when the last view goes

    def wait_caught_up(self, timeout_s: float = 60.0) -> bool:
        """Until a pass of the follower that began after this call found nothing left to copy (True: every
        epoch committed before the call is mirrored), or ``timeout_s`` passed (False). Raises what stopped the
        mirror, if anything did."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            want = self._began + 1  # a pass that begins after this call
            while self._idle_began < want and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        if self.error is not None:
            raise self.error
        return True

    @property
    def mirrored_bytes(self) -> int:
        return sum(s.mark for s in self._segs.values())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for seg in self._segs.values():
            self._close_seg(seg)
        self._segs = {}


def _file_header(path: Path) -> bytes | None:
    """What identifies a segment file to the keeper: a digest of its header bytes (log id, generation,
    creation time)."""
    try:
        with open(path, "rb") as f:
            return _digest(f.read(SEGMENT_HEADER_BYTES))
    except OSError:
        return None


def _digest(header: bytes) -> bytes:
    import hashlib

    return hashlib.sha256(header).digest()


class MirrorView:
    """The mirror as a restarted process sees it: segment name -> (device-visible address, mark)."""

    def __init__(self, segs: dict[str, tuple[_Mapped, int]], attach_s: float, skipped: dict[str, str]) -> None:
        self._segs = segs
        self.attach_s = attach_s
        self.skipped = skipped  # name -> why the entry was not used
        self.bytes = sum(m for _, m in segs.values())

    @property
    def segments(self) -> list[str]:
        return sorted(self._segs)

    def translator(self, mappings: list[tuple[str, int, int]]) -> Any:
        """``translate(address, nbytes) -> address | None`` over a replay's mappings (name, address, length):
        the mirror's device-visible address of those bytes, or None where they are not mirrored."""
        from ..core.streamed import range_translator

        return range_translator([(addr, addr + n, self._segs[name][0].va, self._segs[name][1])
                                 for name, addr, n in mappings if name in self._segs])

    def close(self) -> None:
        for mem, _ in self._segs.values():
            mem.close()
        self._segs = {}


class MirrorAttach:
    """Attaches the keeper's mirror of ``log_dir`` on a helper thread (start it early: beside the model's load
    or the log's open); ``result()`` is the ``MirrorView``, or None where there is no usable mirror."""

    def __init__(self, log_dir: str | os.PathLike[str], device: int | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.device = device
        self._view: MirrorView | None = None
        self.why = ""
        self._thread = threading.Thread(target=self._run, name="concordia-mirror-attach", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            client = KeeperClient(self.log_dir)
            if client.ping() is None:
                self.why = "no mirror keeper runs for this log"
                return
            entries = client.list_entries()
            self._view = _attach(self.log_dir, entries, driver.ensure_context(self.device), t0)
        except Exception as e:  # noqa: BLE001 - best effort: without a mirror the restore reads the log
            self.why = f"the mirror could not be attached: {e}"
            _log.warning("pinned log mirror: %s; restoring from the log alone", self.why)

    def result(self) -> MirrorView | None:
        self._thread.join()
        return self._view


def _attach(log_dir: Path, entries: list[Entry], device: int, t0: float) -> MirrorView | None:
    drv = driver.bindings()
    segs: dict[str, tuple[_Mapped, int]] = {}
    skipped: dict[str, str] = {}
    try:
        for e in entries:
            try:
                if e.mark <= SEGMENT_HEADER_BYTES:
                    skipped[e.name] = "nothing mirrored"
                    continue
                if _file_header(log_dir / e.name) != e.header:
                    skipped[e.name] = "its header differs from the segment file's (another log, or rewritten)"
                    continue
                handle = driver.check(drv.cuMemImportFromShareableHandle(
                    e.fd, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                    "cuMemImportFromShareableHandle")
                segs[e.name] = (_Mapped(handle, e.capacity, device, host=False, dev=True), e.mark)
            finally:
                os.close(e.fd)
    except BaseException:
        for mem, _ in segs.values():
            mem.close()
        raise
    if not segs:
        return None
    return MirrorView(segs, time.perf_counter() - t0, skipped)
