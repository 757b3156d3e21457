"""OTLP/HTTP metric export against a stand-in collector on 127.0.0.1.

The collector is a small HTTP/1.1 server on this test's trio loop: it reads each POST
(Content-Length or chunked, gzip/deflate bodies), records path, headers and body, and
answers with the status the test chooses (an empty `ExportMetricsServiceResponse` on
200). The broker runs in this process with `otlp_endpoint` pointing at it and a short
`otlp_export_interval`; its exporter posts from a worker thread, so the loop is free to
serve the request. Bodies are decoded with opentelemetry-proto (which the `otlp` extra
brings) and checked for the queue metrics, their labels and values. Every wait is
bounded by `trio.fail_after`.
"""

from __future__ import annotations

import functools
import gzip
import logging
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

pytest.importorskip(
    "opentelemetry.exporter.otlp.proto.http",
    reason="the otlp extra is not installed (scripts/test installs .[dev,otlp])",
)

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from proton import Message

from amqbroker.app import BrokerApp
from amqbroker.settings import Settings
from tests.client import Client

INTERVAL = 0.05  # otlp_export_interval for these tests, seconds
WAIT = 15.0  # bound on any wait for an export, seconds


@dataclass
class Post:
    path: str
    headers: dict[str, str]
    body: bytes

    def metrics(self) -> ExportMetricsServiceRequest:
        req = ExportMetricsServiceRequest()
        req.ParseFromString(self.body)
        return req


@dataclass
class Collector:
    """A stand-in OTLP/HTTP collector; `status` is what it answers next."""

    port: int = 0
    status: int = 200
    posts: list[Post] = field(default_factory=list)
    arrived: trio.Event = field(default_factory=trio.Event)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_for(self, pred: Callable[[Post], bool]) -> Post:
        """The first recorded POST (past or future) for which `pred` holds."""
        seen = 0
        with trio.fail_after(WAIT):
            while True:
                for p in self.posts[seen:]:
                    if pred(p):
                        return p
                seen = len(self.posts)
                self.arrived = trio.Event()
                await self.arrived.wait()

    async def wait_posts(self, n: int) -> None:
        """Until at least `n` POSTs have arrived."""
        with trio.fail_after(WAIT):
            while len(self.posts) < n:
                self.arrived = trio.Event()
                await self.arrived.wait()

    async def handle(self, stream: trio.SocketStream) -> None:
        buf = bytearray()

        async def fill() -> bool:
            data = await stream.receive_some(65536)
            buf.extend(data)
            return bool(data)

        async def take_line() -> bytes:
            while b"\r\n" not in buf:
                if not await fill():
                    raise EOFError
            i = buf.index(b"\r\n")
            line = bytes(buf[:i])
            del buf[: i + 2]
            return line

        async def take(n: int) -> bytes:
            while len(buf) < n:
                if not await fill():
                    raise EOFError
            data = bytes(buf[:n])
            del buf[:n]
            return data

        async with stream:
            try:
                while True:  # keep-alive: several requests per connection
                    method, path, _ = (await take_line()).decode().split(" ", 2)
                    headers: dict[str, str] = {}
                    while line := await take_line():
                        k, _, v = line.decode().partition(":")
                        headers[k.strip().lower()] = v.strip()
                    if headers.get("transfer-encoding", "").lower() == "chunked":
                        body = b""
                        while size := int((await take_line()).split(b";")[0], 16):
                            body += await take(size)
                            await take_line()
                        while await take_line():  # trailers
                            pass
                    else:
                        body = await take(int(headers.get("content-length", "0")))
                    encoding = headers.get("content-encoding", "")
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    if method == "POST":
                        self.posts.append(Post(path, headers, body))
                        self.arrived.set()
                    status = self.status
                    reply = (
                        ExportMetricsServiceResponse().SerializeToString() if status == 200 else b""
                    )
                    await stream.send_all(
                        f"HTTP/1.1 {status} X\r\nContent-Type: application/x-protobuf\r\n"
                        f"Content-Length: {len(reply)}\r\n\r\n".encode()
                        + reply
                    )
            except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass


