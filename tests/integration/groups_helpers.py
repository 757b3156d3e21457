"""Helpers shared by the grouping integration tests (test_groups_*.py)."""

from __future__ import annotations

from typing import Any

import trio
from proton import Message

from amqbroker.app import BrokerApp
from tests.client import Client, Received, Receiver
from tests.conftest import wait_idle

CLOSE = 0xFFFFFFFF  # group-sequence -1 as the AMQP uint it travels as
FIRST = "JMSXGroupFirstForConsumer"
BUCKET = "_AMQ_GROUP_BUCKET_INT_KEY_"


def msg(body: str, group: str | None = None, seq: int | None = None, **app: Any) -> Message:
    m = Message(body=body)
    if group is not None:
        m.group_id = group
    if seq is not None:
        m.group_sequence = seq & 0xFFFFFFFF
    if app:
        m.properties = app  # type: ignore[assignment]
    return m


async def take_all(r: Receiver, n: int) -> list[Received]:
    """Receive exactly n messages and accept them."""
    got = await r.receive_n(n)
    for g in got:
        r.accept(g)
    return got


async def take(r: Receiver, n: int) -> list[str]:
    """Receive exactly n messages, accept them, return their bodies."""
    return [g.body for g in await take_all(r, n)]


def flags(got: list[Received], key: str = FIRST) -> list[tuple[str, bool]]:
    """(body, first-key property present) per delivery; present means boolean true."""
    out = []
    for g in got:
        props = g.properties
        if key in props:
            assert props[key] is True, f"{key} must be boolean true, got {props[key]!r}"
        out.append((g.body, key in props))
    return out


def summary(got: list[Received], key: str = FIRST) -> list[tuple[str, int, bool]]:
    """(body, delivery-count, first-key flag present) per delivery."""
    return [
        (body, g.message.delivery_count, flag)
        for g, (body, flag) in zip(got, flags(got, key), strict=True)
    ]


async def assert_idle(app: BrokerApp, *clients: Client) -> None:
    """Close the clients; every per-connection/per-link registry must be empty."""
    for c in clients:
        await c.close()
    sizes = await wait_idle(app, timeout=1.0)
    assert not any(sizes.values()), f"registries not empty after the clients left: {sizes}"


def queue_of(app: BrokerApp, name: str) -> Any:
    assert app.broker is not None
    return app.broker.queues[name]


def stats(app: BrokerApp, queue: str) -> dict[str, Any]:
    result: dict[str, Any] = queue_of(app, queue).statistics()
    return result


async def until(app: BrokerApp, queue: str, what: str, value: Any) -> None:
    """Wait until the broker has processed a settlement (it travels on another
    connection than the next send, so it could otherwise arrive after it)."""
    for _ in range(5000):
        if stats(app, queue)[what] == value:
            return
        await trio.sleep(0.001)
    raise AssertionError(f"{what} never became {value!r}: {stats(app, queue)[what]!r}")
