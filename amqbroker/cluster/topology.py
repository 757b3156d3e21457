"""The cluster's topology: the peers, their links, announcements and requests.

Topology (D11): a full mesh with max-hops 1. For every configured peer this node runs
one outbound AMQP connection (`net.outbound.OutboundDriver` + `protocol.peer`) with
three links: a sender to the peer's `$cluster.inbound` (forwarded messages), a sender
to its `$management` (announcements, grouping proposals / un-proposals, queries) and
a dynamic receiver for the answers (the requests' reply-to). A peer run as a
primary/backup pair (issue 23) is configured with its members' addresses
(``node1=host:port|host:port``): the driver tries them in turn and sticks to the one
that opens (only the live member listens). Everything else knows a peer by its node id
only (bridge queue, bindings, bridge ids, announcements), so a takeover is seen here as
the node's link dropping and coming back. Every node announces,
every `cluster_topology_period` when it changed and whenever a link comes up, which of
its queues have consumers and its grouping role.

Forwarding is store-and-forward: a message for a peer is wrapped (`peer.wrap_forward`:
target queue + bridge id `<node>:<boot>:<seq>`) and enqueued, durable if it was, on the
local bridge queue `$cluster.bridge.<peer>`; the producer is answered once it is
stored there. The bridge queue's only consumer (`BridgeConsumer`) is the link to the
peer: a message is acknowledged in the bridge queue only when the peer accepted it
(after its own sync); when the link drops, unacknowledged messages go back to the head
of the bridge queue in order and are resent on reconnect, the peer drops copies it had
already stored by bridge id. Order per (producer, entry node) holds end to end.

`Topology` owns `peers` (one `Peer` each: link state, what it announced, since when it
is down) and the request/answer plumbing (`request`, `_on_reply`). Lost instances
(7.8): a queue that disappears from a node's announced topology (or from this node's
own) was deleted; `gone` records a peer's deleted queues (routing force-removes a
binding naming one) and the arbiter releases their bindings (`Releaser`).

Invariants
----------
- `Peer.ready` is true exactly while its three links are open; `down_since` is None
  exactly while ready; a bridge queue has a `BridgeConsumer` only while ready.
- A peer's `topology` holds what it last announced (emptied when it is lost); `gone`
  holds the queues it announced and later stopped announcing, until announced again.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import trio

from amqbroker.core.address import ANYCAST, Address
from amqbroker.core.broker import ROUTED, ROUTED_SYNC
from amqbroker.core.consumer import Consumer
from amqbroker.core.entry import Entry
from amqbroker.net.driver import Hub
from amqbroker.net.outbound import OutboundDriver
from amqbroker.net.tls import client_context
from amqbroker.protocol.cluster_links import INBOUND_ADDRESS
from amqbroker.protocol.peer import (
    PeerEngine,
    PeerMessage,
    PeerReceiver,
    PeerSender,
    encode_message,
)
from amqbroker.settings import Settings, parse_peer

if TYPE_CHECKING:
    from amqbroker.cluster.arbiter import Arbiter, ArbiterRole
    from amqbroker.cluster.replication import Replicator
    from amqbroker.core.broker import Broker

log = logging.getLogger("amqbroker.cluster")

GROUPING_TYPE = "org.amqbroker.grouping"
CLUSTER_TYPE = "org.amqbroker.cluster"
BRIDGE_PREFIX = "$cluster.bridge."


class BridgeConsumer(Consumer):
    """The consumer of a bridge queue: the outbound link to the peer."""

    __slots__ = ("awaiting", "flush", "sender", "unsettled")
    counts_attempts = False

    def __init__(
        self,
        peer_id: str,
        sender: PeerSender,
        flush: Callable[[], None],
        awaiting: dict[bytes, Callable[[Any], None]],
    ) -> None:
        super().__init__(f"$cluster.bridge->{peer_id}")
        self.sender = sender
        self.flush = flush
        #: sent, not yet settled by the peer, in sending order
        self.unsettled: dict[int, Entry] = {}
        #: the peer's `Peer.awaiting`: producers answered when the peer accepts
        self.awaiting = awaiting

    def deliver(self, entry: Entry, first: bool) -> None:
        q = self.queue
        self.unsettled[id(entry)] = entry

        def outcome(o: str, desc: str) -> None:
            if q is None or self.queue is not q or q.deleted:
                return  # link gone: the queue took the message back already
            if o == "lost" or self.unsettled.pop(id(entry), None) is None:
                return  # lost: returned to the queue by the link's removal
            if o == "accepted":
                q.ack(self, entry)
                self._answer(entry, ROUTED)  # the owner has it: the producer may go on
            elif o == "rejected":
                self._answer(entry, ROUTED_SYNC)  # kept here: dead-lettered below
                log.warning(
                    "peer refused a forwarded message (%s); it goes to the dead letter "
                    "address of %s, if any",
                    desc,
                    q.name,
                )
                q.reject(self, entry)
            elif o in ("released", "modified"):
                q.release(self, entry)
            # no flush here: outcomes arrive in a batch of the peer's input, and the
            # outbound driver flushes the hub once after each batch (one write per
            # producer connection for all the answers, not one per message)

        self.sender.send(entry.data, outcome)

    def _answer(self, entry: Entry, res: int) -> None:
        """Answer the producer waiting for the peer's outcome of `entry`, if any."""
        if self.awaiting:
            answer = self.awaiting.pop(entry.data, None)
            if answer is not None:
                answer(res)

    def refresh_credit(self) -> None:
        self.credit = self.sender.credit
        if self.queue is not None and self.credit > 0:
            self.queue.credit_changed(self)
            self.flush()


