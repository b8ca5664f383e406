"""The executor ring protocol, version 2: a single-producer / single-consumer ring of 64-byte descriptors over
any writable memoryview, in which every descriptor word validates itself, so the consumer finds a task in ONE
read of its slot.

On a GPU the buffer is host-mapped pinned memory: the host (producer) writes descriptors, the resident executor
(consumer) writes ``tail``, per-slot results, the heartbeat and its state. Here the protocol is plain Python
over a memoryview, so CPU CI tests it over ordinary memory with a consumer thread standing in for the device
(:class:`RingConsumer`). ``executor/resident.cuh`` implements the same consumer on the device; its constants are
rendered from this module, so the two cannot drift.

Layout (little-endian; every shared word has exactly one writer and its own 64-byte line)::

    0     line 0  host, once : magic u32, version u32, capacity u32, slot_bytes u32, slots_off u32, results_off u32
    64    line 1  reserved   (version 1 kept ``head`` here; version 2 has no head, see below)
    128   line 2  host       : stop u32        0 run, 1 exit at the next task boundary (tasks left stay queued)
    192   line 3  device     : tail u64        tasks completed, in order (== seq of the last completed task)
    256   line 4  device     : heartbeat u64   bumped while the consumer polls
    320   line 5  device     : state u32, image_id u32, error u32, pad u32, error_seq u64
    384   line 6  device     : starts u64      consumer instances started on this ring
    448   line 7  host       : release_count u32 (entries used in the exit-release table below)
    512   lines 8..11 host   : exit-release table, 16 B each: flag address u64, value u32, pad u32
                               (the consumer stores ``value`` to each ``flag`` when it exits: armed waits it
                               could fire are released, never left pending)
    1024  slots              : capacity x 64 B descriptors; task ``seq`` (1-based) in slot (seq - 1) % capacity
    ...   results            : capacity x 16 B: value u32 | status u32 (one u64 word), then seq u64

Descriptor: 8 little-endian u64 words. Bits 63..48 of EVERY word hold the task's tag,
``tag(seq) = 0x8000 | (seq & 0x7fff)``; bits 47..0 are the payload::

    word 0     opcode u16 (bits 0..15), flags u16 (bits 16..31), bits 32..47 zero
    words 1-6  args a0..a5, 48 bits each: device pointers, sizes, counts (float32 bits go in aux)
    word 7     aux u32 (bits 0..31), bits 32..47 zero

Why one read is enough. The consumer expects task ``seq = tail + 1`` and loads the 8 words of its slot together
(on the GPU, with ``stop``, in one PCIe round trip, where version 1 needed two: ``head``, then the slot). It runs
the task only when every word carries ``tag(seq)``. While it waits, each word of the slot holds one of:

- the previous occupant's value, tagged ``tag(seq - capacity)``. That task completed, so all of its words were
  written, and its tag differs from ``tag(seq)`` because the capacity is a power of two of at most 2**14: never a
  multiple of 2**15, the period of the tag's 15 seq bits. (A 16-bit tag without the marker bit would allow
  2**15, but then a zero word would be a valid tag, see the next case.)
- zero: a freshly initialised ring, or the producer mid-write (CPython's ``struct.pack_into`` zero-fills its
  target before it stores the fields). The marker bit 0x8000 makes every real tag non-zero, so a zero word
  never matches.
- the new task's value, tagged ``tag(seq)``.

No later task can be there yet: the producer reuses a slot only after ``tail`` passed its previous occupant, and
the consumer has not completed ``seq``. Every word is stored with one aligned 8-byte store (x86-64 makes those
atomic; CPython's native ``Q`` packing stores a whole word), so no word is ever torn, and the producer writes at
most one descriptor per seq (a task's fields are validated before anything is written). So eight matching words
are one whole descriptor, in whatever order they were stored or loaded, and a partially written descriptor
simply fails the check and is polled again. Any other tag (or a non-zero word without the marker) is corruption,
a second producer or a ring of another build: the consumer stops with ``ConsumerError.BAD_SLOT``.

No ``head``. Nothing needs it for correctness: the consumer finds work by the tags, and the producer counts its
own tasks (``RingProducer.head``) and re-reads ``tail`` only when its cached copy says the ring is full. Storing
``head`` on every submit would cost the Python fast path a store into a line for observability only;
:meth:`RingLayout.published` recovers the count from the slots when a tool wants it.

Memory ordering. Producer: a task's inputs, then its descriptor words in any order (x86-64 does not reorder
stores with older stores; a non-TSO host would need a release fence before the descriptor). Consumer: every word
load is an acquire (on the GPU, one ``ld.acquire.sys`` per lane, carried to the block by a barrier), so whatever
the task reads is read after its descriptor. Results: the consumer writes value|status, then ONE release fence,
then the result's seq, then ``tail``. The fence puts the task's writes and the value before both, so a host
spinning on the result's seq reads a complete value, and ``tail`` (the producer's flow control) never passes a
slot before its last read. No word is read-modify-written by both sides.
"""

