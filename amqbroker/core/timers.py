"""Deterministic timers for the core, driven by whoever owns the event loop.

The core never sleeps. It schedules callbacks here with absolute times from the
injected clock; the application runs one task that sleeps until `next_deadline()` and
calls `run_due(now)`. Tests drive `run_due` directly (or through trio's autojump
clock), so every time-based rule is testable without real waiting.

Invariants: a cancelled timer never fires; `on_change` is called whenever the
earliest deadline may have moved earlier, so the driver can shorten its sleep.
Cancelled timers are dropped lazily from the heap but never kept beyond their
deadline, so the heap is bounded by the number of timers scheduled and not yet due.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class Timer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Timers:
    def __init__(self, on_change: Callable[[], object] | None = None) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._counter = itertools.count()
        self.on_change = on_change

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        t = Timer(when, callback)
        earliest = self._heap[0][0] if self._heap else None
        heapq.heappush(self._heap, (when, next(self._counter), t))
        if self.on_change is not None and (earliest is None or when < earliest):
            self.on_change()
        return t

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def run_due(self, now: float) -> int:
        """Run every timer due at `now`; returns how many ran."""
        heap = self._heap
        ran = 0
        while heap and heap[0][0] <= now:
            _, _, t = heapq.heappop(heap)
            if t.cancelled:
                continue
            t.cancelled = True
            ran += 1
            t.callback()
        return ran

    def pending(self) -> int:
        """Timers scheduled and not cancelled (not `__len__`: an empty Timers must
        not be falsy)."""
        return sum(1 for _, _, t in self._heap if not t.cancelled)
