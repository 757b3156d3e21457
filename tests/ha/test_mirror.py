"""The backup's mirror in process (real sockets and files): a disk error drops it out
of sync and a new full sync follows; only the cluster user may attach the stream; an
unreachable primary is retried with backoff and logged once."""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from amqbroker.app import BrokerApp
from amqbroker.ha import stream as st
from amqbroker.ha.mirror import Mirror, MirrorStore, read_state
from amqbroker.protocol.ha_links import REPLICATION_ADDRESS
from tests.client import Client
from tests.cluster.cluster_helpers import free_port
from tests.ha.test_full_sync import PASSWORD, USER, send, settings, snapshot, start


async def test_a_disk_error_on_the_backup_drops_it_out_of_sync_then_it_resyncs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    fail = [True]
    real = MirrorStore._batch

    def flaky(self: MirrorStore, h: st.Header, b: st.CycleBatch) -> None:
        if fail[0]:
            fail[0] = False
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, h, b)

    monkeypatch.setattr(MirrorStore, "_batch", flaky)
    async with trio.open_nursery() as n:
        primary = BrokerApp(settings(tmp_path / "p", ha_role="primary"))
        await start(n, primary)
        port = primary.listening[0][1]
        backup = BrokerApp(
            settings(tmp_path / "b", ha_role="backup", ha_primary=f"127.0.0.1:{port}")
        )
        await start(n, backup)
        mirror = backup.mirror
        assert mirror is not None and primary.primary is not None
        first = primary.primary.synced
        with trio.fail_after(20):
            await first.wait()
        second = primary.primary.synced
        # the first batch fails on the backup: it rejects it and leaves sync; the
        # primary answers its producer anyway (unreplicated) and says so
        await send(port, n, range(10))
        with trio.fail_after(20):
            await second.wait()  # and the backup is back by a new full sync
        assert "cannot apply a replication frame: [Errno 28] No space left" in caplog.text
        assert "HA primary: running unreplicated (backup dropped" in caplog.text
        # a cycle in sync waits for the backup: everything before it is applied too
        await send(port, n, range(10, 20))
        assert mirror.resyncs == 2 and mirror.failures == 1
        assert snapshot(tmp_path / "b") == snapshot(tmp_path / "p")
        state = read_state(tmp_path / "b")
        assert state is not None and state["stream"] == mirror.synced_stream
        n.cancel_scope.cancel()


async def test_only_the_cluster_user_may_attach_the_replication_stream(tmp_path: Path) -> None:
    async with trio.open_nursery() as n:
        primary = BrokerApp(settings(tmp_path / "p", ha_role="primary", allow_anonymous=True))
        primary.ha_epoch = lambda: 7  # what the lease will set
        await start(n, primary)
        port = primary.listening[0][1]
        async with await Client.connect(port, nursery=n) as c:
            r = await c.receiver(REPLICATION_ADDRESS, credit=1, wait=False)
            with trio.fail_after(10):
                while not r.closed_by_peer:
                    await c._changed.wait()
            cond = r.remote_condition
            assert cond is not None and cond.name == "amqp:unauthorized-access"
            assert "cluster user 'cluster'" in cond.description
        async with await Client.connect(port, nursery=n, user=USER, password=PASSWORD) as c:
            r = await c.receiver(REPLICATION_ADDRESS, credit=1)
            first = await r.receive(timeout=10)  # the full sync begins
            h, _ = st.decode(first.body)
            assert h.kind in (st.SNAPSHOT_FILE_CHUNK, st.SNAPSHOT_DONE) and h.epoch == 7
        n.cancel_scope.cancel()


async def test_an_unreachable_primary_is_retried_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, autojump_clock: Any
) -> None:
    caplog.set_level(logging.INFO)
    m = Mirror(
        tmp_path / "b",
        host="127.0.0.1",
        port=free_port(),  # nobody listens
        user=USER,
        password=PASSWORD,
        backoff_initial=0.1,
        backoff_max=1.0,
    )
    with trio.move_on_after(30):
        await m.run()
    assert m.driver is not None and m.driver.attempts > 20
    assert caplog.text.count("cannot reach the primary") == 1
    assert not m.in_sync and m.synced_epoch is None
