"""Operating a pair whose live member a real ZooKeeper decides, as real processes:
the live member's management broker entity (`haStatus`, asked over AMQP), `amqbroker
cluster status` (its output), the Prometheus metrics of both the live member and the
standby, and the role-change log lines; then the backup is killed and the live member
shows that it runs unreplicated (and takes the next epoch once it answers alone).
With ha_unreplicated = "refuse" the live member rejects durable sends while no backup
is in sync."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner, Result
from proton import Delivery, Message

from tests.client import Client
from tests.cluster.cluster_helpers import free_port
from tests.cluster.zk_harness import ZooKeeperServer, zk_path, zookeeper  # noqa: F401
from tests.ha.test_ha_processes import produce
from tests.ha.test_pair_takeover import NODE, WAIT, backup_in_sync, live, member_env, procs  # noqa: F401
from tests.integration import mgmt
from tests.integration.broker_process import BrokerProcess, BrokerProcesses
from tests.integration.test_telemetry import Scrape

pytestmark = pytest.mark.timeout(180)


async def spawn(
    procs: BrokerProcesses,  # noqa: F811
    role: str,
    data_dir: Path,
    port: int,
    metrics_port: int,
    zk: ZooKeeperServer,
    path: str,
) -> BrokerProcess:
    env = member_env(role, zk, path)
    env["AMQBROKER_METRICS_PROMETHEUS_PORT"] = str(metrics_port)
    return await procs.spawn(["run", "--port", str(port), "--data-dir", str(data_dir)], env=env)


async def ha_status(port: int, nursery: trio.Nursery) -> dict[str, Any]:
    c = await Client.connect(port, nursery=nursery)
    try:
        a = await mgmt.request(c, "haStatus", "amqbroker", type="org.amqbroker.broker")
    finally:
        c.abort()
    assert a.status == 200, a
    assert isinstance(a.body, dict)
    return a.body


async def until_status(port: int, nursery: trio.Nursery, pred: Any) -> dict[str, Any]:
    """Another process's state, seen only by asking it: polled, bounded."""
    with trio.fail_after(WAIT):
        while not pred(st := await ha_status(port, nursery)):  # noqa: ASYNC110
            await trio.sleep(0.1)
    return st


async def cli(*args: str) -> Result:
    from amqbroker.cli import main

    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("AMQBROKER_")}
    runner = CliRunner()
    return await trio.to_thread.run_sync(lambda: runner.invoke(main, list(args), env=unset))


async def scrape(port: int) -> Scrape:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            body: bytes = r.read()
            return body.decode()

    return Scrape(await trio.to_thread.run_sync(get))


