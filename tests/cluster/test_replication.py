"""The arbiter's synchronous replication to the backup, in process (no sockets: the
peer link is a function; the three-process failover is tests/cluster/test_failover.py)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from amqbroker.cluster.arbiter import Arbiter, NotArbiter
from amqbroker.cluster.decisions import BIND, Decision
from amqbroker.cluster.replication import ReplicaStore, Replicator


def leader(epoch: int = 3) -> Arbiter:
    a = Arbiter(None, trio.current_time, in_thread=False)
    a.leading, a.epoch = True, epoch
    return a


class Link:
    """The backup at the other end: answers with `answer(body)` after `delay` s (a
    peer in `by_peer` with its own function)."""

    def __init__(
        self,
        answer: Any,
        delay: float = 0.0,
        up: bool = True,
        by_peer: dict[str, Any] | None = None,
    ) -> None:
        self.answer = answer
        self.by_peer = by_peer or {}
        self.delay = delay
        self.up = up
        self.sent: list[dict[str, Any]] = []
        #: the peer of each message in `sent`, and when it was sent
        self.to: list[str] = []
        self.at: list[float] = []
        self.nursery: trio.Nursery | None = None
        self._activity = trio.Event()

    def _active(self) -> None:
        self._activity.set()
        self._activity = trio.Event()

    async def until(self, cond: Callable[[], bool]) -> None:
        """Wait for `cond`, checked whenever the replicator is blocked after a message
        was sent or answered; fails after 5 s (of the autojump clock)."""
        with trio.fail_after(5):
            while True:
                await trio.testing.wait_all_tasks_blocked()
                if cond():
                    return
                await self._activity.wait()

    def send(self, peer: str, body: dict[str, Any], on_answer: Any) -> bool:
        if not self.up:
            return False
        self.sent.append(body)
        self.to.append(peer)
        self.at.append(trio.current_time())
        self._active()

        async def later() -> None:
            await trio.sleep(self.delay)
            on_answer(*self.by_peer.get(peer, self.answer)(body))
            self._active()

        assert self.nursery is not None
        self.nursery.start_soon(later)
        return True


def replicator(
    a: Arbiter, link: Link, confirmed: bool = True, nursery: trio.Nursery | None = None
) -> tuple[Replicator, list[int]]:
    """With `nursery`, the eager snapshot runs there (the node's nursery in node.py)."""
    fenced: list[int] = []

    async def confirm(epoch: int) -> bool:
        return confirmed

    def on_fenced(epoch: int) -> None:
        fenced.append(epoch)
        a.leading = False

    def spawn(fn: Callable[[], Any]) -> bool:
        if nursery is None:
            return False
        nursery.start_soon(fn)
        return True

    r = Replicator(
        a,
        link.send,
        epoch=lambda: a.epoch,
        confirm=confirm,
        on_fenced=on_fenced,
        retry_delay=0.05,
        spawn=spawn,
    )
    a.add_replica(r)
    return r, fenced


@asynccontextmanager
async def running(
    a: Arbiter, link: Link, *, eager: bool = False
) -> AsyncIterator[tuple[trio.Nursery, Replicator, list[int]]]:
    """`a` running with a replicator over `link` (`eager`: its snapshot task in the same
    nursery, as node.py's spawn); the nursery, the replicator and the fenced epochs;
    everything is cancelled when the block ends."""
    async with trio.open_nursery() as n:
        link.nursery = n
        n.start_soon(a.run)
        r, fenced = replicator(a, link, nursery=n if eager else None)
        yield n, r, fenced
        n.cancel_scope.cancel()


async def test_snapshot_then_each_decision_before_the_answer(autojump_clock: Any) -> None:
    a = leader()
    link = Link(lambda body: (200, "OK", True), delay=1.0)
    async with running(a, link) as (_n, r, _):
        r.set_target("node2")
        t0 = trio.current_time()
        b, accepted = await a.propose("g.q", "node3", "q")
        assert accepted and b.ready.is_set()
        assert trio.current_time() - t0 == pytest.approx(2.0)  # snapshot, then the decision
        assert link.sent[0] == {"epoch": 3, "snapshot": []}
        assert link.sent[1]["epoch"] == 3
        assert [x["key"] for x in link.sent[1]["decisions"]] == ["g.q"]
        await a.propose("h.q", "node1", "q")
        assert len(link.sent) == 3  # in sync: no second snapshot
        r.link_down("node2")
        await a.propose("i.q", "node1", "q")
        assert [x["key"] for x in link.sent[3]["snapshot"]] == ["g.q", "h.q"]


async def test_backup_with_a_higher_epoch_fences_the_arbiter(autojump_clock: Any) -> None:
    a = leader(epoch=3)
    link = Link(lambda body: (409, "stale arbiter epoch", {"epoch": 4}))
    async with running(a, link) as (n, r, fenced):
        r.set_target("node2")
        waiter_result: list[BaseException] = []
        second_done = trio.Event()

        async def second() -> None:  # a concurrent proposal for the same key
            try:
                await a.propose("g.q", "node1", "q")
            except NotArbiter as exc:
                waiter_result.append(exc)
            finally:
                second_done.set()

        n.start_soon(second)
        with pytest.raises(NotArbiter):
            await a.propose("g.q", "node3", "q")
        with trio.fail_after(5):
            await second_done.wait()
    assert fenced == [4]
    assert "g.q" not in a.bindings  # never answered, not bound
    assert len(waiter_result) == 1


async def test_without_a_backup_zookeeper_must_confirm(autojump_clock: Any) -> None:
    a = leader()
    link = Link(lambda body: (200, "OK", True), up=False)
    async with running(a, link) as (n, r, fenced):
        r.set_target("node2")  # elected backup, link down
        _, accepted = await a.propose("g.q", "node1", "q")
        assert accepted and r.unreplicated == 1 and fenced == []
        a2 = leader()
        n.start_soon(a2.run)
        _r2, fenced2 = replicator(a2, Link(lambda body: (200, "OK", True)), confirmed=False)
        with pytest.raises(NotArbiter):
            await a2.propose("g.q", "node1", "q")  # no backup, ZooKeeper says: replaced
        assert fenced2 == [3]


def ok(body: Any) -> tuple[int, str, Any]:
    return 200, "OK", True


def in_sync_lines(caplog: pytest.LogCaptureFixture, peer: str) -> int:
    return sum(
        1 for r in caplog.records if r.getMessage().startswith(f"backup arbiter {peer} is in sync")
    )


async def test_a_new_backup_receives_the_snapshot_without_a_new_decision(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker.cluster")
    a = leader()
    link = Link(ok, delay=1.0)
    async with running(a, link, eager=True) as (_n, r, _):
        r.set_target("node2")
        await a.propose("g.q", "node3", "q")
        assert link.to == ["node2", "node2"] and "snapshot" in link.sent[0]
        # the election names another backup, then no decision is made: the leader
        # dying now must leave node4 (the next leader) with g.q
        r.set_target("node4")
        await link.until(lambda: r.synced == ("node4", 3))
        assert link.to[2:] == ["node4"]
        assert link.sent[2]["epoch"] == 3
        assert [x["key"] for x in link.sent[2]["snapshot"]] == ["g.q"]
        assert in_sync_lines(caplog, "node4") == 1
        # a new epoch with the same backup (`_role_changed` sets it again)
        a.epoch = 4
        r.set_target("node4")
        await link.until(lambda: r.synced == ("node4", 4))
        assert [(b["epoch"], len(b["snapshot"])) for b in link.sent[3:]] == [(4, 1)]
        # the next decision goes alone: the backup is in sync already
        await a.propose("h.q", "node1", "q")
        assert len(link.sent) == 5 and link.sent[4]["epoch"] == 4
        assert [x["key"] for x in link.sent[4]["decisions"]] == ["h.q"]
        assert in_sync_lines(caplog, "node4") == 2  # once per epoch: never twice


async def test_the_snapshot_is_sent_again_when_the_link_is_back(autojump_clock: Any) -> None:
    a = leader()
    link = Link(ok, delay=1.0, up=False)
    async with running(a, link, eager=True) as (_n, r, _):
        await a.propose("g.q", "node3", "q")  # no backup yet: unreplicated
        r.set_target("node2")  # its link is down: nothing is sent, nothing retried
        await trio.sleep(1.0)
        assert link.sent == [] and r.synced is None
        link.up = True
        r.link_up("node1")  # not the backup
        r.link_up("node2")
        r.link_up("node2")  # under way already: not twice
        await link.until(lambda: r.synced == ("node2", 3))
        assert link.to == ["node2"] and len(link.sent[0]["snapshot"]) == 1
        r.link_down("node2")
        r.link_up("node2")
        await link.until(lambda: r.synced == ("node2", 3))
        assert link.to == ["node2", "node2"]
        r.link_up("node2")  # in sync: nothing to send
        await trio.sleep(1.0)
        assert len(link.sent) == 2


async def test_a_change_of_backup_mid_snapshot_sends_it_to_the_new_one(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker.cluster")
    a = leader()
    link = Link(ok, delay=1.0)
    async with running(a, link, eager=True) as (_n, r, _):
        await a.propose("g.q", "node3", "q")  # no backup yet: unreplicated
        r.set_target("node2")
        await link.until(lambda: len(link.sent) == 1)  # node2's answer comes in 1 s
        r.set_target("node4")
        await link.until(lambda: link.to == ["node2", "node4"])
        # a decision made meanwhile waits for the snapshot, then goes alone
        await a.propose("h.q", "node1", "q")
        assert r.synced == ("node4", 3)
        assert link.to == ["node2", "node4", "node4"]
        assert [len(b["snapshot"]) for b in link.sent[:2]] == [1, 1]
        assert [x["key"] for x in link.sent[2]["decisions"]] == ["h.q"]
        await trio.sleep(2.0)  # node2's late answer changes nothing
        assert r.synced == ("node4", 3) and len(link.sent) == 3
        assert in_sync_lines(caplog, "node2") == 0
        assert in_sync_lines(caplog, "node4") == 1


async def test_503_is_retried_until_the_backup_changes(autojump_clock: Any) -> None:
    a = leader()

    def unknown(body: Any) -> tuple[int, str, Any]:  # node2 does not know this arbiter yet
        return 503, "not the arbiter of epoch 3", None

    link = Link(ok, delay=0.01, by_peer={"node2": unknown})
    async with running(a, link, eager=True) as (_n, r, _):
        r.set_target("node2")
        await link.until(lambda: len(link.sent) >= 4)
        gaps = [t1 - t0 for t0, t1 in zip(link.at, link.at[1:], strict=False)]
        assert gaps == pytest.approx([0.06] * len(gaps))  # answer, then retry_delay
        assert set(link.to) == {"node2"} and r.synced is None
        # the election names node4: node2's retries stop, node4 gets the snapshot
        r.set_target("node4")
        tried = link.to.count("node2")
        await link.until(lambda: r.synced == ("node4", 3))
        await trio.sleep(1.0)  # 20 retry delays
        assert link.to.count("node2") == tried
        assert link.to[-1] == "node4" and link.to.count("node4") == 1
        # a new epoch also ends the retries of the old one
        r.set_target("node2")
        await link.until(lambda: len(link.sent) >= tried + 3)
        a.epoch = 4
        r.set_target("node2")
        await link.until(lambda: link.sent[-1]["epoch"] == 4)
        first = len(link.sent) - 1
        await trio.sleep(1.0)
        assert len(link.sent) > first + 1  # still retried, at epoch 4 only
        assert all(b["epoch"] == 4 for b in link.sent[first:])


async def test_replica_store_refuses_a_stale_epoch_and_applies_snapshots_in_order(
    autojump_clock: Any,
) -> None:
    backup = Arbiter(None, trio.current_time, in_thread=False)
    fence = 5

    def check(sender: str, epoch: int) -> tuple[int, str, Any] | None:
        if epoch < fence:
            return 409, "stale", {"epoch": fence}
        return None

    store = ReplicaStore(backup, check, lambda: None, in_thread=False)
    answers: list[tuple[int, Any]] = []
    all_answered = trio.Event()

    def respond(status: int, desc: str, body: Any) -> None:
        answers.append((status, body))
        if len(answers) == 5:
            all_answered.set()

    def bind(key: str, node: str, epoch: int = 5) -> dict[str, Any]:
        return Decision(BIND, key, node, "q", epoch).to_dict()

    async with trio.open_nursery() as n:
        n.start_soon(store.run)
        store.submit("node1", bind("old.q", "node1", epoch=4), respond)
        store.submit("node2", bind("a.q", "node1"), respond)
        store.submit("node2", {"epoch": 5, "snapshot": [bind("b.q", "node3")]}, respond)
        store.submit("node2", bind("c.q", "node2"), respond)
        batch = {"epoch": 5, "decisions": [bind("d.q", "node3"), bind("e.q", "node1")]}
        store.submit("node2", batch, respond)  # the arbiter's group commit: one message
        with trio.fail_after(5):
            await all_answered.wait()
        n.cancel_scope.cancel()
    assert answers[0] == (409, {"epoch": 5})
    assert [s for s, _ in answers[1:]] == [200, 200, 200, 200]
    assert {k: b.node for k, b in backup.bindings.items()} == {
        "b.q": "node3",
        "c.q": "node2",
        "d.q": "node3",
        "e.q": "node1",
    }