from __future__ import annotations

import enum
import os
import struct
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NoReturn, Protocol

from ..errors import ConfigError, DescriptorError, ExecutorError, RingError, RingFullError

try:  # the C fast paths (executor/_ringfast.c), built by pip install; optional
    from . import _ringfast
    _FAST_WHY = ""
except ImportError as _e:  # no compiler at install time, or a source tree used without building it
    _ringfast = None  # type: ignore[assignment]
    _FAST_WHY = f"import failed: {_e}"

MAGIC = 0x47524343  # b"CCRG" little-endian
VERSION = 2
LINE_BYTES = 64
SLOT_BYTES = 64
SLOT_WORDS = 8
RESULT_BYTES = 16
CTRL_BYTES = 1024
MAX_RELEASES = 4
MAX_ARGS = 6
MIN_CAPACITY = 2
MAX_CAPACITY = 1 << 14  # < 2**15, the period of the tags (see the module docstring)

# Descriptor words: tag in bits 63..48, payload in bits 47..0.
TAG_SHIFT = 48
TAG_MARK = 0x8000
TAG_SEQ_MASK = 0x7FFF
PAYLOAD_BITS = 48
PAYLOAD_MASK = (1 << PAYLOAD_BITS) - 1
OPCODE_BITS = 16
FLAGS_BITS = 16
AUX_BITS = 32

# Byte offsets of the shared words (rendered into resident.cuh as CCR_OFF_*).
OFF_MAGIC = 0
OFF_VERSION = 4
OFF_CAPACITY = 8
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

# The fast paths (RingProducer.try_publish, make_submit, make_wait) inline these as literals.
assert (TAG_SHIFT, TAG_MARK, TAG_SEQ_MASK, PAYLOAD_BITS, AUX_BITS, OPCODE_BITS) == (48, 0x8000, 0x7FFF, 48, 32, 16)
assert MAX_CAPACITY <= TAG_SEQ_MASK + 1 and (TAG_SEQ_MASK + 1) % MAX_CAPACITY == 0

_WORDS = struct.Struct("8Q")  # native: every word is one 8-byte store (the '<' codes store byte by byte)
_HEADER = struct.Struct("<IIIIII")
assert _WORDS.size == SLOT_BYTES


assert OFF_STATE >> 2 == 80  # make_submit inlines the state word's index


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
    EXITED_ERROR = 5  # protocol error: see error / error_seq (ConsumerError)


assert int(ConsumerState.RUNNING) == 1  # make_submit inlines it

if _ringfast is not None and (
        _ringfast.SLOT_BYTES, _ringfast.RESULT_BYTES, _ringfast.OFF_TAIL, _ringfast.OFF_STATE,
        _ringfast.STATE_RUNNING, _ringfast.PAYLOAD_BITS) != (
        SLOT_BYTES, RESULT_BYTES, OFF_TAIL, OFF_STATE, int(ConsumerState.RUNNING), PAYLOAD_BITS):
    _FAST_WHY = "the built extension is stale (its ring constants differ from ring.py's): rebuild it"
    _ringfast = None  # type: ignore[assignment]


def fast_path_available() -> bool:
    """Whether new producers use the C fast paths: built, current, and not turned off with
    ``CONCORDIA_RING_IMPL=python`` (``=c`` makes a missing build an error instead of a fallback)."""
    want = os.environ.get("CONCORDIA_RING_IMPL", "").lower()
    if want not in ("", "c", "python"):
        raise ConfigError(f"CONCORDIA_RING_IMPL={want!r}: use 'c', 'python' or leave it unset")
    if want == "python":
        return False
    if want == "c" and _ringfast is None:
        raise ConfigError(f"CONCORDIA_RING_IMPL=c but the C ring fast path is not available ({_FAST_WHY}): "
                          "reinstall concordia-ft with a C compiler and the Python headers (pip install -e .)")
    return _ringfast is not None


