"""A harness that drives the broker core (`amqbroker.core`) synchronously.

Everything the core depends on is injected and deterministic here: a fake clock (a
mutable float, seconds), `Timers` driven by `advance()`, a `Broker` that records what it
dead-letters and expires, and `FakeConsumer`s that record every delivery (entry, first
flag, time) and keep their unsettled entries the way the protocol layer does
(`unsettled_entries()`), so settling and detaching go through the same queue calls as
`amqbroker.protocol.links.ConsumerLink`.

Messages are `Entry` objects with distinct payloads: ``b"A1"`` is the first message of
group ``A``, ``b"u3"`` the third ungrouped one; `label(e)` gives the payload back as a str.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from amqbroker.core.address import ANYCAST
from amqbroker.core.address_settings import AddressSettings, AddressSettingsRepository
from amqbroker.core.broker import Broker
from amqbroker.core.consumer import Consumer
from amqbroker.core.entry import Entry
from amqbroker.core.queue import Queue, QueuePolicy
from amqbroker.core.timers import Timers

#: epoch seconds the fake clock starts at
T0 = 1_700_000_000.0
#: timers due within this many seconds of "now" run (float sums of ms steps are inexact)
EPSILON = 1e-6


class FakeClock:
    """A clock the test moves by hand (seconds, like `time.time`)."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    @property
    def ms(self) -> int:
        return int(self.t * 1000)


@dataclass
class Delivery:
    entry: Entry
    first: bool
    time: float
    consumer: FakeConsumer

    @property
    def label(self) -> str:
        return label(self.entry)


class FakeConsumer(Consumer):
    """Records deliveries; keeps unsettled entries in delivery order (like a link)."""

    def __init__(
        self,
        name: str,
        clock: Callable[[], float],
        journal: list[Delivery] | None = None,
        *,
        priority: int = 0,
        presettled: bool = False,
    ) -> None:
        super().__init__(
            name,
            priority=priority,
            presettled=presettled,
            connection_id=f"conn-{name}",
            container_id=f"container-{name}",
        )
        self._clock = clock
        self.deliveries: list[Delivery] = []
        self.unsettled: dict[Entry, None] = {}
        #: entries delivered while already unsettled on this consumer (must stay empty)
        self.duplicates: list[Entry] = []
        self._journal = journal
        #: optional hook called after each delivery (the property test checks there)
        self.on_deliver: Callable[[Delivery], None] | None = None

    def deliver(self, entry: Entry, first: bool) -> None:
        d = Delivery(entry, first, self._clock(), self)
        self.deliveries.append(d)
        if self._journal is not None:
            self._journal.append(d)
        if not self.presettled:
            if entry in self.unsettled:
                self.duplicates.append(entry)
            self.unsettled[entry] = None
        if self.on_deliver is not None:
            self.on_deliver(d)

    def unsettled_entries(self) -> Iterable[Entry]:
        return self.unsettled.keys()

    # convenience views
    @property
    def labels(self) -> list[str]:
        return [d.label for d in self.deliveries]

    @property
    def firsts(self) -> list[str]:
        """Labels of the deliveries that carried the group-first flag."""
        return [d.label for d in self.deliveries if d.first]

    def take(self) -> list[str]:
        """Labels delivered since the last take() (and forget them)."""
        out = self.labels
        self.deliveries.clear()
        return out


def label(e: Entry) -> str:
    return e.data.decode()


