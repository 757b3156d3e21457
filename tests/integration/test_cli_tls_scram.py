"""The CLI over TLS and SCRAM-SHA-256: `amqbroker queue stat` (and producer) against an
in-process broker with a TLS listener (trustme certificates made here), SCRAM users,
PLAIN-only users and client certificates mapped through tls_identity_users (EXTERNAL).
The CLI runs in-process (click's CliRunner) on a worker thread, over real sockets; its
client is `protocol.client_auth` (TLS by `ssl`, SASL by hand, then Proton).

A refusal (bad CA, wrong password, unmapped certificate, TLS to a plain port...) must
be one line on stderr and exit 2, like an unreachable broker."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from click.testing import CliRunner, Result

from amqbroker.app import BrokerApp
from amqbroker.core.auth import hash_password, hash_password_scram
from tests.conftest import BrokerFactory

SUBJECT = "CN=app,OU=Payments,O=Example"
USERS = {
    "bob": hash_password_scram("bob-pw", iterations=4096),
    "carol": hash_password("carol-pw", iterations=1000),  # pbkdf2: PLAIN only
}


@dataclass
class Pki:
    ca: Path
    server: Path  # certificate chain and key in one file
    client_cert: Path
    client_key: Path
    stranger: Path  # signed by the CA, not mapped to a user (cert and key)
    rogue_ca: Path  # a CA that signed nothing here
    other_host: Path  # a server certificate (and key) for another host name

    def broker_settings(self, **kw: Any) -> dict[str, Any]:
        return {
            "tls_listeners": ["127.0.0.1:0"],
            "tls_cert_file": str(self.server),
            "tls_key_file": str(self.server),
            **kw,
        }


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("cli-pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(
        str(d / "server.pem")
    )
    app = ca.issue_cert(
        "app@example.org",
        common_name="app",
        organization_name="Example",
        organization_unit_name="Payments",
    )
    app.cert_chain_pems[0].write_to_path(str(d / "client.pem"))
    app.private_key_pem.write_to_path(str(d / "client.key"))
    ca.issue_cert(
        "x@example.org", common_name="stranger"
    ).private_key_and_cert_chain_pem.write_to_path(str(d / "stranger.pem"))
    trustme.CA().cert_pem.write_to_path(str(d / "rogue-ca.pem"))
    ca.issue_cert("broker.example").private_key_and_cert_chain_pem.write_to_path(
        str(d / "other-host.pem")
    )
    return Pki(
        d / "ca.pem",
        d / "server.pem",
        d / "client.pem",
        d / "client.key",
        d / "stranger.pem",
        d / "rogue-ca.pem",
        d / "other-host.pem",
    )


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


def refused(r: Result, *fragments: str) -> str:
    """Exit 2 with exactly one line on stderr, naming each fragment, no traceback."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert r.stdout == "", r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("Error: cannot connect to "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def amqps(app: BrokerApp) -> str:
    return f"amqps://127.0.0.1:{app.tls_listening[0][1]}"


def amqp(app: BrokerApp) -> str:
    return f"amqp://127.0.0.1:{app.listening[0][1]}"


def names(stat_json: str) -> list[str]:
    return [row["name"] for row in json.loads(stat_json)]


# ------------------------------------------------------------- CA verification, SCRAM


async def test_queue_stat_over_amqps_with_scram_and_plain(
    make_broker: BrokerFactory, pki: Pki
) -> None:
    app = await make_broker(require_auth=True, users=USERS, **pki.broker_settings())
    url, ca = amqps(app), str(pki.ca)
    bob = ("--user", "bob", "--password", "bob-pw")
    made = await cli(
        "queue", "create", "tls.q", "--url", url, "--ca-file", ca, *bob,
        "--mechanism", "SCRAM-SHA-256",
    )  # fmt: skip
    assert ok(made).startswith("created queue 'tls.q'")
    # every option from the environment, as --url/--user/--password already were
    env = {
        "AMQBROKER_URL": url,
        "AMQBROKER_CA_FILE": ca,
        "AMQBROKER_USER": "bob",
        "AMQBROKER_PASSWORD": "bob-pw",
        "AMQBROKER_MECHANISM": "scram-sha-256",
    }
    assert "tls.q" in names(ok(await cli("queue", "stat", "--json", env=env)))
    # the client tools (producer) take the same options
    sent = await cli("producer", "tls.q", "--count", "3", env=env)
    assert ok(sent) == "sent 3 message(s) to 'tls.q'\n"
    rows = json.loads(ok(await cli("queue", "stat", "--json", "--name", "tls.q", env=env)))
    assert [(r["name"], r["messageCount"]) for r in rows] == [("tls.q", 3)]

    # it really is SCRAM: carol has a PLAIN-only (pbkdf2) hash, which SCRAM refuses
    carol = ("--user", "carol", "--password", "carol-pw", "--url", url, "--ca-file", ca)
    assert "tls.q" in names(ok(await cli("queue", "stat", "--json", *carol)))  # PLAIN
    refused(
        await cli("queue", "stat", *carol, "--mechanism", "SCRAM-SHA-256"),
        "the broker refused user 'carol' (SCRAM-SHA-256)",
    )
    # a wrong password: one line, the exit status of a refused login
    line = refused(
        await cli("queue", "stat", env={**env, "AMQBROKER_PASSWORD": "nope"}),
        "the broker refused user 'bob' (SCRAM-SHA-256)",
        "check --user/--password (AMQBROKER_USER, AMQBROKER_PASSWORD)",
    )
    assert url in line
    # SCRAM over the plain listener works too
    plain = await cli(
        "queue", "stat", "--json", "--url", amqp(app), *bob, "--mechanism", "SCRAM-SHA-256"
    )
    assert "tls.q" in names(ok(plain))