@pytest.fixture
async def collector(nursery: trio.Nursery) -> Collector:
    c = Collector()
    listeners = await nursery.start(
        functools.partial(trio.serve_tcp, c.handle, 0, host="127.0.0.1")
    )
    c.port = listeners[0].socket.getsockname()[1]
    return c


@pytest.fixture
async def broker(
    nursery: trio.Nursery, collector: Collector, tmp_path: Path
) -> AsyncIterator[BrokerApp]:
    app = BrokerApp(
        Settings(
            port=0,
            data_dir=tmp_path / "data",
            store_sync=False,
            expiry_scan_period=0,
            otlp_endpoint=collector.endpoint,
            otlp_export_interval=INTERVAL,
        )
    )
    started: BrokerApp = await nursery.start(app.run)
    yield started
    app.request_shutdown()


def points(req: ExportMetricsServiceRequest, name: str) -> list[tuple[dict[str, str], Any]]:
    """(attributes, data point) of every point of metric `name` in an export."""
    found = []
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name != name:
                    continue
                kind = m.WhichOneof("data")
                assert kind is not None, m
                for dp in getattr(m, kind).data_points:
                    attrs = {a.key: a.value.string_value for a in dp.attributes}
                    found.append((attrs, dp))
    return found


def value(req: ExportMetricsServiceRequest, name: str, **labels: str) -> float | None:
    hits = [
        dp for attrs, dp in points(req, name) if all(attrs.get(k) == v for k, v in labels.items())
    ]
    if not hits:
        return None
    assert len(hits) == 1, (name, labels, hits)
    dp = hits[0]
    return float(dp.as_int if dp.WhichOneof("value") == "as_int" else dp.as_double)


async def test_otlp_export_carries_queue_metrics(
    broker: BrokerApp, collector: Collector, nursery: trio.Nursery
) -> None:
    c = await Client.connect(broker.listening[0][1], nursery=nursery)
    try:
        s = await c.sender("orders")
        await s.send_many(
            [Message(body=f"m{i}", group_id="A" if i < 3 else "B", durable=True) for i in range(5)]
        )

        def has_orders(p: Post) -> bool:
            return (
                p.path == "/v1/metrics"
                and value(p.metrics(), "amqbroker.queue.messages", queue="orders") == 5
            )

        post = await collector.wait_for(has_orders)
    finally:
        c.abort()

    assert post.headers["content-type"] == "application/x-protobuf"
    req = post.metrics()
    resource = {a.key: a.value.string_value for a in req.resource_metrics[0].resource.attributes}
    assert resource["service.name"] == "amqbroker"
    q = {"queue": "orders"}
    assert value(req, "amqbroker.queue.messages.added", **q) == 5
    assert value(req, "amqbroker.queue.messages.acknowledged", **q) == 0
    assert value(req, "amqbroker.queue.consumers", **q) == 0
    assert (value(req, "amqbroker.queue.size", **q) or 0) > 0
    assert value(req, "amqbroker.address.messages", address="orders") == 5
    assert value(req, "amqbroker.messages.routed") == 5
    assert value(req, "amqbroker.group.backlog.messages", group="A", **q) == 3
    assert value(req, "amqbroker.group.backlog.messages", group="B", **q) == 2
    # counters are cumulative monotonic sums, gauges are gauges
    added = next(
        m
        for rm in req.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "amqbroker.queue.messages.added"
    )
    assert added.WhichOneof("data") == "sum" and added.sum.is_monotonic
    assert added.unit == "{message}"
    attrs, _ = points(req, "amqbroker.queue.messages")[0]
    assert set(attrs) == {"queue", "address"}


async def test_otlp_refused_export_logs_once_then_recovers(
    broker: BrokerApp, collector: Collector, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker.telemetry")
    collector.status = 400  # not retryable: the exporter gives up on this batch at once
    await collector.wait_posts(len(collector.posts) + 3)
    warned = [r for r in caplog.records if "cannot export metrics" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert collector.endpoint in warned[0].getMessage()
    assert warned[0].levelno == logging.WARNING

    collector.status = 200
    # an export's outcome is logged before the next export is sent
    while not any("works again" in r.getMessage() for r in caplog.records):
        await collector.wait_posts(len(collector.posts) + 1)
    assert len([r for r in caplog.records if "cannot export metrics" in r.getMessage()]) == 1
