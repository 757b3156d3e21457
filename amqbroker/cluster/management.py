"""The cluster's management handlers and the replication glue.

`ClusterManagement` answers the `$management` operations of the types
`org.amqbroker.grouping` (groupingPropose on the arbiter, groupingUnpropose,
groupingBindings, groupingReplicate) and `org.amqbroker.cluster` (clusterStatus,
clusterTopology: a peer's announcement), and builds `status()` and `bindings()`.

Replication: the leader's arbiter replicates every decision to the backup before
answering (`replication.Replicator`, sent by `replicate_send` as groupingReplicate);
every node stores replicated decisions it accepts (`replication.ReplicaStore`: only
from the node its election names as leader of that very epoch, 409 below its fence:
`replica_check`).

Invariants
----------
- Operations that change state (everything but groupingBindings and clusterStatus)
  are for the cluster user only, when authentication is required.
- An un-proposal or an answer of an epoch older than the fence is refused (409) or
  ignored; only the arbiter answers a proposal (503 elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from amqbroker.cluster.arbiter import Binding, NotArbiter
from amqbroker.cluster.topology import GROUPING_TYPE, NodeContext, NodePart, Peer, Topology
from amqbroker.protocol.management import ManagementError, ManagementRequest
from amqbroker.protocol.peer import PeerMessage

if TYPE_CHECKING:
    from amqbroker.cluster.election import ZkElection
    from amqbroker.cluster.node_loss import NodeLoss
    from amqbroker.cluster.replication import ReplicaStore
    from amqbroker.cluster.routing import Routing
    from amqbroker.protocol.cluster_links import DuplicateWindow

Respond = Callable[[int, str, Any], None]


class ClusterManagement(NodePart):
    """The grouping and cluster management operations, status and replication glue."""

    def __init__(
        self,
        node: NodeContext,
        election: ZkElection | None,
        topology: Topology,
        routing: Routing,
        node_loss: NodeLoss,
        window: DuplicateWindow,
    ) -> None:
        super().__init__(node)
        self.election = election
        self.topology = topology
        self.peers: dict[str, Peer] = topology.peers
        self.routing = routing
        self.node_loss = node_loss
        self.window = window
        #: set by the runner with cluster_zookeeper
        self.replica_store: ReplicaStore | None = None

    def _check_cluster_user(self, req: ManagementRequest) -> None:
        s = self.settings
        if s.require_auth and s.cluster_user and req.user != s.cluster_user:
            raise ManagementError(
                401, f"{req.operation} is for the cluster user {s.cluster_user!r} only"
            )

    def on_grouping_request(self, req: ManagementRequest, respond: Respond) -> None:
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
            try:
                key, node, queue = str(body["key"]), str(body["node"]), str(body["queue"])
                stale = [str(x) for x in body["stale"][:2]] if body.get("stale") else None
            except (KeyError, TypeError):
                respond(400, "groupingPropose needs a map body with key, node and queue", None)
                self.tasks.flush()
                return
            # the usual case needs no task: answered at once for a decided key, else by
            # the arbiter's committer when the decision is durable (`propose_soon`)
            if stale is not None or not self.arbiter.propose_soon(
                key, node, queue, lambda b, accepted: self._answer(respond, b, accepted)
            ):
                started = self.tasks.spawn(self._answer_proposal, key, node, queue, stale, respond)
                assert started
        elif op == "groupingUnpropose":
            epoch = int(body.get("epoch", 0))
            if not self.role.fence.check(epoch):
                respond(409, f"stale epoch {epoch} (current {self.role.fence.current})", None)
                return
            key = str(body.get("key"))
            self.routing.unproposed(key, body.get("node"), str(body.get("queue")))
            lost = self.peers.get(str(body.get("node")))
            if lost is not None and not lost.ready:
                self.node_loss.released_from_lost(key, lost.node_id, str(body.get("queue")))
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

    def replicate_send(
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

        sent = self.topology.request(p, "groupingReplicate", GROUPING_TYPE, body, on_answer=answer)
        if sent:
            self.tasks.flush()
        return sent

    def replica_check(self, sender: str, epoch: int) -> tuple[int, str, Any] | None:
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

    def _answer(self, respond: Respond, b: Binding, accepted: bool) -> None:
        """Answer a proposal with its decided binding `b`."""
        if b.failed:
            if b.error is not None:
                respond(500, f"the grouping decision failed: {b.error}", None)
            else:
                respond(503, f"this node is no longer the arbiter; ask {self.role.leader_id}", None)
        else:
            respond(200, "OK", self._decision_body(b, accepted))
        self.tasks.flush()

    def _decision_body(self, b: Binding, accepted: bool) -> dict[str, Any]:
        return {
            "key": b.key,
            "node": b.node,
            "queue": b.queue,
            "epoch": self.role.epoch,
            "boundEpoch": b.epoch,
            "accepted": accepted,
        }

    async def _answer_proposal(
        self, key: str, node: str, queue: str, stale: list[str] | None, respond: Respond
    ) -> None:
        """The task path: a proposal that first force-removes a stale binding (or
        arrived while this node stopped leading)."""
        try:
            if stale:
                await self.routing.force_remove(key, *stale)
            b, accepted = await self.arbiter.propose(key, node, queue)
        except NotArbiter:
            respond(503, f"this node is no longer the arbiter; ask {self.role.leader_id}", None)
            self.tasks.flush()
        else:
            self._answer(respond, b, accepted)

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
            if p is not None and p.lost and self.node_loss.loss_policy == "wait":
                since = p.down_since if p.down_since is not None else now
                row["waitingFor"] = b.node
                row["waitingSinceMillis"] = int((now - since) * 1000)
            rows.append(row)
        return rows

    def _bindings_request(self, respond: Respond) -> None:
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

        self.topology.request(leader, "groupingBindings", GROUPING_TYPE, None, on_answer=relay)

    def on_cluster_request(self, req: ManagementRequest, respond: Respond) -> None:
        op = req.operation
        if op == "clusterStatus":
            respond(200, "OK", self.status())
        elif op == "clusterTopology":
            self._check_cluster_user(req)
            p = self.peers.get(str(req.properties.get("node")))
            body = req.body if isinstance(req.body, dict) else {}
            if p is None:
                raise ManagementError(404, f"unknown cluster node {req.properties.get('node')!r}")
            self.topology.on_announcement(p, body)
            respond(200, "OK", True)
        else:
            raise ManagementError(
                501, f"unknown cluster operation {op!r}; known: clusterStatus, clusterTopology"
            )

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        routing, loss = self.routing, self.node_loss
        return {
            "node": self.node_id,
            "grouping": self.settings.cluster_grouping or "off",
            "nodeLossPolicy": loss.loss_policy,
            "waitingFor": loss.waiting(),
            "arbiter": self.role.leader_id or "",
            "epoch": self.role.epoch,
            "isArbiter": self.role.is_leader,
            "election": "zookeeper" if self.election is not None else "static",
            "backup": (self.election.view.backup_id or "") if self.election is not None else "",
            "bindings": len(self.arbiter.bindings),
            "cachedAnswers": len(routing.cache),
            "pendingProposals": len(routing.outstanding),
            "duplicatesDropped": self.window.duplicates,
            "forceRemoved": routing.force_removed,
            "consumerlessReleased": loss.consumerless_released,
            "groupsVerifying": loss.groups_verifying,
            "lateForwarded": loss.late_forwarded,
            "proposals": routing.proposal_latency.summary(),
            # the arbiter's group commit: batches (one fsync + one replication each)
            "decisionBatches": {
                "batches": self.arbiter.batches,
                "decisions": self.arbiter.decisions,
                "largest": self.arbiter.largest_batch,
            },
            "peers": [
                {
                    "node": p.node_id,
                    # the address in use (a pair: its live member's, once linked)
                    "address": p.address,
                    "addresses": [f"{h}:{n}" for h, n in p.addresses],
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
                    # the peer's queues and their consumers, as it last announced them
                    "queues": dict(p.topology),
                }
                for p in self.peers.values()
            ],
        }
