"""Fault injection around a REAL recovery log (imported as ``faults``; llm_helpers' child processes use it too).

``FaultyLog`` wraps a ``RecoveryLog`` and hands everything to it, except that ``append`` can be held up (a slow
disk) or refused before a byte is written (what a full disk looks like after ``FileSegment`` cut its partial
write back) for chosen epoch numbers. It records when each append ran, so tests can check the ordering of
asynchronous epochs against the real writer.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Collection
from typing import Any

from concordia_ft.errors import LogError


class FaultyLog:
    def __init__(self, log: Any, *, delay_s: float = 0.0, delay_epochs: Collection[int] | None = None,
                 fail_epochs: Collection[int] = ()) -> None:
        self.inner = log
        self.delay_s = delay_s
        self.delay_epochs = None if delay_epochs is None else set(delay_epochs)
        self.fail_epochs = set(fail_epochs)
        self.appends: list[tuple[int, float, float, bool]] = []  # (epoch, start, end, committed)
        self.max_concurrent = 0
        self._concurrent = 0
        self._lock = threading.Lock()

    def append(self, **kw: Any) -> Any:
        number = (self.inner.last_epoch or 0) + 1
        start = time.perf_counter()
        with self._lock:
            self._concurrent += 1
            self.max_concurrent = max(self.max_concurrent, self._concurrent)
        ok = False
        try:
            if self.delay_s and (self.delay_epochs is None or number in self.delay_epochs):
                time.sleep(self.delay_s)
            if number in self.fail_epochs:
                raise LogError(f"appending epoch {number} to {self.inner.dir} failed: [Errno {errno.ENOSPC}] "
                               f"{os.strerror(errno.ENOSPC)} (injected); nothing of this epoch was committed")
            res = self.inner.append(**kw)
            ok = True
            return res
        finally:
            with self._lock:
                self._concurrent -= 1
            self.appends.append((number, start, time.perf_counter(), ok))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