def fast_path_status() -> str:
    """One line for ``concordia doctor`` and benchmark stamps."""
    if _ringfast is None:
        return f"python ({_FAST_WHY})"
    return "c" if fast_path_available() else "python (CONCORDIA_RING_IMPL=python)"


class ConsumerError(enum.IntEnum):
    """The consumer's ``error`` word after ``EXITED_ERROR``. (2 was version 1's head/tail mismatch.)"""

    NONE = 0
    BAD_SLOT = 1  # a descriptor word tagged neither for its task nor for the slot's previous occupant
    BAD_HEADER = 3  # the ring's magic/version/capacity is not what this consumer was built for


class Status(enum.IntEnum):
    OK = 0
    BAD_OPCODE = 1
    BAD_ARGS = 2


class WordState(enum.IntEnum):
    """What a descriptor word says about the task the consumer expects in its slot."""

    MATCH = 0  # written for this task
    STALE = 1  # the previous occupant's, or zero: not written yet
    BAD = 2  # anything else: corruption


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


def check_capacity(capacity: int) -> int:
    if capacity < MIN_CAPACITY or capacity & (capacity - 1) or capacity > MAX_CAPACITY:
        raise ConfigError(
            f"ring capacity must be a power of two in [{MIN_CAPACITY}, {MAX_CAPACITY}], got {capacity}: the "
            f"descriptor tags carry 15 bits of the task's seq, and a slot's previous occupant (seq - capacity) is "
            f"told apart from its new task only when the capacity is not a multiple of 2**15")
    return capacity


def ring_bytes(capacity: int) -> int:
    """Bytes a ring of ``capacity`` slots needs (control block + slots + results)."""
    check_capacity(capacity)
    return CTRL_BYTES + capacity * (SLOT_BYTES + RESULT_BYTES)


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


# ---------------------------------------------------------------------------------------------- descriptors


def tag_of(seq: int) -> int:
    """The tag (bits 63..48 of every descriptor word) of task ``seq``: never zero."""
    return TAG_MARK | (seq & TAG_SEQ_MASK)


_HINTS = {
    "opcode": "opcodes are u16 (see Opcode)",
    "flags": "flags are u16",
    "aux": "aux is a u32: pass a float32 as float_bits(x)",
}
_ARG_HINT = ("arguments are device pointers, sizes and counts below 2**48; pass a float32 as aux (float_bits) "
             "and anything larger in device memory, by pointer")


def check_fields(opcode: int, args: tuple[int, ...], flags: int = 0, aux: int = 0) -> None:
    """Raise :class:`DescriptorError` naming the first field that does not fit its descriptor bits."""
    if len(args) > MAX_ARGS:
        raise DescriptorError(f"a descriptor holds at most {MAX_ARGS} args, got {len(args)}")
    named = [("opcode", opcode, OPCODE_BITS), ("flags", flags, FLAGS_BITS)]
    named += [(f"a{i}", a, PAYLOAD_BITS) for i, a in enumerate(args)]
    named.append(("aux", aux, AUX_BITS))
    for name, value, bits in named:
        if not 0 <= value < 1 << bits:
            raise DescriptorError(f"descriptor field {name} = {value:#x} does not fit in {bits} bits "
                                  f"(0 <= {name} < 2**{bits}): {_HINTS.get(name, _ARG_HINT)}")


def encode_words(seq: int, opcode: int, args: Iterable[int] = (), flags: int = 0, aux: int = 0) -> tuple[int, ...]:
    """The 8 tagged words of task ``seq``; raises :class:`DescriptorError` when a field does not fit."""
    a = tuple(args)
    check_fields(opcode, a, flags, aux)
    if seq < 1:
        raise DescriptorError(f"task seqs start at 1, got {seq}")
    a += (0,) * (MAX_ARGS - len(a))
    t = tag_of(seq) << TAG_SHIFT
    return (opcode | flags << 16 | t, *(x | t for x in a), aux | t)


def encode_descriptor(d: Descriptor) -> bytes:
    return _WORDS.pack(*encode_words(d.seq, d.opcode, d.args, d.flags, d.aux))


def decode_words(words: tuple[int, ...] | list[int], seq: int) -> Descriptor:
    """The fields of task ``seq`` from its 8 words (tags are not checked here: see :func:`classify_word`)."""
    w0 = words[0]
    args = tuple(w & PAYLOAD_MASK for w in words[1:1 + MAX_ARGS])
    return Descriptor(w0 & 0xFFFF, args, (w0 >> 16) & 0xFFFF, words[7] & 0xFFFFFFFF, seq)


