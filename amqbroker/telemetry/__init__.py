"""Telemetry: metrics (OpenTelemetry SDK, Prometheus endpoint and/or OTLP) and traces.

Layering: between `app` and `net`. The app builds one `Telemetry` per broker from the
settings and hands it itself as the `Source` (broker, journal, hub); telemetry reads the
core's `statistics()` and a few O(groups) helpers of `Queue`, never the reverse: core,
protocol and store import nothing from here (import-linter forbids `opentelemetry` in
them). Everything is per broker instance (its own `MeterProvider`, Prometheus
`CollectorRegistry` and `TracerProvider`), never the SDK's process-global providers,
so several brokers can run in one process.

Metrics (`metrics.py`)
----------------------
Every instrument is *observable*: its callback reads a snapshot, so a message costs
nothing for metrics. A snapshot is taken right before each collection, and every
collection runs on the trio thread (the Prometheus endpoint is served by a trio task;
the OTLP exporter only sends, from a worker thread, data collected on the trio
thread), so no core structure is ever read from another thread. The one synchronous
instrument is the store's sync-latency histogram, recorded once per journal batch.

Message ages come from the core's arrival marks (`Queue.arrival_time`, a coarse clock
read at most once per `message_age_resolution`), so no message is timestamped.

Prometheus (`prometheus.py`): a minimal HTTP/1.1 server (GET /metrics only, one
request per connection) on `metrics_prometheus_host:metrics_prometheus_port`,
bound before the broker reports ready.

Traces (`tracing.py`): only with `tracing = true`. The protocol links call the route
hook for each routed message and the dispatch hook for each delivery (with tracing
off they hold `None` and pay one attribute test). See `tracing.py` for the context
propagation rules.
"""

from __future__ import annotations

from amqbroker.telemetry.service import Source, Telemetry, TelemetryError

__all__ = ["Source", "Telemetry", "TelemetryError"]
