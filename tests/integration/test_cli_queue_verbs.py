"""`amqbroker queue move` and `queue retry` (the moveMessages and retryMessages
management operations) against an in-process broker over a real socket: the CLI runs
in-process (click's CliRunner) on a worker thread; messages are sent, rejected (dead
letters) and taken back with the Proton test client."""

from __future__ import annotations

import json
import os
from typing import Any

import trio
from click.testing import CliRunner, Result
from proton import Message

from amqbroker.app import BrokerApp
from tests.client import Client
from tests.conftest import BrokerFactory
from tests.integration.groups_helpers import until


async def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    from amqbroker.cli import main

    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("AMQBROKER_")}
    runner = CliRunner()
    with trio.fail_after(60):
        return await trio.to_thread.run_sync(
            lambda: runner.invoke(main, list(args), env={**unset, **(env or {})})
        )


def ok(r: Result) -> str:
    assert r.exit_code == 0, (r.exit_code, r.output, r.exception)
    return r.stdout


async def messages(app: BrokerApp, queue: str) -> int:
    r = await cli("queue", "show", queue, "--json", "--url", url_of(app))
    count: int = json.loads(ok(r))["messageCount"]
    return count


def url_of(app: BrokerApp) -> str:
    return f"amqp://127.0.0.1:{app.listening[0][1]}"


async def test_move_with_a_selector_and_retry_dead_letters(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(
        address_settings={"orders": {"dead_letter_address": "DLQ"}},
        addresses=[{"name": "DLQ", "routing": "anycast"}],
    )
    env = {"AMQBROKER_URL": url_of(app)}
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        s = await c.sender("orders")
        await s.send_many(
            [Message(body=f"d{i}", properties={"n": i, "region": "eu"}) for i in range(3)]
        )
        r = await c.receiver("orders", credit=3)
        for got in await r.receive_n(3):
            r.reject(got)  # dead letters, with x-opt-ORIG-ADDRESS = orders
        await r.close()
        await until(app, "DLQ", "messages", 3)  # the rejections are processed
        ok(await cli("queue", "create", "parking", env=env))

        moved = await cli("queue", "move", "DLQ", "parking", "--selector", "n = 1", env=env)
        assert ok(moved) == "queue 'DLQ': 1 message(s) matching 'n = 1' moved to 'parking'\n"
        none = await cli("queue", "move", "DLQ", "parking", "--filter", "n = 7", "--json", env=env)
        assert json.loads(ok(none)) == {
            "queue": "DLQ",
            "toQueue": "parking",
            "selector": "n = 7",
            "moved": 0,
        }
        assert (await messages(app, "DLQ"), await messages(app, "parking")) == (2, 1)

        # refusals: exit 1 with the broker's status and description
        bad = await cli("queue", "move", "DLQ", "parking", "--selector", "n = = 1", env=env)
        assert bad.exit_code == 1 and "moveMessages (400): bad filter 'n = = 1'" in bad.stderr
        missing = await cli("queue", "move", "DLQ", "nowhere", env=env)
        assert missing.exit_code == 1
        assert "moveMessages (404): no queue named 'nowhere'" in missing.stderr

        retried = json.loads(ok(await cli("queue", "retry", "DLQ", "--json", env=env)))
        assert retried == {"queue": "DLQ", "retried": 2}
        text = ok(await cli("queue", "retry", "parking", env=env))
        assert text == "queue 'parking': 1 message(s) sent back to their original address\n"
        assert ok(await cli("queue", "retry", "parking", env=env)).startswith(
            "queue 'parking': 0 message(s)"
        )

        r = await c.receiver("orders", credit=3)
        got = await r.receive_n(3)
        assert sorted(g.body for g in got) == ["d0", "d1", "d2"]
        for g in got:
            r.accept(g)

        # moving everything (no selector) from one plain queue to another
        ok(await cli("queue", "create", "a", env=env))
        ok(await cli("producer", "a", "--count", "4", env=env))
        ok(await cli("queue", "create", "b", env=env))
        every: dict[str, Any] = json.loads(
            ok(await cli("queue", "move", "a", "b", "--json", env=env))
        )
        assert (every["moved"], every["selector"]) == (4, None)
        assert (await messages(app, "a"), await messages(app, "b")) == (0, 4)
    finally:
        c.abort()
