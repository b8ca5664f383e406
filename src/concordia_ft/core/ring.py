"""The executor ring protocol: a single-producer / single-consumer ring of 64-byte descriptors over any
writable memoryview.

On a GPU the buffer is host-mapped pinned memory: the host (producer) writes descriptors and ``head``, the
resident executor (consumer) writes ``tail``, per-slot results, the heartbeat and its state. Here the protocol
is plain Python over a memoryview, so CPU CI tests it over ordinary memory with a consumer thread standing in
for the device (:class:`RingConsumer`). ``cuda/executor.cuh`` implements the same consumer on the device; its
constants are rendered from this module, so the two cannot drift.

Layout (little-endian; every shared word has exactly one writer and its own 64-byte line)::

    0     line 0  host, once : magic u32, version u32, capacity u32, slot_bytes u32, slots_off u32, results_off u32
    64    line 1  host       : head u64        tasks published; task ``seq`` (1-based) lives in slot (seq-1) % capacity
    128   line 2  host       : stop u32        0 run, 1 exit at the next task boundary (tasks left stay queued)
    192   line 3  device     : tail u64        tasks completed, in order (== seq of the last completed task)
    256   line 4  device     : heartbeat u64   bumped while the consumer polls
    320   line 5  device     : state u32, image_id u32, error u32, pad u32, error_seq u64
    384   line 6  device     : starts u64      consumer instances started on this ring
    448   line 7  host       : release_count u32 (entries used in the exit-release table below)
    512   lines 8..11 host   : exit-release table, 16 B each: flag address u64, value u32, pad u32
                               (the consumer stores ``value`` to each ``flag`` when it exits: armed waits it
                               could fire are released, never left pending)
    1024  slots              : capacity x 64 B descriptors
    ...   results            : capacity x 16 B: value u32, status u32, seq u64 (seq written last)

Descriptor (64 B): seq u64 (written last by the producer), opcode u16, flags u16, aux u32, args 6 x u64.

Memory ordering: the producer writes a slot's body, then its seq, then ``head`` (program order: x86-64 stores
are not reordered with older stores, so these are release stores; the consumer loads ``head`` with acquire
and checks the slot's seq, so a torn or stale slot is detected, never run). The consumer writes a result's
value then its seq, then ``tail`` (release). No word is read-modify-written by both sides.
"""

from __future__ import annotations

import enum
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError, RingError, RingFullError

MAGIC = 0x47524343  # b"CCRG" little-endian
VERSION = 1
LINE_BYTES = 64
SLOT_BYTES = 64
RESULT_BYTES = 16
CTRL_BYTES = 1024
MAX_RELEASES = 4
MAX_ARGS = 6

# Byte offsets of the shared words (rendered into executor.cuh as CCR_OFF_*).
OFF_MAGIC = 0
OFF_HEAD = 64
OFF_STOP = 128
OFF_TAIL = 192
OFF_HEARTBEAT = 256
OFF_STATE = 320
OFF_IMAGE = 324
OFF_ERROR = 328
OFF_ERROR_SEQ = 336
OFF_STARTS = 384
OFF_RELEASE_COUNT = 448
OFF_RELEASES = 512

# Descriptor field offsets inside a slot.
DESC_OFF_SEQ = 0
DESC_OFF_OPCODE = 8
DESC_OFF_FLAGS = 10
DESC_OFF_AUX = 12
DESC_OFF_ARGS = 16

assert OFF_HEAD == 64 and DESC_OFF_OPCODE == 8  # try_publish inlines both

_BODY = struct.Struct("<HHI6Q")  # opcode, flags, aux, args: bytes 8..63 of a slot
_RESULT = struct.Struct("<IIQ")  # value, status, seq


class Opcode(enum.IntEnum):
    """Built-in operations. Elementwise ops: args = (a, b, out, n); float32 buffers by device pointer."""

    NOP = 0
    ADD = 1  # out = a + b
    MUL = 2  # out = a * b
    SUB = 3  # out = a - b
    RELU = 4  # out = max(a, 0)
    SILU = 5  # out = a / (1 + exp(-a))
    SCALE = 6  # out = alpha * a, alpha = aux as float32 bits
    ADD_RELU = 7  # out = max(a + b, 0)
    MARK = 8  # ((u32*)a)[b] += 1: a task that is visibly run exactly once
    TRIGGER = 9  # *(u32*)a = aux (release, system scope): fires a pre-armed launch waiting on that word
    PAGE_DIFF = 10  # a=cur, b=shadow, out=u32 flag per page, n=pages, aux=page bytes; result = dirty count
    RESTORE = 11  # a=src payload (page after page), b=u32 page indices, out=region, n=pages, aux=page bytes
    SLEEP = 12  # spin for a ns on the device (tests: a long task)


