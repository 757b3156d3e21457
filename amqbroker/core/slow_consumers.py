"""Slow-consumer detection: which consumers settle below a rate while messages wait
for them.

Theory of operation
-------------------
Every consumer carries two counters that the queue keeps (`Consumer.settled`: the
deliveries it has settled, any outcome, presettled ones when sent; and
`Consumer.idle_marks`: how many times it was left with nothing to do, i.e. its last
unsettled delivery was settled while nothing waited in the queue's main order or in
its own groups). The application calls `SlowConsumerDetector.check` every
`slow_consumer_check_period` seconds. Each check takes a `Sample` of every consumer
(time, both counters, and whether it *has work* right now: unsettled deliveries,
messages of its groups parked for it, or messages in the main order of a dispatching
queue that it could take) and compares it with the previous sample, stored on the
consumer itself (`Consumer.slow_sample`), with the pure function `judge`.

A consumer is *judged* over a period only when it had work for the whole period: at
both samples, and it never ran out of work in between (its idle marks did not move).
So an idle consumer on an empty queue, or a fast consumer fed by a slow producer (it
settles each message and waits for the next), is never judged. A judged consumer is
*slow* when its settle rate over the period, (settled now - settled then) / elapsed
seconds, is below the threshold (messages per second), as in ActiveMQ Artemis's
slow-consumer-threshold. A consumer that gives no credit while messages wait is slow
too (rate 0): it is not consuming them. A consumer with a filter (selector, no-local)
counts only its own work (unsettled deliveries, its groups), never the main order,
whose messages may all be for others.

Episodes: a slow consumer is reported once (`check` returns it and counts it in
`detected`); it is reported again only after a period in which it was not slow (fast,
or out of work), which ends the episode. What to do with a report (log a warning, or
detach the consumer) is the application's policy (`slow_consumer_policy`).

Invariants: a consumer's first check only records its baseline (a consumer attached
less than one period ago is never judged); the detector holds no reference to any
consumer between checks (its state lives on the consumers, so it goes with them);
`detected` only grows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from amqbroker.core.consumer import Consumer
    from amqbroker.core.queue import Queue

#: slow_consumer_policy values: log a warning / detach the consumer's link
NOTIFY = "NOTIFY"
KILL = "KILL"


@dataclass(frozen=True, slots=True)
class Sample:
    """One consumer's counters at one check."""

    at: float  # clock time, seconds
    settled: int
    idle_marks: int
    busy: bool  # it had work at `at`


@dataclass(frozen=True, slots=True)
class SlowConsumer:
    """A consumer found slow: the start of a slow episode."""

    consumer: Consumer
    queue: str
    rate: float  # messages settled per second over the period
    period: float  # seconds the rate was measured over
    threshold: float

    def describe(self) -> str:
        """What happened, for a log line and a detach description."""
        return (
            f"consumer {self.consumer.name!r} on queue {self.queue!r} settled "
            f"{self.rate:.2f} message(s)/s over the last {self.period:.1f} s while messages "
            f"were waiting for it, below slow_consumer_threshold ({self.threshold:g} "
            "messages/s)"
        )


def has_work(c: Consumer, q: Queue) -> bool:
    """Whether messages are available to `c` now (see the module docstring)."""
    if c.inflight or c.parked_groups:
        return True
    return c.filter is None and q.ready_count > 0 and q.dispatching


def sample(c: Consumer, q: Queue, now: float) -> Sample:
    return Sample(now, c.settled, c.idle_marks, has_work(c, q))


def judge(prev: Sample | None, cur: Sample, threshold: float) -> float | None:
    """The settle rate over [prev.at, cur.at] when the consumer had work for the whole
    period and settled below `threshold` messages per second; None otherwise (not
    judged: no previous sample, out of work at either end or in between, no time
    elapsed; or judged and fast enough)."""
    if prev is None or not (prev.busy and cur.busy) or cur.idle_marks != prev.idle_marks:
        return None
    elapsed = cur.at - prev.at
    if elapsed <= 0:
        return None
    rate = (cur.settled - prev.settled) / elapsed
    return rate if rate < threshold else None


class SlowConsumerDetector:
    """Checks consumers against `threshold` (messages per second, > 0)."""

    def __init__(self, threshold: float) -> None:
        if threshold <= 0:
            raise ValueError("the slow-consumer threshold must be positive")
        self.threshold = threshold
        #: slow episodes detected since start
        self.detected = 0

    def check(self, queues: Iterable[Queue], now: float) -> list[SlowConsumer]:
        """Sample every consumer of `queues`; return those that start a slow episode."""
        found: list[SlowConsumer] = []
        for q in queues:
            for c in q.consumers():
                prev = c.slow_sample
                if prev is not None and now <= prev.at:
                    continue  # no time has passed: keep the older baseline
                cur = sample(c, q, now)
                c.slow_sample = cur
                rate = judge(prev, cur, self.threshold)
                if rate is None:
                    c.slow = False  # fast, or out of work: any episode is over
                    continue
                if c.slow:
                    continue  # still slow: reported once per episode
                c.slow = True
                self.detected += 1
                assert prev is not None
                found.append(SlowConsumer(c, q.name, rate, now - prev.at, self.threshold))
        return found
