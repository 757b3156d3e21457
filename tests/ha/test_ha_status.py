"""The operator's view of a pair (issue 23, "Operating it") without processes: the
report (`amqbroker.ha.status.report`) from a primary's and a backup's counters and the
lease, its metrics (through a real OpenTelemetry reader), the `cluster status` lines,
the settings, and the pair member's role-change log lines."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from pydantic import ValidationError

from amqbroker.cli.cluster import ha_lines
from amqbroker.ha import roles
from amqbroker.ha.status import LeaseStatus, report
from amqbroker.pair import REASON_TEXT, ROLE_TEXT, PairMember
from amqbroker.settings import Settings
from amqbroker.telemetry.metrics import HA_EXPORTED, HA_INSTRUMENTS, Metrics
from tests.unit.test_cluster_metrics import points

LEASE = LeaseStatus(
    node="node1",
    member="node1@127.0.0.1:5672",
    state="live",
    epoch=3,
    live_member="node1@127.0.0.1:5672",
    live_address="127.0.0.1:5672",
    members=("node1@127.0.0.1:5672", "node1@127.0.0.1:5673"),
    addresses=("127.0.0.1:5672", "127.0.0.1:5673"),
)

PRIMARY_STATUS: dict[str, Any] = {
    "role": "primary",
    "backup": "127.0.0.1:40001",
    "state": "catchup",
    "stream": "ab" * 16,
    "in_sync": False,
    "unreplicated": True,
    "queued_bytes": 300,
    "queued_records": 3,
    "unacked_bytes": 100,
    "unacked_records": 1,
    "lag_bytes": 400,
    "lag_records": 4,
    "snapshot_bytes": 10,
    "snapshot_total": 50,
    "full_syncs": 2,
    "dropped": 1,
}


def test_report_of_a_live_primary_with_a_lease() -> None:
    r = report(PRIMARY_STATUS, LEASE, "refuse", True)
    assert r["role"] == "primary" and r["node"] == "node1" and r["epoch"] == 3
    assert r["liveMember"] == LEASE.member and r["liveAddress"] == "127.0.0.1:5672"
    assert r["backups"] == ["node1@127.0.0.1:5673"]  # the eligible ones, not the live
    assert r["backup"] == "127.0.0.1:40001" and r["backupState"] == "catchup"
    assert not r["inSync"] and r["unreplicated"]
    assert (r["lagRecords"], r["lagBytes"]) == (4, 400)
    assert (r["fullSyncs"], r["drops"]) == (2, 1)
    assert r["unreplicatedPolicy"] == "refuse" and r["refusingDurable"]
    assert (r["snapshotBytes"], r["snapshotTotal"]) == (10, 50)


def test_report_of_a_backup_and_without_lease_or_ha() -> None:
    st = {
        "role": "backup",
        "primary": "127.0.0.1:5672",
        "connected": True,
        "in_sync": True,
        "epoch": 3,
        "lag_records": 7,
        "lag_bytes": 900,
        "resyncs": 1,
    }
    standby = LeaseStatus("node1", "node1@127.0.0.1:5673", "synced", 3, LEASE.member, "x:1")
    r = report(st, standby)
    assert r["role"] == "backup" and r["inSync"] and r["syncedEpoch"] == 3
    assert (r["lagRecords"], r["lagBytes"], r["fullSyncs"]) == (7, 900, 1)
    assert r["memberState"] == "synced" and not r["unreplicated"]
    bare = report({"role": "primary", **{k: v for k, v in PRIMARY_STATUS.items()}}, None)
    assert bare["epoch"] is None and bare["members"] == [] and bare["backups"] == []
    assert report({"role": ""}, None)["role"] == ""


def _metrics(ha: dict[str, Any] | None) -> tuple[Metrics, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    m = Metrics(
        MeterProvider(metric_readers=[reader]).get_meter("test"),
        broker=lambda: None,
        journal=lambda: None,
        connections=lambda: 0,
        clock=lambda: 0.0,
        top_groups=5,
        ha=lambda: ha,
    )
    return m, reader


def test_ha_metrics_only_with_ha_labelled_by_node_and_member() -> None:
    m, reader = _metrics({"role": ""})
    m.refresh()
    assert not any(name.startswith("amqbroker.ha") for name in points(reader))
    m, reader = _metrics(report(PRIMARY_STATUS, LEASE))
    m.refresh()
    got = points(reader)
    attrs = {"node": "node1", "member": LEASE.member}
    assert got["amqbroker.ha.role"] == [(1, {**attrs, "role": "primary"})]
    assert got["amqbroker.ha.epoch"] == [(3, attrs)]
    assert got["amqbroker.ha.in_sync"] == [(0, attrs)]
    assert got["amqbroker.ha.unreplicated"] == [(1, attrs)]
    assert got["amqbroker.ha.lag.records"] == [(4, attrs)]
    assert got["amqbroker.ha.lag"] == [(400, attrs)]
    assert got["amqbroker.ha.full_syncs"] == [(2, attrs)]
    assert got["amqbroker.ha.drops"] == [(1, attrs)]
    assert {row[0] for row in HA_INSTRUMENTS} == {n for n in got if n.startswith("amqbroker.ha")}
    assert len(HA_EXPORTED) == len(HA_INSTRUMENTS)


def test_cluster_status_lines() -> None:
    text = "\n".join(ha_lines(report(PRIMARY_STATUS, LEASE, "refuse", True)))
    assert "HA pair node1: live node1@127.0.0.1:5672 at 127.0.0.1:5672, epoch 3" in text
    assert "this member node1@127.0.0.1:5672 is live" in text
    assert "backup member(s): node1@127.0.0.1:5673" in text
    assert "NOT in sync; lag 4 record(s), 400 byte(s)" in text
    assert "full sync: 10 of 50 byte(s) sent" in text
    assert "full syncs 2, drops 1" in text
    assert "UNREPLICATED" in text and "REFUSED" in text
    st = dict(PRIMARY_STATUS, state="in-sync", in_sync=True, unreplicated=False)
    text = "\n".join(ha_lines(report(st, LEASE)))
    assert "IN SYNC" in text and "replicated: every store cycle waits" in text
    assert "UNREPLICATED" not in text


def test_ha_unreplicated_setting() -> None:
    assert Settings().ha_unreplicated == "continue"
    assert Settings(ha_unreplicated="refuse").ha_unreplicated == "refuse"
    with pytest.raises(ValidationError):
        Settings(ha_unreplicated="stop")


def test_every_role_and_reason_has_words() -> None:
    assert set(ROLE_TEXT) == set(roles.State)
    assert set(REASON_TEXT) == set(roles.Event)


def test_a_role_change_is_one_operator_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker.ha.pair")
    m = PairMember(
        Settings(
            data_dir=tmp_path,
            ha_role="backup",
            node_id="node1",
            port=5673,
            cluster_zookeeper="127.0.0.1:1",
            cluster_user="cluster",
            cluster_password="pw",
        )
    )
    m.live_address = "127.0.0.1:5672"
    m._log_role_change(roles.State.WAITING, roles.State.MIRRORING, roles.Event.STANDBY, 2)
    m._log_role_change(roles.State.MIRRORING, roles.State.SYNCED, roles.Event.SYNCED, 2)
    m._log_role_change(roles.State.SYNCED, roles.State.LIVE, roles.Event.LIVE, 3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "HA pair node1: member node1@127.0.0.1:5673 is now MIRRORING (standby: copying the "
        "live member's store, not yet eligible), was waiting: another member is live at "
        "127.0.0.1:5672, epoch 2",
        "HA pair node1: member node1@127.0.0.1:5673 is now SYNCED (standby: its copy is "
        "complete, eligible to take over), was mirroring: the mirror's copy is complete "
        "for epoch 2",
        "HA pair node1: member node1@127.0.0.1:5673 is now LIVE (serving clients and the "
        "pair's backup), was synced: the lease in ZooKeeper made this member live, epoch 3",
    ]
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.WARNING]
    st = m.lease_status()
    assert st.node == "node1" and st.member == "node1@127.0.0.1:5673"
    assert st.state == "waiting"
