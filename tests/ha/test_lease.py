"""The HA lease against a real ZooKeeper: who is live for a node id, takeover, epochs.

Members run in-process (`ZkLease` tasks), each with its own kazoo session. Time is real
(ZooKeeper ends sessions on its own clock); every wait is bounded by ``trio.fail_after``
and fails the test when it runs out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from amqbroker.cluster.zk import commit_epoch
from amqbroker.core.errors import LocalError
from amqbroker.ha.lease import (
    LeaseRole,
    LeaseUnavailable,
    LeaseView,
    ZkLease,
    load_served_epoch,
    save_served_epoch,
)
from tests.cluster.zk_harness import (  # noqa: F401
    ZooKeeperServer,
    end_session,
    free_port,
    zk_path,
    zookeeper,
)

pytestmark = pytest.mark.timeout(90)

SESSION_MS = 1000  # how long a silent member keeps its place
WAIT = 15.0  # bound for any one change (several session timeouts)
NODE = "node1"
WIPES = 300  # deletes of the pair's znodes by a racing "operator"


@dataclass
class Recorder:
    """LeaseEvents that log every callback and wake waiters."""

    events: list[tuple[str, str | None, str | None, int]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # trio.current_time() of each event
    changed: trio.Event = field(default_factory=trio.Event)

    def _add(self, kind: str, member: str | None, address: str | None, epoch: int) -> None:
        self.events.append((kind, member, address, epoch))
        self.times.append(trio.current_time())
        self.changed.set()
        self.changed = trio.Event()

    def on_live(self, epoch: int) -> None:
        self._add("live", None, None, epoch)

    def on_standby(self, live_member: str | None, live_address: str | None, epoch: int) -> None:
        self._add("standby", live_member, live_address, epoch)

    def on_lost(self) -> None:
        self._add("lost", None, None, -1)

    def live_epochs(self) -> list[int]:
        return [e for kind, _, _, e in self.events if kind == "live"]

    def first(self, kind: str, epoch: int | None = None) -> float:
        """When the first `kind` event (at `epoch`) came."""
        for (k, _, _, e), t in zip(self.events, self.times, strict=True):
            if k == kind and (epoch is None or e == epoch):
                return t
        raise AssertionError(f"no {kind} event in {self.events}")


@dataclass
class Member:
    lease: ZkLease
    recorder: Recorder
    scope: trio.CancelScope

    @property
    def view(self) -> LeaseView:
        return self.lease.view

    async def wait(self, pred: Callable[[LeaseView], bool], what: str) -> LeaseView:
        # eligibility and members call no callback: poll the view too (bounded)
        with trio.fail_after(WAIT):
            while not pred(self.lease.view):
                with trio.move_on_after(0.02):
                    await self.recorder.changed.wait()
        return self.lease.view

    def leave(self) -> None:
        self.scope.cancel()


class Pair:
    def __init__(self, nursery: trio.Nursery, hosts: str, path: str) -> None:
        self.nursery = nursery
        self.hosts = hosts
        self.path = path
        self.members: dict[str, Member] = {}

    async def join(
        self, name: str, synced: int | None, hosts: str | None = None, session_ms: int = SESSION_MS
    ) -> Member:
        """Start member `name` (candidate with `synced` unless None), connected."""
        recorder = Recorder()
        lease = ZkLease(
            hosts or self.hosts,
            self.path,
            NODE,
            member_id(name),
            address(name),
            recorder,
            session_timeout_ms=session_ms,
            connect_timeout=WAIT,
        )
        if synced is not None:
            lease.candidate(synced)
        scope = trio.CancelScope()

        async def runner(task_status: trio.TaskStatus[None]) -> None:
            with scope:
                await lease.run(task_status=task_status)

        await self.nursery.start(runner)
        m = Member(lease, recorder, scope)
        self.members[name] = m
        return m


def member_id(name: str) -> str:
    return f"{NODE}@{name}"


def address(name: str) -> str:
    return f"{name}.example:5672"


def is_live(epoch: int) -> Callable[[LeaseView], bool]:
    return lambda v: v.role is LeaseRole.LIVE and v.epoch == epoch


def standby_of(name: str | None, epoch: int) -> Callable[[LeaseView], bool]:
    live = None if name is None else member_id(name)
    return lambda v: v.role is LeaseRole.STANDBY and v.live_member == live and v.epoch == epoch


@pytest.fixture
async def pair(
    nursery: trio.Nursery,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> AsyncIterator[Pair]:
    p = Pair(nursery, zookeeper.hosts, zk_path)
    yield p
    for m in p.members.values():
        m.leave()


async def kill_session(m: Member, hosts: str) -> None:
    session = m.lease.session()
    assert session is not None
    await trio.to_thread.run_sync(end_session, hosts, session)


class Partition:
    """A TCP proxy in front of ZooKeeper that can black-hole all traffic (a network
    partition between one member and ZooKeeper) and heal."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.cut = False
        self._scopes: set[trio.CancelScope] = set()

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    def heal(self) -> None:
        """Let traffic through again; the connections cut meanwhile are closed (their
        byte streams lost data)."""
        self.cut = False
        for scope in self._scopes:
            scope.cancel()

    async def _handle(self, downstream: trio.SocketStream) -> None:
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                async with (
                    downstream,
                    await trio.open_tcp_stream("127.0.0.1", self.target_port) as upstream,
                    trio.open_nursery() as n,
                ):
                    n.start_soon(self._pump, downstream, upstream, n.cancel_scope)
                    n.start_soon(self._pump, upstream, downstream, n.cancel_scope)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                self._scopes.discard(scope)

    async def _pump(
        self, src: trio.SocketStream, dst: trio.SocketStream, done: trio.CancelScope
    ) -> None:
        try:
            while data := await src.receive_some():
                if not self.cut:  # cut: the bytes are lost
                    await dst.send_all(data)
        finally:
            done.cancel()


