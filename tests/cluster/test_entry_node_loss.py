"""A producer whose entry node dies goes on through another node and never overtakes its
own earlier messages (issue 20, GROUPING 7.11).

Three real broker processes: the groups are bound to node3 (the only consumer); the
producer enters through node2, whose link to node3 goes through a proxy. The proxy
stalls the link (bytes held, connections open: a congested or hung link), the producer
sends a few more rounds, node2 is SIGKILLed, the producer reconnects to node1 and sends
again, in order, every message node2 had not answered `accepted`, then the rest. node2
is restarted later and forwards what its bridge kept.

With `cluster_accept_after_forward` (the default) node2 answers a grouped message only
once node3 has it, so nothing the producer was told accepted is left in node2's bridge:
first deliveries at node3 are in order per group, and node2's copies of the unanswered
messages arrive later as repeats (at least once). With it off, node2 answers once its
own bridge holds them, the producer moves on, and the messages it kept arrive after
newer ones: the test sees that order broken, which shows that it can fail.
"""

from __future__ import annotations

import pytest
import trio
from proton import Delivery, Message

from tests.client import ClientError, wait_until
from tests.cluster.cluster_helpers import (
    CLEAN,
    Cluster,
    Session,
    TcpProxy,
    audit,
    audit_reference,
    findings,
)

pytestmark = pytest.mark.timeout(400)

GROUPS = [f"g{i}" for i in range(6)]
ROUNDS = 30
STALL_AT = 8  # rounds answered before the stall
STALLED = 4  # rounds sent into the stalled link before node2 dies
WAIT = 30.0
PRODUCER = "moving-producer"


def body(g: str, k: int) -> str:
    return f"{g}:{k}"


def msg(b: str) -> Message:
    """The message with body `b`: its id is the body, as a JMS client's resend keeps
    its JMSMessageID, and its group-sequence the round."""
    g, k = b.split(":")
    return Message(id=b, body=b, group_id=g, group_sequence=int(k) + 1, durable=True)


async def peer_row(cluster: Cluster, node: str, peer: str) -> dict[str, object]:
    st = await cluster.status(node)
    return next(p for p in st["peers"] if p["node"] == peer)


async def run(
    cluster: Cluster, nursery: trio.Nursery, env: dict[str, str] | None = None
) -> tuple[Session, int]:
    """The scenario of the module docstring: the consumer's session and how many
    messages node2 had not answered when it died."""
    # the log is flushed every 0.2 s: a SIGKILL loses at most that much of it, and the
    # test waits longer before the kill, so the audit has node2's `received` records
    cluster.extra_env.update(
        {"AMQBROKER_DELIVERY_LOG": "true", "AMQBROKER_DELIVERY_LOG_FLUSH_INTERVAL": "0.2"}
        | (env or {})
    )
    proxy = TcpProxy(cluster.ports["node3"])
    await nursery.start(proxy.run)
    cluster.peer_override[("node2", "node3")] = proxy.port
    await cluster.start()
    await cluster.wait_linked()
    consumer = Session("node3")
    await nursery.start(consumer.run, cluster)
    await cluster.wait_announced("orders", {"node3": 1})

    todo = [body(g, k) for k in range(ROUNDS) for g in GROUPS]
    # one producer, one identity (container-id and link name) through both nodes, as
    # a failover client keeps them
    c = await cluster.connect("node2", container=PRODUCER)
    snd = await c.sender("orders", name="producer")
    first = [msg(b) for b in todo[: STALL_AT * 6]]
    ds = await snd.send_many(first, timeout=WAIT)
    assert all(d.remote_state == Delivery.ACCEPTED for d in ds)
    del todo[: len(first)]

    proxy.stall()
    stalled = todo[: STALLED * len(GROUPS)]
    del todo[: len(stalled)]
    sent = [(b, snd.send_nowait(msg(b))) for b in stalled]
    await c._flush()
    forwarded = int((await peer_row(cluster, "node2", "node3"))["forwarded"])
    with trio.fail_after(WAIT):  # node2 has routed every stalled message to its bridge
        while forwarded < len(first) + len(stalled):
            await trio.sleep(0.05)
            forwarded = int((await peer_row(cluster, "node2", "node3"))["forwarded"])
    # what node2 answers on its own (its store) has reached us, and its log is flushed
    await trio.sleep(0.6)
    cluster.proc["node2"].kill()
    await wait_until(lambda: c._dead, WAIT)
    unanswered = [b for b, d in sent if d.remote_state != Delivery.ACCEPTED]
    # the producer fails over to node1: first what node2 did not accept, in order
    c1 = await cluster.connect("node1", container=PRODUCER)
    s1 = await c1.sender("orders", name="producer")
    rest = [msg(b) for b in unanswered + todo]
    ds = await s1.send_many(rest, timeout=WAIT)
    assert all(d.remote_state == Delivery.ACCEPTED for d in ds)

    await cluster.start_node("node2")
    proxy.resume()
    want = {body(g, k) for k in range(ROUNDS) for g in GROUPS}
    await wait_until(lambda: want <= set(consumer.bodies), WAIT)
    with trio.fail_after(WAIT):  # node2's bridge has given node3 all it kept
        while True:
            try:
                row = await peer_row(cluster, "node2", "node3")
            except (ClientError, OSError, StopIteration):
                row = {}
            if row.get("link") == "up" and row.get("bridgeDepth") == 0:
                break
            await trio.sleep(0.05)
    await trio.sleep(0.3)
    for cl in (c, c1):
        cl.abort()
    if consumer.client is not None:
        consumer.client.abort()
    for n in ("node1", "node2", "node3"):  # the delivery logs flushed
        await cluster.proc[n].stop()
    return consumer, len(unanswered)


def order_violations(bodies: list[str]) -> list[str]:
    last: dict[str, int] = {}
    seen: set[str] = set()
    bad = []
    for b in bodies:
        if b in seen:
            continue  # a repeat, not a first delivery
        seen.add(b)
        g, k = b.split(":")
        if last.get(g, -1) > int(k):
            bad.append(f"{g}: seq {k} after {last[g]}")
        last[g] = max(last.get(g, -1), int(k))
    return bad


async def test_a_producer_moving_entry_node_keeps_its_order(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    consumer, unanswered = await run(cluster, nursery)
    assert order_violations(consumer.bodies) == []
    # node2 could not answer the stalled messages: the producer sent them again
    assert unanswered == STALLED * len(GROUPS), unanswered
    repeats = len(consumer.bodies) - len(set(consumer.bodies))
    assert repeats <= unanswered
    # the audit agrees: nothing lost, no order broken, one owner; the resent
    # messages (same message-id) that node2 also delivered when it came back are
    # duplicates, as at-least-once has them
    _, report = await audit(cluster)
    f = findings(report)
    assert {k: f[k] for k in CLEAN} == dict.fromkeys(CLEAN, 0), f
    assert f["received_twice"] <= unanswered, f


async def test_without_accept_after_forward_the_moved_producer_overtakes_itself(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    consumer, unanswered = await run(
        cluster, nursery, {"AMQBROKER_CLUSTER_ACCEPT_AFTER_FORWARD": "false"}
    )
    assert unanswered == 0  # answered from node2's own bridge
    assert order_violations(consumer.bodies), "the kept messages should arrive late"
    # and the audit sees it: the producer (one container-id and link name through
    # both nodes) had its newer messages consumed before older ones
    f = audit_reference(cluster)
    assert f["producer_order_across_entry_nodes"] > 0, f
    assert f["received_twice"] == 0, f
