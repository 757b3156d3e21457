"""The delivery log under clustering: a message forwarded to another node's queue
instance is recorded as `forwarded` on the entry node (with its own id and group, and
the target as "<node>/<queue>") and delivered and settled on the owning node; records
carry the arbiter's epoch (0 for the static arbiter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from amqbroker.app import BrokerApp
from amqbroker.pipeline.delivery_log_format import EVENTS
from tests.cluster.test_grouping_release import gmsg, node, start_cluster, until
from tests.conftest import BrokerFactory, ClientFactory

pytestmark = pytest.mark.timeout(60)

LOG = {"delivery_log": True, "delivery_log_format": "jsonl", "delivery_log_flush_interval": 0.05}


async def test_forwarded_messages_are_logged_on_both_nodes(
    make_broker: BrokerFactory, client: ClientFactory, tmp_path: Path
) -> None:
    assert "forwarded" in EVENTS
    nodes = {n: {**LOG, "node_id": n} for n in ("node1", "node2", "node3")}
    apps = await start_cluster(make_broker, tmp_path, nodes)
    n3 = node(apps["node3"])
    c2 = await client(apps["node2"])
    r2 = await c2.receiver("orders", credit=100)
    await until(lambda: n3.peers["node2"].topology.get("orders", 0) > 0)
    c3 = await client(apps["node3"])
    s3 = await c3.sender("orders")
    await s3.send_many([gmsg("g", k) for k in range(3)])  # node3 has no consumer -> node2
    got = await r2.receive_n(3)
    for m in got:
        r2.accept(m)
    assert [m.body for m in got] == ["g:0", "g:1", "g:2"]

    def records(app_name: str) -> list[dict[str, object]]:
        return _records(apps[app_name])

    def have(app_name: str, event: str, n: int) -> bool:
        return sum(1 for r in records(app_name) if r["event"] == event) >= n

    def settled_g() -> list[dict[str, object]]:
        return [
            r
            for r in records("node2")
            if r["event"] == "settled" and r["queue"] == "orders" and r["group_id"] == "g"
        ]

    # wait for the very records checked below (node2 logs settlements of other queues
    # too, which used to satisfy a looser wait before these were written)
    await until(lambda: have("node3", "forwarded", 3) and len(settled_g()) >= 3)
    fwd = [r for r in records("node3") if r["event"] == "forwarded"]
    assert [r["group_id"] for r in fwd] == ["g", "g", "g"]
    assert {r["queue"] for r in fwd} == {"node2/orders"}
    assert all(r["owner_epoch"] == 0 for r in fwd)  # static arbiter
    assert [r["outcome"] for r in settled_g()] == ["accepted"] * 3


def _records(app: BrokerApp) -> list[dict[str, object]]:
    """Every complete line written so far (the current file is still in progress)."""
    d = app.dlog.directory if app.dlog is not None else None
    assert d is not None
    rows: list[dict[str, object]] = []
    for p in sorted(d.glob("part-*")):
        text = p.read_text()
        rows.extend(json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines())
    return rows
