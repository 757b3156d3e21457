"""Telemetry end to end: the Prometheus endpoint scraped over HTTP while messages flow,
the Grafana dashboard checked against what it exports, and tracing spans (in-memory
exporter) linked to a producer's context, with the broker's context added to the
message annotations only."""

from __future__ import annotations

import functools
import json
import re
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from proton import Message

from amqbroker.app import BrokerApp, StartupError
from amqbroker.protocol.scanner import _APPLICATION_PROPERTIES, _find, _sections
from amqbroker.settings import Settings
from amqbroker.telemetry.metrics import CLUSTER_EXPORTED, EXPORTED, HA_EXPORTED
from amqbroker.telemetry.tracing import annotation_context
from tests.client import Client, wait_until

DASHBOARD = Path(__file__).resolve().parents[2] / "config" / "grafana-dashboard.json"
SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Starter = Callable[..., Awaitable[BrokerApp]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Starter]:
    """Start brokers in this process; `span_exporter` is set before run()."""
    apps: list[BrokerApp] = []
    async with trio.open_nursery() as n:

        async def _start(span_exporter: Any = None, **overrides: Any) -> BrokerApp:
            values: dict[str, Any] = {
                "port": 0,
                "data_dir": tmp_path / f"data{len(apps)}",
                "store_sync": False,
                "expiry_scan_period": 0,
            }
            values.update(overrides)
            app = BrokerApp(Settings(**values))
            app.span_exporter = span_exporter
            started: BrokerApp = await n.start(functools.partial(app.run))
            apps.append(app)
            return started

        yield _start
        for app in apps:
            app.request_shutdown()


@pytest.fixture
async def clients(nursery: trio.Nursery) -> AsyncIterator[Callable[[BrokerApp], Awaitable[Client]]]:
    made: list[Client] = []

    async def _connect(app: BrokerApp) -> Client:
        c = await Client.connect(app.listening[0][1], nursery=nursery)
        made.append(c)
        return c

    yield _connect
    for c in made:
        c.abort()


async def scrape(app: BrokerApp, path: str = "/metrics") -> tuple[int, str, str]:
    """GET the endpoint from a worker thread (the server runs on this trio loop)."""
    tel = app.telemetry
    assert tel is not None and tel.prometheus_address is not None
    host, port = tel.prometheus_address
    url = f"http://{host}:{port}{path}"

    def get() -> tuple[int, str, str]:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status, r.headers.get("Content-Type", ""), r.read().decode()
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, "", exc.read().decode()

    return await trio.to_thread.run_sync(get)


