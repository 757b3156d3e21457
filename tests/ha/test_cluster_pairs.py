"""A cluster node run as a primary/backup pair (issue 23), as real processes with a
real ZooKeeper on 127.0.0.1.

Three cluster nodes elect their grouping arbiter in ZooKeeper: node2 (started first,
the arbiter), node3 (its backup arbiter) and node1, run as a pair (a primary and a
backup member sharing the node id, their lease in the same ZooKeeper). node2 and node3
name node1 by both members' addresses (``node1=host:port|host:port``). Consumers on
node1 and node3 own the groups; producers on node2 and node3 send durable grouped
messages, so node1's groups are forwarded to it through the bridges. Mid-stream the
live primary of node1 is SIGKILLed; its backup takes over (same node id, next epoch),
the peers' links find it at its own address and the forwarded messages resume to it;
node1's consumer fails over to the backup's address, as a client with a failover
list does. A third producer sends through node1 itself (answered once a message is in
node1's bridge, ``cluster_accept_after_forward = false`` there, so what the bridge to
node3 holds at the kill is the backup's to forward) and, when the live member dies,
fails over to the other member and sends again what was not answered.

Checked from the clients' own records: every accepted message is delivered; no group
is consumed by two consumers in overlapping intervals (node1's groups stay bound to
node1 across the takeover: the arbiter's bindings name the node id, which does not
change); first deliveries are in order per (group, producer). Repeats are allowed
(at least once): messages node1 had delivered but whose settlement the backup never
got are delivered again, and a forwarded message the old primary stored but whose
acknowledgement the sending node never got is sent again to the new live member,
whose duplicate window (in memory) does not know it. The audit's plain-Python
reference over the four delivery logs must find nothing lost and no order broken.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Delivery, Message

from amqbroker.core.auth import hash_password
from amqbroker.pipeline.delivery_log_format import SEQ_LIFE_SHIFT
from amqbroker.pipeline.invariants import check
from tests.client import Client, ClientError
from tests.cluster.cluster_helpers import free_port, mgmt
from tests.cluster.test_node_loss import send_round
from tests.cluster.zk_harness import ZooKeeperServer, zk_path, zookeeper  # noqa: F401
from tests.integration.broker_process import BrokerProcess, BrokerProcesses

pytestmark = pytest.mark.timeout(300)

USER = "cluster"
PASSWORD = "cluster-pw"
SESSION_MS = 2000
WAIT = 40.0
GROUPS = [f"g{i}" for i in range(12)]
ROUNDS = 150
KILL_AT = ROUNDS * 3 // 10
PACE = 0.05
MOVER = "pair-producer"  # node1's producer: container-id and link name, kept across
#: the node1 members' data dirs, then the other nodes'
DIRS = ("node1a", "node1b", "node2", "node3")


def gmsg(g: str, k: int, src: str) -> Message:
    b = f"{g}:{k}:{src}"
    return Message(id=b, body=b, group_id=g, group_sequence=k + 1, durable=True)


class Pairs:
    """node1 as a pair (members a and b), node2 and node3 single; their processes."""

    def __init__(
        self, procs: BrokerProcesses, root: Path, nursery: trio.Nursery, zk: str, path: str
    ) -> None:
        self.procs = procs
        self.root = root
        self.nursery = nursery
        self.zk = zk
        self.path = path
        self.ports = {d: free_port() for d in DIRS}
        self.proc: dict[str, BrokerProcess] = {}
        self.clients: list[Client] = []

    def addresses(self, node: str) -> str:
        members = ("node1a", "node1b") if node == "node1" else (node,)
        return "|".join(f"127.0.0.1:{self.ports[m]}" for m in members)

    def env(self, member: str) -> dict[str, str]:
        node = member[:5]
        peers = ",".join(
            f"{n}={self.addresses(n)}" for n in ("node1", "node2", "node3") if n != node
        )
        env = {
            "AMQBROKER_CLUSTER_NODE_ID": node,
            "AMQBROKER_CLUSTER_PEERS": peers,
            "AMQBROKER_CLUSTER_GROUPING": "REMOTE",
            "AMQBROKER_CLUSTER_ZOOKEEPER": self.zk,
            "AMQBROKER_CLUSTER_ZOOKEEPER_PATH": self.path,
            "AMQBROKER_CLUSTER_ZOOKEEPER_SESSION_TIMEOUT": str(SESSION_MS),
            "AMQBROKER_CLUSTER_ZOOKEEPER_RECONNECT_MAX_DELAY": "200",
            "AMQBROKER_CLUSTER_USER": USER,
            "AMQBROKER_CLUSTER_PASSWORD": PASSWORD,
            "AMQBROKER_USERS": json.dumps({USER: hash_password(PASSWORD, iterations=1000)}),
            "AMQBROKER_CLUSTER_RECONNECT_INITIAL": "0.05",
            "AMQBROKER_CLUSTER_RECONNECT_MAX": "0.5",
            "AMQBROKER_CLUSTER_NODE_TIMEOUT": "2",
            "AMQBROKER_CLUSTER_TOPOLOGY_PERIOD": "0.05",
            "AMQBROKER_GROUPING_TIMEOUT": "10000",
            "AMQBROKER_SHUTDOWN_TIMEOUT": "2",
            "AMQBROKER_STORE_SYNC": "false",  # a SIGKILL keeps the page cache
            "AMQBROKER_HA_ACK_TIMEOUT": "3",
            "AMQBROKER_IDLE_TIMEOUT": "4",
            "AMQBROKER_DELIVERY_LOG": "true",
        }
        if node == "node1":
            env["AMQBROKER_HA_ROLE"] = "primary" if member == "node1a" else "backup"
            # node1 answers its own producer once a message is in its bridge: what it
            # holds there for node3 at the kill is forwarded by the new live member
            env["AMQBROKER_CLUSTER_ACCEPT_AFTER_FORWARD"] = "false"
        return env

    async def start(self, member: str) -> BrokerProcess:
        bp = await self.procs.spawn(
            ["run", "--port", str(self.ports[member]), "--data-dir", str(self.root / member)],
            env=self.env(member),
        )
        self.proc[member] = bp
        return bp

    async def connect(self, member: str, container: str | None = None) -> Client:
        c = await Client.connect(self.ports[member], nursery=self.nursery, container=container)
        self.clients.append(c)
        return c

    async def status(self, member: str) -> dict[str, Any]:
        async with await self.connect(member) as c:
            return dict(await mgmt(c, "clusterStatus", "org.amqbroker.cluster"))

    async def wait_status(self, member: str, pred: Any, what: str) -> dict[str, Any]:
        try:
            with trio.fail_after(WAIT):
                while True:  # another process's state: polled, bounded
                    try:
                        st = await self.status(member)
                    except (ClientError, OSError):
                        st = None
                    if st is not None and pred(st):
                        return st
                    await trio.sleep(0.05)
        except trio.TooSlowError:
            raise AssertionError(f"{what}: last status {st}") from None

    async def bindings(self, member: str) -> dict[str, str]:
        async with await self.connect(member) as c:
            rows = await mgmt(c, "groupingBindings", "org.amqbroker.grouping")
        return {str(b["key"]).rsplit(".", 1)[0]: str(b["node"]) for b in rows}


class Session:
    """A consumer of one node, accepting everything, in arrival order; on node1 it
    fails over between the members' addresses (the live one answers)."""

    def __init__(self, node: str, members: tuple[str, ...]) -> None:
        self.node = node
        self.members = members
        #: per connection: (body, delivery count, arrival time)
        self.runs: list[list[tuple[str, int, float]]] = []
        self.connected = trio.Event()

    async def run(self, pairs: Pairs) -> None:
        i = 0
        while True:
            member = self.members[i % len(self.members)]
            i += 1
            try:
                c = await pairs.connect(member)
                r = await c.receiver("orders", credit=5000)
            except (ClientError, OSError):
                await trio.sleep(0.1)
                continue
            got: list[tuple[str, int, float]] = []
            self.runs.append(got)
            self.connected.set()
            try:
                while True:
                    m = await r.receive(timeout=3600)
                    r.accept(m)
                    got.append((str(m.body), int(m.message.delivery_count), time.monotonic()))
            except ClientError:
                c.abort()  # its node went away: the next member

    def bodies(self) -> set[str]:
        return {b for run in self.runs for b, _, _ in run}