# ------------------------------------------------------------------------------ no ZK


def test_served_epoch_is_saved_atomically_and_read_back(tmp_path: Path) -> None:
    assert load_served_epoch(tmp_path) == 0  # never saved: an empty store
    save_served_epoch(tmp_path, 3)
    save_served_epoch(tmp_path, 4)
    assert load_served_epoch(tmp_path) == 4
    assert sorted(p.name for p in (tmp_path / "ha").iterdir()) == ["epoch"]  # no .tmp left
    save_served_epoch(tmp_path, 0)  # before discarding the store for a full resync
    assert load_served_epoch(tmp_path) == 0
    (tmp_path / "ha" / "epoch").write_text("garbage", encoding="utf-8")
    with pytest.raises(LocalError, match="does not hold an amqbroker HA epoch"):
        load_served_epoch(tmp_path)
    with pytest.raises(ValueError):
        save_served_epoch(tmp_path, -1)


async def test_unreachable_zookeeper_at_start_is_a_clear_error(nursery: trio.Nursery) -> None:
    hosts = f"127.0.0.1:{free_port()}"  # nothing listens there
    lease = ZkLease(hosts, "/x", NODE, "m", "a:1", Recorder(), connect_timeout=1.0)
    with trio.fail_after(WAIT), pytest.raises(LeaseUnavailable) as info:
        await nursery.start(lease.run)
    assert hosts in str(info.value)
    assert "start ZooKeeper" in str(info.value)


# --------------------------------------------------------------------- real ZooKeeper


async def test_bootstrap_first_member_is_live_at_epoch_1_and_the_second_is_standby(
    pair: Pair,
) -> None:
    a = await pair.join("a", 0)
    await a.wait(is_live(1), "a live")
    assert a.lease.synced_epoch == 1  # its store is now the one of epoch 1
    b = await pair.join("b", 1)
    v = await b.wait(standby_of("a", 1), "b standby of a")
    assert v.live_address == address("a")
    assert v.eligible
    await a.wait(lambda v: v.members == (member_id("a"), member_id("b")), "a sees b")
    assert a.recorder.events == [("live", None, None, 1)]
    assert b.recorder.events == [("standby", member_id("a"), address("a"), 1)]
    assert a.lease.fence.current == b.lease.fence.current == 1


async def test_a_member_that_is_not_a_candidate_watches_the_live(pair: Pair) -> None:
    a = await pair.join("a", 0)
    await a.wait(is_live(1), "a live")
    syncing = await pair.join("s", None)  # a backup still copying: not eligible yet
    v = await syncing.wait(standby_of("a", 1), "s knows a")
    assert not v.eligible and v.live_address == address("a")
    await a.wait(lambda v: v.members == (member_id("a"),), "s is not a member")


