"""SASL frames spoken by hand on a socket, for the tests that check what the broker's
SASL layer sends byte for byte (PLAIN/ANONYMOUS in test_sasl_socket, SCRAM in
test_scram), and the one-message round trip that shows an authenticated connection
really works."""

from __future__ import annotations

import struct
from typing import Any

import trio
from proton import Data, Delivery, Message

from tests.client import Client


def sasl_frame(descriptor: int, *fields: tuple[str, Any]) -> bytes:
    """Encode a SASL frame: [(kind, value), ...] in the performative's field order."""
    d = Data()
    d.put_described()
    d.enter()
    d.put_ulong(descriptor)
    d.put_list()
    d.enter()
    for kind, value in fields:
        getattr(d, f"put_{kind}")(value)
    d.exit()
    d.exit()
    body = d.encode()
    return struct.pack(">IBBH", 8 + len(body), 2, 1, 0) + body


class SaslWire:
    """Reads SASL frames (and then raw bytes) from a socket; every wait is bounded."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.buf = b""

    async def send(self, data: bytes) -> None:
        await self.sock.send(data)

    async def read(self, n: int) -> bytes:
        with trio.fail_after(10):
            while len(self.buf) < n:
                chunk = await self.sock.recv(65536)
                if not chunk:
                    raise EOFError(f"connection closed; unread {self.buf!r}")
                self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    async def header(self) -> bytes:
        return await self.read(8)

    async def frame(self) -> tuple[int, list[Any]]:
        """Next SASL frame: (descriptor code, list of fields; binaries as bytes)."""
        size, doff, ftype, _ = struct.unpack(">IBBH", await self.read(8))
        assert ftype == 1, f"not a SASL frame (type {ftype})"
        assert await self.read(doff * 4 - 8) == b""
        d = Data()
        d.decode(await self.read(size - doff * 4))
        d.rewind()
        d.next()
        d.enter()
        d.next()
        descriptor = int(d.get_ulong())
        d.next()
        d.enter()
        fields: list[Any] = []
        while d.next() is not None:
            value = d.get_object()
            fields.append(bytes(value) if isinstance(value, memoryview) else value)
        return descriptor, fields

    async def at_eof(self, timeout: float = 10) -> bool:
        """The broker closed the socket within `timeout` (bytes read meanwhile are
        kept)."""
        with trio.move_on_after(timeout):
            while True:
                chunk = await self.sock.recv(65536)
                if not chunk:
                    return True
                self.buf += chunk
        return False


async def roundtrip(c: Client, address: str) -> None:
    """The connection really works: send one message and receive it back."""
    s = await c.sender(address)
    d = await s.send(Message(body="ping"))
    assert d.remote_state == Delivery.ACCEPTED
    r = await c.receiver(address, credit=1)
    got = await r.receive()
    assert got.body == "ping"
    r.accept(got)
