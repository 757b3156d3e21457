"""Which process of a primary/backup pair is live for a node id: a lease in ZooKeeper.

Theory of operation
-------------------
A node id (``node1``) may run as two processes, a primary and a backup, each with its
own store; exactly one of them is *live* (serves clients and peers under the node id),
the other is *standby* (copies the live's store). Who is live is decided in ZooKeeper,
on the pattern of the cluster's arbiter election (`amqbroker.cluster.election`, whose
worker thread, fence and epoch compare-and-set this module shares through
`amqbroker.cluster.zk`). The processes are *members*, each named by a member id
(``node1@127.0.0.1:5673``) and the address clients and peers reach it at. Under
``<path>/ha/<node_id>/``:

* ``members/m_<seq>``: an *ephemeral sequential* znode per **eligible** member (JSON
  ``{"member": id, "address": "host:port", "synced": epoch, "role": ha_role}``,
  rewritten when the member's copy changes epoch; `ZkLease.requeue` deletes and
  creates it again, at the end of the order, which is how a live member handing the
  node id back to the primary lets that primary take over first). A member is eligible
  once it calls `ZkLease.candidate` with ``synced_epoch``, the epoch its store is a
  complete copy of (a backup: the epoch of the live it finished syncing from; a
  primary restarting on its own store: the epoch it last served under, kept by
  `save_served_epoch`). It stops being eligible on `ZkLease.withdraw`, when it leaves
  (the znode is deleted) or when its ZooKeeper session ends (ZooKeeper deletes the
  znode). Sorted by sequence, the members whose ``synced`` is the current epoch give
  the order; the first of them may take over (a stale member ahead, say an older copy
  restarted first, blocks nobody), and nobody takes over while the epoch's live member
  znode exists;
* ``epoch``: JSON ``{"epoch": n, "live": id, "address": addr, "znode": m_<seq>}``,
  created with epoch 0 (nobody live) by the first member to connect. To become live,
  a member that is first among the eligible members in sync **and** whose
  ``synced_epoch`` equals the epoch it read rewrites it with ``n + 1`` and itself, in one ZooKeeper
  transaction that also checks that its own member znode still exists and that the
  epoch znode still has the version it read (`amqbroker.cluster.zk.commit_epoch`). So
  an epoch is given to at most one member, only while its session lives, only to a
  member whose store holds everything accepted under the previous epoch, and epochs
  only grow. A backup that synced under an older epoch (it missed what a later live
  accepted) can never become live, even when it is the only member: it says why in
  the log and stays standby. Bootstrap is the same rule: epoch 0 and an empty store
  (``synced_epoch`` 0).

The live is named by the epoch znode; it counts as live only while its member znode
(``znode``) exists. When its session expires (crash, SIGSTOP or partition longer than
the session timeout) ZooKeeper deletes its znode, the standbys see nobody live, and
the next member, if in sync with that epoch, takes over with the next one.

Invariants
----------
* ``on_live(epoch)`` is reported only after this member's compare-and-set of `epoch`
  committed, and only while the kazoo connection is CONNECTED. On SUSPENDED
  (connection lost; the session may still be alive) or LOST (session expired) a live
  member reports ``on_lost`` at once: the caller stops serving and never answers
  ``accepted`` again under that epoch. kazoo reports SUSPENDED when ZooKeeper stays
  silent for two thirds of the session timeout, before the server can expire the
  session and let the backup in; a paused process learns it only when it resumes, so
  before answering a send no backup acknowledged the caller asks `ZkLease.confirm`.
  The loss goes from kazoo's connection listener straight to the trio thread
  (``run_sync_soon``), not through the worker, which may be blocked in a call queued
  while disconnected; every view carries the connection generation it was evaluated
  in, and trio drops a connected view older than a loss it has applied.
* After a reconnect a member re-evaluates and becomes live again only by the rule
  above, with a fresh epoch (its own store is complete for the epoch it served under,
  so a live whose session survived a SUSPENDED simply takes the next epoch).
* Taking over makes the new epoch this member's ``synced_epoch``. A standby is named
  the live's member and address (``on_standby``) only once the live's takeover
  committed and while its member znode exists; otherwise ``None`` (nobody live right
  now). A member never names itself (a stale incarnation) as the live of someone
  else.
* A live member may take the next epoch while it stays live (`ZkLease.bump`, the same
  compare-and-set): a primary does so before it answers a store cycle no backup
  acknowledged, so a backup that dropped out can never become live with its copy.
* `ZkLease.fence` is the highest epoch seen; it never decreases (check replication
  records and peer messages against it). Callbacks come on the trio thread, one at a
  time, in the order the worker saw the changes, only when (role, live member,
  address, epoch) changed; `ZkLease.view` always holds the latest `LeaseView`
  (eligibility and members included).

`ZkLease.run` raises `LeaseUnavailable` when ZooKeeper cannot be reached within the
connect timeout at start; later outages only make the member LOST until it reconnects.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

import trio

from amqbroker.cluster.zk import (
    EpochDoc,
    Fence,
    ZkWorker,
    kazoo_installed,
    read_epoch,
)
from amqbroker.core.errors import LocalError
from amqbroker.store.atomic import replace_file

__all__ = [
    "LeaseEvents",
    "LeaseRole",
    "LeaseUnavailable",
    "LeaseView",
    "ZkLease",
    "lease_path",
    "load_served_epoch",
    "save_served_epoch",
]

log = logging.getLogger("amqbroker.ha.lease")

MEMBER_PREFIX: Final = "m_"
#: the served-epoch file, relative to a member's data dir
EPOCH_FILE: Final = Path("ha") / "epoch"
_EPOCH_HINT: Final = "is the ZooKeeper path shared with another application?"


class LeaseUnavailable(LocalError):
    """The lease cannot run: kazoo is missing, or ZooKeeper is unreachable at start."""


def lease_path(path: str, node_id: str) -> str:
    """The znode of `node_id`'s pair under the cluster's ZooKeeper `path`."""
    return f"{path.rstrip('/')}/ha/{node_id}"


# -------------------------------------------------------------------- the served epoch


def load_served_epoch(data_dir: Path) -> int:
    """The epoch saved by `save_served_epoch` in `data_dir`, 0 when none was saved."""
    path = data_dir / EPOCH_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0
    try:
        epoch = int(json.loads(text)["epoch"])
    except (ValueError, KeyError, TypeError):
        raise LocalError(
            f"{path} does not hold an amqbroker HA epoch ({text[:60]!r}); restore it, or "
            "delete it together with the store so that this member resyncs from the live one"
        ) from None
    if epoch < 0:
        raise LocalError(f"{path} holds a negative HA epoch ({epoch})")
    return epoch


def save_served_epoch(data_dir: Path, epoch: int) -> None:
    """Persist `epoch` as the one this member's store is complete for, atomically
    (a temporary file, fsync'ed, renamed over ``<data_dir>/ha/epoch``, directory
    fsync'ed). Save it on ``on_live`` before serving, and 0 before discarding the store
    for a full resync."""
    if epoch < 0:
        raise ValueError(f"an HA epoch is never negative ({epoch})")
    path = data_dir / EPOCH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, (json.dumps({"epoch": epoch}) + "\n").encode())


# ------------------------------------------------------------------------- the events


class LeaseRole(enum.Enum):
    LIVE = "live"
    STANDBY = "standby"
    LOST = "lost"  # not connected to ZooKeeper (or not yet): neither live nor standby


@dataclass(frozen=True)
class LeaseView:
    """What this member knows of its node id's lease after one evaluation."""

    role: LeaseRole
    epoch: int  # the current epoch (this member's own when live)
    live_member: str | None  # None: nobody live right now (or LOST)
    live_address: str | None
    eligible: bool = False  # this member has its member znode (it called candidate)
    members: tuple[str, ...] = field(default=())  # eligible member ids, in order
    #: the eligible members' client addresses (host:port), in the same order
    addresses: tuple[str, ...] = field(default=())
    #: the epoch each eligible member's copy is complete for (None: not said), in order
    synced: tuple[int | None, ...] = field(default=())
    #: each eligible member's configured role ("primary", "backup" or ""), in order
    roles: tuple[str, ...] = field(default=())

    def in_sync_with(self, role: str) -> tuple[str, ...]:
        """The eligible members configured as `role` whose copy is complete for the
        current epoch."""
        return tuple(
            m
            for m, r, e in zip(self.members, self.roles, self.synced, strict=False)
            if r == role and e == self.epoch
        )


class LeaseEvents(Protocol):
    """Receives the lease's changes, on the trio thread, in order.

    ``on_live(epoch)``: this member is live under `epoch` (save it with
    `save_served_epoch`, then serve). ``on_standby(live_member, live_address, epoch)``:
    another member is live (None: nobody right now); a live member that gets it stops
    serving. ``on_lost()``: no trustworthy ZooKeeper session (SUSPENDED or LOST); a live
    member stops serving at once, a standby just waits.
    """

    def on_live(self, epoch: int) -> None: ...
    def on_standby(self, live_member: str | None, live_address: str | None, epoch: int) -> None: ...
    def on_lost(self) -> None: ...


#: the eligible members' ids, addresses, synced epochs and roles, in order
_Listing = tuple[tuple[str, ...], tuple[str, ...], tuple[int | None, ...], tuple[str, ...]]


def _key(view: LeaseView) -> tuple[object, ...]:
    return (view.role, view.live_member, view.live_address, view.epoch)


# --------------------------------------------------------------------------- the lease


class ZkLease(ZkWorker[LeaseView]):
    """One member's side of its node id's lease (see the module docstring).

    `run` (a trio task) connects (raising `LeaseUnavailable` if ZooKeeper is not
    reached within `connect_timeout` seconds; None waits for ever), reports every
    change to `events` and, when cancelled, withdraws and closes. `candidate` and
    `withdraw` may be called at any time on the trio thread (before `run` too);
    `view` and `fence` are readable at any time.
    """

    def __init__(
        self,
        hosts: str,
        path: str,
        node_id: str,
        member_id: str,
        address: str,
        events: LeaseEvents,
        *,
        session_timeout_ms: int = 10000,
        reconnect_max_delay_ms: int = 2000,
        connect_timeout: float | None = 30.0,
        fence: Fence | None = None,
        role: str = "",
    ) -> None:
        if not hosts:
            raise ValueError("ZkLease needs ZooKeeper servers")
        if not node_id or "/" in node_id:
            raise ValueError(f"a node id for the HA lease cannot be empty or hold '/': {node_id!r}")
        if not kazoo_installed():
            raise LeaseUnavailable(
                "HA needs the kazoo ZooKeeper client, which is not installed; install it "
                "(pip install kazoo, or reinstall amqbroker: it is a dependency)"
            )
        self.fence = fence if fence is not None else Fence()
        super().__init__(
            hosts,
            view=LeaseView(LeaseRole.LOST, self.fence.current, None, None),
            thread_name=f"zk-lease-{member_id}",
            what="an HA lease step",
            session_timeout_ms=session_timeout_ms,
            reconnect_max_delay_ms=reconnect_max_delay_ms,
            connect_timeout=connect_timeout,
            fast_lost=True,
        )
        self.path = lease_path(path.rstrip("/") or "/amqbroker", node_id)
        self.node_id = node_id
        self.member_id = member_id
        self.address = address
        #: this member's configured role, in its member znode (fail back looks for it)
        self.role = role
        self._events = events
        self._members_path = f"{self.path}/members"
        self._epoch_path = f"{self.path}/epoch"
        self._lock = threading.Lock()
        self._synced: int | None = None  # None: not a candidate
        self._bump_from: int | None = None  # bump asked for while live at this epoch
        self._requeue = False  # a new member znode (at the end of the order) is asked for
        self._view_changed = trio.Event()  # set (and replaced) at every new view
        # worker-thread state
        self._my_session: int | None = None
        self._my_synced: int | None = None  # the epoch our member znode names
        self._prepared_session: int | None = None
        self._live_epoch = 0  # the epoch of our current live period, 0 if not live
        self._live_gen = 0  # the connection generation it was taken in
        self._refused: tuple[int, int] | None = None  # (epoch, synced) last logged

    # ------------------------------------------------------------------ trio side

    @property
    def synced_epoch(self) -> int | None:
        """The epoch this member's store is complete for (its own while live); None
        while it is not a candidate."""
        with self._lock:
            return self._synced

    def candidate(self, synced_epoch: int) -> None:
        """Become eligible (or update the epoch the store is a complete copy of)."""
        if synced_epoch < 0:
            raise ValueError(f"an HA epoch is never negative ({synced_epoch})")
        with self._lock:
            self._synced = synced_epoch
        self._wake.put("candidate")

    def requeue(self, synced_epoch: int) -> None:
        """Stay eligible with `synced_epoch` but go to the end of the order: the member
        znode is deleted and created again (a live member handing over does this once
        stopped, so that a member in sync ahead of it takes over first)."""
        if synced_epoch < 0:
            raise ValueError(f"an HA epoch is never negative ({synced_epoch})")
        with self._lock:
            self._synced = synced_epoch
            self._requeue = True
        self._wake.put("requeue")

    @property
    def next_view(self) -> trio.Event:
        """Set at the next view this member evaluates (any change: members too); take
        it before looking at `view`, then wait on it."""
        return self._view_changed

    def withdraw(self) -> None:
        """Stop being eligible: the member znode is deleted (a live member must stop
        serving first; it is then told ``on_standby`` and the next member may take
        over)."""
        with self._lock:
            self._synced = None
        self._wake.put("withdraw")

    async def bump(self, epoch: int) -> int:
        """While live at `epoch`, take the next epoch (the same compare-and-set as a
        takeover), so that no copy complete only up to `epoch` can become live any
        more. Call it before answering anything that no backup holds: a backup that
        dropped out may still believe it is in sync. The new epoch; 0 when this member
        is not live at `epoch` (any more), or no answer came within the session
        timeout (the caller then stops serving)."""
        with self._lock:
            self._bump_from = epoch
        self._wake.put("bump")
        with trio.move_on_after(self._session_timeout):
            while True:
                v = self.view
                if v.role is not LeaseRole.LIVE:
                    return 0
                if v.epoch > epoch:
                    return v.epoch
                await self._view_changed.wait()
        return 0

    async def confirm(self, epoch: int) -> bool:
        """True if ZooKeeper (after a sync) still shows this member live at exactly
        `epoch` and its member znode still exists; False otherwise, and when no answer
        comes within the session timeout. Ask before answering a send no backup
        acknowledged."""
        return await self._check_in_worker(
            lambda: self._confirm_epoch(self._epoch_path, epoch, _EPOCH_HINT)
        )

    def _dispatch(self, view: LeaseView, old: LeaseView) -> None:
        self._view_changed.set()
        self._view_changed = trio.Event()
        if _key(view) == _key(old):
            return
        if view.role is LeaseRole.LIVE:
            self._events.on_live(view.epoch)
        elif view.role is LeaseRole.STANDBY:
            self._events.on_standby(view.live_member, view.live_address, view.epoch)
        else:
            self._events.on_lost()

    def _connected(self, view: LeaseView) -> bool:
        return view.role is not LeaseRole.LOST

    def _unreachable(self) -> Exception:
        return LeaseUnavailable(
            f"cannot reach ZooKeeper at {self.hosts} within {self._connect_timeout:g} s to "
            f"decide which member of node id {self.node_id!r} is live; start ZooKeeper "
            "(or check that those servers are the configured ones and reachable from this "
            "host), then start this member again"
        )

    # ---------------------------------------------------------------- worker side

    def _lost_view(self) -> LeaseView:
        return LeaseView(LeaseRole.LOST, self.fence.current, None, None)

    def _publish(self, view: LeaseView) -> None:
        if view.role is not LeaseRole.LIVE:
            self._live_epoch = 0
        super()._publish(view)

    def _log_change(self, view: LeaseView, old: LeaseView) -> None:
        if _key(view) == _key(old):
            return
        if view.role is LeaseRole.LOST:
            what = "lost: no ZooKeeper session it can trust (not live)"
        elif view.live_member is None:
            what = f"{view.role.value} (nobody live"
        else:
            what = f"{view.role.value} (live {view.live_member} at {view.live_address}"
        if view.role is not LeaseRole.LOST:
            what += f", epoch {view.epoch})"
        log.info("HA lease of %s: member %s is %s", self.node_id, self.member_id, what)

    def _evaluate(self) -> None:
        from kazoo.exceptions import NodeExistsError, NoNodeError

        session = self._session_or_lost()
        if session is None:
            return
        client = self._client
        with self._lock:
            synced = self._synced
            requeue, self._requeue = self._requeue, False
        if self._my_node is not None and (synced is None or requeue or self._my_session != session):
            if self._my_session == session:  # withdrawn (else it went with the old session)
                with contextlib.suppress(NoNodeError):
                    client.delete(self._my_node)
                log.info(
                    "HA lease of %s: member %s %s",
                    self.node_id,
                    self.member_id,
                    "withdraws" if synced is None else "goes to the end of the order",
                )
            self._my_node = None
        if self._prepared_session != session:
            try:
                client.ensure_path(self._members_path)
                with contextlib.suppress(NodeExistsError):
                    doc = {"epoch": 0, "live": None, "address": None, "znode": None}
                    client.create(self._epoch_path, json.dumps(doc).encode())
            except NoNodeError:  # deleted again between the two (an operator's wipe)
                self._wake.put("path gone")
                return
            self._prepared_session = session
        if synced is not None and self._my_node is not None and self._my_synced != synced:
            # the copy's epoch changed (a resync, a takeover): the others must see it
            mine = self._member_doc(synced)
            with contextlib.suppress(NoNodeError):  # gone: found again below
                client.set(self._my_node, json.dumps(mine).encode())
                self._my_synced = synced
        if synced is not None and self._my_node is None:
            znode_doc = self._member_doc(synced)
            try:
                self._my_node = client.create(
                    f"{self._members_path}/{MEMBER_PREFIX}",
                    json.dumps(znode_doc).encode(),
                    ephemeral=True,
                    sequence=True,
                )
                self._my_synced = synced
            except NoNodeError:
                self._prepared_session = None  # the path was deleted: create it again
                self._wake.put("path gone")
                return
            self._my_session = session
            log.info(
                "HA lease of %s: member %s is eligible, its store complete for epoch %d",
                self.node_id,
                self.member_id,
                synced,
            )
        my_name = None if self._my_node is None else self._my_node.rsplit("/", 1)[1]

        try:
            listed = self._children(self._members_path, watch_data=True)
            if listed is None:
                return
            current = read_epoch(client, self._epoch_path, self._watch, _EPOCH_HINT)
        except NoNodeError:
            self._prepared_session = None  # deleted (by an operator?): create it again
            self._wake.put("path gone")
            return
        children, data = listed
        self.fence.raise_to(current.epoch)
        if my_name is not None and my_name not in children:
            self._my_node = None  # deleted under us (by an operator?): join again
            self._wake.put("rejoin")
            return
        parsed = [_member(d) for d in data]
        members = tuple(m[0] for m in parsed)
        addresses = tuple(m[1] for m in parsed)
        own = [c == my_name for c in children]
        synceds = tuple(synced if o else m[2] for o, m in zip(own, parsed, strict=True))
        roles = tuple(self.role if o else m[3] for o, m in zip(own, parsed, strict=True))
        listing = (members, addresses, synceds, roles)

        # the first member whose copy is of the current epoch may take over: a stale
        # member ahead of it (an older copy restarted first) must not block it. A
        # member znode without "synced" (an older version) counts as in sync
        in_sync = [c for c, e in zip(children, synceds, strict=True) if e in (None, current.epoch)]
        first = in_sync[0] if in_sync else children[0] if children else None
        # a member of the current epoch's live znode, other than us, is live: nobody
        # takes over from it, whatever the order
        live_other = current.znode in children and current.znode != my_name
        if (
            my_name is not None
            and synced is not None
            and self._live_epoch
            and self._live_gen == self._eval_gen  # no connection change since
            and current.epoch == self._live_epoch
            and current.znode == my_name
        ):
            # live, whatever the order (a member in sync may be ahead: it waits until
            # our znode goes)
            with self._lock:
                bump_from, self._bump_from = self._bump_from, None
            if bump_from == current.epoch:
                new = self._take_over(current, my_name)
                if new:
                    self._publish_live(new, listing)
                return  # 0: the epoch moved or our znode went: evaluated again
            self._publish_live(current.epoch, listing)
            return
        if my_name is not None and synced is not None and first == my_name and not live_other:
            if current.epoch == synced:
                new = self._take_over(current, my_name)
                if new:
                    self._publish_live(new, listing)
                return  # 0: lost a race or the session; evaluated again on the wake-up
            self._refuse(current.epoch, synced)

        live, address = current.doc.get("live"), current.doc.get("address")
        if current.znode not in children or live == self.member_id:
            live = address = None  # nobody live now (or a stale incarnation of ours)
        self._publish(
            LeaseView(
                LeaseRole.STANDBY,
                current.epoch,
                live if isinstance(live, str) else None,
                address if isinstance(address, str) else None,
                my_name is not None,
                *listing,
            )
        )

    def _publish_live(self, epoch: int, listing: _Listing) -> None:
        self._live_epoch, self._live_gen = epoch, self._eval_gen
        members, addresses, synceds, roles = listing
        # our own znode names the new epoch (set at the takeover or bump)
        synceds = tuple(
            epoch if m == self.member_id else e for m, e in zip(members, synceds, strict=True)
        )
        self._publish(
            LeaseView(
                LeaseRole.LIVE,
                epoch,
                self.member_id,
                self.address,
                True,
                members,
                addresses,
                synceds,
                roles,
            )
        )

    def _member_doc(self, synced: int) -> dict[str, object]:
        """This member's znode: its id, address, the epoch its copy is complete for and
        its configured role."""
        return {
            "member": self.member_id,
            "address": self.address,
            "synced": synced,
            "role": self.role,
        }

    def _take_over(self, current: EpochDoc, my_name: str) -> int:
        """Bump the epoch if it is unchanged and we are still eligible; the new epoch,
        or 0."""
        new = max(current.epoch, self.fence.current) + 1
        doc = {"epoch": new, "live": self.member_id, "address": self.address, "znode": my_name}
        if not self._commit_epoch(self._epoch_path, doc, current.version):
            return 0  # the epoch moved or our znode is gone: evaluated again
        self.fence.raise_to(new)
        with self._lock:
            if self._synced is not None:
                self._synced = new
        self._refused = None
        # our znode names the copy's new epoch at once: the others order by it
        doc = self._member_doc(new)
        try:
            assert self._my_node is not None
            self._client.set(self._my_node, json.dumps(doc).encode())
            self._my_synced = new
        except Exception:  # set again at the next evaluation
            self._my_synced = None
        log.info(
            "HA lease of %s: member %s takes over with epoch %d", self.node_id, self.member_id, new
        )
        return new

    def _refuse(self, epoch: int, synced: int) -> None:
        if self._refused == (epoch, synced):
            return  # said already
        self._refused = (epoch, synced)
        if synced < epoch:
            why = (
                f"what was accepted under epoch {epoch} would be lost; it stays standby "
                "until it has resynced from the live member"
            )
        else:
            why = (
                "ZooKeeper never reached its epoch: was ZooKeeper's data reset? it will "
                "not take over on its own"
            )
        log.warning(
            "HA lease of %s: member %s is first among the eligible members but cannot "
            "become live: its store is a complete copy of epoch %d and ZooKeeper's epoch "
            "is %d (%s)",
            self.node_id,
            self.member_id,
            synced,
            epoch,
            why,
        )


def _member(data: bytes) -> tuple[str, str, int | None, str]:
    """A member znode's id, address, synced epoch and role, parsed once. What is
    missing or unreadable: the raw text as the id, "" as address and role, None as
    the epoch."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict):
        return data.decode("utf-8", "replace"), "", None, ""
    synced, role = doc.get("synced"), doc.get("role")
    return (
        str(doc["member"]) if "member" in doc else data.decode("utf-8", "replace"),
        str(doc["address"]) if "address" in doc else "",
        synced if isinstance(synced, int) else None,
        role if isinstance(role, str) else "",
    )
