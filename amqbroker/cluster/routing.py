"""Routing: which queue instance (which node) gets a message, and group bindings.

`Routing.route` is the broker's `Router` hook, asked for every message a client sends
to an anycast address: an ungrouped message goes to the local queue if it has
consumers, else round robin to a peer whose instance of the queue has consumers and
whose link is up, else stays local (`_pick`). A grouped message goes where the group's
binding says; what to do with it is the group key's state machine's answer
(`proposals.step`): deliver to the bound node, wait behind the decision under way, or
start one. A new group is proposed (key `group_id + "." + queue`) with `_pick`'s
candidate, and the message, with every later message of the same key from this node,
waits in a per-key pending queue until the arbiter answers (so none overtakes the
first), or `grouping_timeout` passes (then rejected with amqp:internal-error "grouping
decision timed out", or routed ungrouped with `grouping_timeout_policy = "ungrouped"`).

Grouping (GROUPING 7.4-7.8): the arbiter (`arbiter.Arbiter`) runs on the leader; the
others cache its answers (`_cache`, never expiring them, D14) and refresh groups they
use every half `grouping_group_timeout`. The arbiter un-proposes (`unbind`: here and on
every peer, which drop the cached answer and unpin the group in their local queue)
bindings that the reaper expired and those of a node unreachable for
`cluster_node_timeout`. Proposals outstanding while the arbiter is unreachable are
kept and sent again when its link is back, or when another arbiter is known; one
answered 503 (the node asked does not know yet that it leads) is sent again after
`cluster_reconnect_initial`. Answers of an epoch older than the current
one are ignored (fencing). An un-proposal names the node it unbinds, so a late one
never drops a newer answer.

Force-removal: a binding this node cannot route to (its node is not in
`cluster_peers`, or announced the queue deleted) is force-removed: the proposal
carries it as `stale` and the arbiter removes it, if it still stands, before deciding;
after `grouping_retries` such attempts the message is treated like a timeout
("grouping decision failed"). `proposal_latency` (clusterStatus "proposals") times
each new group's decision as seen by the entry node.

Invariants
----------
- `_pending` has a key exactly while one `_decide` for it runs (state PROPOSING); the
  messages in it are delivered or failed, in order, when it ends.
- `_outstanding` holds a key while a proposal for it waits for a remote arbiter.
- Hot path (a bound group): a dict lookup, one table lookup (`ON_ROUTE`) and a forward.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from amqbroker.cluster.arbiter import NotArbiter
from amqbroker.cluster.proposals import ON_ROUTE, Action, Event, State, step
from amqbroker.cluster.stats import LatencyHistogram
from amqbroker.cluster.topology import GROUPING_TYPE, NodeContext, NodePart, Peer
from amqbroker.core import delivery_log as dl
from amqbroker.core.accept import ENLIST
from amqbroker.core.address import ANYCAST, Address
from amqbroker.core.broker import PENDING
from amqbroker.core.entry import Entry
from amqbroker.core.errors import BrokerError
from amqbroker.protocol.peer import PeerMessage, wrap_forward

log = logging.getLogger("amqbroker.cluster")

TIMED_OUT = "grouping decision timed out"

_Waiting = deque[tuple[Address, Entry, Callable[[Any], None]]]


_UNKNOWN, _PROPOSING, _BOUND, _STALE = State.UNKNOWN, State.PROPOSING, State.BOUND, State.STALE
_DELIVER = Action.DELIVER


class GroupingTimeout(BrokerError):
    condition = "amqp:internal-error"


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


class Links(Protocol):
    """What routing needs from topology: requests to a peer."""

    def request(
        self,
        p: Peer,
        operation: str,
        typ: str,
        body: Any,
        on_answer: Callable[[PeerMessage], None] | None = None,
        msg_id: str | None = None,
    ) -> bool: ...


class Rescuer(Protocol):
    """What routing needs from node loss: a decided key's messages held for a lost node."""

    def take_rescued(self, key: str, qname: str, node: str) -> None: ...


