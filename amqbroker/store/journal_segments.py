"""The journal's segment files: their names, the directory lock, each segment's
accounting, and the writer that puts batches on disk (see `amqbroker.store.journal`).

Files in the directory: ``segment-<n:08d>.log`` (numbers increase, never reused),
``LOCK`` (fcntl.flock'ed for the life of the open journal, holds the owner's pid) and,
only after corruption, ``segment-<n:08d>.log.corrupt`` (see `journal_recovery`).

When a record counts as durable
-------------------------------
A record is durable when `write_batch` returned for the batch containing it: its bytes
were written and (with sync=True) fdatasync'ed. On rolling to a new segment the writer
first fdatasyncs the old file, then creates the new one and fsyncs the directory, so a
newer segment never exists on disk unless every older one is complete. Therefore a torn
write can only be at the tail of the newest segment, and the producer's transfer is
settled only after `synced_batch_no` covers its ADD.

Threading: `SegmentFiles.write` (and `roll`) run on the worker thread, called by
`Journal.write_batch`; they touch only the batch they were given and the writer's file
descriptors. Everything else here runs on the event-loop thread.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from amqbroker.core.errors import LocalError
from amqbroker.store import records as rec

if TYPE_CHECKING:
    from pathlib import Path

    from amqbroker.core.entry import Entry

#: the journal's one logger, whichever of its modules logs
log = logging.getLogger("amqbroker.store.journal")

LOCK_FILE: Final = "LOCK"
SEGMENT_RE: Final = re.compile(r"^segment-(\d{8,})\.log$")
_IOV_MAX: Final = 512

_fdatasync = getattr(os, "fdatasync", os.fsync)


class JournalError(LocalError):
    """The journal cannot be used (see the message)."""


class JournalLockedError(JournalError):
    """Another process (or another Journal object) holds the journal directory."""


def segment_path(directory: Path, segno: int) -> Path:
    return directory / f"segment-{segno:08d}.log"


@dataclass(slots=True)
class Batch:
    """One piece of group commit, produced by `take_batch` and written by `write_batch`."""

    #: (segment number, bytes) in log order; consecutive pieces may share a segment
    writes: list[tuple[int, bytes | bytearray]]
    records: int
    nbytes: int
    #: the batch number that is fully synced once this piece is (0: none completes)
    closes: int
    #: segments to unlink after the writes (oldest first)
    deletes: list[int] = field(default_factory=list)
    #: filled in by write_batch
    write_ms: float = 0.0
    sync_ms: float = 0.0


class Segment:
    """The accounting of one segment (event-loop thread)."""

    __slots__ = ("live_bytes", "live_records", "msgs", "no", "size")

    def __init__(self, no: int, size: int) -> None:
        self.no = no
        #: bytes in the file, including records still buffered
        self.size = size
        self.live_bytes = 0
        self.live_records = 0
        #: qid -> seq -> Entry for live messages whose ADD record is in this segment
        self.msgs: dict[int, dict[int, Entry]] = {}


class QueueInfo:
    """A live queue: its current QUEUE record's contents, segment and size."""

    __slots__ = ("attributes", "name", "rec_size", "segno")

    def __init__(self, name: str, attributes: dict[str, Any], segno: int, rec_size: int) -> None:
        self.name = name
        self.attributes = attributes
        self.segno = segno
        self.rec_size = rec_size


class SegmentFiles:
    """The journal directory's open files: the LOCK, the directory, the append segment.

    `write` and `roll` are the writer (worker thread); `lock`, `release` and `fsync_dir`
    run on the event-loop thread while no batch is being written.
    """

    def __init__(self, directory: Path, sync: bool) -> None:
        self.directory = directory
        self.sync = sync
        self.lock_fd: int | None = None
        self.dir_fd: int | None = None
        # -- writer (worker thread) state
        self.wfd: int | None = None
        self.wsegno = 0
        #: segments with unreadable parts: renamed to *.corrupt instead of deleted
        self.damaged: set[int] = set()

    def release(self) -> None:
        for name in ("wfd", "dir_fd", "lock_fd"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                with contextlib.suppress(OSError):
                    os.close(fd)

    def lock(self) -> None:
        path = self.directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = ""
            with contextlib.suppress(OSError):
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
                if pid:
                    owner = f" (pid {pid})"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise JournalLockedError(
                    f"journal directory {self.directory} is locked by another broker"
                    f"{owner}; stop that broker, or configure a different store directory "
                    f"for this one"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.lock_fd = fd

    def fsync_dir(self) -> None:
        if self.sync and self.dir_fd is not None:
            os.fsync(self.dir_fd)

    def write(self, batch: Batch) -> None:
        """WORKER THREAD: write the batch (rolling segment files), fsync, unlink its deletes."""
        t0 = time.perf_counter()
        writes = batch.writes
        i = 0
        n = len(writes)
        while i < n:
            segno = writes[i][0]
            bufs: list[bytes | bytearray] = []
            while i < n and writes[i][0] == segno:
                bufs.append(writes[i][1])
                i += 1
            if segno != self.wsegno:
                self.roll(segno)
            assert self.wfd is not None
            _write_all(self.wfd, bufs)
        t1 = time.perf_counter()
        if self.sync and writes and self.wfd is not None:
            _fdatasync(self.wfd)
        if batch.deletes:
            for segno in batch.deletes:
                path = segment_path(self.directory, segno)
                if segno in self.damaged:
                    aside = path.with_name(path.name + ".corrupt")
                    os.replace(path, aside)
                    log.warning("journal: compacted damaged segment kept as %s", aside)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if self.sync and self.dir_fd is not None:
                os.fsync(self.dir_fd)
        t2 = time.perf_counter()
        batch.write_ms = (t1 - t0) * 1000.0
        batch.sync_ms = (t2 - t1) * 1000.0

    def roll(self, segno: int) -> None:
        if segno <= self.wsegno:
            raise JournalError(f"segment {segno} written after segment {self.wsegno}")
        if self.wfd is not None:
            # the old segment is complete on disk before the new one exists
            if self.sync:
                _fdatasync(self.wfd)
            os.close(self.wfd)
            self.wfd = None
        fd = os.open(
            segment_path(self.directory, segno),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
            0o644,
        )
        self.wfd = fd
        self.wsegno = segno
        _write_all(fd, [rec.segment_header(segno)])
        if self.sync and self.dir_fd is not None:
            os.fsync(self.dir_fd)


def _write_all(fd: int, bufs: list[bytes | bytearray]) -> None:
    views = [memoryview(b) for b in bufs if len(b)]
    while views:
        n = os.writev(fd, views[:_IOV_MAX])
        while n and views:
            first = views[0]
            if n >= len(first):
                n -= len(first)
                views.pop(0)
            else:
                views[0] = first[n:]
                n = 0