class ConsumerState(enum.IntEnum):
    """The consumer's ``state`` word (device-written)."""

    NOT_STARTED = 0
    RUNNING = 1
    EXITED_STOP = 2  # host asked (stop flag)
    EXITED_IDLE = 3  # no task within the idle timeout
    EXITED_LEASE = 4  # resident longer than its lease: exits so nothing waits on it unboundedly
    EXITED_ERROR = 5  # protocol error (slot seq mismatch, bad opcode): see error / error_seq


class Status(enum.IntEnum):
    OK = 0
    BAD_OPCODE = 1
    BAD_ARGS = 2


@dataclass(frozen=True)
class Descriptor:
    opcode: int
    args: tuple[int, ...] = ()
    flags: int = 0
    aux: int = 0
    seq: int = 0


@dataclass(frozen=True)
class Result:
    seq: int
    value: int
    status: int


def ring_bytes(capacity: int) -> int:
    """Bytes a ring of ``capacity`` slots needs (control block + slots + results)."""
    check_capacity(capacity)
    return CTRL_BYTES + capacity * (SLOT_BYTES + RESULT_BYTES)


def check_capacity(capacity: int) -> int:
    if capacity < 2 or capacity & (capacity - 1) or capacity > 1 << 20:
        raise ConfigError(f"ring capacity must be a power of two in [2, 2**20], got {capacity}")
    return capacity


def slot_index(seq: int, capacity: int) -> int:
    """Slot of task ``seq`` (1-based)."""
    return (seq - 1) & (capacity - 1)


def free_slots(head: int, tail: int, capacity: int) -> int:
    """Slots the producer may still fill; raises if the counters are inconsistent (tail ahead of head, or
    more in flight than the ring holds)."""
    in_flight = head - tail
    if not 0 <= in_flight <= capacity:
        raise RingError(f"ring counters inconsistent: head {head}, tail {tail}, capacity {capacity}")
    return capacity - in_flight


def encode_descriptor(d: Descriptor) -> bytes:
    return struct.pack("<Q", d.seq) + encode_body(d.opcode, d.args, d.flags, d.aux)


def encode_body(opcode: int, args: tuple[int, ...] = (), flags: int = 0, aux: int = 0) -> bytes:
    if len(args) > MAX_ARGS:
        raise ConfigError(f"a descriptor holds at most {MAX_ARGS} args, got {len(args)}")
    a = tuple(args) + (0,) * (MAX_ARGS - len(args))
    return _BODY.pack(opcode, flags, aux, *a)


def decode_descriptor(raw: bytes | memoryview) -> Descriptor:
    if len(raw) != SLOT_BYTES:
        raise ConfigError(f"a descriptor is {SLOT_BYTES} bytes, got {len(raw)}")
    (seq,) = struct.unpack_from("<Q", raw, 0)
    opcode, flags, aux, *args = _BODY.unpack_from(raw, DESC_OFF_OPCODE)
    return Descriptor(opcode, tuple(args), flags, aux, seq)


def float_bits(x: float) -> int:
    """A float32's bit pattern (the SCALE op's alpha travels in ``aux``)."""
    return int(struct.unpack("<I", struct.pack("<f", x))[0])


