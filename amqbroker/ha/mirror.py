"""The backup's side of replication: a `Mirror` of the primary's store.

The mirror connects out to the primary's AMQP listener as the cluster user (an
`OutboundDriver` + `PeerEngine`, like a cluster peer), attaches a receiver to
`$ha.replication` with `ha_window` credit, and applies the frames of
`amqbroker.ha.stream` in order in a worker thread, settling each transfer `accepted`
only once it is applied durably (a new credit is granted then, so at most
`ha_window` frames wait in memory).

Full sync: the chunks of a new stream go to a fresh staging directory
(``<data_dir>/.ha-staging``, emptied first); SNAPSHOT_DONE fsyncs every staged file,
removes the sync marker (``ha-backup.json``), swaps the staged ``journal``, ``paging``
and ``cluster`` directories in place of the old ones, fsyncs the data dir and writes
the marker again (atomically: temp file, fsync, rename) with the epoch and stream it
is in sync with. A crash in between leaves no marker: the copy is not claimed to be in
sync and the next stream replaces it in full (never merged).

Live batches: the journal writes go through a `SegmentFiles` writer on the mirrored
journal directory (the same writer as the primary's, so segment headers and rolls are
byte-identical; the first write after a snapshot appends to the existing append
segment), the page writes through the page store's writer, pages first, as on the
primary. A frame of another stream, an undecodable frame, or a write/fsync error
drops the mirror out of sync: it rejects the frame, removes its marker and
reconnects, and the primary starts a new full sync.

The mirror reconnects with backoff (`cluster_reconnect_initial` ..
`cluster_reconnect_max`) while the primary is unreachable, and logs each change of
state once (not each attempt).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shutil
import ssl
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from amqbroker.ha import stream as st
from amqbroker.net.driver import Hub
from amqbroker.net.outbound import OutboundDriver
from amqbroker.protocol.ha_links import (
    DATA_SECTION_SIZE,
    REPLICATION_ADDRESS,
    data_section_body,
)
from amqbroker.protocol.peer import PeerEngine, PeerRawReceiver
from amqbroker.store.atomic import fsync_dir, replace_file
from amqbroker.store.journal_segments import SegmentFiles, segment_path
from amqbroker.store.paging import PageStore

log = logging.getLogger(__name__)

STATE_FILE = "ha-backup.json"
STAGING = ".ha-staging"
OLD = ".ha-old"
#: the data dir's entries a snapshot replaces
STORE_DIRS = ("journal", "paging", "cluster")

_fdatasync = getattr(os, "fdatasync", os.fsync)


def read_state(data_dir: Path) -> dict[str, Any] | None:
    """The marker of the stream this data dir is in sync with (None: not in sync)."""
    try:
        got = json.loads((data_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def write_state(data_dir: Path, state: dict[str, Any]) -> None:
    replace_file(data_dir / STATE_FILE, json.dumps(state).encode())


def clear_state(data_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(data_dir / STATE_FILE)
        fsync_dir(data_dir)


class MirrorStore:
    """The files of the mirrored store and how frames change them (worker thread for
    `apply_*`, one at a time; see the module docstring). No trio: the engine-level
    tests drive it directly."""

    def __init__(self, data_dir: Path, *, sync: bool = True) -> None:
        self.data_dir = data_dir
        self.sync = sync
        self.stream: bytes | None = None
        self.epoch = 0
        self.in_sync = False
        self._staging_fds: dict[str, int] = {}
        self._journal: SegmentFiles | None = None
        self._pages: PageStore | None = None
        #: the epoch the data dir's copy is complete for, as its marker says (None:
        #: no marker: the copy claims nothing); it survives a lost link (what was
        #: acknowledged stays complete for that epoch) and goes with a new stream or
        #: a failed write
        self.claimed: int | None = None
        state = read_state(data_dir)
        if state is not None:
            # a copy in sync with an older stream: kept until a new snapshot replaces
            # it (promote may use it), never appended to
            self.epoch = int(state.get("epoch", 0))
            self.claimed = self.epoch

    @property
    def staging(self) -> Path:
        return self.data_dir / STAGING

    def close(self) -> None:
        for fd in self._staging_fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._staging_fds.clear()
        if self._journal is not None:
            self._journal.release()
            self._journal = None
        self._pages = None

    def out_of_sync(self) -> None:
        """Stop claiming to be in sync (the next stream starts over)."""
        self.in_sync = False
        self.stream = None
        self.claimed = None
        self.close()
        with contextlib.suppress(OSError):
            clear_state(self.data_dir)

    # ------------------------------------------------------------- frames
    def apply(self, h: st.Header, frame: st.Frame) -> None:
        """WORKER THREAD: apply one frame durably; raises OSError / StreamError."""
        if isinstance(frame, st.FileChunk):
            self._chunk(h, frame)
        elif isinstance(frame, st.SnapshotDone):
            self._done(h, frame)
        else:
            self._batch(h, frame)

    def _new_stream(self, h: st.Header) -> None:
        if h.epoch < self.epoch:
            raise st.StreamError(
                f"the primary's epoch {h.epoch} is older than epoch {self.epoch} this "
                "backup already followed: a stale primary is not mirrored"
            )
        self.out_of_sync()
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        self.stream = h.stream
        self.epoch = h.epoch

    def _chunk(self, h: st.Header, c: st.FileChunk) -> None:
        if h.stream != self.stream:
            self._new_stream(h)
        rel = Path(c.path)
        if rel.is_absolute() or ".." in rel.parts or rel.parts[0] not in STORE_DIRS:
            raise st.StreamError(f"snapshot path {c.path!r} is not a store file")
        fd = self._staging_fds.get(c.path)
        if fd is None:
            p = self.staging / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._staging_fds[c.path] = fd
        view = memoryview(c.data)
        off = c.offset
        while view:
            n = os.pwrite(fd, view, off)
            view = view[n:]
            off += n

    def _done(self, h: st.Header, d: st.SnapshotDone) -> None:
        if h.stream != self.stream and d.files == 0:
            self._new_stream(h)  # an empty store: nothing was chunked
        if h.stream != self.stream:
            raise st.StreamError("SNAPSHOT_DONE of a stream whose snapshot was not received")
        if len(self._staging_fds) != d.files:
            raise st.StreamError(
                f"snapshot of {d.files} file(s) announced, {len(self._staging_fds)} received"
            )
        for fd in self._staging_fds.values():
            if self.sync:
                os.fsync(fd)
            os.close(fd)
        self._staging_fds.clear()
        staging = self.staging
        for name in STORE_DIRS:
            (staging / name).mkdir(exist_ok=True)
        if self.sync:
            for dirpath, _, _ in os.walk(staging):
                fsync_dir(Path(dirpath))
        clear_state(self.data_dir)
        old = self.data_dir / OLD
        shutil.rmtree(old, ignore_errors=True)
        old.mkdir()
        for name in STORE_DIRS:
            live = self.data_dir / name
            if live.exists():
                os.replace(live, old / name)
            os.replace(staging / name, live)
        fsync_dir(self.data_dir)
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        write_state(self.data_dir, {"epoch": h.epoch, "stream": h.stream.hex(), "in_sync": True})
        self._open_live()
        self.in_sync = True
        self.claimed = h.epoch

    def _open_live(self) -> None:
        jdir = self.data_dir / "journal"
        files = SegmentFiles(jdir, self.sync)
        files.dir_fd = os.open(jdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._journal = files
        self._pages = PageStore(self.data_dir / "paging", sync=self.sync)

    def _batch(self, h: st.Header, b: st.CycleBatch) -> None:
        if not self.in_sync or h.stream != self.stream:
            raise st.StreamError("a batch of a stream this backup has no snapshot of")
        assert self._journal is not None and self._pages is not None
        if b.pages is not None:
            self._pages.write(b.pages)
        if b.journal is not None:
            files = self._journal
            writes = b.journal.writes
            if writes and writes[0][0] != files.wsegno:
                segno = writes[0][0]
                path = segment_path(files.directory, segno)
                if path.exists():
                    # the append segment of the snapshot (or of the primary's restart)
                    if files.wfd is not None:
                        if self.sync:
                            _fdatasync(files.wfd)
                        os.close(files.wfd)
                        files.wfd = None
                    files.wfd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
                    files.wsegno = segno
            files.write(b.journal)


class Mirror:
    """The backup's replication client (see the module docstring)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str,
        port: int,
        user: str,
        password: str,
        window: int = 64,
        sync: bool = True,
        idle_timeout: float = 0.0,
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        hub: Hub | None = None,
        node_id: str = "backup",
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.host = host
        self.port = port
        self.user = user
        self.password = password
        self.window = window
        self.idle_timeout = idle_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.hub = hub if hub is not None else Hub()
        self.node_id = node_id
        self.ssl_context = ssl_context
        data_dir.mkdir(parents=True, exist_ok=True)
        self.store = MirrorStore(data_dir, sync=sync)
        #: told the store's claim (`MirrorStore.claimed`) each time it changes (the
        #: pair makes this process a candidate for the lease, or withdraws it)
        self.on_claim: Callable[[int | None], None] | None = None
        self._claim_told = self.store.claimed
        self._queue: collections.deque[tuple[int, bytes, Callable[[bool], None], int]] = (
            collections.deque()
        )
        self._lot = trio.lowlevel.ParkingLot()
        self._gen = 0
        self._engine: PeerEngine | None = None
        self._receiver: PeerRawReceiver | None = None
        self._state = ""
        self._scope: trio.CancelScope | None = None
        self.driver: OutboundDriver | None = None
        #: counters
        self.frames_applied = 0
        self.bytes_applied = 0
        self.records_applied = 0
        self.lag_frames = 0
        self.lag_bytes = 0
        self.lag_records = 0
        self.resyncs = 0
        self.failures = 0
        #: set each time the mirror becomes in sync (tests wait on it)
        self.synced = trio.Event()
        self.stopped = False

    # ------------------------------------------------------------- status
    @property
    def in_sync(self) -> bool:
        """The data dir holds a complete copy of the primary's current stream (from
        SNAPSHOT_DONE on), possibly behind by the batches the primary still has
        queued for it; the primary's own `Primary.in_sync` says when it waits for
        this backup."""
        return self.store.in_sync

    @property
    def lag(self) -> tuple[int, int]:
        """(journal records, bytes) received from the primary and not yet applied."""
        return self.lag_records, self.lag_bytes

    @property
    def synced_epoch(self) -> int | None:
        return self.store.epoch if self.store.in_sync else None

    @property
    def synced_stream(self) -> str | None:
        s = self.store.stream
        return s.hex() if s is not None and self.store.in_sync else None

    def status(self) -> dict[str, Any]:
        return {
            "primary": f"{self.host}:{self.port}",
            "connected": self._receiver is not None,
            "in_sync": self.in_sync,
            "epoch": self.synced_epoch,
            "stream": self.synced_stream,
            "frames_applied": self.frames_applied,
            "bytes_applied": self.bytes_applied,
            "records_applied": self.records_applied,
            "lag_frames": self.lag_frames,
            "lag_bytes": self.lag_bytes,
            "lag_records": self.lag_records,
            "resyncs": self.resyncs,
        }

    def _say(self, state: str, level: int, msg: str, *args: object) -> None:
        if self._state == "refused" and state in ("up", "down"):
            return  # refused again at each attempt: said once, until something changes
        if state != self._state:
            self._state = state
            log.log(level, msg, *args)

    # ---------------------------------------------------------- lifecycle
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.driver = OutboundDriver(
            self.hub,
            name="ha-primary",
            host=self.host,
            port=self.port,
            factory=self._factory,
            on_up=self._on_up,
            on_down=self._on_down,
            on_fail=self._on_fail,
            backoff_initial=self.backoff_initial,
            backoff_max=self.backoff_max,
            ssl_context=self.ssl_context,
        )
        log.info(
            "HA backup: mirroring the primary at %s:%d into %s", self.host, self.port, self.data_dir
        )
        try:
            with trio.CancelScope() as scope:
                self._scope = scope
                async with trio.open_nursery() as n:
                    n.start_soon(self.driver.run)
                    n.start_soon(self._apply_loop)
                    task_status.started()
        finally:
            self.stopped = True
            self.store.close()

    def stop(self) -> None:
        """Stop mirroring (promote calls it); `run` returns."""
        if self._scope is not None:
            self._scope.cancel()

    def _factory(self, on_dirty: Callable[[], None]) -> PeerEngine:
        return PeerEngine(
            container_id=f"amqbroker-ha-{self.node_id}-{uuid.uuid4().hex[:8]}",
            user=self.user,
            password=self.password,
            idle_timeout=self.idle_timeout,
            on_dirty=on_dirty,
            on_event=self._on_event,
        )

    def _on_up(self, engine: PeerEngine) -> None:
        self._gen += 1
        self._engine = engine
        gen = self._gen
        self._receiver = engine.raw_receiver(
            lambda raw, settle: self._on_transfer(gen, raw, settle),
            f"{self.node_id}.ha-replication.{uuid.uuid4().hex[:8]}",
            address=REPLICATION_ADDRESS,
            credit=self.window,
        )
        self._say(
            "up", logging.INFO, "HA backup: connected to the primary at %s:%d", self.host, self.port
        )

    def _on_event(self) -> None:
        r = self._receiver
        if r is not None and r.closed_by_peer and self._engine is not None:
            self._say(
                "refused",
                logging.ERROR,
                "HA backup: the primary at %s:%d closed the replication link: %s",
                self.host,
                self.port,
                r.error or "no reason given",
            )
            self._engine.close()

    def _on_down(self, engine: PeerEngine | None, error: str) -> None:
        self._gen += 1
        self._engine = None
        self._receiver = None
        self._queue.clear()
        self.lag_frames = self.lag_bytes = self.lag_records = 0
        if self.store.in_sync:
            # a new connection is a new stream: what we hold stays (promote may use
            # it) but is no longer appended to
            self.store.in_sync = False
        self._say(
            "down",
            logging.WARNING,
            "HA backup: lost the primary at %s:%d (%s); reconnecting",
            self.host,
            self.port,
            error,
        )

    def _on_fail(self, error: str) -> None:
        self._say(
            "unreachable",
            logging.WARNING,
            "HA backup: cannot reach the primary at %s:%d (%s); retrying every %.1f..%.1f s",
            self.host,
            self.port,
            error,
            self.backoff_initial,
            self.backoff_max,
        )

    def _on_transfer(self, gen: int, raw: bytes, settle: Callable[[bool], None]) -> None:
        records = st.batch_records(raw, DATA_SECTION_SIZE)
        self._queue.append((gen, raw, settle, records))
        self.lag_frames += 1
        self.lag_bytes += len(raw)
        self.lag_records += records
        self._lot.unpark_all()

    async def _apply_loop(self) -> None:
        q = self._queue
        while True:
            if not q:
                await self._lot.park()
                continue
            gen, raw, settle, records = q.popleft()
            self.lag_frames -= 1
            self.lag_bytes -= len(raw)
            self.lag_records -= records
            if gen != self._gen:
                continue  # of a connection that ended
            ok = await self._apply(raw)
            if gen != self._gen:
                continue
            settle(ok)
            if not ok and self._engine is not None:
                self._engine.close()
            self.hub.flush()

    async def _apply(self, raw: bytes) -> bool:
        try:
            return await self._apply_frame(raw)
        finally:
            claimed = self.store.claimed
            if claimed != self._claim_told:
                self._claim_told = claimed
                if self.on_claim is not None:
                    self.on_claim(claimed)

    async def _apply_frame(self, raw: bytes) -> bool:
        store = self.store
        try:
            try:
                body = data_section_body(raw)
            except ValueError as exc:
                raise st.StreamError(str(exc)) from None
            h, frame = st.decode(body)
            was = store.in_sync
            await trio.to_thread.run_sync(store.apply, h, frame)
        except (OSError, st.StreamError) as exc:
            self.failures += 1
            log.error(
                "HA backup: cannot apply a replication frame: %s; out of sync until a new "
                "full sync",
                exc,
            )
            await trio.to_thread.run_sync(store.out_of_sync)
            self._state = ""
            return False
        self.frames_applied += 1
        self.bytes_applied += len(raw)
        if isinstance(frame, st.CycleBatch):
            self.records_applied += frame.records
        if store.in_sync and not was:
            self.resyncs += 1
            self.synced.set()
            self.synced = trio.Event()
            self._say(
                "in-sync",
                logging.INFO,
                "HA backup: in sync with the primary at %s:%d (epoch %d, stream %s)",
                self.host,
                self.port,
                store.epoch,
                h.stream.hex()[:8],
            )
        return True
