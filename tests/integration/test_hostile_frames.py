"""Frames Proton cannot dispatch, over a real socket (issue 22): after a valid open
and begin, a performative with an unknown descriptor, a SASL frame, or an encoding
nested 20,000 deep. Proton ends its input on them without a condition; the broker
must answer at once with a close carrying an AMQP error and a description, close the
socket and free the connection's slots, not sit silent until the idle timeout.

Under trio's autojump clock with idle_timeout = 6 s: the whole answer must come within
1 s of trio time, so waiting for the idle timeout fails the test instead of passing
late.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
import trio

from tests.client import Client, roundtrip
from tests.conftest import BrokerFactory
from tests.integration.amqp_wire import (
    BEGIN,
    BEGIN_CODE,
    CLOSE_CODE,
    OPEN,
    OPEN_CODE,
    error_of,
    open_raw,
)
from tests.integration.sasl_wire import sasl_frame


def amqp_frame(body: bytes, ftype: int = 0) -> bytes:
    return struct.pack(">IBBH", 8 + len(body), 2, ftype, 0) + body


#: performative 0x7f with an empty list
UNKNOWN_7F = bytes.fromhex("000000150200000000537fd0000000050000000140")
#: descriptor ulong 0xFFFFFFFFFFFFFFFF with an empty list
UNKNOWN_ULONG_MAX = amqp_frame(b"\x00\x80" + b"\xff" * 8 + b"\x45")
#: a SASL frame (type 1: sasl-init ANONYMOUS) after the AMQP open
SASL_AFTER_OPEN = sasl_frame(0x41, ("symbol", "ANONYMOUS"))
#: 20,000 nested described-type constructors around an open
DEEP_NESTING = amqp_frame(b"\x00" * 20_000 + b"\x53\x10\x45")

HOSTILE = {
    "descriptor 0x7f": UNKNOWN_7F,
    "descriptor ulong max": UNKNOWN_ULONG_MAX,
    "SASL frame after open": SASL_AFTER_OPEN,
    "20000 nested constructors": DEEP_NESTING,
}


@pytest.mark.parametrize("frame", HOSTILE.values(), ids=list(HOSTILE))
async def test_undispatchable_frame_is_answered_at_once_and_frees_the_slot(
    make_broker: BrokerFactory, nursery: trio.Nursery, autojump_clock: Any, frame: bytes
) -> None:
    app = await make_broker(idle_timeout=6, max_connections=1, max_connections_per_address=1)
    port = app.listening[0][1]
    wire = await open_raw(port, OPEN, BEGIN)
    try:
        await wire.until(OPEN_CODE)
        await wire.until(BEGIN_CODE)
        await wire.send(frame)
        with trio.fail_after(1):  # far below idle_timeout (6 s)
            fields = await wire.until(CLOSE_CODE)
            assert await wire.at_eof(1), "the broker kept the socket open"
        condition, description = error_of(fields)
        assert condition in ("amqp:connection:framing-error", "amqp:decode-error"), condition
        assert description, "no description"
        assert "idle" not in description, description
        # the slots (max_connections and per address) are free right away
        assert app.server.per_address == {}
        with trio.fail_after(1):
            c = await Client.connect(port, nursery=nursery)
            try:
                await roundtrip(c)
            finally:
                await c.close()
    finally:
        wire.sock.close()
