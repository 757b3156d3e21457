"""The replication stream over TLS (`cluster_tls`): a backup dials the primary's TLS
listener, verifies its certificate against `cluster_tls_ca_file` and mirrors it; a
backup that cannot verify the certificate never syncs and says why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
import trustme

from amqbroker.app import BrokerApp, StartupError
from amqbroker.settings import Settings
from tests.ha.test_full_sync import send, settings, snapshot, start


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
    server.private_key_pem.write_to_path(str(d / "server.key"))
    return d


class _OnMessage(logging.Handler):
    """Sets `event` when a record (logged on the trio thread) contains `text`."""

    def __init__(self, text: str, event: trio.Event) -> None:
        super().__init__()
        self.text, self.event = text, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


async def _remove_handler_at_exit(h: logging.Handler) -> None:
    try:
        await trio.sleep_forever()
    finally:
        logging.getLogger("amqbroker.ha.mirror").removeHandler(h)


def primary_settings(tmp_path: Path, pki: Path) -> Settings:
    return settings(
        tmp_path / "p",
        ha_role="primary",
        tls_listeners=["127.0.0.1:0"],
        tls_cert_file=str(pki / "server.pem"),
        tls_key_file=str(pki / "server.key"),
    )


async def test_backup_mirrors_over_tls(tmp_path: Path, pki: Path) -> None:
    async with trio.open_nursery() as n:
        primary = BrokerApp(primary_settings(tmp_path, pki))
        await start(n, primary)
        port = primary.listening[0][1]
        tls_port = primary.tls_listening[0][1]
        await send(port, n, range(50))
        backup = BrokerApp(
            settings(
                tmp_path / "b",
                ha_role="backup",
                ha_primary=f"127.0.0.1:{tls_port}",
                cluster_tls=True,
                cluster_tls_ca_file=str(pki / "ca.pem"),
            )
        )
        await start(n, backup)
        assert primary.primary is not None and backup.mirror is not None
        with trio.fail_after(20):
            await primary.primary.synced.wait()
        await send(port, n, range(50, 80))  # cycles in sync wait for the backup over TLS
        assert backup.mirror.in_sync
        assert snapshot(tmp_path / "b") == snapshot(tmp_path / "p")
        n.cancel_scope.cancel()


async def test_backup_that_cannot_verify_the_primary_never_syncs_and_says_why(
    tmp_path: Path, pki: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as n:
        primary = BrokerApp(primary_settings(tmp_path, pki))
        await start(n, primary)
        tls_port = primary.tls_listening[0][1]
        said = trio.Event()
        watch = _OnMessage("TLS handshake failed", said)
        logging.getLogger("amqbroker.ha.mirror").addHandler(watch)
        n.start_soon(_remove_handler_at_exit, watch)
        backup = BrokerApp(  # the system's CAs: the test CA is not among them
            settings(
                tmp_path / "b",
                ha_role="backup",
                ha_primary=f"127.0.0.1:{tls_port}",
                cluster_tls=True,
            )
        )
        await start(n, backup)
        with trio.fail_after(20):
            await said.wait()
        assert "CERTIFICATE_VERIFY_FAILED" in caplog.text
        assert backup.mirror is not None and not backup.mirror.in_sync
        assert primary.primary is not None and not primary.primary.in_sync
        n.cancel_scope.cancel()


async def test_a_bad_ca_file_stops_the_backup_at_start(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("not a certificate\n")
    backup = BrokerApp(
        settings(
            tmp_path / "b",
            ha_role="backup",
            ha_primary="127.0.0.1:1",
            cluster_tls=True,
            cluster_tls_ca_file=str(tmp_path / "ca.pem"),
        )
    )
    with pytest.raises(StartupError, match="cluster_tls_ca_file"):
        await backup.run()
