"""The arbiter's group commit (issue 15 follow-up; `arbiter.Arbiter.run`), in process.

Proposals waiting at one moment are committed as one batch: one decision-log append
with one fsync (a real `DecisionLog` with sync on, in a worker thread) and one
replication message to the backup carrying every decision of the batch; no proposal
of a batch is answered before that fsync and that acknowledgement. Proposals that
arrive while a batch is being committed form the next batch. A batch the backup
refuses (fenced) fails as a whole: no proposal of it is answered or bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from amqbroker.cluster.arbiter import Arbiter, NotArbiter
from amqbroker.cluster.decisions import DecisionLog
from tests.cluster.test_replication import Link, replicator

pytestmark = pytest.mark.timeout(30)


def durable_leader(tmp_path: Path, events: list[tuple[str, int]]) -> tuple[Arbiter, DecisionLog]:
    lg = DecisionLog(tmp_path / "decisions.log", sync=True)
    a = Arbiter(lg, trio.current_time, in_thread=True)
    a.load()
    a.leading, a.epoch = True, 3
    append = lg.append

    def recorded(decisions: list[Any]) -> None:
        append(decisions)  # write + fsync, in the worker thread
        events.append(("synced", len(decisions)))

    lg.append = recorded  # type: ignore[method-assign]
    return a, lg


def acking(events: list[tuple[str, int]]) -> Link:
    def answer(body: dict[str, Any]) -> tuple[int, str, Any]:
        events.append(("replicated", len(body.get("decisions", body.get("snapshot", [])))))
        return 200, "OK", True

    return Link(answer, delay=0.5)


async def test_concurrent_proposals_share_one_fsync_and_one_replication(
    tmp_path: Path, autojump_clock: Any
) -> None:
    events: list[tuple[str, int]] = []
    a, lg = durable_leader(tmp_path, events)
    link = acking(events)
    keys = [f"g{i}.q" for i in range(10)]
    answers: dict[str, tuple[str, bool]] = {}

    async def propose(key: str) -> None:
        b, accepted = await a.propose(key, "node2", "q")
        assert b.ready.is_set() and not b.failed
        answers[key] = (b.node, accepted)
        events.append(("answer", 1))

    async with trio.open_nursery() as n:
        link.nursery = n
        n.start_soon(a.run)
        r, _ = replicator(a, link)
        r.set_target("node2")
        async with trio.open_nursery() as proposers:
            for k in keys:
                proposers.start_soon(propose, k)
        n.cancel_scope.cancel()

    assert answers == {k: ("node2", True) for k in keys}
    assert lg.syncs == 1 and lg.appended == 10  # one append, one fsync for all ten
    assert a.batches == 1 and a.largest_batch == 10
    decision_msgs = [m for m in link.sent if "decisions" in m]
    assert len(decision_msgs) == 1 and r.messages == 1 and len(link.sent) == 2  # + snapshot
    assert sorted(d["key"] for d in decision_msgs[0]["decisions"]) == sorted(keys)
    # every answer after the batch's fsync and after the backup acknowledged it
    assert events[:3] == [("synced", 10), ("replicated", 0), ("replicated", 10)]
    assert events[3:] == [("answer", 1)] * 10
    # what was synced is what a restart loads
    lg.close()
    reloaded = DecisionLog(tmp_path / "decisions.log", sync=False)
    assert set(reloaded.load()) == set(keys)
    reloaded.close()


async def test_proposals_during_a_commit_form_the_next_batch(
    tmp_path: Path, autojump_clock: Any
) -> None:
    events: list[tuple[str, int]] = []
    a, lg = durable_leader(tmp_path, events)
    link = acking(events)
    answered: list[str] = []
    first_sent = trio.Event()
    send = link.send

    def send_and_note(peer: str, body: dict[str, Any], on_answer: Any) -> bool:
        ok = send(peer, body, on_answer)
        first_sent.set()
        return ok

    link.send = send_and_note  # type: ignore[method-assign]

    async def propose(key: str) -> None:
        await a.propose(key, "node1", "q")
        answered.append(key)
        events.append((key.rstrip("0123456789.q"), 1))

    async with trio.open_nursery() as n:
        link.nursery = n
        n.start_soon(a.run)
        r, _ = replicator(a, link)
        r.set_target("node2")
        r.synced = ("node2", 3)  # backup already in sync: no snapshot
        async with trio.open_nursery() as proposers:
            for i in range(3):
                proposers.start_soon(propose, f"first{i}.q")
            # the first batch is synced and sent, waiting for the backup's answer (no
            # trio deadline: the fsync runs in a thread, which the autojump clock does
            # not wait for; the module's pytest timeout bounds the wait)
            await first_sent.wait()
            assert len(link.sent) == 1 and a.batches == 0 and not answered
            for i in range(4):
                proposers.start_soon(propose, f"second{i}.q")
        n.cancel_scope.cancel()

    assert lg.syncs == 2 and a.batches == 2 and a.largest_batch == 4
    assert [len(m["decisions"]) for m in link.sent] == [3, 4]
    lg.close()
    # each batch answered only after its own fsync and its own acknowledgement
    assert events == [
        ("synced", 3),
        ("replicated", 3),
        *[("first", 1)] * 3,
        ("synced", 4),
        ("replicated", 4),
        *[("second", 1)] * 4,
    ]


async def test_a_fenced_batch_fails_as_a_whole(tmp_path: Path, autojump_clock: Any) -> None:
    events: list[tuple[str, int]] = []
    a, lg = durable_leader(tmp_path, events)
    link = Link(lambda body: (409, "stale arbiter epoch", {"epoch": 4}))
    refused: list[str] = []

    async def propose(key: str) -> None:
        try:
            await a.propose(key, "node1", "q")
        except NotArbiter:
            refused.append(key)

    async with trio.open_nursery() as n:
        link.nursery = n
        n.start_soon(a.run)
        r, fenced = replicator(a, link)
        r.set_target("node2")
        r.synced = ("node2", 3)
        async with trio.open_nursery() as proposers:
            for i in range(3):
                proposers.start_soon(propose, f"g{i}.q")
        n.cancel_scope.cancel()
    assert sorted(refused) == ["g0.q", "g1.q", "g2.q"] and fenced == [4]
    lg.close()
    assert a.bindings == {} and lg.syncs == 1 and not a.leading


async def test_propose_soon_answers_from_the_committer(tmp_path: Path, autojump_clock: Any) -> None:
    """The task-free proposal path of the management node (`Arbiter.propose_soon`):
    answered by the committer once the batch is synced and replicated, in the same
    batch as concurrent `propose` calls; at once for a decided key; never for a fenced
    batch (the binding says failed)."""
    events: list[tuple[str, int]] = []
    a, lg = durable_leader(tmp_path, events)
    link = acking(events)
    answers: list[tuple[str, str, bool, bool]] = []
    counted = {3: trio.Event(), 5: trio.Event()}

    def answer(b: Any, accepted: bool) -> None:
        assert b.ready.is_set()
        answers.append((b.key, b.node, accepted, b.failed))
        events.append(("answer", 1))
        if len(answers) in counted:
            counted[len(answers)].set()

    async with trio.open_nursery() as n:
        link.nursery = n
        n.start_soon(a.run)
        r, _ = replicator(a, link)
        r.set_target("node2")
        r.synced = ("node2", 3)
        assert a.propose_soon("g1.q", "node2", "q", answer)
        assert a.propose_soon("g1.q", "node3", "q", answer)  # same key, same batch
        assert a.propose_soon("g2.q", "node3", "q", answer)
        assert answers == []  # nothing before the batch is durable
        await counted[3].wait()  # the fsync runs in a real worker thread
        assert events == [("synced", 2), ("replicated", 2), *[("answer", 1)] * 3]
        assert answers == [
            ("g1.q", "node2", True, False),
            ("g1.q", "node2", False, False),  # the first proposal's binding
            ("g2.q", "node3", True, False),
        ]
        assert a.propose_soon("g2.q", "node1", "q", answer)  # decided: answered at once
        assert answers[-1] == ("g2.q", "node3", False, False) and lg.syncs == 1
        # a fenced batch: every waiting answer sees a failed binding, none is bound
        link.answer = lambda body: (409, "stale arbiter epoch", {"epoch": 4})
        assert a.propose_soon("g3.q", "node2", "q", answer)
        await counted[5].wait()
        assert answers[-1] == ("g3.q", "node2", True, True) and "g3.q" not in a.bindings
        assert not a.propose_soon("g4.q", "node2", "q", answer)  # not leading any more
        n.cancel_scope.cancel()
    lg.close()
