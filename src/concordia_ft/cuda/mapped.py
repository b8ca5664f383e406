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

    def place(self, address: int) -> None:
        driver.memcpy_dtoh_async(address, self.ptr, self.copy_bytes, self.stream)
        self._address = address

    def wait(self) -> None:
        self.stream.synchronize()
        if self.pad and self._address:
            import ctypes

            ctypes.memset(self._address + self.copy_bytes, 0, self.pad)


__all__ = ["DevicePayload", "HostRegistration", "register_host_range"]
