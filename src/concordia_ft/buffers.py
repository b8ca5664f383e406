"""Buffer adapters: what the runtime needs to know about a registered numpy array or torch tensor.

The runtime accepts both without importing torch: a tensor is recognised by its type's module, and torch is
imported only to view a host tensor's bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .core.regions import MemoryRange
from .errors import RegionError


def is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def is_cuda_tensor(obj: Any) -> bool:
    return is_torch(obj) and bool(obj.is_cuda)


def describe_buffer(buf: Any) -> tuple[str, tuple[int, ...], MemoryRange]:
    """dtype string, shape and memory range of a numpy array or torch tensor (contiguous)."""
    if is_torch(buf):
        if not buf.is_contiguous():
            raise RegionError("register a contiguous tensor (call .contiguous() and register that buffer)")
        nbytes = buf.numel() * buf.element_size()
        return str(buf.dtype), tuple(buf.shape), MemoryRange(str(buf.device), buf.data_ptr(), nbytes)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise RegionError("register a C-contiguous array (np.ascontiguousarray makes a copy you can register)")
        if not buf.flags.writeable:
            raise RegionError("the array is read-only; register a writable array so recovery can restore into it")
        return str(buf.dtype), tuple(buf.shape), MemoryRange("cpu", buf.__array_interface__["data"][0], buf.nbytes)
    raise RegionError(f"register a numpy array or a torch tensor, got {type(buf).__name__}")


def host_bytes(buf: Any) -> npt.NDArray[np.uint8]:
    """A writable 1-D uint8 view of a host buffer's bytes (no copy)."""
    if is_torch(buf):
        import torch

        t = buf.detach()
        return t.reshape(-1).view(torch.uint8).numpy()  # type: ignore[no-any-return]
    return buf.reshape(-1).view(np.uint8)  # type: ignore[no-any-return]


def any_nonzero(buf: Any) -> bool:
    """Whether any byte of the buffer (host or device) is nonzero."""
    if is_torch(buf):
        import torch

        return bool(buf.detach().reshape(-1).view(torch.uint8).any())
    return bool(buf.reshape(-1).view(np.uint8).any())


def host_bitmap(buf: Any) -> Any:
    """A host flag buffer as numpy (a CPU tensor's numpy view); None and device tensors unchanged."""
    if buf is None or not is_torch(buf) or buf.is_cuda:
        return buf
    return buf.numpy()
