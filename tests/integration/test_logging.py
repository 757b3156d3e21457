"""Logs: one line per event, each naming its connection (and link and queue).

A small scenario against a real broker on a socket (connect, attach a producer and a
consumer, an attach refused by max_links_per_connection, detach, close, and a client
that drops its socket) with every `amqbroker` logger at DEBUG: every record of the
scenario starts with `connection cN from HOST:PORT`, link events go on with
`: link 'NAME' on queue|address 'orders'`, and no record spans two lines. The CLI's
formatter keeps a record with a traceback or a peer's line break on one line.
"""

from __future__ import annotations

import logging
import re
import sys

import pytest
from proton import Message

from amqbroker.cli.server import OneLineFormatter
from tests.client import ClientError
from tests.conftest import BrokerFactory, ClientFactory, wait_idle

PREFIX_RE = re.compile(r"^connection (c\d+) from 127\.0\.0\.1:(\d+)(: |$)")


def scenario_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("amqbroker")]


async def test_every_event_names_its_connection_link_and_queue(
    make_broker: BrokerFactory, client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app = await make_broker(max_links_per_connection=2)
    caplog.set_level(logging.DEBUG, logger="amqbroker")
    caplog.clear()  # from here on, every record is about a connection

    c = await client(app, container="log-test")
    port = c.sock.getsockname()[1]
    s = await c.sender("orders", name="prod-1")
    r = await c.receiver("orders", credit=1, name="cons-1")
    await s.send(Message(body="x"))
    r.accept(await r.receive())
    refused = await c.receiver("orders", name="too-many", wait=False)
    with pytest.raises(ClientError, match="resource-limit-exceeded"):
        await refused.wait_open()
    await r.detach()
    await s.close()
    await c.close()

    lost = await client(app)
    lost_port = lost.sock.getsockname()[1]
    await lost.receiver("orders", name="cons-lost")
    lost.abort()
    await wait_idle(app)

    records = scenario_lines(caplog)
    assert records, "the scenario logged nothing"
    ids: dict[int, str] = {}
    for rec in records:
        msg = rec.getMessage()
        assert "\n" not in msg and "\r" not in msg, msg
        m = PREFIX_RE.match(msg)
        assert m, f"{rec.name}: {msg!r} does not start with 'connection cN from HOST:PORT'"
        assert ids.setdefault(int(m.group(2)), m.group(1)) == m.group(1), msg
    assert set(ids) == {port, lost_port} and len(set(ids.values())) == 2, ids

    where = f"connection {ids[port]} from 127.0.0.1:{port}"
    mine = [rec.getMessage() for rec in records if rec.getMessage().startswith(where)]
    expected = [
        (logging.DEBUG, f"{where}: open, container-id 'log-test'"),
        (logging.DEBUG, f"{where}: link 'prod-1' on address 'orders': producer attached"),
        (logging.DEBUG, f"{where}: link 'cons-1' on queue 'orders': consumer attached"),
        (
            logging.INFO,
            f"{where}: link 'too-many' on address 'orders': refused consumer attach: "
            "amqp:resource-limit-exceeded too many links on this connection",
        ),
        (logging.DEBUG, f"{where}: link 'cons-1' on queue 'orders': detached by the client"),
        (logging.DEBUG, f"{where}: link 'prod-1' on address 'orders': closed by the client"),
        (logging.DEBUG, f"{where}: closed (0 link(s) open)"),
    ]
    assert len(mine) == len(expected), mine
    by_msg = {rec.getMessage(): rec.levelno for rec in records}
    for (level, start), msg in zip(expected, mine, strict=True):
        assert msg.startswith(start), (start, mine)
        assert by_msg[msg] == level, msg

    other = f"connection {ids[lost_port]} from 127.0.0.1:{lost_port}"
    theirs = [rec.getMessage() for rec in records if rec.getMessage().startswith(other)]
    assert theirs[1] == f"{other}: link 'cons-lost' on queue 'orders': consumer attached"
    # the dropped socket: why (a transport or socket error, at INFO), then one "lost"
    assert theirs[-1] == f"{other}: lost (1 link(s) open)", theirs
    why = theirs[2:-1]
    assert 1 <= len(why) <= 2, theirs
    assert all(re.match(rf"{re.escape(other)}: (transport|socket) error ", w) for w in why)
    assert all(by_msg[w] == logging.INFO for w in why)


def test_cli_formatter_keeps_each_event_on_one_line() -> None:
    fmt = OneLineFormatter("%(levelname)s %(name)s: %(message)s")
    try:
        raise ValueError("boom")
    except ValueError:
        exc = sys.exc_info()
    rec = logging.LogRecord(
        "amqbroker.protocol.connection",
        logging.ERROR,
        __file__,
        1,
        "connection c1 from 127.0.0.1:1: peer said %r",
        ("two\nlines",),
        exc,
    )
    rec_plain = logging.LogRecord("amqbroker", logging.INFO, __file__, 1, "a\r\nforged", (), None)
    line = fmt.format(rec)
    assert "\n" not in line and "Traceback" in line and "ValueError: boom" in line, line
    assert fmt.format(rec_plain) == "INFO amqbroker: a | forged"
