"""The primary's side of replication: the `Replicator` of its `StoreWriter` and the
stream to its one backup.

A backup attaches a receiver to `$ha.replication` (`protocol.ha_links`; only the
cluster user may). The primary then, in order:

1. Snapshot: holding the `StoreWriter` lock (no store cycle in progress) it opens a
   file descriptor on every file its store owns under the data dir (journal segments,
   page files, the cluster decision log if any; never the delivery log) and records
   their sizes; from then on every store cycle's BATCH frame is queued for this backup.
   Files deleted later by compaction stay readable through the open descriptors; the
   queued batches replay the deletes.
2. Full sync: the files' contents up to the recorded sizes, in chunks of
   `ha_chunk_bytes` read in a worker thread (at most `ha_window` frames unsettled:
   the backup grants credit as it applies them), then SNAPSHOT_DONE, then the queued
   batches. If the queue grows past `ha_max_queued_bytes` the backup is dropped (its
   link closed); it reconnects and starts over.
3. In sync: each store cycle sends its BATCH and (`ha_sync`, the default) waits for
   the backup's acknowledgement, which it sends once the batch is fsync'ed. A backup
   that does not acknowledge within `ha_ack_timeout`, rejects a frame or goes away is
   dropped; the primary goes on unreplicated.
4. Alone: a cycle that no backup in sync acknowledged completes only once `alone`
   (the pair's lease: take the next epoch the first time, so that a backup which
   dropped out can never take over with its older copy; then confirm the lease
   every cycle) says so; False fences the store (`StoreWriter.fenced`).

Status: `Primary.status` (the report of `amqbroker.ha.status`) counts the lag as what
the backup does not have yet: batches queued while it catches up plus frames sent and
not yet acknowledged. With ``ha_unreplicated = "refuse"`` (`serve_replication`) the
broker rejects durable client sends while no backup is in sync; the store cycles
themselves are never held for it (step 4 still answers what is already in a cycle).

Every attach starts a new stream (a random 16-byte id): a backup never merges a
stream into a store of an older one. The primary logs a WARNING each time it starts
running unreplicated and each time a backup is in sync again (not once per cycle).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from amqbroker.core.broker import Broker
from amqbroker.ha import stream as st
from amqbroker.protocol.connection import AmqpConnection
from amqbroker.protocol.ha_links import REPLICATION_ADDRESS, ReplicationLink, replication_factory
from amqbroker.settings import Settings
from amqbroker.store.journal_segments import SEGMENT_RE, Batch
from amqbroker.store.paging import PageBatch
from amqbroker.store.writer import StoreWriter

log = logging.getLogger(__name__)

_PAGE_RE = re.compile(r"^page-(\d{8,})\.pg$")
#: the decision log of a cluster node, relative to the data dir
DECISION_LOG = "cluster/decisions.log"

SNAPSHOT = "snapshot"
CATCHUP = "catchup"
IN_SYNC = "in-sync"
DROPPED = "dropped"


def store_files(data_dir: Path) -> list[str]:
    """The files of the store under `data_dir` (relative paths, sorted): what a full
    sync copies. Not the delivery log, the journal's LOCK, or anything else."""
    out: list[str] = []
    jdir = data_dir / "journal"
    if jdir.is_dir():
        out += sorted(f"journal/{p.name}" for p in jdir.iterdir() if SEGMENT_RE.match(p.name))
    pdir = data_dir / "paging"
    if pdir.is_dir():
        for q in sorted(pdir.iterdir()):
            if q.is_dir() and q.name.isdigit():
                out += sorted(
                    f"paging/{q.name}/{p.name}" for p in q.iterdir() if _PAGE_RE.match(p.name)
                )
    if (data_dir / DECISION_LOG).is_file():
        out.append(DECISION_LOG)
    return out


@dataclass(eq=False)
class BackupStream:
    """The stream to one attached backup."""

    link: ReplicationLink
    stream: bytes
    state: str = SNAPSHOT
    queued: collections.deque[tuple[bytes, int]] = field(default_factory=collections.deque)
    queued_bytes: int = 0
    queued_records: int = 0
    credit: trio.Event = field(default_factory=trio.Event)
    frames_sent: int = 0
    bytes_sent: int = 0
    #: sent, not yet acknowledged by the backup (its outcome not yet received)
    unacked_bytes: int = 0
    unacked_records: int = 0
    snapshot_bytes: int = 0
    #: the snapshot's size (its files' sizes when it was taken)
    snapshot_total: int = 0
    error: str = ""


