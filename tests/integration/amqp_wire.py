"""AMQP frames spoken by hand on a socket, for tests that send what no client library
would (unknown performatives, SASL frames after the open, deep nesting) or that keep
a socket open without ever closing it."""

from __future__ import annotations

import struct
from typing import Any

import trio
from proton import Data

from tests.integration.sasl_wire import SaslWire

#: AMQP protocol header, open (container-id "fz", max-frame-size 65536) and begin,
#: as a raw client sends them (no SASL)
HEADER = bytes.fromhex("414d515000010000")
OPEN = bytes.fromhex("0000001e02000000005310d00000000e00000003a102667a407000010000")
BEGIN = bytes.fromhex("0000002402000000005311d0000000140000000440700000000070000000647000000064")
#: close with no error
CLOSE = bytes.fromhex("0000000c0200000000531845")

OPEN_CODE = 0x10
BEGIN_CODE = 0x11
CLOSE_CODE = 0x18


class AmqpWire(SaslWire):
    """Reads AMQP frames from a socket after the protocol header; every wait is
    bounded (by the caller's deadline, or SaslWire's 10 s)."""

    async def amqp_frame(self) -> tuple[int, list[Any]]:
        """Next non-empty AMQP frame: (performative code, fields); heartbeats are
        skipped."""
        while True:
            size, doff, ftype, _ = struct.unpack(">IBBH", await self.read(8))
            assert ftype == 0, f"not an AMQP frame (type {ftype})"
            await self.read(doff * 4 - 8)
            body = await self.read(size - doff * 4)
            if not body:
                continue  # heartbeat
            d = Data()
            d.decode(body)
            d.rewind()
            d.next()
            d.enter()
            d.next()
            code = int(d.get_ulong())
            d.next()
            obj = d.get_object()
            return code, list(obj) if obj is not None else []

    async def until(self, code: int) -> list[Any]:
        """The fields of the next frame with performative `code` (earlier ones are
        skipped)."""
        while True:
            got, fields = await self.amqp_frame()
            if got == code:
                return fields


def error_of(close_fields: list[Any]) -> tuple[str, str]:
    """(condition, description) of a close/detach/end frame's error field."""
    assert close_fields, "no error in the frame"
    err = close_fields[0]
    fields = list(err.value)
    return str(fields[0]), str(fields[1]) if len(fields) > 1 else ""


async def open_raw(port: int, *frames: bytes) -> AmqpWire:
    """A raw client: connect, send the AMQP header and `frames`."""
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    wire = AmqpWire(sock)
    await wire.send(HEADER + b"".join(frames))
    assert await wire.header() == HEADER
    return wire
