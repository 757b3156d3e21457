"""Paging over real sockets: an address with a small memory limit and policy PAGE takes
far more messages than fit in memory, and consumers get all of them in order (the
in-process broker); durable paged messages survive kill -9 (a broker subprocess).
RSS is measured by scripts/paging_soak.py, not here."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Delivery, Message

from amqbroker.app import BrokerApp
from tests.client import Client
from tests.conftest import BrokerFactory
from tests.integration.broker_process import BrokerProcesses

LIMIT = 64 * 1024
PAGE = {"#": {"max_size_bytes": LIMIT, "address_full_policy": "PAGE"}}


def body(i: int) -> str:
    return f"m{i:06d}" + "." * 200


async def send_all(c: Client, address: str, n: int, **kw: Any) -> None:
    s = await c.sender(address)
    for first in range(0, n, 1000):
        ds = await s.send_many(
            [Message(body=body(i), **kw) for i in range(first, min(n, first + 1000))],
            timeout=60,
        )
        assert {d.remote_state for d in ds} == {Delivery.ACCEPTED}


async def receive_all(c: Client, address: str, n: int) -> list[int]:
    r = await c.receiver(address, credit=1000)
    got: list[int] = []
    while len(got) < n:
        got.append(int(str((m := await r.receive(timeout=60)).body)[1:7]))
        r.accept(m)
        while r.queue and len(got) < n:
            m = r.queue.popleft()
            got.append(int(str(m.body)[1:7]))
            r.accept(m)
        if r.credit < 500:
            r.flow(1000 - r.credit)
    return got


async def test_ten_thousand_messages_through_a_64k_limit_in_order(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app: BrokerApp = await make_broker(address_settings=PAGE, page_size_bytes=256 * 1024)
    port = app.listening[0][1]
    p = await Client.connect(port, nursery=nursery)
    c = await Client.connect(port, nursery=nursery)
    try:
        n = 10_000
        await send_all(p, "paged", n)
        assert app.broker is not None
        q = app.broker.queues["paged"]
        st = q.statistics()
        assert st["messages"] == n
        assert st["paged_messages"] > n - LIMIT // 200
        assert q.bytes <= LIMIT + 1000
        assert app.statistics()["paging"]["page_segments"] > 1
        assert await receive_all(c, "paged", n) == list(range(n))
        assert q.paged_count == 0
        assert q.bytes <= LIMIT + 1000
        # consumed segments are deleted by the next store cycles
        for _ in range(1000):
            left = list((app.data_dir / "paging").rglob("*.pg"))
            if not left:
                break
            await trio.sleep(0.01)
        assert not left
    finally:
        p.abort()
        c.abort()


async def test_producer_keeps_credit_while_paging_and_groups_keep_order(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    """PAGE never withholds credit; two consumers share four groups across the page
    boundary, each group in order at one consumer."""
    app = await make_broker(address_settings=PAGE)
    port = app.listening[0][1]
    p = await Client.connect(port, nursery=nursery)
    c = await Client.connect(port, nursery=nursery)
    try:
        n = 2000
        s = await p.sender("grouped")
        for first in range(0, n, 500):  # send_many flushes only at its end: <= credit
            msgs = [Message(body=body(i), group_id=f"G{i % 4}") for i in range(first, first + 500)]
            ds = await s.send_many(msgs, timeout=60)
            assert {d.remote_state for d in ds} == {Delivery.ACCEPTED}
        assert app.broker is not None
        assert app.broker.queues["grouped"].paged_count > 0
        r1 = await c.receiver("grouped", credit=50)
        r2 = await c.receiver("grouped", credit=50)
        got: dict[str, list[tuple[int, int]]] = {}
        total = 0
        with trio.fail_after(60):
            while total < n:
                await c._wait(lambda: bool(r1.queue or r2.queue), 60)
                for k, r in enumerate((r1, r2)):
                    while r.queue:
                        m = r.queue.popleft()
                        got.setdefault(str(m.message.group_id), []).append(
                            (int(str(m.body)[1:7]), k)
                        )
                        r.accept(m)
                        total += 1
                    if r.credit < 25:
                        r.flow(50 - r.credit)
        for g, seen in got.items():
            idx = [i for i, _ in seen]
            assert idx == sorted(idx) and len(idx) == n // 4, g
            assert len({k for _, k in seen}) == 1, f"group {g} had two consumers"
    finally:
        p.abort()
        c.abort()


@pytest.mark.slow
async def test_durable_paged_messages_survive_kill_9(nursery: trio.Nursery, tmp_path: Path) -> None:
    procs = BrokerProcesses(nursery, cwd=tmp_path)
    data = tmp_path / "data"
    env = {"AMQBROKER_ADDRESS_SETTINGS": json.dumps(PAGE)}
    try:
        bp = await procs.start(data, env=env)
        p = await Client.connect(bp.port, nursery=nursery)
        n = 3000
        await send_all(p, "dq", n, durable=True)
        # take some (read back from the page and acknowledged), then kill -9
        c = await Client.connect(bp.port, nursery=nursery)
        r = await c.receiver("dq", credit=100)
        first = []
        for m in await r.receive_n(100, timeout=30):
            first.append(int(str(m.body)[1:7]))
            r.accept(m)
        # the acks reach the journal before an accepted durable send (one connection)
        await c._flush()
        s = await c.sender("barrier")
        assert (await s.send(Message(body="b", durable=True))).remote_state == (Delivery.ACCEPTED)
        assert await bp.crash() == -signal.SIGKILL
        p.abort()
        c.abort()
        bp2 = await procs.start(data, env=env)
        c2 = await Client.connect(bp2.port, nursery=nursery)
        rest = await receive_all(c2, "dq", n - 100)
        assert first == list(range(100))
        assert rest == list(range(100, n))
        r2 = await c2.receiver("dq", credit=10)
        await r2.expect_none(0.5)
        c2.abort()
    finally:
        await procs.aclose()
