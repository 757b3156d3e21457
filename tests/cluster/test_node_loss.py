"""A node lost for longer than `cluster_node_timeout` under the default node loss policy
`wait` (issue 20): its groups stay bound to it, their new messages wait in order in
the survivors' bridges, and when it is back every group is still consumed on one queue
instance only, in order per (group, producer).

Two runs with real broker processes:

* a REMOTE node that owns groups and holds stored messages of them (its consumer
  takes only a few) is SIGKILLed mid-traffic, stays down well past the node timeout,
  and is restarted on its data directory;
* the same with the arbiter itself, elected in a real ZooKeeper: the backup takes
  over with the replicated table, and the groups bound to the dead arbiter's queue
  instance wait for it.

Each run checks from the clients' own records: every accepted message is delivered;
each group reaches exactly the node it was bound to before the loss; the first
deliveries of each (group, producer) are in sending order across the consumer sessions
of that node (a message the dead node had delivered but not settled is delivered again
after the restart: such repeats are not first deliveries); during the outage the
arbiter's `clusterStatus` reports the groups as waiting for the lost node, and its
bindings do not change.

Two producers send through the surviving nodes; a third sends through the victim and,
when it dies, reconnects to a survivor and sends again what the victim had not
answered, as a failover client does. With `cluster_accept_after_forward` (the default)
the victim answers a message of a group owned elsewhere only once the owner has it, so
none of that producer's accepted messages can wait in the dead node's bridge while its
newer ones overtake them (GROUPING 7.11); its unanswered ones are sent twice (at least
once). A message the dead node (or the owner it forwarded to) had stored before its
answer was lost is then delivered twice: the second copy counts no failed attempt
(delivery-count 0), so the checks tell such copies, allowed only for the resent
messages, from redeliveries, which must count the attempt the node's death cost.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Delivery, Message

from tests.client import Client, ClientError, Sender
from tests.cluster.cluster_helpers import (
    CLEAN,
    NODES,
    Cluster,
    Session,
    TcpProxy,
    audit,
    audit_reference,
    findings,
    mgmt,
    running_cluster,
    zk_env,
)
from tests.cluster.test_failover import start_elected, wait_status
from tests.cluster.zk_harness import ZooKeeperServer

pytestmark = pytest.mark.timeout(400)

GROUPS = [f"g{i}" for i in range(12)]
MOVER = "moving-producer"  # container-id and link name, kept across its failover


def gmsg(g: str, k: int, src: str) -> Message:
    """Round `k` of group `g` from producer `src`: its id is its body, as a failover
    client's resend keeps its message-id; its group-sequence follows the round."""
    b = f"{g}:{k}:{src}"
    return Message(id=b, body=b, group_id=g, group_sequence=k + 1, durable=True)


ROUNDS = 200
KILL_AT = ROUNDS * 3 // 10  # at 30 % of the traffic, as in the issue
PACE = 0.05
NODE_TIMEOUT = 2.0
DOWN_FOR = NODE_TIMEOUT + 2.5  # the node stays down well past the node timeout
STALLED = 20  # credit of the doomed node's consumer: the rest stays stored there
UNSETTLED = 3  # of which it leaves the last ones unsettled when its node dies
WAIT = 40.0


async def bindings(cluster: Cluster, node: str) -> dict[str, dict[str, Any]]:
    async with await cluster.connect(node) as c:
        rows = await mgmt(c, "groupingBindings", "org.amqbroker.grouping")
    return {str(b["key"]).rsplit(".", 1)[0]: dict(b) for b in rows}


async def send_round(c: Client, snd: Sender, msgs: list[Message], ds: list[Delivery]) -> None:
    """Send `msgs` and wait for their outcomes; `ds` holds the deliveries sent so far
    when the connection is lost midway."""
    await c._wait(lambda: snd.credit >= len(msgs), WAIT)
    ds.extend(snd.send_nowait(m) for m in msgs)
    await c._flush()
    await c._wait(lambda: all(d.settled or d.remote_state for d in ds), WAIT)


