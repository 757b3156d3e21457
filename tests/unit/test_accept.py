"""The core's accept policy (`amqbroker.core.accept`), without a protocol layer."""

from __future__ import annotations

from collections.abc import Callable, Hashable

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

T0 = 1_700_000_000.0
NOW_MS = int(T0 * 1000)


def clock() -> float:
    return T0


class IdCodec(PlainCodec):
    """The message bytes are their own duplicate id."""

    def duplicate_id(self, data: bytes) -> Hashable | None:
        return data


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[int, str | None, bytes]] = []

    def event(self, event: int, queue: str | None, entry: Entry, *_: object) -> None:
        self.events.append((event, queue, entry.data))


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
    log = Log()
    b.dlog = log  # type: ignore[assignment]
    a = b.address_for_producer("orders")
    accept(b, a, Entry(b"x"), b"x")
    accept(b, a, Entry(b"x"), b"x")
    accept(b, a, Entry(b"t"), b"t", transactional=True)
    received = [(q, d) for ev, q, d in log.events if ev == 0]
    assert received == [("orders", b"x"), ("orders", b"t")]


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
