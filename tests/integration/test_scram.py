"""SCRAM-SHA-256, EXTERNAL and the anonymous-access policy, over real sockets.

The SCRAM client is scramp (an independent implementation from PyPI); the SASL frames
it travels in are written and read by the small `Wire` helper below, and after a
successful outcome a SASL-less Proton client transport opens the AMQP connection on
the same socket. PLAIN and ANONYMOUS use the Proton test client; EXTERNAL runs over a
TLS listener with a client certificate from a test CA (trustme).

The PyPI Proton wheel cannot be the SCRAM client: it has no Cyrus SASL
(`proton.SASL.extended()` is False), so it only does ANONYMOUS, PLAIN and EXTERNAL.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import scramp
import trio
import trustme
from proton import Connection, Endpoint, SSLDomain, Transport

from amqbroker.app import BrokerApp
from amqbroker.core.auth import hash_password, hash_password_scram
from amqbroker.protocol import sasl_scram
from tests.client import Client, ClientError
from tests.conftest import BrokerFactory
from tests.integration.broker_process import clean_env
from tests.integration.sasl_wire import SaslWire, roundtrip, sasl_frame

SCRAM = "SCRAM-SHA-256"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
SASL_MECHANISMS, SASL_INIT, SASL_CHALLENGE, SASL_RESPONSE, SASL_OUTCOME = range(0x40, 0x45)
OK, AUTH = 0, 1
ITERATIONS = 4096  # the RFC 7677 minimum: the client's PBKDF2 stays quick
SASL_LOGGER = "amqbroker.protocol.connection"

USERS = {
    "bob": hash_password_scram("bob-pw", iterations=ITERATIONS),
    "carol": hash_password("carol-pw", iterations=1000),  # pbkdf2: PLAIN only
}


# --------------------------------------------------------------------------- helpers


class Wire(SaslWire):
    """SASL frames on a socket, then raw AMQP bytes."""

    async def mechanisms(self) -> list[str]:
        await self.send(SASL_HEADER)
        assert await self.read(8) == SASL_HEADER
        descriptor, fields = await self.frame()
        assert descriptor == SASL_MECHANISMS
        return [str(m) for m in fields[0]]

    async def amqp_open(self) -> Connection:
        """Open an AMQP connection over the authenticated socket (a Proton client
        transport without SASL); returns it once the broker's open arrived."""
        conn = Connection()
        conn.container = "scram-test"
        t = Transport()
        t.bind(conn)
        conn.open()
        with trio.fail_after(10):
            while not conn.state & Endpoint.REMOTE_ACTIVE:
                pending = t.pending()
                if pending > 0:
                    await self.send(t.peek(pending))
                    t.pop(pending)
                if self.buf:
                    t.push(self.buf)
                    self.buf = b""
                    continue
                chunk = await self.sock.recv(65536)
                assert chunk, f"the broker closed the connection: {t.condition}"
                t.push(chunk)
        return conn


@pytest.fixture
async def wire() -> AsyncIterator[Callable[[int], Awaitable[Wire]]]:
    socks: list[trio.socket.SocketType] = []

    async def open_wire(port: int) -> Wire:
        s = trio.socket.socket()
        socks.append(s)
        await s.connect(("127.0.0.1", port))
        return Wire(s)

    try:
        yield open_wire
    finally:
        for s in socks:
            s.close()


def port_of(app: BrokerApp) -> int:
    return int(app.listening[0][1])


async def scram_exchange(
    w: Wire, user: str, password: str, *, gs2_hook: Callable[[bytes], bytes] | None = None
) -> tuple[scramp.ScramClient, list[Any]]:
    """Run SCRAM-SHA-256 with scramp up to the outcome; returns the client and the
    sasl-outcome fields (the exchange stops early if the broker answers an outcome
    instead of a challenge)."""
    assert SCRAM in await w.mechanisms()
    client = scramp.ScramClient([SCRAM], user, password)
    first = client.get_client_first().encode()
    if gs2_hook is not None:
        first = gs2_hook(first)
    await w.send(sasl_frame(SASL_INIT, ("symbol", SCRAM), ("binary", first)))
    descriptor, fields = await w.frame()
    if descriptor == SASL_OUTCOME:
        return client, fields
    assert descriptor == SASL_CHALLENGE
    client.set_server_first(fields[0].decode())
    final = client.get_client_final().encode()
    await w.send(sasl_frame(SASL_RESPONSE, ("binary", final)))
    descriptor, fields = await w.frame()
    assert descriptor == SASL_OUTCOME
    return client, fields


