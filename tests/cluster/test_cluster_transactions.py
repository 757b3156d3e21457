"""Transactional sends of grouped messages in a cluster (issue 20: one owner cluster-wide).

A transacted JMS session's sends take effect at commit. They must reach the queue
instance that owns their group, like any other send: a grouped message committed on
a node that does not own the group is forwarded to the owner, and a group first seen
in a transaction is decided before its messages take effect. Real broker processes;
consumers on two nodes so that a message delivered on the wrong one is seen.
"""

from __future__ import annotations

import pytest
import trio
from proton import Delivery, Message

from tests.client import coordinator, declare, discharge, txn_send_many, wait_until
from tests.cluster.cluster_helpers import Cluster, Session, mgmt

pytestmark = pytest.mark.timeout(90)

WAIT = 20.0


def gmsg(g: str, k: int) -> Message:
    return Message(body=f"{g}:{k}", group_id=g, durable=True)


async def bound_to(cluster: Cluster, key: str) -> str:
    async with await cluster.connect("node1") as c:
        rows = await mgmt(c, "groupingBindings", "org.amqbroker.grouping")
    return next(str(b["node"]) for b in rows if b["key"] == key)


async def test_committed_grouped_sends_reach_the_groups_owner(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    await cluster.start()
    await cluster.wait_linked()
    sessions = {n: Session(n) for n in ("node2", "node3")}
    for s in sessions.values():
        await nursery.start(s.run, cluster)
    await cluster.wait_announced("orders", {"node2": 1, "node3": 1})
    # bind "a" and "b" with plain sends through node1 (no consumer there)
    async with await cluster.connect("node1") as c1:
        snd = await c1.sender("orders")
        ds = await snd.send_many([gmsg("a", 0), gmsg("b", 0)])
        assert all(d.remote_state == Delivery.ACCEPTED for d in ds)
    owners = {g: await bound_to(cluster, f"{g}.orders") for g in ("a", "b")}
    # a transaction through each consumer node sends both groups, and a new one, "c"
    for k, node in enumerate(("node2", "node3"), start=1):
        async with await cluster.connect(node) as c:
            coord = await coordinator(c)
            snd = await c.sender("orders")
            txn = await declare(coord)
            msgs = [gmsg(g, k) for g in ("a", "b", "c")]
            ds = await txn_send_many(snd, msgs, txn, timeout=WAIT)
            assert all(d.remote_state for d in ds)
            d = await discharge(coord, txn, timeout=WAIT)
            assert d.remote_state == Delivery.ACCEPTED, d.remote.condition
    owners["c"] = await bound_to(cluster, "c.orders")
    want = {f"{g}:{k}" for g in ("a", "b") for k in range(3)} | {"c:1", "c:2"}
    await wait_until(lambda: want <= {b for s in sessions.values() for b in s.bodies}, WAIT)
    for node, s in sessions.items():
        for b in s.bodies:
            g = b.split(":")[0]
            assert owners[g] == node, f"{b} delivered on {node}, its group is bound to {owners[g]}"
    for g in ("a", "b", "c"):
        seqs = [int(b.split(":")[1]) for b in sessions[owners[g]].bodies if b.startswith(g)]
        assert seqs == sorted(seqs), (g, seqs)
