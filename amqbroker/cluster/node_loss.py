"""Node loss (issue 20, `cluster_node_loss_policy`) and consumerless release (7.8).

A peer unreachable for `cluster_node_timeout` is lost (`check_peers`, run by the
runner's monitor loop). Under `wait` its groups stay bound to it (the reaper and the
consumerless release spare them too); their messages wait in order in the bridges,
and `waiting()` reports them. Under `move` the arbiter releases them; every node whose
bridge to the lost node holds messages of a released key decides the key again at
once (`released_from_lost`, the key's RESCUE event) and routing's decision moves the
held messages to the new owner (`take_rescued`) before the newer ones waiting behind
it. Whatever the policy, a node holds the groups of the messages it recovered at start
(`hold_recovered`, `Queue.hold_group`) until the arbiter confirms each binding: still
here, it serves them; bound elsewhere, it forwards them there (`_forward_stranded`),
counted as late deliveries.

An instance whose consumers left but which stays keeps its groups (7.8: their
messages wait there for a consumer, never redistributed); with
`grouping_consumerless_timeout` > 0 the arbiter's monitor releases the groups of an
instance its node has announced without consumers for that long (`_consumers`
unknown -> no decision: node loss and deletion cover those).

Invariants
----------
- A peer is `lost` only while its link is down; it stops being lost when it is back.
- A recovered group is held (never served) until the arbiter named its owner;
  `groups_verifying` counts those still held.
- `_rescue` names, per key, the lost node whose bridge holds messages of the key; the
  entry is taken when the key is decided again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import trio

from amqbroker.cluster.topology import NodeContext, NodePart
from amqbroker.core import delivery_log as dl
from amqbroker.core.accept import delivery_time, message_expiry
from amqbroker.core.address import ANYCAST, Address
from amqbroker.core.entry import Entry
from amqbroker.protocol.peer import unwrap_forward
from amqbroker.protocol.scanner import ScanError, scan

if TYPE_CHECKING:
    from amqbroker.cluster.topology import Peer
    from amqbroker.core.queue import Queue

log = logging.getLogger("amqbroker.cluster")


class Decider(Protocol):
    """What node loss needs from routing."""

    async def propose(
        self, key: str, candidate: str, qname: str, stale: tuple[str, str] | None = None
    ) -> str: ...

    def deliver_to(self, node: str, a: Address, e: Entry, *, late: bool = False) -> int | None: ...

    def rescue(self, key: str, qname: str) -> None: ...

    def hold(self, key: str) -> bool: ...

    def start_decision(self, key: str, qname: str) -> None: ...

    def cached_for(self, node: str) -> int: ...

    async def unbind(self, key: str, reason: str) -> None: ...

    @property
    def outstanding(self) -> dict[str, Any]: ...


class NodeLoss(NodePart):
    """Lost peers, recovered groups held until confirmed, consumerless release."""

    def __init__(self, node: NodeContext, peers: dict[str, Peer], routing: Decider) -> None:
        super().__init__(node)
        self.peers = peers
        self.routing = routing
        settings = node.settings
        self.grouping = settings.cluster_grouping
        self.timeout = settings.grouping_timeout / 1000.0
        #: what a node unreachable for cluster_node_timeout does to its groups
        self.loss_policy = settings.cluster_node_loss_policy
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
        self._checked = 0.0

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

    def hold_recovered(self) -> list[tuple[Queue, str]]:
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

    async def verify_recovered(self, held: list[tuple[Queue, str]]) -> None:
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
                        node = await self.routing.propose(key, self.node_id, q.name)
                    if node is not None:
                        break
                    self.routing.outstanding.pop(key, None)
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
            self.routing.deliver_to(node, a, e, late=True)

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
        self.tasks.flush()

    # ---------------------------------------------------------- lost nodes
    def released_from_lost(self, key: str, lost: str, qname: str) -> None:
        """Policy move: `key` was bound to the lost node `lost` and is released. The
        messages of it that this node's bridge to `lost` holds go to the new owner
        before any newer message: the key is decided again at once, newer messages
        wait behind the decision, and the decision takes the held ones from the
        bridge first (`take_rescued`)."""
        if self._marks(key, lost, qname):
            self.routing.rescue(key, qname)

    def _marks(self, key: str, lost: str, qname: str) -> bool:
        """Note that the bridge to `lost` may hold messages of `key` (policy move)."""
        if self.loss_policy != "move" or not self.grouping:
            return False
        p = self.peers.get(lost)
        q = self.broker.queues.get(qname)
        if p is None or q is None or q.address is None or not p.bridge.queues:
            return False
        self._rescue[key] = lost
        return True

    def _hold_for_rescue(self, key: str, lost: str, qname: str) -> bool:
        """On the arbiter, before it unbinds `key`: mark it, and make newer messages
        of it wait (False: nothing to do, or a decision is already under way)."""
        return self._marks(key, lost, qname) and self.routing.hold(key)

    def take_rescued(self, key: str, qname: str, node: str) -> None:
        """`key` is decided (bound to `node`): messages held for a lost node go first
        (kept for later while the decision still names the lost node itself)."""
        lost = self._rescue.get(key)
        if lost is None or lost == node:
            return
        del self._rescue[key]
        q = self.broker.queues.get(qname)
        if q is not None and q.address is not None:
            self._take_from_bridge(lost, key, qname, node, q.address)

    def _take_from_bridge(self, lost: str, key: str, qname: str, node: str, a: Address) -> int:
        p = self.peers.get(lost)
        if p is None or not p.bridge.queues:
            return 0
        gid = key[: -len(qname) - 1]

        def inner(e: Entry) -> Entry | None:
            try:
                _bid, target, data = unwrap_forward(e.data)
                durable, prio, ttl, abs_exp, dc, g, gseq, _to, dtime, ddelay = scan(data)
            except (ValueError, ScanError):
                return None
            if target != qname or g != gid:
                return None
            clock = self.broker.clock
            expiry = message_expiry(clock, ttl, abs_exp)
            ie = Entry(data, durable, prio if prio < 10 else 9, expiry, dc, g, gseq)
            if dtime or ddelay:  # as the peer's inbound link would have read it
                ie.deliver_at = delivery_time(clock, dtime, ddelay)
            return ie

        # each envelope is unwrapped and scanned once: `take_waiting` asks `match` for
        # every waiting entry, then hands the taken ones to `sink`
        found: dict[int, Entry] = {}

        def match(e: Entry) -> bool:
            ie = inner(e)
            if ie is None:
                return False
            found[id(e)] = ie
            return True

        def sink(e: Entry) -> None:
            self.routing.deliver_to(node, a, found.pop(id(e)))

        moved = p.bridge.queues[0].take_waiting(match, sink)
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

    async def check_peers(self) -> None:
        """On the arbiter: a peer unreachable for cluster_node_timeout is lost; the
        groups bound to it are released everywhere (GROUPING 7.8). With
        grouping_consumerless_timeout, so are the groups of an instance without a
        consumer for that long (`_release_consumerless`)."""
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
                    # newer messages of the key wait from now on, before the unbind:
                    # none may be decided elsewhere ahead of those the bridges hold
                    held = b is not None and self._hold_for_rescue(k, p.node_id, b.queue)
                    await self.routing.unbind(k, dl.UNBIND_NODE_LOST)
                    if b is not None and (held or k in self._rescue):
                        self.routing.start_decision(k, b.queue)
            # the other nodes keep their cached answers naming the lost node until the
            # arbiter's un-proposal: until then their messages of those groups queue in
            # order in their bridge, and the un-proposal moves them first
        limit = self.settings.grouping_consumerless_timeout / 1000.0
        if self.role.is_leader and limit > 0 and now - self._checked >= limit / 4:
            self._checked = now  # a sweep over the bindings: at most 4 per limit
            await self._release_consumerless(now)

    def _groups_bound_to(self, node: str) -> int | None:
        """Groups bound to `node` as known here: the arbiter's table, else the cached
        answers (None: this node is not the arbiter and caches nothing for it)."""
        if self.role.is_leader:
            return len(self.arbiter.bound_to(node))
        n = self.routing.cached_for(node)
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

    # ---------------------------------------------------- consumerless release
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
                    await self.routing.unbind(k, dl.UNBIND_CONSUMERLESS)
