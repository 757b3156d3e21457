"""The cluster node-loss gauges (issue 20): what `ClusterNode.waiting` reports for a
lost peer becomes one labelled point per instrument, through a real OpenTelemetry
meter provider and reader."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from amqbroker.telemetry.metrics import CLUSTER_EXPORTED, EXPORTED, Metrics


def points(reader: InMemoryMetricReader) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    out: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    out.setdefault(m.name, []).append((p.value, dict(p.attributes or {})))
    return out


def test_waiting_groups_of_a_lost_node_are_gauges_labelled_by_node() -> None:
    waiting: list[dict[str, Any]] = []
    reader = InMemoryMetricReader()
    metrics = Metrics(
        MeterProvider(metric_readers=[reader]).get_meter("test"),
        broker=lambda: None,
        journal=lambda: None,
        connections=lambda: 0,
        clock=lambda: 0.0,
        top_groups=5,
        cluster_waiting=lambda: waiting,
    )
    metrics.refresh()
    assert not any(name.startswith("amqbroker.cluster") for name in points(reader))
    waiting.append({"node": "node3", "sinceMillis": 12500, "groups": 6, "bridgeDepth": 210})
    metrics.refresh()
    got = points(reader)
    assert got["amqbroker.cluster.waiting.groups"] == [(6, {"node": "node3"})]
    assert got["amqbroker.cluster.waiting.messages"] == [(210, {"node": "node3"})]
    assert got["amqbroker.cluster.waiting.duration"] == [(12.5, {"node": "node3"})]
    assert CLUSTER_EXPORTED <= EXPORTED