class RecordingBroker(Broker):
    """A Broker that also records dead-lettered and expired entries."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.dead: list[tuple[str, Entry, str]] = []
        self.expired_entries: list[tuple[str, Entry]] = []
        self.wakes = 0
        self.wake = self._wake

    def _wake(self) -> None:
        self.wakes += 1

    def dead_letter(self, queue: Queue, entry: Entry, reason: str) -> None:
        self.dead.append((queue.name, entry, reason))
        super().dead_letter(queue, entry, reason)

    def expired(self, queue: Queue, entry: Entry) -> None:
        self.expired_entries.append((queue.name, entry))
        super().expired(queue, entry)


@dataclass
class Harness:
    """One broker with one anycast queue (`name`) and helpers to drive it."""

    policy: QueuePolicy | None = None
    settings: dict[str, AddressSettings] | None = None
    name: str = "q"
    clock: FakeClock = field(default_factory=FakeClock)
    keep_broker_policy: bool = False

    def __post_init__(self) -> None:
        self.timers = Timers()
        self.broker = RecordingBroker(
            clock=self.clock,
            timers=self.timers,
            address_settings=AddressSettingsRepository(self.settings or {}),
        )
        self.broker.create_address(self.name, ANYCAST, durable=False)
        self.queue: Queue = self.broker.queues[self.name]
        if not self.keep_broker_policy:
            self.queue.policy = self.policy or QueuePolicy()
        self.journal: list[Delivery] = []
        self._n: dict[str, int] = {}
        self.sent: list[Entry] = []

    # ------------------------------------------------------------------ messages
    def make(
        self,
        group: str | None = None,
        seq: int = 0,
        *,
        priority: int = 4,
        expiry: int = 0,
        tag: str | None = None,
        durable: bool = False,
    ) -> Entry:
        """A new entry with a distinct payload: <group><n> or u<n> (or `tag`)."""
        if tag is None:
            base = group if group is not None else "u"
            n = self._n.get(base, 0) + 1
            self._n[base] = n
            tag = f"{base}{n}"
        data = tag.encode()
        return Entry(data, durable, priority, expiry, 0, group, seq)

    def send(
        self,
        group: str | None = None,
        seq: int = 0,
        *,
        priority: int = 4,
        expiry: int = 0,
        tag: str | None = None,
    ) -> Entry:
        e = self.make(group, seq, priority=priority, expiry=expiry, tag=tag)
        self.sent.append(e)
        self.queue.enqueue(e)
        return e

    def send_many(self, *groups: str | None) -> list[Entry]:
        return [self.send(g) for g in groups]

    # ----------------------------------------------------------------- consumers
    def attach(
        self,
        name: str,
        credit: int = 0,
        *,
        priority: int = 0,
        filter: Callable[[Entry], bool] | None = None,
        presettled: bool = False,
        queue: Queue | None = None,
    ) -> FakeConsumer:
        """Attach a consumer. `credit` is already set when the queue sees the consumer
        (attach and first flow in one batch), then announced with `credit_changed`."""
        c = FakeConsumer(name, self.clock, self.journal, priority=priority, presettled=presettled)
        c.filter = filter
        c.credit = credit
        (queue or self.queue).add_consumer(c)
        if credit:
            self.credit(c, credit)
        return c

    def credit(self, c: FakeConsumer, n: int) -> None:
        """Set the link credit to `n` (a flow frame) and tell the queue."""
        c.credit = n
        q = c.queue
        if q is not None:
            q.credit_changed(c)

    def add_credit(self, c: FakeConsumer, n: int) -> None:
        self.credit(c, c.credit + n)

    def detach(self, c: FakeConsumer, *, failed: bool = True) -> list[Entry]:
        """Connection drop (`failed`, the default: each unsettled message counts a
        failed delivery attempt) or clean detach: unsettled entries go back."""
        unsettled = list(c.unsettled)
        c.unsettled.clear()
        q = c.queue
        assert q is not None, "consumer is not attached"
        q.remove_consumer(c, unsettled, failed=failed)
        return unsettled

    def run_deferred(self) -> int:
        """What the app's event loop does after an input batch: continue the queues
        that asked for a deferred dispatch. Returns how many rounds ran."""
        n = 0
        while True:
            n += 1
            if not self.broker.run_deferred():
                return n

    # ---------------------------------------------------------------- settlement
    def _pop(self, c: FakeConsumer, e: Entry | str | None) -> Entry:
        if e is None:
            e = next(iter(c.unsettled))
        elif isinstance(e, str):
            e = next(x for x in c.unsettled if label(x) == e)
        del c.unsettled[e]
        return e

    def ack(self, c: FakeConsumer, e: Entry | str | None = None) -> Entry:
        e = self._pop(c, e)
        assert c.queue is not None
        c.queue.ack(c, e)
        return e

    def ack_all(self, c: FakeConsumer) -> list[Entry]:
        return [self.ack(c) for _ in range(len(c.unsettled))]

    def release(
        self,
        c: FakeConsumer,
        e: Entry | str | None = None,
        *,
        failed: bool = False,
        undeliverable: bool = False,
    ) -> Entry:
        """`released` (default) or `modified{delivery-failed, undeliverable-here}`."""
        e = self._pop(c, e)
        assert c.queue is not None
        c.queue.release(c, e, delivery_failed=failed, undeliverable_here=undeliverable)
        return e

    def reject(self, c: FakeConsumer, e: Entry | str | None = None) -> Entry:
        e = self._pop(c, e)
        assert c.queue is not None
        c.queue.reject(c, e)
        return e

    # ---------------------------------------------------------------------- time
    def advance(self, ms: float) -> int:
        """Move the clock and run the timers that are due; returns how many ran."""
        self.clock.t += ms / 1000.0
        return self.timers.run_due(self.clock.t + EPSILON)

    def expiry_in(self, ms: int) -> int:
        """An absolute expiry (epoch ms) `ms` from now."""
        return self.clock.ms + ms

    # ------------------------------------------------------------------- checks
    def assert_empty(self) -> None:
        q = self.queue
        assert (q.count, q.bytes, q.inflight) == (0, 0, 0), q.statistics()


# ------------------------------------------------------------------------ op counting

_CORE_DIR = str(Path(__file__).resolve().parents[2] / "amqbroker" / "core")


@dataclass
class OpCount:
    lines: int = 0


@contextmanager
def count_core_lines() -> Iterator[OpCount]:
    """Count the source lines of `amqbroker/core` executed inside the block.

    A deterministic stand-in for "work done" (not time): loops over groups, consumers
    or queued messages show up as one line event per iteration.
    """
    counter = OpCount()

    def local(frame: FrameType, event: str, arg: object) -> Any:
        if event == "line":
            counter.lines += 1
        return local

    def global_(frame: FrameType, event: str, arg: object) -> Any:
        if frame.f_code.co_filename.startswith(_CORE_DIR):
            return local
        return None

    old = sys.gettrace()
    sys.settrace(global_)
    try:
        yield counter
    finally:
        sys.settrace(old)