class Routing(NodePart):
    """The broker's `Router` hook: where each message goes, and the group bindings."""

    def __init__(
        self,
        node: NodeContext,
        peers: dict[str, Peer],
        gone: dict[str, set[str]],
        links: Links,
    ) -> None:
        super().__init__(node)
        self.peers = peers
        self._gone = gone
        self.links = links
        #: set by the runner once node loss exists
        self.rescuer: Rescuer | None = None
        settings = node.settings
        self.grouping = settings.cluster_grouping
        self.timeout = settings.grouping_timeout / 1000.0
        self.group_timeout = settings.grouping_group_timeout / 1000.0
        #: answer a grouped message's producer once its owner node stored it (7.11)
        self.accept_after_forward = settings.cluster_accept_after_forward
        self._seq = itertools.count(1)
        self._rr = itertools.count()
        self._pending: dict[str, _Waiting] = {}
        #: keys `hold` made wait for a decision `start_decision` starts
        self._held: set[str] = set()
        #: key -> completions of transactional sends waiting for its decision to be
        #: enlisted (`prepare`); answered when the decision ends
        self._enlisting: dict[str, list[Callable[[Any], None]]] = {}
        self.outstanding: dict[str, Outstanding] = {}
        self.cache: dict[str, Cached] = {}
        self.proposals_sent = 0
        self.timeouts = 0
        self.force_removed = 0
        #: entry node: time from proposing a new group to the answer (local or remote)
        self.proposal_latency = LatencyHistogram()

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
            return None  # (`_handles`, inlined: once per message)
        qname = a.queues[0].name
        if e.group_id is None or not self.grouping:
            return self.deliver_to(self._pick(qname), a, e)
        key = f"{e.group_id}.{qname}"
        pend = self._pending.get(key)
        node: str | None = None
        if pend is not None:
            state = _PROPOSING
        else:
            node = self._lookup(key)
            if node is None:
                state = _UNKNOWN
            elif self._unroutable(node, qname) is None:
                state = _BOUND
            else:
                state = _STALE
        actions = ON_ROUTE[state].actions  # = step(state, Event.ROUTE).actions
        if actions[0] is _DELIVER:
            assert node is not None
            return self.deliver_to(node, a, e, done)
        if pend is not None:  # QUEUE: behind the decision under way
            pend.append((a, e, done))
            return PENDING
        self._pending[key] = deque([(a, e, done)])
        # PROPOSE, or PROPOSE_FORCE_REMOVE: force-removed and proposed again
        force = actions[-1] is Action.PROPOSE_FORCE_REMOVE
        stale = (node, qname) if force and node is not None else None
        started = self.tasks.spawn(self._decide, key, self._pick(qname), qname, stale)
        assert started
        return PENDING

    def _handles(self, a: Address) -> bool:
        return a.routing == ANYCAST and len(a.queues) == 1 and not a.name.startswith("$")

    def prepare(self, a: Address, e: Entry, done: Callable[[Any], None]) -> int | None:
        """A transactional send of a grouped message, before it is enlisted: a group
        with no decision yet is decided first (PENDING; `done(ENLIST)` or
        `done(GroupingTimeout)` when it ends), so that at commit `route_committed`
        finds it bound and routes it in the commit's own store batch."""
        if not (self.grouping and self._handles(a)):
            return None
        qname = a.queues[0].name
        key = f"{e.group_id}.{qname}"
        state = self.state(key)
        if state is _BOUND or state is _STALE:  # STALE: force-removed at commit
            return None
        self._enlisting.setdefault(key, []).append(done)
        if state is _UNKNOWN:
            self._pending[key] = deque()
            self.tasks.spawn(self._decide, key, self._pick(qname), qname, None)
        return PENDING

    def route_committed(self, a: Address, e: Entry) -> int | None:
        """A transactional send taking effect at commit: to its group's owner, at once
        when the group is bound (the usual case after `prepare`); else behind a new
        decision, in memory until it ends (a refusal then is logged: the commit was
        answered already). None: the broker routes it (ungrouped: locally, as before)."""
        if e.group_id is None or not (self.grouping and self._handles(a)):
            return None
        qname = a.queues[0].name
        key = f"{e.group_id}.{qname}"
        if key not in self._pending:
            node = self._lookup(key)
            if node is not None and self._unroutable(node, qname) is None:
                return self.deliver_to(node, a, e)
        return self.route(a, e, functools.partial(self._committed_late, key))

    @staticmethod
    def _committed_late(key: str, res: object) -> None:
        if isinstance(res, BrokerError):
            log.warning(
                "a committed transactional message of group key %r was dropped: %s",
                key,
                res.description,
            )

    def _lookup(self, key: str) -> str | None:
        if self.role.is_leader:
            b = self.arbiter.lookup(key)
            return b.node if b is not None and b.ready.is_set() else None
        c = self.cache.get(key)
        if c is None:
            return None
        now = trio.current_time()
        if self.group_timeout > 0 and now - c.touched > self.group_timeout / 2:
            c.touched = now
            leader = self.peers.get(self.role.leader_id or "")
            if leader is not None:  # refresh: a proposal the arbiter counts as a use
                self.links.request(
                    leader,
                    "groupingPropose",
                    GROUPING_TYPE,
                    {"key": key, "node": c.node, "queue": c.queue},
                )
        return c.node

    def state(self, key: str) -> State:
        """The key's state as known here (cached answer first, then the arbiter's)."""
        if key in self._pending:
            return State.PROPOSING
        c = self.cache.get(key)
        if c is not None:
            node, qname = c.node, c.queue
        else:
            b = self.arbiter.bindings.get(key) if self.role.is_leader else None
            if b is None or not b.ready.is_set():
                return State.UNKNOWN
            node, qname = b.node, b.queue
        return State.BOUND if self._unroutable(node, qname) is None else State.STALE

    def deliver_to(
        self,
        node: str,
        a: Address,
        e: Entry,
        done: Callable[[Any], None] | None = None,
        *,
        late: bool = False,
    ) -> int:
        """Route `e` to `a`'s instance on `node`: here, or wrapped onto its bridge.

        With `done` (a grouped message's producer transfer) and
        `cluster_accept_after_forward`, a message for a peer whose link is up returns
        PENDING and `done` is called when the peer accepts it (or, the link lost, as
        stored here): the producer is answered only once the owner has the message, so
        none it was told accepted can be stranded in this node's bridge (GROUPING 7.11)."""
        if node == self.node_id:
            return self.broker.route(a, e)
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
        res = self.broker.route(p.bridge, fe, check_full=False)
        if done is not None and p.ready and self.accept_after_forward:
            p.awaiting[data] = done
            return PENDING
        return res

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

    # ------------------------------------------------------------ decisions
    def hold(self, key: str) -> bool:
        """Make messages of `key` wait behind a decision that `start_decision` starts
        later (the arbiter is about to release the key). False when one is pending."""
        if key in self._pending:
            return False
        self._pending[key] = deque()
        self._held.add(key)
        return True

    def start_decision(self, key: str, qname: str) -> None:
        """Decide a key `hold` made wait, or one with no decision under way."""
        if key in self._held:
            self._held.discard(key)
        elif key in self._pending:
            return  # a decision is under way: it takes the bridged messages first
        else:
            self._pending[key] = deque()
        self.tasks.spawn(self._decide, key, self._pick(qname), qname, None)

    def rescue(self, key: str, qname: str) -> None:
        """Decide `key` again at once (its node was lost and it was released)."""
        if Action.PROPOSE not in step(self.state(key), Event.RESCUE).actions:
            return  # a decision is under way: it takes them first
        self._pending[key] = deque()
        self.tasks.spawn(self._decide, key, self._pick(qname), qname, None)

    async def _decide(
        self, key: str, candidate: str, qname: str, stale: tuple[str, str] | None = None
    ) -> None:
        node, failed = await self._decide_node(key, candidate, qname, stale)
        if node is not None:
            event = Event.DECIDED
        else:
            event = Event.TIMEOUT if failed is None else Event.GIVE_UP
        for action in step(_PROPOSING, event).actions:
            if action is Action.TAKE_FROM_BRIDGE:
                assert node is not None
                if self.rescuer is not None:
                    self.rescuer.take_rescued(key, qname, node)
            elif action is Action.COUNT_TIMEOUT:
                self.timeouts += 1
                self.outstanding.pop(key, None)
                log.warning(
                    "grouping decision for %r timed out after %d ms (arbiter %s)",
                    key,
                    self.settings.grouping_timeout,
                    self.role.leader_id or "unknown",
                )
            else:  # DELIVER_WAITING, FAIL_WAITING: the decision is over
                self._release_waiting(self._pending.pop(key, deque()), node, failed, qname)
        enlisting = self._enlisting.pop(key, None)
        if enlisting:
            res: Any = ENLIST
            if node is None and self.settings.grouping_timeout_policy != "ungrouped":
                res = GroupingTimeout(failed or f"{TIMED_OUT}: send again in a new transaction")
            for done in enlisting:
                done(res)
        self.tasks.flush()

    def _release_waiting(
        self, items: _Waiting, node: str | None, failed: str | None, qname: str
    ) -> None:
        for a, e, done in items:
            res: Any
            try:
                if node is None:
                    if self.settings.grouping_timeout_policy == "ungrouped":
                        res = self.deliver_to(self._pick(qname), a, e)
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
                    res = self.deliver_to(node, a, e, done)
            except BrokerError as exc:
                res = exc
            if res != PENDING:
                done(res)

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
                for action in step(_PROPOSING, Event.FORCE_REMOVAL).actions:
                    if action is Action.DROP_CACHE:
                        self.cache.pop(key, None)
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
                node = await self.propose(key, candidate, qname, stale)
            if node is None:
                return None, None
            self.proposal_latency.record(trio.current_time() - t0)
            reason = self._unroutable(node, qname)
            if reason is None:
                return node, None
            why, stale = reason, (node, qname)

    async def propose(
        self, key: str, candidate: str, qname: str, stale: tuple[str, str] | None = None
    ) -> str:
        while True:
            if self.role.is_leader:
                try:
                    if stale is not None:
                        await self.force_remove(key, *stale)
                    b, _ = await self.arbiter.propose(key, candidate, qname)
                    return b.node
                except NotArbiter:
                    continue
            o = self.outstanding.get(key)
            if o is None:
                o = Outstanding(key, candidate, qname, stale=stale)
                self.outstanding[key] = o
                self._send_proposal(o)
            await o.answered.wait()
            self.outstanding.pop(key, None)
            if o.result is not None:
                return o.result

    def resend_proposals(self) -> None:
        """The arbiter's link is up (or a new arbiter is known): send what waits."""
        for o in self.outstanding.values():
            self._send_proposal(o)

    def _send_proposal(self, o: Outstanding) -> None:
        leader = self.peers.get(self.role.leader_id or "")
        if leader is None:
            return  # sent when an arbiter is known and reachable (_check_ready)
        self.proposals_sent += 1
        self.links.request(
            leader,
            "groupingPropose",
            GROUPING_TYPE,
            {"key": o.key, "node": o.node, "queue": o.queue}
            | ({"stale": list(o.stale)} if o.stale else {}),
            on_answer=lambda m: self._on_answer(o, m),
        )
        self.tasks.flush()

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
            if status == 503:
                # "not the arbiter": the node it went to may learn that it leads only
                # after this node learned it (an election's views reach the nodes in
                # any order): no later arbiter change would re-send it, so try again
                self.tasks.spawn(self._propose_again, o)
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
        self.cache[o.key] = Cached(node, str(body["queue"]), epoch, trio.current_time())
        o.result = node
        o.answered.set()

    async def _propose_again(self, o: Outstanding) -> None:
        """After a 503, send `o` again (to the arbiter known then) in
        ``cluster_reconnect_initial`` seconds, if it is still waiting; the proposal's
        own ``grouping_timeout`` bounds the attempts."""
        await trio.sleep(self.settings.cluster_reconnect_initial)
        waiting = self.outstanding.get(o.key) is o and not o.answered.is_set()
        if waiting and not self.role.is_leader:
            self._send_proposal(o)

    def role_changed(self) -> None:
        if self.role.is_leader:  # proposals waiting for another arbiter: decided here now
            for o in list(self.outstanding.values()):
                o.answered.set()
        if self.role.leader_id and self.role.leader_id != self.node_id:
            p = self.peers.get(self.role.leader_id)
            if p is not None and p.ready:
                self.resend_proposals()

    # ------------------------------------------------- releases (un-proposals)
    def unproposed(self, key: str, node: object, queue: str) -> None:
        """The arbiter un-proposed `key` (bound to `node`; None: whichever)."""
        cached = self.cache.get(key)
        late = cached is not None and node not in (None, cached.node)
        event = Event.UNPROPOSE_LATE if late else Event.UNPROPOSE
        for action in step(self.state(key), event).actions:
            if action is Action.DROP_BINDING:
                self.drop_local(key, queue)

    def cached_for(self, node: str) -> int:
        return sum(1 for c in self.cache.values() if c.node == node)

    async def force_remove(self, key: str, node: str, queue: str) -> None:
        """On the arbiter: remove `key`'s binding if it still names node/queue."""
        b = self.arbiter.lookup(key, touch=False)
        if b is not None and b.ready.is_set() and (b.node, b.queue) == (node, queue):
            log.warning("group binding %r -> %s/%s force-removed", key, node, queue)
            await self.unbind(key, dl.UNBIND_FORCED)

    async def unbind(self, key: str, reason: str) -> None:
        """On the arbiter: release `key`'s binding everywhere, for `reason` (one of
        `delivery_log.UNBIND_REASONS`, recorded in the ``unbound`` marker)."""
        try:
            b = await self.arbiter.remove(key)
        except NotArbiter:
            return  # fenced meanwhile: the new arbiter decides
        if b is None:
            return
        self.drop_local(key, b.queue)
        if self.broker.dlog is not None:  # the audit's marker: the group may move now
            self.broker.dlog.marker(
                dl.UNBOUND, f"{b.node}/{b.queue}", key[: -len(b.queue) - 1], reason
            )
        for p in self.peers.values():
            self.links.request(
                p,
                "groupingUnpropose",
                GROUPING_TYPE,
                {"key": key, "node": b.node, "queue": b.queue, "epoch": self.role.epoch},
            )
        self.tasks.flush()

    def drop_local(self, key: str, queue: str) -> None:
        self.cache.pop(key, None)
        q = self.broker.queues.get(queue)
        suffix = "." + queue
        if q is not None and key.endswith(suffix):
            q.reset_group(key[: -len(suffix)])

    async def release_instances(self, node: str, queues: set[str]) -> None:
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
                await self.unbind(k, dl.UNBIND_QUEUE_DELETED)
