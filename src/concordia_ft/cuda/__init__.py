"""CUDA backend: the only package that talks to the driver (cuda.bindings) and NVRTC.

Importing it touches no GPU and needs no driver: ``driver`` initialises CUDA on first use. Modules:

- ``driver``: lazy init, error translation (``DeviceError`` with ``sticky``), contexts, streams, events, launches.
- ``nvrtc``: NVRTC compilation to cubin with an on-disk cache, module loading.
- ``memory``: pinned, host-mapped and device buffers.
- ``handlers`` (+ ``handlers.cuh``): dirty-page handlers rendered per region spec.
- ``crc``: CRC32C kernels (a streamed restore's checksums on the device); ``streamed``: a streamed restore's sink.
- ``trackers``: ``make_cuda_tracker`` - the core.tracking.Tracker contract for CUDA tensors.
"""

from __future__ import annotations

__all__ = ["driver", "nvrtc"]