async def run_node_loss(
    cluster: Cluster,
    nursery: trio.Nursery,
    *,
    victim: str,
    arbiter_after: str,
    consumers: tuple[str, ...],
    producers: tuple[str, str],
    rounds: int = ROUNDS,
    down_for: float = DOWN_FOR,
) -> str:
    """Kill `victim` mid-traffic, keep it down for DOWN_FOR s, restart it, check.

    The first producer has no local consumer: its first round, sent before the other
    producer starts, spreads the groups round robin over the consumers' nodes."""
    sessions: list[Session] = []
    for n in consumers:
        s = (
            Session(n, credit=STALLED, settle_first=STALLED - UNSETTLED)
            if n == victim
            else Session(n)
        )
        await nursery.start(s.run, cluster)
        sessions.append(s)
    await cluster.wait_announced("orders", dict.fromkeys(consumers, 1))
    accepted: dict[str, list[str]] = {n: [] for n in (*producers, victim)}
    refused: list[tuple[str, Any]] = []
    round_done = dict.fromkeys(producers, -1)
    first_round = trio.Event()
    moved = trio.Event()
    resent: list[int] = []
    #: the bodies the moving producer sent twice (its dead node may have stored them)
    resent_bodies: set[str] = set()

    async def produce(node: str) -> None:
        async with await cluster.connect(node) as c:
            snd = await c.sender("orders")
            if node != producers[0]:
                await first_round.wait()
            for k in range(rounds):
                msgs = [gmsg(g, k, node) for g in GROUPS]
                ds = await snd.send_many(msgs, timeout=WAIT)
                for m, d in zip(msgs, ds, strict=True):
                    if d.remote_state == Delivery.ACCEPTED:
                        accepted[node].append(str(m.body))
                    else:
                        refused.append((str(m.body), d.remote_state))
                round_done[node] = k
                first_round.set()
                await trio.sleep(PACE)

    async def produce_moving() -> None:
        """The victim's own producer: when its node dies it reconnects to a survivor
        and sends again, in order, what the victim had not answered `accepted`, then
        goes on (GROUPING 7.11: it must not overtake its own messages)."""
        c = await cluster.connect(victim, container=MOVER)
        snd = await c.sender("orders", name=MOVER)
        await first_round.wait()
        for k in range(rounds):
            msgs = [gmsg(g, k, victim) for g in GROUPS]
            ds: list[Delivery] = []
            try:
                await send_round(c, snd, msgs, ds)
            except ClientError:  # the victim died: fail over
                assert not moved.is_set()
                moved.set()
                answered = [
                    m for m, d in zip(msgs, ds, strict=False) if d.remote_state == Delivery.ACCEPTED
                ]
                accepted[victim] += [str(m.body) for m in answered]
                msgs = [m for m in msgs if m not in answered]
                resent.append(len(msgs))
                resent_bodies.update(str(m.body) for m in msgs)
                c = await cluster.connect(producers[0], container=MOVER)
                snd = await c.sender("orders", name=MOVER)
                ds = await snd.send_many(msgs, timeout=WAIT)
            for m, d in zip(msgs, ds, strict=True):
                if d.remote_state == Delivery.ACCEPTED:
                    accepted[victim].append(str(m.body))
                else:
                    refused.append((str(m.body), d.remote_state))
            await trio.sleep(PACE)
        c.abort()

    waiting: dict[str, Any] = {}
    async with trio.open_nursery() as prod:
        for n in producers:
            prod.start_soon(produce, n)
        prod.start_soon(produce_moving)
        with trio.fail_after(WAIT):
            while True:  # polled: the producers' progress, not an event
                if min(round_done.values()) >= KILL_AT:
                    break
                await trio.sleep(0.01)
        before = await bindings(cluster, arbiter_after)
        assert set(before) == set(GROUPS)
        owned = {g for g, b in before.items() if b["node"] == victim}
        assert owned, f"{victim} owns no group: {before}"
        cluster.proc[victim].kill()
        killed_at = trio.current_time()
        # past the node timeout the arbiter reports the groups as waiting for the victim
        with trio.fail_after(WAIT):
            while True:
                try:
                    st = await cluster.status(arbiter_after)
                except ClientError:
                    st = {}
                rows = [w for w in st.get("waitingFor", ()) if w["node"] == victim]
                if st.get("isArbiter") and rows and rows[0]["groups"] == len(owned):
                    waiting = rows[0]
                    break
                await trio.sleep(0.05)
        assert st["nodeLossPolicy"] == "wait"
        during = await bindings(cluster, arbiter_after)
        # (an idle group of a live node may expire with grouping_group_timeout: it is
        # then unbound, never bound elsewhere)
        assert all(during[g]["node"] == b["node"] for g, b in before.items() if g in during), (
            "a group moved while its node was lost"
        )
        assert all(during.get(g, {}).get("waitingFor") == victim for g in owned), during
        await trio.sleep(max(0.0, killed_at + down_for - trio.current_time()))
        still = await bindings(cluster, arbiter_after)
        assert all(still.get(g, {}).get("node") == victim for g in owned), (
            "a group of the lost node was released while it was down",
            still,
        )
        if rounds == ROUNDS:
            assert min(round_done.values()) < ROUNDS - 20, "traffic ended before the restart"
        await cluster.start_node(victim)
        s2 = Session(victim)
        await nursery.start(s2.run, cluster)
        sessions.append(s2)
    assert not refused, refused[:5]

    assert moved.is_set(), "the victim's producer never had to move"
    want = {b for v in accepted.values() for b in v}
    assert len(want) == (len(producers) + 1) * rounds * len(GROUPS)

    def received() -> set[str]:
        return {b for s in sessions for b in s.bodies}

    try:
        with trio.fail_after(WAIT):
            while True:
                if want <= received():
                    break
                await trio.sleep(0.05)
    except trio.TooSlowError:
        missing = sorted(want - received())
        for n in ("node1", "node2", "node3"):
            try:
                print(n, await cluster.status(n))
            except (ClientError, OSError) as exc:
                print(n, "no status:", exc)
            print("\n".join(cluster.proc[n].stderr_lines[-40:]))
        raise AssertionError(f"{len(missing)} accepted message(s) never delivered") from None
    await trio.sleep(0.3)  # late copies, if any, arrive now

    after = await bindings(cluster, arbiter_after)
    assert all(after[g]["node"] == b["node"] for g, b in before.items() if g in after), after
    # one node per group: the one it was bound to before the loss
    where: dict[str, set[str]] = {g: set() for g in GROUPS}
    for s in sessions:
        for b in s.bodies:
            where[b.split(":")[0]].add(s.node)
    for g in GROUPS:
        assert where[g] == {before[g]["node"]}, (g, where[g], before[g])
    # first deliveries in order per (group, producer), across a node's sessions in turn
    repeats = 0
    repeat_counts: list[int] = []
    #: repeats that are a second copy (delivery-count 0), not a redelivery
    copies: list[str] = []
    for node in consumers:
        last: dict[tuple[str, str], int] = {}
        seen: set[str] = set()
        for s in sessions:
            if s.node != node:
                continue
            for b, count in zip(s.bodies, s.counts, strict=True):
                if b in seen:
                    repeats += 1
                    if count == 0:
                        copies.append(b)
                    else:
                        repeat_counts.append(count)
                    continue
                seen.add(b)
                g, seq, src = b.split(":")
                assert last.get((g, src), -1) < int(seq), (
                    f"{g} from {src}: seq {seq} after {last[(g, src)]} on {node}"
                )
                last[(g, src)] = int(seq)
    # unsettled when its node died: delivered again, counting that failed attempt
    assert len(repeat_counts) >= UNSETTLED, (repeat_counts, copies)
    # a repeat that counts no failed attempt is a second copy: only of a message the
    # moving producer sent again because its dead node had not answered it (the node
    # had stored it, or its owner had, before the answer was lost), once at most
    assert set(copies) <= resent_bodies, (sorted(set(copies) - resent_bodies), repeat_counts)
    assert len(copies) == len(set(copies)), copies
    for s in sessions:
        if s.client is not None:
            s.client.abort()
    return Outcome(
        f"{len(owned)} group(s) waited for {victim} ({waiting['bridgeDepth']} message(s) "
        f"in the reporting node's bridge); {len(want)} delivered; repeats after restart: "
        f"{repeats} ({len(copies)} second copies of resent messages); sent twice by the "
        f"moving producer: {sum(resent)}",
        sum(resent),
    )


