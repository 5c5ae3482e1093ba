"""The scheduler's waiting queue: first come, first served, with removal from anywhere in O(1).

A client that goes away takes its waiting sequences with it, from anywhere in the queue. A
deque's `remove` scans from the front, so aborting the k newest of n waiting sequences cost
O(n * k) on the engine thread, every stream paused meanwhile (3.5 s for a 4,096-sequence
request behind 28,672 others). Here a removed sequence stays in the deque, marked, until it
reaches the front; length, truth and iteration count only the sequences still waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from headroom.engine.sequence import Sequence


class WaitingQueue:
    """Sequences waiting for admission, the front first; preempted ones rejoin at the front.

    A sequence removed from it does not come back (the scheduler finishes it).
    """

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()
        # id() of the sequences still waiting. A removed one stays in the deque until it reaches
        # the front, so its id cannot be reused by a new sequence before then.
        self._waiting: set[int] = set()

    def append(self, seq: Sequence) -> None:
        self._join(seq)
        self._queue.append(seq)

    def appendleft(self, seq: Sequence) -> None:
        self._join(seq)
        self._queue.appendleft(seq)

    def _join(self, seq: Sequence) -> None:
        if id(seq) in self._waiting:
            raise ValueError(f"sequence {seq.seq_id} is already waiting")
        self._waiting.add(id(seq))

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out wherever it stands; ValueError if it is not waiting here."""
        if id(seq) not in self._waiting:
            raise ValueError(f"sequence {seq.seq_id} is not waiting")
        self._waiting.discard(id(seq))
        if self._queue[-1] is seq:
            self._queue.pop()
        self._drop_removed_front()

    def head(self) -> Sequence:
        """The next sequence to admit (IndexError when none waits)."""
        return self._queue[0]

    def popleft(self) -> Sequence:
        seq = self._queue.popleft()
        self._waiting.discard(id(seq))
        self._drop_removed_front()
        return seq

    def _drop_removed_front(self) -> None:
        queue, waiting = self._queue, self._waiting
        while queue and id(queue[0]) not in waiting:
            queue.popleft()

    def __len__(self) -> int:
        return len(self._waiting)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __iter__(self) -> Iterator[Sequence]:
        waiting = self._waiting
        return (s for s in self._queue if id(s) in waiting)