@pytest.fixture
async def pairs(
    nursery: trio.Nursery,
    tmp_path: Path,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> Any:
    procs = BrokerProcesses(nursery, cwd=tmp_path)
    p = Pairs(procs, tmp_path, nursery, zookeeper.hosts, zk_path)
    try:
        yield p
    finally:
        for c in p.clients:
            c.abort()
        await procs.aclose()


async def test_a_pair_nodes_backup_takes_over_its_groups_and_forwarded_messages(
    pairs: Pairs, nursery: trio.Nursery
) -> None:
    # node2 first: the arbiter; node3 its backup arbiter; node1 a follower
    await pairs.start("node2")
    st = await pairs.wait_status("node2", lambda s: s["isArbiter"], "node2 elected")
    epoch = int(st["epoch"])
    await pairs.start("node3")
    primary = await pairs.start("node1a")
    await primary.wait_for_line(r"is LIVE at epoch \d+ ", timeout=WAIT)
    backup = await pairs.start("node1b")
    await backup.wait_for_line(r"HA backup: in sync with the primary", timeout=WAIT)
    await primary.wait_for_line(r"HA primary: backup at .* is in sync", timeout=WAIT)
    for m in ("node1a", "node2", "node3"):
        await pairs.wait_status(
            m,
            lambda s: s["arbiter"] == "node2" and all(p["link"] == "up" for p in s["peers"]),
            f"{m} linked, following node2",
        )
    # the standby member opens no listener: only the live one answers
    assert not any("listening on amqp://" in line for line in backup.stderr_lines)

    sessions = {
        n: Session(n, ms) for n, ms in (("node1", ("node1a", "node1b")), ("node3", ("node3",)))
    }
    for s in sessions.values():
        nursery.start_soon(s.run, pairs)
        with trio.fail_after(WAIT):
            await s.connected.wait()
    await pairs.wait_status(
        "node2",
        lambda s: (
            {p["node"]: p["queues"].get("orders", 0) for p in s["peers"]}
            == {"node1": 1, "node3": 1}
        ),
        "node2 sees the consumers of node1 and node3",
    )
    await pairs.wait_status(
        "node3",
        lambda s: {p["node"]: p["queues"].get("orders", 0) for p in s["peers"]}.get("node1") == 1,
        "node3 sees the consumer of node1",
    )

    producers = ("node2", "node3")
    accepted: dict[str, list[str]] = {n: [] for n in (*producers, "node1")}
    resent: list[int] = []
    moved = trio.Event()
    refused: list[tuple[str, Any]] = []
    round_done = dict.fromkeys(producers, -1)
    first_round = trio.Event()

    async def produce(node: str) -> None:
        async with await pairs.connect(node) as c:
            snd = await c.sender("orders")
            if node != producers[0]:
                await first_round.wait()
            for k in range(ROUNDS):
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

    async with trio.open_nursery() as prod:
        for n in producers:
            prod.start_soon(produce, n)

        async def produce_on_the_pair() -> None:
            """node1's own producer: when the live member dies it connects to the other
            member and sends again, in order, what was not answered `accepted`, as a
            failover client does (those may be stored twice: at least once)."""
            c = await pairs.connect("node1a", container=MOVER)
            snd = await c.sender("orders", name=MOVER)
            await first_round.wait()
            for k in range(ROUNDS):
                msgs = [gmsg(g, k, "node1") for g in GROUPS]
                ds: list[Delivery] = []
                try:
                    await send_round(c, snd, msgs, ds)
                except ClientError:
                    assert not moved.is_set()
                    moved.set()
                    c.abort()
                    answered = [
                        m
                        for m, d in zip(msgs, ds, strict=False)
                        if d.remote_state == Delivery.ACCEPTED
                    ]
                    accepted["node1"] += [str(m.body) for m in answered]
                    msgs = [m for m in msgs if m not in answered]
                    resent.append(len(msgs))
                    while True:  # until the backup is live and listens
                        try:
                            c = await pairs.connect("node1b", container=MOVER)
                            snd = await c.sender("orders", name=MOVER)
                            break
                        except (ClientError, OSError):
                            await trio.sleep(0.1)
                    ds = await snd.send_many(msgs, timeout=WAIT)
                for m, d in zip(msgs, ds, strict=True):
                    if d.remote_state == Delivery.ACCEPTED:
                        accepted["node1"].append(str(m.body))
                    else:
                        refused.append((str(m.body), d.remote_state))
                await trio.sleep(PACE)

        prod.start_soon(produce_on_the_pair)
        with trio.fail_after(WAIT):
            while min(round_done.values()) < KILL_AT:  # noqa: ASYNC110 (the producers' progress)
                await trio.sleep(0.01)
        before = await pairs.bindings("node2")
        assert set(before) == set(GROUPS), before
        owned = {g for g, n in before.items() if n == "node1"}
        assert owned, f"node1 owns no group: {before}"
        await primary.crash()  # SIGKILL mid-stream
        killed = time.monotonic()
        await backup.wait_for_line(r"is LIVE at epoch \d+ ", timeout=WAIT)
        await backup.wait_for_line(r"listening on amqp://", timeout=WAIT)
        takeover = time.monotonic() - killed
        # the peers' links find node1 at its backup's address; the arbiter's bindings
        # still name node1
        for m in ("node2", "node3"):
            await pairs.wait_status(
                m,
                lambda s: any(
                    p["node"] == "node1"
                    and p["link"] == "up"
                    and p["address"] == f"127.0.0.1:{pairs.ports['node1b']}"
                    for p in s["peers"]
                ),
                f"{m}'s link to node1 is up at the backup's address",
            )
        during = await pairs.bindings("node2")
        assert {g: during[g] for g in owned if g in during} == dict.fromkeys(
            (g for g in owned if g in during), "node1"
        ), during
        # the arbiter did not move: node1's takeover is not an arbiter takeover
        st = await pairs.status("node2")
        assert st["isArbiter"] and int(st["epoch"]) == epoch, st
        assert min(round_done.values()) < ROUNDS - 10, "traffic ended before the takeover"
    assert takeover <= SESSION_MS / 1000 + 2.0 + 1.0, f"takeover took {takeover:.1f} s"
    assert not refused, refused[:5]
    want = {b for v in accepted.values() for b in v}
    assert moved.is_set(), "node1's producer never had to fail over"
    assert len(want) == (len(producers) + 1) * ROUNDS * len(GROUPS)

    def received() -> set[str]:
        return {b for s in sessions.values() for b in s.bodies()}

    try:
        with trio.fail_after(WAIT):
            while not want <= received():  # noqa: ASYNC110 (the consumers' progress)
                await trio.sleep(0.05)
    except trio.TooSlowError:
        missing = sorted(want - received())
        for m in ("node1b", "node2", "node3"):
            print(m, await pairs.status(m))
            print("\n".join(pairs.proc[m].stderr_lines[-40:]))
        raise AssertionError(
            f"{len(missing)} accepted message(s) never delivered: {missing[:10]}"
        ) from None
    await trio.sleep(0.5)  # late copies, if any, arrive now

    after = await pairs.bindings("node2")
    assert {g: n for g, n in after.items() if g in before} == {
        g: before[g] for g in after if g in before
    }, after
    # no group consumed by two consumers (connections) in overlapping intervals
    spans: dict[str, list[tuple[float, float, str]]] = {g: [] for g in GROUPS}
    for s in sessions.values():
        for i, run in enumerate(s.runs):
            per: dict[str, list[float]] = {}
            for b, _, t in run:
                per.setdefault(b.split(":")[0], []).append(t)
            for g, ts in per.items():
                spans[g].append((min(ts), max(ts), f"{s.node}#{i}"))
    for g, sp in spans.items():
        sp.sort()
        for (_, end, who), (start, _, nxt) in itertools.pairwise(sp):
            assert end < start, f"{g} consumed by {who} and {nxt} at once"
        assert {who.split("#")[0] for _, _, who in sp} == {before[g]}, (g, sp, before[g])
    # first deliveries in order per (group, producer), across a node's connections
    repeats = 0
    for s in sessions.values():
        last: dict[tuple[str, str], int] = {}
        seen: set[str] = set()
        for run in s.runs:
            for b, _, _ in run:
                if b in seen:
                    repeats += 1
                    continue
                seen.add(b)
                g, seq, src = b.split(":")
                assert last.get((g, src), -1) < int(seq), (
                    f"{g} from {src}: seq {seq} after {last[(g, src)]} on {s.node}"
                )
                last[(g, src)] = int(seq)
    # the forwarded messages of node1's groups resumed to the new live member: its
    # consumer's connection to the backup got groups of both producers
    runs = sessions["node1"].runs
    assert len(runs) >= 2, "node1's consumer never failed over"
    after_takeover = {b.split(":")[2] for b, _, _ in runs[-1] if b.split(":")[0] in owned}
    assert set(producers) <= after_takeover, after_takeover
    # node1's bridge to node3 resumed from the backup: node3 got node1's messages of
    # its groups sent before the kill and after the failover
    on3 = [b for run in sessions["node3"].runs for b, _, _ in run if b.endswith(":node1")]
    assert on3, "node3 got nothing from node1"
    print(
        f"takeover {takeover:.2f} s; {len(owned)} group(s) on node1; {len(want)} "
        f"delivered; repeats {repeats}; node1 connections {len(sessions['node1'].runs)}; "
        f"sent again by node1's producer: {sum(resent)}"
    )
    for c in pairs.clients:
        c.abort()
    for m in ("node1b", "node2", "node3"):
        assert await pairs.proc[m].stop() == 0
    records = delivery_logs(pairs.root)
    findings = check(records)
    f = findings.counts()
    print("audit", f)
    for k in ("order_violations", "producer_order", "two_owners", "moves", "late"):
        assert f[k] == 0, (k, f)
    assert f["received_twice"] <= sum(resent), f
    # "lost" by the audit: only a message whose last records are the killed primary's
    # dispatch (its settlement, journaled and mirrored, was still in the delivery log's
    # buffer that the SIGKILL took), and which the consumer did get
    lives = {r["seq"] >> SEQ_LIFE_SHIFT for r in records if r["node"] == "node1"}
    assert len(lives) == 2, lives  # the members' logs: one life each
    killed_life = min(lives)
    for node, _, mid in findings.lost:
        mine = sorted(
            (r for r in records if r["message_id"] == mid and r["node"] == "node1"),
            key=lambda r: r["seq"],
        )
        assert node == "node1" and mid in received(), (node, mid)
        assert {r["seq"] >> SEQ_LIFE_SHIFT for r in mine} == {killed_life}, mine
        assert mine[-1]["event"] == "dispatched", mine


def delivery_logs(root: Path) -> list[dict[str, Any]]:
    """The records of the four members' delivery logs (as `audit_reference` reads)."""
    import pyarrow.parquet as pq

    from amqbroker.pipeline.audit_files import find_files

    files = find_files([str(root / d) for d in DIRS])
    assert not files["jsonl"], files
    return [r for name in files["parquet"] for r in pq.read_table(name).to_pylist()]
