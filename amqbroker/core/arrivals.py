"""Message ages without a clock read per message: a queue's coarse clock and arrival marks.

The queue keeps a *coarse clock* `coarse`, read from the real clock at the first
enqueue or grouped settlement after `age_resolution` seconds without a read (a
one-shot timer re-arms it). Each read leaves an *arrival mark* (n, t): every message
with seq >= n arrived at or after t. A message's arrival time is the latest mark with
n <= its seq: at most `age_resolution` before its real arrival, so the age reported is
an upper bound within that resolution. Marks below every held message are dropped;
past `age_marks` every other one of the older half is dropped, so memory stays bounded
and only very old messages lose precision. Messages without a mark left (recovered
after a restart, or back from a long delay after a prune) count from the oldest mark:
their age is then a lower bound.

Hot path: `enqueue` and `ack` test `armed` and call `stamp` only when it is False.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from amqbroker.core.consumer import Consumer
    from amqbroker.core.timers import Timers


class AgePolicy(Protocol):
    @property
    def age_marks(self) -> int: ...

    @property
    def age_resolution(self) -> float: ...


class AgedQueue(Protocol):
    """The queue as its arrival marks see it (`amqbroker.core.queue.Queue`)."""

    clock: Callable[[], float]
    timers: Timers
    last_seq: int
    paged_count: int
    page_mark: int

    @property
    def policy(self) -> AgePolicy: ...

    def oldest_waiting_seq(self) -> int | None: ...

    def consumers(self) -> list[Consumer]: ...


class ArrivalMarks:
    __slots__ = ("armed", "coarse", "marks", "q")

    def __init__(self, q: AgedQueue) -> None:
        self.q = q
        self.armed = False
        self.coarse = 0.0
        self.marks: list[tuple[int, float]] = []

    def stamp(self, n: int) -> None:
        """Read the clock into `coarse` and leave the mark (n, now)."""
        q = self.q
        now = q.clock()
        self.coarse = now
        self.armed = True
        arr = self.marks
        if arr and arr[-1][0] == n:
            arr[-1] = (n, now)
        else:
            arr.append((n, now))
            if len(arr) > q.policy.age_marks:
                self._prune()
        q.timers.call_at(now + q.policy.age_resolution, self._unstamp)

    def _unstamp(self) -> None:
        self.armed = False

    def arrival_time(self, seq: int) -> float | None:
        """When message `seq` arrived; None before the first message."""
        arr = self.marks
        if not arr:
            return None
        i = bisect_right(arr, (seq, float("inf"))) - 1
        return arr[max(i, 0)][1]

    def _prune(self) -> None:
        q = self.q
        arr = self.marks
        lo = q.oldest_waiting_seq() or q.last_seq + 1
        for c in q.consumers():
            f = getattr(c, "unsettled_entries", None)
            for e in f() if f is not None else ():
                lo = min(lo, e.seq)
        if q.paged_count:
            lo = min(lo, q.page_mark + 1)
        i = bisect_right(arr, (lo, float("inf"))) - 1
        if i > 0:
            del arr[:i]  # keep the latest mark at or below the oldest held message
        cap = q.policy.age_marks
        if len(arr) > cap:
            half = len(arr) // 2
            arr[:half] = arr[:half:2]