def decode_descriptor(raw: bytes | memoryview, seq: int, capacity: int = MAX_CAPACITY) -> Descriptor:
    """Decode a slot that must hold the whole descriptor of task ``seq``; raises :class:`RingError` otherwise."""
    if len(raw) != SLOT_BYTES:
        raise ConfigError(f"a descriptor is {SLOT_BYTES} bytes, got {len(raw)}")
    words = _WORDS.unpack_from(raw)
    for i, w in enumerate(words):
        state = classify_word(w, seq, capacity)
        if state != WordState.MATCH:
            raise RingError(f"the slot does not hold a complete descriptor of task {seq}: word {i} is "
                            f"{w:#018x} ({state.name}, tag {w >> TAG_SHIFT:#06x}, expected {tag_of(seq):#06x})")
    return decode_words(words, seq)


def classify_word(word: int, seq: int, capacity: int) -> WordState:
    """The consumer's check of one word of the slot where it expects task ``seq`` (the device does the same)."""
    tag = word >> TAG_SHIFT
    if tag == tag_of(seq):
        return WordState.MATCH
    if word == 0 or tag == tag_of(seq - capacity):
        return WordState.STALE
    return WordState.BAD


def float_bits(x: float) -> int:
    """A float32's bit pattern (the SCALE op's alpha travels in ``aux``)."""
    return int(struct.unpack("<I", struct.pack("<f", x))[0])


# ---------------------------------------------------------------------------------------------- layout


class RingLayout:
    """Typed views of one ring in ``buf``; shared by producer and consumer."""

    def __init__(self, buf: memoryview, capacity: int) -> None:
        check_capacity(capacity)
        if sys.byteorder != "little":
            raise ConfigError("the ring is little-endian (it is shared with the GPU); this host is big-endian")
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
        _HEADER.pack_into(self.buf, OFF_MAGIC, MAGIC, VERSION, self.capacity, SLOT_BYTES, self.slots_off,
                          self.results_off)

    def validate(self) -> None:
        """Refuse a ring this build cannot speak: another version, another capacity, or not a ring at all."""
        magic, version, cap, sb, so, ro = _HEADER.unpack_from(self.buf, OFF_MAGIC)
        if magic != MAGIC:
            raise RingError(f"not an executor ring: magic {magic:#x}, expected {MAGIC:#x}; initialise the ring "
                            "(RingLayout.initialise) before starting a producer or consumer")
        if version != VERSION:
            raise RingError(f"ring protocol version {version}, this build speaks version {VERSION}: the ring was "
                            "initialised by another build of concordia_ft; rings are not converted in place, "
                            "initialise a new one with this build")
        if (cap, sb, so, ro) != (self.capacity, SLOT_BYTES, self.slots_off, self.results_off):
            raise RingError(f"ring header mismatch: capacity {cap}, slot bytes {sb}, slots at {so}, results at "
                            f"{ro}; expected capacity {self.capacity}, {SLOT_BYTES}, {self.slots_off}, "
                            f"{self.results_off}: open the ring with the capacity it was initialised with")

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

    def slot_words(self, seq: int) -> tuple[int, ...]:
        return _WORDS.unpack_from(self.buf, self.slot_off(seq))

    def slot_states(self, seq: int) -> list[WordState]:
        """Each word of the slot of task ``seq``, as the consumer would classify it now."""
        return [classify_word(w, seq, self.capacity) for w in self.slot_words(seq)]

    def published(self) -> int:
        """The last task published completely and in order (``tail`` plus the whole descriptors after it).

        Version 2 keeps no ``head`` word; this recovers it from the slots (exact while the producer is idle)."""
        tail = self.load(OFF_TAIL)
        seq = tail
        while seq - tail < self.capacity and all(s == WordState.MATCH for s in self.slot_states(seq + 1)):
            seq += 1
        return seq

    @property
    def state(self) -> ConsumerState:
        return ConsumerState(self.load32(OFF_STATE))


# ---------------------------------------------------------------------------------------------- producer


class _PyState:
    """The producer's counters when the C fast path is not in use (the C type ``_ringfast._ProducerBase`` has
    the same two members and adds the fast paths)."""

    __slots__ = ("head", "_tail_seen")

    def __init__(self) -> None:
        self.head = 0
        self._tail_seen = 0


