"""SASL over real sockets: PLAIN with hashed users, ANONYMOUS, no SASL at all.

Most tests run the broker in-process (`make_broker`) and connect the trio Proton client
over TCP; a few speak raw SASL frames to check exactly what the broker offers and
answers, and one runs the broker as a subprocess configured from the environment.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from amqbroker.core.auth import hash_password
from tests.client import Client, ClientError
from tests.conftest import BrokerFactory
from tests.integration.broker_process import BrokerProcesses, clean_env
from tests.integration.sasl_wire import SaslWire, roundtrip, sasl_frame

# a cheap hash for most tests; the CLI test below uses the real default iteration count
FAST_ITERATIONS = 1000
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
SASL_MECHANISMS = 0x40
SASL_INIT = 0x41
SASL_OUTCOME = 0x44
SASL_CODE_OK = 0
SASL_CODE_AUTH = 1


# --------------------------------------------------------------------------- helpers


@contextmanager
def _track_sockets() -> Iterator[list[trio.socket.SocketType]]:
    """Collect the sockets trio.socket.socket() creates (Client.connect does not close
    its socket when the connection is refused)."""
    created: list[trio.socket.SocketType] = []
    real: Callable[..., trio.socket.SocketType] = trio.socket.socket

    def tracking(*args: Any, **kwargs: Any) -> trio.socket.SocketType:
        sock = real(*args, **kwargs)
        created.append(sock)
        return sock

    trio.socket.socket = tracking  # type: ignore[assignment]
    try:
        yield created
    finally:
        trio.socket.socket = real  # type: ignore[assignment]


class Clients:
    """Connects clients; every socket is closed when the test ends."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.clients: list[Client] = []
        self.sockets: list[trio.socket.SocketType] = []

    async def connect(self, port: int, **kw: Any) -> Client:
        kw.setdefault("timeout", 10.0)
        with _track_sockets() as created:
            try:
                c = await Client.connect(port, nursery=self.nursery, **kw)
            finally:
                self.sockets.extend(created)
        self.clients.append(c)
        return c

    async def refused(self, port: int, **kw: Any) -> str:
        """Connect expecting a refusal; returns the ClientError text."""
        with pytest.raises(ClientError) as info:
            await self.connect(port, **kw)
        return str(info.value)

    def close_all(self) -> None:
        for c in self.clients:
            c.abort()
        for s in self.sockets:
            s.close()


@pytest.fixture
async def clients(nursery: trio.Nursery) -> AsyncIterator[Clients]:
    cs = Clients(nursery)
    try:
        yield cs
    finally:
        cs.close_all()


@pytest.fixture
async def raw_socket() -> AsyncIterator[Callable[[int], Any]]:
    socks: list[trio.socket.SocketType] = []

    async def open_raw(port: int) -> SaslWire:
        s = trio.socket.socket()
        socks.append(s)
        await s.connect(("127.0.0.1", port))
        return SaslWire(s)

    try:
        yield open_raw
    finally:
        for s in socks:
            s.close()


def _mechanisms(fields: list[Any]) -> list[str]:
    mechs = fields[0]
    if isinstance(mechs, str):  # a single symbol may be sent instead of an array
        return [str(mechs)]
    return [str(m) for m in mechs]


def _port(app: Any) -> int:
    return int(app.listening[0][1])


# ----------------------------------------------------------------------------- PLAIN


async def test_plain_good_password_opens(make_broker: BrokerFactory, clients: Clients) -> None:
    app = await make_broker(users={"alice": hash_password("s3cret", iterations=FAST_ITERATIONS)})
    c = await clients.connect(_port(app), user="alice", password="s3cret")
    await roundtrip(c, "sasl.plain.ok")


async def test_plain_bad_password_is_an_authentication_failure(
    make_broker: BrokerFactory, clients: Clients
) -> None:
    app = await make_broker(users={"alice": hash_password("s3cret", iterations=FAST_ITERATIONS)})
    port = _port(app)
    text = await clients.refused(port, user="alice", password="wrong")
    assert "amqp:unauthorized-access" in text
    # an unknown user is refused the same way
    text = await clients.refused(port, user="mallory", password="s3cret")
    assert "amqp:unauthorized-access" in text
    # and the broker still serves the right password afterwards
    c = await clients.connect(port, user="alice", password="s3cret")
    await roundtrip(c, "sasl.plain.after-failure")


async def test_plain_wrong_password_gets_auth_outcome_and_close(
    make_broker: BrokerFactory, raw_socket: Callable[[int], Any]
) -> None:
    """Byte level: sasl-outcome code 1 (auth), then the broker closes the socket."""
    app = await make_broker(users={"alice": hash_password("s3cret", iterations=FAST_ITERATIONS)})
    raw: SaslWire = await raw_socket(_port(app))
    await raw.sock.send(SASL_HEADER)
    assert await raw.header() == SASL_HEADER
    code, fields = await raw.frame()
    assert code == SASL_MECHANISMS
    assert "PLAIN" in _mechanisms(fields)
    await raw.sock.send(sasl_frame(SASL_INIT, ("symbol", "PLAIN"), ("binary", b"\0alice\0nope")))
    code, fields = await raw.frame()
    assert (code, fields[0]) == (SASL_OUTCOME, SASL_CODE_AUTH)
    assert await raw.at_eof(), "the broker kept the connection open after a failed login"


# ------------------------------------------------------------------ require_auth


