"""Arbiter failover with three broker processes and a real ZooKeeper (issue 15).

node1 starts first and is elected arbiter, node2 second (the backup), node3 third.

* SIGKILL the arbiter while producers on node2 and node3 send grouped messages, old
  groups and new ones: node2 takes over with a higher epoch, every group is consumed
  on exactly one queue instance, in order per (group, producer), nothing accepted is
  lost, and the new arbiter's bindings are those the consumers saw.
* SIGSTOP the arbiter, let node2 take over and decide new groups sent through node3,
  while messages of the same new groups wait, unread, in node1's socket; SIGCONT it:
  node1 must be fenced (it follows node2's epoch and cannot bind those groups
  elsewhere), so each group still has one queue instance.

The tests observe ownership on the consumer side (each message names its group and
producer) and through `groupingBindings`; every wait is bounded.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Delivery, Message

from tests.client import Client, Received
from tests.cluster.cluster_helpers import NODES, Cluster, mgmt, running_cluster, zk_env
from tests.cluster.zk_harness import ZooKeeperServer

pytestmark = pytest.mark.timeout(120)

SESSION_MS = 1000
WAIT = 30.0


@pytest.fixture
async def zc(
    nursery: trio.Nursery, tmp_path: Path, zookeeper: ZooKeeperServer, zk_path: str
) -> AsyncIterator[Cluster]:
    # new groups wait out the takeover instead of being rejected
    env = zk_env(zookeeper.hosts, zk_path, SESSION_MS) | {"AMQBROKER_GROUPING_TIMEOUT": "20000"}
    async with running_cluster(nursery, tmp_path, env) as c:
        yield c


async def wait_status(
    c: Cluster, node: str, pred: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    with trio.fail_after(WAIT):
        while True:
            try:
                st = await c.status(node)
            except Exception:  # not answering yet (starting, or just resumed)
                st = None
            if st is not None and pred(st):
                return st
            await trio.sleep(0.05)


async def start_elected(c: Cluster) -> int:
    """node1 arbiter, node2 backup, node3 follower; the arbiter's epoch."""
    await c.start_node("node1")
    st = await wait_status(c, "node1", lambda s: s["isArbiter"], "node1 elected")
    for n in ("node2", "node3"):
        await c.start_node(n)
        await wait_status(c, n, lambda s: s["arbiter"] == "node1", f"{n} follows node1")
    await c.wait_linked()
    return int(st["epoch"])


def gmsg(group: str, seq: int, src: str) -> Message:
    return Message(body=f"{group}:{seq}:{src}", group_id=group, durable=True)


class Consumers:
    """A receiver on `orders` at each given node, accepting into `got[node]`."""

    def __init__(self) -> None:
        self.got: dict[str, list[Received]] = {}
        self.clients: dict[str, Client] = {}
        self.changed = trio.Event()
        self.scopes: list[trio.CancelScope] = []

    async def open(self, c: Cluster, nodes: tuple[str, ...]) -> None:
        for n in nodes:
            self.clients[n] = await c.connect(n)
            r = await self.clients[n].receiver("orders", credit=10000)
            self.got[n] = []
            c.nursery.start_soon(self._pump, n, r)

    async def _pump(self, n: str, r: Any) -> None:
        scope = trio.CancelScope()
        self.scopes.append(scope)
        with scope:
            while True:
                m = await r.receive(timeout=3600)
                r.accept(m)
                self.got[n].append(m)
                self.changed.set()
                self.changed = trio.Event()

    async def close(self) -> None:
        for scope in self.scopes:
            scope.cancel()
        for c in self.clients.values():
            await c.close()

    def count(self) -> int:
        return sum(len(v) for v in self.got.values())

    async def wait_count(self, total: int) -> None:
        with trio.fail_after(WAIT):
            while self.count() < total:
                await self.changed.wait()

    def check(self) -> dict[str, str]:
        """group -> the one node it was consumed on; asserts order per (group, src)."""
        owner: dict[str, str] = {}
        for n, msgs in self.got.items():
            last: dict[tuple[str, str], int] = {}
            for m in msgs:
                g, seq, src = m.body.split(":")
                assert owner.setdefault(g, n) == n, f"group {g} consumed on {owner[g]} and {n}"
                assert last.get((g, src), -1) < int(seq), f"{g} from {src} out of order on {n}"
                last[(g, src)] = int(seq)
        return owner


async def mgmt_status(
    c: Client, operation: str, props: dict[str, Any], body: Any
) -> tuple[int, Any]:
    """A management request whose non-200 answers the test inspects."""
    reply = await c.receiver(None, dynamic=True, credit=1)
    s = await c.sender("$management")
    await s.send(
        Message(
            id="fence-probe",
            reply_to=reply.address,
            properties={"operation": operation, "type": "org.amqbroker.grouping", **props},
            body=body,
        )
    )
    r = await reply.receive()
    reply.accept(r)
    return int(r.properties["statusCode"]), r.body


def accepted(d: Delivery) -> bool:
    return bool(d.remote_state == Delivery.ACCEPTED)