async def test_bad_ca_and_tls_mistakes_are_one_line(make_broker: BrokerFactory, pki: Pki) -> None:
    app = await make_broker(**pki.broker_settings())
    url = amqps(app)
    refused(
        await cli("queue", "stat", "--url", url, "--ca-file", str(pki.rogue_ca)),
        "TLS: the broker's certificate did not verify",
        "--ca-file (AMQBROKER_CA_FILE)",
    )
    # the system's CAs do not know the test CA either
    refused(await cli("queue", "stat", "--url", url), "did not verify")
    # the right CA, but a certificate for another host
    elsewhere = await make_broker(
        **pki.broker_settings(tls_cert_file=str(pki.other_host), tls_key_file=str(pki.other_host))
    )
    refused(
        await cli("queue", "stat", "--url", amqps(elsewhere), "--ca-file", str(pki.ca)),
        "did not verify", "127.0.0.1",
    )  # fmt: skip
    # anonymous over TLS with the right CA
    assert ok(await cli("queue", "stat", "--url", url, "--ca-file", str(pki.ca))).startswith("NAME")
    # TLS to the plain listener, TLS files with a plain URL, a missing CA file
    refused(
        await cli("queue", "stat", "--url", f"amqps://127.0.0.1:{app.listening[0][1]}",
                  "--ca-file", str(pki.ca)),
        "did not answer in TLS", "is this a TLS listener?",
    )  # fmt: skip
    refused(
        await cli("queue", "stat", "--url", amqp(app), "--ca-file", str(pki.ca)),
        "needs TLS", "use an amqps:// URL",
    )  # fmt: skip
    refused(
        await cli("queue", "stat", "--url", url, "--ca-file", str(pki.ca) + ".missing"),
        "cannot use --ca-file",
    )


# --------------------------------------------------------------------------- EXTERNAL


async def test_client_certificate_logs_in_with_external(
    make_broker: BrokerFactory, pki: Pki
) -> None:
    """Only EXTERNAL can let the CLI in here: no users, anonymous access off."""
    app = await make_broker(
        require_auth=True,
        tls_identity_users={SUBJECT: "app"},
        **pki.broker_settings(tls_client_auth="required", tls_ca_file=str(pki.ca)),
    )
    url, ca = amqps(app), str(pki.ca)
    env = {
        "AMQBROKER_URL": url,
        "AMQBROKER_CA_FILE": ca,
        "AMQBROKER_CERT_FILE": str(pki.client_cert),
        "AMQBROKER_KEY_FILE": str(pki.client_key),
    }
    ok(await cli("queue", "create", "ext.q", env=env))
    assert "ext.q" in names(ok(await cli("queue", "stat", "--json", env=env)))
    assert "ext.q" in names(
        ok(
            await cli(
                "queue", "stat", "--json", "--url", url, "--ca-file", ca,
                "--cert-file", str(pki.client_cert), "--key-file", str(pki.client_key),
                "--mechanism", "EXTERNAL",
            )
        )
    )  # fmt: skip
    # a certificate the CA signed, but mapped to no user
    refused(
        await cli("queue", "stat", "--url", url, "--ca-file", ca, "--cert-file", str(pki.stranger)),
        "the broker refused the client certificate (EXTERNAL)",
        "tls_identity_users",
    )
    # no certificate: the TLS listener requires one
    refused(await cli("queue", "stat", "--url", url, "--ca-file", ca), "TLS: ")
