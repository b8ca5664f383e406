"""The error types of the experiments (the resident executor and the kernel instrumentation), beside the
product's own (``concordia_ft.errors``, re-exported here for the relative imports of these packages)."""

from __future__ import annotations

from concordia_ft.errors import CompileError, ConcordiaError, ConfigError, DeviceError

__all__ = ["CompileError", "ConcordiaError", "ConfigError", "DescriptorError", "DeviceError", "ExecutorError",
           "ExecutorTimeout", "InstrumentError", "PtxParseError", "RingError", "RingFullError", "UnsafeKernelError"]


class RingError(ConcordiaError):
    """The task ring cannot be used as asked (full, bad layout, consumer error, result overwritten)."""


class RingFullError(RingError):
    """Every slot holds a task the consumer has not completed yet."""


class DescriptorError(RingError, ConfigError):
    """A task's fields do not fit a ring descriptor (an argument of 2**48 or more, a negative value, aux of
    2**32 or more...). Nothing was published."""


class ExecutorError(ConcordiaError):
    """A task failed on the device, the executor stopped on a protocol error, or a wait timed out."""


class ExecutorTimeout(ExecutorError):
    """A task did not complete within its timeout."""


class InstrumentError(ConcordiaError):
    """Kernel instrumentation (PTX safe points, pause/resume, the interposer) cannot do what was asked."""


class PtxParseError(InstrumentError, ConfigError):
    """The PTX text handed to the safe-point rewriter is not what it can read."""

    def __init__(self, what: str, line: int, reason: str) -> None:
        super().__init__(what, line, reason)
        self.what = what
        self.line = line
        self.reason = reason

    def __str__(self) -> str:
        return (f"cannot read PTX ({self.what}, line {self.line}): {self.reason}; pass the text of a whole "
                "module as the compiler wrote it (Triton's asm['ptx'])")


class UnsafeKernelError(InstrumentError):
    """A kernel cannot be paused and resumed by blocks without breaking exactly-once execution.

    ``reason`` is one of the names in ``concordia_lab.instrument.safepoints.REFUSALS``."""

    def __init__(self, kernel: str, reason: str, detail: str) -> None:
        super().__init__(kernel, reason, detail)
        self.kernel = kernel
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return (f"kernel {self.kernel} cannot get pause safe points ({self.reason}): {self.detail}; it runs "
                "unmodified and can only be checkpointed at its launch boundaries")
