"""The core's accept policy (`amqbroker.core.accept`), without a protocol layer."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from pathlib import Path

from amqbroker.core import delivery_log as dl
from amqbroker.core.accept import (
    DUPLICATE,
    ENLIST,
    NO_ROUTE,
    PENDING,
    ROUTED,
    ROUTED_SYNC,
    accept,
    delivery_time,
    message_expiry,
)
from amqbroker.core.address import ANYCAST, MULTICAST, Address
from amqbroker.core.address_settings import AddressSettings, AddressSettingsRepository
from amqbroker.core.broker import Broker
from amqbroker.core.codec import PlainCodec
from amqbroker.core.entry import Entry
from amqbroker.core.errors import BrokerError, NotFound, ResourceLimitExceeded
from amqbroker.pipeline import delivery_log_format as fmt
from amqbroker.store.delivery_log import FIELDS, DeliveryLogWriter
from tests.unit.core_harness import FakeConsumer

T0 = 1_700_000_000.0
NOW_MS = int(T0 * 1000)


def clock() -> float:
    return T0


class IdCodec(PlainCodec):
    """The message bytes are their own duplicate id."""

    def duplicate_id(self, data: bytes) -> Hashable | None:
        return data


def delivery_log() -> DeliveryLogWriter:
    """The real writer's buffer (nothing is written: `records` reads it back)."""
    return DeliveryLogWriter(
        Path("/nonexistent"),
        file_format="jsonl",
        clock=clock,
        message_id=lambda data: data.decode(),
    )


def records(w: DeliveryLogWriter) -> list[tuple[int, str, str | None, str | None, str | None]]:
    """(seq, event, queue, message-id, consumer) of what the buffer stands for, as the
    files would hold it."""
    batch = w.take_batch()
    if batch is None:
        return []
    rows, seqs = batch.expand()
    return [(q, fmt.EVENTS[r[1]], r[2], r[3], r[7]) for q, r in zip(seqs, rows, strict=True)]


class Router:
    def __init__(self, answer: int | None) -> None:
        self.answer = answer
        self.asked: list[tuple[str, bytes]] = []

    def route(self, a: Address, e: Entry, done: Callable[[int | BrokerError], None]) -> int | None:
        self.asked.append((a.name, e.data))
        return self.answer

    def prepare(
        self, a: Address, e: Entry, done: Callable[[int | BrokerError], None]
    ) -> int | None:
        self.asked.append(("prepare " + a.name, e.data))
        return self.answer

    def route_committed(self, a: Address, e: Entry) -> int | None:
        self.asked.append(("committed " + a.name, e.data))
        return self.answer


def make_broker(**settings: object) -> Broker:
    repo = AddressSettingsRepository({"#": AddressSettings(**settings)})  # type: ignore[arg-type]
    return Broker(address_settings=repo, clock=clock, codec=IdCodec())


def noop(res: int | BrokerError) -> None:
    pass


def test_expiry_from_ttl_or_absolute_time_whichever_is_earlier() -> None:
    assert message_expiry(clock, 0, 0) == 0
    assert message_expiry(clock, 500, 0) == NOW_MS + 500
    assert message_expiry(clock, 0, NOW_MS + 9) == NOW_MS + 9
    assert message_expiry(clock, 500, NOW_MS + 9) == NOW_MS + 9
    assert message_expiry(clock, 5, NOW_MS + 900) == NOW_MS + 5


def test_delivery_delay_relative_wins_over_absolute_time() -> None:
    assert delivery_time(clock, 123, 50) == NOW_MS + 50
    assert delivery_time(clock, 123, 0) == 123


def test_routed_to_the_one_queue_sync_only_when_durable() -> None:
    b = make_broker()
    a = b.address_for_producer("orders")
    assert accept(b, a, Entry(b"x", durable=True), b"x") == ROUTED_SYNC
    assert accept(b, a, Entry(b"y"), b"y") == ROUTED
    assert a.queues[0].count == 2
    assert b.routed == 2


def test_topic_without_subscribers_is_no_route() -> None:
    b = make_broker()
    a = b.create_address("news", MULTICAST)
    assert accept(b, a, Entry(b"x"), b"x") == NO_ROUTE
    assert b.dropped_no_route == 1


def test_duplicate_dropped_but_a_transactional_send_is_not_checked() -> None:
    b = make_broker(duplicate_detection_window=10)
    a = b.address_for_producer("orders")
    assert accept(b, a, Entry(b"x"), b"x") == ROUTED
    assert accept(b, a, Entry(b"x"), b"x") == DUPLICATE
    assert accept(b, a, Entry(b"x"), b"x", transactional=True) == ENLIST
    assert a.queues[0].count == 1
    assert b.duplicates_dropped == 1


def test_received_is_logged_for_routed_and_transactional_sends_not_duplicates() -> None:
    b = make_broker(duplicate_detection_window=10)
    w = b.dlog = delivery_log()
    a = b.address_for_producer("orders")
    accept(b, a, Entry(b"x"), b"x")
    accept(b, a, Entry(b"x"), b"x")
    accept(b, a, Entry(b"t"), b"t", transactional=True)
    assert records(w) == [
        (1, "received", "orders", "x", None),
        (2, "routed", "orders", "x", None),
        (3, "received", "orders", "t", None),  # routed at commit
    ]


