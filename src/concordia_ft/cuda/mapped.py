"""GPU payloads DMA'd straight into the log's own pages.

``register_host_range`` pins a mapped log segment with the driver (``cuMemHostRegister``, PORTABLE |
DEVICEMAP): a ``cuMemcpyDtoHAsync`` into it then runs at full PCIe speed (55 GB/s measured on the H200, vs
4.1 GB/s for a DtoH into pinned memory followed by a pwrite into the segment) and no staging copy exists.
``RecoveryLog.set_mapping_registrar(register_host_range)`` applies it to every segment the log maps, the spare
one prepared ahead included, so the 10.9 ms per 256 MiB registration never lands on an append.

``DevicePayload`` is a device buffer handed to ``RecoveryLog.append`` as a delta's payload (core/log.py,
``PlacedPayload``): the log plans the epoch, asks the payload to ``place`` itself at its offset in the mapping,
waits, checksums the placed bytes and writes the header and commit marker after them.
"""

from __future__ import annotations

import threading
from typing import Any

from . import driver


class HostRegistration:
    """A host range pinned with ``cuMemHostRegister``; ``close`` unregisters it (before the memory goes)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.device = driver.ensure_context()
        drv = driver.bindings()
        flags = drv.CU_MEMHOSTREGISTER_PORTABLE | drv.CU_MEMHOSTREGISTER_DEVICEMAP
        driver.check(drv.cuMemHostRegister(address, nbytes, flags), f"cuMemHostRegister({nbytes} bytes)")
        self.address, self.nbytes = int(address), int(nbytes)

    def close(self) -> None:
        """Unregister (from any thread: a sealed segment is closed on a background thread, core/mapped.py)."""
        if self.address:
            driver.ensure_context(self.device)
            driver.check(driver.bindings().cuMemHostUnregister(self.address), "cuMemHostUnregister")
            self.address = 0


def register_host_range(address: int, nbytes: int) -> HostRegistration:
    return HostRegistration(address, nbytes)


class _Gates:
    """Host words the GPU writes after each chunk of a payload's DMA (``cuStreamWriteValue32`` into page-locked,
    device-mapped memory): the log's C checksum reads a chunk once its word holds the chunk's tag, so the CRC32C
    runs while the rest of the copy is in flight. One process-wide ring of words; each chunk gets a fresh tag."""

    WORDS = 4096

    def __init__(self) -> None:
        from .memory import PinnedBuffer

        self.buf = PinnedBuffer(4 * self.WORDS)
        self.buf.view()[:] = bytes(4 * self.WORDS)
        self.next_word = 0
        self.next_tag = 1
        self.lock = threading.Lock()

    def take(self, n: int) -> list[tuple[int, int]]:
        """``n`` (word index, tag) pairs."""
        with self.lock:
            out = []
            for _ in range(n):
                out.append((self.next_word, self.next_tag))
                self.next_word = (self.next_word + 1) % self.WORDS
                self.next_tag = self.next_tag % 0xFFFFFFFF + 1
            return out


_GATES: _Gates | None = None
_GATES_OFF = False
GATE_CHUNK = 8 << 20  # DMA chunk (a word written after each); a payload of fewer than 2 is one plain copy
GATE_MAX_CHUNKS = 32


def _gates() -> _Gates | None:
    global _GATES, _GATES_OFF
    if _GATES is None and not _GATES_OFF:
        try:
            _GATES = _Gates()
        except Exception:  # noqa: BLE001 - no mapped pinned memory: plain copies
            _GATES_OFF = True
    return _GATES


class _TimingEvents:
    """A pool of timing events (pairs around one payload's copies: how long the DMA itself took on the GPU, so
    the log's "wait" phase can be split into DMA and what is not)."""

    def __init__(self) -> None:
        self.free: list[Any] = []
        self.lock = threading.Lock()

    def take(self) -> Any:
        with self.lock:
            if self.free:
                return self.free.pop()
        return driver.Event(timing=True)

    def give(self, ev: Any) -> None:
        with self.lock:
            if len(self.free) < 64:
                self.free.append(ev)
                return
        ev.close()


_TIMING = _TimingEvents()


class DevicePayload:
    """``nbytes`` bytes at device address ``ptr`` (valid in stream order on ``stream``), to be DMA'd into a host
    address the log picks. ``pad`` zero bytes follow the device bytes (a region that is not a whole number of
    pages: its last page is padded with zeros, as the staged path does). ``keep`` holds whatever owns ``ptr``."""

    def __init__(self, ptr: int, nbytes: int, stream: driver.Stream, *, pad: int = 0, keep: Any = None) -> None:
        self.ptr, self.copy_bytes, self.pad = int(ptr), int(nbytes), int(pad)
        self.nbytes = self.copy_bytes + self.pad
        self.stream = stream
        self.keep = keep
        self._address = 0

    gates: list[tuple[int, int, int]] | None = None  # (end offset, word, tag) of each chunk, once placed
    flags_address = 0

    def place(self, address: int) -> None:
        self._address = address
        if self.pad:  # the zero tail is not part of the copy: written now, beside it
            import ctypes

            ctypes.memset(address + self.copy_bytes, 0, self.pad)
        n = self.copy_bytes
        g = _gates() if n >= 2 * GATE_CHUNK else None
        try:
            self._timing = (_TIMING.take(), _TIMING.take())
            self._timing[0].record(self.stream)
        except Exception:  # noqa: BLE001 - a measurement only: the copy goes on without it
            self._timing = None
        try:
            self._copy(address, n, g)
        finally:
            if self._timing is not None:
                self._timing[1].record(self.stream)

    _timing: tuple[Any, Any] | None = None

    def copy_seconds(self) -> float:
        """Seconds the GPU spent on this payload's copies (after ``wait``; 0 when unknown)."""
        t, self._timing = self._timing, None
        if t is None:
            return 0.0
        try:
            driver.ensure_context(self.stream.device)  # the log may ask from another thread
            return float(t[0].elapsed_ms(t[1])) / 1e3
        except Exception:  # noqa: BLE001 - a measurement only
            return 0.0
        finally:
            _TIMING.give(t[0])
            _TIMING.give(t[1])

    def drop_timing(self) -> None:
        """Give the timing events back unread (no driver call)."""
        t, self._timing = self._timing, None
        if t is not None:
            _TIMING.give(t[0])
            _TIMING.give(t[1])

    def _copy(self, address: int, n: int, g: _Gates | None) -> None:
        global _GATES_OFF
        if g is None:
            driver.memcpy_dtoh_async(address, self.ptr, n, self.stream)
            return
        chunk = max(GATE_CHUNK, -(-n // GATE_MAX_CHUNKS))
        chunk = -(-chunk // 4096) * 4096
        ends = list(range(chunk, n, chunk)) + [n]
        words = g.take(len(ends))
        drv = driver.bindings()
        done, gates = 0, []
        try:
            for end, (word, tag) in zip(ends, words, strict=True):
                driver.memcpy_dtoh_async(address + done, self.ptr + done, end - done, self.stream)
                done = end
                driver.check(drv.cuStreamWriteValue32(self.stream.handle, g.buf.device_ptr + 4 * word, tag, 0),
                             "cuStreamWriteValue32")
                gates.append((end if end < n else self.nbytes, word, tag))  # the zero tail is there already
        except Exception:  # noqa: BLE001 - stream memory operations refused: the rest as one plain copy
            _GATES_OFF = True
            if done < n:
                driver.memcpy_dtoh_async(address + done, self.ptr + done, n - done, self.stream)
            return
        self.gates, self.flags_address = gates, g.buf.host_ptr

    def wait(self) -> None:
        self.stream.synchronize()


__all__ = ["DevicePayload", "HostRegistration", "register_host_range"]