async def test_status_metrics_and_log_lines_of_a_pair_then_the_backup_dies(
    procs: BrokerProcesses,  # noqa: F811
    tmp_path: Path,
    nursery: trio.Nursery,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> None:
    p_port, b_port, pm_port, bm_port = free_port(), free_port(), free_port(), free_port()
    p_id, b_id = f"{NODE}@127.0.0.1:{p_port}", f"{NODE}@127.0.0.1:{b_port}"
    primary = await spawn(procs, "primary", tmp_path / "a", p_port, pm_port, zookeeper, zk_path)
    await live(primary, p_port, 1)
    backup = await spawn(procs, "backup", tmp_path / "b", b_port, bm_port, zookeeper, zk_path)
    await backup_in_sync(backup, 1)
    await primary.wait_for_line(r"HA primary: backup at .* is in sync", timeout=WAIT)

    # the log: one line per role change, with its reason
    await primary.wait_for_line(
        r"member .* is now LIVE \(serving clients.*\), was waiting: the lease in ZooKeeper "
        r"made this member live, epoch 1",
        timeout=WAIT,
    )
    await backup.wait_for_line(
        rf"is now MIRRORING \(standby.*\), was waiting: another member is live at "
        rf"127\.0\.0\.1:{p_port}, epoch 1",
        timeout=WAIT,
    )
    await backup.wait_for_line(
        r"is now SYNCED \(standby: its copy is complete.*for epoch 1", timeout=WAIT
    )

    # the management broker entity, over AMQP (the lease's view of the backup follows)
    st = await until_status(p_port, nursery, lambda s: s["backups"] == [b_id])
    assert st["role"] == "primary" and st["node"] == NODE and st["member"] == p_id
    assert st["liveMember"] == p_id and st["liveAddress"] == f"127.0.0.1:{p_port}"
    assert st["epoch"] == 1 and st["memberState"] == "live"
    assert st["inSync"] and st["backupState"] == "in-sync" and not st["unreplicated"]
    assert st["fullSyncs"] == 1 and st["drops"] == 0
    assert st["lagRecords"] >= 0 and st["lagBytes"] >= 0

    # amqbroker cluster status: text and JSON
    r = await cli("cluster", "status", "--url", f"amqp://127.0.0.1:{p_port}")
    assert r.exit_code == 0, (r.output, r.exception)
    out = r.stdout
    assert f"HA pair {NODE}: live {p_id} at 127.0.0.1:{p_port}, epoch 1" in out, out
    assert f"backup member(s): {b_id}" in out, out
    assert "backup in-sync" in out and "IN SYNC; lag " in out, out
    assert "full syncs 1, drops 0" in out, out
    assert "replicated: every store cycle waits for the backup" in out, out
    assert "not a cluster node" in out, out
    r = await cli("cluster", "status", "--url", f"amqp://127.0.0.1:{p_port}", "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["status"] is None and got["ha"]["liveMember"] == p_id

    # metrics: the live member and the standby (whose telemetry runs while it mirrors)
    m = await scrape(pm_port)
    labels = {"node": NODE, "member": p_id}
    assert m.value("amqbroker_ha_role", role="primary", **labels) == 1
    assert m.value("amqbroker_ha_epoch", **labels) == 1
    assert m.value("amqbroker_ha_in_sync", **labels) == 1
    assert m.value("amqbroker_ha_unreplicated", **labels) == 0
    assert m.value("amqbroker_ha_full_syncs_total", **labels) == 1
    assert m.value("amqbroker_ha_drops_total", **labels) == 0
    m = await scrape(bm_port)
    labels = {"node": NODE, "member": b_id}
    assert m.value("amqbroker_ha_role", role="backup", **labels) == 1
    assert m.value("amqbroker_ha_in_sync", **labels) == 1
    assert m.value("amqbroker_ha_epoch", **labels) == 1
    assert m.value("amqbroker_ha_lag_records", **labels) >= 0
    assert "amqbroker_queue_messages" not in m.names()  # no broker runs on a standby

    # the backup dies: the live member says it runs unreplicated, and once it answers
    # alone it has taken the next epoch
    await backup.crash()
    st = await until_status(p_port, nursery, lambda s: s["unreplicated"])
    assert not st["inSync"] and st["backupState"] == "none" and not st["refusingDurable"]
    accepted: list[int] = []
    await produce(p_port, nursery, 0, 10, accepted)
    assert accepted == list(range(10))
    st = await until_status(p_port, nursery, lambda s: s["epoch"] == 2)
    assert st["liveMember"] == p_id
    # the dead backup stays listed as eligible until ZooKeeper expires its session
    await until_status(p_port, nursery, lambda s: s["backups"] == [])
    r = await cli("cluster", "status", "--url", f"amqp://127.0.0.1:{p_port}")
    assert r.exit_code == 0, r.output
    assert "UNREPLICATED: no backup in sync; answering alone" in r.stdout, r.stdout
    assert f"live {p_id} at 127.0.0.1:{p_port}, epoch 2" in r.stdout, r.stdout
    m = await scrape(pm_port)
    assert m.value("amqbroker_ha_unreplicated", node=NODE, member=p_id) == 1
    assert m.value("amqbroker_ha_epoch", node=NODE, member=p_id) == 2
    assert await primary.stop() == 0


async def test_refuse_mode_in_a_pair(
    procs: BrokerProcesses,  # noqa: F811
    tmp_path: Path,
    nursery: trio.Nursery,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> None:
    """ha_unreplicated = "refuse": the live member rejects durable sends until its
    backup is in sync, accepts them while it is, and rejects them again once it died."""
    p_port, b_port = free_port(), free_port()
    env = {"AMQBROKER_HA_UNREPLICATED": "refuse"}
    primary = await procs.spawn(
        ["run", "--port", str(p_port), "--data-dir", str(tmp_path / "a")],
        env={**member_env("primary", zookeeper, zk_path), **env},
    )
    await live(primary, p_port, 1)
    assert await durable_send(p_port, nursery) == "refused"
    st = await ha_status(p_port, nursery)
    assert st["refusingDurable"] and st["unreplicatedPolicy"] == "refuse"
    # (the refused send still made a store cycle, its queue's creation: answered
    # alone, it takes the next epoch: the backup syncs at 1 or 2)
    backup = await procs.spawn(
        ["run", "--port", str(b_port), "--data-dir", str(tmp_path / "b")],
        env={**member_env("backup", zookeeper, zk_path), **env},
    )
    await backup.wait_for_line(r"HA backup: in sync with the primary", timeout=WAIT)
    await until_status(p_port, nursery, lambda s: s["inSync"] and not s["refusingDurable"])
    assert await durable_send(p_port, nursery) == "accepted"
    await backup.crash()
    await until_status(p_port, nursery, lambda s: s["refusingDurable"])
    assert await durable_send(p_port, nursery) == "refused"
    await primary.wait_for_line(r"durable sends are refused", timeout=WAIT)
    assert await primary.stop() == 0


async def durable_send(port: int, nursery: trio.Nursery) -> str:
    c = await Client.connect(port, nursery=nursery)
    try:
        s = await c.sender("orders")
        d = await s.send(Message(body="x", durable=True), timeout=WAIT)
    finally:
        c.abort()
    if d.remote_state == Delivery.ACCEPTED:
        return "accepted"
    cond = d.remote.condition
    assert d.remote_state == Delivery.REJECTED and cond is not None, d.remote_state
    assert cond.name == "amqp:resource-limit-exceeded", cond
    assert "no backup is in sync" in (cond.description or ""), cond
    return "refused"