class RingProducer:
    """The host side: publishes descriptors, never overruns a slot the consumer has not completed.

    Two implementations of the same producer: the C extension ``executor._ringfast`` (built by ``pip install``;
    ~0.1 us per submit) and pure Python (~0.9 us), which this class falls back to when the extension is missing.
    ``fast`` picks: None takes C when it is built (unless ``CONCORDIA_RING_IMPL=python``), True requires it,
    False forces Python. Either way ``head`` (tasks published) lives in one place, ``self.st``, which the fast
    paths of :func:`make_submit` and :func:`make_wait` share.

    Producers in several threads: the C publish is one step under the GIL (it neither calls into Python nor
    releases the GIL; a free-threaded build takes a mutex), the Python one needs the lock :func:`make_submit`
    takes. ``head`` lives here only (see the module docstring: no head word)."""

    __slots__ = ("layout", "capacity", "st", "_fast", "_q", "_buf", "_mask", "_tail_q", "_slot_offs", "_result_q")

    def __init__(self, layout: RingLayout, fast: bool | None = None) -> None:
        layout.validate()
        self.layout = layout
        self.capacity = layout.capacity
        self._q = layout.q
        self._buf = layout.buf
        self._mask = layout.mask
        self._tail_q = OFF_TAIL >> 3
        # indexed by seq & mask: the byte offset of task seq's slot, the u64 index of its result's seq word
        self._slot_offs = [layout.slot_off(s) for s in range(self.capacity)]
        self._result_q = [(layout.result_off(s) >> 3) + 1 for s in range(self.capacity)]
        use_c = fast_path_available() if fast is None else fast
        if use_c and _ringfast is None:
            raise ConfigError(f"the C ring fast path is not built ({_FAST_WHY}): reinstall concordia-ft with a C "
                              "compiler and the Python headers (pip install -e . builds executor/_ringfast.c through setup.py), or "
                              "pass fast=False")
        self._fast: _ringfast._ProducerBase | None = None
        self.st: _PyState | _ringfast._ProducerBase
        if use_c:
            assert _ringfast is not None
            self._fast = self.st = _ringfast._ProducerBase()
            self._fast._bind(layout.buf, self.capacity, layout.slots_off, layout.results_off)
            self._fast._hooks(None, check_fields, None, None, None)
        else:
            self.st = _PyState()
        self.st.head = layout.published()
        self.st._tail_seen = layout.load(OFF_TAIL)
        nxt = layout.slot_states(self.head + 1)
        if self.head - self.st._tail_seen < self.capacity and WordState.MATCH in nxt:
            raise RingError(f"the slot of task {self.head + 1} is partly written ({[s.name for s in nxt]}): a "
                            "producer stopped in the middle of a publish; initialise a new ring")

    @property
    def head(self) -> int:
        """Tasks published: the seq of the last one."""
        return int(self.st.head)

    @head.setter
    def head(self, seq: int) -> None:
        """For a caller that wrote a descriptor itself (tests that tear writes on purpose)."""
        self.st.head = seq

    @property
    def implementation(self) -> str:
        """``"c"`` or ``"python"``: which fast paths this producer runs."""
        return "c" if self._fast is not None else "python"

    def tail(self) -> int:
        if self._fast is not None:
            return self._fast.tail()
        self.st._tail_seen = t = int(self._q[self._tail_q])
        return t

    def free(self) -> int:
        return free_slots(self.head, self.tail(), self.capacity)

    def try_publish(self, opcode: int, a0: int = 0, a1: int = 0, a2: int = 0, a3: int = 0, a4: int = 0,
                    a5: int = 0, aux: int = 0, flags: int = 0) -> int:
        """Publish one task; return its seq, or 0 when the ring is full (nothing written).

        The same steps as :func:`make_submit`'s fast path (which adds the consumer check)."""
        if self._fast is not None:
            return self._fast.try_publish(opcode, a0, a1, a2, a3, a4, a5, aux, flags)
        if (a0 | a1 | a2 | a3 | a4 | a5) >> 48 or aux >> 32 or (opcode | flags) >> 16:
            check_fields(opcode, (a0, a1, a2, a3, a4, a5), flags, aux)  # raises, naming the field
        st = self.st
        seq = st.head + 1
        if seq - st._tail_seen > self.capacity and seq - self.tail() > self.capacity:
            return 0
        t = ((seq & 0x7FFF) | 0x8000) << 48
        _WORDS.pack_into(self._buf, self._slot_offs[seq & self._mask], opcode | flags << 16 | t, a0 | t,
                         a1 | t, a2 | t, a3 | t, a4 | t, a5 | t, aux | t)
        st.head = seq
        return seq

    def publish(self, opcode: int, *args: int, flags: int = 0, aux: int = 0, timeout_s: float = 5.0,
                on_full: Callable[[], None] | None = None) -> int:
        """Publish, waiting up to ``timeout_s`` for a free slot (``on_full`` runs while waiting, e.g. to
        restart a consumer that exited)."""
        a = tuple(args)
        check_fields(opcode, a, flags, aux)
        a += (0,) * (MAX_ARGS - len(a))
        seq = self.try_publish(opcode, a[0], a[1], a[2], a[3], a[4], a[5], aux, flags)
        if seq:
            return seq
        deadline = time.monotonic() + timeout_s
        while True:
            if on_full is not None:
                on_full()
            seq = self.try_publish(opcode, a[0], a[1], a[2], a[3], a[4], a[5], aux, flags)
            if seq:
                return seq
            if time.monotonic() > deadline:
                raise RingFullError(
                    f"ring full for {timeout_s}s: head {self.head}, tail {self.tail()}, capacity {self.capacity}, "
                    f"consumer state {self.layout.state.name}; is the executor running?")
            time.sleep(0)

    def completed(self, seq: int) -> bool:
        """Task ``seq``'s result has been written (it may have been overwritten since, by a later task)."""
        return int(self._q[self._result_q[seq & self._mask]]) >= seq

    def result(self, seq: int) -> Result:
        """The result of completed task ``seq``; raises if it is not complete or its entry was reused."""
        i = self._result_q[seq & self._mask]
        rseq = int(self._q[i])
        if rseq < seq:
            raise RingError(f"task {seq} is not complete (tail {self.tail()}, head {self.head})")
        if rseq != seq:
            raise RingError(f"result of task {seq} was overwritten by task {rseq}: read results within "
                            f"{self.capacity} tasks of completion")
        vs = int(self._q[i - 1])
        return Result(seq, vs & 0xFFFFFFFF, vs >> 32)

    def retire(self) -> RingLayout:
        """Move this producer off the ring's memory so that memory can be freed (an executor's close()).

        The ring is copied into private memory (a ``bytearray``) and the producer, with the C fast paths
        made from it, is bound to the copy; the copy's consumer state is set to ``EXITED_STOP``, so a later
        submit through the C path publishes into the copy, sees no running consumer and goes to ``slow``.
        Python-path closures from :func:`make_submit` / :func:`make_wait` keep the old views: their owner must
        drop them (the executor replaces its ``submit`` / ``wait``). Returns the copy's layout."""
        tomb = RingLayout(memoryview(bytearray(self.layout.buf)), self.capacity)
        tomb.store32(OFF_STATE, ConsumerState.EXITED_STOP)
        self.layout = tomb
        self._q = tomb.q
        self._buf = tomb.buf
        if self._fast is not None:
            self._fast._bind(tomb.buf, self.capacity, tomb.slots_off, tomb.results_off)
        return tomb

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


