"""Who is the cluster's grouping arbiter: a leader election in ZooKeeper, and its fence.

Theory of operation
-------------------
Clustered grouping needs exactly one arbiter (the LOCAL handler of GROUPING.md 7) that
decides which queue instance owns a group. Instead of a home-made election, the
arbiter is the leader of a ZooKeeper election, as in Artemis's pluggable-quorum HA:

* every node creates an *ephemeral sequential* znode ``<path>/election/n_<seq>``
  whose data is its node id. The children sorted by sequence number give the order:
  the first is the **leader** (the arbiter), the second the **backup** (it receives
  every decision synchronously before the leader answers, so it can take over with
  the whole state), the others are **followers** (REMOTE handlers);
* a znode lives as long as its owner's ZooKeeper session. When the leader crashes,
  is paused (SIGSTOP) or is cut off for longer than the session timeout, ZooKeeper
  expires the session and deletes the znode; the backup becomes first;
* to take over, a node that finds itself first bumps the **epoch**: the integer in
  ``<path>/epoch`` (JSON ``{"epoch": n, "leader": id, "znode": name}``), rewritten in
  one ZooKeeper transaction that also checks that the node's own election znode
  still exists and that the epoch znode has not changed since it was read
  (compare-and-set on its version). So an epoch is given to at most one leadership,
  only to a node that is first in the election at that moment, and epochs only grow;
* every arbiter decision and answer carries the epoch it was made under. A node
  that knows a higher epoch refuses lower ones: that is the `Fence`. A paused old
  arbiter that resumes still believes it leads until kazoo reports its session
  expired; whatever it sends meanwhile carries its old epoch and is refused by every
  node that has seen the new one, in particular by the new leader (the old backup),
  whose synchronous acknowledgement the old arbiter needs before it may answer. Two
  arbiters can therefore never both get a decision for the same group accepted.

Threads
-------
kazoo is a blocking, threaded client. `ZkElection` owns one worker thread that does
every kazoo call; kazoo's own callbacks (watches, connection-state listener) only
put a wake-up on that thread's queue, so no kazoo call ever runs on kazoo's event
thread or on the trio loop's thread. The worker evaluates the election after every
wake-up (re-arming its one-shot watches) and hands each change of role to trio
(``trio.from_thread.run``) through a memory channel of `VIEW_CHANNEL_SIZE` views, which
`ZkElection.run` reads to call the `ElectionEvents` callbacks on the trio thread, in
order. When the channel is full the worker waits for room (it blocks on no lock the
trio thread needs), so no change is dropped; changes pile up only while the trio
thread is stalled, and ZooKeeper's wake-ups wait in the worker's queue meanwhile. The
`Fence` is shared: the worker raises it (under a lock) as soon as ZooKeeper shows a
higher epoch, before trio hears about it. The thread, the channel, the `Fence` and the
epoch's compare-and-set live in `amqbroker.cluster.zk`, shared with the HA lease
(`amqbroker.ha.lease`).

Invariants
----------
* A role is reported as leader only after this node's epoch bump has committed, and
  only while the kazoo connection is CONNECTED; on SUSPENDED (connection lost, the
  session may still be alive) or LOST (session expired) the leader reports
  ``on_lost`` at once and stops being leader. After a reconnect it re-evaluates and,
  if still first, takes a fresh epoch.
* Followers and the backup name a leader only once that leader's takeover has
  committed (the epoch znode names the first election znode); in between they are
  told ``leader_id=None`` (no arbiter right now: keep proposals, re-send later).
* `Fence.current` never decreases; `Fence.check(e)` is true iff ``e >= current``.
* Callbacks are called on the trio thread, one at a time, in the order the worker
  saw the changes: the role callbacks only when (role, leader, epoch) changed, the
  optional ``on_backup_changed(backup_id)`` when the second in line changed (the
  leader then re-attaches its synchronous replica). `ZkElection.view` always has the
  latest `ElectionView`, members and backup included.

Without ZooKeeper configured (``cluster_zookeeper = ""``) the cluster uses
`StaticElection`: a fixed arbiter with epoch 1, a single point of failure.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

import trio

from amqbroker.cluster.zk import (
    Fence,
    ZkWorker,
    kazoo_installed,
    read_epoch,
)
from amqbroker.core.errors import LocalError

if TYPE_CHECKING:
    from amqbroker.settings import Settings

__all__ = [
    "ArbiterRoleLike",
    "ElectionEvents",
    "ElectionView",
    "Fence",
    "Role",
    "StaticElection",
    "ZkElection",
    "arbiter_events",
    "default_zookeeper_path",
    "zk_election",
]

log = logging.getLogger("amqbroker.cluster.election")

ELECTION_PREFIX: Final = "n_"


def default_zookeeper_path(cluster_name: str = "") -> str:
    """The election's znode when ``cluster_zookeeper_path`` is empty.

    ``/amqbroker/<cluster_name>``; ``/amqbroker/default`` while there is no cluster name
    (one cluster per ZooKeeper ensemble unless each sets its own path).
    """
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in cluster_name) or "default"
    return f"/amqbroker/{safe}"


# ------------------------------------------------------------------------- the events


class Role(enum.Enum):
    LEADER = "leader"
    BACKUP = "backup"
    FOLLOWER = "follower"
    LOST = "lost"  # not connected to ZooKeeper (or not yet): no role at all


@dataclass(frozen=True)
class ElectionView:
    """What this node knows of the election after one evaluation."""

    role: Role
    epoch: int  # the current epoch (this node's own when it leads)
    leader_id: str | None  # None: no leader has completed its takeover (or LOST)
    backup_id: str | None = None  # the second in the election order, if any
    members: tuple[str, ...] = field(default=())  # node ids in election order


class ElectionEvents(Protocol):
    """Receives role changes, on the trio thread (see `arbiter_events`)."""

    def on_leader(self, epoch: int) -> None: ...
    def on_backup(self, leader_id: str | None, epoch: int) -> None: ...
    def on_follower(self, leader_id: str | None, epoch: int) -> None: ...
    def on_lost(self) -> None: ...


class ArbiterRoleLike(Protocol):
    """The cluster core's side (`amqbroker.cluster.arbiter.ArbiterRole`).

    ``leader_node_id`` is None when no arbiter is known (takeover in progress, or this
    node lost ZooKeeper): stop deciding, keep proposals and re-send them later.
    Optional methods, called when present: ``become_backup(leader_node_id, epoch)``
    and ``backup_changed(backup_node_id | None)``.
    """

    def become_leader(self, epoch: int) -> None: ...
    def become_follower(self, leader_node_id: str | None, epoch: int) -> None: ...


class _ArbiterEvents:
    def __init__(self, role: ArbiterRoleLike, fence: Fence) -> None:
        self._role = role
        self._fence = fence

    def on_leader(self, epoch: int) -> None:
        self._role.become_leader(epoch)

    def on_backup(self, leader_id: str | None, epoch: int) -> None:
        become_backup = getattr(self._role, "become_backup", None)
        if become_backup is not None:
            become_backup(leader_id, epoch)
        else:
            self._role.become_follower(leader_id, epoch)

    def on_follower(self, leader_id: str | None, epoch: int) -> None:
        self._role.become_follower(leader_id, epoch)

    def on_lost(self) -> None:
        self._role.become_follower(None, self._fence.current)

    def on_backup_changed(self, backup_id: str | None) -> None:
        backup_changed = getattr(self._role, "backup_changed", None)
        if backup_changed is not None:
            backup_changed(backup_id)


def arbiter_events(role: ArbiterRoleLike, fence: Fence) -> ElectionEvents:
    """Map election events onto an `ArbiterRole`.

    leader -> ``become_leader(epoch)``; backup -> ``become_backup(leader, epoch)`` if the
    role has that method, else ``become_follower``; follower -> ``become_follower``;
    lost -> ``become_follower(None, fence.current)`` (no arbiter known: stop deciding,
    keep proposals); backup changed -> ``backup_changed(backup)`` if the role has it.
    """
    return _ArbiterEvents(role, fence)


def _dispatch(events: ElectionEvents, view: ElectionView, old: ElectionView | None) -> None:
    if old is not None and (view.role, view.leader_id, view.epoch) == (
        old.role,
        old.leader_id,
        old.epoch,
    ):
        if view.backup_id != old.backup_id:
            backup_changed = getattr(events, "on_backup_changed", None)
            if backup_changed is not None:
                backup_changed(view.backup_id)
        return
    if view.role is Role.LEADER:
        events.on_leader(view.epoch)
    elif view.role is Role.BACKUP:
        events.on_backup(view.leader_id, view.epoch)
    elif view.role is Role.FOLLOWER:
        events.on_follower(view.leader_id, view.epoch)
    else:
        events.on_lost()


# ---------------------------------------------------------------------- static arbiter


class StaticElection:
    """No ZooKeeper: `arbiter_id` is the arbiter for good (epoch 1), as in Artemis.

    The arbiter is a single point of failure; `warning` says so for the start-up log.
    """

    EPOCH: Final = 1

    def __init__(self, node_id: str, arbiter_id: str, events: ElectionEvents) -> None:
        self.node_id = node_id
        self.arbiter_id = arbiter_id
        self.fence = Fence(self.EPOCH)
        self._events = events
        role = Role.LEADER if node_id == arbiter_id else Role.FOLLOWER
        self.view = ElectionView(role, self.EPOCH, arbiter_id)

    @property
    def warning(self) -> str:
        return (
            f"cluster arbiter is the static node {self.arbiter_id!r}: it is a single point "
            "of failure for new message groups; set cluster_zookeeper to elect the arbiter "
            "and a backup in ZooKeeper instead"
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        _dispatch(self._events, self.view, None)
        task_status.started()
        await trio.sleep_forever()


# ------------------------------------------------------------------- ZooKeeper election


class ZkElection(ZkWorker[ElectionView]):
    """One node's participation in the arbiter election (see the module docstring).

    `run` (a trio task) starts the worker thread, reports each role change to
    `events` and, when cancelled, leaves the election (deleting its znode, so the
    backup takes over at once) and stops the thread. `view` and `fence` are readable
    at any time on the trio thread.
    """

    def __init__(
        self,
        hosts: str,
        path: str,
        node_id: str,
        events: ElectionEvents,
        *,
        session_timeout_ms: int = 10000,
        reconnect_max_delay_ms: int = 2000,
        fence: Fence | None = None,
    ) -> None:
        if not hosts:
            raise ValueError("ZkElection needs ZooKeeper servers (cluster_zookeeper)")
        self.fence = fence if fence is not None else Fence()
        super().__init__(
            hosts,
            view=ElectionView(Role.LOST, self.fence.current, None),
            thread_name=f"zk-election-{node_id}",
            what="an election step",
            session_timeout_ms=session_timeout_ms,
            reconnect_max_delay_ms=reconnect_max_delay_ms,
        )
        self.path = path.rstrip("/") or "/amqbroker"
        self.node_id = node_id
        self._events = events
        self._election = f"{self.path}/election"
        self._epoch_path = f"{self.path}/epoch"
        # worker-thread state
        self._my_session: int | None = None
        self._leader_epoch = 0  # the epoch of our current leadership, 0 if not leading

    # ------------------------------------------------------------------ trio side

    def _dispatch(self, view: ElectionView, old: ElectionView) -> None:
        _dispatch(self._events, view, old)

    async def confirm(self, epoch: int) -> bool:
        """True if ZooKeeper still names this node's election znode as the leader of
        `epoch` (a sync and a read, in a worker thread, bounded by the session
        timeout). The arbiter asks before answering a decision it could not replicate:
        a resumed old arbiter whose session expired gets False."""
        return await self._check_in_worker(
            lambda: self._confirm_epoch(self._epoch_path, epoch, _EPOCH_HINT)
        )

    # ---------------------------------------------------------------- worker side

    def _lost_view(self) -> ElectionView:
        return ElectionView(Role.LOST, self.fence.current, None)

    def _publish(self, view: ElectionView) -> None:
        if view.role is not Role.LEADER:
            self._leader_epoch = 0
        super()._publish(view)

    def _log_change(self, view: ElectionView, old: ElectionView) -> None:
        if view.role is not old.role or view.leader_id != old.leader_id:
            log.info(
                "cluster arbiter election: %s is %s (leader %s, epoch %d)",
                self.node_id,
                view.role.value,
                view.leader_id,
                view.epoch,
            )

    def _evaluate(self) -> None:
        from kazoo.exceptions import NodeExistsError

        session = self._session_or_lost()
        if session is None:
            return
        client = self._client
        if self._my_node is None or self._my_session != session:
            # first join, or the old session expired and took our znode with it
            client.ensure_path(self._election)
            with contextlib.suppress(NodeExistsError):
                client.create(
                    self._epoch_path,
                    json.dumps({"epoch": 0, "leader": None, "znode": None}).encode(),
                )
            self._my_node = client.create(
                f"{self._election}/{ELECTION_PREFIX}",
                self.node_id.encode("utf-8"),
                ephemeral=True,
                sequence=True,
            )
            self._my_session = session
        assert self._my_node is not None
        my_name = self._my_node.rsplit("/", 1)[1]

        listed = self._children(self._election)
        if listed is None:
            return
        children, data = listed
        current = read_epoch(client, self._epoch_path, self._watch, _EPOCH_HINT)
        epoch, epoch_znode = current.epoch, current.znode
        self.fence.raise_to(epoch)
        if my_name not in children:
            # deleted under us (by an operator?): join again
            self._my_node = None
            self._wake.put("rejoin")
            return
        members = [d.decode("utf-8", "replace") for d in data]
        backup_id = members[1] if len(members) > 1 else None
        index = children.index(my_name)

        if index == 0:
            if self._leader_epoch == 0 or epoch != self._leader_epoch or epoch_znode != my_name:
                epoch = self._take_over(epoch, current.version, my_name)
                if epoch == 0:
                    return  # lost a race or the session: evaluated again on the wake-up
            self._leader_epoch = epoch
            self._publish(ElectionView(Role.LEADER, epoch, self.node_id, backup_id, tuple(members)))
            return

        leader_id: str | None = members[0]
        if epoch_znode != children[0] or leader_id == self.node_id:
            # the first node has not completed its takeover yet (or it is a stale
            # incarnation of this very node whose session has not expired yet)
            leader_id = None
        role = Role.BACKUP if index == 1 else Role.FOLLOWER
        self._publish(ElectionView(role, epoch, leader_id, backup_id, tuple(members)))

    def _take_over(self, epoch: int, version: int, my_name: str) -> int:
        """Bump the epoch if we are still in the election; the new epoch, or 0."""
        new = max(epoch, self.fence.current) + 1
        doc = {"epoch": new, "leader": self.node_id, "znode": my_name}
        if not self._commit_epoch(self._epoch_path, doc, version):
            return 0
        self.fence.raise_to(new)
        log.info("cluster arbiter: %s takes over with epoch %d", self.node_id, new)
        return new


_EPOCH_HINT: Final = "is cluster_zookeeper_path shared with another application?"


class ElectionUnavailable(LocalError):
    """The election cannot run here (its client library is missing)."""


def zk_election(settings: Settings, role: ArbiterRoleLike, cluster_name: str = "") -> ZkElection:
    """The election configured by ``cluster_zookeeper*``, driving `role`.

    Start it with ``await nursery.start(election.run)``; ``election.fence`` is the fence
    to check every arbiter answer and replicated decision against.
    """
    if not kazoo_installed():
        raise ElectionUnavailable(
            "cluster_zookeeper is set but the kazoo ZooKeeper client is not installed; "
            "install it (pip install kazoo, or reinstall amqbroker: it is a dependency) "
            "or remove cluster_zookeeper"
        )
    fence = Fence()
    return ZkElection(
        settings.cluster_zookeeper,
        settings.cluster_zookeeper_path or default_zookeeper_path(cluster_name),
        settings.cluster_node_id,
        arbiter_events(role, fence),
        session_timeout_ms=settings.cluster_zookeeper_session_timeout,
        reconnect_max_delay_ms=settings.cluster_zookeeper_reconnect_max_delay,
        fence=fence,
    )
