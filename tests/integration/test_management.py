"""The `$management` node over real sockets (AMQP Management draft): every entity type
and operation, every error class, a generic OASIS client written here from the draft
(plain Proton messages, not our management client), and Qpid Dispatch's `qdmanage`
when it is installed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from typing import Any

import pytest
import trio
from proton import Message
from proton.utils import BlockingConnection, SyncRequestResponse

from amqbroker.app import BrokerApp
from amqbroker.core.auth import hash_password
from amqbroker.protocol.management import queue_ops
from tests.client import Client
from tests.conftest import BrokerFactory, ClientFactory
from tests.integration import mgmt
from tests.integration.groups_helpers import assert_idle, msg, queue_of, take, until

Q = "org.amqbroker.queue"
NODE = "org.amqp.management"


async def req(c: Client, op: str, type: str, name: str = "", **kw: Any) -> mgmt.Answer:
    return await mgmt.request(c, op, name, type=type, **kw)


# ---------------------------------------------------------------- CRUD: address, queue


async def test_address_and_queue_create_read_update_delete(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    admin = await client(broker)
    a = await req(admin, "CREATE", "address", "news", body={"routingType": "MULTICAST"})
    assert a.status == 201, a.description
    assert (a.status, a.body["routingType"], a.body["type"]) == (
        201,
        "MULTICAST",
        "org.amqbroker.address",
    )
    assert (await req(admin, "CREATE", "address", "news", body={})).status == 409
    bad = await req(admin, "CREATE", "address", "x", body={"routingType": "BROADCAST"})
    assert bad.status == 400 and "ANYCAST or MULTICAST" in (bad.description or "")

    created = await req(
        admin, "CREATE", Q, "orders", body={"groupBuckets": 4, "group-rebalance": True}
    )
    assert created.status == 201, created.description
    attrs = created.body
    assert (attrs["name"], attrs["identity"], attrs["address"], attrs["routingType"]) == (
        "orders",
        "orders",
        "orders",
        "ANYCAST",
    )
    assert (attrs["groupBuckets"], attrs["groupRebalance"], attrs["durable"]) == (4, True, True)
    assert (await req(admin, "CREATE", "queue", "orders", body={})).status == 409
    bad_opt = await req(admin, "CREATE", "queue", "o2", body={"groupBuckets": "many"})
    assert bad_opt.status == 400 and "group-buckets" in (bad_opt.description or "")
    unknown_attr = await req(admin, "CREATE", "queue", "o3", body={"colour": "red"})
    assert unknown_attr.status == 400 and "colour" in (unknown_attr.description or "")
    no_name = await req(admin, "CREATE", "queue", body={})
    assert no_name.status == 400 and "'name'" in (no_name.description or "")
    # a queue on a multicast address gets every message sent there
    sub = await req(admin, "CREATE", "queue", "news-audit", body={"address": "news"})
    assert (sub.status, sub.body["routingType"]) == (201, "MULTICAST")

    s = await admin.sender("orders")
    await s.send_many([msg("o1", "A"), msg("o2", "B")])
    await (await admin.sender("news")).send(Message(body="n1"))
    await s.close()
    read = await req(admin, "READ", "queue", "orders")
    assert (read.status, read.body["messageCount"], read.body["messagesAdded"]) == (200, 2, 2)
    assert (await req(admin, "READ", "queue", "news-audit")).body["messageCount"] == 1
    by_identity = await mgmt.request(admin, "READ", type=Q, identity="orders")
    assert by_identity.body == read.body

    upd = await req(admin, "UPDATE", Q, "orders", body={"groupBuckets": -1, "paused": True})
    assert (upd.status, upd.body["groupBuckets"], upd.body["paused"]) == (200, -1, True)
    assert upd.body["groupRebalance"] is True  # kept: only the given options change
    assert queue_of(broker, "orders").policy.group_buckets == -1
    ro = await req(admin, "UPDATE", Q, "orders", body={"messageCount": 0})
    assert ro.status == 400 and "messageCount" in (ro.description or "")
    assert (await req(admin, "UPDATE", Q, "orders", body={"paused": "maybe"})).status == 400
    assert (await req(admin, "UPDATE", Q, "orders", body=["not", "a", "map"])).status == 400

    # DELETE: a queue with a consumer needs force
    c = await client(broker)
    r = await c.receiver("orders", credit=10)
    busy = await req(admin, "DELETE", Q, "orders")
    assert busy.status == 409 and "force=true" in (busy.description or "")
    gone = await req(admin, "DELETE", Q, "orders", force=True)
    assert (gone.status, gone.body) == (204, {})
    await until_closed(r)
    assert "deleted by an operator" in str(r.remote_condition.description)
    missing = await req(admin, "READ", Q, "orders")
    assert missing.status == 404 and "'orders'" in (missing.description or "")
    assert "orders" not in broker.broker.addresses  # type: ignore[union-attr]
    assert (await req(admin, "DELETE", "address", "news", body={"force": True})).status == 204
    assert "news-audit" not in broker.broker.queues  # type: ignore[union-attr]
    assert (await req(admin, "DELETE", "address", "news")).status == 404
    await assert_idle(broker, admin, c)


async def until_closed(r: Any) -> None:
    await r.client._wait(lambda: r.closed_by_peer, 5)


# --------------------------------------------------- QUERY and the node operations


async def test_query_and_node_operations(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    admin = await client(broker)
    for name in ("q1", "q2", "q3"):
        assert (await req(admin, "CREATE", "queue", name, body={"durable": False})).ok
    await (await admin.sender("q2")).send(Message(body="x"))
    ans = await mgmt.request(
        admin,
        "QUERY",
        "self",
        type=NODE,
        entityType=Q,
        body={"attributeNames": ["name", "messageCount", "durable"]},
    )
    assert ans.status == 200
    assert ans.body["attributeNames"] == ["name", "messageCount", "durable"]
    mine = [row for row in ans.body["results"] if not row[0].startswith("tmp.")]  # replies
    assert sorted(mine) == [["q1", 0, False], ["q2", 1, False], ["q3", 0, False]]
    page = await mgmt.request(
        admin,
        "QUERY",
        type=NODE,
        entityType="queue",
        offset=1,
        count=1,
        body={"attributeNames": ["name"]},
    )
    assert page.status == 200 and len(page.body["results"]) == 1
    every = await mgmt.request(admin, "QUERY", type=NODE, entityType="queue")
    assert every.body["attributeNames"][:3] == ["name", "identity", "type"]
    assert "groupBuckets" in every.body["attributeNames"]
    everything = await mgmt.request(admin, "QUERY", type=NODE, body={"attributeNames": ["type"]})
    kinds = {row[0] for row in everything.body["results"]}
    assert {"org.amqbroker.broker", "org.amqbroker.queue", "org.amqbroker.connection"} <= kinds

    types = await mgmt.request(admin, "GET-TYPES", type=NODE)
    assert set(types.body) == {
        f"org.amqbroker.{t}"
        for t in ("broker", "address", "queue", "connection", "consumer", "group")
    }
    attrs = await mgmt.request(admin, "GET-ATTRIBUTES", type=NODE, entityType="group")
    assert "oldestMessageAge" in attrs.body["org.amqbroker.group"]
    ops = await mgmt.request(admin, "GET-OPERATIONS", type=NODE, entityType=Q)
    queue_ops_ = ops.body[Q]
    assert {"CREATE", "READ", "UPDATE", "DELETE", "purge", "moveMessages"} <= set(queue_ops_)
    assert queue_ops_["moveMessages"] == ["toQueue", "filter"]
    assert (await mgmt.request(admin, "GET-MGMT-NODES", type=NODE)).body == []

    # errors of the node operations
    unknown = await mgmt.request(admin, "QUERY", type=NODE, entityType="widget")
    assert unknown.status == 404 and "org.amqbroker.queue" in (unknown.description or "")
    bad_names = await mgmt.request(admin, "QUERY", type=NODE, body={"attributeNames": "name"})
    assert bad_names.status == 400
    bad_count = await mgmt.request(admin, "QUERY", type=NODE, count=-1)
    assert bad_count.status == 400 and "count" in (bad_count.description or "")
    not_node = await mgmt.request(admin, "READ", type=NODE)
    assert not_node.status == 405 and "GET-TYPES" in (not_node.description or "")
    no_op = await mgmt.request(admin, "", type=Q)
    assert no_op.status == 400 and "'operation'" in (no_op.description or "")
    no_type = await mgmt.request(admin, "READ", "q1", type="")
    assert no_type.status == 400 and "'type'" in (no_type.description or "")
    no_name = await mgmt.request(admin, "READ", type=Q)
    assert no_name.status == 400 and "'name'" in (no_name.description or "")
    wrong_op = await req(admin, "UPDATE", "connection", "c1")
    assert wrong_op.status == 405 and "READ" in (wrong_op.description or "")
    await assert_idle(broker, admin)


# ------------------------------------------------------------------ queue operations


async def test_purge_pause_resume(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    admin, c = await client(broker), await client(broker)
    s = await c.sender("work")
    await s.send_many([Message(body=f"m{i}") for i in range(3)])
    assert (await mgmt.call(admin, "purge", "work")) == {"removed": 3}
    assert await mgmt.call(admin, "pause", "work") == {"paused": True}
    r = await c.receiver("work", credit=10)
    await s.send_many([Message(body="p1"), Message(body="p2")])
    await r.expect_none(1.0)  # paused: nothing is delivered
    read = await req(admin, "READ", Q, "work")
    assert (read.body["paused"], read.body["dispatching"], read.body["messageCount"]) == (
        True,
        False,
        2,
    )
    assert await mgmt.call(admin, "resume", "work") == {"paused": False}
    assert await take(r, 2) == ["p1", "p2"]
    await assert_idle(broker, admin, c)


async def test_group_operations_ages_and_the_group_entity(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    admin = await client(broker)
    c = await client(broker, container="app")
    r1 = await c.receiver("g", credit=1, name="w1")
    r2 = await c.receiver("g", credit=10, name="w2")
    s = await c.sender("g")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("A2", "A"), msg("A3", "A")])
    a1 = await r1.receive()  # A2, A3 wait for w1's credit
    assert await take(r2, 1) == ["B1"]  # settled now
    await until(broker, "g", "in_flight", 1)
    await trio.sleep(10)
    groups = (await mgmt.call(admin, "listGroups", "g"))["groups"]
    by = {g["group"]: g for g in groups}
    a, b = by["A"], by["B"]
    assert (a["consumer"], a["connection"], a["backlog"], a["inFlight"]) == ("w1", "c2", 2, 1)
    assert (b["consumer"], b["backlog"], b["inFlight"], b["bucket"]) == ("w2", 0, 0, None)
    assert 10_000 <= a["oldestMessageAge"] <= 11_000  # A2 has waited 10 s
    assert b["oldestMessageAge"] is None  # nothing waiting
    assert 10_000 <= b["sinceLastSettle"] <= 11_000  # B1 was settled 10 s ago
    assert 10_000 <= a["sinceLastSettle"] <= 11_000  # bound 10 s ago, nothing settled
    assert a["blocked"] and not a["stuck"]
    top = await mgmt.call(admin, "listGroups", "g", body={"top": 1, "orderBy": "backlog"})
    assert [g["group"] for g in top["groups"]] == ["A"]
    by_age = await mgmt.call(admin, "listGroups", "g", body={"orderBy": "age"})
    assert [g["group"] for g in by_age["groups"]] == ["A", "B"]
    assert (await mgmt.request(admin, "listGroups", "g", body={"orderBy": "size"})).status == 400
    assert (await mgmt.request(admin, "listGroups", "g", body={"top": "x"})).status == 400

    # the group entity: READ, QUERY, DELETE (= reset)
    read = await req(admin, "READ", "group", "g/A")
    assert (read.status, read.body["identity"], read.body["queue"], read.body["backlog"]) == (
        200,
        "g/A",
        "g",
        2,
    )
    rows = await mgmt.request(
        admin, "QUERY", type=NODE, entityType="group", body={"attributeNames": ["identity"]}
    )
    assert sorted(rows.body["results"]) == [["g/A"], ["g/B"]]
    assert (await req(admin, "READ", "group", "g/Z")).status == 404
    assert (await req(admin, "READ", "group", "nosuchqueue/A")).status == 404
    assert (await req(admin, "DELETE", "group", "g/B")).status == 204
    assert await mgmt.call(admin, "getGroupCount", "g") == 1
    assert await mgmt.call(admin, "resetAllGroups", "g") == {"reset": 1}
    r1.accept(a1)
    await r2.close()
    assert await take(r1, 0) == []
    r1.flow(2)
    assert await take(r1, 2) == ["A2", "A3"]
    await assert_idle(broker, admin, c)


# --------------------------------------------------------------- move and retry


async def test_move_messages_with_a_filter_and_retry_dead_letters(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(
        address_settings={"orders": {"dead_letter_address": "DLQ"}},
        addresses=[{"name": "DLQ", "routing": "anycast"}],
    )
    admin, c = await client(app), await client(app)
    s = await c.sender("orders")
    await s.send_many([Message(body=f"d{i}", properties={"n": i}) for i in range(3)])
    r = await c.receiver("orders", credit=3)
    for got in await r.receive_n(3):
        r.reject(got)
    await until(app, "DLQ", "messages", 3)
    await r.close()
    moved = await mgmt.call(admin, "moveMessages", "DLQ", toQueue="parking", expect=404)
    assert moved is None
    assert (await req(admin, "CREATE", Q, "parking", body={})).status == 201
    assert await mgmt.call(
        admin, "moveMessages", "DLQ", body={"toQueue": "parking", "filter": "n = 1"}
    ) == {"moved": 1}
    bad = await mgmt.request(
        admin, "moveMessages", "DLQ", body={"toQueue": "parking", "filter": "n = = 1"}
    )
    assert bad.status == 400 and "n = = 1" in (bad.description or "")
    assert (await mgmt.request(admin, "moveMessages", "DLQ")).status == 400
    assert (await mgmt.request(admin, "moveMessages", "DLQ", toQueue="DLQ")).status == 400
    assert queue_of(app, "parking").count == 1
    # the dead letters go back to orders (x-opt-ORIG-ADDRESS); the moved one too
    assert await mgmt.call(admin, "retryMessages", "DLQ") == {"retried": 2}
    assert await mgmt.call(admin, "retryMessages", "parking") == {"retried": 1}
    r = await c.receiver("orders", credit=3)
    got = await r.receive_n(3)
    assert sorted(g.body for g in got) == ["d0", "d1", "d2"]
    assert all(g.message.annotations["x-opt-ORIG-ADDRESS"] == "orders" for g in got)
    for g in got:
        r.accept(g)
    assert queue_of(app, "DLQ").count == 0
    await assert_idle(app, admin, c)


# ------------------------------------------------- broker, connection, consumer


async def test_broker_connection_and_consumer_entities(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    admin = await client(broker)
    worker = await client(broker, container="worker-app")
    r = await worker.receiver("jobs", credit=5, name="jobs-in")
    await trio.sleep(3)
    b = await req(admin, "READ", "broker")
    assert b.status == 200
    from amqbroker import __version__

    # queues: jobs, and the temporary queue the answer goes to
    assert (b.body["version"], b.body["connections"], b.body["queues"]) == (__version__, 2, 2)
    assert b.body["uptime"] >= 3000
    assert b.body["memoryLimit"] == broker.settings.global_max_size
    assert b.body["storeSize"] is not None and b.body["storeSyncLatency"] is not None

    conns = await mgmt.request(
        admin,
        "QUERY",
        type=NODE,
        entityType="connection",
        body={"attributeNames": ["identity", "container", "consumers"]},
    )
    worker_row = next(row for row in conns.body["results"] if row[1] == "worker-app")
    conn_id = worker_row[0]
    assert worker_row[2] == 1
    read = await req(admin, "READ", "connection", conn_id)
    assert (read.body["container"], read.body["links"]) == ("worker-app", 1)
    cons = await req(admin, "READ", "consumer", f"{conn_id}/jobs-in")
    assert (cons.status, cons.body["queue"], cons.body["credit"], cons.body["linkName"]) == (
        200,
        "jobs",
        5,
        "jobs-in",
    )
    assert (await req(admin, "READ", "consumer", f"{conn_id}/nope")).status == 404
    assert (await req(admin, "READ", "consumer", "nonsense")).status == 404
    assert (await req(admin, "DELETE", "consumer", f"{conn_id}/jobs-in")).status == 204
    await until_closed(r)
    assert (await req(admin, "DELETE", "connection", conn_id)).status == 204
    await worker._wait(lambda: worker.closed_by_peer, 5)
    assert worker.remote_condition.name == "amqp:connection:forced"
    worker.abort()
    with trio.fail_after(5):
        while any(conn.conn_id == conn_id for conn in broker.hub.drivers):
            await broker.hub.drivers_changed.park()
    assert (await req(admin, "READ", "connection", conn_id)).status == 404
    await assert_idle(broker, admin)


# ------------------------------------------------------------- 401/403 and 500


async def test_not_allowed_and_internal_errors(
    make_broker: BrokerFactory,
    client: ClientFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pw = hash_password("pw", iterations=1000)
    app = await make_broker(
        users={"olga": pw},
        roles={"olga": ["ops"], "anonymous": ["guest"]},
        security={
            "$management": {"manage": ["ops", "guest"]},
            "ops.#": {"create_address": ["ops"], "delete_address": ["ops"]},
            "other.#": {"create_address": ["guest"]},
        },
        security_enabled=True,
    )
    olga = await client(app, user="olga", password="pw")
    assert (await req(olga, "CREATE", Q, "ops.q", body={})).status == 201
    denied = await req(olga, "CREATE", Q, "other.q", body={})
    assert denied.status == 403
    assert "create_address" in (denied.description or "")
    assert (await req(olga, "DELETE", Q, "ops.q")).status == 204

    # an internal error is a 500 with a description, and logged with its traceback
    def boom(ctx: Any, req: Any, q: Any) -> Any:
        raise RuntimeError("disk on fire")

    monkeypatch.setitem(queue_ops.QUEUE_OPERATIONS, "purge", ((), boom))
    assert (await req(olga, "CREATE", Q, "ops.p", body={})).ok
    with caplog.at_level(logging.ERROR):
        ans = await req(olga, "purge", Q, "ops.p")
    assert ans.status == 500 and "disk on fire" in (ans.description or "")
    assert any("management request" in r.message for r in caplog.records)

    # anonymous: may manage but not delete: 401 (authenticate) rather than 403
    anon = await client(app)
    assert (await req(anon, "DELETE", Q, "ops.p")).status == 401
    await assert_idle(app, olga, anon)


# ---------------------------------------------------- a generic OASIS client (draft)


def _oasis_client(port: int) -> dict[str, Any]:
    """Written from the AMQP Management draft only: a request is a message to
    `$management` with application properties operation / type / name, a reply-to
    (a dynamic receiver's address), and a message-id the answer's correlation-id
    repeats; statusCode and statusDescription come back as application properties."""
    conn = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=10)
    out: dict[str, Any] = {}
    try:
        replies = conn.create_receiver(None, dynamic=True)
        sender = conn.create_sender("$management", name="oasis-requests")
        reply_to = replies.remote_source.address

        def call(props: dict[str, Any], body: Any = None) -> Message:
            mid = str(uuid.uuid4())
            sender.send(Message(id=mid, reply_to=reply_to, properties=props, body=body))
            answer = replies.receive(timeout=10)
            replies.accept()
            assert answer.correlation_id == mid
            return answer

        created = call(
            {"operation": "CREATE", "type": "org.amqbroker.queue", "name": "oasis"},
            {"groupBuckets": 8},
        )
        out["create"] = (created.properties["statusCode"], created.body["groupBuckets"])
        read = call({"operation": "READ", "type": "org.amqbroker.queue", "name": "oasis"})
        out["read"] = (read.properties["statusCode"], read.body["name"])
        query = call(
            {
                "operation": "QUERY",
                "type": "org.amqp.management",
                "name": "self",
                "entityType": "org.amqbroker.queue",
            },
            {"attributeNames": ["name", "groupBuckets"]},
        )
        out["query"] = (query.properties["statusCode"], query.body["results"])
        missing = call({"operation": "READ", "type": "org.amqbroker.queue", "name": "nope"})
        out["missing"] = (
            missing.properties["statusCode"],
            missing.properties["statusDescription"],
        )
        # Proton's generic request/response correlates by correlation-id instead
        rr = SyncRequestResponse(conn, "$management")
        types = rr.call(
            Message(properties={"operation": "GET-TYPES", "type": "org.amqp.management"})
        )
        out["types"] = (types.properties["statusCode"], sorted(types.body))
    finally:
        conn.close()
    return out


async def test_a_generic_oasis_management_client(broker: BrokerApp) -> None:
    got = await trio.to_thread.run_sync(_oasis_client, broker.listening[0][1])
    assert got["create"] == (201, 8)
    assert got["read"] == (200, "oasis")
    status, rows = got["query"]
    assert status == 200 and [row for row in rows if not row[0].startswith("tmp.")] == [
        ["oasis", 8]
    ]
    status, desc = got["missing"]
    assert status == 404 and "'nope'" in desc
    assert got["types"][0] == 200 and "org.amqbroker.group" in got["types"][1]


@pytest.mark.skipif(
    shutil.which("qdmanage") is None,
    reason="qdmanage is not installed (qpid-dispatch-tools is not packaged for this "
    "Debian release); the generic OASIS client test covers the same requests",
)
async def test_qdmanage_queries_queues(broker: BrokerApp, client: ClientFactory) -> None:
    c = await client(broker)
    await (await c.sender("qd-queue")).send(Message(body="x"))
    port = broker.listening[0][1]
    done = await trio.run_process(
        ["qdmanage", "--bus", f"amqp://127.0.0.1:{port}", "query", "--type", Q],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr.decode()
    rows = json.loads(done.stdout)
    assert any(r.get("name") == "qd-queue" and r.get("messageCount") == 1 for r in rows)