# ---------------------------------------------------------------------------------------------- fast paths


class Lock(Protocol):
    """What :func:`make_submit` needs of a lock (``threading.Lock`` / ``RLock``)."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...


class SubmitFn(Protocol):
    """``submit(opcode, a0..a5, aux) -> seq``: what an executor's ``submit`` is."""

    def __call__(self, opcode: int, a0: int = 0, a1: int = 0, a2: int = 0, a3: int = 0, a4: int = 0,
                 a5: int = 0, aux: int = 0) -> int: ...


class SlowSubmitFn(Protocol):
    """Called by a :func:`make_submit` function when the ring was full (``seq`` 0: nothing published) or the
    consumer's state word is not RUNNING; returns the seq of the task, published by then."""

    def __call__(self, seq: int, opcode: int, a0: int, a1: int, a2: int, a3: int, a4: int, a5: int,
                 aux: int) -> int: ...


class WaitFn(Protocol):
    """``wait(ticket, timeout_s) -> value``: what an executor's ``wait`` is."""

    def __call__(self, ticket: int, timeout_s: float = 10.0) -> int: ...


def make_submit(producer: RingProducer, lock: Lock, slow: SlowSubmitFn) -> SubmitFn:
    """The executor's submit. Returns the C fast path (``producer.implementation == "c"``) or a Python closure
    over the ring's views; both do the same steps.

    Fast path: validate the fields (one combined test), publish the 8 tagged words, and check with ONE word
    compare that the consumer is RUNNING. Anything else (ring full by the cached tail and by the real one,
    consumer not running) goes to ``slow``. ``lock`` serialises producers (threads) on the Python path: a plain
    ``threading.Lock`` is enough (nothing re-enters it), its bound ``acquire`` / ``release`` are called
    directly (a ``with`` block costs more), and only the slot write is inside it. The C publish needs no lock
    (see :class:`RingProducer`), so ``lock`` only has to be held by whoever else publishes
    (:meth:`RingProducer.try_publish` is atomic on the C path too). In Python, zero arguments are the tag itself
    (``a | t if a else t``): one integer op fewer per unused argument."""
    if producer._fast is not None:
        producer._fast._hooks(slow, check_fields, None, None, None)
        return producer._fast.submit
    p = producer
    st = p.st
    pack = _WORDS.pack_into
    buf = p._buf
    offs = p._slot_offs
    mask = p._mask
    cap = p.capacity
    state = producer.layout.u32
    acquire = lock.acquire
    release = lock.release

    def submit(opcode: int, a0: int = 0, a1: int = 0, a2: int = 0, a3: int = 0, a4: int = 0, a5: int = 0,
               aux: int = 0) -> int:
        if (a0 | a1 | a2 | a3 | a4 | a5) >> 48 or aux >> 32 or opcode >> 16:
            check_fields(opcode, (a0, a1, a2, a3, a4, a5), 0, aux)  # raises, naming the field
        acquire()
        try:
            seq = st.head + 1
            if seq - st._tail_seen > cap and seq - p.tail() > cap:
                seq = 0  # full
            else:
                t = ((seq & 0x7FFF) | 0x8000) << 48
                pack(buf, offs[seq & mask], opcode | t if opcode else t, a0 | t if a0 else t,
                     a1 | t if a1 else t, a2 | t if a2 else t, a3 | t if a3 else t, a4 | t if a4 else t,
                     a5 | t if a5 else t, aux | t if aux else t)
                st.head = seq
        finally:
            release()
        if seq and state[80] == 1:
            return seq
        return slow(seq, opcode, a0, a1, a2, a3, a4, a5, aux)

    return submit


