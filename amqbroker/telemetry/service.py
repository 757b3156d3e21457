"""`Telemetry`: builds the providers from the settings and runs the telemetry tasks.

Life cycle (driven by the app): construct (providers, instruments, tracing hooks);
`bind()` before the broker reports ready (a port conflict is a start-up error); `run()`
as a task of the root nursery (Prometheus server, OTLP export loop); `shutdown()` after
the broker stopped (flushes pending spans).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricExporter, MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

from amqbroker import __version__
from amqbroker.net.listener import ListenError, bind, bound_address
from amqbroker.telemetry import prometheus
from amqbroker.telemetry.metrics import Metrics
from amqbroker.telemetry.tracing import Tracing

if TYPE_CHECKING:
    from amqbroker.core.broker import Broker
    from amqbroker.net.driver import Hub
    from amqbroker.settings import Settings
    from amqbroker.store.journal import Journal

log = logging.getLogger("amqbroker.telemetry")


class TelemetryError(Exception):
    """Telemetry cannot start; the message says why and what to do."""


class Source(Protocol):
    """What telemetry reads from the app (BrokerApp satisfies it)."""

    broker: Broker | None
    journal: Journal | None
    hub: Hub

    def clock(self) -> float: ...

    def cluster_waiting(self) -> list[dict[str, Any]]:
        """Lost cluster nodes whose groups wait for them (`ClusterNode.waiting`)."""
        ...

    def ha_report(self) -> dict[str, Any]:
        """The HA report (`amqbroker.ha.status.report`; role "" without HA)."""
        ...


def _otlp(kind: str) -> Any:
    try:
        if kind == "metrics":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )

            return OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter
    except ImportError as exc:
        raise TelemetryError(
            "otlp_endpoint is set but the OTLP exporter is not installed: install it with "
            "pip install 'amqbroker[otlp]', or set otlp_endpoint = \"\""
        ) from exc


class Telemetry:
    def __init__(
        self,
        settings: Settings,
        source: Source,
        *,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        s = settings
        self.settings = s
        self.source = source
        self.prometheus_address: tuple[str, int] | None = None
        self._sock: socket.socket | None = None
        resource = Resource.create({"service.name": "amqbroker", "service.version": __version__})
        readers: list[MetricReader] = []
        self._registry: Any = None
        if s.metrics_prometheus_port >= 0:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry

            self._registry = CollectorRegistry()
            readers.append(
                PrometheusMetricReader(registry=self._registry, scope_info_enabled=False)
            )
        endpoint = s.otlp_endpoint.rstrip("/")
        self._otlp_reader: InMemoryMetricReader | None = None
        self._otlp_exporter: MetricExporter | None = None
        if endpoint:
            self._otlp_exporter = _otlp("metrics")(endpoint=f"{endpoint}/v1/metrics")
            self._otlp_reader = InMemoryMetricReader()
            readers.append(self._otlp_reader)
        self.meter_provider: MeterProvider | None = None
        self.metrics: Metrics | None = None
        if readers:
            self.meter_provider = MeterProvider(metric_readers=readers, resource=resource)
            self.metrics = Metrics(
                self.meter_provider.get_meter("amqbroker", __version__),
                broker=lambda: source.broker,
                journal=lambda: source.journal,
                connections=lambda: len(source.hub.drivers),
                clock=source.clock,
                top_groups=s.metrics_top_groups,
                cluster_waiting=source.cluster_waiting,
                ha=source.ha_report,
            )
        self.tracer_provider: TracerProvider | None = None
        self.tracing: Tracing | None = None
        if s.tracing:
            tp = TracerProvider(
                resource=resource,
                sampler=ParentBased(ALWAYS_ON),  # roots are sampled by Tracing.route
            )
            if endpoint:
                tp.add_span_processor(
                    BatchSpanProcessor(_otlp("traces")(endpoint=f"{endpoint}/v1/traces"))
                )
            if span_exporter is not None:
                tp.add_span_processor(SimpleSpanProcessor(span_exporter))
            self.tracer_provider = tp
            self.tracing = Tracing(tp.get_tracer("amqbroker", __version__), s.tracing_sample_ratio)

    @staticmethod
    def wanted(settings: Settings) -> bool:
        s = settings
        return s.metrics_prometheus_port >= 0 or bool(s.otlp_endpoint) or s.tracing

    # ------------------------------------------------------------ hooks
    @property
    def route_tracer(self) -> Callable[..., None] | None:
        return self.tracing.route if self.tracing is not None else None

    @property
    def dispatch_tracer(self) -> Callable[..., None] | None:
        return self.tracing.dispatch if self.tracing is not None else None

    def store_batch(self, sync_ms: float) -> None:
        """The store synced one journal batch in `sync_ms` milliseconds."""
        if self.metrics is not None:
            self.metrics.sync_latency.record(sync_ms / 1000.0)

    # ------------------------------------------------------------ lifecycle
    def bind(self) -> None:
        """Bind the Prometheus endpoint (before the broker reports ready)."""
        s = self.settings
        if self._registry is None:
            return
        try:
            self._sock = bind(s.metrics_prometheus_host, s.metrics_prometheus_port, backlog=64)
        except ListenError as exc:
            raise TelemetryError(
                f"Prometheus endpoint: {exc} (the setting is metrics_prometheus_port; -1 "
                "turns the endpoint off)"
            ) from exc
        self.prometheus_address = bound_address(self._sock)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def describe(self) -> str:
        """One phrase for the start-up log line."""
        parts = []
        if self.prometheus_address is not None:
            h, p = self.prometheus_address
            parts.append(f"metrics on http://{h}:{p}/metrics")
        if self.settings.otlp_endpoint:
            parts.append(f"OTLP to {self.settings.otlp_endpoint}")
        if self.tracing is not None:
            parts.append(f"tracing at ratio {self.settings.tracing_sample_ratio:g}")
        return "; ".join(parts)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition (collects now, on the calling thread)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.metrics is not None:
            self.metrics.refresh()
        return generate_latest(self._registry), CONTENT_TYPE_LATEST

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        s = self.settings
        if self.tracing is not None and not s.otlp_endpoint:
            log.warning(
                "tracing is on but otlp_endpoint is empty: spans are made (and messages "
                "carry the broker's trace context) but not exported; set otlp_endpoint"
            )
        async with trio.open_nursery() as n:
            if self._sock is not None:
                sock, self._sock = self._sock, None
                await n.start(prometheus.serve, sock, self.render)
            if self._otlp_reader is not None:
                n.start_soon(self._otlp_loop, self._otlp_reader)
            task_status.started()

    async def _otlp_loop(self, reader: InMemoryMetricReader) -> None:
        exporter = self._otlp_exporter
        assert exporter is not None and self.metrics is not None
        failed = False
        while True:
            await trio.sleep(self.settings.otlp_export_interval)
            self.metrics.refresh()
            data = reader.get_metrics_data()  # collect on the trio thread
            if data is None:
                continue
            result = await trio.to_thread.run_sync(exporter.export, data)
            ok = getattr(result, "name", "") == "SUCCESS"
            if not ok and not failed:
                log.warning(
                    "cannot export metrics to %s (the collector refused or is "
                    "unreachable); retrying every %g s, logged once until it works",
                    self.settings.otlp_endpoint,
                    self.settings.otlp_export_interval,
                )
            elif ok and failed:
                log.info("metrics export to %s works again", self.settings.otlp_endpoint)
            failed = not ok

    def shutdown(self) -> None:
        self.close()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()
        if self._otlp_exporter is not None:
            self._otlp_exporter.shutdown()
