"""Operating a pair (issue 23, "Operating it"), with two in-process brokers on real
sockets: the management broker entity's `haStatus` (and its READ's `ha` map) as the
primary's replication changes, and ``ha_unreplicated = "refuse"``: durable sends are
rejected (amqp:resource-limit-exceeded) while no backup is in sync, accepted once one
is, rejected again when it goes; non-durable sends always go through. A standby's
telemetry exports the HA metrics, and its broker, once promoted, binds the same
Prometheus port."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Delivery, Message

from amqbroker.app import BrokerApp
from amqbroker.ha.primary import REFUSED
from tests.client import Client, wait_until
from tests.cluster.cluster_helpers import free_port
from tests.ha.test_full_sync import settings, start
from tests.ha.test_pair_ops import scrape
from tests.integration import mgmt


async def ha_status(c: Client) -> dict[str, Any]:
    a = await mgmt.request(c, "haStatus", "amqbroker", type="org.amqbroker.broker")
    assert a.status == 200, a
    assert isinstance(a.body, dict)
    return a.body


async def send(c: Client, durable: bool) -> Delivery:
    s = await c.sender("orders")
    d = await s.send(Message(body="x", durable=durable))
    await s.close()
    return d


def refused(d: Delivery) -> bool:
    cond = d.remote.condition
    return (
        d.remote_state == Delivery.REJECTED
        and cond is not None
        and cond.name == "amqp:resource-limit-exceeded"
        and "no backup is in sync" in (cond.description or "")
    )


async def test_refuse_mode_rejects_durable_sends_until_a_backup_is_in_sync(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="amqbroker.ha.primary")
    async with trio.open_nursery() as n:
        primary = BrokerApp(settings(tmp_path / "p", ha_role="primary", ha_unreplicated="refuse"))
        _, primary_done = await start(n, primary)
        port = primary.listening[0][1]
        c = await Client.connect(port, nursery=n)

        # no backup yet: durable refused, non-durable accepted
        assert refused(await send(c, durable=True))
        assert (await send(c, durable=False)).remote_state == Delivery.ACCEPTED
        st = await ha_status(c)
        assert st["role"] == "primary" and st["backupState"] == "none"
        assert st["unreplicated"] and not st["inSync"]
        assert st["unreplicatedPolicy"] == "refuse" and st["refusingDurable"]
        assert st["epoch"] is None and st["liveMember"] is None  # no lease here
        read = await mgmt.request(c, "READ", "amqbroker", type="org.amqbroker.broker")
        assert read.status == 200 and read.body["ha"]["refusingDurable"] is True

        backup = BrokerApp(
            settings(tmp_path / "b", ha_role="backup", ha_primary=f"127.0.0.1:{port}")
        )
        _, backup_done = await start(n, backup)
        assert primary.primary is not None
        with trio.fail_after(20):
            await primary.primary.synced.wait()
        assert (await send(c, durable=True)).remote_state == Delivery.ACCEPTED
        assert "durable sends are accepted again" in caplog.text
        st = await ha_status(c)
        assert st["inSync"] and st["backupState"] == "in-sync" and not st["unreplicated"]
        assert not st["refusingDurable"]
        assert st["fullSyncs"] == 1 and st["drops"] == 0
        # every cycle was acknowledged before the send was answered
        assert st["lagRecords"] == 0 and st["lagBytes"] == 0
        assert st["backup"]  # the backup's connection
        assert st["snapshotTotal"] == st["snapshotBytes"] > 0

        # the backup goes: refused again
        backup.request_shutdown()
        with trio.fail_after(10):
            await backup_done.wait()
        await wait_until(lambda: primary.broker is not None and primary.broker.durable_refused)
        assert primary.broker is not None and primary.broker.durable_refused == REFUSED
        assert refused(await send(c, durable=True))
        st = await ha_status(c)
        assert st["unreplicated"] and st["refusingDurable"] and st["backupState"] == "none"
        assert caplog.text.count("durable sends are refused") == 2  # at start, and now
        c.abort()
        primary.request_shutdown()
        with trio.fail_after(10):
            await primary_done.wait()
        n.cancel_scope.cancel()  # the aborted client's tasks


async def test_continue_mode_answers_alone_and_says_so(tmp_path: Path) -> None:
    async with trio.open_nursery() as n:
        primary = BrokerApp(settings(tmp_path / "p", ha_role="primary"))
        _, done = await start(n, primary)
        c = await Client.connect(primary.listening[0][1], nursery=n)
        assert (await send(c, durable=True)).remote_state == Delivery.ACCEPTED
        st = await ha_status(c)
        assert st["unreplicated"] and not st["refusingDurable"]
        assert st["unreplicatedPolicy"] == "continue"
        c.abort()
        primary.request_shutdown()
        with trio.fail_after(10):
            await done.wait()
        n.cancel_scope.cancel()  # the aborted client's tasks


async def test_a_broker_without_ha_answers_an_empty_role(tmp_path: Path) -> None:
    async with trio.open_nursery() as n:
        app = BrokerApp(settings(tmp_path / "p"))
        _, done = await start(n, app)
        c = await Client.connect(app.listening[0][1], nursery=n)
        assert await ha_status(c) == {"role": ""}
        read = await mgmt.request(c, "READ", "amqbroker", type="org.amqbroker.broker")
        assert read.status == 200 and read.body["ha"] is None
        c.abort()
        app.request_shutdown()
        with trio.fail_after(10):
            await done.wait()
        n.cancel_scope.cancel()  # the aborted client's tasks


async def test_a_standby_exports_ha_metrics_and_its_promoted_broker_binds_the_same_port(
    tmp_path: Path,
) -> None:
    metrics_port = free_port()
    async with trio.open_nursery() as n:
        primary = BrokerApp(settings(tmp_path / "p", ha_role="primary"))
        _, primary_done = await start(n, primary)
        port = primary.listening[0][1]
        backup = BrokerApp(
            settings(
                tmp_path / "b",
                ha_role="backup",
                ha_primary=f"127.0.0.1:{port}",
                metrics_prometheus_port=metrics_port,
            )
        )
        backup_listening, backup_done = await start(n, backup)
        assert primary.primary is not None
        await wait_until(lambda: backup.mirror is not None and backup.mirror.in_sync, 20)
        m = await scrape(metrics_port)
        assert m.value("amqbroker_ha_role", role="backup") == 1
        assert m.value("amqbroker_ha_in_sync") == 1
        primary.request_shutdown()
        with trio.fail_after(10):
            await primary_done.wait()
        backup.promote()
        with trio.fail_after(20):
            await backup_listening.wait()
        m = await scrape(metrics_port)
        assert m.value("amqbroker_ha_role", role="primary") == 1
        assert m.value("amqbroker_ha_unreplicated") == 1
        assert "amqbroker_store_size_bytes" in m.types  # the broker's own metrics too
        backup.request_shutdown()
        with trio.fail_after(10):
            await backup_done.wait()
