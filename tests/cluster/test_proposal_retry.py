"""A proposal answered 503 ("not the arbiter") is sent again (`routing.Routing`).

An election's views reach the nodes in any order: an entry node may learn that node2
is the new arbiter, send it a proposal, and get 503 because node2 has not learned it
yet. No later arbiter change comes to re-send it, so before this the proposal waited
for its whole `grouping_timeout` and the send was rejected (seen once in about 25 runs
of `test_failover.py`'s SIGKILL test). In process, with the autojump clock: a recording
link in place of the peer connection.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio

from amqbroker.cluster.arbiter import Arbiter, ArbiterRole
from amqbroker.cluster.routing import Routing
from amqbroker.cluster.topology import NodeContext
from amqbroker.protocol.peer import PeerMessage
from amqbroker.settings import Settings

pytestmark = pytest.mark.timeout(30)


class Links:
    """Records each request and its answer callback."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any], Any]] = []
        self.changed = trio.Event()

    def request(
        self,
        p: Any,
        operation: str,
        typ: str,
        body: Any,
        on_answer: Any = None,
        msg_id: str | None = None,
    ) -> bool:
        self.sent.append((p.node_id, body, on_answer))
        self.changed.set()
        self.changed = trio.Event()
        return True

    async def wait_sent(self, n: int) -> None:
        while len(self.sent) < n:
            await self.changed.wait()


class Tasks:
    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery

    def spawn(self, fn: Any, *args: Any) -> bool:
        self.nursery.start_soon(fn, *args)
        return True

    def flush(self) -> None:
        pass


def answer(status: int, body: Any = None, why: str = "") -> PeerMessage:
    return PeerMessage(properties={"statusCode": status, "statusDescription": why}, body=body)


def routing_on(node: str, nursery: trio.Nursery, links: Links) -> tuple[Routing, ArbiterRole]:
    settings = Settings(cluster_node_id=node, cluster_reconnect_initial=0.2)
    arbiter = Arbiter(None, trio.current_time)
    role = ArbiterRole(node, arbiter)
    role.become_follower("node2", 2)  # this node already knows node2 leads epoch 2
    ctx = NodeContext(settings, cast(Any, None), node, "boot", role, arbiter, Tasks(nursery))
    peers = {p: cast(Any, SimpleNamespace(node_id=p)) for p in ("node1", "node2")}
    return Routing(ctx, peers, {}, links), role


async def test_a_503_from_an_arbiter_that_does_not_know_it_leads_yet_is_sent_again(
    autojump_clock: Any,
) -> None:
    links = Links()
    got: list[str] = []
    async with trio.open_nursery() as n:
        routing, _ = routing_on("node3", n, links)

        async def propose() -> None:
            got.append(await routing.propose("g.orders", "node3", "orders"))

        n.start_soon(propose)
        with trio.fail_after(5):
            await links.wait_sent(1)
            peer, body, on_answer = links.sent[0]
            assert (peer, body) == (
                "node2",
                {"key": "g.orders", "node": "node3", "queue": "orders"},
            )
            t0 = trio.current_time()
            on_answer(
                answer(503, why="this node is not the grouping arbiter; the arbiter is node1")
            )
            # no arbiter change follows (this node knew node2 already): sent again
            await links.wait_sent(2)
        assert trio.current_time() - t0 == pytest.approx(0.2)  # cluster_reconnect_initial
        assert links.sent[1][:2] == links.sent[0][:2]
        links.sent[1][2](answer(200, {"node": "node3", "queue": "orders", "epoch": 2}))
    assert got == ["node3"]
    assert routing.cache["g.orders"].node == "node3"
    assert not routing.outstanding


async def test_other_refusals_and_answered_proposals_are_not_sent_again(
    autojump_clock: Any,
) -> None:
    links = Links()
    async with trio.open_nursery() as n:
        routing, role = routing_on("node3", n, links)
        n.start_soon(routing.propose, "g.orders", "node3", "orders")
        await links.wait_sent(1)
        links.sent[0][2](answer(400, why="groupingPropose needs a map body"))
        await trio.sleep(5)
        assert len(links.sent) == 1  # a 400 is not a timing matter: not retried
        # a 503 whose retry finds the proposal answered meanwhile sends nothing
        role.become_follower("node1", 3)  # a new arbiter: re-sent by the role change
        routing.resend_proposals()
        assert len(links.sent) == 2
        links.sent[1][2](answer(503, why="this node is not the grouping arbiter"))
        links.sent[1][2](answer(200, {"node": "node3", "queue": "orders", "epoch": 3}))
        await trio.sleep(5)
        assert len(links.sent) == 2
        n.cancel_scope.cancel()
