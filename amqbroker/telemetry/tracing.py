"""Spans for routing and dispatch, and the trace context carried by messages.

Only built when `tracing = true`; the protocol links then call `route` for every
message routed (before it is queued, or enlisted in a transaction) and `dispatch` for
every delivery to a consumer.

Producer context, in this order (W3C trace-context values):
1. the application property `traceparent` (with `tracestate` if present), what
   OpenTelemetry's AMQP/JMS instrumentations and most clients set;
2. the message annotation `x-opt-qpid-tracestate`: a map holding `traceparent`
   (and `tracestate`), as Qpid JMS's tracing writes it, or a `traceparent` string.

`route` starts the span "amqbroker route <address>" (kind CONSUMER) as a child of the
producer's context, with a link to it as well, and the attributes
`messaging.destination.name`, `amqbroker.group_id` (when grouped),
`amqbroker.connection.id` and `amqbroker.link.name`. Sampling: a producer's decision is
followed (the provider's sampler is ParentBased(ALWAYS_ON)); a message without a
context is traced with probability `tracing_sample_ratio`, decided here before any
span work, so an unsampled message costs two substring tests and a random draw. When the span is
recorded the broker writes *its* context into the message annotation
`x-opt-qpid-tracestate` = {"traceparent": ...} (replacing the producer's, if any), so a
consumer continues the trace from the broker. Nothing else of the message changes:
the application properties (and every other section) are copied byte for byte; the
splice follows `protocol.scanner`'s rule. The stored (journaled) copy carries the
annotation too.

`dispatch` starts "amqbroker dispatch <queue>" (kind PRODUCER) under the broker's
context found in that annotation, with the queue, group id, consumer link,
connection and (after a failed attempt) delivery count; a message without it (not
sampled at routing, or routed before tracing was on) gets no dispatch span.

Both spans are ended at once: they mark the moments a message entered the broker and
left it for a consumer; the time between them is the time it waited in the queue.
The substring tests (`b"traceparent" in data`) keep messages without any context
cheap: only those that carry one are parsed.
"""

from __future__ import annotations

import logging
import random
import struct
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# The splice helpers of the scanner are module-private; this is their only user
# outside protocol/ (the telemetry layer sits above protocol, so the import is legal).
from amqbroker.protocol.scanner import (
    _MESSAGE_ANNOTATIONS,
    ScanError,
    _decode,
    _elements,
    _enc_compound,
    _enc_var,
    _find,
    _key_bytes,
    _sections,
    _splice_map,
    application_properties,
)

if TYPE_CHECKING:
    from amqbroker.core.address import Address
    from amqbroker.core.entry import Entry

log = logging.getLogger(__name__)

TRACESTATE_ANNOTATION = "x-opt-qpid-tracestate"
_ANNOTATION_RAW = TRACESTATE_ANNOTATION.encode()
_MAP_SHAPES = frozenset({0xC1, 0xD1})


def _map_items(data: bytes, v: int) -> dict[str, object]:
    """The string/symbol-keyed entries of the map value at `v` (decoded simply)."""
    elements = _elements(data, v)
    out: dict[str, object] = {}
    for i in range(0, len(elements) - 1, 2):
        k = _key_bytes(data, elements[i][0])
        if k is None:
            continue
        vs, ve = elements[i + 1]
        out[k.decode(errors="replace")] = _decode(data, vs, ve)
    return out


def annotation_context(data: bytes) -> dict[str, str] | None:
    """The W3C carrier in the `x-opt-qpid-tracestate` annotation, None when absent or
    malformed."""
    if _ANNOTATION_RAW not in data:
        return None
    try:
        sec = _find(_sections(data), _MESSAGE_ANNOTATIONS)
        if sec is None:
            return None
        elements = _elements(data, sec[2])
        for i in range(0, len(elements) - 1, 2):
            if _key_bytes(data, elements[i][0]) != _ANNOTATION_RAW:
                continue
            vs, ve = elements[i + 1]
            if data[vs] in _MAP_SHAPES:
                items = _map_items(data, vs)
                carrier = {k: val for k, val in items.items() if isinstance(val, str)}
                return carrier if "traceparent" in carrier else None
            value = _decode(data, vs, ve)
            return {"traceparent": value} if isinstance(value, str) else None
    except (ScanError, IndexError, UnicodeDecodeError, struct.error):
        return None
    return None


