"""GROUPING 7.8, "consumer disappears, queue stays", in process (three whole brokers).

* Default (`grouping_consumerless_timeout = -1`, the spec): the group keeps its queue
  instance after that instance's last consumer left; new messages of the group, from
  any entry node (the arbiter's own too, though it has a consumer), keep going there
  and wait, and a consumer that attaches there gets them all in order.
* `grouping_consumerless_timeout = 500` on the arbiter: once the instance has had no
  consumer for that long, the arbiter releases the group and un-proposes it on every
  node; the next message is proposed afresh and lands where a consumer is, while the
  messages already queued on the old instance stay there (not lost) for its next
  consumer. While no other instance has a consumer, nothing is released (moving the
  group would gain nothing); once one has, the group moves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from amqbroker.app import BrokerApp
from tests.client import Client, Receiver
from tests.cluster.test_grouping_release import gmsg, node, start_cluster, until
from tests.conftest import BrokerFactory, ClientFactory

pytestmark = pytest.mark.timeout(60)


async def group_on_node2_then_its_consumer_leaves(
    apps: dict[str, BrokerApp], client: ClientFactory, *, node1_consumer_stays: bool = True
) -> tuple[Client, Receiver, float]:
    """Bind group k to node2's instance, deliver k:0-1 there, leave k:2-4 queued, and
    detach node2's only consumer; node1 keeps a consumer (returned, with the time just
    before the detach)."""
    n1, n2, n3 = (node(apps[n]) for n in ("node1", "node2", "node3"))
    c1 = await client(apps["node1"])
    r1 = await c1.receiver("orders", credit=100)
    c2 = await client(apps["node2"])
    r2 = await c2.receiver("orders", credit=2)
    await until(
        lambda: (
            n3.peers["node2"].topology.get("orders", 0) > 0
            and n3.peers["node1"].topology.get("orders", 0) > 0
        )
    )
    s2 = await c2.sender("orders")
    await s2.send_many([gmsg("k", i) for i in range(5)])  # local consumer first: node2
    first = await r2.receive_n(2)
    assert [m.body for m in first] == ["k:0", "k:1"]
    for m in first:
        r2.accept(m)
    assert n1.arbiter.bindings["k.orders"].node == "node2"
    assert n2._cache["k.orders"].node == "node2"
    q2 = n2.broker.queues["orders"]
    await until(lambda: q2.count == 3)  # k:0-1 settled
    if not node1_consumer_stays:
        await r1.close()
        q1 = n1.broker.queues.get("orders")  # (empty: auto-deleted)
        await until(lambda: q1 is None or q1.deleted or q1.consumer_count == 0)
    t_close = trio.current_time()
    await r2.close()
    await s2.close()
    assert q2.consumer_count == 0 and q2.count == 3  # not auto-deleted: not empty
    await until(
        lambda: (
            n1.peers["node2"].topology.get("orders") == 0
            and n3.peers["node2"].topology.get("orders") == 0
        )
    )
    return c2, r1, t_close


async def test_by_default_the_group_waits_on_its_instance_for_a_consumer(
    make_broker: BrokerFactory, client: ClientFactory, tmp_path: Path
) -> None:
    apps = await start_cluster(make_broker, tmp_path, {"node1": {}, "node2": {}, "node3": {}})
    n1, n2 = node(apps["node1"]), node(apps["node2"])
    c2, r1, _ = await group_on_node2_then_its_consumer_leaves(apps, client)
    binding = n1.arbiter.bindings["k.orders"]
    q2 = n2.broker.queues["orders"]
    s3 = await (await client(apps["node3"])).sender("orders")
    await s3.send_many([gmsg("k", i) for i in range(5, 8)])
    await until(lambda: q2.count == 6)  # forwarded to node2, waiting there
    s1 = await (await client(apps["node1"])).sender("orders")
    await s1.send(gmsg("k", 8))  # the arbiter's own entry: node2 as well
    await until(lambda: q2.count == 7)
    await trio.sleep(0.5)
    assert n1.arbiter.bindings["k.orders"] is binding and n2.consumerless_released == 0
    await r1.expect_none(0.2)  # never redistributed to node1's consumer
    r2 = await c2.receiver("orders", credit=100)
    assert [m.body for m in await r2.receive_n(7)] == [f"k:{i}" for i in range(2, 9)]


async def test_consumerless_timeout_releases_the_group_and_keeps_queued_messages(
    make_broker: BrokerFactory, client: ClientFactory, tmp_path: Path
) -> None:
    arbiter: dict[str, Any] = {"grouping_consumerless_timeout": 500}
    apps = await start_cluster(make_broker, tmp_path, {"node1": arbiter, "node2": {}, "node3": {}})
    n1, n2, n3 = (node(apps[n]) for n in ("node1", "node2", "node3"))
    c2, r1, t_close = await group_on_node2_then_its_consumer_leaves(apps, client)
    await until(lambda: "k.orders" not in n1.arbiter.bindings)
    assert trio.current_time() - t_close >= 0.5  # not before the timeout without consumer
    await until(lambda: "k.orders" not in n2._cache)  # un-proposed on the entry node
    assert n1.status()["consumerlessReleased"] == 1

    s3 = await (await client(apps["node3"])).sender("orders")
    await s3.send(gmsg("k", 5))  # proposed afresh: node1 is the instance with a consumer
    assert (await r1.receive()).body == "k:5"
    assert n1.arbiter.bindings["k.orders"].node == "node1"
    assert n3._cache["k.orders"].node == "node1"
    q2 = n2.broker.queues["orders"]
    assert q2.count == 3  # k:2-4 stay on the old instance, not lost
    r2 = await c2.receiver("orders", credit=100)
    assert [m.body for m in await r2.receive_n(3)] == ["k:2", "k:3", "k:4"]


async def test_consumerless_timeout_waits_for_a_consumer_elsewhere(
    make_broker: BrokerFactory, client: ClientFactory, tmp_path: Path
) -> None:
    arbiter: dict[str, Any] = {"grouping_consumerless_timeout": 300}
    apps = await start_cluster(make_broker, tmp_path, {"node1": arbiter, "node2": {}, "node3": {}})
    n1 = node(apps["node1"])
    await group_on_node2_then_its_consumer_leaves(apps, client, node1_consumer_stays=False)
    binding = n1.arbiter.bindings["k.orders"]
    await trio.sleep(1.0)  # more than three timeouts, no consumer anywhere: kept
    assert n1.arbiter.bindings.get("k.orders") is binding
    c3 = await client(apps["node3"])
    r3 = await c3.receiver("orders", credit=100)  # a consumer elsewhere: released
    await until(lambda: "k.orders" not in n1.arbiter.bindings)
    s3 = await c3.sender("orders")
    await s3.send(gmsg("k", 5))
    assert (await r3.receive()).body == "k:5"
    assert n1.arbiter.bindings["k.orders"].node == "node3"