class Primary:
    """The `Replicator` of a primary's StoreWriter (see the module docstring)."""

    def __init__(
        self,
        store: StoreWriter,
        data_dir: Path,
        *,
        flush: Callable[[], object],
        sync: bool = True,
        window: int = 64,
        chunk_bytes: int = 1 << 20,
        max_queued_bytes: int = 256 << 20,
        ack_timeout: float = 10.0,
        epoch: Callable[[], int] = lambda: 0,
        alone: Callable[[], Awaitable[bool]] | None = None,
        on_replicated: Callable[[bool], None] | None = None,
    ) -> None:
        self.store = store
        self.data_dir = data_dir
        self._flush = flush
        self.sync = sync
        self.window = window
        self.chunk_bytes = chunk_bytes
        self.max_queued_bytes = max_queued_bytes
        self.ack_timeout = ack_timeout
        self.epoch = epoch
        #: asked before a cycle completes that no backup acknowledged: True lets it
        #: complete, False fences this primary (its lease is gone: the cycle is never
        #: answered). None (no lease): always True
        self.alone = alone
        #: told each time a backup gets in sync (True) and each time this primary
        #: starts running unreplicated (False): `ha_unreplicated = "refuse"` hooks it
        self.on_replicated = on_replicated
        self.backup: BackupStream | None = None
        #: True once a backup is in sync, False after it was lost (None: never said)
        self._replicated: bool | None = None
        self._nursery: trio.Nursery | None = None
        self._pending: list[BackupStream] = []
        self.full_syncs = 0
        #: cycles a backup in sync took (the pair's lease bumps the epoch again when
        #: this primary answers alone after any of them)
        self.backed_cycles = 0
        self.dropped = 0
        #: set (then replaced) each time a backup is in sync (tests wait on it)
        self.synced = trio.Event()

    # ------------------------------------------------------------- status
    @property
    def in_sync(self) -> bool:
        b = self.backup
        return b is not None and b.state == IN_SYNC

    def status(self) -> dict[str, object]:
        """The stream to the backup. Lag: what the backup does not have yet, as this
        primary knows it: batches queued while it catches up plus frames sent and
        not yet acknowledged (records: journal records; bytes: frame bytes)."""
        b = self.backup
        return {
            "backup": b.link.peer if b is not None else None,
            "state": b.state if b is not None else "none",
            "stream": b.stream.hex() if b is not None else None,
            "in_sync": self.in_sync,
            "unreplicated": not self.in_sync,
            "queued_bytes": b.queued_bytes if b is not None else 0,
            "queued_records": b.queued_records if b is not None else 0,
            "unacked_bytes": b.unacked_bytes if b is not None else 0,
            "unacked_records": b.unacked_records if b is not None else 0,
            "lag_bytes": b.queued_bytes + b.unacked_bytes if b is not None else 0,
            "lag_records": b.queued_records + b.unacked_records if b is not None else 0,
            "snapshot_bytes": b.snapshot_bytes if b is not None else 0,
            "snapshot_total": b.snapshot_total if b is not None else 0,
            "full_syncs": self.full_syncs,
            "dropped": self.dropped,
        }

    def connections(self) -> frozenset[AmqpConnection]:
        """The connection of the backup's replication link (none without a backup):
        a shutdown closes it after the others and the final store cycle."""
        b = self.backup
        return frozenset() if b is None else frozenset({b.link.conn})

    def _say_unreplicated(self, why: str) -> None:
        if self._replicated is not False:
            self._replicated = False
            log.warning("HA primary: running unreplicated (%s)", why)
            if self.on_replicated is not None:
                self.on_replicated(False)

    # ------------------------------------------------------------ lifecycle
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n
            self._say_unreplicated("no backup in sync yet")
            for b in self._pending:
                n.start_soon(self._full_sync, b)
            self._pending.clear()
            task_status.started()
            await trio.sleep_forever()

    # ------------------------------------------------- ReplicationSink
    def attached(self, link: ReplicationLink) -> None:
        old = self.backup
        if old is not None:
            self._drop(old, "another backup attached")
        b = BackupStream(link, uuid.uuid4().bytes)
        self.backup = b
        log.info(
            "HA primary: backup at %s attached; full sync of stream %s starts",
            link.peer,
            b.stream.hex()[:8],
        )
        if self._nursery is None:
            self._pending.append(b)
        else:
            self._nursery.start_soon(self._full_sync, b)

    def credit_changed(self, link: ReplicationLink) -> None:
        b = self.backup
        if b is not None and b.link is link:
            b.credit.set()

    def detached(self, link: ReplicationLink) -> None:
        b = self.backup
        if b is not None and b.link is link and b.state != DROPPED:
            b.state = DROPPED
            b.credit.set()
            self.backup = None
            log.warning("HA primary: backup at %s detached", link.peer)
            self._say_unreplicated("the backup went away")

    def _drop(self, b: BackupStream, why: str) -> None:
        if b.state == DROPPED:
            return
        was = b.state
        b.state = DROPPED
        b.error = why
        b.credit.set()
        b.queued.clear()
        self.dropped += 1
        if self.backup is b:
            self.backup = None
        log.warning("HA primary: dropped the backup at %s (%s) while %s", b.link.peer, why, was)
        self._say_unreplicated(f"backup dropped: {why}")
        b.link.close("amqp:resource-limit-exceeded", f"replication stream dropped: {why}")
        self._flush()

    # ------------------------------------------------------------ sending
    async def _send(
        self, b: BackupStream, frame: bytes, on_outcome: Callable[[str], None], records: int = 0
    ) -> bool:
        """Send one frame once there is credit (and fewer than `window` unsettled);
        False when the backup was dropped or gave no credit within ack_timeout."""
        with trio.move_on_after(self.ack_timeout):
            while b.state != DROPPED and (b.link.credit <= 0 or b.link.in_flight >= self.window):
                b.credit = trio.Event()
                await b.credit.wait()
        if b.state == DROPPED:
            return False
        if b.link.credit <= 0 or b.link.in_flight >= self.window:
            self._drop(b, f"no credit within ha_ack_timeout ({self.ack_timeout} s)")
            return False
        n = len(frame)
        b.unacked_bytes += n
        b.unacked_records += records

        def settled(outcome: str) -> None:
            b.unacked_bytes -= n
            b.unacked_records -= records
            on_outcome(outcome)

        b.link.send(frame, settled)
        b.frames_sent += 1
        b.bytes_sent += n
        self._flush()
        return True

    def _outcome(self, b: BackupStream) -> Callable[[str], None]:
        def done(outcome: str) -> None:
            if outcome != "accepted" and b.state != DROPPED:
                self._drop(b, f"the backup answered {outcome}")

        return done

    async def replicate(self, cycle: int, batch: Batch | None, pages: PageBatch | None) -> bool:
        """The store cycle's half (StoreWriter.replicator): see the module docstring.
        False: this primary is fenced and the cycle must not be answered."""
        if await self._replicated_by_backup(cycle, batch, pages):
            self.backed_cycles += 1
            return True
        return True if self.alone is None else await self.alone()

    async def _replicated_by_backup(
        self, cycle: int, batch: Batch | None, pages: PageBatch | None
    ) -> bool:
        """Send the cycle to the backup; True once a backup in sync acknowledged it
        (with ha_sync off: once it was sent to a backup in sync)."""
        b = self.backup
        if b is None or b.state == DROPPED:
            self._say_unreplicated("no backup attached")
            return False
        frame = st.encode_batch(self.epoch(), b.stream, cycle, batch, pages)
        records = batch.records if batch is not None else 0
        if b.state != IN_SYNC:
            if b.state == CATCHUP:
                b.queued.append((frame, records))
                b.queued_bytes += len(frame)
                b.queued_records += records
                b.credit.set()  # the full sync's drain loop waits on it too
                if b.queued_bytes > self.max_queued_bytes:
                    self._drop(
                        b,
                        f"{b.queued_bytes} byte(s) of batches queued while catching up "
                        f"exceed ha_max_queued_bytes ({self.max_queued_bytes})",
                    )
            return False
        acked = trio.Event()
        ok = True

        def done(outcome: str) -> None:
            nonlocal ok
            ok = outcome == "accepted"
            acked.set()
            if not ok and b.state != DROPPED:
                self._drop(b, f"the backup answered {outcome} to cycle {cycle}")

        if not await self._send(b, frame, done, records):
            return False
        if not self.sync:
            return True
        with trio.move_on_after(self.ack_timeout):
            await acked.wait()
        if not acked.is_set():
            self._drop(b, f"cycle {cycle} not acknowledged within ha_ack_timeout")
            return False
        return ok

    # ---------------------------------------------------------- full sync
    def _open_snapshot(self) -> list[tuple[str, int, int]]:
        """Between two store cycles: (relative path, fd, size) of every store file."""
        files: list[tuple[str, int, int]] = []
        try:
            for rel in store_files(self.data_dir):
                try:
                    fd = os.open(self.data_dir / rel, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                files.append((rel, fd, os.fstat(fd).st_size))
        except BaseException:
            for _, fd, _ in files:
                os.close(fd)
            raise
        return files

    async def _full_sync(self, b: BackupStream) -> None:
        self.full_syncs += 1
        async with self.store.lock:
            if b.state == DROPPED:
                return
            try:
                files = self._open_snapshot()
            except OSError as exc:
                self._drop(b, f"cannot open the store files: {exc}")
                return
            b.state = CATCHUP
            b.snapshot_total = sum(size for _, _, size in files)
        try:
            epoch = self.epoch()
            for rel, fd, size in files:
                off = 0
                while True:
                    n = min(self.chunk_bytes, size - off)
                    data = await trio.to_thread.run_sync(os.pread, fd, n, off) if n else b""
                    if len(data) < n:
                        self._drop(b, f"{rel} shrank during the full sync")
                        return
                    frame = st.encode_chunk(epoch, b.stream, rel, off, data)
                    if not await self._send(b, frame, self._outcome(b)):
                        return
                    b.snapshot_bytes += n
                    off += n
                    if off >= size:
                        break
            if not await self._send(
                b, st.encode_done(epoch, b.stream, len(files)), self._outcome(b)
            ):
                return
        finally:
            for _, fd, _ in files:
                os.close(fd)
        log.info(
            "HA primary: snapshot of %d file(s), %d byte(s) sent to %s; %d queued batch(es)",
            len(files),
            b.snapshot_bytes,
            b.link.peer,
            len(b.queued),
        )
        while b.queued:
            frame, records = b.queued.popleft()
            b.queued_bytes -= len(frame)
            b.queued_records -= records
            if not await self._send(b, frame, self._outcome(b), records):
                return
        if b.state != CATCHUP:
            return
        b.state = IN_SYNC
        self._replicated = True
        if self.on_replicated is not None:
            self.on_replicated(True)
        self.synced.set()
        self.synced = trio.Event()
        log.warning(
            "HA primary: backup at %s is in sync (stream %s); every store cycle is "
            "replicated again",
            b.link.peer,
            b.stream.hex()[:8],
        )


async def answer_alone() -> bool:
    """The default `alone` of a primary without a lease: it may always answer alone."""
    return True


#: why a durable send is rejected while no backup is in sync (ha_unreplicated = refuse)
REFUSED = (
    'no backup is in sync with this primary and ha_unreplicated is "refuse": durable '
    "messages are not accepted until a backup is in sync again; retry later"
)


def serve_replication(
    s: Settings,
    broker: Broker,
    store: StoreWriter,
    data_dir: Path,
    *,
    flush: Callable[[], object],
    sources: dict[str, Any],
    epoch: Callable[[], int],
    alone: Callable[[], Awaitable[bool]],
) -> Primary:
    """A primary's replication: the `Primary` as `store`'s replicator, and the
    `$ha.replication` source (in the management node's `sources`) for the cluster user
    only. With ``ha_unreplicated = "refuse"`` the broker rejects durable sends
    (`Broker.durable_refused`) from the start until a backup is in sync, and again each
    time this primary runs unreplicated; store cycles themselves are never held."""
    on_replicated = None
    if s.ha_unreplicated == "refuse":
        # Primary.run reports "unreplicated" at once, before any client is accepted

        def on_replicated(ok: bool) -> None:
            if ok and broker.durable_refused is not None:
                log.warning("HA primary: a backup is in sync: durable sends are accepted again")
            elif not ok and broker.durable_refused is None:
                log.warning(
                    "HA primary: durable sends are refused (amqp:resource-limit-exceeded) "
                    'until a backup is in sync (ha_unreplicated = "refuse")'
                )
            broker.durable_refused = None if ok else REFUSED

    primary = Primary(
        store,
        data_dir,
        flush=flush,
        sync=s.ha_sync,
        window=s.ha_window,
        chunk_bytes=s.ha_chunk_bytes,
        max_queued_bytes=s.ha_max_queued_bytes,
        ack_timeout=s.ha_ack_timeout,
        epoch=epoch,
        alone=alone,
        on_replicated=on_replicated,
    )
    store.replicator = primary
    user = s.cluster_user

    def authorize(conn: AmqpConnection) -> str | None:
        if not user or conn.user != user:
            return (
                f"{REPLICATION_ADDRESS} is for the cluster user{f' {user!r}' if user else ''} "
                "only; check cluster_user/cluster_password on the backup"
            )
        return None

    sources[REPLICATION_ADDRESS] = replication_factory(primary, authorize)
    return primary
