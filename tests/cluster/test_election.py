"""The arbiter election against a real ZooKeeper: roles, takeover, epochs, fencing.

Participants run in-process (`ZkElection` tasks) except the one that is paused with
SIGSTOP, which runs in a child process (tests/cluster/zk_participant.py). Time is real
(ZooKeeper expires sessions on its own clock); every wait is bounded by
``trio.fail_after`` and fails the test when it runs out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from amqbroker.cluster.election import (
    ElectionView,
    Fence,
    Role,
    StaticElection,
    ZkElection,
    arbiter_events,
    zk_election,
)
from tests.cluster.zk_harness import ZooKeeperServer, zk_path, zookeeper  # noqa: F401

SESSION_MS = 1000  # how long a silent participant keeps its place
WAIT = 15.0  # bound for any one role change (several session timeouts)
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Recorder:
    """ElectionEvents that log every callback and wake waiters."""

    name: str
    events: list[tuple[str, str | None, int]] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)

    def _add(self, kind: str, leader: str | None, epoch: int) -> None:
        self.events.append((kind, leader, epoch))
        self.changed.set()
        self.changed = trio.Event()

    def on_leader(self, epoch: int) -> None:
        self._add("leader", self.name, epoch)

    def on_backup(self, leader_id: str | None, epoch: int) -> None:
        self._add("backup", leader_id, epoch)

    def on_follower(self, leader_id: str | None, epoch: int) -> None:
        self._add("follower", leader_id, epoch)

    def on_lost(self) -> None:
        self._add("lost", None, -1)


@dataclass
class Participant:
    election: ZkElection
    recorder: Recorder
    scope: trio.CancelScope

    @property
    def view(self) -> ElectionView:
        return self.election.view

    async def wait(self, pred: Callable[[ElectionView], bool], what: str) -> ElectionView:
        # members/backup changes call no callback: poll the view (bounded)
        with trio.fail_after(WAIT):
            while not pred(self.election.view):
                with trio.move_on_after(0.02):
                    await self.recorder.changed.wait()
        return self.election.view

    def leave(self) -> None:
        self.scope.cancel()


class Cluster:
    def __init__(self, nursery: trio.Nursery, hosts: str, path: str) -> None:
        self.nursery = nursery
        self.hosts = hosts
        self.path = path
        self.members: dict[str, Participant] = {}

    async def join(self, name: str) -> Participant:
        recorder = Recorder(name)
        election = ZkElection(self.hosts, self.path, name, recorder, session_timeout_ms=SESSION_MS)
        scope = trio.CancelScope()

        async def runner(task_status: trio.TaskStatus[None]) -> None:
            with scope:
                await election.run(task_status=task_status)

        await self.nursery.start(runner)
        p = Participant(election, recorder, scope)
        self.members[name] = p
        await p.wait(lambda v: v.role is not Role.LOST, f"{name} joins")
        return p


@pytest.fixture
async def cluster(
    nursery: trio.Nursery,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> AsyncIterator[Cluster]:
    c = Cluster(nursery, zookeeper.hosts, zk_path)
    yield c
    for p in c.members.values():
        p.leave()


def leader_epochs(*ps: Participant) -> list[int]:
    return sorted(e for p in ps for kind, _, e in p.recorder.events if kind == "leader")


# ------------------------------------------------------------------------------ no ZK


def test_fence_refuses_older_epochs_and_learns_newer_ones() -> None:
    fence = Fence(3)
    assert fence.check(3)
    assert not fence.check(2)
    assert fence.check(5)  # a newer arbiter: learnt
    assert not fence.check(4)
    fence.raise_to(1)  # never lowers
    assert fence.current == 5


class _Role:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def become_leader(self, epoch: int) -> None:
        self.calls.append(("leader", epoch))

    def become_follower(self, leader_node_id: str | None, epoch: int) -> None:
        self.calls.append(("follower", leader_node_id, epoch))


def test_arbiter_events_map_onto_the_arbiter_role() -> None:
    role, fence = _Role(), Fence(7)
    events = arbiter_events(role, fence)
    events.on_leader(7)
    events.on_backup("n1", 8)
    events.on_follower("n1", 8)
    events.on_lost()
    assert role.calls == [
        ("leader", 7),
        ("follower", "n1", 8),
        ("follower", "n1", 8),
        ("follower", None, 7),
    ]


async def test_static_election_names_a_fixed_arbiter_and_warns(nursery: trio.Nursery) -> None:
    arbiter, remote = Recorder("n1"), Recorder("n2")
    s1 = StaticElection("n1", "n1", arbiter)
    s2 = StaticElection("n2", "n1", remote)
    await nursery.start(s1.run)
    await nursery.start(s2.run)
    assert arbiter.events == [("leader", "n1", 1)]
    assert remote.events == [("follower", "n1", 1)]
    assert "single point of failure" in s2.warning
    nursery.cancel_scope.cancel()


# --------------------------------------------------------------------- real ZooKeeper


async def test_three_participants_one_leader_one_backup_one_follower(cluster: Cluster) -> None:
    a = await cluster.join("a")
    assert a.view.role is Role.LEADER
    epoch = a.view.epoch
    assert epoch >= 1
    b = await cluster.join("b")
    c = await cluster.join("c")
    await b.wait(lambda v: v.role is Role.BACKUP and v.leader_id == "a", "b backup")
    await c.wait(lambda v: v.role is Role.FOLLOWER and v.leader_id == "a", "c follower")
    await a.wait(lambda v: v.members == ("a", "b", "c"), "a sees everyone")
    assert a.view.backup_id == "b"
    assert {p.view.epoch for p in (a, b, c)} == {epoch}
    assert [p.election.fence.current for p in (a, b, c)] == [epoch] * 3
    assert leader_epochs(a, b, c) == [epoch]  # one leader, once


async def test_leader_that_leaves_is_replaced_by_the_backup_with_a_higher_epoch(
    cluster: Cluster,
) -> None:
    a = await cluster.join("a")
    b = await cluster.join("b")
    c = await cluster.join("c")
    await c.wait(lambda v: v.leader_id == "a", "c follows a")
    old = a.view.epoch
    a.leave()
    v = await b.wait(lambda v: v.role is Role.LEADER, "b takes over")
    assert v.epoch > old
    await c.wait(lambda v: v.role is Role.BACKUP and v.leader_id == "b", "c is backup")
    assert c.view.epoch == v.epoch
    assert not c.election.fence.check(old)  # the old leader's answers are fenced


async def test_leader_whose_session_expires_is_replaced_and_rejoins_fenced(
    cluster: Cluster,
    zookeeper: ZooKeeperServer,  # noqa: F811
) -> None:
    from kazoo.client import KazooClient

    a = await cluster.join("a")
    b = await cluster.join("b")
    c = await cluster.join("c")
    await c.wait(lambda v: v.leader_id == "a", "c follows a")
    old = a.view.epoch
    session = a.election.session()
    assert session is not None

    # Expire a's session from outside: a second client attaching to the same session
    # and closing it ends the session for ZooKeeper, exactly as an expiry does.
    def kill_session() -> None:
        thief = KazooClient(hosts=zookeeper.hosts, client_id=session, timeout=2.0)
        thief.start(timeout=5)
        thief.stop()
        thief.close()

    await trio.to_thread.run_sync(kill_session)
    v = await b.wait(lambda v: v.role is Role.LEADER, "b takes over")
    assert v.epoch > old
    # a notices, drops out of the leadership and comes back last, behind c
    rejoined = await a.wait(
        lambda v: v.role is Role.FOLLOWER and v.leader_id == "b", "a rejoins as a follower"
    )
    assert rejoined.epoch == v.epoch
    assert ("lost", None, -1) in a.recorder.events
    assert a.election.fence.current == v.epoch
    assert not a.election.fence.check(old)
    assert leader_epochs(a, b, c) == [old, v.epoch]


async def test_epochs_never_go_backwards_over_many_takeovers(cluster: Cluster) -> None:
    ps = [await cluster.join(f"p{i}") for i in range(3)]
    for i in range(3, 7):
        leader = next(p for p in ps if p.view.role is Role.LEADER)
        before = leader.view.epoch
        leader.leave()
        ps.remove(leader)
        ps.append(await cluster.join(f"p{i}"))
        new = await ps[0].wait(
            lambda v, before=before: v.role is Role.LEADER and v.epoch > before, "takeover"
        )
        assert new.epoch > before
    everyone = list(cluster.members.values())
    for p in everyone:
        epochs = [e for kind, _, e in p.recorder.events if kind != "lost"]
        assert epochs == sorted(epochs), (p.recorder.name, p.recorder.events)
    led = leader_epochs(*everyone)
    assert led == sorted(set(led)) and len(led) == 5  # each leadership its own epoch


# ----------------------------------------------------- a paused arbiter comes back


class Child:
    """A zk_participant process; its JSON lines are collected as they come."""

    def __init__(self, hosts: str, path: str, name: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.cluster.zk_participant",
                hosts,
                path,
                name,
                str(SESSION_MS),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[dict[str, object]] = []
        self.changed = trio.Event()

    async def read(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        async with trio.lowlevel.FdStream(os.dup(self.proc.stdout.fileno())) as stream:
            while chunk := await stream.receive_some():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self.lines.append(json.loads(line))
                    self.changed.set()
                    self.changed = trio.Event()

    async def wait(self, pred: Callable[[dict[str, object]], bool], what: str) -> dict[str, object]:
        with trio.fail_after(WAIT):
            while True:
                for line in self.lines:
                    if pred(line):
                        return line
                await self.changed.wait()

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


async def test_paused_old_leader_is_fenced_when_it_resumes(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    old = Child(cluster.hosts, cluster.path, "old")
    try:
        nursery.start_soon(old.read)
        first = await old.wait(lambda m: m["event"] == "leader", "old leads")
        e1 = first["epoch"]
        assert isinstance(e1, int)
        b = await cluster.join("b")
        c = await cluster.join("c")
        await b.wait(lambda v: v.role is Role.BACKUP and v.leader_id == "old", "b backup")
        await c.wait(lambda v: v.leader_id == "old", "c follows old")

        old.proc.send_signal(signal.SIGSTOP)
        old.send("answer g1")  # a proposal the paused arbiter will answer late
        v = await b.wait(lambda v: v.role is Role.LEADER, "b takes over")
        e2 = v.epoch
        assert e2 > e1
        await c.wait(lambda v: v.leader_id == "b" and v.epoch == e2, "c follows b")

        old.proc.send_signal(signal.SIGCONT)
        reply = await old.wait(lambda m: m.get("group") == "g1", "late answer")
        if reply["event"] == "answer":
            # it answered believing it still leads: the answer carries the old epoch,
            # and every node that matters refuses it
            assert reply["epoch"] == e1
            assert not b.election.fence.check(e1)
            assert not c.election.fence.check(e1)
        else:
            assert reply["event"] == "not-leader"
        # it learns that its session expired, stops leading and follows b's epoch
        await old.wait(lambda m: m["event"] == "lost", "old steps down")
        await old.wait(
            lambda m: (
                m["event"] in ("follower", "backup") and m["leader"] == "b" and m["epoch"] == e2
            ),
            "old follows b",
        )
        old.send("answer g2")
        assert (await old.wait(lambda m: m.get("group") == "g2", "answer"))["event"] == (
            "not-leader"
        )
        # nobody ever led with the old epoch after the takeover
        assert b.view.role is Role.LEADER and b.view.epoch == e2
        assert leader_epochs(b, c) == [e2]
    finally:
        old.kill()


# ------------------------------------------------------------------------- settings


def test_zookeeper_settings_validate_and_explain() -> None:
    from amqbroker.settings import SettingsError, load_settings

    s = load_settings(
        environ={
            "AMQBROKER_CLUSTER_ZOOKEEPER": " 127.0.0.1:2181 , zk2:2181",
            "AMQBROKER_CLUSTER_NODE_ID": "n1",
        }
    )
    assert s.cluster_zookeeper == "127.0.0.1:2181,zk2:2181"
    election = zk_election(s, _Role())
    assert election.path == "/amqbroker/default"
    assert election.node_id == "n1"
    with pytest.raises(SettingsError, match="not host:port"):
        load_settings(environ={"AMQBROKER_CLUSTER_ZOOKEEPER": "zk1"})
    with pytest.raises(SettingsError, match="absolute znode path"):
        load_settings(environ={"AMQBROKER_CLUSTER_ZOOKEEPER_PATH": "amqbroker/x/"})
