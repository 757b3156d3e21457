"""`amqbroker cluster status` against a running three-node cluster (issue 15).

The CLI runs in-process (click's CliRunner) on a worker thread; the cluster is three
real broker processes. node2's link to node3 goes through a TCP proxy the test cuts,
so the status shows one link down. The management node's `groupingBindings` asked on
a REMOTE node is relayed to the arbiter: the listing is cluster-wide.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner, Result
from proton import Message

from tests.cluster.cluster_helpers import Cluster, TcpProxy

pytestmark = pytest.mark.timeout(60)


async def cli(*args: str) -> Result:
    from amqbroker.cli import main

    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("AMQBROKER_")}
    runner = CliRunner()
    return await trio.to_thread.run_sync(lambda: runner.invoke(main, list(args), env=unset))


def url(c: Cluster, node: str) -> str:
    return f"amqp://127.0.0.1:{c.ports[node]}"


async def status_json(c: Cluster, node: str, *extra: str) -> dict[str, Any]:
    r = await cli("cluster", "status", "--url", url(c, node), "--json", *extra)
    assert r.exit_code == 0, r.output
    return dict(json.loads(r.output))


async def test_cluster_status_shows_nodes_links_arbiter_and_bindings(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    proxy = TcpProxy(cluster.ports["node3"])
    await nursery.start(proxy.run)
    cluster.peer_override[("node2", "node3")] = proxy.port
    await cluster.start()
    await cluster.wait_linked()

    # groups decided through node2 (a REMOTE): the arbiter on node1 holds them
    c3 = await cluster.connect("node3")
    await c3.receiver("orders", credit=100)
    await cluster.wait_announced("orders", {"node3": 1})
    c2 = await cluster.connect("node2")
    s2 = await c2.sender("orders")
    await s2.send_many([Message(body=f"{g}", group_id=g, durable=True) for g in ("a", "b")])

    for node in ("node1", "node2", "node3"):
        st = (await status_json(cluster, node))["status"]
        assert st["node"] == node
        assert st["arbiter"] == "node1" and st["epoch"] == 0
        assert st["isArbiter"] == (node == "node1")
        assert st["grouping"] == ("LOCAL" if node == "node1" else "REMOTE")
        assert {p["node"]: p["link"] for p in st["peers"]} == {
            n: "up" for n in ("node1", "node2", "node3") if n != node
        }

    # cluster-wide bindings, asked on a REMOTE node (relayed to the arbiter)
    both = await status_json(cluster, "node2", "--bindings")
    assert {(b["key"], b["node"], b["queue"]) for b in both["bindings"]} == {
        ("a.orders", "node3", "orders"),
        ("b.orders", "node3", "orders"),
    }

    # text output: the header line, one row per peer, the bindings table
    r = await cli("cluster", "status", "--url", url(cluster, "node2"), "--bindings")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("node node2 (grouping REMOTE); arbiter: node1, epoch 0")
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.startswith("node")}
    assert rows["node1"][2] == "up" and rows["node3"][2] == "up"
    assert any(ln.startswith("a.orders") and "node3" in ln for ln in lines), r.output

    # cut node2 -> node3: node2 reports that link down (with the reason), others up
    proxy.cut()
    with trio.fail_after(15):
        while True:
            st = (await status_json(cluster, "node2"))["status"]
            links = {p["node"]: p for p in st["peers"]}
            if links["node3"]["link"] == "down":
                break
            await trio.sleep(0.05)
    assert links["node1"]["link"] == "up"
    r = await cli("cluster", "status", "--url", url(cluster, "node2"))
    assert r.exit_code == 0, r.output
    row3 = next(ln for ln in r.output.splitlines() if ln.startswith("node3 "))
    assert row3.split()[2] == "down", r.output
    st1 = (await status_json(cluster, "node1"))["status"]
    assert {p["node"]: p["link"] for p in st1["peers"]} == {"node2": "up", "node3": "up"}

    proxy.restore()
    with trio.fail_after(15):
        while True:
            st = (await status_json(cluster, "node2"))["status"]
            if all(p["link"] == "up" for p in st["peers"]):
                break
            await trio.sleep(0.05)
    await c2.close()
    await c3.close()


async def test_cluster_status_of_an_unreachable_node_exits_2(cluster: Cluster) -> None:
    r = await cli("cluster", "status", "--url", url(cluster, "node1"))
    assert r.exit_code == 2, r.output


def test_a_node_with_cluster_zookeeper_but_no_kazoo_refuses_to_start(tmp_path: Path) -> None:
    """Issue 20: it used to start, log "listening" and lose its election thread to an
    ImportError traceback. The child blocks `import kazoo` as an uninstalled one."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['kazoo'] = None\n"
        "from amqbroker.cli import main\n"
        "sys.argv = ['amqbroker', 'run', '--port', '0', '--data-dir', sys.argv[1]]\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMQBROKER_")}
    env |= {
        "AMQBROKER_CLUSTER_NODE_ID": "node1",
        "AMQBROKER_CLUSTER_PEERS": "node2=127.0.0.1:1",
        "AMQBROKER_CLUSTER_GROUPING": "LOCAL",
        "AMQBROKER_CLUSTER_ZOOKEEPER": "127.0.0.1:1",
    }
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "data")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert p.returncode != 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert "kazoo" in lines[-1] and "not installed" in lines[-1], p.stderr
    assert "Traceback" not in p.stderr and "listening" not in p.stderr, p.stderr
