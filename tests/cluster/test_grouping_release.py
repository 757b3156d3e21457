"""GROUPING 7.7 / 7.8 with in-process cluster nodes (issue 15).

Each node is a whole broker (`make_broker`) on a real socket in the test's trio run,
linked to its peers over real AMQP connections; the test looks into `app.cluster`
for the arbiter's table and the REMOTE caches.

* Deleting a queue instance releases its groups cluster-wide: the arbiter drops
  every binding to that instance and un-proposes it on every node; the next message
  of the group is proposed again.
* A binding that names a node this node does not know (a peer list that differs
  between nodes, or a decision log from an older configuration) is force-removed and
  proposed again; when the arbiter keeps answering with such a binding, after
  `grouping_retries` force-removals the message gets the documented rejection, or is
  routed ungrouped with `grouping_timeout_policy = "ungrouped"`.
* A REMOTE node warns when its `grouping_group_timeout` is more than half the
  arbiter's (learnt from the arbiter's announcement), and does not otherwise.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Delivery, Message

from amqbroker.app import BrokerApp
from amqbroker.cluster.arbiter import Binding
from amqbroker.cluster.decisions import BIND, Decision, DecisionLog
from amqbroker.cluster.node import ClusterNode
from amqbroker.core.address import ANYCAST
from tests.cluster.cluster_helpers import free_port
from tests.conftest import BrokerFactory, ClientFactory
from tests.integration import mgmt

pytestmark = pytest.mark.timeout(30)

FAST = {
    "cluster_reconnect_initial": 0.05,
    "cluster_reconnect_max": 0.3,
    "cluster_topology_period": 0.05,
    "cluster_node_timeout": 2.0,
    "grouping_timeout": 3000,
}


async def start_cluster(
    make_broker: BrokerFactory,
    tmp_path: Path,
    nodes: dict[str, dict[str, Any]],
    *,
    extra_peers: dict[str, list[str]] | None = None,
) -> dict[str, BrokerApp]:
    """Start the given nodes (first = LOCAL arbiter) fully meshed; wait until linked."""
    ports = {n: free_port() for n in nodes}
    apps: dict[str, BrokerApp] = {}
    for i, (n, overrides) in enumerate(nodes.items()):
        peers = [f"{p}=127.0.0.1:{ports[p]}" for p in nodes if p != n]
        peers += (extra_peers or {}).get(n, [])
        values: dict[str, Any] = {
            **FAST,
            "port": ports[n],
            "data_dir": tmp_path / n,
            "cluster_node_id": n,
            "cluster_peers": peers,
            "cluster_grouping": "LOCAL" if i == 0 else "REMOTE",
        }
        values.update(overrides)
        apps[n] = await make_broker(**values)
    first = next(iter(nodes))
    with trio.fail_after(10):
        for n, app in apps.items():
            cn = node(app)
            while True:
                linked = all(cn.peers[p].ready for p in nodes if p != n)
                if linked and first in (n, cn.role.leader_id):
                    break
                await trio.sleep(0.02)
    return apps


def node(app: BrokerApp) -> ClusterNode:
    assert app.cluster is not None
    return app.cluster


async def until(pred: Any, timeout: float = 10) -> None:
    with trio.fail_after(timeout):
        while True:
            if pred():
                return
            await trio.sleep(0.02)


async def announcements(apps: dict[str, BrokerApp], source: str, n: int = 3) -> None:
    """`source` announces its topology `n` more times (a node announces when its
    queues change: each round declares a queue there), and every other node has
    received each announcement (and run its checks on it) before the next."""
    for i in range(n):
        peers = [node(app).peers[source] for name, app in apps.items() if name != source]
        seen = [p.announced_at for p in peers]
        b = apps[source].broker
        assert b is not None
        b.create_address(f"announce.probe{i}", ANYCAST, durable=False)
        pairs = list(zip(peers, seen, strict=True))
        await until(lambda pairs=pairs: all(p.announced_at != t for p, t in pairs))


def gmsg(group: str, seq: int) -> Message:
    return Message(body=f"{group}:{seq}", group_id=group, durable=True)


# ------------------------------------------------------------ queue instance deleted


async def test_deleting_a_queue_instance_releases_its_groups_everywhere(
    make_broker: BrokerFactory, client: ClientFactory, tmp_path: Path
) -> None:
    apps = await start_cluster(make_broker, tmp_path, {"node1": {}, "node2": {}, "node3": {}})
    n1, n2, n3 = (node(apps[n]) for n in ("node1", "node2", "node3"))
    c2 = await client(apps["node2"])
    r2 = await c2.receiver("orders", credit=100)
    await until(lambda: n3.peers["node2"].topology.get("orders", 0) > 0)
    c3 = await client(apps["node3"])
    s3 = await c3.sender("orders")
    await s3.send_many([gmsg("g", k) for k in range(3)])  # node3 has no consumer: node2
    assert [m.body for m in await r2.receive_n(3)] == ["g:0", "g:1", "g:2"]
    for m in list(r2.queue):
        r2.accept(m)
    assert n1.arbiter.bindings["g.orders"].node == "node2"
    assert n3._cache["g.orders"].node == "node2"

    # an operator deletes node2's instance of the queue (its consumer is detached)
    admin = await client(apps["node2"])
    gone = await mgmt.request(admin, "DELETE", "orders", type="org.amqbroker.queue", force=True)
    assert gone.status == 204, gone.description
    await until(lambda: "g.orders" not in n1.arbiter.bindings)
    await until(lambda: "g.orders" not in n3._cache)  # the un-proposal reached node3
    assert "g.orders" not in n2._cache

    # the next message of the group is proposed again and lands where a consumer is
    c1 = await client(apps["node1"])
    r1 = await c1.receiver("orders", credit=100)
    await until(lambda: n3.peers["node1"].topology.get("orders", 0) > 0)
    await s3.send(gmsg("g", 3))
    assert (await r1.receive()).body == "g:3"
    assert n1.arbiter.bindings["g.orders"].node == "node1"


async def test_deleting_the_arbiters_own_instance_releases_its_groups(
    make_broker: BrokerFactory, client: ClientFactory, tmp_path: Path
) -> None:
    apps = await start_cluster(make_broker, tmp_path, {"node1": {}, "node2": {}})
    n1, n2 = node(apps["node1"]), node(apps["node2"])
    c1 = await client(apps["node1"])
    r1 = await c1.receiver("orders", credit=100)
    await until(lambda: n2.peers["node1"].topology.get("orders", 0) > 0)
    c2 = await client(apps["node2"])
    s2 = await c2.sender("orders")
    await s2.send(gmsg("h", 0))
    r1.accept(await r1.receive())
    assert n2._cache["h.orders"].node == "node1"
    gone = await mgmt.request(c1, "DELETE", "orders", type="org.amqbroker.queue", force=True)
    assert gone.status == 204, gone.description
    await until(lambda: "h.orders" not in n1.arbiter.bindings)
    await until(lambda: "h.orders" not in n2._cache)


# ------------------------------------------------------ binding names an unknown node


def preload(data_dir: Path, *decisions: Decision) -> None:
    """Write decisions to a node's decision log before it starts."""
    log = DecisionLog(data_dir / "cluster" / "decisions.log", sync=False)
    log.load()
    log.append(list(decisions))
    log.close()


