"""An anycast address whose queue an operator deleted (issue 24), over real sockets.

A producer link keeps its address alive after a management DELETE of the queue. Where
the address settings auto-create addresses and queues, the next send (on that link, a
new one or the anonymous relay) or consumer attach gives the address its queue back;
where they do not, each send is rejected with amqp:not-found naming the address and a
consumer attach is refused. Never is a message answered `accepted` into nothing.
Multicast keeps its rule: a topic without subscribers accepts and keeps nothing.
"""

from __future__ import annotations

from typing import Any

from proton import Delivery, Message

from amqbroker.app import BrokerApp
from amqbroker.core.broker import Broker
from tests.client import (
    Client,
    ClientError,
    Sender,
    coordinator,
    declare,
    discharge,
    roundtrip,
    txn_send_many,
)
from tests.conftest import BrokerFactory, ClientFactory
from tests.integration import mgmt
from tests.integration.groups_helpers import assert_idle, take

Q = "org.amqbroker.queue"


def core(app: BrokerApp) -> Broker:
    assert app.broker is not None
    return app.broker


async def delete_queue(admin: Client, app: BrokerApp, name: str) -> None:
    """The operator's act: DELETE type queue, force true (answered 204); the address
    stays because a producer still holds it."""
    ans = await mgmt.request(admin, "DELETE", name, type=Q, force=True)
    assert (ans.status, ans.body) == (204, {}), ans.description
    assert name not in core(app).queues
    assert name in core(app).addresses


async def accepted(s: Sender, body: str, to: str | None = None) -> None:
    d = await s.send(Message(body=body, address=to))
    assert d.remote_state == Delivery.ACCEPTED, (body, d.remote_state, d.remote.condition)


async def not_found(s: Sender, body: str, address: str, to: str | None = None) -> None:
    d = await s.send(Message(body=body, address=to))
    assert d.remote_state == Delivery.REJECTED, (body, d.remote_state)
    cond = d.remote.condition
    assert cond is not None and cond.name == "amqp:not-found", cond
    assert f"'{address}'" in (cond.description or ""), cond.description


