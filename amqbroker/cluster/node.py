"""A cluster node: connections to the peers, forwarding, and clustered grouping.

Topology (D11): a full mesh with max-hops 1. For every configured peer this node runs
one outbound AMQP connection (`net.outbound.OutboundDriver` + `protocol.peer`) with
three links: a sender to the peer's `$cluster.inbound` (forwarded messages), a sender
to its `$management` (announcements, grouping proposals / un-proposals, queries) and
a dynamic receiver for the answers (the requests' reply-to). Every node announces,
every `cluster_topology_period` when it changed and whenever a link comes up, which of
its queues have consumers and its grouping role.

Routing (`route`, the broker's `Router` hook, asked for every message a client sends
to an anycast address): an ungrouped message goes to the local queue if it has
consumers, else round robin to a peer whose instance of the queue has consumers and
whose link is up, else stays local. A grouped message goes where the group's binding
says; a new group is proposed (key `group_id + "." + queue`) with the same rule's
candidate, and the message, with every later message of the same key from this node,
waits in a per-key pending queue until the arbiter answers (so none overtakes the
first), or `grouping_timeout` passes (then rejected with amqp:internal-error "grouping
decision timed out", or routed ungrouped with `grouping_timeout_policy = "ungrouped"`).

Forwarding is store-and-forward: a message for a peer is wrapped (`peer.wrap_forward`:
target queue + bridge id `<node>:<boot>:<seq>`) and enqueued, durable if it was, on the
local bridge queue `$cluster.bridge.<peer>`; the producer is answered once it is
stored there. The bridge queue's only consumer (`BridgeConsumer`) is the link to the
peer: a message is acknowledged in the bridge queue only when the peer accepted it
(after its own sync); when the link drops, unacknowledged messages go back to the head
of the bridge queue in order and are resent on reconnect, the peer drops copies it had
already stored by bridge id. Order per (producer, entry node) holds end to end.

Grouping (GROUPING 7.4-7.8): the arbiter (`arbiter.Arbiter`) runs on the leader; the
others cache its answers (never expiring them, D14) and refresh groups they use every
half `grouping_group_timeout`. The arbiter un-proposes (here and on every peer, which
drop the cached answer and unpin the group in their local queue) bindings that the
reaper expired and those of a node unreachable for `cluster_node_timeout`. Proposals
outstanding while the arbiter is unreachable are kept and sent again when its link is
back. Answers of an epoch older than the current one are ignored (fencing).

Lost instances (7.8): a queue that disappears from a node's announced topology (or from
the arbiter's own) was deleted; the arbiter releases every binding to that instance and
un-proposes it everywhere. An un-proposal names the node it unbinds, so a late one
never drops a newer answer. A binding this node cannot route to (its node is not in
`cluster_peers`, or announced the queue deleted) is force-removed: the proposal carries
it as `stale` and the arbiter removes it, if it still stands, before deciding; after
`grouping_retries` such attempts the message is treated like a timeout ("grouping
decision failed"). An instance whose consumers left but which stays keeps its
groups (7.8: their messages wait there for a consumer, never redistributed); with
`grouping_consumerless_timeout` > 0 the arbiter's monitor releases the groups of an
instance its node has announced without consumers for that long (`_consumers`
unknown -> no decision: node loss and deletion cover those). A REMOTE warns once
when its `grouping_group_timeout` exceeds half the arbiter's (announced as
`groupTimeout`), 7.7. `proposal_latency` (clusterStatus "proposals") times each new
group's decision as seen by the entry node.

Node loss (issue 20, `cluster_node_loss_policy`): a peer unreachable for
`cluster_node_timeout` is lost. Under `wait` its groups stay bound to it (the reaper
and the consumerless release spare them too); their messages wait in order in the
bridges, and `waiting()` reports them. Under `move` the arbiter releases them; every
node whose bridge to the lost node holds messages of a released key decides the key
again at once (`_released_from_lost`) and `_decide` moves the held messages to the new
owner before the newer ones waiting in `_pending`. Whatever the policy, a node holds
the groups of the messages it recovered at start (`_hold_recovered`, `Queue.hold_group`)
until the arbiter confirms each binding: still here, it serves them; bound elsewhere,
it forwards them there (`_forward_stranded`), counted as late deliveries.

Who arbitrates: without `cluster_zookeeper` the node with `cluster_grouping = "LOCAL"`
leads at epoch 0 for good (a single point of failure, logged at start) and the others
learn it from its announcements. With `cluster_zookeeper` (and grouping on) `run`
starts `election.zk_election(settings, self.role)`: every such node is eligible; the
election calls `ArbiterRole.become_leader/become_follower/become_backup/backup_changed`
(`become_follower(None, e)`: no arbiter known, proposals wait and are re-sent once one
is). The leader's arbiter replicates every decision to the backup before answering
(`replication.Replicator`, `groupingReplicate`); every node stores replicated
decisions it accepts (`replication.ReplicaStore`: only from the node its election
names as leader of that very epoch, 409 below its fence). The arbiter commits the
decisions waiting at one moment as one batch (`Arbiter.run`, started here: one fsync
and one replication message per batch). Proposals waiting for
another arbiter when this node becomes leader are decided here.

Limits: multicast addresses, transactional sends and addresses with several queues are
routed locally only; messages already forwarded to a queue instance whose consumers
later left wait there (no redistribution); the duplicate window is in memory.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from amqbroker.cluster.arbiter import SPOF_WARNING, Arbiter, ArbiterRole, NotArbiter
from amqbroker.cluster.decisions import DecisionLog
from amqbroker.cluster.election import ZkElection, zk_election
from amqbroker.cluster.replication import ReplicaStore, Replicator
from amqbroker.cluster.stats import LatencyHistogram
from amqbroker.core import delivery_log as dl
from amqbroker.core.address import ANYCAST, Address
from amqbroker.core.broker import PENDING, Broker
from amqbroker.core.consumer import Consumer
from amqbroker.core.entry import Entry
from amqbroker.core.errors import BrokerError
from amqbroker.core.queue import Queue
from amqbroker.net.driver import Hub
from amqbroker.net.outbound import OutboundDriver
from amqbroker.protocol.cluster_links import INBOUND_ADDRESS, DuplicateWindow, inbound_factory
from amqbroker.protocol.connection import AmqpConnection
from amqbroker.protocol.management import ManagementError, ManagementNode, ManagementRequest
from amqbroker.protocol.peer import (
    PeerEngine,
    PeerMessage,
    PeerReceiver,
    PeerSender,
    encode_message,
    unwrap_forward,
    wrap_forward,
)
from amqbroker.protocol.scanner import ScanError, scan
from amqbroker.settings import Settings, parse_peer

log = logging.getLogger("amqbroker.cluster")

GROUPING_TYPE = "org.amqbroker.grouping"
CLUSTER_TYPE = "org.amqbroker.cluster"
BRIDGE_PREFIX = "$cluster.bridge."
TIMED_OUT = "grouping decision timed out"

#: what `cluster_node_loss_policy` means, said at start (README "Cluster")
LOSS_POLICY_TEXT = {
    "wait": (
        "wait (one owner and order first): the groups of a node unreachable for "
        "cluster_node_timeout stay bound to it; their new messages wait, in order, in "
        "the bridges until it is back"
    ),
    "move": (
        "move (availability first): the groups of a node unreachable for "
        "cluster_node_timeout move to the surviving nodes; its stranded messages of "
        "those groups are delivered late when it returns, and reported"
    ),
}


class GroupingTimeout(BrokerError):
    condition = "amqp:internal-error"


class BridgeConsumer(Consumer):
    """The consumer of a bridge queue: the outbound link to the peer."""

    __slots__ = ("flush", "sender", "unsettled")
    counts_attempts = False

    def __init__(self, peer_id: str, sender: PeerSender, flush: Callable[[], None]) -> None:
        super().__init__(f"$cluster.bridge->{peer_id}")
        self.sender = sender
        self.flush = flush
        #: sent, not yet settled by the peer, in sending order
        self.unsettled: dict[int, Entry] = {}

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
            elif o == "rejected":
                log.warning(
                    "peer refused a forwarded message (%s); it goes to the dead letter "
                    "address of %s, if any",
                    desc,
                    q.name,
                )
                q.reject(self, entry)
            elif o in ("released", "modified"):
                q.release(self, entry)
            else:
                return
            self.flush()

        self.sender.send(entry.data, outcome)

    def refresh_credit(self) -> None:
        self.credit = self.sender.credit
        if self.queue is not None and self.credit > 0:
            self.queue.credit_changed(self)
            self.flush()


@dataclass
class Peer:
    node_id: str
    host: str
    port: int
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


@dataclass
class Cached:
    node: str
    queue: str
    epoch: int
    touched: float


@dataclass
class Outstanding:
    key: str
    node: str
    queue: str
    answered: trio.Event = field(default_factory=trio.Event)
    result: str | None = None
    #: (node, queue) of a binding this node could not route to: the arbiter removes
    #: it, if it still stands, before deciding (force-remove, GROUPING 7.4 step 4)
    stale: tuple[str, str] | None = None


class ClusterNode:
    def __init__(
        self,
        settings: Settings,
        broker: Broker,
        hub: Hub,
        management: ManagementNode,
        data_dir: Path,
    ) -> None:
        s = settings
        self.settings = s
        self.broker = broker
        self.hub = hub
        self.node_id = s.cluster_node_id
        self.boot = os.urandom(4).hex()
        self._seq = itertools.count(1)
        self._req = itertools.count(1)
        self.grouping = s.cluster_grouping
        self.timeout = s.grouping_timeout / 1000.0
        self.group_timeout = s.grouping_group_timeout / 1000.0
        #: what a node unreachable for cluster_node_timeout does to its groups
        self.loss_policy = s.cluster_node_loss_policy
        self.arbiter = Arbiter(
            DecisionLog(data_dir / "cluster" / "decisions.log", sync=s.store_sync)
            if self.grouping == "LOCAL" or bool(s.cluster_zookeeper)
            else None,
            trio.current_time,
            # without fsync an append takes microseconds: a worker-thread hop would
            # only add scheduling delay to every proposal's answer
            in_thread=s.store_sync,
        )
        self.role = ArbiterRole(self.node_id, self.arbiter, on_change=self._role_changed)
        #: with cluster_zookeeper: the arbiter election (run), its replication to the
        #: backup (leader side) and the store of replicated decisions (backup side)
        self.election: ZkElection | None = None
        self.replicator: Replicator | None = None
        self.replica_store: ReplicaStore | None = None
        if s.cluster_zookeeper and self.grouping:
            self.election = zk_election(s, self.role)
            self.role.fence = self.election.fence
            self.replicator = Replicator(
                self.arbiter,
                self._replicate_send,
                epoch=lambda: self.role.epoch,
                confirm=self.election.confirm,
                on_fenced=lambda epoch: self.role.become_follower(None, epoch),
                retry_delay=s.cluster_reconnect_initial,
            )
            self.arbiter.add_replica(self.replicator)
            self.replica_store = ReplicaStore(self.arbiter, self._replica_check, self.flush)
        self.peers: dict[str, Peer] = {}
        for text in s.cluster_peers:
            pid, host, port = parse_peer(text)
            bridge = broker.create_address(BRIDGE_PREFIX + pid, ANYCAST, durable=True)
            self.peers[pid] = Peer(pid, host, port, bridge)
        self._rr = itertools.count()
        self._pending: dict[str, deque[tuple[Address, Entry, Callable[[Any], None]]]] = {}
        self._outstanding: dict[str, Outstanding] = {}
        self._cache: dict[str, Cached] = {}
        self._waiters: dict[Any, Callable[[PeerMessage], None]] = {}
        self._announced: dict[str, int] | None = None
        self._nursery: trio.Nursery | None = None
        self.window = DuplicateWindow(s.cluster_duplicate_window)
        self.proposals_sent = 0
        self.timeouts = 0
        self.force_removed = 0
        #: entry node: time from proposing a new group to the answer (local or remote)
        self.proposal_latency = LatencyHistogram()
        #: per peer: queues it announced and later announced gone (7.8)
        self._gone: dict[str, set[str]] = {}
        self._local_queues: set[str] = set()
        #: on the arbiter, with grouping_consumerless_timeout: (node, queue) instances
        #: seen without a consumer, since when
        self._consumerless: dict[tuple[str, str], float] = {}
        self.consumerless_released = 0
        #: under cluster_node_loss_policy = move: key -> lost node whose bridge holds
        #: messages of the key, taken to the new owner once the key is decided again
        self._rescue: dict[str, str] = {}
        #: recovered groups held until the arbiter says who owns them (ask first)
        self.groups_verifying = 0
        #: stranded messages of groups that moved while this node was lost, forwarded
        #: to their current owner after newer ones (policy move): late deliveries
        self.late_forwarded = 0
        self._warned_group_timeout: tuple[str, int] | None = None
        management.register(GROUPING_TYPE, self._on_grouping_request)
        management.register(CLUSTER_TYPE, self._on_cluster_request)
        management.targets[INBOUND_ADDRESS] = inbound_factory(self.window, self._authorize)
        broker.router = self

    # ------------------------------------------------------------ lifecycle
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        s = self.settings
        loaded = self.arbiter.load()
        if self.grouping == "LOCAL" and self.election is None:
            log.warning(SPOF_WARNING)
            self.role.become_leader(0)
        log.info(
            "cluster node %s: %d peer(s), grouping %s%s",
            self.node_id,
            len(self.peers),
            self.grouping or "off",
            f", {loaded} group binding(s) loaded" if loaded else "",
        )
        if self.grouping:
            log.info("cluster node loss policy: %s", LOSS_POLICY_TEXT[self.loss_policy])
            self._check_takeover_timeout()
        async with trio.open_nursery() as n:
            self._nursery = n
            n.start_soon(self.arbiter.run)  # group commit of the arbiter's decisions
            held = self._hold_recovered()
            for p in self.peers.values():
                p.driver = OutboundDriver(
                    self.hub,
                    name=p.node_id,
                    host=p.host,
                    port=p.port,
                    factory=self._engine_factory(p),
                    on_up=self._up_cb(p),
                    on_down=self._down_cb(p),
                    backoff_initial=s.cluster_reconnect_initial,
                    backoff_max=s.cluster_reconnect_max,
                )
                p.down_since = trio.current_time()
                n.start_soon(p.driver.run)
            n.start_soon(self._topology_loop)
            n.start_soon(self._monitor_loop)
            if self.election is not None and self.replica_store is not None:
                n.start_soon(self.replica_store.run)
                await n.start(self.election.run)
            if self.group_timeout > 0 and s.grouping_reaper_period > 0:
                n.start_soon(self._reaper_loop)
            if held:
                n.start_soon(self._verify_recovered, held)
            task_status.started()

    def close(self) -> None:
        self.arbiter.close()

    # ------------------------------------------ ask before serving (issue 20)
    def _clustered(self, q: Queue) -> bool:
        """Whether routing to `q` goes through the cluster (`route`'s rule)."""
        a = q.address
        return (
            a is not None
            and a.routing == ANYCAST
            and len(a.queues) == 1
            and not a.name.startswith("$")
            and not q.temporary
        )

    def _hold_recovered(self) -> list[tuple[Queue, str]]:
        """At start, before any client or peer: hold every group of the messages this
        node recovered, so that none is served before the arbiter confirms that the
        group is still bound here (it may have moved while this node was down)."""
        if not self.grouping:
            return []
        held: list[tuple[Queue, str]] = []
        for q in list(self.broker.queues.values()):
            if not self._clustered(q):
                continue
            for gid in sorted({e.group_id for e in q.browse() if e.group_id is not None}):
                if q.hold_group(gid):
                    held.append((q, gid))
        if held:
            log.info(
                "holding %d recovered group(s) until the grouping arbiter confirms their "
                "owner: a returning node never serves a group that is bound elsewhere",
                len(held),
            )
        self.groups_verifying = len(held)
        return held

    async def _verify_recovered(self, held: list[tuple[Queue, str]]) -> None:
        limiter = trio.CapacityLimiter(64)  # proposals in flight at once
        async with trio.open_nursery() as n:
            for q, gid in held:
                n.start_soon(self._verify_group, q, gid, limiter)

    async def _verify_group(self, q: Queue, gid: str, limiter: trio.CapacityLimiter) -> None:
        key = f"{gid}.{q.name}"
        try:
            async with limiter:
                warned = False
                while True:
                    node: str | None = None
                    with trio.move_on_after(self.timeout):
                        node = await self._propose(key, self.node_id, q.name)
                    if node is not None:
                        break
                    self._outstanding.pop(key, None)
                    if not warned:
                        warned = True
                        log.warning(
                            "group %r: no answer from the grouping arbiter (%s) within "
                            "grouping_timeout; its recovered messages stay held, asking again",
                            key,
                            self.role.leader_id or "not known yet",
                        )
            if node != self.node_id and not q.deleted:
                self._forward_stranded(node, q, gid)
        finally:
            self.groups_verifying -= 1
            q.unhold_group(gid)

    def _forward_stranded(self, node: str, q: Queue, gid: str) -> None:
        """`gid` is bound to `node` now: this node's messages of it go there, late."""
        a = q.address
        assert a is not None

        def sink(e: Entry) -> None:
            self._deliver_to(node, a, e, late=True)

        moved = q.take_waiting(lambda e: e.group_id == gid, sink)
        if moved:
            self.late_forwarded += moved
            log.warning(
                "group %r moved to %s while this node was lost (cluster_node_loss_policy "
                "= %s): its %d stranded message(s) here are forwarded there, after newer "
                "messages of the group (late deliveries)",
                f"{gid}.{q.name}",
                node,
                self.loss_policy,
                moved,
            )
        self.flush()

    def _released_from_lost(self, key: str, lost: str, qname: str) -> None:
        """Policy move: `key` was bound to the lost node `lost` and is released. The
        messages of it that this node's bridge to `lost` holds go to the new owner
        before any newer message: the key is decided again at once, newer messages
        wait behind the decision (`_pending`), and `_decide` takes the held ones from
        the bridge first."""
        if self.loss_policy != "move" or not self.grouping:
            return
        p = self.peers.get(lost)
        q = self.broker.queues.get(qname)
        if p is None or q is None or q.address is None or not p.bridge.queues:
            return
        self._rescue[key] = lost
        if key in self._pending:
            return  # a decision is under way: it takes them first
        self._pending[key] = deque()
        if self._nursery is not None:
            self._nursery.start_soon(self._decide, key, self._pick(qname), qname, None)

    def _take_from_bridge(self, lost: str, key: str, qname: str, node: str, a: Address) -> int:
        p = self.peers.get(lost)
        if p is None or not p.bridge.queues:
            return 0
        gid = key[: -len(qname) - 1]

        def inner(e: Entry) -> Entry | None:
            try:
                _bid, target, data = unwrap_forward(e.data)
                durable, prio, ttl, abs_exp, dc, g, gseq, _to, _dt, _dd = scan(data)
            except (ValueError, ScanError):
                return None
            if target != qname or g != gid:
                return None
            expiry = int(self.broker.clock() * 1000) + ttl if ttl else 0
            if abs_exp and (not expiry or abs_exp < expiry):
                expiry = abs_exp
            return Entry(data, durable, prio if prio < 10 else 9, expiry, dc, g, gseq)

        def sink(e: Entry) -> None:
            ie = inner(e)
            if ie is not None and self._deliver_to(node, a, ie) is None:
                self.broker.route(a, ie)

        moved = p.bridge.queues[0].take_waiting(lambda e: inner(e) is not None, sink)
        if moved:
            log.warning(
                "group %r moved from the lost node %s to %s: the %d message(s) this "
                "node's bridge held for it go there first, before newer ones",
                key,
                lost,
                node,
                moved,
            )
        return moved

    def flush(self) -> None:
        self.hub.flush()

    def _authorize(self, conn: AmqpConnection) -> str | None:
        s = self.settings
        if s.require_auth and s.cluster_user and conn.user != s.cluster_user:
            return (
                f"cluster links are for the cluster user {s.cluster_user!r}; "
                "check cluster_user/cluster_password on the connecting node"
            )
        return None

    # -------------------------------------------------------------- links
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
        log.info("cluster link to %s (%s:%d) is up", p.node_id, p.host, p.port)
        c = BridgeConsumer(p.node_id, p.inbound, self.flush)
        p.consumer = c
        p.inbound.on_credit = c.refresh_credit
        p.bridge.queues[0].add_consumer(c)
        c.refresh_credit()
        self._announce(p)
        if self.role.leader_id == p.node_id:
            for o in self._outstanding.values():
                self._send_proposal(o)
        self.flush()

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
        c = p.consumer
        p.consumer = None
        if c is not None and c.queue is not None:
            c.queue.remove_consumer(c, list(c.unsettled.values()), failed=False)
            c.unsettled.clear()
        if was:
            log.warning(
                "cluster link to %s (%s:%d) is down: %s; reconnecting",
                p.node_id,
                p.host,
                p.port,
                err or "connection lost",
            )

    def _request(
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
            self.flush()

    # ----------------------------------------------------------- topology
    def _snapshot(self) -> dict[str, int]:
        return {
            q.name: q.consumer_count
            for q in self.broker.queues.values()
            if not q.temporary and not q.name.startswith("$")
        }

    def _announce(self, p: Peer) -> None:
        self._request(
            p,
            "clusterTopology",
            CLUSTER_TYPE,
            {
                "queues": self._announced if self._announced is not None else self._snapshot(),
                "grouping": self.grouping,
                "leader": self.role.leader_id or "",
                "epoch": self.role.epoch,
                "groupTimeout": self.settings.grouping_group_timeout,
            },
        )

    async def _topology_loop(self) -> None:
        while True:
            snap = self._snapshot()
            if snap != self._announced:
                self._local_queues_changed(set(snap))
                self._announced = snap
                for p in self.peers.values():
                    self._announce(p)
                self.flush()
            await trio.sleep(self.settings.cluster_topology_period)

    def _role_changed(self) -> None:
        self._announced = None  # announce the new role at the next tick
        dlog = self.broker.dlog
        if dlog is not None:
            # delivery-log records carry the arbiter epoch their group decisions
            # were made under (the audit orders owners across failovers by it)
            dlog.set_owner_epoch(self.role.epoch)
        if self.replicator is not None and self.election is not None:
            backup = self.election.view.backup_id if self.role.is_leader else None
            self.replicator.set_target(None if backup == self.node_id else backup)
        if self.role.is_leader:  # proposals waiting for another arbiter: decided here now
            for o in list(self._outstanding.values()):
                o.answered.set()
        if self.role.leader_id and self.role.leader_id != self.node_id:
            p = self.peers.get(self.role.leader_id)
            if p is not None and p.ready:
                for o in self._outstanding.values():
                    self._send_proposal(o)

    async def _monitor_loop(self) -> None:
        """On the arbiter: a peer unreachable for cluster_node_timeout is lost; the
        groups bound to it are released everywhere (GROUPING 7.8). With
        grouping_consumerless_timeout, so are the groups of an instance without a
        consumer for that long (`_release_consumerless`)."""
        period = min(0.2, self.settings.cluster_node_timeout / 4)
        checked = 0.0
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            for p in self.peers.values():
                if p.ready or p.lost or p.down_since is None:
                    continue
                if now - p.down_since < self.settings.cluster_node_timeout:
                    continue
                p.lost = True
                p.topology = {}
                if self.loss_policy == "wait":
                    waiting = self._groups_bound_to(p.node_id)
                    log.warning(
                        "cluster node %s unreachable for %.1f s (cluster_node_timeout): "
                        "%s group binding(s) stay bound to it (cluster_node_loss_policy = "
                        "wait); their new messages wait in order in the bridge "
                        "$cluster.bridge.%s until it is back",
                        p.node_id,
                        now - p.down_since,
                        waiting if waiting is not None else "its",
                        p.node_id,
                    )
                    continue
                if self.role.is_leader:
                    keys = self.arbiter.bound_to(p.node_id)
                    if keys:
                        log.warning(
                            "cluster node %s unreachable for %.1f s: releasing its %d "
                            "group binding(s); they are proposed again",
                            p.node_id,
                            now - p.down_since,
                            len(keys),
                        )
                    for k in keys:
                        b = self.arbiter.bindings.get(k)
                        await self._unbind(k)
                        if b is not None:
                            self._released_from_lost(k, p.node_id, b.queue)
                # a cached answer naming the lost node is dropped too
                for k in [k for k, c in self._cache.items() if c.node == p.node_id]:
                    del self._cache[k]
            limit = self.settings.grouping_consumerless_timeout / 1000.0
            if self.role.is_leader and limit > 0 and now - checked >= limit / 4:
                checked = now  # a sweep over the bindings: at most 4 per limit
                await self._release_consumerless(now)

    def _node_down(self, node: str) -> bool:
        """Whether `node` is a peer whose link is down (unreachable from here)."""
        p = self.peers.get(node)
        return p is not None and not p.ready

    def _groups_bound_to(self, node: str) -> int | None:
        """Groups bound to `node` as known here: the arbiter's table, else the cached
        answers (None: this node is not the arbiter and caches nothing for it)."""
        if self.role.is_leader:
            return len(self.arbiter.bound_to(node))
        n = sum(1 for c in self._cache.values() if c.node == node)
        return n or None

    def waiting(self) -> list[dict[str, Any]]:
        """Lost peers whose groups wait for them (cluster_node_loss_policy = wait)."""
        now = trio.current_time()
        out: list[dict[str, Any]] = []
        for p in self.peers.values():
            if not p.lost or self.loss_policy != "wait":
                continue
            since = p.down_since if p.down_since is not None else now
            out.append(
                {
                    "node": p.node_id,
                    "sinceMillis": int((now - since) * 1000),
                    "groups": self._groups_bound_to(p.node_id) or 0,
                    "bridgeDepth": p.bridge.queues[0].count if p.bridge.queues else 0,
                }
            )
        return out

    def _check_takeover_timeout(self) -> None:
        """A takeover lasts about one ZooKeeper session timeout (plus reconnects): new
        groups wait for it, so grouping_timeout must be well above it."""
        s = self.settings
        if not s.cluster_zookeeper:
            return
        need = 2 * s.cluster_zookeeper_session_timeout
        if s.grouping_timeout < need:
            log.warning(
                "grouping_timeout (%d ms) is less than twice "
                "cluster_zookeeper_session_timeout (%d ms): during an arbiter takeover, "
                "which lasts about one session timeout, the sends of new groups can be "
                "rejected with 'grouping decision timed out'. Set grouping_timeout to at "
                "least %d ms",
                s.grouping_timeout,
                s.cluster_zookeeper_session_timeout,
                need,
            )

    def _consumers(self, node: str, queue: str) -> int | None:
        """Consumers of the instance `queue` on `node` as known here; None: unknown
        (instance gone, or its node's link down: node loss and deletion handle it)."""
        if node == self.node_id:
            q = self.broker.queues.get(queue)
            return None if q is None or q.deleted else q.consumer_count
        p = self.peers.get(node)
        if p is None or not p.ready or not p.announced_at or queue not in p.topology:
            return None
        return p.topology[queue]

    def _consumers_elsewhere(self, node: str, queue: str) -> bool:
        others = [n for n in (self.node_id, *self.peers) if n != node]
        return any((self._consumers(n, queue) or 0) > 0 for n in others)

    async def _release_consumerless(self, now: float) -> None:
        """GROUPING 7.8, opt-in: release the groups of an instance without consumers
        for grouping_consumerless_timeout ms (default -1: they stay, as specified),
        once another instance of the queue has a consumer (until then moving the
        group would gain nothing and only split it)."""
        limit = self.settings.grouping_consumerless_timeout / 1000.0
        seen: dict[tuple[str, str], float] = {}
        expired: set[tuple[str, str]] = set()
        for b in list(self.arbiter.bindings.values()):
            inst = (b.node, b.queue)
            if inst in seen or inst in expired or not b.ready.is_set():
                continue
            if self._consumers(*inst) != 0:
                continue
            since = self._consumerless.get(inst, now)
            seen[inst] = since
            if now - since >= limit and self._consumers_elsewhere(*inst):
                expired.add(inst)
        self._consumerless = seen
        for node, queue in sorted(expired):
            keys = [
                k
                for k, b in list(self.arbiter.bindings.items())
                if (b.node, b.queue) == (node, queue)
            ]
            log.warning(
                "queue instance %s on %s has had no consumer for %.1f s "
                "(grouping_consumerless_timeout): releasing its %d group binding(s); their "
                "next messages are proposed again, messages already queued there wait for a "
                "consumer on %s",
                queue,
                node,
                now - seen.pop((node, queue)),
                len(keys),
                node,
            )
            for k in keys:
                cur = self.arbiter.bindings.get(k)
                if cur is not None and (cur.node, cur.queue) == (node, queue):
                    self.consumerless_released += 1
                    await self._unbind(k)

    async def _reaper_loop(self) -> None:
        while True:
            await trio.sleep(self.settings.grouping_reaper_period / 1000.0)
            if not self.role.is_leader:
                continue
            for k in self.arbiter.idle(trio.current_time() - self.group_timeout):
                b = self.arbiter.bindings.get(k)
                if b is not None and self._node_down(b.node):
                    # its messages may still wait in the bridges or in the node's store:
                    # expiring it now would let newer messages overtake them
                    continue
                await self._unbind(k)

    async def _unbind(self, key: str) -> None:
        try:
            b = await self.arbiter.remove(key)
        except NotArbiter:
            return  # fenced meanwhile: the new arbiter decides
        if b is None:
            return
        self._drop_local(key, b.queue)
        if self.broker.dlog is not None:  # the audit's marker: the group may move now
            self.broker.dlog.marker(dl.UNBOUND, f"{b.node}/{b.queue}", key[: -len(b.queue) - 1])
        for p in self.peers.values():
            self._request(
                p,
                "groupingUnpropose",
                GROUPING_TYPE,
                {"key": key, "node": b.node, "queue": b.queue, "epoch": self.role.epoch},
            )
        self.flush()

    def _drop_local(self, key: str, queue: str) -> None:
        self._cache.pop(key, None)
        q = self.broker.queues.get(queue)
        suffix = "." + queue
        if q is not None and key.endswith(suffix):
            q.reset_group(key[: -len(suffix)])

    # ------------------------------------- lost queue instances (GROUPING 7.7, 7.8)
    def _local_queues_changed(self, now: set[str]) -> None:
        """A local queue instance was deleted: the arbiter here releases its groups."""
        gone, self._local_queues = self._local_queues - now, now
        if gone and self.role.is_leader and self._nursery is not None:
            self._nursery.start_soon(self._release_instances, self.node_id, gone)

    def _peer_queues_changed(self, p: Peer, before: set[str], body: dict[str, Any]) -> None:
        """A peer's announcement: queues it deleted (released here on the arbiter,
        force-removed on the other nodes when a binding still names them) and the
        arbiter's grouping_group_timeout (the "at most half" rule)."""
        now = set(p.topology)
        gone = self._gone.setdefault(p.node_id, set())
        gone -= now
        gone |= before - now
        if before - now and self.role.is_leader and self._nursery is not None:
            self._nursery.start_soon(self._release_instances, p.node_id, before - now)
        if body.get("leader") == p.node_id and "groupTimeout" in body:
            self._check_group_timeout(p.node_id, int(body["groupTimeout"]))

    async def _release_instances(self, node: str, queues: set[str]) -> None:
        keys = [
            k
            for k, b in list(self.arbiter.bindings.items())
            if b.node == node and b.queue in queues
        ]
        if keys:
            log.warning(
                "queue instance(s) %s on %s deleted: releasing %d group binding(s) "
                "cluster-wide; the groups are proposed again at their next message",
                ", ".join(sorted(queues)),
                node,
                len(keys),
            )
        for k in keys:
            b = self.arbiter.bindings.get(k)
            if b is not None and b.node == node and b.queue in queues:
                await self._unbind(k)

    def _unroutable(self, node: str, qname: str) -> str | None:
        """Why this node cannot route to the queue instance `qname` on `node`, or None."""
        if node == self.node_id:
            return None
        if node not in self.peers:
            return (
                f"it names node {node!r}, which is not in this node's cluster_peers "
                f"({', '.join(self.peers) or 'none'})"
            )
        if qname in self._gone.get(node, ()):
            return f"node {node!r} announced that its queue {qname!r} was deleted"
        return None

    async def _force_remove(self, key: str, node: str, queue: str) -> None:
        """On the arbiter: remove `key`'s binding if it still names node/queue."""
        b = self.arbiter.lookup(key, touch=False)
        if b is not None and b.ready.is_set() and (b.node, b.queue) == (node, queue):
            log.warning("group binding %r -> %s/%s force-removed", key, node, queue)
            await self._unbind(key)

    async def _decide_node(
        self, key: str, candidate: str, qname: str, stale: tuple[str, str] | None
    ) -> tuple[str | None, str | None]:
        """Propose until the answer names a queue instance this node can route to:
        (node, None); (None, None) when an attempt timed out; (None, why) after
        grouping_retries force-removals (GROUPING 7.4 step 4)."""
        why = "" if stale is None else (self._unroutable(*stale) or "")
        retries = self.settings.grouping_retries
        removals = 0
        while True:
            if stale is not None:
                if removals >= retries:
                    return None, (
                        f"grouping decision failed: group key {key!r} stays bound to "
                        f"{stale[0]}/{stale[1]} after {retries} force-removal(s); {why}. "
                        "Check that cluster_peers lists the same nodes on every node"
                    )
                removals += 1
                self.force_removed += 1
                self._cache.pop(key, None)
                log.warning(
                    "group binding %r -> %s/%s force-removed: %s; proposing the group "
                    "again (force-removal %d of at most %d)",
                    key,
                    stale[0],
                    stale[1],
                    why,
                    removals,
                    retries,
                )
            t0 = trio.current_time()
            node: str | None = None
            with trio.move_on_after(self.timeout):
                node = await self._propose(key, candidate, qname, stale)
            if node is None:
                return None, None
            self.proposal_latency.record(trio.current_time() - t0)
            reason = self._unroutable(node, qname)
            if reason is None:
                return node, None
            why, stale = reason, (node, qname)

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

    # -------------------------------------------------------------- routing
    def _pick(self, qname: str) -> str:
        q = self.broker.queues.get(qname)
        if q is not None and q.consumer_count > 0:
            return self.node_id
        remote = [
            p.node_id for p in self.peers.values() if p.ready and p.topology.get(qname, 0) > 0
        ]
        if remote:
            return remote[next(self._rr) % len(remote)]
        return self.node_id

    def route(self, a: Address, e: Entry, done: Callable[[Any], None]) -> int | None:
        if a.routing != ANYCAST or len(a.queues) != 1 or a.name.startswith("$"):
            return None
        qname = a.queues[0].name
        if e.group_id is None or not self.grouping:
            return self._deliver_to(self._pick(qname), a, e)
        key = f"{e.group_id}.{qname}"
        pend = self._pending.get(key)
        if pend is not None:
            pend.append((a, e, done))
            return PENDING
        node = self._lookup(key)
        stale: tuple[str, str] | None = None
        if node is not None:
            if self._unroutable(node, qname) is None:
                return self._deliver_to(node, a, e)
            stale = (node, qname)  # force-removed and proposed again
        self._pending[key] = deque([(a, e, done)])
        assert self._nursery is not None
        self._nursery.start_soon(self._decide, key, self._pick(qname), qname, stale)
        return PENDING

    def _lookup(self, key: str) -> str | None:
        if self.role.is_leader:
            b = self.arbiter.lookup(key)
            return b.node if b is not None and b.ready.is_set() else None
        c = self._cache.get(key)
        if c is None:
            return None
        now = trio.current_time()
        if self.group_timeout > 0 and now - c.touched > self.group_timeout / 2:
            c.touched = now
            leader = self.peers.get(self.role.leader_id or "")
            if leader is not None:  # refresh: a proposal the arbiter counts as a use
                self._request(
                    leader,
                    "groupingPropose",
                    GROUPING_TYPE,
                    {"key": key, "node": c.node, "queue": c.queue},
                )
        return c.node

    def _deliver_to(self, node: str, a: Address, e: Entry, *, late: bool = False) -> int | None:
        if node == self.node_id:
            return None if a is None else self.broker.route(a, e)
        p = self.peers.get(node)
        if p is None:
            log.warning("group bound to unknown node %s; routed locally", node)
            return self.broker.route(a, e)
        bid = f"{self.node_id}:{self.boot}:{next(self._seq)}"
        data = wrap_forward(e.data, bridge_id=bid, target=a.queues[0].name, durable=e.durable)
        fe = Entry(data, e.durable)
        p.forwarded += 1
        dlog = self.broker.dlog
        if dlog is not None:
            # the message (its own id and group) leaves for `node`: the bridge queue's
            # records that follow are those of the wrapped copy
            if late:  # a stranded message leaves its queue here: delivered late
                dlog.event(dl.LATE, a.queues[0].name, e)
            dlog.event(dl.FORWARDED, f"{node}/{a.queues[0].name}", e)
        return self.broker.route(p.bridge, fe, check_full=False)

    async def _decide(
        self, key: str, candidate: str, qname: str, stale: tuple[str, str] | None = None
    ) -> None:
        node, failed = await self._decide_node(key, candidate, qname, stale)
        lost = self._rescue.get(key)
        if node is not None and lost is not None:
            del self._rescue[key]
            q = self.broker.queues.get(qname)
            if q is not None and q.address is not None:
                self._take_from_bridge(lost, key, qname, node, q.address)
        items = self._pending.pop(key, deque())
        if node is None and failed is None:
            self.timeouts += 1
            self._outstanding.pop(key, None)
            log.warning(
                "grouping decision for %r timed out after %d ms (arbiter %s)",
                key,
                self.settings.grouping_timeout,
                self.role.leader_id or "unknown",
            )
        for a, e, done in items:
            res: Any
            try:
                if node is None:
                    if self.settings.grouping_timeout_policy == "ungrouped":
                        res = self._deliver_to(self._pick(qname), a, e)
                        if res is None:
                            res = self.broker.route(a, e)
                    elif failed is not None:
                        res = GroupingTimeout(failed)
                    else:
                        res = GroupingTimeout(
                            f"{TIMED_OUT}: the grouping arbiter "
                            f"({self.role.leader_id or 'not known yet'}) did not answer within "
                            f"grouping_timeout ({self.settings.grouping_timeout} ms); send "
                            "again, and check that the arbiter node is running and reachable"
                        )
                else:
                    res = self._deliver_to(node, a, e)
                    if res is None:
                        res = self.broker.route(a, e)
            except BrokerError as exc:
                res = exc
            done(res)
        self.flush()

    async def _propose(
        self, key: str, candidate: str, qname: str, stale: tuple[str, str] | None = None
    ) -> str:
        while True:
            if self.role.is_leader:
                try:
                    if stale is not None:
                        await self._force_remove(key, *stale)
                    b, _ = await self.arbiter.propose(key, candidate, qname)
                    return b.node
                except NotArbiter:
                    continue
            o = self._outstanding.get(key)
            if o is None:
                o = Outstanding(key, candidate, qname, stale=stale)
                self._outstanding[key] = o
                self._send_proposal(o)
            await o.answered.wait()
            self._outstanding.pop(key, None)
            if o.result is not None:
                return o.result

    def _send_proposal(self, o: Outstanding) -> None:
        leader = self.peers.get(self.role.leader_id or "")
        if leader is None:
            return  # sent when an arbiter is known and reachable (_check_ready)
        self.proposals_sent += 1
        self._request(
            leader,
            "groupingPropose",
            GROUPING_TYPE,
            {"key": o.key, "node": o.node, "queue": o.queue}
            | ({"stale": list(o.stale)} if o.stale else {}),
            on_answer=lambda m: self._on_answer(o, m),
        )
        self.flush()

    def _on_answer(self, o: Outstanding, m: PeerMessage) -> None:
        status = m.properties.get("statusCode")
        body = m.body if isinstance(m.body, dict) else {}
        if status != 200:
            log.info(
                "grouping proposal for %r: %s %s",
                o.key,
                status,
                m.properties.get("statusDescription"),
            )
            return  # kept outstanding: re-sent when the arbiter changes or comes back
        epoch = int(body.get("epoch", 0))
        if not self.role.fence.check(epoch):
            log.warning(
                "ignored a grouping answer of stale epoch %d for %r (current epoch %d): "
                "it comes from a replaced arbiter",
                epoch,
                o.key,
                self.role.fence.current,
            )
            return
        node = str(body["node"])
        self._cache[o.key] = Cached(node, str(body["queue"]), epoch, trio.current_time())
        o.result = node
        o.answered.set()

    # ---------------------------------------------------- management handlers
    def _check_cluster_user(self, req: ManagementRequest) -> None:
        s = self.settings
        if s.require_auth and s.cluster_user and req.user != s.cluster_user:
            raise ManagementError(
                401, f"{req.operation} is for the cluster user {s.cluster_user!r} only"
            )

    def _on_grouping_request(
        self, req: ManagementRequest, respond: Callable[[int, str, Any], None]
    ) -> None:
        op = req.operation
        body = req.body if isinstance(req.body, dict) else {}
        if op == "groupingBindings":
            self._bindings_request(respond)
            return
        self._check_cluster_user(req)
        if op == "groupingPropose":
            if not self.role.is_leader:
                respond(
                    503,
                    f"this node is not the grouping arbiter; the arbiter is "
                    f"{self.role.leader_id or 'not known'}",
                    None,
                )
                return
            assert self._nursery is not None
            self._nursery.start_soon(self._answer_proposal, body, respond)
        elif op == "groupingUnpropose":
            epoch = int(body.get("epoch", 0))
            if not self.role.fence.check(epoch):
                respond(409, f"stale epoch {epoch} (current {self.role.fence.current})", None)
                return
            key, cached = str(body.get("key")), self._cache.get(str(body.get("key")))
            if cached is None or body.get("node") in (None, cached.node):
                self._drop_local(key, str(body.get("queue")))
            lost = self.peers.get(str(body.get("node")))
            if lost is not None and not lost.ready:
                self._released_from_lost(key, lost.node_id, str(body.get("queue")))
            respond(200, "OK", True)
        elif op == "groupingReplicate":
            if self.replica_store is None:
                respond(
                    501,
                    "groupingReplicate needs the arbiter election: this node has no "
                    "cluster_zookeeper (or grouping is off)",
                    None,
                )
                return
            self.replica_store.submit(str(req.properties.get("node", "")), req.body, respond)
        else:
            raise ManagementError(
                501,
                f"unknown grouping operation {op!r}; known: groupingPropose, "
                "groupingUnpropose, groupingBindings, groupingReplicate",
            )

    def _replicate_send(
        self, peer_id: str, body: dict[str, Any], on_answer: Callable[[int, str, Any], None]
    ) -> bool:
        p = self.peers.get(peer_id)
        if p is None:
            return False

        def answer(m: PeerMessage) -> None:
            st = m.properties.get("statusCode")
            on_answer(
                int(st) if isinstance(st, int) else 500,
                str(m.properties.get("statusDescription", "")),
                m.body,
            )

        sent = self._request(p, "groupingReplicate", GROUPING_TYPE, body, on_answer=answer)
        if sent:
            self.flush()
        return sent

    def _replica_check(self, sender: str, epoch: int) -> tuple[int, str, Any] | None:
        """Whether to store a decision replicated by `sender` (None) or the refusal."""
        fence = self.role.fence
        if epoch < fence.current:
            return (
                409,
                f"stale arbiter epoch {epoch}: this node knows epoch {fence.current}, so "
                f"{sender} is no longer the grouping arbiter",
                {"epoch": fence.current},
            )
        view = self.election.view if self.election is not None else None
        if view is None or self.role.is_leader or view.leader_id != sender or view.epoch != epoch:
            return (
                503,
                f"{sender} is not (yet) known here as the grouping arbiter of epoch {epoch}; retry",
                None,
            )
        return None

    async def _answer_proposal(
        self, body: dict[str, Any], respond: Callable[[int, str, Any], None]
    ) -> None:
        try:
            key, node, queue = str(body["key"]), str(body["node"]), str(body["queue"])
            stale = [str(x) for x in body["stale"][:2]] if body.get("stale") else None
        except (KeyError, TypeError):
            respond(400, "groupingPropose needs a map body with key, node and queue", None)
            self.flush()
            return
        try:
            if stale:
                await self._force_remove(key, *stale)
            b, accepted = await self.arbiter.propose(key, node, queue)
        except NotArbiter:
            respond(503, f"this node is no longer the arbiter; ask {self.role.leader_id}", None)
        else:
            respond(
                200,
                "OK",
                {
                    "key": b.key,
                    "node": b.node,
                    "queue": b.queue,
                    "epoch": self.role.epoch,
                    "boundEpoch": b.epoch,
                    "accepted": accepted,
                },
            )
        self.flush()

    def bindings(self) -> list[dict[str, Any]]:
        now = trio.current_time()
        rows = []
        for b in self.arbiter.bindings.values():
            if not b.ready.is_set():
                continue
            row: dict[str, Any] = {
                "key": b.key,
                "node": b.node,
                "queue": b.queue,
                "epoch": b.epoch,
                "idleMillis": int((now - b.last_used) * 1000),
            }
            p = self.peers.get(b.node)
            if p is not None and p.lost and self.loss_policy == "wait":
                since = p.down_since if p.down_since is not None else now
                row["waitingFor"] = b.node
                row["waitingSinceMillis"] = int((now - since) * 1000)
            rows.append(row)
        return rows

    def _bindings_request(self, respond: Callable[[int, str, Any], None]) -> None:
        if self.role.is_leader:
            respond(200, "OK", self.bindings())
            return
        leader = self.peers.get(self.role.leader_id or "")
        if leader is None or not leader.ready:
            respond(
                503,
                f"the grouping arbiter ({self.role.leader_id or 'not known'}) is not reachable "
                "from this node; ask the arbiter node directly",
                None,
            )
            return

        def relay(m: PeerMessage) -> None:
            respond(
                int(m.properties.get("statusCode", 500)),
                str(m.properties.get("statusDescription", "")),
                m.body,
            )

        self._request(leader, "groupingBindings", GROUPING_TYPE, None, on_answer=relay)

    def _on_cluster_request(
        self, req: ManagementRequest, respond: Callable[[int, str, Any], None]
    ) -> None:
        op = req.operation
        if op == "clusterStatus":
            respond(200, "OK", self.status())
        elif op == "clusterTopology":
            self._check_cluster_user(req)
            p = self.peers.get(str(req.properties.get("node")))
            body = req.body if isinstance(req.body, dict) else {}
            if p is None:
                raise ManagementError(404, f"unknown cluster node {req.properties.get('node')!r}")
            old = p.topology
            p.topology = {str(k): int(v) for k, v in dict(body.get("queues") or {}).items()}
            self._peer_queues_changed(p, set(old), body)
            p.grouping = str(body.get("grouping", ""))
            p.announced_at = trio.current_time()
            zk = bool(self.settings.cluster_zookeeper)
            if p.grouping == "LOCAL" and not zk and not self.role.is_leader:
                self.role.become_follower(p.node_id, int(body.get("epoch", 0)))
            respond(200, "OK", True)
        else:
            raise ManagementError(
                501, f"unknown cluster operation {op!r}; known: clusterStatus, clusterTopology"
            )

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        return {
            "node": self.node_id,
            "grouping": self.grouping or "off",
            "nodeLossPolicy": self.loss_policy,
            "waitingFor": self.waiting(),
            "arbiter": self.role.leader_id or "",
            "epoch": self.role.epoch,
            "isArbiter": self.role.is_leader,
            "election": "zookeeper" if self.election is not None else "static",
            "backup": (self.election.view.backup_id or "") if self.election is not None else "",
            "bindings": len(self.arbiter.bindings),
            "cachedAnswers": len(self._cache),
            "pendingProposals": len(self._outstanding),
            "duplicatesDropped": self.window.duplicates,
            "forceRemoved": self.force_removed,
            "consumerlessReleased": self.consumerless_released,
            "groupsVerifying": self.groups_verifying,
            "lateForwarded": self.late_forwarded,
            "proposals": self.proposal_latency.summary(),
            # the arbiter's group commit: batches (one fsync + one replication each)
            "decisionBatches": {
                "batches": self.arbiter.batches,
                "decisions": self.arbiter.decisions,
                "largest": self.arbiter.largest_batch,
            },
            "peers": [
                {
                    "node": p.node_id,
                    "address": f"{p.host}:{p.port}",
                    "link": "up" if p.ready else "down",
                    # down for longer than cluster_node_timeout
                    "lost": p.lost,
                    "downForMillis": 0
                    if p.down_since is None
                    else int((now - p.down_since) * 1000),
                    "lastError": p.driver.last_error if p.driver else "",
                    "grouping": p.grouping,
                    "bridgeDepth": p.bridge.queues[0].count if p.bridge.queues else 0,
                    "forwarded": p.forwarded,
                    "bridgeCredit": p.consumer.credit if p.consumer else 0,
                    "bridgeUnsettled": len(p.consumer.unsettled) if p.consumer else 0,
                }
                for p in self.peers.values()
            ],
        }