def producer_context(data: bytes) -> dict[str, str] | None:
    """The producer's W3C carrier: application properties first, then the annotation."""
    if b"traceparent" not in data:
        return None
    try:
        props = application_properties(data)
    except (ScanError, IndexError, UnicodeDecodeError, struct.error):
        props = {}
    tp = props.get("traceparent")
    if isinstance(tp, str):
        carrier = {"traceparent": tp}
        ts = props.get("tracestate")
        if isinstance(ts, str):
            carrier["tracestate"] = ts
        return carrier
    return annotation_context(data)


def set_annotation_context(data: bytes, carrier: dict[str, str]) -> bytes:
    """Copy of `data` whose `x-opt-qpid-tracestate` annotation is the map `carrier`
    (string keys and values); every other byte is copied (scanner splice rule)."""
    body = b"".join(
        _enc_var(0xA1, 0xB1, k.encode()) + _enc_var(0xA1, 0xB1, v.encode())
        for k, v in carrier.items()
    )
    value = _enc_compound(0xC1, 0xD1, 2 * len(carrier), body)
    entry = _enc_var(0xA3, 0xB3, _ANNOTATION_RAW) + value
    return _splice_map(data, _MESSAGE_ANNOTATIONS, [(_ANNOTATION_RAW, entry)])


class Tracing:
    """The two hooks the protocol links call (see the module docstring)."""

    def __init__(self, tracer: trace.Tracer, ratio: float = 1.0) -> None:
        #: the provider's sampler must be ParentBased(ALWAYS_ON): messages without a
        #: context are sampled here, at `ratio`, before any span work
        self.tracer = tracer
        self.ratio = ratio
        self.propagator = TraceContextTextMapPropagator()

    def route(self, link: Any, e: Entry, a: Address) -> None:
        data = e.data
        carrier = producer_context(data)
        if carrier is None:
            if self.ratio < 1.0 and random.random() >= self.ratio:
                return  # not sampled: no span, the message is left alone
            ctx = Context()
        else:
            ctx = self.propagator.extract(carrier)
        parent = trace.get_current_span(ctx).get_span_context()
        span = self.tracer.start_span(
            f"amqbroker route {a.name}",
            context=ctx,
            kind=SpanKind.CONSUMER,
            links=[Link(parent)] if parent.is_valid else None,
            attributes=_span_attributes(a.name, link, e, with_delivery_count=False),
        )
        if span.is_recording():
            out: dict[str, str] = {}
            self.propagator.inject(out, context=trace.set_span_in_context(span, Context()))
            try:
                e.data = set_annotation_context(data, out)
            except ScanError as exc:  # pragma: no cover - scan() accepted the message
                log.debug("cannot add the trace context to a message: %s", exc)
        span.end()

    def dispatch(self, link: Any, e: Entry) -> None:
        carrier = annotation_context(e.data)
        if carrier is None:
            return
        ctx = self.propagator.extract(carrier)
        if not trace.get_current_span(ctx).get_span_context().is_valid:
            return
        q = link.queue
        qname = q.name if q is not None else ""
        span = self.tracer.start_span(
            f"amqbroker dispatch {qname}",
            context=ctx,
            kind=SpanKind.PRODUCER,
            attributes=_span_attributes(qname, link, e, with_delivery_count=True),
        )
        span.end()


def _span_attributes(
    destination: str, link: Any, e: Entry, *, with_delivery_count: bool
) -> dict[str, Any]:
    """The attributes of a route or dispatch span (the delivery count, when not 0, on
    dispatch spans only)."""
    attributes: dict[str, Any] = {
        "messaging.destination.name": destination,
        "amqbroker.connection.id": link.conn.conn_id,
        "amqbroker.link.name": link.link.name,
    }
    if with_delivery_count and e.delivery_count:
        attributes["amqbroker.delivery_count"] = e.delivery_count
    if e.group_id is not None:
        attributes["amqbroker.group_id"] = e.group_id
    return attributes