async def test_require_auth_offers_only_plain_and_refuses_anonymous(
    make_broker: BrokerFactory, raw_socket: Callable[[int], Any], clients: Clients
) -> None:
    app = await make_broker(
        users={"alice": hash_password("s3cret", iterations=FAST_ITERATIONS)}, require_auth=True
    )
    port = _port(app)
    raw: SaslWire = await raw_socket(port)
    await raw.sock.send(SASL_HEADER)
    assert await raw.header() == SASL_HEADER
    code, fields = await raw.frame()
    assert code == SASL_MECHANISMS
    assert _mechanisms(fields) == ["PLAIN"]
    # a client that insists on ANONYMOUS anyway is refused
    await raw.sock.send(sasl_frame(SASL_INIT, ("symbol", "ANONYMOUS"), ("binary", b"")))
    code, fields = await raw.frame()
    assert code == SASL_OUTCOME
    assert fields[0] != SASL_CODE_OK
    assert await raw.at_eof()
    # PLAIN still works
    c = await clients.connect(port, user="alice", password="s3cret")
    await roundtrip(c, "sasl.required.ok")


async def test_require_auth_refuses_a_client_without_sasl(
    make_broker: BrokerFactory, clients: Clients, raw_socket: Callable[[int], Any]
) -> None:
    app = await make_broker(
        users={"alice": hash_password("s3cret", iterations=FAST_ITERATIONS)}, require_auth=True
    )
    port = _port(app)
    text = await clients.refused(port, sasl=False)
    assert "SASL" in text or "unauthorized" in text, text
    # byte level: the broker answers the plain AMQP header with its SASL header, then
    # closes
    raw: SaslWire = await raw_socket(port)
    await raw.sock.send(AMQP_HEADER)
    assert await raw.header() == SASL_HEADER
    assert await raw.at_eof()


# ------------------------------------------------------------ anonymous / no SASL


async def test_anonymous_allowed_by_default(make_broker: BrokerFactory, clients: Clients) -> None:
    app = await make_broker()
    c = await clients.connect(_port(app))  # SASL ANONYMOUS
    await roundtrip(c, "sasl.anonymous")


async def test_anonymous_offered_alongside_plain_when_not_required(
    make_broker: BrokerFactory, clients: Clients, raw_socket: Callable[[int], Any]
) -> None:
    app = await make_broker(users={"alice": hash_password("s3cret", iterations=FAST_ITERATIONS)})
    port = _port(app)
    raw: SaslWire = await raw_socket(port)
    await raw.sock.send(SASL_HEADER)
    assert await raw.header() == SASL_HEADER
    code, fields = await raw.frame()
    assert code == SASL_MECHANISMS
    assert set(_mechanisms(fields)) == {"PLAIN", "ANONYMOUS"}
    c = await clients.connect(port)
    await roundtrip(c, "sasl.anonymous.with-users")


async def test_client_without_sasl_works_when_auth_not_required(
    make_broker: BrokerFactory, clients: Clients
) -> None:
    app = await make_broker()
    c = await clients.connect(_port(app), sasl=False)
    await roundtrip(c, "sasl.none")


@pytest.mark.slow
async def test_stalled_sasl_exchange_is_disconnected(
    make_broker: BrokerFactory, raw_socket: Callable[[int], Any]
) -> None:
    """A client that sends the SASL header and then nothing must not hold a connection
    forever: the broker drops it after handshake_timeout."""
    app = await make_broker(handshake_timeout=1.0)
    raw: SaslWire = await raw_socket(_port(app))
    await raw.sock.send(SASL_HEADER)
    assert await raw.header() == SASL_HEADER
    code, _ = await raw.frame()
    assert code == SASL_MECHANISMS
    assert await raw.at_eof(timeout=5), (
        "the broker kept a connection that never finished SASL for 5 s (handshake_timeout 1 s)"
    )


# ------------------------------------------------ the CLI hash, end to end (slow-ish)


async def _hash_with_cli(password: str) -> str:
    exe = Path(sys.executable).with_name("amqbroker")
    assert exe.exists(), f"console script missing: {exe}"
    with trio.fail_after(30):
        done = await trio.run_process(
            [str(exe), "hash-password", "--password", password],
            capture_stdout=True,
            capture_stderr=True,
            env=clean_env(),
        )
    out = done.stdout.decode().strip()
    assert done.returncode == 0, done.stderr.decode()
    assert out.startswith("pbkdf2-sha256$"), out
    assert len(out.splitlines()) == 1, out
    return out


async def test_cli_hash_password_output_is_accepted_by_the_broker(
    make_broker: BrokerFactory, clients: Clients
) -> None:
    stored = await _hash_with_cli("x")
    app = await make_broker(users={"carol": stored}, require_auth=True)
    port = _port(app)
    c = await clients.connect(port, user="carol", password="x")
    await roundtrip(c, "sasl.cli-hash")
    text = await clients.refused(port, user="carol", password="y")
    assert "amqp:unauthorized-access" in text


@pytest.mark.slow
async def test_subprocess_broker_with_users_from_environment(
    nursery: trio.Nursery, tmp_path: Path, clients: Clients
) -> None:
    """The real process: AMQBROKER_USERS (JSON) + AMQBROKER_REQUIRE_AUTH from the env."""
    stored = await _hash_with_cli("pw")
    procs = BrokerProcesses(nursery, cwd=tmp_path)
    try:
        bp = await procs.start(
            tmp_path / "data",
            env={
                "AMQBROKER_USERS": json.dumps({"dave": stored}),
                "AMQBROKER_REQUIRE_AUTH": "true",
            },
        )
        assert bp.port is not None
        assert stored not in bp.stdout + bp.stderr, "a password hash was logged"
        c = await clients.connect(bp.port, user="dave", password="pw")
        await roundtrip(c, "sasl.subprocess")
        text = await clients.refused(bp.port, user="dave", password="nope")
        assert "amqp:unauthorized-access" in text
        text = await clients.refused(bp.port, sasl=False)
        assert "SASL" in text or "unauthorized" in text, text
        await c.close()
    finally:
        await procs.aclose()
