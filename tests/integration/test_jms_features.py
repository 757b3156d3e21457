"""The JMS feature surface over real sockets with the Proton engine client: connection
capabilities and sole-connection-for-container, selectors and no-local, durable and
shared subscriptions, queue browsers, temporary topics, delayed delivery, drain and
the terminus echo. (Transactions: test_transactions.py; Qpid JMS itself:
test_jms_interop.py; rhea: test_rhea_interop.py.)

Time-dependent checks (delivery delay) run on trio's autojump clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio
from proton import Data, Link, Message, Terminus, symbol, timestamp

from amqbroker.app import BrokerApp
from tests.client import Client, ClientError, Received, Receiver
from tests.conftest import ConnectFactory, StoppableFactory

SELECTOR = 0x0000468C00000004
NO_LOCAL = 0x0000468C00000003


def selector(text: str, *, no_local: bool = False) -> Callable[[Link], None]:
    def configure(link: Link) -> None:
        f: Data = link.source.filter
        f.put_map()
        f.enter()
        f.put_symbol("jms-selector")
        f.put_described()
        f.enter()
        f.put_ulong(SELECTOR)
        f.put_string(text)
        f.exit()
        if no_local:
            _put_no_local(f)
        f.exit()

    return configure


def _put_no_local(f: Data) -> None:
    f.put_symbol("no-local")
    f.put_described()
    f.enter()
    f.put_ulong(NO_LOCAL)
    f.put_list()
    f.exit()


def no_local_only(link: Link) -> None:
    f: Data = link.source.filter
    f.put_map()
    f.enter()
    _put_no_local(f)
    f.exit()


def durable(link: Link) -> None:
    link.source.durability = Terminus.DELIVERIES
    link.source.expiry_policy = Terminus.EXPIRE_NEVER
    link.source.distribution_mode = Terminus.DIST_MODE_COPY


def both(*fs: Callable[[Link], None]) -> Callable[[Link], None]:
    def configure(link: Link) -> None:
        for f in fs:
            f(link)

    return configure


def browse(link: Link) -> None:
    link.source.distribution_mode = Terminus.DIST_MODE_COPY


def msg(body: Any, **props: Any) -> Message:
    return Message(body=body, properties=props or None)


def bodies(rs: list[Received]) -> list[Any]:
    return [r.body for r in rs]


async def take(r: Receiver, n: int) -> list[Any]:
    got = await r.receive_n(n)
    for x in got:
        r.accept(x)
    return bodies(got)


# ------------------------------------------------------------------- connection


async def test_offered_capabilities(connect: ConnectFactory) -> None:
    c = await connect()
    caps = set(c.offered_capabilities)
    assert {"ANONYMOUS-RELAY", "DELAYED_DELIVERY", "SHARED-SUBS"} <= caps


async def test_sole_connection_for_container(connect: ConnectFactory) -> None:
    first = await connect(container="client-1", desired=["sole-connection-for-container"])
    with pytest.raises(ClientError) as err:
        await connect(container="client-1", desired=["sole-connection-for-container"])
    assert "amqp:invalid-field" in str(err.value)
    assert "client-1" in str(err.value)
    # the first connection keeps working; once it is gone the id is free again
    s = await first.sender("sole.q")
    await s.send(msg("still here"))
    await first.close()
    again = await connect(container="client-1", desired=["sole-connection-for-container"])
    r = await again.receiver("sole.q", credit=1)
    assert await take(r, 1) == ["still here"]


async def test_sole_connection_refusal_carries_the_field(connect: ConnectFactory) -> None:
    """Qpid JMS turns exactly this into InvalidClientIDException."""
    await connect(container="client-2", desired=["sole-connection-for-container"])
    with pytest.raises(ClientError) as err:
        await connect(container="client-2", desired=["sole-connection-for-container"])
    cond = err.value.condition
    assert cond.name == "amqp:invalid-field"
    assert cond.info == {symbol("invalid-field"): symbol("container-id")}


async def test_same_container_without_the_capability_is_allowed(connect: ConnectFactory) -> None:
    await connect(container="shared-id")
    await connect(container="shared-id")


# ----------------------------------------------------------------------- echo


async def test_source_and_target_echo_address_with_options(connect: ConnectFactory) -> None:
    c = await connect()
    addr = "echo.q?group-first-key=JMSXGroupFirstForConsumer"
    r = await c.receiver(addr, credit=5)
    assert r.link.remote_source.address == addr
    s = await c.sender(addr)
    assert s.link.remote_target.address == addr
    await s.send(Message(body="x", group_id="g"))
    got = await r.receive()
    # the option still applies
    assert got.properties.get("JMSXGroupFirstForConsumer") is True


def _blocking_receiver_with_options(port: int) -> list[Any]:
    from proton.utils import BlockingConnection

    conn = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=10)
    try:
        addr = "blocking.opts?group-first-key=JMSXGroupFirstForConsumer"
        rcv = conn.create_receiver(addr, credit=10)
        snd = conn.create_sender(addr)
        snd.send(Message(body="b", group_id="g1"))
        m = rcv.receive(timeout=10)
        rcv.accept()
        return [m.body, (m.properties or {}).get("JMSXGroupFirstForConsumer")]
    finally:
        conn.close()


async def test_blocking_connection_receiver_on_address_with_options(port: int) -> None:
    got = await trio.to_thread.run_sync(_blocking_receiver_with_options, port)
    assert got == ["b", True]


# ------------------------------------------------------------------ selectors


async def test_selector_on_queue_consumer(connect: ConnectFactory) -> None:
    c = await connect()
    red = await c.receiver("sel.q", credit=10, configure=selector("color = 'red' AND weight > 10"))
    s = await c.sender("sel.q")
    for i, (color, weight) in enumerate([("red", 5), ("red", 20), ("blue", 30), ("red", 11)]):
        await s.send(msg(i, color=color, weight=weight))
    assert await take(red, 2) == [1, 3]
    await red.expect_none(0.5)
    rest = await c.receiver("sel.q", credit=10)
    assert await take(rest, 2) == [0, 2]


async def test_selector_on_group_fields(connect: ConnectFactory) -> None:
    c = await connect()
    r = await c.receiver(
        "sel.g", credit=10, configure=selector("JMSXGroupID LIKE 'a%' AND JMSXGroupSeq > 1")
    )
    s = await c.sender("sel.g")
    for gid, seq in [("a1", 1), ("a1", 2), ("b1", 2), ("a2", 3)]:
        await s.send(Message(body=f"{gid}/{seq}", group_id=gid, group_sequence=seq))
    # a1/2 matches but must not overtake a1/1, which this consumer does not take
    assert await take(r, 1) == ["a2/3"]
    await r.expect_none(0.5)
    rest = await c.receiver("sel.g", credit=10)
    got = await take(rest, 3)
    assert got.index("a1/1") < got.index("a1/2") and "b1/2" in got


async def test_invalid_selector_is_refused_with_its_place(connect: ConnectFactory) -> None:
    c = await connect()
    r = await c.receiver("sel.bad", configure=selector("color = = 'red'"), wait=False)
    with pytest.raises(ClientError):
        await r.wait_open()
    cond = r.remote_condition
    assert cond is not None and cond.name == "amqp:invalid-field"
    assert "position" in cond.description
    # the connection keeps working
    ok = await c.receiver("sel.bad", credit=1)
    s = await c.sender("sel.bad")
    await s.send(msg("fine"))
    assert await take(ok, 1) == ["fine"]


async def test_unmatched_message_does_not_block_others(connect: ConnectFactory) -> None:
    c = await connect()
    only_b = await c.receiver("sel.hol", credit=10, configure=selector("kind = 'b'"))
    s = await c.sender("sel.hol")
    await s.send(msg("a0", kind="a"))
    await s.send(msg("b0", kind="b"))
    await s.send(msg("b1", kind="b"))
    assert await take(only_b, 2) == ["b0", "b1"]


async def test_selectors_and_groups(connect: ConnectFactory) -> None:
    """Two consumers with disjoint selectors: each group's messages reach one of them,
    in order."""
    c = await connect()
    left = await c.receiver("sel.groups", credit=100, configure=selector("side = 'L'"))
    right = await c.receiver("sel.groups", credit=100, configure=selector("side = 'R'"))
    s = await c.sender("sel.groups")
    for i in range(5):
        for g, side in (("gl", "L"), ("gr", "R")):
            await s.send(Message(body=f"{g}{i}", group_id=g, properties={"side": side}))
    assert await take(left, 5) == [f"gl{i}" for i in range(5)]
    assert await take(right, 5) == [f"gr{i}" for i in range(5)]


async def test_selector_on_topic_subscription(connect: ConnectFactory) -> None:
    c = await connect()
    sub = await c.receiver(
        "sel.topic", credit=10, capabilities=["topic"], configure=selector("n >= 2")
    )
    s = await c.sender("sel.topic", capabilities=["topic"])
    for i in range(4):
        await s.send(msg(i, n=i))
    assert await take(sub, 2) == [2, 3]
    await sub.expect_none(0.5)


# -------------------------------------------------------------------- no-local


async def test_no_local_topic_subscriber(connect: ConnectFactory) -> None:
    me = await connect()
    other = await connect()
    local = await me.receiver(
        "nl.topic", credit=10, capabilities=["topic"], configure=no_local_only
    )
    plain = await me.receiver("nl.topic", credit=10, capabilities=["topic"])
    mine = await me.sender("nl.topic", capabilities=["topic"])
    theirs = await other.sender("nl.topic", capabilities=["topic"])
    await mine.send(msg("from me"))
    await theirs.send(msg("from other"))
    assert await take(local, 1) == ["from other"]
    await local.expect_none(0.5)
    assert sorted(await take(plain, 2)) == ["from me", "from other"]


# ------------------------------------------------------ durable subscriptions


async def test_durable_subscription_detach_keeps_close_removes(connect: ConnectFactory) -> None:
    c = await connect(container="jms-client")
    pub = await c.sender("news", capabilities=["topic"])
    sub = await c.receiver(
        "news", name="mysub", credit=10, capabilities=["topic"], configure=durable
    )
    await pub.send(msg("m0"))
    assert await take(sub, 1) == ["m0"]
    await sub.detach()
    await pub.send(msg("m1"))
    await pub.send(msg("m2"))
    sub = await c.receiver(
        "news", name="mysub", credit=10, capabilities=["topic"], configure=durable
    )
    assert await take(sub, 2) == ["m1", "m2"]
    await sub.close()  # unsubscribe
    await pub.send(msg("m3"))
    sub = await c.receiver(
        "news", name="mysub", credit=10, capabilities=["topic"], configure=durable
    )
    await sub.expect_none(0.5)


async def test_unsubscribe_by_link_name(connect: ConnectFactory, broker: BrokerApp) -> None:
    c = await connect(container="jms-unsub")
    sub = await c.receiver(
        "unsub.t", name="s1", credit=1, capabilities=["topic"], configure=durable
    )
    await sub.detach()
    assert "jms-unsub.s1" in broker.broker.queues
    # Qpid JMS: attach by name with no source, then close
    u = await c.receiver(None, name="s1")
    assert u.link.remote_source.address == "unsub.t"
    await u.close()
    assert "jms-unsub.s1" not in broker.broker.queues
    missing = await c.receiver(None, name="nope", wait=False)
    with pytest.raises(ClientError):
        await missing.wait_open()
    assert missing.remote_condition.name == "amqp:not-found"


async def test_durable_subscription_with_selector(connect: ConnectFactory) -> None:
    c = await connect(container="jms-sel")
    sub = await c.receiver(
        "sel.news",
        name="only-big",
        credit=10,
        capabilities=["topic"],
        configure=both(durable, selector("size > 5")),
    )
    await sub.detach()
    pub = await c.sender("sel.news", capabilities=["topic"])
    for i in (1, 10, 3, 7):
        await pub.send(msg(i, size=i))
    sub = await c.receiver(
        "sel.news",
        name="only-big",
        credit=10,
        capabilities=["topic"],
        configure=both(durable, selector("size > 5")),
    )
    assert await take(sub, 2) == [10, 7]


async def test_second_consumer_on_nonshared_durable_is_refused(connect: ConnectFactory) -> None:
    c = await connect(container="jms-one")
    await c.receiver("one.t", name="s", credit=1, capabilities=["topic"], configure=durable)
    r = await c.receiver("one.t", name="s", capabilities=["topic"], configure=durable, wait=False)
    with pytest.raises(ClientError):
        await r.wait_open()


# ------------------------------------------------------- shared subscriptions


async def test_shared_volatile_subscription(connect: ConnectFactory) -> None:
    a = await connect(container="shared-c")
    b = await connect(container="shared-c2")
    caps = ["topic", "shared", "global"]
    r1 = await a.receiver("shared.t", name="work|global-volatile1", credit=100, capabilities=caps)
    r2 = await b.receiver("shared.t", name="work|global-volatile2", credit=100, capabilities=caps)
    pub = await a.sender("shared.t", capabilities=["topic"])
    for i in range(10):
        await pub.send(msg(i))
    got: list[Any] = []
    with trio.move_on_after(2):
        while len(got) < 10:
            for r in (r1, r2):
                while r.queue:
                    x = r.queue.popleft()
                    r.accept(x)
                    got.append(x.body)
            await trio.sleep(0.01)
    assert sorted(got) == list(range(10))
    assert r1.credit < 100 and r2.credit < 100  # both took some


async def test_shared_durable_subscription_survives_consumers(connect: ConnectFactory) -> None:
    c = await connect(container="sd")
    caps = ["topic", "shared"]
    r1 = await c.receiver("sd.t", name="jobs", credit=10, capabilities=caps, configure=durable)
    pub = await c.sender("sd.t", capabilities=["topic"])
    await r1.detach()
    await pub.send(msg("kept"))
    r2 = await c.receiver("sd.t", name="jobs|2", credit=10, capabilities=caps, configure=durable)
    assert await take(r2, 1) == ["kept"]


# ----------------------------------------------------------------- browsers


async def test_queue_browser_sees_without_consuming(connect: ConnectFactory) -> None:
    c = await connect()
    s = await c.sender("browse.q")
    for i in range(5):
        await s.send(msg(i, even=i % 2 == 0))
    b = await c.receiver("browse.q", credit=100, configure=browse)
    seen = await b.receive_n(5)
    assert bodies(seen) == [0, 1, 2, 3, 4]
    await b.drain()  # the end of the browse completes a drain at once
    sel = await c.receiver("browse.q", credit=100, configure=both(browse, selector("even")))
    assert bodies(await sel.receive_n(3)) == [0, 2, 4]
    r = await c.receiver("browse.q", credit=10)
    assert await take(r, 5) == [0, 1, 2, 3, 4]


# ------------------------------------------------------------ temporary topic


async def test_temporary_topic(connect: ConnectFactory, broker: BrokerApp) -> None:
    c = await connect()
    creator = await c.sender(None, dynamic=True, capabilities=["temporary-topic"])
    name = creator.link.remote_target.address
    assert name and broker.broker.addresses[name].routing == "multicast"
    r1 = await c.receiver(name, credit=5, capabilities=["temporary-topic"])
    r2 = await c.receiver(name, credit=5, capabilities=["temporary-topic"])
    s = await c.sender(name)
    await s.send(msg("both"))
    assert await take(r1, 1) == ["both"]
    assert await take(r2, 1) == ["both"]
    await creator.close()
    assert name not in broker.broker.addresses


async def test_relay_creates_topic_from_jms_dest(
    connect: ConnectFactory, broker: BrokerApp
) -> None:
    c = await connect()
    relay = await c.sender(None)
    m = Message(body="t", address="relay.topic")
    m.annotations = {symbol("x-opt-jms-dest"): _byte(1)}
    await relay.send(m)
    assert broker.broker.addresses["relay.topic"].routing == "multicast"


def _byte(v: int) -> Any:
    from proton import byte

    return byte(v)


# ----------------------------------------------------------- delayed delivery


def _delayed(body: Any, at_ms: int, **kw: Any) -> Message:
    m = Message(body=body, **kw)
    m.annotations = {symbol("x-opt-delivery-time"): timestamp(at_ms)}
    return m


async def test_delayed_delivery(
    connect: ConnectFactory, broker: BrokerApp, autojump_clock: Any
) -> None:
    c = await connect()
    r = await c.receiver("delay.q", credit=10)
    s = await c.sender("delay.q")
    now = int(broker.clock() * 1000)
    await s.send(_delayed("later", now + 5000))
    await s.send(msg("now"))
    assert await take(r, 1) == ["now"]
    await r.expect_none(4.0)
    assert await take(r, 1) == ["later"]


async def test_delayed_grouped_message_is_not_overtaken(
    connect: ConnectFactory, broker: BrokerApp, autojump_clock: Any
) -> None:
    c = await connect()
    r = await c.receiver("delay.g", credit=10)
    s = await c.sender("delay.g")
    now = int(broker.clock() * 1000)
    await s.send(_delayed("g1", now + 3000, group_id="g"))
    await s.send(Message(body="g2", group_id="g"))
    await s.send(Message(body="other", group_id="h"))
    assert await take(r, 1) == ["other"]
    await r.expect_none(2.0)
    assert await take(r, 2) == ["g1", "g2"]


async def test_delivery_delay_relative(
    connect: ConnectFactory, broker: BrokerApp, autojump_clock: Any
) -> None:
    c = await connect()
    r = await c.receiver("delay.rel", credit=10)
    s = await c.sender("delay.rel")
    m = Message(body="rel")
    m.annotations = {symbol("x-opt-delivery-delay"): 2000}
    await s.send(m)
    await r.expect_none(1.5)
    assert await take(r, 1) == ["rel"]


# -------------------------------------------------------------------- drain


async def test_drain_on_empty_queue_completes(connect: ConnectFactory) -> None:
    c = await connect()
    r = await c.receiver("drain.q", credit=10)
    with trio.fail_after(2):
        await r.drain()
    assert r.credit == 0


async def test_prefetch_zero_one_credit_at_a_time(connect: ConnectFactory) -> None:
    c = await connect()
    s = await c.sender("p0.q")
    for i in range(3):
        await s.send(msg(i))
    r = await c.receiver("p0.q")
    got = []
    for _ in range(3):
        r.flow(1)
        x = await r.receive()
        r.accept(x)
        got.append(x.body)
        await r.drain()
    assert got == [0, 1, 2]
    r.flow(1)
    await r.drain()
    assert not r.queue


# ------------------------------------------------------------------ restart


@pytest.fixture
async def restartable(
    stoppable: StoppableFactory,
) -> AsyncIterator[Callable[[], Awaitable[BrokerApp]]]:
    """Start a broker on one data directory; calling again stops the running one
    gracefully and starts a new one on the same data."""
    current: list[tuple[BrokerApp, trio.Event]] = []

    async def restart() -> BrokerApp:
        if current:
            app, done = current.pop()
            app.request_shutdown()
            with trio.fail_after(10):
                await done.wait()
        app, done = await stoppable()
        current.append((app, done))
        return app

    yield restart
    for app, done in current:
        app.request_shutdown()
        with trio.fail_after(10):
            await done.wait()


async def test_durable_subscription_survives_restart(
    restartable: Callable[[], Awaitable[BrokerApp]], nursery: trio.Nursery
) -> None:
    app = await restartable()
    c = await Client.connect(app.listening[0][1], nursery=nursery, container="dur-c")
    sub = await c.receiver(
        "dur.t",
        name="keep",
        credit=1,
        capabilities=["topic"],
        configure=both(durable, selector("k > 0")),
    )
    await sub.detach()
    pub = await c.sender("dur.t", capabilities=["topic"])
    for i in range(4):
        m = msg(i, k=i)
        m.durable = True
        await pub.send(m)
    await c.close()
    app = await restartable()
    c = await Client.connect(app.listening[0][1], nursery=nursery, container="dur-c")
    sub = await c.receiver(
        "dur.t",
        name="keep",
        credit=10,
        capabilities=["topic"],
        configure=both(durable, selector("k > 0")),
    )
    assert await take(sub, 3) == [1, 2, 3]
    # the selector still applies after the restart
    pub = await c.sender("dur.t", capabilities=["topic"])
    await pub.send(msg("zero", k=0))
    await pub.send(msg("one", k=1))
    assert await take(sub, 1) == ["one"]
    await c.close()


async def test_scheduled_message_survives_restart(
    restartable: Callable[[], Awaitable[BrokerApp]], nursery: trio.Nursery, autojump_clock: Any
) -> None:
    app = await restartable()
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    s = await c.sender("sched.q")
    m = _delayed("scheduled", int(app.clock() * 1000) + 60_000)
    m.durable = True
    await s.send(m)
    await c.close()
    app = await restartable()
    assert app.broker.queues["sched.q"].statistics()["scheduled"] == 1
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    r = await c.receiver("sched.q", credit=1)
    await r.expect_none(30)
    x = await r.receive(timeout=60)
    assert x.body == "scheduled"
    r.accept(x)
    await c.close()


async def test_selector_on_delivery_count_sees_redeliveries(connect: ConnectFactory) -> None:
    """JMSXDeliveryCount is the entry's current count, not the one in the stored
    header (the cached fields must not go stale)."""
    c = await connect()
    retry = await c.receiver("sel.dc", credit=5, configure=selector("JMSXDeliveryCount >= 2"))
    s = await c.sender("sel.dc")
    await s.send(msg("m"))
    await retry.expect_none(0.2)  # evaluated (and its fields cached) at count 1
    first = await c.receiver("sel.dc", credit=1)
    got = await first.receive()
    first.modify(got, failed=True)
    again = await retry.receive()
    assert again.body == "m" and again.message.delivery_count == 1