class RingLayout:
    """Typed views of one ring in ``buf``; shared by producer and consumer."""

    def __init__(self, buf: memoryview, capacity: int) -> None:
        check_capacity(capacity)
        need = ring_bytes(capacity)
        mv = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        if mv.readonly:
            raise ConfigError("the ring needs a writable buffer")
        if mv.nbytes < need:
            raise ConfigError(f"a ring of {capacity} slots needs {need} bytes, the buffer has {mv.nbytes}")
        self.buf = mv[:need]
        self.capacity = capacity
        self.mask = capacity - 1
        self.slots_off = CTRL_BYTES
        self.results_off = CTRL_BYTES + capacity * SLOT_BYTES
        self.q = self.buf.cast("Q")  # u64 words
        self.u32 = self.buf.cast("I")

    def initialise(self) -> None:
        """Zero the ring and write the header (producer side, before any consumer starts)."""
        self.buf[:] = bytes(len(self.buf))
        struct.pack_into("<IIIIII", self.buf, OFF_MAGIC, MAGIC, VERSION, self.capacity, SLOT_BYTES,
                         self.slots_off, self.results_off)

    def validate(self) -> None:
        magic, version, cap, sb, so, ro = struct.unpack_from("<IIIIII", self.buf, OFF_MAGIC)
        if (magic, version, cap, sb, so, ro) != (MAGIC, VERSION, self.capacity, SLOT_BYTES, self.slots_off,
                                                 self.results_off):
            raise RingError(f"ring header mismatch: magic {magic:#x} version {version} capacity {cap}; expected "
                            f"{MAGIC:#x} v{VERSION} capacity {self.capacity}: initialise the ring first")

    # word accessors (a u64 word index is byte offset // 8)
    def load(self, off: int) -> int:
        return int(self.q[off >> 3])

    def store(self, off: int, value: int) -> None:
        self.q[off >> 3] = value

    def load32(self, off: int) -> int:
        return int(self.u32[off >> 2])

    def store32(self, off: int, value: int) -> None:
        self.u32[off >> 2] = value

    def slot_off(self, seq: int) -> int:
        return self.slots_off + ((seq - 1) & self.mask) * SLOT_BYTES

    def result_off(self, seq: int) -> int:
        return self.results_off + ((seq - 1) & self.mask) * RESULT_BYTES

    @property
    def state(self) -> ConsumerState:
        return ConsumerState(self.load32(OFF_STATE))


class RingProducer:
    """The host side: publishes descriptors, never overruns a slot the consumer has not completed.

    Single producer: callers that submit from several threads must serialise (the Executor holds a lock).
    """

    __slots__ = ("layout", "capacity", "head", "_tail_seen", "_q", "_buf", "_mask", "_slots_q", "_head_q",
                 "_tail_q", "_pack")

    def __init__(self, layout: RingLayout) -> None:
        self.layout = layout
        self.capacity = layout.capacity
        self.head = layout.load(OFF_HEAD)
        self._tail_seen = layout.load(OFF_TAIL)
        self._q = layout.q
        self._buf = layout.buf
        self._mask = layout.mask
        self._slots_q = layout.slots_off >> 3
        self._head_q = OFF_HEAD >> 3
        self._tail_q = OFF_TAIL >> 3
        self._pack = _BODY.pack_into

    def tail(self) -> int:
        self._tail_seen = int(self._q[self._tail_q])
        return self._tail_seen

    def free(self) -> int:
        return free_slots(self.head, self.tail(), self.capacity)

    def try_publish(self, opcode: int, a0: int = 0, a1: int = 0, a2: int = 0, a3: int = 0, a4: int = 0,
                    a5: int = 0, flags: int = 0, aux: int = 0) -> int:
        """Publish one task; return its seq, or 0 when the ring is full (nothing written)."""
        seq = self.head + 1
        q = self._q
        if seq - self._tail_seen > self.capacity:
            self._tail_seen = int(q[self._tail_q])
            if seq - self._tail_seen > self.capacity:
                return 0
        sq = self._slots_q + (((seq - 1) & self._mask) << 3)
        self._pack(self._buf, (sq << 3) + 8, opcode, flags, aux, a0, a1, a2, a3, a4, a5)  # body first
        q[sq] = seq  # then the slot's seq
        q[8] = seq  # then head (OFF_HEAD // 8): the release that publishes the task
        self.head = seq
        return seq

    def publish(self, opcode: int, *args: int, flags: int = 0, aux: int = 0, timeout_s: float = 5.0,
                on_full: Callable[[], None] | None = None) -> int:
        """Publish, waiting up to ``timeout_s`` for a free slot (``on_full`` runs while waiting, e.g. to
        restart a consumer that exited)."""
        if len(args) > MAX_ARGS:
            raise ConfigError(f"a descriptor holds at most {MAX_ARGS} args, got {len(args)}")
        a = tuple(args) + (0,) * (MAX_ARGS - len(args))
        seq = self.try_publish(opcode, a[0], a[1], a[2], a[3], a[4], a[5], flags, aux)
        if seq:
            return seq
        deadline = time.monotonic() + timeout_s
        while True:
            if on_full is not None:
                on_full()
            seq = self.try_publish(opcode, a[0], a[1], a[2], a[3], a[4], a[5], flags, aux)
            if seq:
                return seq
            if time.monotonic() > deadline:
                raise RingFullError(
                    f"ring full for {timeout_s}s: head {self.head}, tail {self.tail()}, capacity {self.capacity}, "
                    f"consumer state {self.layout.state.name}; is the executor running?")
            time.sleep(0)

    def completed(self, seq: int) -> bool:
        return self.tail() >= seq

    def result(self, seq: int) -> Result:
        """The result of completed task ``seq``; raises if it is not complete or its entry was reused."""
        if self.tail() < seq:
            raise RingError(f"task {seq} is not complete (tail {self._tail_seen})")
        value, status, rseq = _RESULT.unpack_from(self._buf, self.layout.result_off(seq))
        if rseq != seq:
            raise RingError(f"result of task {seq} was overwritten by task {rseq}: read results within "
                            f"{self.capacity} tasks of completion")
        return Result(seq, value, status)

    def request_stop(self) -> None:
        self.layout.store32(OFF_STOP, 1)

    def clear_stop(self) -> None:
        self.layout.store32(OFF_STOP, 0)

    def set_releases(self, entries: list[tuple[int, int]]) -> None:
        """The exit-release table: (flag address, value) pairs the consumer stores when it exits."""
        if len(entries) > MAX_RELEASES:
            raise ConfigError(f"at most {MAX_RELEASES} exit releases, got {len(entries)}")
        for i, (addr, value) in enumerate(entries):
            struct.pack_into("<QII", self._buf, OFF_RELEASES + 16 * i, addr, value & 0xFFFFFFFF, 0)
        self.layout.store32(OFF_RELEASE_COUNT, len(entries))


