"""The `$cluster.inbound` link reads envelopes of every version (issue 20).

Since issue 20 the entry node writes the forwarding envelope byte by byte (one data
section holding the original message); earlier versions let proton encode it (an
amqp-value binary and an empty properties section). A node must unwrap both, so a
cluster can be upgraded one node at a time, and deliver the original bytes unchanged.
"""

from __future__ import annotations

import pytest
from proton import Delivery, Message, symbol

from amqbroker.protocol.peer import BRIDGE_ID, BRIDGE_TARGET
from tests.cluster.cluster_helpers import Cluster

pytestmark = pytest.mark.timeout(60)


def envelope(inner: bytes, bridge_id: str, *, data_section: bool) -> Message:
    """What a peer sends: proton's encoding (earlier versions) or a data section."""
    m = Message(body=inner, inferred=data_section, durable=True)
    m.annotations = {symbol(BRIDGE_ID): bridge_id, symbol(BRIDGE_TARGET): "orders"}
    return m


async def test_old_and_new_envelopes_deliver_the_original_bytes_once(cluster: Cluster) -> None:
    await cluster.start()
    await cluster.wait_linked()
    consumer_client = await cluster.connect("node1")
    r = await consumer_client.receiver("orders", credit=100)
    peer = await cluster.connect("node1")  # stands in for node2's bridge
    s = await peer.sender("$cluster.inbound")
    inners = [
        bytes(Message(body=f"m{i}" * (i * 100), group_id="g", durable=True, id=f"id-{i}").encode())
        for i in range(4)
    ]
    sent = await s.send_many(
        [
            envelope(inners[0], "node2:boot:1", data_section=False),  # proton, amqp-value
            envelope(inners[1], "node2:boot:2", data_section=True),  # data section
            envelope(inners[1], "node2:boot:2", data_section=True),  # a resend: dropped
            envelope(inners[2], "node2:boot:3", data_section=True),  # vbin32
            envelope(inners[3], "node3:boot:2", data_section=False),  # other node's ids
        ]
    )
    assert [d.remote_state for d in sent] == [Delivery.ACCEPTED] * 5
    got = await r.receive_n(4)
    assert [m.raw for m in got] == inners
    await r.expect_none(0.3)

    bad = Message(body="not an envelope")
    bad.annotations = {symbol(BRIDGE_ID): "node2:boot:4", symbol(BRIDGE_TARGET): "orders"}
    (d,) = await s.send_many([bad])
    assert d.remote_state == Delivery.REJECTED
    assert d.remote.condition.name == "amqp:decode-error"
    assert "data section" in d.remote.condition.description
    for c in (consumer_client, peer):
        await c.close()