async def refused(port: int, nursery: trio.Nursery, **kw: Any) -> str:
    """Connect expecting a refusal; returns the ClientError text. Client.connect does
    not close its socket when refused: the sockets it creates are closed here."""
    created: list[trio.socket.SocketType] = []
    real = trio.socket.socket

    def tracking(*args: Any, **kwargs: Any) -> trio.socket.SocketType:
        sock = real(*args, **kwargs)
        created.append(sock)
        return sock

    trio.socket.socket = tracking  # type: ignore[assignment]
    try:
        with pytest.raises(ClientError) as info:
            await Client.connect(port, nursery=nursery, timeout=10, **kw)
    finally:
        trio.socket.socket = real  # type: ignore[assignment]
        for sock in created:
            sock.close()
    return str(info.value)


def sasl_log(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == SASL_LOGGER)


# ----------------------------------------------------------------------------- SCRAM


async def test_scramp_logs_in_and_the_connection_works(
    make_broker: BrokerFactory,
    wire: Callable[[int], Awaitable[Wire]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    verified_in: list[bool] = []
    real_verify = sasl_scram.scram_verify

    def recording(*args: Any) -> Any:
        verified_in.append(threading.current_thread() is threading.main_thread())
        return real_verify(*args)

    monkeypatch.setattr(sasl_scram, "scram_verify", recording)
    app = await make_broker(users=USERS, require_auth=True)
    w = await wire(port_of(app))
    assert await w.mechanisms() == [SCRAM, "PLAIN"]
    client = scramp.ScramClient([SCRAM], "bob", "bob-pw")
    await w.send(
        sasl_frame(SASL_INIT, ("symbol", SCRAM), ("binary", client.get_client_first().encode()))
    )
    descriptor, fields = await w.frame()
    assert descriptor == SASL_CHALLENGE
    [conn] = list(app.hub.drivers)
    assert conn.in_sasl and conn.sasl_may_block  # the response is fed in a worker thread
    client.set_server_first(fields[0].decode())
    await w.send(sasl_frame(SASL_RESPONSE, ("binary", client.get_client_final().encode())))
    descriptor, fields = await w.frame()
    assert (descriptor, fields[0]) == (SASL_OUTCOME, OK)
    client.set_server_final(fields[1].decode())  # the broker proved it knows the key
    assert verified_in == [False], "the SCRAM proof was checked on the event loop thread"
    opened = await w.amqp_open()
    assert opened.remote_container == "amqbroker"
    assert conn.user == "bob"


@pytest.mark.parametrize(
    ("user", "password", "logged"),
    [
        ("bob", "wrong", "user 'bob' (SCRAM-SHA-256): wrong password"),
        ("mallory", "bob-pw", "user 'mallory' (SCRAM-SHA-256): no such user"),
        ("carol", "carol-pw", "hash-password --scram"),
    ],
)
async def test_scram_refusals_end_with_auth_and_close(
    make_broker: BrokerFactory,
    wire: Callable[[int], Awaitable[Wire]],
    caplog: pytest.LogCaptureFixture,
    user: str,
    password: str,
    logged: str,
) -> None:
    caplog.set_level(logging.INFO, SASL_LOGGER)
    app = await make_broker(users=USERS, require_auth=True)
    w = await wire(port_of(app))
    _, outcome = await scram_exchange(w, user, password)
    assert outcome == [AUTH]  # no additional-data on failure
    assert await w.at_eof(), "the broker kept the connection open after a failed login"
    assert logged in sasl_log(caplog)


async def test_scram_channel_binding_is_refused_with_a_clear_log_line(
    make_broker: BrokerFactory,
    wire: Callable[[int], Awaitable[Wire]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, SASL_LOGGER)
    app = await make_broker(users=USERS, require_auth=True)
    w = await wire(port_of(app))
    _, outcome = await scram_exchange(
        w, "bob", "bob-pw", gs2_hook=lambda first: b"p=tls-unique" + first[1:]
    )
    assert outcome == [AUTH]
    assert await w.at_eof()
    assert "requires channel binding ('tls-unique'), which this broker does not support" in (
        sasl_log(caplog)
    )


async def test_plain_still_works_for_scram_and_pbkdf2_users(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(users=USERS, require_auth=True)
    port = port_of(app)
    for user, password in (("bob", "bob-pw"), ("carol", "carol-pw")):
        c = await Client.connect(port, nursery=nursery, user=user, password=password)
        try:
            await roundtrip(c, f"scram.plain.{user}")
        finally:
            await c.close()
    text = await refused(port, nursery, user="bob", password="nope")
    assert "amqp:unauthorized-access" in text


async def test_cli_scram_hash_logs_in_with_scramp(
    make_broker: BrokerFactory, wire: Callable[[int], Awaitable[Wire]]
) -> None:
    exe = Path(sys.executable).with_name("amqbroker")
    with trio.fail_after(30):
        done = await trio.run_process(
            [str(exe), "hash-password", "--scram", "--iterations", "4096", "--password", "pw"],
            capture_stdout=True,
            capture_stderr=True,
            env=clean_env(),
        )
    assert done.returncode == 0, done.stderr.decode()
    stored = done.stdout.decode().strip()
    assert stored.startswith("scram-sha-256$4096$"), stored
    app = await make_broker(users={"dana": stored}, require_auth=True)
    w = await wire(port_of(app))
    client, outcome = await scram_exchange(w, "dana", "pw")
    assert outcome[0] == OK
    client.set_server_final(outcome[1].decode())
    await w.amqp_open()


# ------------------------------------------------------------------- anonymous access


async def test_anonymous_refused_when_disabled(
    make_broker: BrokerFactory,
    wire: Callable[[int], Awaitable[Wire]],
    nursery: trio.Nursery,
) -> None:
    app = await make_broker(users=USERS, allow_anonymous=False)
    port = port_of(app)
    w = await wire(port)
    assert await w.mechanisms() == [SCRAM, "PLAIN"]
    await w.send(sasl_frame(SASL_INIT, ("symbol", "ANONYMOUS"), ("binary", b"")))
    assert await w.frame() == (SASL_OUTCOME, [AUTH])
    assert await w.at_eof()
    # (a Proton client limited to ANONYMOUS gives up by itself on this list:
    # test_sasl.py::test_allow_anonymous_false_offers_no_anonymous)
    assert "SASL" in await refused(port, nursery, sasl=False)  # no SASL = anonymous too
    c = await Client.connect(port, nursery=nursery, user="bob", password="bob-pw")
    await c.close()


async def test_anonymous_allowed_by_default(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker()
    c = await Client.connect(port_of(app), nursery=nursery)
    try:
        await roundtrip(c, "scram.anonymous")
    finally:
        await c.close()


# -------------------------------------------------------------------------- EXTERNAL

SUBJECT = "CN=app,OU=Payments,O=Example"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("external-pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server = ca.issue_cert("127.0.0.1")
    server.private_key_and_cert_chain_pem.write_to_path(str(d / "server.pem"))
    issued = {
        "app": ca.issue_cert(
            "app@example.org",
            common_name="app",
            organization_name="Example",
            organization_unit_name="Payments",
        ),
        "stranger": ca.issue_cert("stranger@example.org", common_name="stranger"),
    }
    for name, cert in issued.items():
        cert.private_key_and_cert_chain_pem.write_to_path(str(d / f"{name}.pem"))
    return {"dir": d, **{p.stem: p for p in d.glob("*.pem")}}


def client_domain(certs: dict[str, Path], who: str) -> SSLDomain:
    d = SSLDomain(SSLDomain.MODE_CLIENT)
    d.set_trusted_ca_db(str(certs["ca"]))
    d.set_peer_authentication(SSLDomain.VERIFY_PEER)
    d.set_credentials(str(certs[who]), str(certs[who]), None)
    return d


async def test_external_with_a_client_certificate(
    make_broker: BrokerFactory,
    nursery: trio.Nursery,
    wire: Callable[[int], Awaitable[Wire]],
    certs: dict[str, Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, SASL_LOGGER)
    app = await make_broker(
        require_auth=True,
        tls_identity_users={SUBJECT: "app"},
        tls_listeners=["127.0.0.1:0"],
        tls_cert_file=str(certs["server"]),
        tls_key_file=str(certs["server"]),
        tls_ca_file=str(certs["ca"]),
        tls_client_auth="required",
    )
    tls_port = int(app.tls_listening[0][1])
    c = await Client.connect(
        tls_port, nursery=nursery, mechs="EXTERNAL", ssl_domain=client_domain(certs, "app")
    )
    try:
        await roundtrip(c, "external.ok")
        [conn] = list(app.hub.drivers)
        assert (conn.tls_identity, conn.user) == (SUBJECT, "app")
    finally:
        await c.close()
    # a certificate the CA signed, but not mapped to a user
    text = await refused(
        tls_port, nursery, mechs="EXTERNAL", ssl_domain=client_domain(certs, "stranger")
    )
    assert "amqp:unauthorized-access" in text
    log = sasl_log(caplog)
    assert "TLS client certificate 'CN=stranger," in log
    assert "is not mapped to a user (EXTERNAL); add it to tls_identity_users" in log
    # the plain listener has nothing to offer: no users, no certificate
    w = await wire(port_of(app))
    assert await w.mechanisms() == []
    assert await w.at_eof()
