"""Type stubs of the C ring fast paths (``_ringfast.c``)."""

from collections.abc import Callable
from typing import Any

SLOT_BYTES: int
RESULT_BYTES: int
OFF_TAIL: int
OFF_STATE: int
STATE_RUNNING: int
PAYLOAD_BITS: int

class _ProducerBase:
    head: int
    _tail_seen: int
    def _bind(self, buf: Any, capacity: int, slots_off: int, results_off: int, /) -> None: ...
    def _hooks(self, slow: Callable[..., int] | None, check: Callable[..., None] | None,
               on_spin: Callable[[], None] | None, on_timeout: Callable[[int, float], Any] | None,
               on_failed: Callable[[int, int, int], Any] | None, /) -> None: ...
    def tail(self) -> int: ...
    def try_publish(self, opcode: int, a0: int = 0, a1: int = 0, a2: int = 0, a3: int = 0, a4: int = 0,
                    a5: int = 0, aux: int = 0, flags: int = 0) -> int: ...
    def submit(self, opcode: int, a0: int = 0, a1: int = 0, a2: int = 0, a3: int = 0, a4: int = 0,
               a5: int = 0, aux: int = 0) -> int: ...
    def wait(self, ticket: int, timeout_s: float = 10.0) -> int: ...