@dataclass
class Peer:
    node_id: str
    #: where the node is reached: one address, or its pair's members in turn (only the
    #: live member listens); the node is known by its id, never by an address
    addresses: tuple[tuple[str, int], ...]
    bridge: Address
    driver: OutboundDriver | None = None
    engine: PeerEngine | None = None
    inbound: PeerSender | None = None
    mgmt: PeerSender | None = None
    replies: PeerReceiver | None = None
    consumer: BridgeConsumer | None = None
    ready: bool = False
    down_since: float | None = 0.0
    lost: bool = False
    #: queue name -> consumers, as the peer announced
    topology: dict[str, int] = field(default_factory=dict)
    grouping: str = ""
    announced_at: float = 0.0
    forwarded: int = 0
    #: wrapped message bytes -> the completion of its producer's transfer, answered
    #: when this peer accepts it (`cluster_accept_after_forward`), or when the link
    #: drops (then as stored here)
    awaiting: dict[bytes, Callable[[Any], None]] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """host:port of the link's current (or last) connection attempt."""
        host, port = (self.driver.host, self.driver.port) if self.driver else self.addresses[0]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Releaser(Protocol):
    """What topology needs from routing: proposals to resend, instances to release."""

    def resend_proposals(self) -> None: ...

    async def release_instances(self, node: str, queues: set[str]) -> None: ...


class Tasks(Protocol):
    """What every part needs from the runner: a task started, the output flushed."""

    def spawn(self, fn: Callable[..., Awaitable[object]], *args: Any) -> bool: ...

    def flush(self) -> None: ...


@dataclass(frozen=True, slots=True)
class NodeContext:
    """What the runner (`cluster.node.ClusterNode`) gives every part of a node alike."""

    settings: Settings
    broker: Broker
    node_id: str
    #: this process's boot id (a random hex string), in bridge and request ids
    boot: str
    role: ArbiterRole
    arbiter: Arbiter
    tasks: Tasks


class NodePart:
    """A part of a cluster node (topology, routing, node loss, management): holds the
    `NodeContext` as its own attributes (plain attributes: routing reads them per
    message)."""

    def __init__(self, node: NodeContext) -> None:
        self.settings = node.settings
        self.broker = node.broker
        self.node_id = node.node_id
        self.boot = node.boot
        self.role = node.role
        self.arbiter = node.arbiter
        self.tasks = node.tasks


