"""Limits against hostile or careless clients, over real sockets: connections per
client address, the largest message (single-frame and multi-frame paths), and
slow-consumer detection (NOTIFY and KILL).

Every refusal is checked for its AMQP condition and for a description that names the
setting. Time-dependent tests run under trio's autojump clock: consumers that settle at
a given pace sleep in trio time, never in real time.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
from proton import Delivery, Message

from amqbroker.app import BrokerApp
from tests.client import Client, ClientError, Receiver, Sender, roundtrip, wait_until
from tests.conftest import BrokerFactory, ClientFactory, wait_idle
from tests.integration.amqp_wire import CLOSE, CLOSE_CODE, OPEN, OPEN_CODE, error_of, open_raw

# ---------------------------------------------------------- connections per address


async def test_connections_per_address_refused_others_unaffected_map_emptied(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await make_broker(max_connections_per_address=2)
    a1 = await client(app)
    a2 = await client(app)
    with pytest.raises(ClientError) as exc:
        await client(app)
    cond = exc.value.condition  # type: ignore[attr-defined]
    assert cond is not None and cond.name == "amqp:resource-limit-exceeded"
    desc = cond.description or ""
    assert "max_connections_per_address (2)" in desc, desc
    assert "127.0.0.1" in desc, desc
    # another client address (still loopback) is unaffected
    b1 = await client(app, source="127.0.0.2")
    s = await b1.sender("per.addr")
    d = await s.send(Message(body="from b"))
    assert d.remote_state == Delivery.ACCEPTED
    assert app.server.per_address == {"127.0.0.1": 2, "127.0.0.2": 1}
    assert app.statistics()["limits"]["connections_refused_per_address"] == 1
    # a connection that ends makes room for the next one from its address
    await a1.close()
    await wait_until(lambda: app.server.per_address.get("127.0.0.1") == 1)
    a3 = await client(app)
    await roundtrip(a3)
    for c in (a2, a3, b1):
        await c.close()
    sizes = await wait_idle(app)
    assert sizes["connections_per_address"] == 0
    assert app.server.per_address == {}
    assert all(v == 0 for v in sizes.values()), sizes


async def test_connections_per_address_unlimited(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await make_broker(max_connections_per_address=-1, max_connections=5)
    cs = [await client(app) for _ in range(5)]
    assert app.server.per_address == {"127.0.0.1": 5}
    # the broker-wide limit still applies, and names its own setting
    with pytest.raises(ClientError) as exc:
        await client(app)
    assert "max_connections (5)" in str(exc.value)
    for c in cs:
        await c.close()
    assert (await wait_idle(app))["connections_per_address"] == 0


async def test_refused_client_that_keeps_its_socket_open_frees_its_slot(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    """A refused connection stops counting once its refusal is written: a client that
    reads the refusal but never closes its socket (the broker lingers for it up to
    handshake_timeout) does not keep a legitimate client out when a slot frees."""
    app = await make_broker(max_connections=1, handshake_timeout=600)
    a1 = await client(app)
    refused = await open_raw(app.listening[0][1], OPEN)
    try:
        condition, description = error_of(await refused.until(CLOSE_CODE))
        assert condition == "amqp:resource-limit-exceeded"
        assert "max_connections (1)" in description, description
        # the refused socket stays open, the broker lingers on it; the admitted
        # connection ends
        await a1.close()
        await wait_until(lambda: len(app.hub.drivers) == 1)
        a2 = await client(app)
        await roundtrip(a2)
        assert len(app.hub.drivers) == 2  # the refused one still lingers
    finally:
        refused.sock.close()


async def test_closed_connection_left_open_by_its_client_frees_its_address_slot(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    """The same for max_connections_per_address: after the close handshake the
    broker lingers for the client's socket, but no longer counts it."""
    app = await make_broker(max_connections_per_address=1, handshake_timeout=600)
    first = await open_raw(app.listening[0][1], OPEN)
    try:
        await first.until(OPEN_CODE)
        assert app.server.per_address == {"127.0.0.1": 1}
        await first.send(CLOSE)
        assert error_of_or_none(await first.until(CLOSE_CODE)) is None
        c = await client(app)
        await roundtrip(c)
        assert app.server.per_address == {"127.0.0.1": 1}
        assert len(app.hub.drivers) == 2  # the first one still lingers
    finally:
        first.sock.close()


