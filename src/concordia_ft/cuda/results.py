"""What a CUDA driver result means for this process: the table behind ``DeviceError``'s message.

The split that matters to a fault-tolerance runtime is "recover in place" vs "restart": after a *sticky*
result the context is poisoned (every later CUDA call returns the same error; the primary context, shared with
torch, cannot be rebuilt in this process), so the only way on is to restart the process and recover from the
log. The sticky set follows the CUDA 13 driver API documentation of ``CUresult``: every code documented as
"the process must be terminated and relaunched" (700, 702, 714-719, 721, 226, 810, 911) plus 710
(device-side assert: "the context cannot be used anymore, and must be destroyed", which for a primary context
shared with torch means the same) and 214 (uncorrectable ECC: device memory is lost). 709 and 720 sit next to
them in the numbering but leave the context usable. ``tests/test_cuda_compile.py`` checks this table against
the descriptions the installed cuda-bindings carries, so a new CUDA release that adds a poisoning code fails
CI instead of being reported as recoverable.

Codes outside the table are explained from cuda-bindings' own description of the enum member (the same text
cuda.core's ``driver_cu_result_explanations`` serves), trimmed to its first sentence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ResultInfo:
    name: str
    sticky: bool
    explanation: str


_KERNEL = "a kernel faulted on the device"

RESULTS: dict[int, ResultInfo] = {
    214: ResultInfo("CUDA_ERROR_ECC_UNCORRECTABLE", True,
                    "uncorrectable ECC error in device memory: GPU data is lost (if it repeats, "
                    "the GPU needs a reset or replacing: check `nvidia-smi -q -d ECC`)"),
    226: ResultInfo("CUDA_ERROR_CONTAINED", True,
                    "the GPU contained a hardware error or a bad NVLink peer access"),
    700: ResultInfo("CUDA_ERROR_ILLEGAL_ADDRESS", True,
                    f"{_KERNEL}: a load or store to an invalid address"),
    702: ResultInfo("CUDA_ERROR_LAUNCH_TIMEOUT", True,
                    "a kernel ran past the display watchdog's limit"),
    709: ResultInfo("CUDA_ERROR_CONTEXT_IS_DESTROYED", False,
                    "the context current in this thread was destroyed (or a primary context reset elsewhere in "
                    "this process); streams, modules and memory made in it are gone: make them again, or "
                    "restart and recover"),
    710: ResultInfo("CUDA_ERROR_ASSERT", True,
                    "a device-side assert fired in a kernel; every device allocation in the context is "
                    "invalid (run with CUDA_LAUNCH_BLOCKING=1 to find the kernel)"),
    714: ResultInfo("CUDA_ERROR_HARDWARE_STACK_ERROR", True,
                    f"{_KERNEL}: stack corruption or stack overflow"),
    715: ResultInfo("CUDA_ERROR_ILLEGAL_INSTRUCTION", True, f"{_KERNEL}: an illegal instruction"),
    716: ResultInfo("CUDA_ERROR_MISALIGNED_ADDRESS", True,
                    f"{_KERNEL}: a load or store to a misaligned address"),
    717: ResultInfo("CUDA_ERROR_INVALID_ADDRESS_SPACE", True,
                    f"{_KERNEL}: an address outside the address space the instruction allows"),
    718: ResultInfo("CUDA_ERROR_INVALID_PC", True, f"{_KERNEL}: its program counter wrapped around"),
    719: ResultInfo("CUDA_ERROR_LAUNCH_FAILED", True,
                    f"{_KERNEL} (an invalid pointer, out-of-bounds shared memory...)"),
    720: ResultInfo("CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", False,
                    "a cooperative launch asked for more blocks than can be resident at once; nothing ran"),
    721: ResultInfo("CUDA_ERROR_TENSOR_MEMORY_LEAK", True,
                    "a kernel exited without freeing its tensor memory"),
    810: ResultInfo("CUDA_ERROR_MPS_CLIENT_TERMINATED", True,
                    "the MPS server terminated this client"),
    911: ResultInfo("CUDA_ERROR_EXTERNAL_DEVICE", True,
                    "a device outside the GPU signalled an error for data the GPU was waiting on"),
}

STICKY_CODES: dict[int, str] = {code: info.name for code, info in RESULTS.items() if info.sticky}


def is_sticky(code: int) -> bool:
    """True when ``code`` poisons the context: restart the process and recover from the log."""
    return int(code) in STICKY_CODES


def _bindings_description(code: int) -> tuple[str, str]:
    """(name, first sentence of the description) from cuda-bindings, or ("", "") when it has none."""
    try:
        from cuda.bindings import driver as drv

        member = drv.CUresult(code)
    except (ImportError, ValueError):
        return "", ""
    text = " ".join((member.__doc__ or "").split())
    text = re.sub(r":py:obj:`~?\.?([^`]+)`", r"\1", text)
    first = re.split(r"(?<=[a-z0-9)])\. ", text, maxsplit=1)[0].rstrip(".")
    return str(member.name), first


def result_name(code: int) -> str:
    info = RESULTS.get(int(code))
    if info is not None:
        return info.name
    name, _ = _bindings_description(int(code))
    return name or f"CUDA_ERROR_{code}"


def explain(code: int) -> str:
    """One clause saying what ``code`` means (our table, else the driver documentation's first sentence)."""
    info = RESULTS.get(int(code))
    if info is not None:
        return info.explanation
    _, first = _bindings_description(int(code))
    if first.startswith("This indicates that "):
        first = first[len("This indicates that "):]
    elif first.startswith("This error indicates that "):
        first = first[len("This error indicates that "):]
    return first[:1].lower() + first[1:]
