"""Clustered grouping with three real broker processes (issue 15)."""

from __future__ import annotations

import pytest
import trio
from proton import Delivery, Message

from tests.client import Received
from tests.cluster.cluster_helpers import NODES, Cluster, TcpProxy, mgmt

pytestmark = pytest.mark.timeout(60)


def gmsg(group: str, seq: int, src: str) -> Message:
    return Message(body=f"{group}:{seq}:{src}", group_id=group, durable=True)


async def test_groups_from_every_node_land_on_one_instance_in_order(cluster: Cluster) -> None:
    await cluster.start()
    await cluster.wait_linked()
    consumers = {}
    clients = {}
    for n in NODES:
        clients[n] = await cluster.connect(n)
        consumers[n] = await clients[n].receiver("orders", credit=1000)
    await cluster.wait_announced("orders", dict.fromkeys(NODES, 1))
    groups = [f"g{i}" for i in range(12)]
    per_node = 10
    for n in NODES:
        s = await clients[n].sender("orders")
        await s.send_many([gmsg(g, k, n) for k in range(per_node) for g in groups])
    total = len(groups) * per_node * len(NODES)
    got: dict[str, list[Received]] = {n: [] for n in NODES}
    with trio.move_on_after(20):
        while sum(len(v) for v in got.values()) < total:
            for n in NODES:
                r = consumers[n]
                while r.queue:
                    m = r.queue.popleft()
                    r.accept(m)
                    got[n].append(m)
            await trio.sleep(0.02)
    if sum(len(v) for v in got.values()) < total:
        for n in NODES:
            print(n, len(got[n]), await cluster.status(n))
            print("\n".join(cluster.proc[n].stderr_lines[-30:]))
        raise AssertionError("not everything arrived")
    owner: dict[str, str] = {}
    for n, msgs in got.items():
        last: dict[tuple[str, str], int] = {}
        for m in msgs:
            g, seq, src = m.body.split(":")
            assert owner.setdefault(g, n) == n, f"group {g} on {owner[g]} and {n}"
            assert last.get((g, src), -1) < int(seq), f"{g} from {src} out of order on {n}"
            last[(g, src)] = int(seq)
    assert len(owner) == len(groups)
    async with await cluster.connect("node2") as c:
        bindings = await mgmt(c, "groupingBindings", "org.amqbroker.grouping")
    assert {b["key"] for b in bindings} == {f"{g}.orders" for g in groups}
    assert {b["key"]: b["node"] for b in bindings} == {f"{g}.orders": owner[g] for g in groups}
    for c in clients.values():
        await c.close()


async def drain(r, n: int, timeout: float = 15) -> list[Received]:  # type: ignore[no-untyped-def]
    out: list[Received] = []
    with trio.fail_after(timeout):
        while len(out) < n:
            m = await r.receive(timeout)
            r.accept(m)
            out.append(m)
    return out


async def test_ungrouped_prefers_local_consumers_then_balances(cluster: Cluster) -> None:
    await cluster.start()
    await cluster.wait_linked()
    c1, c2, c3 = [await cluster.connect(n) for n in NODES]
    r1 = await c1.receiver("jobs", credit=100)
    r2 = await c2.receiver("jobs", credit=100)
    await cluster.wait_announced("jobs", {"node1": 1, "node2": 1})
    s1 = await c1.sender("jobs")
    await s1.send_many([Message(body=f"a{i}") for i in range(20)])
    assert len(await drain(r1, 20)) == 20
    await r2.expect_none(0.3)  # node1 has a local consumer: nothing left node1
    s3 = await c3.sender("jobs")  # node3 has none: balanced over node1 and node2
    await s3.send_many([Message(body=f"b{i}") for i in range(20)])
    got1 = [m.body for m in await drain(r1, 10)]
    got2 = [m.body for m in await drain(r2, 10)]
    assert sorted(got1 + got2) == sorted(f"b{i}" for i in range(20))
    assert got1 == sorted(got1, key=lambda b: int(b[1:]))  # each instance in order
    for c in (c1, c2, c3):
        await c.close()


async def test_arbiter_timeout_rejects_with_documented_error(cluster: Cluster) -> None:
    cluster.extra_env = {"AMQBROKER_GROUPING_TIMEOUT": "300"}
    await cluster.start(("node2", "node3"))  # no arbiter running
    c = await cluster.connect("node2")
    r = await c.receiver("orders", credit=10)
    s = await c.sender("orders")
    d = await s.send(gmsg("g1", 0, "node2"))
    assert d.remote_state == Delivery.REJECTED
    cond = d.remote.condition
    assert cond.name == "amqp:internal-error"
    assert "grouping decision timed out" in cond.description
    await r.expect_none(0.2)
    # ungrouped traffic is not affected
    await s.send(Message(body="plain"))
    assert (await r.receive()).body == "plain"
    await c.close()


async def test_cut_peer_link_keeps_order_and_loses_nothing(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    proxy = TcpProxy(cluster.ports["node3"])
    await nursery.start(proxy.run)
    cluster.peer_override[("node2", "node3")] = proxy.port
    await cluster.start()
    await cluster.wait_linked()
    c3 = await cluster.connect("node3")
    r3 = await c3.receiver("orders", credit=1000)
    await cluster.wait_announced("orders", {"node3": 1})
    c2 = await cluster.connect("node2")
    s2 = await c2.sender("orders")
    await s2.send_many([gmsg(g, k, "n2") for k in range(10) for g in ("x", "y")])
    proxy.cut()
    # accepted while the link is down: kept on node2's bridge queue
    await s2.send_many([gmsg(g, k, "n2") for k in range(10, 30) for g in ("x", "y")])
    st = await cluster.status("node2")
    assert {p["node"]: p["link"] for p in st["peers"]}["node3"] == "down"
    proxy.restore()
    try:
        got = await drain(r3, 60, timeout=10)
    except trio.TooSlowError:
        print(len(r3.queue), await cluster.status("node2"), proxy.connections)
        print("\n".join(cluster.proc["node2"].stderr_lines[-20:]))
        print("\n".join(cluster.proc["node3"].stderr_lines[-20:]))
        raise
    for g in ("x", "y"):
        seqs = [int(m.body.split(":")[1]) for m in got if m.group_id == g]
        assert seqs == list(range(30)), (g, seqs)
    await r3.expect_none(0.3)  # and no duplicate
    await c2.close()
    await c3.close()