def error_of_or_none(fields: list[Any]) -> tuple[str, str] | None:
    return error_of(fields) if fields and fields[0] is not None else None


# --------------------------------------------------------------- max_message_size


async def test_max_message_size_single_frame_rejected_naming_the_setting(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await make_broker(max_message_size=1000)
    c = await client(app)
    s = await c.sender("size.q")
    d = await s.send(Message(body="x" * 2000))
    assert d.remote_state == Delivery.REJECTED
    cond = d.remote.condition
    assert cond is not None and cond.name == "amqp:link:message-size-exceeded"
    assert "max_message_size (1000 bytes)" in (cond.description or "")
    assert "send smaller messages" in (cond.description or "")
    # the link stays usable for messages that fit
    d = await s.send(Message(body="fits"))
    assert d.remote_state == Delivery.ACCEPTED


async def test_max_message_size_multi_frame_detaches_naming_the_setting(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    # frames of 4 KiB and reads of 4 KiB: the broker sees the message grow past the
    # limit while it is still partial, and stops it without buffering the rest
    app = await make_broker(max_message_size=10_000, max_frame_size=4096, read_buffer_size=4096)
    c = await client(app)
    s = await c.sender("size.q")
    s.send_nowait(Message(body="y" * 200_000))
    await c._flush()
    await c._wait(lambda: s.closed_by_peer, 10)
    cond = s.remote_condition
    assert cond is not None and cond.name == "amqp:link:message-size-exceeded"
    desc = cond.description or ""
    assert "max_message_size (10000 bytes)" in desc, desc
    assert "send smaller messages" in desc
    assert app.broker is not None
    assert app.broker.statistics()["messages"] == 0
    # the connection stays usable
    s2 = await c.sender("size.q")
    d = await s2.send(Message(body="fits"))
    assert d.remote_state == Delivery.ACCEPTED


# ----------------------------------------------------------------- slow consumers

SLOW = {"slow_consumer_threshold": 5, "slow_consumer_check_period": 1.0}


async def fill(c: Client, address: str, n: int) -> Sender:
    s = await c.sender(address)
    ds = await s.send_many([Message(body=f"m{i}") for i in range(n)])
    assert all(d.remote_state == Delivery.ACCEPTED for d in ds)
    return s


async def consume_at(r: Receiver, per_second: float, n: int) -> None:
    """Settle `n` messages, one every 1/per_second seconds (trio time), granting one
    credit for each."""
    for _ in range(n):
        m = await r.receive(timeout=60)
        await trio.sleep(1 / per_second)
        r.accept(m)
        r.flow(1)


def detected(app: BrokerApp) -> int:
    return int(app.statistics()["limits"]["slow_consumers_detected"])


def slow_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "slow consumer" in r.getMessage()]


async def test_consumer_that_does_not_settle_is_reported_once_per_episode(
    make_broker: BrokerFactory,
    client: ClientFactory,
    autojump_clock: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="amqbroker")
    app = await make_broker(**SLOW)
    c = await client(app)
    await fill(c, "slow.q", 30)
    r = await c.receiver("slow.q", credit=10, name="lazy")
    held = await r.receive_n(10)
    await trio.sleep(3.5)  # a baseline, then two periods with work and nothing settled
    assert detected(app) == 1
    lines = slow_lines(caplog)
    assert len(lines) == 1, lines
    assert "'lazy'" in lines[0] and "'slow.q'" in lines[0]
    assert "0.00 message(s)/s" in lines[0]
    assert "slow_consumer_threshold (5 messages/s)" in lines[0]
    assert "NOTIFY" in lines[0]
    assert not r.closed_by_peer  # NOTIFY keeps the consumer
    await trio.sleep(3)
    assert detected(app) == 1  # still the same episode: not reported again
    # it catches up (settles everything, queue drained): the episode ends ...
    for m in held:
        r.accept(m)
    r.flow(10)
    await consume_at(r, 1000, 20)
    await trio.sleep(2.5)
    assert detected(app) == 1
    # ... and a new one starts when it falls behind again
    await fill(c, "slow.q", 20)
    await r.receive_n(10)
    await trio.sleep(3.5)
    assert detected(app) == 2


async def test_slow_consumer_kill_detaches_with_rate_and_setting(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(**SLOW, slow_consumer_policy="KILL")
    c = await client(app)
    await fill(c, "kill.q", 40)
    idle = await c.receiver("kill.empty", credit=10)  # same connection, nothing to do
    r = await c.receiver("kill.q", credit=10)
    await r.receive_n(10)
    await c._wait(lambda: r.closed_by_peer, 10)
    cond = r.remote_condition
    assert cond is not None and cond.name == "amqp:resource-limit-exceeded"
    desc = cond.description or ""
    assert "settled 0.00 message(s)/s" in desc, desc
    assert "slow_consumer_threshold (5 messages/s)" in desc, desc
    assert "slow_consumer_policy = KILL" in desc, desc
    # its unsettled messages are back; the connection and its other link live on
    assert app.broker is not None
    q = app.broker.queues["kill.q"]
    await wait_until(lambda: q.inflight == 0)
    assert q.count == 40
    assert not idle.closed_by_peer and not c.closed_by_peer
    stats = app.statistics()["limits"]
    assert (stats["slow_consumers_detected"], stats["slow_consumers_detached"]) == (1, 1)
    # a new consumer gets the messages back, in order
    r2 = await c.receiver("kill.q", credit=1)
    assert (await r2.receive()).body == "m0"


async def test_fast_consumer_with_backlog_is_not_slow_a_slower_one_is(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(**SLOW)
    c = await client(app)
    await fill(c, "pace.fast", 80)
    await fill(c, "pace.slow", 20)
    fast = await c.receiver("pace.fast", credit=5)
    slow = await c.receiver("pace.slow", credit=5)
    assert app.broker is not None
    qf = app.broker.queues["pace.fast"]
    async with trio.open_nursery() as n:
        n.start_soon(consume_at, fast, 10, 60)  # 6 s at 10/s, the backlog never empties
        n.start_soon(consume_at, slow, 2, 12)  # 6 s at 2/s
    # the fast one was judged (it had work all along) and found fast enough
    (cf,) = qf.consumers()
    assert cf.slow_sample is not None and cf.slow_sample.busy
    assert not cf.slow
    assert detected(app) == 1
    assert not fast.closed_by_peer and not slow.closed_by_peer


async def test_idle_consumer_and_consumer_of_a_slow_producer_are_not_slow(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(**SLOW)
    c = await client(app)
    idle = await c.receiver("idle.q", credit=10)  # an empty queue for 6 periods
    r = await c.receiver("trickle.q", credit=10)
    s = await c.sender("trickle.q")
    assert app.broker is not None
    q = app.broker.queues["trickle.q"]
    (consumer,) = q.consumers()
    await trio.sleep(0.5)
    busy_at_checks = 0

    async def produce() -> None:
        for i in range(8):  # one message a second
            await s.send(Message(body=f"t{i}"))
            await trio.sleep(1)

    async with trio.open_nursery() as n:
        n.start_soon(produce)
        for _ in range(8):
            # holds each message 0.9 s: 0.9 msg/s settled, under the threshold, but
            # it runs out of work after each one, so it is never judged
            m = await r.receive(timeout=10)
            await trio.sleep(0.9)
            smp = consumer.slow_sample
            busy_at_checks += bool(smp is not None and smp.busy)
            r.accept(m)
    await idle.expect_none(2)
    assert detected(app) == 0
    # the checks did see it holding a message: only the idle marks spared it
    assert busy_at_checks >= 3
    assert consumer.idle_marks >= 7


async def test_consumer_without_credit_while_messages_wait_is_slow(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(**SLOW)
    c = await client(app)
    await fill(c, "nocredit.q", 5)
    await c.receiver("nocredit.q", credit=0)
    await trio.sleep(3.5)
    assert detected(app) == 1


async def test_slow_consumer_detection_off_by_default(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker()
    c = await client(app)
    await fill(c, "off.q", 5)
    r = await c.receiver("off.q", credit=5)
    await r.receive_n(5)
    await trio.sleep(60)
    assert app.slow_consumers is None and detected(app) == 0
    assert not r.closed_by_peer
