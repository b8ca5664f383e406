"""The one error tree of Concordia-FT.

Every message says what happened, the values involved, and what to do next. Exceptions are picklable
(they cross process boundaries): each keeps its constructor arguments in ``args``.
"""

from __future__ import annotations


class ConcordiaError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(ConcordiaError, ValueError):
    """A caller's input is wrong (bad region, bad option value, bad path). Nothing was changed."""


class RegionError(ConfigError):
    """A region registration is invalid (overlap, zero size, duplicate name, bad alignment...)."""


class LogError(ConcordiaError):
    """The recovery log cannot be used as asked (locked, missing, wrong format version...)."""


class LogCorruptError(LogError):
    """Damage before the tail of the log: committed data cannot be trusted past ``offset``."""

    def __init__(self, path: str, offset: int, reason: str, hint: str = "") -> None:
        super().__init__(path, offset, reason, hint)
        self.path = path
        self.offset = offset
        self.reason = reason
        self.hint = hint or (
            "the epochs before this offset are intact; run `concordia log check DIR` for a report, "
            "and restore this segment from a replica if you have one"
        )

    def __str__(self) -> str:
        return f"{self.reason} in {self.path} at offset {self.offset}; {self.hint}"


class LogLockedError(LogError):
    """Another writer (or compactor) holds the log directory."""


class RecoveryError(ConcordiaError):
    """Recovery could not produce a verified state (nothing committed, or it does not fit the target)."""


class CheckpointError(ConcordiaError):
    """A checkpoint (``Runtime.checkpoint``, ``checkpoint_async``, ``RecoveryLog.append``) failed.

    ``committed`` False: epoch ``epoch`` never committed; the log still ends at ``last_committed``, intact, and
    the changes it held are logged again by the next checkpoint. ``committed`` True: the epoch did commit but the
    change trackers could not advance after it, so the next checkpoint logs every region in full.

    ``log_failed`` True: a write or sync failed in a way that leaves what the disk holds unknown (core/DESIGN.md,
    "When a write or a sync fails"), so the writer appends nothing more: every later checkpoint raises this
    again. Close the Runtime (or RecoveryLog) and open the directory again; the new writer replays what the
    disk holds (epochs up to ``last_committed`` at least) and goes on from its last whole epoch."""

    def __init__(self, epoch: int, last_committed: int | None, committed: bool, cause: str,
                 log_failed: bool = False) -> None:
        super().__init__(epoch, last_committed, committed, cause, log_failed)
        self.epoch = epoch
        self.last_committed = last_committed
        self.committed = committed
        self.cause = cause
        self.log_failed = log_failed

    def __str__(self) -> str:
        if self.committed:
            return (f"epoch {self.epoch} committed, but advancing the change trackers after it failed: {self.cause}; "
                    "the next checkpoint logs every region in full")
        upto = "no epoch is committed yet" if self.last_committed is None else \
            f"epochs up to {self.last_committed} are committed and intact"
        if self.log_failed:
            return (f"epoch {self.epoch} was not committed: {self.cause}. The log is failed and appends nothing more "
                    f"({upto}): close this Runtime and open the log directory again, which replays what the disk "
                    "holds and goes on from its last whole epoch")
        return (f"epoch {self.epoch} failed and was not committed: {self.cause}; "
                f"{upto}, and the next checkpoint logs the changes again (fix the cause first)")


class CompactionError(LogError):
    """A compaction (background or ``Runtime.compact()``) failed. The log is intact: the segments it would have
    replaced stay in the manifest, every committed epoch is kept, and appending goes on."""

    def __init__(self, log_dir: str, cause: str) -> None:
        super().__init__(log_dir, cause)
        self.log_dir = log_dir
        self.cause = cause

    def __str__(self) -> str:
        return (f"compaction of {self.log_dir} failed: {self.cause}; the log is intact (the old segments stay, no "
                "committed epoch is lost); fix the cause, then call Runtime.compact() (or let the next threshold "
                "retry it)")


class CompactionWarning(UserWarning):
    """A compaction failed and the runtime was told to go on (``on_compaction_error="warn"``, the default of
    Session, Engine and the LoRA trainer): the log is intact, appending goes on, the suffix keeps growing until
    a compaction succeeds. ``Runtime.compaction_error`` holds the CompactionError with the cause."""


class CompileError(ConcordiaError):
    """NVRTC (or ptxas) rejected generated device code. ``log`` holds the compiler output."""

    def __init__(self, name: str, log: str) -> None:
        super().__init__(name, log)
        self.name = name
        self.log = log

    def __str__(self) -> str:
        return f"compiling {self.name} failed:\n{self.log}"


class DeviceError(ConcordiaError):
    """A CUDA driver call failed. ``sticky`` errors poison the context: the process must restart.
    ``explanation`` says what the code means (cuda/results.py)."""

    def __init__(self, code: int, name: str, sticky: bool, what: str = "", explanation: str = "") -> None:
        super().__init__(code, name, sticky, what, explanation)
        self.code = code
        self.name = name
        self.sticky = sticky
        self.what = what
        self.explanation = explanation

    def __str__(self) -> str:
        todo = (
            "the CUDA context is poisoned: restart the process and recover from the log "
            "(concordia_ft.recover / Session.recover)"
            if self.sticky
            else "not sticky: this process can go on using CUDA"
        )
        where = f" in {self.what}" if self.what else ""
        means = f": {self.explanation}" if self.explanation else ""
        return f"CUDA error {self.code} ({self.name}){where}{means}; {todo}"


class ServeError(ConcordiaError):
    """A request the serving engine cannot take; ``status`` is the HTTP status the server answers with."""

    status = 400
    code = "invalid_request_error"


class QueueFullError(ServeError):
    status = 429
    code = "queue_full"


class ContextLengthError(ServeError, ConfigError):
    status = 400
    code = "context_length_exceeded"
