"""Group management over real sockets (issue 3; GROUPING.md section 6): group count,
group listing (owner link, backlog, in-flight, bound since), resetGroup(id) and
resetAllGroups through the `$management` node, and the operator CLI against a running
broker.

Rotation rule R (GROUPING 3.4) decides every owner: priority, then round robin in attach
order; the pointer moves past the chosen consumer after an ungrouped delivery or a new
binding and goes back to the first consumer on any attach/detach.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import trio

from amqbroker.app import BrokerApp
from tests.conftest import BrokerFactory, ClientFactory
from tests.integration import mgmt
from tests.integration.groups_helpers import (
    BUCKET,
    FIRST,
    assert_idle,
    flags,
    msg,
    queue_of,
    take,
    until,
)

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------ operations


async def test_group_count_reset_group_and_reset_all_groups(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    """Artemis QueueControlTest.testResetGroups: 3 -> reset one -> 2 -> send to the
    reset group -> 3 -> reset all -> 0; reset groups bind afresh (first-key again)."""
    app = await make_broker(address_settings={"#": {"default_group_first_key": FIRST}})
    c1, c2, admin = await client(app), await client(app), await client(app)
    r1 = await c1.receiver("q", credit=50)
    r2 = await c2.receiver("q", credit=50)
    s = await c1.sender("q")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("C1", "C")])
    assert await take(r1, 2) == ["A1", "C1"]
    assert await take(r2, 1) == ["B1"]
    assert await mgmt.call(admin, "getGroupCount", "q") == 3

    assert await mgmt.call(admin, "resetGroup", "q", group="A") == {"reset": 1}
    assert await mgmt.call(admin, "getGroupCount", "q") == 2
    # the older property name still works
    assert await mgmt.call(admin, "resetGroup", "q", groupId="A") == {"reset": 0}  # not bound
    assert await mgmt.call(admin, "resetGroup", "q", group="nope") == {"reset": 0}
    # A binds afresh: next in rotation after C's binding to r1 is r2
    await s.send_many([msg("A2", "A"), msg("B2", "B")])
    assert flags(await r2.receive_n(2)) == [("A2", True), ("B2", False)]
    assert await mgmt.call(admin, "getGroupCount", "q") == 3

    assert await mgmt.call(admin, "resetAllGroups", "q") == {"reset": 3}
    assert await mgmt.call(admin, "getGroupCount", "q") == 0
    assert queue_of(app, "q").list_groups() == []
    # all bind afresh, round robin from after A's binding to r2: r1, r2, r1
    await s.send_many([msg("A3", "A"), msg("B3", "B"), msg("C3", "C")])
    assert flags(await r1.receive_n(2)) == [("A3", True), ("C3", True)]
    assert flags(await r2.receive_n(1)) == [("B3", True)]
    assert await mgmt.call(admin, "getGroupCount", "q") == 3
    await assert_idle(app, c1, c2, admin)


async def test_reset_group_on_a_bucketed_queue_resets_the_whole_bucket(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(
        address_settings={"#": {"default_group_buckets": 4, "default_group_first_key": FIRST}}
    )
    c1, c2, admin = await client(app), await client(app), await client(app)
    r1 = await c1.receiver("q", credit=50, name="r1")
    r2 = await c2.receiver("q", credit=50, name="r2")
    r3 = await c1.receiver("q", credit=50, name="r3")
    s = await c2.sender("q")
    # N=4: groupA and id1 share bucket 2, groupB is in bucket 1
    await s.send_many([msg("a1", "groupA"), msg("b1", "groupB"), msg("i1", "id1")])
    assert flags(await r1.receive_n(2)) == [("a1", True), ("i1", False)]
    assert flags(await r2.receive_n(1)) == [("b1", True)]
    assert await mgmt.call(admin, "getGroupCount", "q") == 2
    listed = (await mgmt.call(admin, "listGroups", "q"))["groups"]
    assert sorted((g["group"], g["consumer"], g["bucket"]) for g in listed) == [
        (f"{BUCKET}1", "r2", 1),
        (f"{BUCKET}2", "r1", 2),
    ]
    # resetting id1 releases bucket 2, so groupA binds afresh too (to r3, next in turn)
    assert await mgmt.call(admin, "resetGroup", "q", group="id1") == {"reset": 1}
    assert await mgmt.call(admin, "getGroupCount", "q") == 1
    await s.send_many([msg("a2", "groupA"), msg("i2", "id1")])
    assert flags(await r3.receive_n(2)) == [("a2", True), ("i2", False)]
    # a bucket can be named directly by its management key
    assert await mgmt.call(admin, "resetGroup", "q", group=f"{BUCKET}1") == {"reset": 1}
    await s.send(msg("b2", "groupB"))
    assert flags(await r1.receive_n(1)) == [("b2", True)]
    await assert_idle(app, c1, c2, admin)


async def test_list_groups_owner_backlog_in_flight_bound_since(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1 = await client(broker, container="app-1")
    c2 = await client(broker, container="app-2")
    admin = await client(broker)
    ra = await c1.receiver("q", credit=2, name="owner-a")
    rb = await c2.receiver("q", credit=10, name="owner-b")
    s = await c2.sender("q")
    assert await mgmt.call(admin, "listGroups", "q") == {"groups": []}
    assert broker.broker is not None
    t_before = broker.broker.clock()
    await s.send_many(
        [msg("A1", "A"), msg("B1", "B"), msg("A2", "A"), msg("A3", "A"), msg("A4", "A")]
    )
    t_after = broker.broker.clock()
    held_a = await ra.receive_n(2)  # A3, A4 wait for owner-a's credit
    assert await take(rb, 1) == ["B1"]
    await s.send(msg("B2", "B"))
    held_b = await rb.receive()  # B2 unsettled
    await until(broker, "q", "in_flight", 3)
    rows = (await mgmt.call(admin, "listGroups", "q"))["groups"]
    assert isinstance(rows, list)
    by_group = {r["group"]: r for r in rows}
    assert sorted(by_group) == ["A", "B"]
    a, b = by_group["A"], by_group["B"]
    assert (a["consumer"], a["container"], a["backlog"], a["inFlight"]) == (
        "owner-a",
        "app-1",
        2,
        2,
    )
    assert (b["consumer"], b["container"], b["backlog"], b["inFlight"]) == (
        "owner-b",
        "app-2",
        0,
        1,
    )
    assert a["connection"] and b["connection"] and a["connection"] != b["connection"]
    ms = round(t_before * 1000), round(t_after * 1000)
    assert ms[0] <= a["boundSince"] <= b["boundSince"] <= ms[1]
    assert (a["blocked"], b["blocked"], a["stuck"], b["stuck"]) == (True, False, False, False)
    # the same groups the core has
    assert sorted(by_group) == sorted(g["group"] for g in queue_of(broker, "q").list_groups())
    for g in held_a:
        ra.accept(g)
    rb.accept(held_b)
    await assert_idle(broker, c1, c2, admin)


async def test_statistics_and_reset_for_a_stuck_group(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1, c2, admin = await client(broker), await client(broker), await client(broker)
    r1 = await c1.receiver("q", credit=20)
    r2 = await c2.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send(msg("A1", "A"))
    a1 = await r1.receive()
    r1.modify(a1, failed=False, undeliverable=True)  # the owner refuses it: stuck
    await until(broker, "q", "stuck_groups", 1)
    await s.send(msg("A2", "A"))
    await r2.expect_none(0.3)
    st = await mgmt.call(admin, "getStatistics", "q")
    assert (st["groups"], st["stuck_groups"], st["stuck_messages"], st["messages"]) == (
        1,
        1,
        1,
        2,
    )
    [row] = (await mgmt.call(admin, "listGroups", "q"))["groups"]
    assert (row["group"], row["stuck"], row["backlog"]) == ("A", True, 2)
    # reset: the group binds afresh; r1 refused A1, so r2 takes the group, in order
    assert await mgmt.call(admin, "resetGroup", "q", group="A") == {"reset": 1}
    assert await take(r2, 2) == ["A1", "A2"]
    await r1.expect_none(0.2)
    await until(broker, "q", "messages", 0)
    st = await mgmt.call(admin, "getStatistics", "q")
    assert (st["groups"], st["stuck_groups"], st["messages"]) == (1, 0, 0)
    await assert_idle(broker, c1, c2, admin)


async def test_management_errors_and_correlation(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c = await client(broker)
    r = await c.receiver("q", credit=1)
    ok = await mgmt.request(c, "getGroupCount", "q")
    assert (ok.status, ok.body) == (200, 0)
    assert ok.correlation_id == ok.request_id
    missing = await mgmt.request(c, "getGroupCount", "no-such-queue")
    assert missing.status == 404
    assert "no-such-queue" in (missing.description or "")
    no_id = await mgmt.request(c, "resetGroup", "q")
    assert no_id.status == 400
    assert "'group'" in (no_id.description or "")
    unknown = await mgmt.request(c, "frobnicate", "q")
    assert unknown.status == 405  # not supported on the queue type
    await r.close()
    await assert_idle(broker, c)


# ------------------------------------------------------------------------------- CLI


async def _cli(port: int, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = await trio.run_process(
        [str(REPO / ".venv" / "bin" / "amqbroker"), "groups", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


async def test_cli_groups_list_count_reset(broker: BrokerApp, client: ClientFactory) -> None:
    """The real operator CLI (a separate process) against the fixture's broker."""
    port = broker.listening[0][1]
    url = f"amqp://127.0.0.1:{port}"
    c1 = await client(broker, container="cli-test")
    r1 = await c1.receiver("orders", credit=1, name="worker-1")
    r2 = await c1.receiver("orders", credit=10, name="worker-2")
    s = await c1.sender("orders")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("A2", "A"), msg("A3", "A")])
    a1 = await r1.receive()
    assert await take(r2, 1) == ["B1"]
    await until(broker, "orders", "in_flight", 1)

    rows = json.loads(await _cli(port, "list", "--queue", "orders", "--url", url, "--json"))
    got = sorted(
        (r["group"], r["owner"], r["container"], r["backlog"], r["inFlight"]) for r in rows
    )
    assert all("consumer" not in r for r in rows)  # one name, as the table's OWNER
    assert got == [("A", "worker-1", "cli-test", 2, 1), ("B", "worker-2", "cli-test", 0, 0)]
    assert all(isinstance(r["boundSince"], int) for r in rows)

    assert (await _cli(port, "count", "--queue", "orders", "--url", url)).strip() == "2"
    await _cli(port, "reset", "--queue", "orders", "--url", url, "--group", "B")
    assert queue_of(broker, "orders").group_count() == 1
    assert [g["group"] for g in queue_of(broker, "orders").list_groups()] == ["A"]
    r1.accept(a1)
    await assert_idle(broker, c1)
