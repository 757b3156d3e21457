"""Three real broker processes on 127.0.0.1 forming a cluster (issue 15 tests).

`Cluster.start` picks free ports, writes nothing to disk but the data directories,
and starts node1 (LOCAL arbiter), node2 and node3 (REMOTE) with `cluster_peers`
pointing at each other; `peer_override` lets a test route one node's link to a peer
through a proxy port instead (`TcpProxy`). `wait_linked` waits until every node
reports every peer link up (via `clusterStatus` on `$management`).
"""

from __future__ import annotations

import json
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from proton import Message

from tests.client import Client, ClientError
from tests.integration.broker_process import BrokerProcess, BrokerProcesses

NODES = ("node1", "node2", "node3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    def __init__(self, procs: BrokerProcesses, root: Path, nursery: trio.Nursery) -> None:
        self.procs = procs
        self.root = root
        self.nursery = nursery
        self.ports = {n: free_port() for n in NODES}
        self.proc: dict[str, BrokerProcess] = {}
        self.peer_override: dict[tuple[str, str], int] = {}
        self.extra_env: dict[str, str] = {}
        self.clients: list[Client] = []

    def env(self, node: str) -> dict[str, str]:
        peers = ",".join(
            f"{p}=127.0.0.1:{self.peer_override.get((node, p), self.ports[p])}"
            for p in NODES
            if p != node
        )
        env = {
            "AMQBROKER_CLUSTER_NODE_ID": node,
            "AMQBROKER_CLUSTER_PEERS": peers,
            "AMQBROKER_CLUSTER_GROUPING": "LOCAL" if node == "node1" else "REMOTE",
            "AMQBROKER_CLUSTER_RECONNECT_INITIAL": "0.05",
            "AMQBROKER_CLUSTER_RECONNECT_MAX": "0.5",
            "AMQBROKER_CLUSTER_NODE_TIMEOUT": "2",
            "AMQBROKER_CLUSTER_TOPOLOGY_PERIOD": "0.05",
            "AMQBROKER_SHUTDOWN_TIMEOUT": "2",
            "AMQBROKER_STORE_SYNC": "false",
        }
        env.update(self.extra_env)
        return env

    async def start_node(self, node: str) -> BrokerProcess:
        bp = await self.procs.start(self.root / node, env=self.env(node), port=self.ports[node])
        self.proc[node] = bp
        return bp

    async def start(self, nodes: tuple[str, ...] = NODES) -> None:
        for n in nodes:
            await self.start_node(n)

    async def connect(self, node: str, container: str | None = None) -> Client:
        c = await Client.connect(self.ports[node], nursery=self.nursery, container=container)
        self.clients.append(c)
        return c

    def abort_clients(self) -> None:
        """Drop every client socket a test left open (a failed test leaves them to the
        garbage collector, whose ResourceWarning would fail some later test)."""
        for c in self.clients:
            c.abort()
        self.clients.clear()

    async def status(self, node: str) -> dict[str, Any]:
        async with await self.connect(node) as c:
            return dict(await mgmt(c, "clusterStatus", "org.amqbroker.cluster"))

    async def wait_linked(self, nodes: tuple[str, ...] = NODES, timeout: float = 15) -> None:
        with trio.fail_after(timeout):
            for n in nodes:
                while True:
                    st = await self.status(n)
                    ups = {p["node"] for p in st["peers"] if p["link"] == "up"}
                    if set(nodes) - {n} <= ups and (n == "node1" or st["arbiter"] == "node1"):
                        break
                    await trio.sleep(0.05)

    async def wait_announced(
        self, queue: str, consumers: dict[str, int], timeout: float = 15
    ) -> None:
        """Until every started node sees, for `queue`, at least `consumers[n]` consumers
        announced by each other node n (clusterStatus: each peer's "queues"); routing
        there takes the peers' consumers into account only once it has seen them."""
        with trio.fail_after(timeout):
            for viewer in self.proc:
                want = {n: k for n, k in consumers.items() if n != viewer}
                while True:
                    st = await self.status(viewer)
                    seen = {p["node"]: p["queues"].get(queue, 0) for p in st["peers"]}
                    if all(seen.get(n, 0) >= k for n, k in want.items()):
                        break
                    await trio.sleep(0.05)


@asynccontextmanager
async def running_cluster(
    nursery: trio.Nursery, root: Path, env: dict[str, str] | None = None
) -> AsyncIterator[Cluster]:
    """A `Cluster` (nothing started yet) whose nodes get `env` on top of the defaults;
    on exit the clients a test left open are aborted and every node is stopped."""
    procs = BrokerProcesses(nursery, cwd=root)
    c = Cluster(procs, root, nursery)
    c.extra_env = dict(env or {})
    try:
        yield c
    finally:
        c.abort_clients()
        await procs.aclose()


def zk_env(hosts: str, path: str, session_ms: int = 1000) -> dict[str, str]:
    """The settings that make the nodes elect the arbiter in ZooKeeper at `hosts`."""
    return {
        "AMQBROKER_CLUSTER_ZOOKEEPER": hosts,
        "AMQBROKER_CLUSTER_ZOOKEEPER_PATH": path,
        "AMQBROKER_CLUSTER_ZOOKEEPER_SESSION_TIMEOUT": str(session_ms),
        "AMQBROKER_CLUSTER_ZOOKEEPER_RECONNECT_MAX_DELAY": "200",
    }


class Session:
    """One consumer connection on one node, accepting what it gets, in arrival order
    (bodies and delivery counts); the messages past `settle_first` it keeps unsettled."""

    def __init__(self, node: str, credit: int = 5000, settle_first: int | None = None) -> None:
        self.node = node
        self.credit = credit
        self.settle_first = settle_first
        self.bodies: list[str] = []
        self.counts: list[int] = []
        self.client: Client | None = None

    async def run(self, cluster: Cluster, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.client = await cluster.connect(self.node)
        r = await self.client.receiver("orders", credit=self.credit)
        task_status.started()
        try:
            while True:
                m = await r.receive(timeout=3600)
                if self.settle_first is None or len(self.bodies) < self.settle_first:
                    r.accept(m)
                self.bodies.append(str(m.body))
                self.counts.append(int(m.message.delivery_count))
        except ClientError:
            return  # the node went away


async def mgmt(c: Client, operation: str, typ: str, body: Any = None) -> Any:
    reply = await c.receiver(None, dynamic=True, credit=1)
    s = await c.sender("$management")
    await s.send(
        Message(
            id=str(uuid.uuid4()),
            reply_to=reply.address,
            properties={"operation": operation, "type": typ},
            body=body,
        )
    )
    r = await reply.receive()
    reply.accept(r)
    props = r.properties
    assert props.get("statusCode") == 200, props
    await s.close()
    await reply.close()
    return r.body


async def audit(cluster: Cluster, nodes: tuple[str, ...] = NODES) -> tuple[int, dict[str, Any]]:
    """`amqbroker audit` (PySpark) over the nodes' delivery logs (started with
    `AMQBROKER_DELIVERY_LOG=true`, stopped so that the logs are flushed): its exit
    code and audit.json."""
    out = cluster.root / "audit-report"
    r = await trio.run_process(
        [
            sys.executable,
            "-m",
            "amqbroker",
            "audit",
            *(str(cluster.root / n) for n in nodes),
            "--out",
            str(out),
            "--format",
            "md",
            "--driver-memory",
            "1g",
            "--shuffle-partitions",
            "4",
        ],
        check=False,
        capture_stdout=True,
        capture_stderr=True,
    )
    if r.returncode not in (0, 1):
        raise AssertionError(f"audit could not run ({r.returncode}): {r.stderr.decode()[-3000:]}")
    return r.returncode, json.loads((out / "audit.json").read_text())


def audit_reference(cluster: Cluster, nodes: tuple[str, ...] = NODES) -> dict[str, int]:
    """The audit's plain-Python reference (`pipeline.invariants.check`, which the
    PySpark audit is tested to agree with) over the nodes' delivery logs: every
    finding's count, as `findings` gives them for `amqbroker audit`. Seconds, where a
    Spark run takes a minute."""
    import pyarrow.parquet as pq

    from amqbroker.pipeline.audit_files import find_files
    from amqbroker.pipeline.invariants import check

    files = find_files([str(cluster.root / n) for n in nodes])
    assert not files["jsonl"], files
    records = [r for name in files["parquet"] for r in pq.read_table(name).to_pylist()]
    return check(records).counts()


#: what the audit of a node-loss run must find none of
CLEAN = (
    "lost",
    "order_violations",
    "producer_order",
    "producer_order_across_entry_nodes",
    "two_owners",
    "moves",
    "late",
)


def findings(report: dict[str, Any]) -> dict[str, int]:
    """audit.json's counts: every invariant's and informational finding's."""
    out = {}
    for part in ("invariants", "info"):
        for name, v in report[part].items():
            if isinstance(v, dict) and "count" in v:
                out[name] = int(v["count"])
    return out


class TcpProxy:
    """A TCP proxy on 127.0.0.1 that the test can cut (drop every connection and
    refuse new ones) and restore, or stall (hold every byte, connections kept open, as
    a congested or hung link does) and resume."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.port = free_port()
        self.enabled = True
        self._flowing = trio.Event()
        self._flowing.set()
        self._scopes: list[trio.CancelScope] = []
        self.connections = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listener = (await trio.open_tcp_listeners(self.port, host="127.0.0.1"))[0]
        task_status.started()
        async with listener, trio.open_nursery() as n:
            while True:
                stream = await listener.accept()
                if not self.enabled:
                    await stream.aclose()
                    continue
                n.start_soon(self._handle, stream)

    async def _handle(self, client: trio.SocketStream) -> None:
        try:
            server = await trio.open_tcp_stream("127.0.0.1", self.target)
        except OSError:
            await client.aclose()
            return
        self.connections += 1
        scope = trio.CancelScope()
        self._scopes.append(scope)
        with scope:
            async with client, server, trio.open_nursery() as n:
                n.start_soon(self._pipe, client, server, n.cancel_scope)
                n.start_soon(self._pipe, server, client, n.cancel_scope)
        self._scopes.remove(scope)

    async def _pipe(
        self, a: trio.SocketStream, b: trio.SocketStream, scope: trio.CancelScope
    ) -> None:
        try:
            async for chunk in a:
                await self._flowing.wait()
                await b.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()

    def cut(self) -> None:
        self.enabled = False
        for scope in self._scopes:
            scope.cancel()

    def restore(self) -> None:
        self.enabled = True

    def stall(self) -> None:
        if self._flowing.is_set():
            self._flowing = trio.Event()

    def resume(self) -> None:
        self._flowing.set()