def test_an_arrival_taken_at_once_is_one_buffered_record_standing_for_its_three() -> None:
    """The common arrival holds its received record and folds it with routed and
    dispatched: one buffered record, expanded to the same records as one call per
    event would write (consecutive seqs, one time)."""
    b = make_broker()
    w = b.dlog = delivery_log()
    a = b.address_for_producer("orders")
    q = a.queues[0]
    accept(b, a, Entry(b"m1"), b"m1")  # no consumer: received + routed
    c = FakeConsumer("c1", clock)
    c.credit = 2
    q.add_consumer(c)
    q.credit_changed(c)  # m1 goes out: dispatched, its own record
    accept(b, a, Entry(b"m2"), b"m2")  # out at once: one record for three
    accept(b, a, Entry(b"m3"), b"m3")  # no credit left: received + routed
    assert w._buf[1::FIELDS] == [
        dl.RECEIVED_ROUTED,
        dl.DISPATCHED,
        dl.RECEIVED_DISPATCHED,
        dl.RECEIVED_ROUTED,
    ]
    assert w.statistics()["seq"] == 8
    assert records(w) == [
        (1, "received", "orders", "m1", None),
        (2, "routed", "orders", "m1", None),
        (3, "dispatched", "orders", "m1", "conn-c1/c1"),
        (4, "received", "orders", "m2", None),
        (5, "routed", "orders", "m2", None),
        (6, "dispatched", "orders", "m2", "conn-c1/c1"),
        (7, "received", "orders", "m3", None),
        (8, "routed", "orders", "m3", None),
    ]
    # the next batch goes on after the records the folded ones stood for
    accept(b, a, Entry(b"m4"), b"m4")
    assert records(w)[0][0] == 9


def test_a_held_received_record_is_recorded_before_any_other_event() -> None:
    w = delivery_log()
    e1, e2 = Entry(b"e1"), Entry(b"e2")
    w.held, w.held_queue = e1, "q"
    w.event(dl.EXPIRED, "q", e2)  # another message's event: e1's comes first
    w.held = e1
    w.event(dl.SETTLED, "q", e1, None, dl.ACCEPTED)  # its own, not a dispatch
    w.held = e2
    w.marker(dl.UNBOUND, "n/q", "g")
    assert [(r[1], r[3]) for r in records(w)] == [
        ("received", "e1"),
        ("routed", "e1"),
        ("expired", "e2"),
        ("received", "e1"),
        ("routed", "e1"),
        ("settled", "e1"),
        ("received", "e2"),
        ("routed", "e2"),
        ("unbound", None),
    ]
    assert w.held is None


def test_a_queue_not_named_as_its_address_is_not_folded() -> None:
    b = make_broker()
    w = b.dlog = delivery_log()
    a = b.create_address("news", MULTICAST)
    b.create_queue("sub1", "news", MULTICAST, durable=False)
    accept(b, a, Entry(b"n1"), b"n1")
    assert w._buf[1::FIELDS] == [dl.RECEIVED, dl.ROUTED]
    assert [(r[1], r[2]) for r in records(w)] == [("received", "news"), ("routed", "sub1")]


def test_transactional_send_gets_a_deleted_queue_back_or_not_found() -> None:
    b = make_broker()
    a = b.address_for_producer("orders")
    a.producers += 1  # a producer holds the address while its queue is deleted
    b.delete_queue(a.queues[0])
    assert accept(b, a, Entry(b"t"), b"t", transactional=True) == ENLIST
    assert a.queues and a.queues[0].name == "orders"
    strict = make_broker(auto_create_queues=False)
    s = strict.create_address("jobs", ANYCAST)
    s.producers += 1
    strict.delete_queue(s.queues[0])
    try:
        accept(strict, s, Entry(b"t"), b"t", transactional=True)
    except NotFound:
        pass
    else:
        raise AssertionError("expected NotFound")


def test_router_asked_only_with_a_completion() -> None:
    b = make_broker()
    a = b.address_for_producer("orders")
    r = Router(PENDING)
    b.router = r
    assert accept(b, a, Entry(b"x"), b"x", done=noop) == PENDING
    assert r.asked == [("orders", b"x")]
    assert a.queues[0].count == 0
    # no completion (a bridge's messages were routed already): routed here
    assert accept(b, a, Entry(b"y"), b"y") == ROUTED
    r.answer = None  # the router leaves it to the broker
    assert accept(b, a, Entry(b"z"), b"z", done=noop) == ROUTED
    assert a.queues[0].count == 2
    r.answer = ROUTED_SYNC  # the router routed it itself
    assert accept(b, a, Entry(b"w"), b"w", done=noop) == ROUTED_SYNC
    assert a.queues[0].count == 2


def test_a_grouped_transactional_send_waits_for_its_groups_decision() -> None:
    b = make_broker()
    a = b.address_for_producer("orders")
    r = Router(PENDING)
    b.router = r
    # grouped: the router decides the group first (PENDING, then done(ENLIST))
    assert accept(b, a, Entry(b"g", group_id="g"), b"g", True, noop) == PENDING
    # ungrouped, or no completion: enlisted at once, the router not asked
    assert accept(b, a, Entry(b"u"), b"u", True, noop) == ENLIST
    assert accept(b, a, Entry(b"n", group_id="g"), b"n", True) == ENLIST
    r.answer = None  # the group is decided already
    assert accept(b, a, Entry(b"h", group_id="g"), b"h", True, noop) == ENLIST
    assert r.asked == [("prepare orders", b"g"), ("prepare orders", b"h")]
    assert a.queues[0].count == 0  # nothing routed before the commit


def test_full_address_under_fail_policy_refuses() -> None:
    b = make_broker(max_size_bytes=1, address_full_policy="FAIL")
    a = b.address_for_producer("orders")
    assert accept(b, a, Entry(b"xx"), b"xx") == ROUTED
    try:
        accept(b, a, Entry(b"yy"), b"yy")
    except ResourceLimitExceeded as exc:
        assert exc.condition == "amqp:resource-limit-exceeded"
    else:
        raise AssertionError("expected ResourceLimitExceeded")
