"""The waiting queue: FIFO order, preempted sequences at the front, removal from anywhere."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headroom.engine.config import EngineConfig
from headroom.engine.scheduler import Scheduler
from headroom.engine.sequence import Sequence
from headroom.engine.waiting_queue import WaitingQueue


def _seq(i: int) -> Sequence:
    return Sequence(f"r{i}", [1, 2, 3], 1)


# (op, index): append a new sequence, appendleft one, remove the index-th waiting, popleft.
_OPS = st.lists(
    st.tuples(st.sampled_from(["append", "appendleft", "remove", "popleft"]), st.integers(0, 40)),
    max_size=120,
)


@given(_OPS)
def test_the_queue_behaves_as_a_list_of_the_sequences_still_waiting(
    ops: list[tuple[str, int]],
) -> None:
    queue, model = WaitingQueue(), list[Sequence]()
    for n, (op, i) in enumerate(ops):
        if op == "append":
            s = _seq(n)
            queue.append(s)
            model.append(s)
        elif op == "appendleft":
            s = _seq(n)
            queue.appendleft(s)
            model.insert(0, s)
        elif op == "remove" and model:
            s = model.pop(i % len(model))
            queue.remove(s)
        elif op == "popleft" and model:
            assert queue.popleft() is model.pop(0)
        assert list(queue) == model
        assert len(queue) == len(model) and bool(queue) == bool(model)
        if model:
            assert queue.head() is model[0]


def test_removing_a_sequence_twice_or_from_an_empty_queue_is_refused() -> None:
    queue = WaitingQueue()
    a, b = _seq(1), _seq(2)
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(a)
    queue.append(a)
    queue.append(b)
    queue.remove(a)
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(a)
    assert list(queue) == [b]


class _Compared(Sequence):
    compared = 0

    def __eq__(self, other: object) -> bool:
        _Compared.compared += 1
        return self is other

    __hash__ = Sequence.__hash__


def test_aborting_sequences_deep_in_the_queue_does_not_scan_it() -> None:
    # A client that goes away takes its waiting sequences from anywhere in the queue; a
    # deque's `remove` compared each against every sequence ahead of it, on the engine thread
    # (3.5 s for a 4,096-sequence request behind 28,672 others, every stream paused).
    sched = Scheduler(EngineConfig(model="tiny").sized(64, 256))
    seqs = [_Compared(f"r{i}", [1], 1) for i in range(2_000)]
    for s in seqs:
        sched.add(s)
    _Compared.compared = 0
    for s in seqs[1_000:1_010]:
        assert sched.finish(s.seq_id)
    assert _Compared.compared == 0
    assert len(sched.waiting) == 1_990 and list(sched.waiting) == seqs[:1_000] + seqs[1_010:]


def test_a_sequence_already_waiting_cannot_join_twice() -> None:
    queue = WaitingQueue()
    a = _seq(1)
    queue.append(a)
    with pytest.raises(ValueError, match="already waiting"):
        queue.appendleft(a)
    assert list(queue) == [a]