Handler = Callable[[Descriptor], tuple[int, int]]  # -> (value, status)


class RingConsumer:
    """The device side in Python: the reference the CUDA executor follows, and CPU CI's stand-in for it.

    ``run(handler)`` polls until stop, idle timeout or lease end, exactly as the kernel does.
    """

    def __init__(self, layout: RingLayout, image_id: int = 0) -> None:
        layout.validate()
        self.layout = layout
        self.image_id = image_id
        self.tail = layout.load(OFF_TAIL)

    def _exit(self, state: ConsumerState) -> ConsumerState:
        lay = self.layout
        n = lay.load32(OFF_RELEASE_COUNT)
        for i in range(min(n, MAX_RELEASES)):
            addr, value, _ = struct.unpack_from("<QII", lay.buf, OFF_RELEASES + 16 * i)
            self.on_release(addr, value)
        lay.store32(OFF_STATE, int(state))
        return state

    def on_release(self, addr: int, value: int) -> None:
        """Where a device would store ``value`` to ``addr``; overridden by tests."""

    def fail(self, error: int, seq: int) -> ConsumerState:
        self.layout.store(OFF_ERROR_SEQ, seq)
        self.layout.store32(OFF_ERROR, error)
        return self._exit(ConsumerState.EXITED_ERROR)

    def run(self, handler: Handler, *, idle_timeout_s: float = 1.0, lease_s: float = 3600.0,
            clock: Callable[[], float] = time.monotonic, batch: int = 4) -> ConsumerState:
        lay = self.layout
        lay.store32(OFF_IMAGE, self.image_id)
        lay.store(OFF_STARTS, lay.load(OFF_STARTS) + 1)
        lay.store32(OFF_STATE, int(ConsumerState.RUNNING))
        start = last = clock()
        polls = 0
        while True:
            head = lay.load(OFF_HEAD)
            if lay.load32(OFF_STOP):
                return self._exit(ConsumerState.EXITED_STOP)
            now = clock()
            if head == self.tail:
                if now - last > idle_timeout_s:
                    return self._exit(ConsumerState.EXITED_IDLE)
                if now - start > lease_s:
                    return self._exit(ConsumerState.EXITED_LEASE)
                polls += 1
                if polls & 63 == 0:
                    lay.store(OFF_HEARTBEAT, lay.load(OFF_HEARTBEAT) + 1)
                    time.sleep(0)
                continue
            if not 0 < head - self.tail <= lay.capacity:
                return self.fail(2, head)
            if now - start > lease_s:
                return self._exit(ConsumerState.EXITED_LEASE)
            n = min(head - self.tail, batch)
            descs = [decode_descriptor(lay.buf[lay.slot_off(s):lay.slot_off(s) + SLOT_BYTES])
                     for s in range(self.tail + 1, self.tail + 1 + n)]
            for d in descs:
                expect = self.tail + 1
                if d.seq != expect:
                    return self.fail(1, expect)
                value, status = handler(d)
                roff = lay.result_off(expect)
                struct.pack_into("<II", lay.buf, roff, value & 0xFFFFFFFF, status)
                lay.store(roff + 8, expect)
                lay.store(OFF_TAIL, expect)
                self.tail = expect
            last = clock()