_SPINS = range(1024)  # result polls between calls of ``on_spin`` and clock reads


def _raise_failed(capacity: int) -> Callable[[int, int, int], NoReturn]:
    """What a wait raises for a result that is not the task's (overwritten) or carries a failure status."""

    def failed(ticket: int, rseq: int, vs: int) -> NoReturn:
        if rseq != ticket:
            raise RingError(f"result of task {ticket} was overwritten by task {rseq}: wait within {capacity} "
                            "tasks of completion")
        status = vs >> 32
        name = Status(status).name if status in Status._value2member_map_ else f"status {status}"
        raise ExecutorError(f"task {ticket} failed on the device: {name}")

    return failed


def make_wait(producer: RingProducer, on_spin: Callable[[], None],
              on_timeout: Callable[[int, float], NoReturn]) -> WaitFn:
    """The executor's wait: spin on the result's seq word (host memory: a cached load per poll), then read
    value|status as one word. Every 1024 polls ``on_spin`` runs (e.g. relaunch a consumer that exited) and the
    clock is read; past ``timeout_s`` ``on_timeout(ticket, timeout_s)`` raises. The C path polls with a pause
    hint, holds the GIL for the first 4096 polls (a few us: the usual round trip) and gives it away between
    bursts of 1024 after that; the Python path holds it until the interpreter's switch interval."""
    failed = _raise_failed(producer.capacity)
    if producer._fast is not None:
        producer._fast._hooks(None, None, on_spin, on_timeout, failed)
        return producer._fast.wait
    q = producer._q
    rq = producer._result_q
    mask = producer._mask

    def wait(ticket: int, timeout_s: float = 10.0) -> int:
        i = rq[ticket & mask]
        r = q[i]
        if r != ticket:
            deadline = 0.0
            while r < ticket:
                for _ in _SPINS:
                    r = q[i]
                    if r >= ticket:
                        break
                else:
                    on_spin()
                    now = time.monotonic()
                    if not deadline:
                        deadline = now + timeout_s
                    elif now > deadline:
                        on_timeout(ticket, timeout_s)
            if r != ticket:
                failed(ticket, r, 0)
        vs = q[i - 1]
        if vs >> 32:
            failed(ticket, ticket, vs)
        return int(vs & 0xFFFFFFFF)

    return wait