async def test_sigkill_arbiter_mid_traffic_backup_takes_over_one_instance_per_group(
    zc: Cluster,
) -> None:
    epoch0 = await start_elected(zc)
    consumers = Consumers()
    await consumers.open(zc, ("node2", "node3"))  # node1 dies: own no queue there
    await zc.wait_announced("orders", {"node2": 1, "node3": 1})
    rounds, kill_at = 30, 10
    reached = trio.Event()
    sent: dict[str, list[tuple[Delivery, Message]]] = {}
    killed_at: float | None = None
    new_group_accepted: list[float] = []  # a new group's first send, started after the kill

    async def produce(src: str) -> None:
        client = await zc.connect(src)
        s = await client.sender("orders")
        out = sent.setdefault(src, [])
        for r in range(rounds):
            if r == kill_at:
                reached.set()
            for g in [*(f"old{i}" for i in range(5)), f"new{r}"]:
                m = gmsg(g, r, src)
                started = trio.current_time()
                d = await s.send(m, timeout=WAIT)
                out.append((d, m))
                if g.startswith("new") and killed_at is not None and started >= killed_at:
                    new_group_accepted.append(trio.current_time())
        await client.close()

    async with trio.open_nursery() as n:
        n.start_soon(produce, "node2")
        n.start_soon(produce, "node3")
        await reached.wait()
        zc.proc["node1"].kill()  # SIGKILL the arbiter mid-traffic
        killed_at = trio.current_time()
        st = await wait_status(zc, "node2", lambda s: s["isArbiter"], "node2 takes over")
        assert int(st["epoch"]) > epoch0
    assert new_group_accepted, "no new group was decided after the kill"
    wait_ms = (min(new_group_accepted) - killed_at) * 1000
    print(
        f"failover: a new group waited {wait_ms:.0f} ms from the SIGKILL of the arbiter "
        f"to its first accepted send (ZooKeeper session timeout {SESSION_MS} ms)"
    )

    ok = [m for src in sent.values() for d, m in src if accepted(d)]
    assert len(ok) == sum(len(v) for v in sent.values()), "a send was not accepted"
    await consumers.wait_count(len(ok))
    owner = consumers.check()
    assert len(owner) == 5 + rounds
    async with await zc.connect("node2") as c:
        bindings = await mgmt(c, "groupingBindings", "org.amqbroker.grouping")
    assert {b["key"]: b["node"] for b in bindings} == {f"{g}.orders": o for g, o in owner.items()}
    st3 = await wait_status(zc, "node3", lambda s: s["arbiter"] == "node2", "node3 follows")
    assert int(st3["epoch"]) == int(st["epoch"])
    await consumers.close()


async def test_paused_arbiter_is_fenced_when_it_resumes(zc: Cluster) -> None:
    epoch0 = await start_elected(zc)
    consumers = Consumers()
    await consumers.open(zc, NODES)
    await zc.wait_announced("orders", dict.fromkeys(NODES, 1))
    c1 = await zc.connect("node1")
    s1 = await c1.sender("orders")
    c3 = await zc.connect("node3")
    s3 = await c3.sender("orders")
    for g in ("a", "b", "c"):  # groups decided by node1 before the pause
        await s3.send(gmsg(g, 0, "node3"))

    node1 = zc.proc["node1"]
    node1.proc.send_signal(signal.SIGSTOP)
    try:
        # new groups that node1 will see first when it resumes, unaware it was replaced
        late = [s1.send_nowait(gmsg(f"x{i}", 0, "node1")) for i in range(5)]
        await c1._flush()
        st = await wait_status(zc, "node2", lambda s: s["isArbiter"], "node2 takes over")
        epoch2 = int(st["epoch"])
        assert epoch2 > epoch0
        # what node1 would send when it resumes: a decision of its old epoch is refused
        async with await zc.connect("node2") as probe:
            status, body = await mgmt_status(
                probe,
                "groupingReplicate",
                {"node": "node1"},
                {
                    "kind": "bind",
                    "key": "x0.orders",
                    "node": "node1",
                    "queue": "orders",
                    "epoch": epoch0,
                },
            )
        assert (status, body) == (409, {"epoch": epoch2})
        for i in range(5):  # the same groups, decided by the new arbiter
            await s3.send(gmsg(f"x{i}", 1, "node3"), timeout=WAIT)
        for g in ("a", "b", "c"):
            await s3.send(gmsg(g, 1, "node3"), timeout=WAIT)
    finally:
        node1.proc.send_signal(signal.SIGCONT)

    st1 = await wait_status(
        zc,
        "node1",
        lambda s: not s["isArbiter"] and s["arbiter"] == "node2" and int(s["epoch"]) == epoch2,
        "node1 fenced",
    )
    assert int(st1["epoch"]) == epoch2
    await c1._wait(lambda: all(d.remote_state or d.settled for d in late), WAIT)
    delivered = 3 * 2 + 5 + sum(1 for d in late if accepted(d))
    await consumers.wait_count(delivered)
    owner = consumers.check()  # x0..x4: one instance each, whoever decided first
    assert {f"x{i}" for i in range(5)} <= owner.keys()
    async with await zc.connect("node2") as c:
        bindings = await mgmt(c, "groupingBindings", "org.amqbroker.grouping")
    assert {b["key"]: b["node"] for b in bindings} == {f"{g}.orders": o for g, o in owner.items()}
    await consumers.close()
    for c in (c1, c3):
        await c.close()
