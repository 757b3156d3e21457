"""The arbiter's synchronous replication to the backup, in process (no sockets: the
peer link is a function; the three-process failover is tests/cluster/test_failover.py)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from amqbroker.cluster.arbiter import Arbiter, NotArbiter
from amqbroker.cluster.decisions import BIND, Decision
from amqbroker.cluster.replication import ReplicaStore, Replicator


def leader(epoch: int = 3) -> Arbiter:
    a = Arbiter(None, trio.current_time, in_thread=False)
    a.leading, a.epoch = True, epoch
    return a


class Link:
    """The backup at the other end: answers with `answer(body)` after `delay` s."""

    def __init__(self, answer: Any, delay: float = 0.0, up: bool = True) -> None:
        self.answer = answer
        self.delay = delay
        self.up = up
        self.sent: list[dict[str, Any]] = []
        self.nursery: trio.Nursery | None = None

    def send(self, peer: str, body: dict[str, Any], on_answer: Any) -> bool:
        if not self.up:
            return False
        self.sent.append(body)

        async def later() -> None:
            await trio.sleep(self.delay)
            on_answer(*self.answer(body))

        assert self.nursery is not None
        self.nursery.start_soon(later)
        return True


def replicator(a: Arbiter, link: Link, confirmed: bool = True) -> tuple[Replicator, list[int]]:
    fenced: list[int] = []

    async def confirm(epoch: int) -> bool:
        return confirmed

    def on_fenced(epoch: int) -> None:
        fenced.append(epoch)
        a.leading = False

    r = Replicator(
        a, link.send, epoch=lambda: a.epoch, confirm=confirm, on_fenced=on_fenced, retry_delay=0.05
    )
    a.add_replica(r)
    return r, fenced


async def test_snapshot_then_each_decision_before_the_answer(autojump_clock: Any) -> None:
    a = leader()
    link = Link(lambda body: (200, "OK", True), delay=1.0)
    async with trio.open_nursery() as n:
        link.nursery = n
        n.start_soon(a.run)
        r, _ = replicator(a, link)
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
        n.cancel_scope.cancel()


async def test_backup_with_a_higher_epoch_fences_the_arbiter(autojump_clock: Any) -> None:
    a = leader(epoch=3)
    link = Link(lambda body: (409, "stale arbiter epoch", {"epoch": 4}))
    async with trio.open_nursery() as n:
        link.nursery = n
        n.start_soon(a.run)
        r, fenced = replicator(a, link)
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
        n.cancel_scope.cancel()
    assert fenced == [4]
    assert "g.q" not in a.bindings  # never answered, not bound
    assert len(waiter_result) == 1


async def test_without_a_backup_zookeeper_must_confirm(autojump_clock: Any) -> None:
    a = leader()
    link = Link(lambda body: (200, "OK", True), up=False)
    async with trio.open_nursery() as n:
        link.nursery = n
        n.start_soon(a.run)
        r, fenced = replicator(a, link, confirmed=True)
        r.set_target("node2")  # elected backup, link down
        _, accepted = await a.propose("g.q", "node1", "q")
        assert accepted and r.unreplicated == 1 and fenced == []
        a2 = leader()
        n.start_soon(a2.run)
        _r2, fenced2 = replicator(a2, Link(lambda body: (200, "OK", True)), confirmed=False)
        with pytest.raises(NotArbiter):
            await a2.propose("g.q", "node1", "q")  # no backup, ZooKeeper says: replaced
        assert fenced2 == [3]
        n.cancel_scope.cancel()


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