async def test_binding_to_an_unknown_node_is_force_removed_on_the_arbiter(
    make_broker: BrokerFactory,
    client: ClientFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    preload(tmp_path / "node1", Decision(BIND, "g.orders", "node9", "orders", 0))
    apps = await start_cluster(make_broker, tmp_path, {"node1": {}})
    n1 = node(apps["node1"])
    assert n1.arbiter.bindings["g.orders"].node == "node9"
    c = await client(apps["node1"])
    r = await c.receiver("orders", credit=10)
    s = await c.sender("orders")
    caplog.set_level(logging.WARNING, "amqbroker.cluster")
    d = await s.send(gmsg("g", 0))
    assert d.remote_state == Delivery.ACCEPTED
    assert (await r.receive()).body == "g:0"
    assert n1.arbiter.bindings["g.orders"].node == "node1"
    assert "node9" in caplog.text and "force-removed" in caplog.text


async def test_remote_force_removes_a_binding_to_a_node_it_does_not_know(
    make_broker: BrokerFactory,
    client: ClientFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the arbiter knows a node9 (not running) that node2's peer list lacks, and had
    # bound g to it: node2 gets that answer, cannot route there, force-removes it
    preload(tmp_path / "node1", Decision(BIND, "g.orders", "node9", "orders", 0))
    apps = await start_cluster(
        make_broker,
        tmp_path,
        {"node1": {}, "node2": {}},
        extra_peers={"node1": [f"node9=127.0.0.1:{free_port()}"]},
    )
    n1, n2 = node(apps["node1"]), node(apps["node2"])
    c2 = await client(apps["node2"])
    r2 = await c2.receiver("orders", credit=10)
    s2 = await c2.sender("orders")
    caplog.set_level(logging.WARNING, "amqbroker.cluster")
    ds = await s2.send_many([gmsg("g", k) for k in range(3)])
    assert [d.remote_state for d in ds] == [Delivery.ACCEPTED] * 3
    assert [m.body for m in await r2.receive_n(3)] == ["g:0", "g:1", "g:2"]
    assert n1.arbiter.bindings["g.orders"].node == "node2"
    assert n2._cache["g.orders"].node == "node2"
    assert "node9" in caplog.text and "force-removed" in caplog.text


def always_node9(cn: ClusterNode) -> list[int]:
    """Make the arbiter answer every proposal with a binding to node9; count calls."""
    calls = [0]

    async def propose(key: str, node: str, queue: str) -> tuple[Binding, bool]:
        calls[0] += 1
        b = Binding(key, "node9", queue, 0, trio.current_time())
        b.ready.set()
        return b, False

    cn.arbiter.propose = propose  # type: ignore[method-assign]
    return calls


async def test_force_removal_is_bounded_then_the_documented_rejection(
    make_broker: BrokerFactory, client: ClientFactory, tmp_path: Path
) -> None:
    apps = await start_cluster(make_broker, tmp_path, {"node1": {"grouping_retries": 2}})
    calls = always_node9(node(apps["node1"]))
    c = await client(apps["node1"])
    r = await c.receiver("orders", credit=10)
    s = await c.sender("orders")
    d = await s.send(gmsg("g", 0))
    assert d.remote_state == Delivery.REJECTED
    cond = d.remote.condition
    assert cond is not None and cond.description is not None
    assert cond.name == "amqp:internal-error"
    assert "grouping decision failed" in cond.description
    assert "node9" in cond.description and "cluster_peers" in cond.description
    assert calls[0] == 3  # the first proposal and grouping_retries force-removals
    await r.expect_none(0.2)


async def test_force_removal_is_bounded_then_ungrouped_when_configured(
    make_broker: BrokerFactory, client: ClientFactory, tmp_path: Path
) -> None:
    apps = await start_cluster(
        make_broker,
        tmp_path,
        {"node1": {"grouping_retries": 1, "grouping_timeout_policy": "ungrouped"}},
    )
    calls = always_node9(node(apps["node1"]))
    c = await client(apps["node1"])
    r = await c.receiver("orders", credit=10)
    s = await c.sender("orders")
    d = await s.send(gmsg("g", 0))
    assert d.remote_state == Delivery.ACCEPTED
    assert (await r.receive()).body == "g:0"
    assert calls[0] == 2


# ------------------------------------------------------------- the "at most half" rule


async def test_remote_warns_when_its_group_timeout_exceeds_half_the_arbiters(
    make_broker: BrokerFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "amqbroker.cluster")
    apps = await start_cluster(
        make_broker,
        tmp_path,
        {
            "node1": {"grouping_group_timeout": 10000},
            "node2": {"grouping_group_timeout": 6000},  # > 5000: warned
            "node3": {"grouping_group_timeout": 5000},  # = half: fine
        },
    )
    await announcements(apps, "node1")  # a few more: the warning is given once
    warned = [r.getMessage() for r in caplog.records if "more than half" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "node2" in warned[0] and "6000" in warned[0] and "10000" in warned[0]
    assert "at most 5000 ms" in warned[0]


async def test_remote_without_group_timeout_warns_when_the_arbiter_expires_groups(
    make_broker: BrokerFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "amqbroker.cluster")
    apps = await start_cluster(
        make_broker,
        tmp_path,
        {"node1": {"grouping_group_timeout": 10000}, "node2": {}},
    )
    await announcements(apps, "node1")
    warned = [r.getMessage() for r in caplog.records if "more than half" in r.getMessage()]
    assert len(warned) == 1 and "node2" in warned[0], warned


async def test_no_warning_when_the_arbiter_never_expires_groups(
    make_broker: BrokerFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "amqbroker.cluster")
    apps = await start_cluster(
        make_broker, tmp_path, {"node1": {}, "node2": {"grouping_group_timeout": 60000}}
    )
    await announcements(apps, "node1")
    assert "more than half" not in caplog.text
