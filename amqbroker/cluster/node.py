"""A cluster node: the runner that wires the cluster's parts and owns their trio tasks.

The parts, each in its own module:

- `topology`: the peers, their links up/down, announcements and requests (`Peer`,
  `BridgeConsumer`, `Topology`);
- `routing`: which instance gets a message, group bindings, force-removal and the
  arbiter's releases (`Routing`, the broker's `Router` hook);
- `proposals`: the lifecycle of a group key on its entry node, a pure state machine
  that `Routing` asks what to do (deliver, wait, propose) and feeds what it learns;
- `node_loss`: lost peers, recovered groups held until confirmed, consumerless
  release (`NodeLoss`);
- `management`: the `$management` handlers, `status()`, `bindings()` and the
  replication glue (`ClusterManagement`).

`ClusterNode` builds them (each a `topology.NodePart`, given the same
`topology.NodeContext`), connects them through small Protocols (`topology.Tasks`,
`topology.Releaser`, `routing.Links`, `routing.Rescuer`, `node_loss.Decider`) and runs
their loops in one nursery: the outbound drivers, the topology announcements, the node
monitor, the reaper, the arbiter's group commit, the election and the replica store.

Who arbitrates: without `cluster_zookeeper` the node with `cluster_grouping = "LOCAL"`
leads at epoch 0 for good (a single point of failure, logged at start) and the others
learn it from its announcements. With `cluster_zookeeper` (and grouping on) `run`
starts `election.zk_election(settings, self.role)`: every such node is eligible; the
election calls `ArbiterRole.become_leader/become_follower/become_backup/backup_changed`
(`become_follower(None, e)`: no arbiter known, proposals wait and are re-sent once one
is). The leader's arbiter replicates every decision to the backup before answering
(`replication.Replicator`, `groupingReplicate`); every node stores replicated
decisions it accepts (`replication.ReplicaStore`). The arbiter commits the decisions
waiting at one moment as one batch (`Arbiter.run`, started here: one fsync and one
replication message per batch). Proposals waiting for another arbiter when this node
becomes leader are decided here.

Limits: multicast addresses, transactional sends and addresses with several queues are
routed locally only; messages already forwarded to a queue instance whose consumers
later left wait there (no redistribution); the duplicate window is in memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from amqbroker.cluster.arbiter import SPOF_WARNING, Arbiter, ArbiterRole
from amqbroker.cluster.decisions import DecisionLog
from amqbroker.cluster.election import ZkElection, zk_election
from amqbroker.cluster.management import ClusterManagement
from amqbroker.cluster.node_loss import NodeLoss
from amqbroker.cluster.replication import ReplicaStore, Replicator
from amqbroker.cluster.routing import (
    TIMED_OUT,
    Cached,
    GroupingTimeout,
    Outstanding,
    Routing,
)
from amqbroker.cluster.topology import (
    BRIDGE_PREFIX,
    CLUSTER_TYPE,
    GROUPING_TYPE,
    BridgeConsumer,
    NodeContext,
    Peer,
    Topology,
)
from amqbroker.core import delivery_log as dl
from amqbroker.core.broker import Broker
from amqbroker.net.driver import Hub
from amqbroker.protocol.cluster_links import INBOUND_ADDRESS, DuplicateWindow, inbound_factory
from amqbroker.protocol.connection import AmqpConnection
from amqbroker.protocol.management import ManagementNode
from amqbroker.settings import Settings

__all__ = [
    "BRIDGE_PREFIX",
    "CLUSTER_TYPE",
    "GROUPING_TYPE",
    "LOSS_POLICY_TEXT",
    "TIMED_OUT",
    "BridgeConsumer",
    "Cached",
    "ClusterNode",
    "GroupingTimeout",
    "Outstanding",
    "Peer",
]

log = logging.getLogger("amqbroker.cluster")

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


class ClusterNode:
    """Wires the parts (see the module docstring) and owns their trio tasks."""

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
        self.grouping = s.cluster_grouping
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
        self._nursery: trio.Nursery | None = None
        #: set once the election named an arbiter epoch (`run` waits for it, bounded)
        self._epoch_known = trio.Event()
        self.window = DuplicateWindow(s.cluster_duplicate_window)
        node = NodeContext(s, broker, self.node_id, self.boot, self.role, self.arbiter, self)
        self.topology = Topology(node, None)
        self.peers: dict[str, Peer] = self.topology.peers
        self.routing = Routing(node, self.peers, self.topology.gone, self.topology)
        self.topology.releaser = self.routing
        self.node_loss = NodeLoss(node, self.peers, self.routing)
        self.routing.rescuer = self.node_loss
        self.management = ClusterManagement(
            node, None, self.topology, self.routing, self.node_loss, self.window
        )
        if s.cluster_zookeeper and self.grouping:
            self.election = zk_election(s, self.role)
            self.role.fence = self.election.fence
            self.replicator = Replicator(
                self.arbiter,
                self.management.replicate_send,
                epoch=lambda: self.role.epoch,
                confirm=self.election.confirm,
                on_fenced=lambda epoch: self.role.become_follower(None, epoch),
                retry_delay=s.cluster_reconnect_initial,
                spawn=self.spawn,  # the eager snapshot to a new backup
            )
            self.arbiter.add_replica(self.replicator)
            self.replica_store = ReplicaStore(
                self.arbiter, self.management.replica_check, self.flush
            )
            self.topology.replicator = self.replicator
            self.management.election = self.election
            self.management.replica_store = self.replica_store
        management.register(GROUPING_TYPE, self.management.on_grouping_request)
        management.register(CLUSTER_TYPE, self.management.on_cluster_request)
        management.targets[INBOUND_ADDRESS] = inbound_factory(self.window, self._authorize)
        broker.router = self.routing

    # ------------------------------------------------------- what others read
    @property
    def _cache(self) -> dict[str, Cached]:
        return self.routing.cache

    @property
    def consumerless_released(self) -> int:
        return self.node_loss.consumerless_released

    def waiting(self) -> list[dict[str, Any]]:
        """Lost peers whose groups wait for them (cluster_node_loss_policy = wait)."""
        return self.node_loss.waiting()

    def status(self) -> dict[str, Any]:
        return self.management.status()

    def bindings(self) -> list[dict[str, Any]]:
        return self.management.bindings()

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
            held = self.node_loss.hold_recovered()
            for p in self.peers.values():
                n.start_soon(self.topology.start(p, self.hub).run)
            n.start_soon(self.topology.topology_loop)
            n.start_soon(self._monitor_loop)
            if self.election is not None and self.replica_store is not None:
                n.start_soon(self.replica_store.run)
                await n.start(self.election.run)
                await self._wait_for_epoch()
            if self.group_timeout > 0 and s.grouping_reaper_period > 0:
                n.start_soon(self._reaper_loop)
            if held:
                n.start_soon(self.node_loss.verify_recovered, held)
            task_status.started()

    async def _wait_for_epoch(self) -> None:
        """Before the listener opens (bounded by the session timeout): the arbiter
        epoch, which the delivery log stamps on every record (the audit orders the
        nodes' records by it first). A node that accepted forwarded messages before
        its election's first view would log their dispatches at epoch 0, before every
        earlier record of the same groups: a restarted node, or a pair's backup
        taking over, whose consumers then seemed to overlap the old owner's."""
        limit = self.settings.cluster_zookeeper_session_timeout / 1000.0
        with trio.move_on_after(limit):
            await self._epoch_known.wait()
            return
        log.warning(
            "cluster node %s: no arbiter epoch from ZooKeeper within %.1f s; accepting "
            "connections anyway (the delivery log records epoch 0 until one is known)",
            self.node_id,
            limit,
        )

    def close(self) -> None:
        self.arbiter.close()

    def spawn(self, fn: Callable[..., Awaitable[object]], *args: Any) -> bool:
        """Start `fn(*args)` in the node's nursery; False before `run`."""
        if self._nursery is None:
            return False
        self._nursery.start_soon(fn, *args)
        return True

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

    def _role_changed(self) -> None:
        self.topology.announced = None  # announce the new role at the next tick
        if self.role.epoch > 0:
            self._epoch_known.set()
        dlog = self.broker.dlog
        if dlog is not None:
            # delivery-log records carry the arbiter epoch their group decisions
            # were made under (the audit orders owners across failovers by it)
            dlog.set_owner_epoch(self.role.epoch)
        if self.replicator is not None and self.election is not None:
            backup = self.election.view.backup_id if self.role.is_leader else None
            self.replicator.set_target(None if backup == self.node_id else backup)
        self.routing.role_changed()

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

    async def _monitor_loop(self) -> None:
        """Lost peers and consumerless instances (`NodeLoss.check_peers`)."""
        period = min(0.2, self.settings.cluster_node_timeout / 4)
        while True:
            await trio.sleep(period)
            await self.node_loss.check_peers()

    async def _reaper_loop(self) -> None:
        while True:
            await trio.sleep(self.settings.grouping_reaper_period / 1000.0)
            if not self.role.is_leader:
                continue
            for k in self.arbiter.idle(trio.current_time() - self.group_timeout):
                b = self.arbiter.bindings.get(k)
                if b is not None and self.topology.node_down(b.node):
                    # its messages may still wait in the bridges or in the node's store:
                    # expiring it now would let newer messages overtake them
                    continue
                await self.routing.unbind(k, dl.UNBIND_IDLE)
