"""Authorisation over real sockets with SASL PLAIN users: every permission granted and
denied, wildcard precedence, roles, per-message refusal on the anonymous relay, the
management node, temporary nodes, unsubscribe, logging once per link, and security
disabled (the open default).

Users (hashed passwords, cheap iteration count) and their roles:

=======  ===============  ==================================================
user     roles            can
=======  ===============  ==================================================
alice    app              send/consume/create under orders.#, news.#
bob      audit            consume + browse under orders.# (no create, no send)
carol    (none)           nothing
dave     feeder           send/consume under feed.#, but never create there
erin     vip              send to orders.vip only
olga     ops              manage
mona     ops, app         manage, and alice's permissions
=======  ===============  ==================================================
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from proton import Delivery, Link, Message, Terminus

from amqbroker.app import BrokerApp
from amqbroker.core.auth import hash_password
from tests.client import Client, ClientError, Receiver, Sender, roundtrip
from tests.conftest import BrokerFactory, ClientFactory
from tests.integration import mgmt

FAST_ITERATIONS = 1000
PASSWORD = "pw"
USERS = ("alice", "bob", "carol", "dave", "erin", "olga", "mona")
ROLES = {
    "alice": ["app"],
    "bob": ["audit"],
    "dave": ["feeder"],
    "erin": ["vip"],
    "olga": ["ops"],
    "mona": ["ops", "app"],
    "anonymous": ["guest"],
}
SECURITY: dict[str, dict[str, list[str]]] = {
    "orders.#": {
        "send": ["app"],
        "consume": ["app", "audit"],
        "browse": ["audit"],
        "create_address": ["app"],
    },
    # exact beats orders.#, and decides alone: app may not send here
    "orders.vip": {"send": ["vip"], "consume": ["app"], "create_address": ["vip"]},
    "news.#": {"send": ["app"], "consume": ["app"], "create_address": ["app"]},
    "feed.#": {"send": ["feeder"], "consume": ["feeder"]},
    "public.#": {"send": ["guest"], "consume": ["guest"], "create_address": ["guest"]},
    "$management": {"manage": ["ops"]},
}
UNAUTHORIZED = "amqp:unauthorized-access"


def _hashes() -> dict[str, str]:
    h = hash_password(PASSWORD, iterations=FAST_ITERATIONS)
    return dict.fromkeys(USERS, h)


async def start(make_broker: BrokerFactory, *, enabled: bool = True, **kw: Any) -> BrokerApp:
    return await make_broker(
        users=_hashes(),
        roles=ROLES,
        security=SECURITY,
        security_enabled=enabled,
        addresses=[{"name": "feed.existing", "routing": "anycast"}],
        **kw,
    )


async def as_user(client: ClientFactory, app: BrokerApp, user: str) -> Client:
    return await client(app, user=user, password=PASSWORD)


async def refused(link: Sender | Receiver) -> str:
    """The attach was refused with amqp:unauthorized-access; returns the description."""
    with pytest.raises(ClientError):
        await link.wait_open()
    cond = link.remote_condition
    assert cond is not None and cond.name == UNAUTHORIZED, cond
    return str(cond.description)


def browse(link: Link) -> None:
    link.source.distribution_mode = Terminus.DIST_MODE_COPY


def durable(link: Link) -> None:
    link.source.durability = Terminus.DELIVERIES
    link.source.expiry_policy = Terminus.EXPIRE_NEVER
    link.source.distribution_mode = Terminus.DIST_MODE_COPY


def rejected(d: Delivery) -> str:
    """The transfer was rejected with amqp:unauthorized-access; returns the description."""
    assert d.remote_state == Delivery.REJECTED, d.remote_state
    cond = d.remote.condition
    assert cond is not None and cond.name == UNAUTHORIZED, cond
    return str(cond.description)


async def send_ok(s: Sender, body: str, to: str | None = None) -> None:
    d = await s.send(Message(body=body, address=to))
    assert d.remote_state == Delivery.ACCEPTED, d.remote.condition


# ----------------------------------------------------------------- send / consume


async def test_send_granted_and_denied(make_broker: BrokerFactory, client: ClientFactory) -> None:
    app = await start(make_broker)
    alice = await as_user(client, app, "alice")
    await send_ok(await alice.sender("orders.eu"), "o1")

    carol = await as_user(client, app, "carol")
    text = await refused(await carol.sender("orders.eu", wait=False))
    assert "user 'carol' may not send to address 'orders.eu' ('send')" in text
    assert "'orders.#' grants it to roles app" in text
    assert "give 'carol' one of the roles app in [roles]" in text
    # bob holds consume there, not send: the fix names his role and the pattern
    bob = await as_user(client, app, "bob")
    text = await refused(await bob.sender("orders.eu", wait=False))
    assert "grant role 'audit' 'send' on 'orders.#' in [security]" in text
    # the connection stays usable after a refusal
    await send_ok(await alice.sender("orders.eu"), "o2")


async def test_consume_granted_and_denied(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker)
    alice = await as_user(client, app, "alice")
    await send_ok(await alice.sender("orders.eu"), "o1")
    bob = await as_user(client, app, "bob")
    r = await bob.receiver("orders.eu", credit=1)
    got = await r.receive()
    assert got.body == "o1"
    r.accept(got)

    carol = await as_user(client, app, "carol")
    text = await refused(await carol.receiver("orders.eu", wait=False))
    assert "user 'carol' may not consume from address 'orders.eu' ('consume')" in text
    erin = await as_user(client, app, "erin")
    text = await refused(await erin.receiver("orders.eu", wait=False))
    assert "grant role 'vip' 'consume' on 'orders.#'" in text


async def test_browse_granted_and_denied(make_broker: BrokerFactory, client: ClientFactory) -> None:
    app = await start(make_broker)
    alice = await as_user(client, app, "alice")
    await send_ok(await alice.sender("orders.b"), "kept")
    bob = await as_user(client, app, "bob")
    b = await bob.receiver("orders.b", credit=10, configure=browse)
    assert (await b.receive()).body == "kept"
    # alice may consume but not browse
    text = await refused(await alice.receiver("orders.b", configure=browse, wait=False))
    assert "user 'alice' may not browse address 'orders.b' ('browse')" in text
    assert app.broker is not None and app.broker.queues["orders.b"].count == 1


async def test_create_address_granted_and_denied(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker)
    assert app.broker is not None
    dave = await as_user(client, app, "dave")
    # an existing address needs only send / consume
    await send_ok(await dave.sender("feed.existing"), "f1")
    r = await dave.receiver("feed.existing", credit=1)
    assert (await r.receive()).body == "f1"
    # a new one would be auto-created: refused for the producer and the consumer
    text = await refused(await dave.sender("feed.new", wait=False))
    assert "user 'dave' may not create address 'feed.new' ('create_address')" in text
    text = await refused(await dave.receiver("feed.new", wait=False))
    assert "('create_address')" in text
    assert "feed.new" not in app.broker.addresses
    # bob may consume under orders.# but not create there
    bob = await as_user(client, app, "bob")
    text = await refused(await bob.receiver("orders.fresh", wait=False))
    assert "user 'bob' may not create address 'orders.fresh'" in text
    assert "orders.fresh" not in app.broker.addresses
    # alice may: her attach creates it, and then bob may consume
    alice = await as_user(client, app, "alice")
    await send_ok(await alice.sender("orders.fresh?group-buckets=4"), "x")
    assert "orders.fresh" in app.broker.addresses
    await bob.receiver("orders.fresh", credit=1)


async def test_most_specific_pattern_wins(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker)
    alice = await as_user(client, app, "alice")
    erin = await as_user(client, app, "erin")
    await send_ok(await erin.sender("orders.vip"), "v")
    r = await alice.receiver("orders.vip", credit=1)  # consume granted by the exact rule
    assert (await r.receive()).body == "v"
    text = await refused(await alice.sender("orders.vip", wait=False))
    assert "pattern 'orders.vip' grants it to roles vip" in text
    # orders.# does not grant vip anything
    await refused(await erin.sender("orders.eu", wait=False))


async def test_no_matching_pattern_is_denied(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker)
    alice = await as_user(client, app, "alice")
    text = await refused(await alice.sender("elsewhere", wait=False))
    assert "no [security] pattern matches it" in text
    assert "[security.elsewhere] send = ['app']" in text


async def test_a_huge_address_is_refused_with_a_short_description(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker, max_frame_size=1 << 20)
    carol = await as_user(client, app, "carol")
    name = "orders." + "z" * 200_000
    text = await refused(await carol.sender(name, wait=False))
    assert "(200007 characters)" in text and len(text) < 1000
    # and the connection carries on
    await refused(await carol.sender("orders.eu", wait=False))


async def test_anonymous_user_has_the_roles_of_anonymous(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker)
    anon = await client(app)
    await send_ok(await anon.sender("public.chat"), "hi")
    r = await anon.receiver("public.chat", credit=1)
    assert (await r.receive()).body == "hi"
    text = await refused(await anon.sender("orders.eu", wait=False))
    assert "user 'anonymous'" in text


# --------------------------------------------------------------- anonymous relay


async def test_relay_rejects_only_the_unauthorised_transfers_and_logs_once(
    make_broker: BrokerFactory, client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker")
    app = await start(make_broker)
    assert app.broker is not None
    alice = await as_user(client, app, "alice")
    relay = await alice.sender(None, name="relay-1")
    await send_ok(relay, "a", "orders.eu")
    denied = []
    for to in ("orders.vip", "feed.existing", "orders.vip"):
        denied.append(rejected(await relay.send(Message(body="no", address=to))))
    assert "user 'alice' may not send to address 'orders.vip' ('send')" in denied[0]
    assert "'feed.existing'" in denied[1]
    # the link is still open and allowed destinations still work, cached or new
    await send_ok(relay, "b", "orders.eu")
    await send_ok(relay, "c", "orders.relay.new")  # alice may create under orders.#
    assert not relay.closed_by_peer
    assert app.broker.queues["orders.eu"].count == 2
    assert "orders.vip" not in app.broker.addresses
    lines = [r.getMessage() for r in caplog.records if "relay-1" in r.getMessage()]
    assert len(lines) == 1, lines
    assert UNAUTHORIZED in lines[0] and "orders.vip" in lines[0]

    # a second relay link logs its own first denial
    relay2 = await alice.sender(None, name="relay-2")
    rejected(await relay2.send(Message(body="no", address="orders.vip")))
    assert len([r for r in caplog.records if "relay-2" in r.getMessage()]) == 1


async def test_relay_checks_create_address(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker)
    assert app.broker is not None
    dave = await as_user(client, app, "dave")
    relay = await dave.sender(None)
    await send_ok(relay, "f", "feed.existing")
    text = rejected(await relay.send(Message(body="no", address="feed.new")))
    assert "may not create address 'feed.new'" in text
    assert "feed.new" not in app.broker.addresses


async def test_relay_presettled_denials_are_dropped(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker)
    assert app.broker is not None
    alice = await as_user(client, app, "alice")
    relay = await alice.sender(None, presettled=True)
    await relay.send(Message(body="no", address="orders.vip"))
    await relay.send(Message(body="yes", address="orders.ps"))
    await roundtrip(alice)
    assert app.broker.queues["orders.ps"].count == 1
    assert "orders.vip" not in app.broker.queues


# ------------------------------------------------------------------- management


async def test_management_needs_manage(make_broker: BrokerFactory, client: ClientFactory) -> None:
    app = await start(make_broker)
    alice = await as_user(client, app, "alice")
    await send_ok(await alice.sender("orders.m"), "x")
    olga = await as_user(client, app, "olga")
    stats = await mgmt.call(olga, "getStatistics", "orders.m")
    assert stats["messages"] == 1
    text = await refused(await alice.sender("$management", wait=False))
    assert "user 'alice' may not manage address '$management' ('manage')" in text
    assert "[security]" in text


async def test_management_answer_may_not_create_an_address(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker)
    assert app.broker is not None
    olga = await as_user(client, app, "olga")
    s = await olga.sender("$management")
    d = await s.send(
        Message(
            id="r1",
            reply_to="orders.replies",
            properties={"operation": "listQueues", "type": "broker", "name": ""},
        )
    )
    assert "may not create address 'orders.replies'" in rejected(d)
    assert "orders.replies" not in app.broker.addresses


def query(reply_to: str, rid: str) -> Message:
    return Message(
        id=rid,
        reply_to=reply_to,
        properties={"operation": "QUERY", "type": "org.amqp.management", "name": "self"},
        body={"attributeNames": ["name"]},
    )


async def test_management_answer_needs_send_on_the_reply_to(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker)
    assert app.broker is not None
    alice = await as_user(client, app, "alice")
    victim = await alice.receiver("orders.eu", credit=10)  # creates the address
    victim_tmp = await alice.receiver(None, dynamic=True, credit=10)
    assert victim_tmp.address
    # olga may manage but not send to orders.#: no answer may be planted there, nor
    # in another connection's temporary queue
    olga = await as_user(client, app, "olga")
    s = await olga.sender("$management")
    text = rejected(await s.send(query("orders.eu", "planted-1")))
    assert "reply-to address 'orders.eu'" in text
    assert "user 'olga' may not send to address 'orders.eu' ('send')" in text
    text = rejected(await s.send(query(victim_tmp.address, "planted-2")))
    assert f"user 'olga' may not send to address {victim_tmp.address!r} ('send')" in text
    await roundtrip(alice)
    assert not victim.queue and not victim_tmp.queue
    assert app.broker.queues["orders.eu"].count == 0
    # its own temporary queue and topic are fine
    answer = await mgmt.request(olga, "QUERY", type="org.amqp.management", body={})
    assert answer.status == 200, answer.description
    topic = await olga.receiver(None, dynamic=True, credit=1, capabilities=["temporary-topic"])
    assert topic.address
    d = await s.send(query(topic.address, "own-topic"))
    assert d.remote_state == Delivery.ACCEPTED, d.remote.condition
    got = await topic.receive()
    assert got.message.correlation_id == "own-topic"
    assert got.properties["statusCode"] == 200
    # a manager who may send to orders.eu answers there
    mona = await as_user(client, app, "mona")
    ms = await mona.sender("$management")
    d = await ms.send(query("orders.eu", "legit-1"))
    assert d.remote_state == Delivery.ACCEPTED, d.remote.condition
    got = await victim.receive()
    assert got.message.correlation_id == "legit-1"
    assert got.properties["statusCode"] == 200


# ------------------------------------------------------ temporary nodes, unsubscribe


async def test_temporary_queues_and_topics_need_no_permission(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker)
    carol = await as_user(client, app, "carol")
    r = await carol.receiver(None, dynamic=True, credit=1)
    assert r.address
    await carol.receiver(None, dynamic=True, capabilities=["temporary-topic"])
    s = await carol.sender(None, dynamic=True)
    assert s.address
    # but sending to a temporary queue by name is a named send like any other
    await refused(await carol.sender(r.address, wait=False))


async def test_unsubscribe_needs_consume_on_the_topic(
    make_broker: BrokerFactory, client: ClientFactory
) -> None:
    app = await start(make_broker)
    assert app.broker is not None
    alice = await client(app, user="alice", password=PASSWORD, container="jms-1")
    sub = await alice.receiver(
        "news.t", name="s1", credit=1, capabilities=["topic"], configure=durable
    )
    await sub.detach()
    assert "jms-1.s1" in app.broker.queues
    # carol, with the same client id, may not remove it
    carol = await client(app, user="carol", password=PASSWORD, container="jms-1")
    text = await refused(await carol.receiver(None, name="s1", wait=False))
    assert "user 'carol' may not consume from address 'news.t'" in text
    assert "jms-1.s1" in app.broker.queues
    # nor may anonymous (consume on public.#) take it over on another topic: that
    # would delete it
    anon = await client(app, container="jms-1")
    text = await refused(
        await anon.receiver(
            "public.t", name="s1", capabilities=["topic"], configure=durable, wait=False
        )
    )
    assert "user 'anonymous' may not consume from address 'news.t'" in text
    assert "jms-1.s1" in app.broker.queues
    u = await alice.receiver(None, name="s1")
    await u.close()
    assert "jms-1.s1" not in app.broker.queues


# ------------------------------------------------------------ logging, disabled


async def test_refused_attach_is_logged_once(
    make_broker: BrokerFactory, client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker")
    app = await start(make_broker)
    carol = await as_user(client, app, "carol")
    await refused(await carol.sender("orders.eu", name="denied-link", wait=False))
    await roundtrip(carol)
    lines = [r.getMessage() for r in caplog.records if "denied-link" in r.getMessage()]
    assert len(lines) == 1, lines
    assert UNAUTHORIZED in lines[0] and "'carol'" in lines[0]


async def test_security_disabled_is_open(make_broker: BrokerFactory, client: ClientFactory) -> None:
    app = await start(make_broker, enabled=False)
    carol = await as_user(client, app, "carol")
    await send_ok(await carol.sender("anything.new"), "x")
    b = await carol.receiver("anything.new", credit=1, configure=browse)
    assert (await b.receive()).body == "x"
    r = await carol.receiver("anything.new", credit=1)
    assert (await r.receive()).body == "x"
    relay = await carol.sender(None)
    await send_ok(relay, "y", "orders.vip")
    assert await mgmt.call(carol, "getGroupCount", "anything.new") == 0