# ---------------------------------------------------------------------------------------------- consumer

Handler = Callable[[Descriptor], tuple[int, int]]  # -> (value, status)


class RingConsumer:
    """The device side in Python: the reference the CUDA executor follows, and CPU CI's stand-in for it.

    ``run(handler)`` polls until stop, idle timeout or lease end, exactly as the kernel does. ``word_order``
    is the order this consumer loads a slot's words in (the device loads them all at once; tests pick orders
    that race the producer). ``partial_polls`` counts polls that saw a slot with some, not all, words of its
    task: evidence that a test really raced a writer.
    """

    def __init__(self, layout: RingLayout, image_id: int = 0, word_order: Iterable[int] = range(SLOT_WORDS)) -> None:
        layout.validate()
        self.layout = layout
        self.image_id = image_id
        self.word_order = tuple(word_order)
        if sorted(self.word_order) != list(range(SLOT_WORDS)):
            raise ConfigError(f"word_order must be a permutation of 0..{SLOT_WORDS - 1}, got {self.word_order}")
        self.tail = layout.load(OFF_TAIL)
        self.partial_polls = 0

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

    def fail(self, error: ConsumerError, seq: int) -> ConsumerState:
        self.layout.store(OFF_ERROR_SEQ, seq)
        self.layout.store32(OFF_ERROR, int(error))
        return self._exit(ConsumerState.EXITED_ERROR)

    def poll(self, batch: int = 4) -> tuple[list[Descriptor], int]:
        """One poll: the words of the slots of tasks tail+1 .. tail+min(batch, capacity), each word loaded once
        (in ``word_order``). Returns the whole descriptors at the front, in order, and the seq of a slot holding
        a BAD word (0 if none)."""
        lay = self.layout
        q = lay.q
        cap = lay.capacity
        ready: list[Descriptor] = []
        bad = 0
        in_order = True
        for seq in range(self.tail + 1, self.tail + 1 + min(batch, cap)):
            base = lay.slot_off(seq) >> 3
            words = [0] * SLOT_WORDS
            for w in self.word_order:
                words[w] = int(q[base + w])
            states = [classify_word(x, seq, cap) for x in words]
            matched = states.count(WordState.MATCH)
            if WordState.BAD in states and not bad:
                bad = seq
            if 0 < matched < SLOT_WORDS:
                self.partial_polls += 1
            if in_order and matched == SLOT_WORDS:
                ready.append(decode_words(words, seq))
            else:
                in_order = False
        return ready, bad

    def run(self, handler: Handler, *, idle_timeout_s: float = 1.0, lease_s: float = 3600.0,
            clock: Callable[[], float] = time.monotonic, batch: int = 4) -> ConsumerState:
        lay = self.layout
        q = lay.q
        lay.store32(OFF_IMAGE, self.image_id)
        lay.store(OFF_STARTS, lay.load(OFF_STARTS) + 1)
        lay.store32(OFF_STATE, int(ConsumerState.RUNNING))
        start = last = clock()
        polls = 0
        while True:
            stop = lay.load32(OFF_STOP)  # the device loads stop with the slot words, in the same round trip
            ready, bad = self.poll(batch)
            if stop:
                return self._exit(ConsumerState.EXITED_STOP)
            if bad:
                return self.fail(ConsumerError.BAD_SLOT, bad)
            now = clock()
            if not ready:
                if now - last > idle_timeout_s:
                    return self._exit(ConsumerState.EXITED_IDLE)
                if now - start > lease_s:
                    return self._exit(ConsumerState.EXITED_LEASE)
                polls += 1
                if polls & 63 == 0:
                    lay.store(OFF_HEARTBEAT, lay.load(OFF_HEARTBEAT) + 1)
                    time.sleep(0)
                continue
            if now - start > lease_s:
                return self._exit(ConsumerState.EXITED_LEASE)
            for d in ready:
                value, status = handler(d)
                ri = lay.result_off(d.seq) >> 3
                q[ri] = (value & 0xFFFFFFFF) | (status & 0xFFFFFFFF) << 32  # value | status
                q[ri + 1] = d.seq  # then the result's seq (after the device's one release fence)
                q[OFF_TAIL >> 3] = d.seq  # then tail
                self.tail = d.seq
            last = clock()