async def test_auto_create_gives_the_queue_back_on_send_and_attach(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker()
    admin = await client(app)
    p = await client(app)
    old = await p.sender("qd")
    await accepted(old, "before")
    await delete_queue(admin, app, "qd")

    # the sender link attached before the delete
    await accepted(old, "old link")
    q = core(app).queues["qd"]
    assert (q.count, q.auto_created, q.address) == (1, True, core(app).addresses["qd"])

    # a new sender link
    await delete_queue(admin, app, "qd")
    new = await p.sender("qd")
    await accepted(new, "new link")
    assert core(app).queues["qd"].count == 1
    await new.close()

    # the anonymous relay (per-message `to`), presettled and unsettled
    await delete_queue(admin, app, "qd")
    relay = await p.sender(None)
    await accepted(relay, "relay", to="qd")
    assert core(app).queues["qd"].count == 1
    await delete_queue(admin, app, "qd")
    pre = await p.sender(None, presettled=True)
    await pre.send(Message(body="relay presettled", address="qd"))
    await roundtrip(p)
    assert core(app).queues["qd"].count == 1

    # a consumer attaching to the address gets the queue back
    await delete_queue(admin, app, "qd")
    c = await client(app)
    r = await c.receiver("qd", credit=10)
    assert core(app).queues["qd"].consumer_count == 1
    await accepted(old, "to the consumer")
    await accepted(relay, "by relay", to="qd")
    assert await take(r, 2) == ["to the consumer", "by relay"]
    await assert_idle(app, admin, p, c)


async def test_without_auto_create_a_send_is_rejected_naming_the_address(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(
        address_settings={"fixed.#": {"auto_create_queues": False}},
        addresses=[{"name": "fixed.q", "routing": "anycast"}],
    )
    admin = await client(app)
    p = await client(app)
    old = await p.sender("fixed.q")
    await accepted(old, "before")
    await delete_queue(admin, app, "fixed.q")
    routed = core(app).routed

    await not_found(old, "old link", "fixed.q")
    await not_found(old, "old link again", "fixed.q")  # the link stays usable
    new = await p.sender("fixed.q")
    await not_found(new, "new link", "fixed.q")
    relay = await p.sender(None)
    await not_found(relay, "relay", "fixed.q", to="fixed.q")
    # a transactional send is refused when it is enlisted, not dropped at commit
    coord = await coordinator(p)
    txn = await declare(coord)
    (d,) = await txn_send_many(new, [Message(body="in txn")], txn)
    assert d.remote_state == Delivery.REJECTED
    assert d.remote.condition is not None and d.remote.condition.name == "amqp:not-found"
    assert (await discharge(coord, txn)).remote_state == Delivery.ACCEPTED
    assert "fixed.q" not in core(app).queues
    assert core(app).routed == routed

    # a consumer attach is refused as before
    c = await client(app)
    try:
        await c.receiver("fixed.q", credit=1)
        raise AssertionError("the attach to an address without queue was accepted")
    except ClientError as exc:
        assert "amqp:not-found" in str(exc) and "'fixed.q' has no queue" in str(exc)

    # the operator creates the queue again: sends are accepted and kept
    ans = await mgmt.request(admin, "CREATE", "fixed.q", type=Q, body={"address": "fixed.q"})
    assert ans.status == 201, ans.description
    await accepted(old, "after create")
    await accepted(relay, "relay after create", to="fixed.q")
    r = await c.receiver("fixed.q", credit=10)
    assert await take(r, 2) == ["after create", "relay after create"]
    await assert_idle(app, admin, p, c)


async def test_queue_deleted_between_enlist_and_commit_is_dropped_not_fatal(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(
        address_settings={"fixed.#": {"auto_create_queues": False}},
        addresses=[{"name": "fixed.t", "routing": "anycast"}],
    )
    admin = await client(app)
    p = await client(app)
    s = await p.sender("fixed.t")
    coord = await coordinator(p)
    txn = await declare(coord)
    (d,) = await txn_send_many(s, [Message(body="in txn")], txn)
    assert d.remote_state is not None
    await delete_queue(admin, app, "fixed.t")
    dropped = core(app).dropped_no_route
    assert (await discharge(coord, txn)).remote_state == Delivery.ACCEPTED
    assert core(app).dropped_no_route == dropped + 1
    assert "fixed.t" not in core(app).queues
    await not_found(s, "after", "fixed.t")
    await assert_idle(app, admin, p)


async def test_relay_rejects_a_queueless_anycast_address_and_drops_for_a_lonely_topic(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(
        address_settings={"fixed.#": {"auto_create_queues": False}},
        addresses=[{"name": "fixed.r", "routing": "anycast"}],
    )
    admin = await client(app)
    p = await client(app)
    held = await p.sender("fixed.r")
    topic = await p.sender("news", capabilities=["topic"])
    await delete_queue(admin, app, "fixed.r")
    relay = await p.sender(None)
    await not_found(relay, "to the queue", "fixed.r", to="fixed.r")
    # multicast keeps its rule: no subscriber, accepted and kept nowhere
    dropped = core(app).dropped_no_route
    await accepted(relay, "to the topic", to="news")
    await accepted(topic, "on the topic link")
    assert core(app).dropped_no_route == dropped + 2
    assert not core(app).addresses["news"].queues
    await not_found(held, "on the held link", "fixed.r")
    await assert_idle(app, admin, p)


async def test_dead_letters_give_a_held_dead_letter_address_its_queue_back(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"dl.#": {"dead_letter_address": "DLQ"}})
    admin = await client(app)
    p = await client(app)
    held = await p.sender("DLQ")  # a producer holds the dead-letter address
    s = await p.sender("dl.q")
    await accepted(s, "doomed")
    await delete_queue(admin, app, "DLQ")
    c = await client(app)
    r = await c.receiver("dl.q", credit=1)
    r.reject(await r.receive())
    await roundtrip(c)
    assert core(app).queues["DLQ"].count == 1
    assert core(app).dropped_dead_letters == 0
    d = await c.receiver("DLQ", credit=1)
    assert await take(d, 1) == ["doomed"]
    await held.close()
    await assert_idle(app, admin, p, c)
