"""The ring protocol over ordinary memory, with a consumer thread standing in for the device."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from concordia_ft.core import ring as R
from concordia_ft.errors import ConfigError


def make(capacity: int) -> tuple[R.RingLayout, R.RingProducer]:
    buf = bytearray(R.ring_bytes(capacity))
    lay = R.RingLayout(memoryview(buf), capacity)
    lay.initialise()
    return lay, R.RingProducer(lay)


@given(seq=st.integers(1, 2**40), opcode=st.integers(0, 2**16 - 1), flags=st.integers(0, 2**16 - 1),
       aux=st.integers(0, 2**32 - 1), args=st.lists(st.integers(0, 2**64 - 1), max_size=6))
def test_descriptor_round_trip(seq: int, opcode: int, flags: int, aux: int, args: list[int]) -> None:
    d = R.Descriptor(opcode, tuple(args), flags, aux, seq)
    raw = R.encode_descriptor(d)
    assert len(raw) == R.SLOT_BYTES
    back = R.decode_descriptor(raw)
    assert back == R.Descriptor(opcode, tuple(args) + (0,) * (6 - len(args)), flags, aux, seq)


def test_layout_rejects_bad_input() -> None:
    with pytest.raises(ConfigError):
        R.check_capacity(3)
    with pytest.raises(ConfigError):
        R.RingLayout(memoryview(bytearray(100)), 4)
    with pytest.raises(ConfigError):
        R.RingLayout(memoryview(bytes(R.ring_bytes(4))), 4)
    with pytest.raises(ConfigError):
        R.encode_body(1, tuple(range(7)))


def test_header_written_and_checked() -> None:
    lay, _ = make(8)
    lay.validate()
    other = R.RingLayout(lay.buf, 4)
    with pytest.raises(R.RingError, match="header mismatch"):
        other.validate()


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
            seq = prod.try_publish(R.Opcode.MARK, op, 0)
            if prod.head - cons_tail >= capacity and seq == 0:
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
                d = R.decode_descriptor(lay.buf[lay.slot_off(s):lay.slot_off(s) + 64])
                assert d.seq == s and d.opcode == R.Opcode.MARK
                lay.store(lay.result_off(s) + 8, s)
                lay.store(R.OFF_TAIL, s)
                cons_tail = s
        assert R.free_slots(prod.head, cons_tail, capacity) == capacity - (prod.head - cons_tail)
        # the slots of in-flight tasks are distinct
        live = [R.slot_index(s, capacity) for s in range(cons_tail + 1, prod.head + 1)]
        assert len(set(live)) == len(live)
    assert published == list(range(1, len(published) + 1))


def test_free_slots_detects_inconsistency() -> None:
    with pytest.raises(R.RingError):
        R.free_slots(3, 5, 8)
    with pytest.raises(R.RingError):
        R.free_slots(20, 5, 8)


def run_consumer(lay: R.RingLayout, box: list[R.ConsumerState], counts: np.ndarray,
                 **kw: float) -> threading.Thread:
    cons = R.RingConsumer(lay, image_id=7)

    def handler(d: R.Descriptor) -> tuple[int, int]:
        if d.opcode == R.Opcode.MARK:
            counts[d.args[1]] += 1
            return d.args[1] & 0xFFFFFFFF, 0
        return 0, R.Status.BAD_OPCODE

    t = threading.Thread(target=lambda: box.append(cons.run(handler, **kw)), daemon=True)
    t.start()
    return t


def test_consumer_thread_100k_tasks_none_lost_or_repeated() -> None:
    n = 100_000
    lay, prod = make(256)
    counts = np.zeros(n, dtype=np.int64)
    box: list[R.ConsumerState] = []
    t = run_consumer(lay, box, counts, idle_timeout_s=10.0)
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
    assert prod.tail() == n == prod.head
    assert seqs == list(range(1, n + 1))
    assert int(counts.min()) == 1 and int(counts.max()) == 1
    assert lay.load32(R.OFF_IMAGE) == 7


def test_stop_leaves_tasks_queued_for_the_next_consumer() -> None:
    """Hot-swap semantics: consumer 1 exits at a boundary, consumer 2 resumes from tail; nothing lost/run twice."""
    n = 20_000
    lay, prod = make(64)
    counts = np.zeros(n, dtype=np.int64)
    box: list[R.ConsumerState] = []
    t = run_consumer(lay, box, counts, idle_timeout_s=10.0)
    for i in range(n):
        if i == n // 2:
            prod.request_stop()
            t.join(10)
            assert box == [R.ConsumerState.EXITED_STOP]
            prod.clear_stop()
            t = run_consumer(lay, box, counts, idle_timeout_s=10.0)
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


def test_consumer_detects_stale_slot() -> None:
    lay, prod = make(4)
    prod.try_publish(R.Opcode.NOP)
    lay.store(lay.slot_off(1), 99)  # corrupt the slot's seq
    state = R.RingConsumer(lay).run(lambda d: (0, 0), idle_timeout_s=1.0)
    assert state == R.ConsumerState.EXITED_ERROR
    assert lay.load32(R.OFF_ERROR) == 1 and lay.load(R.OFF_ERROR_SEQ) == 1
    assert prod.tail() == 0


def test_results_overwritten_are_detected() -> None:
    lay, prod = make(2)
    counts = np.zeros(8, dtype=np.int64)
    box: list[R.ConsumerState] = []
    t = run_consumer(lay, box, counts, idle_timeout_s=10.0)
    for i in range(5):
        prod.publish(R.Opcode.MARK, 0, i, timeout_s=5.0)
    while prod.tail() != 5:
        pass
    prod.request_stop()
    t.join(5)
    assert prod.result(5).value == 4
    with pytest.raises(R.RingError, match="overwritten by task 5"):
        prod.result(3)