class Topology(NodePart):
    """The peers and their links: up/down, announcements, requests and answers."""

    def __init__(self, node: NodeContext, replicator: Replicator | None) -> None:
        super().__init__(node)
        self.replicator = replicator
        self.loss_policy = node.settings.cluster_node_loss_policy
        #: set by the runner once routing exists
        self.releaser: Releaser | None = None
        self.peers: dict[str, Peer] = {}
        for text in node.settings.cluster_peers:
            pid, addresses = parse_peer(text)
            bridge = node.broker.create_address(BRIDGE_PREFIX + pid, ANYCAST, durable=True)
            self.peers[pid] = Peer(pid, addresses, bridge)
        self._req = itertools.count(1)
        self._waiters: dict[Any, Callable[[PeerMessage], None]] = {}
        self.announced: dict[str, int] | None = None
        #: per peer: queues it announced and later announced gone (7.8)
        self.gone: dict[str, set[str]] = {}
        self._local_queues: set[str] = set()
        self._warned_group_timeout: tuple[str, int] | None = None
        s = node.settings
        #: TLS for the links to peers (cluster_tls); a bad CA file fails the start
        self.ssl_context = client_context(s.cluster_tls_ca_file) if s.cluster_tls else None

    # -------------------------------------------------------------- links
    def start(self, p: Peer, hub: Hub) -> OutboundDriver:
        s = self.settings
        (host, port), *more = p.addresses
        p.driver = OutboundDriver(
            hub,
            name=p.node_id,
            host=host,
            port=port,
            more=more,
            factory=self._engine_factory(p),
            on_up=self._up_cb(p),
            on_down=self._down_cb(p),
            backoff_initial=s.cluster_reconnect_initial,
            backoff_max=s.cluster_reconnect_max,
            ssl_context=self.ssl_context,
        )
        p.down_since = trio.current_time()
        return p.driver

    def _engine_factory(self, p: Peer) -> Callable[[Callable[[], None]], PeerEngine]:
        s = self.settings

        def make(on_dirty: Callable[[], None]) -> PeerEngine:
            return PeerEngine(
                container_id=f"amqbroker-cluster-{self.node_id}-{self.boot}",
                user=s.cluster_user,
                password=s.cluster_password,
                idle_timeout=s.idle_timeout,
                on_dirty=on_dirty,
                on_event=lambda: self._check_ready(p),
            )

        return make

    def _up_cb(self, p: Peer) -> Callable[[PeerEngine], None]:
        return lambda engine: self._on_up(p, engine)

    def _down_cb(self, p: Peer) -> Callable[[PeerEngine | None, str], None]:
        return lambda engine, err: self._on_down(p, err)

    def _on_up(self, p: Peer, engine: PeerEngine) -> None:
        p.engine = engine
        p.inbound = engine.sender(INBOUND_ADDRESS, f"{self.node_id}->{p.node_id}.bridge")
        p.mgmt = engine.sender("$management", f"{self.node_id}->{p.node_id}.mgmt")
        p.replies = engine.receiver(self._on_reply, f"{self.node_id}->{p.node_id}.replies")
        self._check_ready(p)

    def _check_ready(self, p: Peer) -> None:
        if p.ready or p.engine is None or p.inbound is None or p.mgmt is None:
            return
        if not (p.inbound.opened and p.mgmt.opened and p.replies is not None and p.replies.opened):
            return
        p.ready = True
        down_for = 0.0 if p.down_since is None else trio.current_time() - p.down_since
        p.down_since = None
        if p.lost:
            p.lost = False
            log.info(
                "cluster node %s is back after %.1f s; %s",
                p.node_id,
                down_for,
                "its groups resume (they waited for it)"
                if self.loss_policy == "wait"
                else "its groups were released while it was lost",
            )
        if self.role.is_leader:
            # the groups that waited for it are in use again: the reaper counts from now
            now = trio.current_time()
            for b in self.arbiter.bindings.values():
                if b.node == p.node_id:
                    b.last_used = now
        log.info("cluster link to %s (%s) is up", p.node_id, p.address)
        if self.replicator is not None:
            self.replicator.link_up(p.node_id)  # the backup arbiter gets its snapshot now
        c = BridgeConsumer(p.node_id, p.inbound, self.tasks.flush, p.awaiting)
        p.consumer = c
        p.inbound.on_credit = c.refresh_credit
        p.bridge.queues[0].add_consumer(c)
        c.refresh_credit()
        self._announce(p)
        if self.role.leader_id == p.node_id and self.releaser is not None:
            self.releaser.resend_proposals()
        self.tasks.flush()

    def _on_down(self, p: Peer, err: str) -> None:
        was = p.ready
        p.ready = False
        p.engine = None
        p.inbound = p.mgmt = None
        p.replies = None
        if p.down_since is None:
            p.down_since = trio.current_time()
        if self.replicator is not None:
            self.replicator.link_down(p.node_id)
        self.answer_awaiting(p)
        c = p.consumer
        p.consumer = None
        if c is not None and c.queue is not None:
            c.queue.remove_consumer(c, list(c.unsettled.values()), failed=False)
            c.unsettled.clear()
        if was:
            log.warning(
                "cluster link to %s (%s) is down: %s; reconnecting%s",
                p.node_id,
                p.address,
                err or "connection lost",
                f" (to {'|'.join(f'{h}:{n}' for h, n in p.addresses)} in turn)"
                if len(p.addresses) > 1
                else "",
            )

    @staticmethod
    def answer_awaiting(p: Peer) -> None:
        """The link to `p` is gone: the producers waiting for it to accept their
        messages are answered as for a message stored here (their copies stay in the
        bridge queue, sent again when the link is back)."""
        if p.awaiting:
            answers = list(p.awaiting.values())
            p.awaiting.clear()
            for answer in answers:
                answer(ROUTED_SYNC)

    def request(
        self,
        p: Peer,
        operation: str,
        typ: str,
        body: Any,
        on_answer: Callable[[PeerMessage], None] | None = None,
        msg_id: str | None = None,
    ) -> bool:
        if not p.ready or p.mgmt is None or p.replies is None:
            return False
        mid = msg_id or f"{self.node_id}:{self.boot}:{next(self._req)}"
        data = encode_message(
            id=mid,
            reply_to=p.replies.address,
            properties={"operation": operation, "type": typ, "node": self.node_id},
            body=body,
        )
        if on_answer is not None:
            self._waiters[mid] = on_answer
        p.mgmt.send(data, lambda o, d: None)
        return True

    def _on_reply(self, m: PeerMessage) -> None:
        cb = self._waiters.pop(m.correlation_id, None)
        if cb is not None:
            cb(m)
            self.tasks.flush()

    # ----------------------------------------------------------- topology
    def _snapshot(self) -> dict[str, int]:
        return {
            q.name: q.consumer_count
            for q in self.broker.queues.values()
            if not q.temporary and not q.name.startswith("$")
        }

    def _announce(self, p: Peer) -> None:
        self.request(
            p,
            "clusterTopology",
            CLUSTER_TYPE,
            {
                "queues": self.announced if self.announced is not None else self._snapshot(),
                "grouping": self.settings.cluster_grouping,
                "leader": self.role.leader_id or "",
                "epoch": self.role.epoch,
                "groupTimeout": self.settings.grouping_group_timeout,
            },
        )

    async def topology_loop(self) -> None:
        while True:
            snap = self._snapshot()
            if snap != self.announced:
                self._local_queues_changed(set(snap))
                self.announced = snap
                for p in self.peers.values():
                    self._announce(p)
                self.tasks.flush()
            await trio.sleep(self.settings.cluster_topology_period)

    def node_down(self, node: str) -> bool:
        """Whether `node` is a peer whose link is down (unreachable from here)."""
        p = self.peers.get(node)
        return p is not None and not p.ready

    def on_announcement(self, p: Peer, body: dict[str, Any]) -> None:
        """A peer's clusterTopology announcement (the management handler's body)."""
        old = p.topology
        p.topology = {str(k): int(v) for k, v in dict(body.get("queues") or {}).items()}
        self._peer_queues_changed(p, set(old), body)
        p.grouping = str(body.get("grouping", ""))
        p.announced_at = trio.current_time()
        zk = bool(self.settings.cluster_zookeeper)
        if p.grouping == "LOCAL" and not zk and not self.role.is_leader:
            self.role.become_follower(p.node_id, int(body.get("epoch", 0)))

    # ------------------------------------- lost queue instances (GROUPING 7.7, 7.8)
    def _local_queues_changed(self, now: set[str]) -> None:
        """A local queue instance was deleted: the arbiter here releases its groups."""
        gone, self._local_queues = self._local_queues - now, now
        if gone and self.role.is_leader and self.releaser is not None:
            self.tasks.spawn(self.releaser.release_instances, self.node_id, gone)

    def _peer_queues_changed(self, p: Peer, before: set[str], body: dict[str, Any]) -> None:
        """A peer's announcement: queues it deleted (released here on the arbiter,
        force-removed on the other nodes when a binding still names them) and the
        arbiter's grouping_group_timeout (the "at most half" rule)."""
        now = set(p.topology)
        gone = self.gone.setdefault(p.node_id, set())
        gone -= now
        gone |= before - now
        if before - now and self.role.is_leader and self.releaser is not None:
            self.tasks.spawn(self.releaser.release_instances, p.node_id, before - now)
        if body.get("leader") == p.node_id and "groupTimeout" in body:
            self._check_group_timeout(p.node_id, int(body["groupTimeout"]))

    def _check_group_timeout(self, arbiter: str, theirs: int) -> None:
        ours = self.settings.grouping_group_timeout
        if self.role.is_leader or theirs <= 0 or 0 < ours * 2 <= theirs:
            return
        if self._warned_group_timeout == (arbiter, theirs):
            return
        self._warned_group_timeout = (arbiter, theirs)
        log.warning(
            "grouping_group_timeout on this node (%s: %s) is more than half the "
            "arbiter %s's (%d ms): a group in continuous use through this node can "
            "expire on the arbiter between two refreshes and move to another queue "
            "instance while its earlier messages are still queued. Set "
            "grouping_group_timeout to at most %d ms on this node (GROUPING 7.7)",
            self.node_id,
            f"{ours} ms" if ours > 0 else "-1, never refreshes",
            arbiter,
            theirs,
            theirs // 2,
        )
