"""The ring protocol (version 2) over ordinary memory, with a consumer thread standing in for the device."""

from __future__ import annotations

import os
import random
import struct
import sys
import threading
import time
from collections.abc import Iterator
from typing import NoReturn

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from concordia_lab.errors import ConfigError, DescriptorError, ExecutorError
from concordia_lab.executor import ring as R

MATCH, STALE, BAD = R.WordState.MATCH, R.WordState.STALE, R.WordState.BAD
PAYLOADS = st.integers(0, 2**48 - 1)
CAPACITIES = st.sampled_from([2**k for k in range(1, 15)])


@pytest.fixture(scope="module", params=["c", "python"], autouse=True)
def ring_impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here runs against both producers: the C fast paths (executor/_ringfast.c) and pure Python."""
    if request.param == "c" and R._ringfast is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build the C ring fast path: {R.fast_path_status()}")
        pytest.skip(f"C ring fast path not built: {R.fast_path_status()}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONCORDIA_RING_IMPL", request.param)
        yield request.param


def make(capacity: int) -> tuple[R.RingLayout, R.RingProducer]:
    buf = bytearray(R.ring_bytes(capacity))
    lay = R.RingLayout(memoryview(buf), capacity)
    lay.initialise()
    return lay, R.RingProducer(lay)


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads every few microseconds, so producer and consumer interleave within a descriptor."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


# ---------------------------------------------------------------------------------------------- descriptors


@given(seq=st.integers(1, 2**40), opcode=st.integers(0, 2**16 - 1), flags=st.integers(0, 2**16 - 1),
       aux=st.integers(0, 2**32 - 1), args=st.lists(PAYLOADS, max_size=6))
def test_descriptor_round_trip(seq: int, opcode: int, flags: int, aux: int, args: list[int]) -> None:
    d = R.Descriptor(opcode, tuple(args), flags, aux, seq)
    raw = R.encode_descriptor(d)
    assert len(raw) == R.SLOT_BYTES
    words = struct.unpack("<8Q", raw)
    assert {w >> 48 for w in words} == {R.tag_of(seq)} and R.tag_of(seq) & 0x8000
    back = R.decode_descriptor(raw, seq)
    assert back == R.Descriptor(opcode, tuple(args) + (0,) * (6 - len(args)), flags, aux, seq)
    with pytest.raises(R.RingError, match=f"complete descriptor of task {seq + 1}"):
        R.decode_descriptor(raw, seq + 1)


@given(capacity=CAPACITIES, seq=st.integers(1, 2**40), mix=st.lists(st.sampled_from("onz"), min_size=8, max_size=8),
       new_args=st.lists(PAYLOADS, min_size=6, max_size=6), old_args=st.lists(PAYLOADS, min_size=6, max_size=6),
       ops=st.tuples(st.integers(0, 2**16 - 1), st.integers(0, 2**16 - 1)))
def test_tag_check_accepts_only_a_whole_descriptor(capacity: int, seq: int, mix: list[str], new_args: list[int],
                                                   old_args: list[int], ops: tuple[int, int]) -> None:
    """Any mixture of the new task's words, the previous occupant's (seq - capacity) and zero words (fresh ring,
    or the producer's zero-fill) is accepted only when every word is the new task's, and is never corrupt."""
    new = R.encode_words(seq, ops[0], new_args, 0, seq & 0xFFFFFFFF)
    old = R.encode_words(seq - capacity, ops[1], old_args) if seq > capacity else (0,) * 8
    words = [new[i] if m == "n" else old[i] if m == "o" else 0 for i, m in enumerate(mix)]
    states = [R.classify_word(w, seq, capacity) for w in words]
    assert BAD not in states
    assert (states == [MATCH] * 8) == (mix == ["n"] * 8)
    assert [s == MATCH for s in states] == [m == "n" for m in mix]


@given(capacity=st.sampled_from([2**k for k in range(1, 14)]), seq=st.integers(1, 2**40), k=st.sampled_from([1, 2]),
       word=st.integers(0, 2**64 - 1))
def test_tag_check_flags_foreign_words(capacity: int, seq: int, k: int, word: int) -> None:
    """A word of a task that cannot be in the slot yet (the next occupants) or garbage is never taken for this
    task; unless it carries the previous occupant's tag or is zero it is reported as corruption. (Best effort:
    with 15 tag bits, a word 2**15 tasks away looks like this task's; the ring never holds one.)"""
    other = R.encode_words(seq + k * capacity, R.Opcode.MARK, (1, 2))[3]
    assert R.classify_word(other, seq, capacity) == BAD
    state = R.classify_word(word, seq, capacity)
    tag = word >> 48
    assert (state == MATCH) == (tag == R.tag_of(seq))
    assert (state == BAD) == (tag not in (R.tag_of(seq), R.tag_of(seq - capacity)) and word != 0)


def test_capacity_is_a_power_of_two_below_the_tag_period() -> None:
    for ok in (2, 4, 1024, R.MAX_CAPACITY):
        assert R.check_capacity(ok) == ok
    for bad in (0, 1, 3, 24, 2**15, 2**20):
        with pytest.raises(ConfigError, match="power of two in \\[2, 16384\\]"):
            R.check_capacity(bad)
    with pytest.raises(ConfigError):
        R.ring_bytes(2**15)
    # why: with 2**15 slots a slot's previous occupant would carry the same tag as its new task
    assert R.tag_of(70_000) == R.tag_of(70_000 - 2**15)
    assert R.tag_of(70_000) != R.tag_of(70_000 - R.MAX_CAPACITY)


@pytest.mark.parametrize(("field", "kwargs", "message"), [
    ("a0", dict(a0=2**48), "a0 = 0x1000000000000 does not fit in 48 bits"),
    ("a5", dict(a5=2**63), "a5 = 0x8000000000000000 does not fit in 48 bits"),
    ("a2", dict(a2=-1), "a2 = -0x1 does not fit"),
    ("aux", dict(aux=2**32), "aux = 0x100000000 does not fit in 32 bits.*float_bits"),
    ("opcode", dict(opcode=2**16), "opcode = 0x10000 does not fit in 16 bits"),
])
def test_fields_that_do_not_fit_are_refused_before_anything_is_written(
        field: str, kwargs: dict[str, int], message: str) -> None:
    lay, prod = make(4)
    submit = R.make_submit(prod, threading.Lock(), lambda seq, *a: seq)
    call = {"opcode": R.Opcode.MARK, **kwargs}
    before = bytes(lay.buf)
    for publish in (prod.try_publish, submit):
        with pytest.raises(DescriptorError, match=message) as e:
            publish(**call)
        assert isinstance(e.value, ValueError)  # a caller's mistake
        assert "pass a float32 as" in str(e.value) or field == "opcode"
    with pytest.raises(DescriptorError, match=message):
        R.encode_words(1, call["opcode"], tuple(kwargs.get(f"a{i}", 0) for i in range(6)), 0, kwargs.get("aux", 0))
    assert prod.head == 0 and bytes(lay.buf) == before
    with pytest.raises(DescriptorError, match="at most 6 args"):
        R.encode_words(1, 0, range(7))


def test_retire_moves_the_producer_off_memory_that_is_about_to_be_freed(ring_impl: str) -> None:
    """An executor's close() frees the ring's pinned memory: after ``retire`` nothing the producer (or, on the
    C path, a submit function taken earlier) does touches the old buffer, and a submit reaches ``slow``."""
    old = bytearray(R.ring_bytes(8))
    lay = R.RingLayout(memoryview(old), 8)
    lay.initialise()
    prod = R.RingProducer(lay)
    slow_calls: list[int] = []
    submit = R.make_submit(prod, threading.Lock(), lambda seq, *a: slow_calls.append(seq) or seq)
    lay.store32(R.OFF_STATE, R.ConsumerState.RUNNING)
    assert submit(R.Opcode.MARK, 1) == 1 and not slow_calls
    tomb = prod.retire()
    assert tomb.buf.obj is not old and tomb.state == R.ConsumerState.EXITED_STOP
    assert R.decode_words(tomb.slot_words(1), 1).args[0] == 1  # what was published is in the copy
    old[:] = b"\xa5" * len(old)  # as if freed and reused
    prod.set_releases([(0x1000, 7)])
    assert prod.try_publish(R.Opcode.MARK, 2) == 2
    if ring_impl == "c":  # the fast path taken before retire() now publishes into the copy
        assert submit(R.Opcode.MARK, 3) == 3 and slow_calls == [3]
    assert old == b"\xa5" * len(old)
    assert prod.head == (3 if ring_impl == "c" else 2)


# ---------------------------------------------------------------------------------------------- layout


def test_layout_rejects_bad_input() -> None:
    with pytest.raises(ConfigError):
        R.RingLayout(memoryview(bytearray(100)), 4)
    with pytest.raises(ConfigError):
        R.RingLayout(memoryview(bytes(R.ring_bytes(4))), 4)
    with pytest.raises(ConfigError, match="permutation"):
        lay, _ = make(4)
        R.RingConsumer(lay, word_order=[0, 1, 2, 3, 4, 5, 6, 6])


def test_a_ring_of_another_version_or_capacity_is_refused() -> None:
    lay, _ = make(8)
    lay.validate()
    with pytest.raises(R.RingError, match="capacity 8.*expected capacity 4"):
        R.RingLayout(lay.buf, 4).validate()
    lay.store32(R.OFF_VERSION, 1)
    for open_ in (R.RingProducer, R.RingConsumer):
        with pytest.raises(R.RingError, match="ring protocol version 1, this build speaks version 2"):
            open_(lay)
    lay.store32(R.OFF_MAGIC, 0)
    with pytest.raises(R.RingError, match="not an executor ring"):
        R.RingProducer(lay)


def test_published_recovers_head_and_a_half_written_slot_is_refused() -> None:
    lay, prod = make(8)
    for i in range(5):
        prod.try_publish(R.Opcode.MARK, 0, i)
    lay.store(R.OFF_TAIL, 2)  # as if the consumer completed two
    assert lay.published() == 5 == R.RingProducer(lay).head
    words = R.encode_words(6, R.Opcode.NOP)
    lay.store(lay.slot_off(6) + 8 * 3, words[3])  # one word of task 6: a producer died mid-publish
    with pytest.raises(R.RingError, match="slot of task 6 is partly written"):
        R.RingProducer(lay)


# ---------------------------------------------------------------------------------------------- producer


@settings(max_examples=200, deadline=None)
@given(capacity=st.sampled_from([2, 4, 8, 64]), ops=st.lists(st.integers(0, 9), max_size=120))
def test_index_invariants(capacity: int, ops: list[int]) -> None:
    """Random interleavings of publish / consume: the producer never overruns, slots never collide, every
    published task is consumed exactly once in order."""
    lay, prod = make(capacity)
    cons_tail = 0
    published: list[int] = []
    for op in ops:
        if op < 6:  # publish
            seq = prod.try_publish(R.Opcode.MARK, op, len(published))
            if seq == 0:
                assert prod.head - cons_tail == capacity  # full: refused, nothing written
            else:
                assert seq == len(published) + 1
                published.append(seq)
                assert 0 < prod.head - cons_tail <= capacity
        else:  # consume up to op-5 tasks
            for _ in range(op - 5):
                if cons_tail == prod.head:
                    break
                s = cons_tail + 1
                d = R.decode_descriptor(lay.buf[lay.slot_off(s):lay.slot_off(s) + 64], s, capacity)
                assert d.opcode == R.Opcode.MARK and d.args[1] == s - 1
                lay.store(lay.result_off(s) + 8, s)
                lay.store(R.OFF_TAIL, s)
                cons_tail = s
        assert R.free_slots(prod.head, cons_tail, capacity) == capacity - (prod.head - cons_tail)
        # the slots of in-flight tasks are distinct, and each holds its whole descriptor
        live = list(range(cons_tail + 1, prod.head + 1))
        assert len({R.slot_index(s, capacity) for s in live}) == len(live)
        assert all(lay.slot_states(s) == [MATCH] * 8 for s in live)
    assert published == list(range(1, len(published) + 1))


def test_free_slots_detects_inconsistency() -> None:
    with pytest.raises(R.RingError):
        R.free_slots(3, 5, 8)
    with pytest.raises(R.RingError):
        R.free_slots(20, 5, 8)


# ---------------------------------------------------------------------------------------------- consumer


def mark_handler(counts: np.ndarray) -> R.Handler:
    def handler(d: R.Descriptor) -> tuple[int, int]:
        if d.opcode == R.Opcode.MARK:
            counts[d.args[1]] += 1
            return d.args[1] & 0xFFFFFFFF, 0
        return 0, R.Status.BAD_OPCODE
    return handler


def run_consumer(lay: R.RingLayout, box: list[R.ConsumerState], handler: R.Handler,
                 word_order: tuple[int, ...] = tuple(range(8)), **kw: float) -> tuple[threading.Thread, R.RingConsumer]:
    cons = R.RingConsumer(lay, image_id=7, word_order=word_order)
    t = threading.Thread(target=lambda: box.append(cons.run(handler, **kw)), daemon=True)
    t.start()
    return t, cons


def test_consumer_thread_100k_tasks_none_lost_or_repeated() -> None:
    n = 100_000
    lay, prod = make(256)
    counts = np.zeros(n, dtype=np.int64)
    box: list[R.ConsumerState] = []
    t, _ = run_consumer(lay, box, mark_handler(counts), word_order=(7, 3, 0, 5, 1, 6, 2, 4), idle_timeout_s=10.0)
    seqs = []
    for i in range(n):
        seqs.append(prod.publish(R.Opcode.MARK, 0, i, timeout_s=10.0))
        if i % 997 == 0:  # read some results back while the ring wraps
            while not prod.completed(seqs[-1]):
                pass
            r = prod.result(seqs[-1])
            assert (r.value, r.status) == (i, 0)
    while prod.tail() != n:
        pass
    prod.request_stop()
    t.join(10)
    assert box == [R.ConsumerState.EXITED_STOP]
    assert prod.tail() == n == prod.head == lay.published()
    assert seqs == list(range(1, n + 1))
    assert int(counts.min()) == 1 and int(counts.max()) == 1
    assert lay.load32(R.OFF_IMAGE) == 7


def expected_fields(seq: int) -> tuple[int, tuple[int, ...], int]:
    """What the torn-writer test publishes as task ``seq``: every field a function of seq."""
    args = tuple(((seq * 0x9E3779B1) >> (5 * i) ^ i << 40) & R.PAYLOAD_MASK for i in range(6))
    return (R.Opcode.MARK if seq % 3 else R.Opcode.NOP), args, (seq * 2654435761) & 0xFFFFFFFF


def test_torn_writes_never_run_a_partial_descriptor(fast_switching: None) -> None:
    """A producer that stores the 8 words one at a time, in a random order, yielding in the middle, while the
    consumer loads them in yet another order: every task runs exactly once with exactly its own fields, and the
    consumer demonstrably saw half-written descriptors (and skipped them)."""
    n = 20_000
    cap = 16
    lay, _ = make(cap)
    rng = random.Random(1234)
    runs: list[int] = []
    wrong: list[tuple[int, R.Descriptor]] = []

    def handler(d: R.Descriptor) -> tuple[int, int]:
        runs.append(d.seq)
        op, args, aux = expected_fields(d.seq)
        if (d.opcode, d.args, d.aux, d.flags) != (op, args, aux, 0):
            wrong.append((d.seq, d))
        return d.seq & 0xFFFFFFFF, 0

    box: list[R.ConsumerState] = []
    t, cons = run_consumer(lay, box, handler, word_order=(4, 0, 7, 2, 6, 1, 5, 3), idle_timeout_s=10.0)
    q = lay.q
    for seq in range(1, n + 1):
        while seq - lay.load(R.OFF_TAIL) > cap:
            time.sleep(0)
        op, args, aux = expected_fields(seq)
        words = R.encode_words(seq, op, args, 0, aux)
        base = lay.slot_off(seq) >> 3
        order = list(range(8))
        rng.shuffle(order)
        for k, w in enumerate(order):
            q[base + w] = words[w]
            if k == 3 or (k == 5 and seq % 7 == 0):
                time.sleep(0)  # let the consumer poll a half-written slot
    while lay.load(R.OFF_TAIL) != n:
        time.sleep(0.001)
    lay.store32(R.OFF_STOP, 1)
    t.join(10)
    assert box == [R.ConsumerState.EXITED_STOP]
    assert not wrong, wrong[:3]
    assert runs == list(range(1, n + 1))
    assert cons.partial_polls > 100, cons.partial_polls  # the race really happened


def test_previous_occupant_words_are_never_accepted() -> None:
    lay, prod = make(4)
    cons = R.RingConsumer(lay)
    ran: list[R.Descriptor] = []
    for i in range(4):  # tasks 1..4 fill every slot once
        prod.try_publish(R.Opcode.MARK, 0, i, aux=100 + i)
    ready, bad = cons.poll()
    assert [d.seq for d in ready] == [1, 2, 3, 4] and bad == 0
    for d in ready:  # complete them as the consumer would
        lay.store(R.OFF_TAIL, d.seq)
        ran.append(d)
    cons.tail = 4
    # slot 0 still holds task 1 (the previous occupant of task 5): never taken for task 5
    assert lay.slot_states(5) == [STALE] * 8
    assert cons.poll() == ([], 0)
    words = R.encode_words(5, R.Opcode.MARK, (0, 99), 0, 7)
    base = lay.slot_off(5) >> 3
    for k, w in enumerate((6, 1, 7, 0, 3, 5, 4, 2)):  # one word at a time: ready only after the last
        lay.q[base + w] = words[w]
        ready, bad = cons.poll()
        assert bad == 0 and cons.partial_polls == (k + 1 if k < 7 else 7)
        assert [d.seq for d in ready] == ([5] if k == 7 else [])
    assert ready[0] == R.Descriptor(R.Opcode.MARK, (0, 99, 0, 0, 0, 0), 0, 7, 5)


def test_a_foreign_tag_stops_the_consumer_with_bad_slot() -> None:
    lay, prod = make(4)
    prod.try_publish(R.Opcode.NOP)
    prod.try_publish(R.Opcode.NOP)
    lay.store(lay.slot_off(2) + 8 * 4, R.encode_words(2 + 2 * 4, R.Opcode.NOP)[4])  # a word of task 10 in task 2's slot
    assert lay.slot_states(2)[4] == BAD
    state = R.RingConsumer(lay).run(lambda d: (0, 0), idle_timeout_s=1.0)
    assert state == R.ConsumerState.EXITED_ERROR
    assert lay.load32(R.OFF_ERROR) == R.ConsumerError.BAD_SLOT and lay.load(R.OFF_ERROR_SEQ) == 2
    assert prod.tail() == 0  # nothing ran: a corrupt poll runs nothing


def test_stop_leaves_tasks_queued_for_the_next_consumer() -> None:
    """Hot-swap semantics: consumer 1 exits at a boundary, consumer 2 resumes from tail; nothing lost/run twice."""
    n = 20_000
    lay, prod = make(64)
    counts = np.zeros(n, dtype=np.int64)
    box: list[R.ConsumerState] = []
    t, _ = run_consumer(lay, box, mark_handler(counts), idle_timeout_s=10.0)
    for i in range(n):
        if i == n // 2:
            prod.request_stop()
            t.join(10)
            assert box == [R.ConsumerState.EXITED_STOP]
            prod.clear_stop()
            t, _ = run_consumer(lay, box, mark_handler(counts), word_order=(7, 6, 5, 4, 3, 2, 1, 0),
                                idle_timeout_s=10.0)
        prod.publish(R.Opcode.MARK, 0, i, timeout_s=10.0)
    while prod.tail() != n:
        pass
    prod.request_stop()
    t.join(10)
    assert lay.load(R.OFF_STARTS) == 2
    assert int(counts.min()) == 1 and int(counts.max()) == 1


def test_idle_exit_releases_flags_and_full_ring_refuses() -> None:
    lay, prod = make(4)
    released: list[tuple[int, int]] = []
    prod.set_releases([(0x1000, 5), (0x2000, 0xFFFFFFFE)])
    cons = R.RingConsumer(lay)
    cons.on_release = lambda a, v: released.append((a, v))  # type: ignore[method-assign]
    state = cons.run(lambda d: (0, 0), idle_timeout_s=0.01)
    assert state == R.ConsumerState.EXITED_IDLE == lay.state
    assert released == [(0x1000, 5), (0x2000, 0xFFFFFFFE)]
    for _ in range(4):
        assert prod.try_publish(R.Opcode.NOP)
    assert prod.try_publish(R.Opcode.NOP) == 0
    with pytest.raises(R.RingFullError, match="capacity 4"):
        prod.publish(R.Opcode.NOP, timeout_s=0.01)
    with pytest.raises(R.RingError, match="not complete"):
        prod.result(1)


def test_results_overwritten_are_detected() -> None:
    lay, prod = make(2)
    counts = np.zeros(8, dtype=np.int64)
    box: list[R.ConsumerState] = []
    t, _ = run_consumer(lay, box, mark_handler(counts), idle_timeout_s=10.0)
    for i in range(5):
        prod.publish(R.Opcode.MARK, 0, i, timeout_s=5.0)
    while prod.tail() != 5:
        pass
    prod.request_stop()
    t.join(5)
    assert prod.result(5).value == 4
    with pytest.raises(R.RingError, match="overwritten by task 5"):
        prod.result(3)


# ---------------------------------------------------------------------------------------------- fast paths


class FakeExecutor:
    """The executor's use of the ring's fast paths, with a Python consumer thread as the device: ``submit`` /
    ``wait`` are exactly what ResidentExecutor installs; the slow path restarts an exited consumer."""

    def __init__(self, capacity: int, idle_timeout_s: float = 10.0) -> None:
        self.lay, self.prod = make(capacity)
        self.counts: dict[int, int] = {}
        self.idle_timeout_s = idle_timeout_s
        self.box: list[R.ConsumerState] = []
        self.thread: threading.Thread | None = None
        self.slow_calls = 0
        self.lock = threading.Lock()
        self.lifecycle = threading.Lock()
        self.submit = R.make_submit(self.prod, self.lock, self._slow)
        self.wait = R.make_wait(self.prod, self.ensure_running, self._timeout)

    def _handler(self, d: R.Descriptor) -> tuple[int, int]:
        if d.opcode == R.Opcode.MARK:
            self.counts[d.args[0]] = self.counts.get(d.args[0], 0) + 1
            return d.args[0] & 0xFFFFFFFF, 0
        return 0, (0 if d.opcode == R.Opcode.NOP else R.Status.BAD_OPCODE)

    def ensure_running(self) -> None:
        with self.lifecycle:
            if self.thread is None or not self.thread.is_alive():
                self.thread, _ = run_consumer(self.lay, self.box, self._handler, idle_timeout_s=self.idle_timeout_s)
                while self.lay.state != R.ConsumerState.RUNNING and self.thread.is_alive():
                    time.sleep(0)

    def _slow(self, seq: int, opcode: int, a0: int, a1: int, a2: int, a3: int, a4: int, a5: int, aux: int) -> int:
        self.slow_calls += 1
        while not seq:
            self.ensure_running()
            with self.lock:
                seq = self.prod.try_publish(opcode, a0, a1, a2, a3, a4, a5, aux)
            time.sleep(0)
        self.ensure_running()
        return seq

    def _timeout(self, ticket: int, timeout_s: float) -> NoReturn:
        raise ExecutorError(f"task {ticket} timed out after {timeout_s}s")

    def close(self) -> None:
        self.prod.request_stop()
        if self.thread is not None:
            self.thread.join(10)


def test_submit_from_threads_none_lost_or_repeated(fast_switching: None) -> None:
    ex = FakeExecutor(capacity=64)
    threads, per = 4, 5_000
    last: list[int] = []

    def produce(k: int) -> None:
        seq = 0
        for i in range(per):
            seq = ex.submit(R.Opcode.MARK, k * per + i)
        last.append(seq)

    ts = [threading.Thread(target=produce, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert len(last) == threads
    ex.wait(max(last), timeout_s=30)
    ex.close()
    assert sorted(ex.counts) == list(range(threads * per)) and set(ex.counts.values()) == {1}
    assert ex.prod.head == threads * per == ex.prod.tail()
    assert ex.slow_calls >= 1  # the first submit found no consumer RUNNING and started one


def test_fast_wait_returns_values_and_raises_clearly() -> None:
    ex = FakeExecutor(capacity=4)
    s1 = ex.submit(R.Opcode.MARK, 41)
    assert ex.wait(s1) == 41
    s2 = ex.submit(R.Opcode.SLEEP)  # the handler refuses it
    with pytest.raises(ExecutorError, match=f"task {s2} failed on the device: BAD_OPCODE"):
        ex.wait(s2)
    for i in range(4):
        ex.wait(ex.submit(R.Opcode.MARK, i))
    with pytest.raises(R.RingError, match=f"result of task {s1} was overwritten by task {s1 + 4}"):
        ex.wait(s1)
    ex.close()
    ex.thread.join(10)  # type: ignore[union-attr]
    ex.lay.store32(R.OFF_STATE, R.ConsumerState.EXITED_STOP)
    stuck = ex.submit(R.Opcode.NOP)  # the slow path restarts the consumer, which sees stop and exits
    with pytest.raises(ExecutorError, match=f"task {stuck} timed out after 0.05s"):
        ex.wait(stuck, timeout_s=0.05)


def test_submit_goes_slow_only_when_full_or_not_running() -> None:
    ex = FakeExecutor(capacity=4)
    ex.ensure_running()
    ex.lay.store32(R.OFF_STOP, 1)  # park the consumer: the ring fills up
    ex.thread.join(10)  # type: ignore[union-attr]
    ex.lay.store32(R.OFF_STOP, 0)
    ex.lay.store32(R.OFF_STATE, R.ConsumerState.RUNNING)  # as if it were still running: fast path only
    calls = ex.slow_calls
    seqs = [ex.submit(R.Opcode.MARK, i) for i in range(4)]
    assert seqs == [1, 2, 3, 4] and ex.slow_calls == calls
    assert ex.submit(R.Opcode.MARK, 4) == 5  # full: the slow path restarts the consumer and publishes
    assert ex.slow_calls == calls + 1
    ex.wait(5)
    ex.close()
    assert sorted(ex.counts) == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------- C == Python


def test_producer_runs_the_implementation_asked_for(ring_impl: str) -> None:
    _, prod = make(4)
    assert prod.implementation == ring_impl


@settings(max_examples=60, deadline=None)
@given(capacity=st.sampled_from([2, 4, 16, 64]), tasks=st.lists(st.tuples(
    st.integers(0, 2**16 - 1), st.lists(PAYLOADS, max_size=6), st.integers(0, 2**32 - 1), st.integers(0, 2**16 - 1)),
    min_size=1, max_size=40))
def test_c_and_python_producers_write_identical_rings(capacity: int,
                                                     tasks: list[tuple[int, list[int], int, int]]) -> None:
    if R._ringfast is None:
        pytest.skip("C ring fast path not built")
    rings = []
    for fast in (True, False):
        lay = R.RingLayout(memoryview(bytearray(R.ring_bytes(capacity))), capacity)
        lay.initialise()
        prod = R.RingProducer(lay, fast=fast)
        seqs = []
        for i, (op, args, aux, flags) in enumerate(tasks):
            seq = prod.try_publish(op, *args, aux=aux, flags=flags)
            seqs.append(seq)
            if i % 3 == 2:  # a consumer completes some: tail moves, the ring wraps
                lay.store(R.OFF_TAIL, prod.head)
        rings.append((bytes(lay.buf), seqs, prod.head))
    assert rings[0] == rings[1]


def test_fast_submit_keeps_reference_counts(ring_impl: str) -> None:
    """The slow path gets the caller's objects and drops them again (a leak in C would show here)."""
    lay, prod = make(2)
    big = 2**47 + 12345  # not a cached small int
    seen: list[int] = []

    def slow(seq: int, *a: int) -> int:
        seen.append(seq)
        return seq

    submit = R.make_submit(prod, threading.Lock(), slow)  # consumer not RUNNING: every submit goes slow
    before = sys.getrefcount(big)
    for _ in range(1000):
        lay.store(R.OFF_TAIL, prod.head)
        submit(R.Opcode.MARK, big, aux=7)
    assert sys.getrefcount(big) == before and seen == list(range(1, 1001))


def test_c_path_is_required_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONCORDIA_RING_IMPL", "rust")
    with pytest.raises(ConfigError, match="CONCORDIA_RING_IMPL"):
        make(2)