async def test_live_whose_session_ends_is_replaced_and_the_old_live_stays_standby(
    pair: Pair,
    zookeeper: ZooKeeperServer,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker.ha.lease")
    a = await pair.join("a", 0)
    await a.wait(is_live(1), "a live")
    b = await pair.join("b", 1)
    await b.wait(standby_of("a", 1), "b standby")
    assert await a.lease.confirm(1)
    assert not await a.lease.confirm(2)
    assert not await b.lease.confirm(1)

    start = trio.current_time()
    await kill_session(a, zookeeper.hosts)
    await b.wait(is_live(2), "b takes over")
    assert trio.current_time() - start < SESSION_MS / 1000 + 2
    assert b.lease.synced_epoch == 2
    assert await b.lease.confirm(2)
    assert not await a.lease.confirm(1)  # the old live learns it lost the lease

    # a hears of it, stops being live, and comes back (eligible, synced to epoch 1)
    await a.wait(lambda v: v.eligible and v.role is LeaseRole.STANDBY, "a rejoins")
    assert ("lost", None, None, -1) in a.recorder.events
    await a.wait(standby_of("b", 2), "a standby of b")
    assert a.view.live_address == address("b")
    assert a.lease.synced_epoch == 1

    # even first in line, a (a copy of epoch 1) cannot become live at epoch 2's expense
    b.leave()
    await a.wait(standby_of(None, 2), "nobody live")
    await a.wait(lambda v: v.members == (member_id("a"),), "a is first")
    with trio.move_on_after(3 * SESSION_MS / 1000):
        await a.wait(lambda v: v.role is LeaseRole.LIVE, "a must not take over")
        pytest.fail("a stale member took over")
    assert a.recorder.live_epochs() == [1]
    assert b.recorder.live_epochs() == [2]
    assert any("cannot become live" in r.getMessage() for r in caplog.records)


async def test_partitioned_live_stops_before_its_session_expires_and_the_standby_takes_over(
    pair: Pair,
    zookeeper: ZooKeeperServer,  # noqa: F811
    nursery: trio.Nursery,
) -> None:
    """A real expiry: the live's traffic to ZooKeeper is black-holed. kazoo reports it
    SUSPENDED (on_lost) after two thirds of the session timeout; ZooKeeper expires the
    session after the timeout and the standby takes over: never two live at once."""
    proxy = Partition(zookeeper.port)
    await nursery.start(proxy.serve)
    a = await pair.join("a", 0, hosts=proxy.hosts)
    await a.wait(is_live(1), "a live")
    b = await pair.join("b", 1)
    await b.wait(standby_of("a", 1), "b standby")

    cut_at = trio.current_time()
    proxy.cut = True
    await b.wait(is_live(2), "b takes over")
    assert b.recorder.first("live", 2) - cut_at < SESSION_MS / 1000 + 2
    await a.wait(lambda v: v.role is LeaseRole.LOST, "a lost")
    assert a.recorder.first("lost") < b.recorder.first("live", 2)  # a stopped first

    proxy.heal()  # a finds its session expired and comes back as b's standby
    await a.wait(standby_of("b", 2), "a standby of b")
    assert a.view.eligible
    assert not await a.lease.confirm(1)
    assert a.recorder.live_epochs() == [1]


async def test_the_loss_reaches_trio_while_the_worker_is_stuck_in_an_evaluation(
    pair: Pair,
    zookeeper: ZooKeeperServer,  # noqa: F811
    nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker can be blocked in a kazoo call queued while disconnected: on_lost
    comes from the connection listener anyway, and what the worker evaluated before
    the loss is dropped as stale."""
    proxy = Partition(zookeeper.port)
    await nursery.start(proxy.serve)
    a = await pair.join("a", 0, hosts=proxy.hosts)
    await a.wait(is_live(1), "a live")
    gate, stalled = threading.Event(), threading.Event()
    original = a.lease._session_or_lost

    def stall() -> int | None:
        session = original()  # connected: the evaluation's generation is taken
        stalled.set()
        gate.wait(WAIT)
        return session

    monkeypatch.setattr(a.lease, "_session_or_lost", stall)
    try:
        b = await pair.join("b", 1)  # a's worker wakes (members changed) and stalls
        with trio.fail_after(WAIT):
            await trio.to_thread.run_sync(stalled.wait)
        proxy.cut = True
        await a.wait(lambda v: v.role is LeaseRole.LOST, "a lost, worker stuck")
        assert not gate.is_set()
        await b.wait(is_live(2), "b takes over")
        assert a.recorder.first("lost") < b.recorder.first("live", 2)
    finally:
        monkeypatch.setattr(a.lease, "_session_or_lost", original)
        gate.set()
    proxy.heal()
    await a.wait(standby_of("b", 2), "a standby of b")
    assert a.recorder.live_epochs() == [1]
    assert [k for k, *_ in a.recorder.events][:2] == ["live", "lost"]


async def test_live_whose_session_survives_a_suspension_takes_a_fresh_epoch(
    pair: Pair,
    zookeeper: ZooKeeperServer,  # noqa: F811
    nursery: trio.Nursery,
) -> None:
    """SUSPENDED (connection lost, session alive): on_lost at once; after the reconnect
    the same session is still first and its store is the one of its epoch, so it is live
    again, but under the next epoch (what it stamped before is fenced)."""
    proxy = Partition(zookeeper.port)
    await nursery.start(proxy.serve)
    a = await pair.join("a", 0, hosts=proxy.hosts, session_ms=6000)
    await a.wait(is_live(1), "a live")
    b = await pair.join("b", 1)
    await b.wait(standby_of("a", 1), "b standby")
    session = a.lease.session()

    proxy.cut = True
    await a.wait(lambda v: v.role is LeaseRole.LOST, "a suspended")
    proxy.heal()  # SUSPENDED after 4 s: 2 s left of the session
    await a.wait(is_live(2), "a live again, fresh epoch")
    assert a.lease.session() == session  # the same session: no expiry happened
    assert [k for k, *_ in a.recorder.events] == ["live", "lost", "live"]
    assert a.recorder.live_epochs() == [1, 2]
    await b.wait(standby_of("a", 2), "b follows the new epoch")
    assert b.lease.fence.current == 2 and not b.lease.fence.check(1)
    assert b.lease.synced_epoch == 1  # b's copy is of epoch 1 until it says otherwise
    assert b.recorder.live_epochs() == []


async def test_a_primary_restarting_on_its_own_store_takes_the_next_epoch(
    pair: Pair, tmp_path: Path
) -> None:
    a = await pair.join("a", 0)
    await a.wait(is_live(1), "a live")
    save_served_epoch(tmp_path, a.view.epoch)  # what the broker does on on_live
    a.leave()  # a clean stop: nobody else is eligible, epoch 1 stays
    again = await pair.join("a", load_served_epoch(tmp_path))  # same member id
    await again.wait(is_live(2), "the restarted primary is live")
    assert again.lease.synced_epoch == 2


async def test_a_stale_member_alone_never_becomes_live(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker.ha.lease")
    a = await pair.join("a", 0)
    await a.wait(is_live(1), "a live")
    a.leave()  # epoch 1 stays in ZooKeeper, nobody is live
    c = await pair.join("c", 0)  # an empty store: it missed epoch 1
    await c.wait(lambda v: v.members == (member_id("c"),), "c alone")
    v = await c.wait(standby_of(None, 1), "c standby, nobody live")
    assert v.eligible
    with trio.move_on_after(3 * SESSION_MS / 1000):
        await c.wait(lambda v: v.role is LeaseRole.LIVE, "c must not take over")
        pytest.fail("a stale member took over")
    refusals = [r.getMessage() for r in caplog.records if "cannot become live" in r.getMessage()]
    assert len(refusals) == 1, refusals  # said once, not on every evaluation
    assert "complete copy of epoch 0" in refusals[0]
    assert "ZooKeeper's epoch is 1" in refusals[0]
    # once it is a copy of epoch 1 (it resynced from a live, say) it may take over
    c.lease.candidate(1)
    await c.wait(is_live(2), "c live at 2")
    assert c.recorder.live_epochs() == [2]


async def test_withdraw_of_the_live_hands_over_to_an_in_sync_standby(pair: Pair) -> None:
    a = await pair.join("a", 0)
    await a.wait(is_live(1), "a live")
    b = await pair.join("b", 1)
    await b.wait(standby_of("a", 1), "b standby")
    a.lease.withdraw()
    await b.wait(is_live(2), "b takes over")
    await a.wait(standby_of("b", 2), "a standby of b")
    assert not a.view.eligible
    assert not await a.lease.confirm(1)


async def test_znodes_deleted_under_a_live_member_end_its_lease_and_it_never_bootstraps(
    pair: Pair,
    zookeeper: ZooKeeperServer,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator wipes the pair's znodes: the epoch restarts at 0, which the live's
    store (epoch 1) is newer than; it stops being live and says so, never serving
    under a reset epoch."""
    from kazoo.client import KazooClient

    caplog.set_level(logging.INFO, logger="amqbroker.ha.lease")
    a = await pair.join("a", 0)
    await a.wait(is_live(1), "a live")

    give_up = threading.Event()  # the test ended (failed): the wipe stops too

    def wipe() -> None:
        from kazoo.exceptions import NoNodeError, NotEmptyError

        c = KazooClient(hosts=zookeeper.hosts, timeout=5.0)
        c.start(timeout=10)
        epoch_path = f"{a.lease.path}/epoch"
        try:
            with contextlib.suppress(NotEmptyError):  # a recreates what is deleted
                c.delete(a.lease.path, recursive=True)
            deadline = time.monotonic() + WAIT
            while (left := deadline - time.monotonic()) > 0 and not give_up.is_set():
                changed = threading.Event()  # set by ZooKeeper's watch on the epoch znode
                with contextlib.suppress(NoNodeError, NotEmptyError):
                    if c.exists(epoch_path, watch=lambda _e, ev=changed: ev.set()) is not None:
                        if json.loads(c.get(epoch_path)[0])["epoch"] == 0:
                            return  # wiped and recreated by a
                        c.delete(a.lease.path, recursive=True)
                changed.wait(min(left, 0.5))  # deleted, or recreated by a
        finally:
            c.stop()
            c.close()
        raise AssertionError(f"a did not recreate the wiped znodes within {WAIT} s")

    try:
        await trio.to_thread.run_sync(wipe, abandon_on_cancel=True)
    finally:
        give_up.set()
    await a.wait(lambda v: v.role is LeaseRole.STANDBY and v.eligible, "a recreated, not live")
    await a.wait(standby_of(None, 0), "epoch 0, nobody live")
    assert not await a.lease.confirm(1)
    assert a.recorder.live_epochs() == [1]
    assert any("was ZooKeeper's data reset?" in r.getMessage() for r in caplog.records)


async def test_members_racing_for_the_first_epoch_one_wins(pair: Pair) -> None:
    ms: list[Member] = []

    async def join(name: str) -> None:
        ms.append(await pair.join(name, 0))

    async with trio.open_nursery() as n:
        for i in range(4):
            n.start_soon(join, f"r{i}")
    assert len(ms) == 4
    for m in ms:
        await m.wait(lambda v: v.epoch == 1 and v.live_member is not None, "settled")
    live = [m for m in ms if m.view.role is LeaseRole.LIVE]
    assert len(live) == 1
    winner = live[0].lease.member_id
    assert all(m.view.live_member == winner for m in ms)
    assert sorted(e for m in ms for e in m.recorder.live_epochs()) == [1]


async def test_compare_and_set_of_one_epoch_version_commits_once(
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> None:
    """The safety under the order rule: two writers that read the same epoch version
    (each with its own live member znode) cannot both commit the next epoch."""
    from kazoo.client import KazooClient

    def race() -> list[bool]:
        clients = [KazooClient(hosts=zookeeper.hosts, timeout=5.0) for _ in range(2)]
        try:
            for c in clients:
                c.start(timeout=10)
            epoch_path = f"{zk_path}/epoch"
            clients[0].create(epoch_path, json.dumps({"epoch": 1}).encode(), makepath=True)
            _, stat = clients[0].get(epoch_path)
            own = [c.create(f"{zk_path}/m_", b"{}", ephemeral=True, sequence=True) for c in clients]
            return [
                commit_epoch(c, node, epoch_path, json.dumps({"epoch": 2}).encode(), stat.version)
                for c, node in zip(clients, own, strict=True)
            ]
        finally:
            for c in clients:
                c.stop()
                c.close()

    with trio.fail_after(WAIT):
        results = await trio.to_thread.run_sync(race)
    assert sorted(results) == [False, True]


async def test_bump_of_a_live_that_lost_its_backup_fences_the_backups_copy(pair: Pair) -> None:
    """A live whose backup dropped out takes the next epoch before it answers alone: the
    backup's copy (complete for the old epoch only) can then never become live."""
    a = await pair.join("a", 0)
    await a.wait(is_live(1), "a live")
    b = await pair.join("b", 1)
    await b.wait(standby_of("a", 1), "b standby")
    await a.wait(lambda v: v.addresses == (address("a"), address("b")), "a sees b's address")
    with trio.fail_after(WAIT):
        assert await a.lease.bump(1) == 2
    assert a.view.role is LeaseRole.LIVE and a.view.epoch == 2
    assert a.recorder.live_epochs() == [1, 2]
    assert await a.lease.confirm(2) and not await a.lease.confirm(1)
    with trio.fail_after(WAIT):
        assert await a.lease.bump(1) == 2  # a repeated request: already past it
    a.leave()  # the live dies: b is first but only a copy of epoch 1
    await b.wait(standby_of(None, 2), "b standby, nobody live")
    with trio.move_on_after(3 * SESSION_MS / 1000):
        await b.wait(lambda v: v.role is LeaseRole.LIVE, "b must not take over")
        pytest.fail("a backup whose copy missed epoch 2 took over")


async def test_bump_by_a_member_that_is_not_live_is_refused(pair: Pair) -> None:
    a = await pair.join("a", 0)
    await a.wait(is_live(1), "a live")
    b = await pair.join("b", 1)
    await b.wait(standby_of("a", 1), "b standby")
    with trio.fail_after(WAIT):
        assert await b.lease.bump(1) == 0
    assert a.view.epoch == 1 and await a.lease.confirm(1)


async def test_a_stale_member_ahead_does_not_block_an_in_sync_one(pair: Pair) -> None:
    """After both members died, the one with the older copy restarting first must not
    keep the one with the current copy from becoming live."""
    a = await pair.join("a", 0)
    await a.wait(is_live(1), "a live")
    with trio.fail_after(WAIT):
        assert await a.lease.bump(1) == 2  # a answered alone: epoch 2
    a.leave()  # nobody live; epoch 2 stays
    stale = await pair.join("s", 1)  # a copy of epoch 1 restarts first
    await stale.wait(standby_of(None, 2), "s standby, nobody live")
    fresh = await pair.join("a", 2)  # a's own store (served epoch 2) restarts second
    await fresh.wait(is_live(3), "a live at 3 although s is ahead")
    await stale.wait(standby_of("a", 3), "s standby of a")
    assert stale.recorder.live_epochs() == []


async def test_a_member_resynced_ahead_of_the_live_never_takes_over_from_it(pair: Pair) -> None:
    """A member whose znode is older than the live's (it was eligible first, with a
    stale copy) and whose copy then becomes one of the live's epoch must not take
    over from the live member."""
    b = await pair.join("b", 5)  # first in order, but a copy of no epoch that exists
    await b.wait(lambda v: v.eligible and v.role is LeaseRole.STANDBY, "b eligible")
    s = await pair.join("s", 0)  # a fresh store may bootstrap: in sync at epoch 0
    await s.wait(is_live(1), "s live although b is ahead")
    b.lease.candidate(1)  # b's copy is now of epoch 1, and b is still ahead of s
    await b.wait(lambda v: v.members == (member_id("b"), member_id("s")), "b ahead")
    with trio.move_on_after(3 * SESSION_MS / 1000):
        await b.wait(lambda v: v.role is LeaseRole.LIVE, "b must not take over from s")
        pytest.fail("a standby took over from a live member")
    assert s.view.role is LeaseRole.LIVE and s.view.epoch == 1
    assert await s.lease.confirm(1)
    s.leave()  # now b, in sync at 1, is the one to take over
    await b.wait(is_live(2), "b live")


async def test_a_member_rebuilds_its_znodes_after_wipes_racing_its_rebuild(
    pair: Pair,
    zookeeper: ZooKeeperServer,  # noqa: F811
) -> None:
    """An operator's script deletes the pair's znodes again and again while the member
    recreates them: some deletes land between two of its steps (the path gone under
    the epoch znode it is creating). Once the deletes stop, it has rebuilt them and is
    standby at epoch 0, not stuck waiting for a change that never comes."""
    from kazoo.client import KazooClient
    from kazoo.exceptions import NoNodeError, NotEmptyError

    a = await pair.join("a", 0)
    await a.wait(is_live(1), "a live")
    give_up = threading.Event()

    def wipe_repeatedly() -> int:
        c = KazooClient(hosts=zookeeper.hosts, timeout=5.0)
        c.start(timeout=10)
        deleted = 0
        try:
            for _ in range(WIPES):
                if give_up.is_set():
                    break
                with contextlib.suppress(NoNodeError, NotEmptyError):
                    c.delete(a.lease.path, recursive=True)
                    deleted += 1
        finally:
            c.stop()
            c.close()
        return deleted

    try:
        assert await trio.to_thread.run_sync(wipe_repeatedly, abandon_on_cancel=True) > 0
    finally:
        give_up.set()
    await a.wait(standby_of(None, 0), "epoch 0, nobody live")
    assert a.view.eligible
    assert a.recorder.live_epochs() == [1]
