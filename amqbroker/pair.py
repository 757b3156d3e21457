"""One member of a primary/backup pair whose live member ZooKeeper decides.

Theory of operation
-------------------
With ``ha_role`` set and ``cluster_zookeeper`` configured, `amqbroker run` runs a
`PairMember` instead of a bare `BrokerApp`. The member takes part in its node id's
lease (`amqbroker.ha.lease`) and runs, at any moment, at most one `BrokerApp`:

* while another member is live: a backup app (``ha_role = "backup"``) mirroring the
  live member's store from the address the lease names;
* while the lease names this member live: a primary app on the data dir, stamping its
  replication frames with the lease's epoch and advertising the pair's members in the
  open's ``failover-server-list``.

What it runs follows `amqbroker.ha.roles` (one table: the lease's and the mirror's
reports in, start/stop actions out). The member is a **candidate** for the lease only
while its data dir holds a complete copy (its *claim*): the epoch it last served
under (``<data_dir>/ha/epoch``) or the epoch its mirror's marker names; a fresh primary
claims epoch 0 (bootstrap), a fresh backup claims nothing. The lease lets a candidate
take over only at exactly its claimed epoch, so a copy that missed anything never
serves.

Fencing: a live member answers a durable send only once its backup acknowledged the
store cycle, or, when no backup in sync took it, once the lease allowed it to answer
alone (`PairMember.alone`): the first such cycle after any replicated one takes the
next epoch (so the backup's copy, complete only for the old epoch, can never become
live), every one confirms the lease in ZooKeeper. A member that loses its lease stops
its broker at once (its connections close); a refused confirm fences the store, so a
paused old primary that resumes answers nothing.

Invariants
----------
* At most one `BrokerApp` runs at a time; the next starts only after the previous one's
  `run` returned (the journal lock and the data dir are never shared).
* The served epoch is written (fsync) before the primary app starts.
* The member is a candidate only with a claim, and withdraws before its mirror can
  replace the store (START_MIRROR follows WITHDRAW in the table).
"""

from __future__ import annotations

import collections
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from amqbroker.app import BrokerApp
from amqbroker.ha import roles
from amqbroker.ha.lease import ZkLease, load_served_epoch, save_served_epoch
from amqbroker.ha.mirror import clear_state, read_state
from amqbroker.ha.status import LeaseStatus
from amqbroker.settings import Settings, parse_listener

log = logging.getLogger("amqbroker.ha.pair")

Ev, Act, St = roles.Event, roles.Action, roles.State
#: reports of an app that may have been stopped since they were queued
_LATE = frozenset({Ev.SYNCED, Ev.UNSYNCED, Ev.STOPPED, Ev.HAND_OVER})

#: what each role state means, for the log line at every role change
ROLE_TEXT: dict[roles.State, str] = {
    St.WAITING: "WAITING (no broker runs; eligible to take over only with a complete store)",
    St.MIRRORING: "MIRRORING (standby: copying the live member's store, not yet eligible)",
    St.SYNCED: "SYNCED (standby: its copy is complete, eligible to take over)",
    St.LIVE: "LIVE (serving clients and the pair's backup)",
    St.STOPPING: "STOPPING (the broker is being stopped: it answers nothing more)",
    St.HANDING_OVER: (
        "HANDING_OVER (fail back: clients disconnected, the last store cycle goes to the "
        "primary, then the primary takes over)"
    ),
}
#: why: the event that caused the change
REASON_TEXT: dict[roles.Event, str] = {
    Ev.LIVE: "the lease in ZooKeeper made this member live",
    Ev.STANDBY: "another member is live",
    Ev.NO_LIVE: "no member is live right now",
    Ev.LIVE_MOVED: "the live member changed",
    Ev.LOST: "the ZooKeeper session was lost (suspended or expired)",
    Ev.SYNCED: "the mirror's copy is complete",
    Ev.UNSYNCED: "the mirror's copy is no longer complete (link lost, resync or disk error)",
    Ev.STOPPED: "the broker stopped",
    Ev.HAND_OVER: "the primary member's copy is in sync again and ha_failback is on",
}


