"""Full sync and live replication between two in-process brokers (real sockets, real
journals in tmp dirs): a primary with messages, a backup that attaches, catches up
while a producer sends, holds a byte-identical copy, and serves every accepted
message in order once promoted."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Message

from amqbroker.app import BrokerApp
from amqbroker.core.auth import hash_password
from amqbroker.ha.mirror import read_state
from amqbroker.ha.primary import store_files
from amqbroker.settings import Settings
from tests.client import Client

USER = "cluster"
PASSWORD = "cluster-pw"


def settings(data_dir: Path, **over: Any) -> Settings:
    values: dict[str, Any] = {
        "port": 0,
        "data_dir": data_dir,
        "store_sync": True,
        "expiry_scan_period": 0,
        "cluster_user": USER,
        "cluster_password": PASSWORD,
        "users": {USER: hash_password(PASSWORD, iterations=1000)},
        "store_segment_size": 64 * 1024,  # several segments, compaction deletes some
        "ha_chunk_bytes": 8192,
        "cluster_reconnect_initial": 0.05,
        "cluster_reconnect_max": 0.2,
        "shutdown_timeout": 2,
    }
    values.update(over)
    return Settings(**values)


async def send(port: int, nursery: trio.Nursery, bodies: range, queue: str = "q") -> None:
    async with await Client.connect(port, nursery=nursery) as c:
        s = await c.sender(queue)
        for i in bodies:
            await s.send(Message(body=f"m{i}", durable=True, group_id=f"g{i % 3}"))


def snapshot(d: Path) -> dict[str, bytes]:
    return {rel: (d / rel).read_bytes() for rel in store_files(d)}


async def start(n: trio.Nursery, app: BrokerApp) -> tuple[trio.Event, trio.Event]:
    """Run `app`; the events: it listens (a backup: once promoted), its run returned."""
    listening = trio.Event()
    done = trio.Event()

    async def runner(task_status: trio.TaskStatus[None]) -> None:
        try:
            await app.run(task_status=task_status, ready=lambda _: listening.set())
        finally:
            done.set()

    await n.start(runner)
    return listening, done


async def test_full_sync_then_live_batches_then_promote(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as n:
        primary = BrokerApp(settings(tmp_path / "p", ha_role="primary"))
        _, primary_done = await start(n, primary)
        port = primary.listening[0][1]
        await send(port, n, range(300))
        assert "HA primary: running unreplicated (no backup in sync yet)" in caplog.text

        backup = BrokerApp(
            settings(tmp_path / "b", ha_role="backup", ha_primary=f"127.0.0.1:{port}")
        )
        backup_listening, backup_done = await start(n, backup)
        assert backup.listening == [] and backup.mirror is not None
        mirror = backup.mirror
        assert primary.primary is not None
        synced = primary.primary.synced
        # a producer keeps sending while the backup catches up
        await send(port, n, range(300, 600))
        with trio.fail_after(20):
            await synced.wait()
        assert mirror.in_sync
        assert "is in sync" in caplog.text
        # in sync: every cycle waits for the backup, so once the sends are answered
        # the backup's files are the primary's, byte for byte
        await send(port, n, range(600, 900))
        assert primary.primary is not None and primary.primary.in_sync
        assert snapshot(tmp_path / "b") == snapshot(tmp_path / "p")
        state = read_state(tmp_path / "b")
        assert state is not None and state["in_sync"] and state["stream"] == mirror.synced_stream
        assert mirror.frames_applied > 0 and mirror.records_applied >= 300
        assert mirror.lag == (0, 0)  # every batch acknowledged was applied
        st = backup.ha_status()
        assert st["role"] == "backup" and st["in_sync"] and st["epoch"] == 0
        assert primary.ha_status()["state"] == "in-sync"

        primary.request_shutdown()
        with trio.fail_after(20):
            await primary_done.wait()
        backup.promote()
        with trio.fail_after(20):
            await backup_listening.wait()
        assert backup.ha_role == "primary"
        async with await Client.connect(backup.listening[0][1], nursery=n) as c:
            r = await c.receiver("q", credit=1000)
            got = [m.body for m in await r.receive_n(900, timeout=20)]
        assert got == [f"m{i}" for i in range(900)]
        backup.request_shutdown()
        with trio.fail_after(20):
            await backup_done.wait()
        n.cancel_scope.cancel()  # the clients' tasks


async def test_page_files_are_mirrored_byte_for_byte(tmp_path: Path) -> None:
    page = {"paged.#": {"max_size_bytes": 16 * 1024, "address_full_policy": "PAGE"}}
    over: dict[str, Any] = {"address_settings": page, "page_size_bytes": 32 * 1024}
    big = "." * 300
    async with trio.open_nursery() as n:
        primary = BrokerApp(settings(tmp_path / "p", ha_role="primary", **over))
        _, primary_done = await start(n, primary)
        port = primary.listening[0][1]
        async with await Client.connect(port, nursery=n) as c:
            s = await c.sender("paged.q")
            await s.send_many([Message(body=f"m{i}{big}", durable=True) for i in range(300)])
            assert list((tmp_path / "p" / "paging").rglob("page-*.pg"))  # it paged

            backup = BrokerApp(
                settings(tmp_path / "b", ha_role="backup", ha_primary=f"127.0.0.1:{port}", **over)
            )
            backup_listening, backup_done = await start(n, backup)
            assert backup.mirror is not None and primary.primary is not None
            synced = primary.primary.synced
            with trio.fail_after(20):
                await synced.wait()
            # consuming reads pages back (journal ADDs, page segments deleted) while
            # more messages are paged
            r = await c.receiver("paged.q", credit=100)
            for _ in range(100):
                r.accept(await r.receive(timeout=20))
            await s.send_many([Message(body=f"m{i}{big}", durable=True) for i in range(300, 600)])
            # a round trip through the store: the accepts above are in a synced cycle
            await s.send(Message(body=f"m600{big}", durable=True))
        assert snapshot(tmp_path / "b") == snapshot(tmp_path / "p")
        assert any(rel.startswith("paging/") for rel in snapshot(tmp_path / "b"))

        primary.request_shutdown()
        with trio.fail_after(20):
            await primary_done.wait()
        backup.promote()
        with trio.fail_after(20):
            await backup_listening.wait()
        async with await Client.connect(backup.listening[0][1], nursery=n) as c:
            r = await c.receiver("paged.q", credit=1000)
            got = []
            for _ in range(501):
                m = await r.receive(timeout=20)
                got.append(str(m.body)[: -len(big)])
                r.accept(m)
        assert got == [f"m{i}" for i in range(100, 601)]
        backup.request_shutdown()
        with trio.fail_after(20):
            await backup_done.wait()
        n.cancel_scope.cancel()


async def test_segments_compacted_away_during_the_full_sync_are_still_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot's files are read through the descriptors opened between two
    cycles: compaction deleting them meanwhile changes nothing, and the queued
    batches replay the deletes."""
    from amqbroker.ha.primary import Primary

    gate = trio.Event()
    opened = trio.Event()
    real = Primary._open_snapshot

    def snapshot_then_hold(self: Primary) -> list[tuple[str, int, int]]:
        files = real(self)
        opened.set()
        return files

    real_send = Primary._send

    async def held_send(
        self: Primary, b: Any, frame: bytes, on_outcome: Any, records: int = 0
    ) -> bool:
        await gate.wait()
        return await real_send(self, b, frame, on_outcome, records)

    monkeypatch.setattr(Primary, "_open_snapshot", snapshot_then_hold)
    monkeypatch.setattr(Primary, "_send", held_send)
    over: dict[str, Any] = {"store_segment_size": 16 * 1024, "store_compact_min_bytes": 0}
    async with trio.open_nursery() as n:
        primary = BrokerApp(settings(tmp_path / "p", ha_role="primary", **over))
        _, primary_done = await start(n, primary)
        port = primary.listening[0][1]
        await send(port, n, range(400))
        before = set(store_files(tmp_path / "p"))
        backup = BrokerApp(
            settings(tmp_path / "b", ha_role="backup", ha_primary=f"127.0.0.1:{port}", **over)
        )
        backup_listening, backup_done = await start(n, backup)
        assert backup.mirror is not None and primary.primary is not None
        synced = primary.primary.synced
        with trio.fail_after(20):
            await opened.wait()
        # consume everything: the old segments are compacted away while held
        async with await Client.connect(port, nursery=n) as c:
            r = await c.receiver("q", credit=1000)
            for _ in range(400):
                r.accept(await r.receive(timeout=20))
            s = await c.sender("q")
            for i in range(400, 450):
                await s.send(Message(body=f"m{i}", durable=True))
        gone = before - set(store_files(tmp_path / "p"))
        assert gone, "compaction deleted none of the snapshot's segments"
        gate.set()
        with trio.fail_after(20):
            await synced.wait()
        await send(port, n, range(450, 460))
        assert snapshot(tmp_path / "b") == snapshot(tmp_path / "p")
        assert not gone & set(store_files(tmp_path / "b"))

        primary.request_shutdown()
        with trio.fail_after(20):
            await primary_done.wait()
        backup.promote()
        with trio.fail_after(20):
            await backup_listening.wait()
        async with await Client.connect(backup.listening[0][1], nursery=n) as c:
            r = await c.receiver("q", credit=1000)
            got = [(await r.receive(timeout=20)).body for _ in range(60)]
            await r.expect_none(0.3)
        assert got == [f"m{i}" for i in range(400, 460)]
        backup.request_shutdown()
        with trio.fail_after(20):
            await backup_done.wait()
        n.cancel_scope.cancel()