class Scrape:
    """A parsed text exposition: families (from # TYPE) and samples."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types: dict[str, str] = {}
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                self.types[name] = kind
            elif line and not line.startswith("#"):
                m = SAMPLE_RE.match(line)
                assert m, f"unparsable sample line {line!r}"
                labels = dict(LABEL_RE.findall(m.group(2) or ""))
                self.samples.append((m.group(1), labels, float(m.group(3))))

    def names(self) -> set[str]:
        return {name for name, _, _ in self.samples}

    def value(self, name: str, **labels: str) -> float:
        found = [
            v
            for n, lab, v in self.samples
            if n == name and all(lab.get(k) == x for k, x in labels.items())
        ]
        assert len(found) == 1, f"{name}{labels}: {found}\n{self.text}"
        return found[0]


async def metrics(app: BrokerApp) -> Scrape:
    status, ctype, body = await scrape(app)
    assert status == 200, body
    assert ctype.startswith("text/plain"), ctype
    return Scrape(body)


def grouped(body: str, group: str) -> Message:
    return Message(body=body, group_id=group, durable=True)


# ---------------------------------------------------------------------- metrics


async def test_prometheus_queue_and_group_figures_move(
    start: Starter, clients: Callable[[BrokerApp], Awaitable[Client]]
) -> None:
    app = await start(metrics_prometheus_port=0)
    c = await clients(app)
    s = await c.sender("orders")
    await s.send_many([grouped("a1", "A"), grouped("a2", "A"), grouped("a3", "A")])
    await s.send_many([grouped("b1", "B"), grouped("b2", "B"), grouped("c1", "C")])

    m = await metrics(app)
    q = {"queue": "orders"}
    assert m.value("amqbroker_queue_messages", **q) == 6
    assert m.value("amqbroker_queue_messages_added_total", **q) == 6
    assert m.value("amqbroker_queue_consumers", **q) == 0
    assert m.value("amqbroker_queue_groups", **q) == 0
    assert m.value("amqbroker_queue_size_bytes", **q) > 0
    assert m.value("amqbroker_address_messages", address="orders") == 6
    assert m.value("amqbroker_messages_routed_total") == 6
    assert m.value("amqbroker_connections") == 1
    assert m.value("amqbroker_memory_resident_bytes") > 1 << 20
    # the largest groups, by backlog, each with its own series
    assert m.value("amqbroker_group_backlog_messages", group="A", **q) == 3
    assert m.value("amqbroker_group_backlog_messages", group="B", **q) == 2
    assert m.value("amqbroker_group_backlog_messages", group="C", **q) == 1
    assert m.value("amqbroker_group_oldest_message_age_seconds", group="A", **q) >= 0
    assert m.types["amqbroker_queue_messages_added_total"] == "counter"
    assert m.types["amqbroker_queue_messages"] == "gauge"

    # r1 can take one message, r2 many: A binds to r1, its next messages park behind
    # the busy owner (a blocked group), B and C go to r2
    r1 = await c.receiver("orders", credit=1)
    assert str((await r1.receive()).body) == "a1"  # left unsettled: A stays bound to r1
    r2 = await c.receiver("orders", credit=10)
    got = await r2.receive_n(3)
    assert sorted(str(x.body) for x in got) == ["b1", "b2", "c1"]
    m = await metrics(app)
    assert m.value("amqbroker_queue_consumers", **q) == 2
    assert m.value("amqbroker_queue_groups", **q) == 3
    assert m.value("amqbroker_queue_group_owner_changes_total", **q) == 3
    assert m.value("amqbroker_queue_messages_delivering", **q) == 4
    assert m.value("amqbroker_queue_groups_blocked", **q) == 1
    assert m.value("amqbroker_group_backlog_messages", group="A", **q) == 2
    blocked = m.value("amqbroker_queue_group_blocked_seconds_total", **q)
    assert blocked > 0
    m = await metrics(app)
    assert m.value("amqbroker_queue_group_blocked_seconds_total", **q) > blocked, (
        "an ongoing blocked episode counts as it goes"
    )

    for x in got:
        r2.accept(x)
    await wait_until(lambda: app.broker is not None and app.broker.queues["orders"].inflight == 1)
    m = await metrics(app)
    assert m.value("amqbroker_queue_messages_acknowledged_total", **q) == 3
    assert m.value("amqbroker_queue_messages", **q) == 3

    # detach r1: group A gets a new owner (r2) and its blocked episode ends
    await r1.close()
    more = await r2.receive_n(3)
    assert [str(x.body) for x in more] == ["a1", "a2", "a3"]
    for x in more:
        r2.accept(x)
    await wait_until(lambda: app.broker is not None and app.broker.queues["orders"].count == 0)
    m = await metrics(app)
    assert m.value("amqbroker_queue_group_owner_changes_total", **q) == 4
    assert m.value("amqbroker_queue_groups_blocked", **q) == 0
    ended = m.value("amqbroker_queue_group_blocked_seconds_total", **q)
    assert ended > blocked
    m = await metrics(app)
    assert m.value("amqbroker_queue_group_blocked_seconds_total", **q) == ended, (
        "no group is blocked: the total stays"
    )
    assert m.value("amqbroker_queue_messages_acknowledged_total", **q) == 6
    assert m.value("amqbroker_queue_oldest_message_age_seconds", **q) == 0
    assert "amqbroker_group_backlog_messages" not in m.names()


async def test_names_follow_prometheus_conventions_and_dashboard_uses_them(
    start: Starter, clients: Callable[[BrokerApp], Awaitable[Client]]
) -> None:
    """Every family the endpoint exports is in EXPORTED and vice versa (with traffic
    that makes each one appear); counters end in _total, units are suffixes; every
    metric a Grafana panel queries is one of them."""
    app = await start(metrics_prometheus_port=0, store_sync=True)
    c = await clients(app)
    s = await c.sender("durable.q")
    await s.send_many([grouped("x", "G1"), grouped("y", "G2")])
    m = await metrics(app)
    families = {n for n in m.types if n.startswith("amqbroker_")}
    exported = set()
    for name in m.names():
        if not name.startswith("amqbroker_"):
            continue
        for suffix in ("_bucket", "_sum", "_count", "_created"):
            if name.endswith(suffix) and name[: -len(suffix)] in families:
                name = name[: -len(suffix)]
        exported.add(name)
    assert exported == families, exported ^ families
    # a single node has no cluster peer to wait for, and no HA pair
    assert exported == EXPORTED - CLUSTER_EXPORTED - HA_EXPORTED, (exported ^ EXPORTED, m.text)
    for name in exported:
        # counters, and only counters, end in _total
        assert (m.types[name] == "counter") == name.endswith("_total"), (name, m.types[name])
    assert "amqbroker_store_sync_latency_seconds" in m.types
    assert m.value("amqbroker_store_sync_latency_seconds_count") >= 1
    assert any(n.endswith("_bytes") for n in exported)
    assert any(n.endswith("_seconds") for n in exported)

    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert panels
    used: set[str] = set()
    for panel in panels:
        assert panel.get("targets"), f"panel {panel.get('title')!r} has no query"
        for t in panel["targets"]:
            names = set(re.findall(r"\bamqbroker_[a-z0-9_]+", t["expr"]))
            assert names, f"panel {panel['title']!r}: no amqbroker metric in {t['expr']!r}"
            for n in names:
                base = n
                for suffix in ("_bucket", "_sum", "_count"):
                    if n.endswith(suffix) and n[: -len(suffix)] in families:
                        base = n[: -len(suffix)]
                assert base in exported, f"panel {panel['title']!r} uses {n}, not exported"
                used.add(base)
    for var in dashboard["templating"]["list"]:
        for n in re.findall(r"\bamqbroker_[a-z0-9_]+", var.get("query", "")):
            assert n in exported, f"variable {var['name']!r} uses {n}, not exported"
    assert used == exported, f"metrics without a panel: {exported - used}"


async def test_endpoint_answers_only_get_metrics(start: Starter) -> None:
    app = await start(metrics_prometheus_port=0)
    status, _, body = await scrape(app, "/other")
    assert status == 404 and "/metrics" in body


async def test_metrics_port_in_use_is_a_startup_error(start: Starter) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupError, match=r"metrics_prometheus_port") as info:
            await start(metrics_prometheus_port=port)
    assert f"127.0.0.1:{port}" in str(info.value)


async def test_telemetry_off_by_default(start: Starter) -> None:
    app = await start()
    assert app.telemetry is None
    assert app.server.limits.route_tracer is None and app.server.limits.dispatch_tracer is None


# ---------------------------------------------------------------------- tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PRODUCER_SPAN = "00f067aa0ba902b7"


def _app_props_section(data: bytes) -> bytes:
    sec = _find(_sections(data), _APPLICATION_PROPERTIES)
    assert sec is not None
    return data[sec[1] : sec[3]]


async def test_route_span_linked_to_producer_and_context_in_annotations(
    start: Starter, clients: Callable[[BrokerApp], Awaitable[Client]]
) -> None:
    exporter = InMemorySpanExporter()
    app = await start(span_exporter=exporter, tracing=True)
    c = await clients(app)
    s = await c.sender("traced")
    msg = Message(
        body="hello",
        group_id="g-42",
        properties={"traceparent": f"00-{TRACE_ID}-{PRODUCER_SPAN}-01", "k": "v"},
    )
    sent = msg.encode()
    await s.send(msg)
    r = await c.receiver("traced", credit=1)
    got = await r.receive()
    r.accept(got)

    spans = exporter.get_finished_spans()
    route = [x for x in spans if x.name == "amqbroker route traced"]
    dispatch = [x for x in spans if x.name == "amqbroker dispatch traced"]
    assert len(route) == 1 and len(dispatch) == 1, [x.name for x in spans]
    rs, ds = route[0], dispatch[0]
    assert rs.kind is SpanKind.CONSUMER
    assert f"{rs.context.trace_id:032x}" == TRACE_ID
    assert rs.parent is not None and f"{rs.parent.span_id:016x}" == PRODUCER_SPAN
    assert [f"{ln.context.span_id:016x}" for ln in rs.links] == [PRODUCER_SPAN]
    assert rs.attributes is not None and rs.attributes["amqbroker.group_id"] == "g-42"
    assert rs.attributes["messaging.destination.name"] == "traced"
    # dispatch continues from the broker's route span
    assert ds.parent is not None and ds.parent.span_id == rs.context.span_id
    assert ds.context.trace_id == rs.context.trace_id
    assert ds.attributes is not None and ds.attributes["amqbroker.group_id"] == "g-42"

    # the delivered message carries the broker's context in its annotations...
    carrier = annotation_context(got.raw)
    assert carrier == {"traceparent": f"00-{TRACE_ID}-{rs.context.span_id:016x}-01"}
    # ...and nothing else changed: application properties byte for byte, same body
    assert _app_props_section(got.raw) == _app_props_section(sent)
    assert got.properties == {"traceparent": f"00-{TRACE_ID}-{PRODUCER_SPAN}-01", "k": "v"}
    assert got.body == "hello" and got.group_id == "g-42"


async def test_producer_context_from_qpid_tracestate_annotation(
    start: Starter, clients: Callable[[BrokerApp], Awaitable[Client]]
) -> None:
    """Qpid JMS writes its context as the x-opt-qpid-tracestate annotation (a map)."""
    exporter = InMemorySpanExporter()
    app = await start(span_exporter=exporter, tracing=True)
    c = await clients(app)
    s = await c.sender("jms")
    msg = Message(body="x", group_id="g")
    from proton import symbol

    msg.annotations = {
        symbol("x-opt-qpid-tracestate"): {"traceparent": f"00-{TRACE_ID}-{PRODUCER_SPAN}-01"}
    }
    await s.send(msg)
    (rs,) = [x for x in exporter.get_finished_spans() if x.name == "amqbroker route jms"]
    assert f"{rs.context.trace_id:032x}" == TRACE_ID
    assert rs.parent is not None and f"{rs.parent.span_id:016x}" == PRODUCER_SPAN


async def test_no_context_and_ratio_zero_makes_no_span_and_leaves_message_alone(
    start: Starter, clients: Callable[[BrokerApp], Awaitable[Client]]
) -> None:
    exporter = InMemorySpanExporter()
    app = await start(span_exporter=exporter, tracing=True, tracing_sample_ratio=0.0)
    c = await clients(app)
    s = await c.sender("plain")
    msg = Message(body="x", properties={"k": 1})
    sent = msg.encode()
    await s.send(msg)
    r = await c.receiver("plain", credit=1)
    got = await r.receive()
    assert exporter.get_finished_spans() == ()
    assert got.raw == sent