def advertised(s: Settings) -> str:
    """The host:port this member is reached at (``ha_advertise``, else its listener)."""
    if s.ha_advertise:
        return s.ha_advertise
    host = s.host if s.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    return f"{host}:{s.port}"


def uses_lease(s: Settings) -> bool:
    """Whether `amqbroker run` runs a `PairMember` (HA with ZooKeeper)."""
    return bool(s.ha_role and s.cluster_zookeeper)


class PairMember:
    def __init__(self, settings: Settings) -> None:
        s = settings
        self.settings = s
        self.node_id = s.cluster_node_id or s.node_id
        self.address = advertised(s)
        self.member_id = f"{self.node_id}@{self.address}"
        self.data_dir = Path(s.data_dir).expanduser().resolve()
        self.state = St.WAITING
        #: the epoch this member serves under (while live)
        self.epoch = 0
        self.live_address: str | None = None
        #: the app running now (a backup's mirror or the live broker), and its end
        self.app: BrokerApp | None = None
        self._app_done = trio.Event()
        self._app_done.set()
        self._events: collections.deque[tuple[roles.Event, int | None]] = collections.deque()
        self._wake = trio.Event()
        self._shutdown = trio.Event()
        self._nursery: trio.Nursery | None = None
        #: `alone`: the epoch taken for answering alone, and the backed cycles then
        self._alone_epoch = 0
        self._alone_backed = -1
        self.exit_code = 0
        self._stopped_code = 0
        self._token: trio.lowlevel.TrioToken | None = None
        #: SIGCONTs seen while live (only the latest one's lease check lifts the refusal)
        self._pauses = 0
        self.lease = ZkLease(
            s.cluster_zookeeper,
            s.cluster_zookeeper_path,
            self.node_id,
            self.member_id,
            self.address,
            self,
            session_timeout_ms=s.cluster_zookeeper_session_timeout,
            reconnect_max_delay_ms=s.cluster_zookeeper_reconnect_max_delay,
            role=s.ha_role,
        )

    # ------------------------------------------------------------ the claim
    def claim(self) -> int | None:
        """The epoch the data dir's store is a complete copy of (None: no claim)."""
        served = load_served_epoch(self.data_dir)
        marker = read_state(self.data_dir)
        mirrored = int(marker.get("epoch", 0)) if marker else None
        if mirrored is not None:
            return max(served, mirrored)
        if served:
            return served
        return 0 if self.settings.ha_role == "primary" else None

    # ------------------------------------------------------- LeaseEvents
    def on_live(self, epoch: int) -> None:
        self._push(Ev.LIVE, epoch)

    def on_standby(self, live_member: str | None, live_address: str | None, epoch: int) -> None:
        if live_member is None or live_address is None:
            self._push(Ev.NO_LIVE, epoch)
            return
        moved = self.live_address is not None and live_address != self.live_address
        self.live_address = live_address
        mirroring = self.state in (St.MIRRORING, St.SYNCED)
        self._push(Ev.LIVE_MOVED if moved and mirroring else Ev.STANDBY, epoch)

    def on_lost(self) -> None:
        self._push(Ev.LOST, None)

    def _on_claim(self, claimed: int | None) -> None:
        self._push(Ev.UNSYNCED if claimed is None else Ev.SYNCED, claimed)

    def _push(self, ev: roles.Event, arg: int | None) -> None:
        self._events.append((ev, arg))
        self._wake.set()

    # ------------------------------------------------------------ running
    def request_shutdown(self) -> None:
        self._shutdown.set()
        self._wake.set()

    async def run(self, *, handle_signals: bool = False) -> None:
        claim = self.claim()
        log.info(
            "HA pair %s: member %s starts (%s); data in %s",
            self.node_id,
            self.member_id,
            "no complete copy yet" if claim is None else f"store complete for epoch {claim}",
            self.data_dir,
        )
        if claim is not None:
            self.lease.candidate(claim)
        previous = None
        if handle_signals:
            self._token = trio.lowlevel.current_trio_token()
            previous = signal.signal(signal.SIGCONT, self._on_sigcont)
        try:
            async with trio.open_nursery() as n:
                self._nursery = n
                if handle_signals:
                    await n.start(self._signal_loop)
                await n.start(self.lease.run)
                await self._loop()
                n.cancel_scope.cancel()
        finally:
            if previous is not None:
                signal.signal(signal.SIGCONT, previous)
        log.info("HA pair %s: member %s stopped", self.node_id, self.member_id)

    async def _loop(self) -> None:
        while not self._shutdown.is_set():
            if not self._events:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            ev, arg = self._events.popleft()
            if ev in _LATE and (self.state, ev) not in roles.TRANSITIONS:
                continue  # of an app that was stopped since: nothing to do
            failed = self.state is St.HANDING_OVER and self._stopped_code != 0
            if ev is Ev.STOPPED and (self.state is St.LIVE or failed):
                log.critical(
                    "HA pair %s: the live broker stopped on its own (exit code %d); this "
                    "member leaves the lease and stops",
                    self.node_id,
                    self._stopped_code,
                )
                self.exit_code = self._stopped_code or 3
                self._shutdown.set()
                if failed:
                    continue  # its store may still be written: never requeued
            t = roles.step(self.state, ev)
            if ev is Ev.LIVE and arg is not None:
                self.epoch = arg
            old, self.state = self.state, t.next
            if t.next is not old:
                self._log_role_change(old, t.next, ev, arg)
            for action in t.actions:
                await self._perform(action)
        await self._stop_app()
        self.lease.withdraw()

    def _log_role_change(
        self, old: roles.State, new: roles.State, ev: roles.Event, arg: int | None
    ) -> None:
        """One line per role change: the new role, what it means, and why."""
        why = REASON_TEXT[ev]
        if ev in (Ev.STANDBY, Ev.LIVE_MOVED) and self.live_address:
            why += f" at {self.live_address}"
        if arg is not None and ev in (Ev.LIVE, Ev.STANDBY, Ev.LIVE_MOVED, Ev.NO_LIVE):
            why += f", epoch {arg}"
        elif arg is not None and ev is Ev.SYNCED:
            why += f" for epoch {arg}"
        log.log(
            logging.WARNING if St.LIVE in (old, new) or new is St.STOPPING else logging.INFO,
            "HA pair %s: member %s is now %s, was %s: %s",
            self.node_id,
            self.member_id,
            ROLE_TEXT[new],
            old.value,
            why,
        )

    async def _perform(self, action: roles.Action) -> None:
        if action is Act.CANDIDATE:
            claim = self.claim()
            if claim is not None:
                self.lease.candidate(claim)
        elif action is Act.WITHDRAW:
            self.lease.withdraw()
        elif action is Act.START_MIRROR:
            await self._start_mirror()
        elif action is Act.STOP_MIRROR:
            await self._stop_app()
        elif action is Act.SERVE:
            await self._serve()
        elif action is Act.HAND_OVER:
            if self.app is not None:
                self.app.request_shutdown()  # clients first, the replication link last
        elif action is Act.REQUEUE:
            # the store is complete for the epoch it served under, or for one the
            # lease took over again while it was stopping (nothing was answered since)
            served = max(self.claim() or 0, self.lease.synced_epoch or 0)
            await trio.to_thread.run_sync(save_served_epoch, self.data_dir, served)
            self.lease.requeue(served)
        elif action is Act.STOP_SERVING:
            log.warning(
                "HA pair %s: member %s lost its lease at epoch %d; stopping the broker "
                "(connections closed, nothing more answered)",
                self.node_id,
                self.member_id,
                self.epoch,
            )
            if self.app is not None:
                self.app.request_shutdown()

    async def _start_app(
        self,
        app: BrokerApp,
        then: roles.Event | None,
        beside: Callable[[BrokerApp], Awaitable[None]] | None = None,
    ) -> None:
        """Run `app` (after the previous one stopped), and `beside` it while it runs;
        `then` is pushed when it ends."""
        await self._stop_app()
        assert self._nursery is not None
        self.app = app
        done = self._app_done = trio.Event()

        async def runner() -> None:
            try:
                async with trio.open_nursery() as n:
                    if beside is not None:
                        n.start_soon(beside, app)
                    await app.run()
                    n.cancel_scope.cancel()
            finally:
                self._stopped_code = app.exit_code
                done.set()
                if self.app is app:
                    self.app = None
                if then is not None:
                    self._push(then, None)

        self._nursery.start_soon(runner)

    async def _stop_app(self) -> None:
        if self.app is not None:
            self.app.request_shutdown()
        await self._app_done.wait()

    async def _start_mirror(self) -> None:
        assert self.live_address is not None
        s = self.settings.model_copy(update={"ha_role": "backup", "ha_primary": self.live_address})
        app = BrokerApp(s)
        app.mirror_claim = self._on_claim
        app.ha_lease = self.lease_status
        log.info(
            "HA pair %s: member %s mirrors the live member at %s",
            self.node_id,
            self.member_id,
            self.live_address,
        )
        await self._start_app(app, None)

    async def _serve(self) -> None:
        await self._stop_app()
        await trio.to_thread.run_sync(save_served_epoch, self.data_dir, self.epoch)
        await trio.to_thread.run_sync(clear_state, self.data_dir)
        s = self.settings.model_copy(update={"ha_role": "primary"})
        app = BrokerApp(s)
        app.ha_epoch = lambda: self.epoch
        app.ha_alone = self.alone
        app.failover_servers = self.failover_servers
        app.ha_lease = self.lease_status
        self._alone_epoch, self._alone_backed = 0, -1
        log.warning(
            "HA pair %s: member %s is LIVE at epoch %d (%s)",
            self.node_id,
            self.member_id,
            self.epoch,
            self.address,
        )
        failback = self.settings.ha_failback and self.settings.ha_role == "backup"
        await self._start_app(app, Ev.STOPPED, self._watch_failback if failback else None)

    # ------------------------------------------------------------ a pause
    def _on_sigcont(self, _signum: int, _frame: object) -> None:
        """SIGCONT: this process was stopped, maybe past its ZooKeeper session, and its
        lease may be gone without kazoo having said so yet. A Python signal handler
        runs before the event loop hands any frame read after the resume to the
        broker: from here every send is refused until ZooKeeper confirms the lease
        (store cycles are fenced by `alone` anyway; this covers what needs none, a
        non-durable send)."""
        app = self.app
        if self.state is not St.LIVE or app is None or app.broker is None:
            return
        app.broker.sends_refused = (
            f"this member of {self.node_id} was paused and is checking in ZooKeeper that "
            "it is still live; resend, or connect to the pair's other member"
        )
        self._pauses += 1
        if self._token is not None:
            self._token.run_sync_soon(self._start_pause_check, app, self._pauses)

    def _start_pause_check(self, app: BrokerApp, pause: int) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._after_pause, app, pause)

    async def _after_pause(self, app: BrokerApp, pause: int) -> None:
        while True:  # the epoch may move meanwhile (a cycle answered alone bumps it)
            epoch = self.epoch
            ok = await self.lease.confirm(epoch)
            if ok or self.epoch == epoch:
                break
        if self.app is not app or app.broker is None or pause != self._pauses:
            return  # another app, or a later pause's check decides
        if ok and self.state in (St.LIVE, St.HANDING_OVER):
            app.broker.sends_refused = None
            log.warning(
                "HA pair %s: member %s resumed after a pause; ZooKeeper confirms it is "
                "live at epoch %d: it answers sends again",
                self.node_id,
                self.member_id,
                epoch,
            )
            return
        log.critical(
            "HA pair %s: member %s resumed after a pause and is no longer live at epoch %d "
            "in ZooKeeper; it answers nothing more",
            self.node_id,
            self.member_id,
            epoch,
        )
        self._push(Ev.LOST, None)

    # ------------------------------------------------------------ fail back
    async def _watch_failback(self, app: BrokerApp) -> None:
        """While `app` is live on a member configured as the backup (``ha_failback``):
        once a member configured as the primary is in sync with it, at the lease's
        current epoch and on the replication stream, ask for the hand-over."""
        while True:
            changed = self.lease.next_view.wait
            synced = app.primary.synced.wait if app.primary is not None else None
            ready = self.lease.view.in_sync_with("primary")
            if ready and self.state is St.LIVE and app.primary is not None and app.primary.in_sync:
                log.warning(
                    "HA pair %s: member %s hands the node id back to the primary %s "
                    "(ha_failback): its clients are disconnected, its last store cycle goes "
                    "to the primary, which then takes over with the next epoch",
                    self.node_id,
                    self.member_id,
                    ready[0],
                )
                self._push(Ev.HAND_OVER, None)
                return
            async with trio.open_nursery() as n:
                for wait in (changed, synced):
                    if wait is not None:
                        n.start_soon(_then_cancel, wait, n.cancel_scope)

    # ------------------------------------------------------------ fencing
    async def alone(self) -> bool:
        """May the live broker answer a store cycle no backup in sync took? The first
        such cycle after a replicated one takes the next epoch; every one confirms
        the lease. False: the lease is gone (the store is fenced, the broker stops)."""
        app = self.app
        backed = app.primary.backed_cycles if app is not None and app.primary else 0
        epoch = self.epoch
        if self._alone_epoch == epoch and self._alone_backed == backed:
            if await self.lease.confirm(epoch):
                return True
        else:
            new = await self.lease.bump(epoch)
            if new:
                await trio.to_thread.run_sync(save_served_epoch, self.data_dir, new)
                self.epoch = self._alone_epoch = new
                self._alone_backed = backed
                log.warning(
                    "HA pair %s: member %s answers without a backup in sync; took epoch "
                    "%d so that no older copy can become live",
                    self.node_id,
                    self.member_id,
                    new,
                )
                return True
        log.critical(
            "HA pair %s: member %s is no longer live at epoch %d in ZooKeeper; it "
            "answers nothing more",
            self.node_id,
            self.member_id,
            epoch,
        )
        self._push(Ev.LOST, None)
        return False

    def lease_status(self) -> LeaseStatus:
        """This member's view of the lease (the live app's management and metrics
        report it: `amqbroker.ha.status`)."""
        v = self.lease.view
        live = self.state is St.LIVE
        return LeaseStatus(
            node=self.node_id,
            member=self.member_id,
            state=self.state.value,
            epoch=self.epoch if live else v.epoch,
            live_member=self.member_id if live else v.live_member,
            live_address=self.address if live else v.live_address,
            members=v.members,
            addresses=v.addresses,
        )

    def failover_servers(self) -> list[tuple[str, int]]:
        """The pair's eligible members (host, port), for the open's failover list."""
        out: list[tuple[str, int]] = []
        for a in self.lease.view.addresses or (self.address,):
            try:
                out.append(parse_listener(a))
            except ValueError:
                continue
        return out

    async def _signal_loop(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGUSR1:
                    log.warning(
                        "received SIGUSR1 (promote): ignored, ZooKeeper decides which member "
                        "of %s is live (stop the live member to hand over)",
                        self.node_id,
                    )
                    continue
                if self._shutdown.is_set():
                    log.warning("second signal: stopping now")
                    raise KeyboardInterrupt
                log.info(
                    "HA pair %s: member %s stopping (received %s; it was %s), leaving the lease",
                    self.node_id,
                    self.member_id,
                    signal.Signals(signum).name,
                    self.state.value,
                )
                self.request_shutdown()


async def _then_cancel(wait: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
    """Wait for `wait`, then cancel `scope` (the first of several waits to return
    ends them all)."""
    await wait()
    scope.cancel()
