"""group-timeout and the reaper under clustering (GROUPING 7.7), in process.

Three whole brokers on real sockets in the test's trio run (`start_cluster`), with
short settings: the arbiter (node1) expires a binding unused for
`grouping_group_timeout` = 1500 ms at its next sweep (`grouping_reaper_period` =
200 ms); the REMOTE nodes refresh a group they use every half their own 700 ms.

* An idle group expires on the arbiter no earlier than the group timeout after its
  last use, is un-proposed on every node (the REMOTE caches drop it), and its next
  message is proposed afresh and may land on another queue instance.
* A group kept in use through a REMOTE node is refreshed on the arbiter and never
  expires while in use (its binding stays the same object for several group
  timeouts); once the messages stop, it expires.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.cluster.test_grouping_release import gmsg, node, start_cluster, until
from tests.conftest import BrokerFactory, ClientFactory

pytestmark = pytest.mark.timeout(60)

ARBITER = {"grouping_group_timeout": 1500, "grouping_reaper_period": 200}
REMOTE = {"grouping_group_timeout": 700}
NODES = {"node1": ARBITER, "node2": REMOTE, "node3": REMOTE}


async def test_an_idle_group_expires_everywhere_and_is_proposed_afresh(
    make_broker: BrokerFactory, client: ClientFactory, tmp_path: Path
) -> None:
    apps = await start_cluster(make_broker, tmp_path, NODES)
    n1, n2, n3 = (node(apps[n]) for n in ("node1", "node2", "node3"))
    c2 = await client(apps["node2"])
    r2 = await c2.receiver("orders", credit=100)
    await until(lambda: n3.peers["node2"].topology.get("orders", 0) > 0)
    s2 = await c2.sender("orders")
    c3 = await client(apps["node3"])
    s3 = await c3.sender("orders")
    t_before = trio.current_time()
    await s3.send_many([gmsg("g", k) for k in range(2)])  # node3: no consumer -> node2
    await s2.send(gmsg("g", 2))
    got = await r2.receive_n(3)
    assert [m.body for m in got] == ["g:0", "g:1", "g:2"]
    for m in got:
        r2.accept(m)
    assert n1.arbiter.bindings["g.orders"].node == "node2"
    assert n2._cache["g.orders"].node == "node2" and n3._cache["g.orders"].node == "node2"

    await until(lambda: "g.orders" not in n1.arbiter.bindings)
    expired_after = trio.current_time() - t_before
    assert expired_after >= 1.5  # not before grouping_group_timeout of no use
    assert expired_after < 1.5 + 0.2 + 2.0  # the next sweeps (generous: a loaded machine)
    # un-proposed on every node: the REMOTE caches drop the answer
    await until(lambda: "g.orders" not in n2._cache and "g.orders" not in n3._cache)

    # proposed afresh: node3 now has a consumer (local first), so the group moves there
    r3 = await c3.receiver("orders", credit=100)
    await s3.send(gmsg("g", 3))
    assert (await r3.receive()).body == "g:3"
    assert n1.arbiter.bindings["g.orders"].node == "node3"
    assert n3._cache["g.orders"].node == "node3"
    await r2.expect_none(0.2)


async def test_a_group_in_use_through_a_remote_is_refreshed_and_never_expires(
    make_broker: BrokerFactory, client: ClientFactory, tmp_path: Path
) -> None:
    apps = await start_cluster(make_broker, tmp_path, NODES)
    n1, n3 = node(apps["node1"]), node(apps["node3"])
    c2 = await client(apps["node2"])
    r2 = await c2.receiver("orders", credit=100)
    await until(lambda: n3.peers["node2"].topology.get("orders", 0) > 0)
    c3 = await client(apps["node3"])
    s3 = await c3.sender("orders")
    await s3.send(gmsg("h", 0))
    binding = n1.arbiter.bindings["h.orders"]
    assert binding.node == "node2"
    sent = 1
    t0 = trio.current_time()
    while trio.current_time() - t0 < 4.5:  # three arbiter group timeouts
        await trio.sleep(0.2)
        await s3.send(gmsg("h", sent))
        sent += 1
        assert n1.arbiter.bindings.get("h.orders") is binding  # never expired meanwhile
    bodies = [m.body for m in await r2.receive_n(sent)]
    assert bodies == [f"h:{k}" for k in range(sent)]  # one instance, in order
    assert trio.current_time() - binding.last_used < 1.0  # refreshed by node3

    # idle now: it expires (so the loop above could have failed without the refreshes)
    await until(lambda: "h.orders" not in n1.arbiter.bindings, timeout=6)
    await until(lambda: "h.orders" not in n3._cache)
