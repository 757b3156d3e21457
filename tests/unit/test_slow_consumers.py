"""The slow-consumer judgement (core.slow_consumers) and the counters the queue keeps
for it, without sockets: `judge` on samples, and `SlowConsumerDetector` on real core
queues with a hand-moved clock."""

from __future__ import annotations

import pytest

from amqbroker.core.consumer import Consumer
from amqbroker.core.entry import Entry
from amqbroker.core.queue import Queue
from amqbroker.core.slow_consumers import Sample, SlowConsumerDetector, judge
from amqbroker.core.timers import Timers


def s(at: float, settled: int, idle: int = 0, busy: bool = True) -> Sample:
    return Sample(at, settled, idle, busy)


@pytest.mark.parametrize(
    ("prev", "cur", "expected"),
    [
        (None, s(5, 0), None),  # first sample: a baseline only
        (s(0, 0), s(5, 0), 0.0),  # busy all along, nothing settled
        (s(0, 0), s(5, 20), 4.0),  # 4/s < 5/s
        (s(0, 0), s(5, 25), None),  # exactly the threshold: not slow
        (s(0, 0, busy=False), s(5, 0), None),  # no work at the start
        (s(0, 0), s(5, 0, busy=False), None),  # no work at the end
        (s(0, 0, idle=3), s(5, 1, idle=4), None),  # ran out of work in between
        (s(5, 0), s(5, 0), None),  # no time elapsed
    ],
)
def test_judge(prev: Sample | None, cur: Sample, expected: float | None) -> None:
    assert judge(prev, cur, 5.0) == expected


class Host:
    def __init__(self) -> None:
        self.now = 0.0
        self.clock = lambda: self.now
        self.timers = Timers()

    def schedule_dispatch(self, queue: Queue) -> None:
        queue.dispatch()

    def dead_letter(self, queue: Queue, entry: Entry, reason: str) -> None:
        pass

    def expired(self, queue: Queue, entry: Entry) -> None:
        pass

    def queue_idle(self, queue: Queue) -> None:
        pass


class Rec(Consumer):
    def __init__(self, name: str, credit: int) -> None:
        super().__init__(name)
        self.credit = credit
        self.got: list[Entry] = []

    def deliver(self, entry: Entry, first: bool) -> None:
        self.got.append(entry)


def entry(i: int) -> Entry:
    return Entry(b"m%d" % i, False, 4, 0, 0, None, 0)


def test_detector_counts_episodes_and_ignores_idle_consumers() -> None:
    h = Host()
    q = Queue("q", h)
    idle_q = Queue("idle", h)
    lazy, idle = Rec("lazy", 2), Rec("idle", 5)
    q.add_consumer(lazy)
    idle_q.add_consumer(idle)
    for i in range(5):
        q.enqueue(entry(i))
    assert len(lazy.got) == 2 and q.ready_count == 3
    det = SlowConsumerDetector(1.0)
    assert det.check([q, idle_q], 0.0) == []  # baselines
    (v,) = det.check([q, idle_q], 5.0)
    assert (v.consumer, v.rate, v.period) == (lazy, 0.0, 5.0)
    assert "slow_consumer_threshold (1 messages/s)" in v.describe()
    assert det.check([q, idle_q], 10.0) == []  # same episode
    assert det.detected == 1
    # it settles 10 in 5 s (2/s): fast enough, the episode ends
    for i in range(5, 15):
        q.enqueue(entry(i))
    for _ in range(10):
        e = lazy.got.pop(0)
        q.ack(lazy, e)
        lazy.credit += 1
        q.credit_changed(lazy)
    assert det.check([q, idle_q], 15.0) == []
    assert not lazy.slow
    (v,) = det.check([q, idle_q], 20.0)  # stalled again: a new episode
    assert v.consumer is lazy and det.detected == 2
    assert not idle.slow and idle.slow_sample is not None and not idle.slow_sample.busy


def test_settled_and_idle_marks_kept_by_the_queue() -> None:
    h = Host()
    q = Queue("q", h)
    c = Rec("c", 10)
    q.add_consumer(c)
    q.enqueue(entry(1))
    q.enqueue(entry(2))
    q.ack(c, c.got[0])
    assert (c.settled, c.idle_marks) == (1, 0)  # one still in flight
    q.release(c, c.got[1])  # back and redelivered at once: still busy
    assert (c.settled, c.idle_marks) == (2, 0)
    q.reject(c, c.got[2])
    assert (c.settled, c.idle_marks) == (3, 1)  # nothing left for it
    q2 = Queue("q2", h)
    p = Rec("p", 1)
    p.presettled = True
    q2.add_consumer(p)
    q2.enqueue(entry(3))
    q2.enqueue(entry(4))
    assert (p.settled, p.idle_marks) == (1, 1)  # settled when sent; nothing else came
    assert q2.ready_count == 1