@dataclass
class Outcome:
    report: str
    #: messages the moving producer sent again through a survivor
    resent: int


async def audit_agrees(cluster: Cluster, resent: int, *, spark: bool = False) -> None:
    """Stop the nodes (their delivery logs flushed) and audit the three logs, with
    `amqbroker audit` (`spark`: a minute) or its plain-Python reference: nothing
    lost, no order broken (per queue instance, per producer across nodes), one owner
    per group, no group moved; the moving producer's resent messages that the victim
    also forwarded when it came back are its only duplicates (at least once)."""
    for n in NODES:
        await cluster.proc[n].stop()
    f = findings((await audit(cluster))[1]) if spark else audit_reference(cluster)
    assert {k: f[k] for k in CLEAN} == dict.fromkeys(CLEAN, 0), f
    assert f["received_twice"] <= resent, f


@pytest.fixture
def cluster_env() -> dict[str, str]:
    return {"AMQBROKER_CLUSTER_NODE_TIMEOUT": str(NODE_TIMEOUT), "AMQBROKER_DELIVERY_LOG": "true"}


async def test_a_lost_remote_nodes_groups_wait_for_it_in_order(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    await cluster.start()
    await cluster.wait_linked()
    out = await run_node_loss(
        cluster,
        nursery,
        victim="node3",
        arbiter_after="node1",
        consumers=("node2", "node3"),
        producers=("node1", "node2"),
    )
    print(out.report)
    await audit_agrees(cluster, out.resent)


@pytest.fixture
async def zc(
    nursery: trio.Nursery, tmp_path: Path, zookeeper: ZooKeeperServer, zk_path: str
) -> AsyncIterator[Cluster]:
    env = zk_env(zookeeper.hosts, zk_path) | {
        "AMQBROKER_CLUSTER_NODE_TIMEOUT": str(NODE_TIMEOUT),
        "AMQBROKER_DELIVERY_LOG": "true",
    }
    async with running_cluster(nursery, tmp_path, env) as c:
        yield c


async def test_a_lost_arbiters_groups_wait_for_it_after_the_takeover(
    zc: Cluster, nursery: trio.Nursery
) -> None:
    await start_elected(zc)
    out = await run_node_loss(
        zc,
        nursery,
        victim="node1",
        arbiter_after="node2",
        consumers=("node1", "node2"),
        producers=("node3", "node2"),
    )
    print(out.report)
    await wait_status(zc, "node1", lambda s: s["arbiter"] == "node2", "node1 follows node2")
    await audit_agrees(zc, out.resent, spark=True)


async def test_cut_links_to_a_node_keep_its_groups_there_in_order(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    """node1 -> node3 and node2 -> node3 go through proxies that are cut for longer
    than the node timeout while both producers send: node3 stays up (its own links
    work) and keeps its groups; their messages wait in the bridges and follow, in
    order, once the links are restored."""
    proxies = {}
    for src in ("node1", "node2"):
        proxies[src] = TcpProxy(cluster.ports["node3"])
        await nursery.start(proxies[src].run)
        cluster.peer_override[(src, "node3")] = proxies[src].port
    await cluster.start()
    await cluster.wait_linked()
    sessions = [Session("node2"), Session("node3")]
    for s in sessions:
        await nursery.start(s.run, cluster)
    await cluster.wait_announced("orders", {"node2": 1, "node3": 1})
    producers = ("node1", "node2")
    accepted: dict[str, list[str]] = {n: [] for n in producers}
    round_done = dict.fromkeys(producers, -1)
    first_round = trio.Event()

    async def produce(node: str) -> None:
        async with await cluster.connect(node) as c:
            snd = await c.sender("orders")
            if node != producers[0]:
                await first_round.wait()
            for k in range(ROUNDS):
                msgs = [gmsg(g, k, node) for g in GROUPS]
                ds = await snd.send_many(msgs, timeout=WAIT)
                assert all(d.remote_state == Delivery.ACCEPTED for d in ds)
                accepted[node] += [str(m.body) for m in msgs]
                round_done[node] = k
                first_round.set()
                await trio.sleep(PACE)

    async with trio.open_nursery() as prod:
        for n in producers:
            prod.start_soon(produce, n)
        with trio.fail_after(WAIT):
            while True:
                if min(round_done.values()) >= KILL_AT:
                    break
                await trio.sleep(0.01)
        before = await bindings(cluster, "node1")
        on3 = {g for g, b in before.items() if b["node"] == "node3"}
        assert on3, before
        for p in proxies.values():
            p.cut()
        with trio.fail_after(WAIT):
            while True:
                st = await cluster.status("node1")
                if [w for w in st["waitingFor"] if w["node"] == "node3" and w["groups"]]:
                    break
                await trio.sleep(0.05)
        await trio.sleep(1.0)  # well past the node timeout, traffic going on
        during = await bindings(cluster, "node1")
        assert {g: b["node"] for g, b in during.items()} == {
            g: b["node"] for g, b in before.items()
        }
        for p in proxies.values():
            p.restore()
    want = {b for v in accepted.values() for b in v}
    with trio.fail_after(WAIT):
        while True:
            if want <= {b for s in sessions for b in s.bodies}:
                break
            await trio.sleep(0.05)
    for s in sessions:
        last: dict[tuple[str, str], int] = {}
        for b in s.bodies:
            g, seq, src = b.split(":")
            assert before[g]["node"] == s.node, (g, s.node)
            assert last.get((g, src), -1) < int(seq), f"{g} from {src} out of order"
            last[(g, src)] = int(seq)
        if s.client is not None:
            s.client.abort()
    await audit_agrees(cluster, 0)


async def test_a_lost_nodes_idle_groups_outlive_grouping_group_timeout(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    """Traffic stops right after the kill and the node stays down for several
    grouping_group_timeout: the arbiter's reaper must not expire the groups bound to
    it (their messages still wait in the bridges and in its store), or the next
    messages would be decided elsewhere and overtake them."""
    cluster.extra_env |= {
        "AMQBROKER_GROUPING_GROUP_TIMEOUT": "1000",
        "AMQBROKER_GROUPING_REAPER_PERIOD": "200",
    }
    await cluster.start()
    await cluster.wait_linked()
    out = await run_node_loss(
        cluster,
        nursery,
        victim="node3",
        arbiter_after="node1",
        consumers=("node2", "node3"),
        producers=("node1", "node2"),
        rounds=KILL_AT + 10,
        down_for=NODE_TIMEOUT + 4.0,
    )
    print(out.report)
    await audit_agrees(cluster, out.resent)
