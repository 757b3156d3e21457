"""The replication stream's frames: one frame per AMQP transfer on `$ha.replication`.

Every frame starts with the same header::

    [u8 version = 1][u8 kind][u64 epoch][16s stream id]

followed by the kind's body (all integers little-endian):

- SNAPSHOT_FILE_CHUNK: ``[u16 path length][path, utf-8, relative to the data dir]
  [u64 offset][bytes to the end of the frame]``: part of one file of the primary's
  store as it was when the full sync started.
- SNAPSHOT_DONE: ``[u32 files]``: every file was sent; the backup swaps its staging
  directory in.
- BATCH: ``[u64 cycle][u32 journal records][u32 n][n x (u64 segment, u32 length, bytes)]
  [u32 n][n x u64 segment deleted][u8 pages durable][u32 n][n x (u64 qid, u64 segment,
  u8 new file, u32 length, bytes)][u32 n][n x (u64 qid, u64 segment or 0)]``: one
  store cycle (`StoreWriter.commit_one`): the journal `Batch`'s writes and deletes and
  the page store's `PageBatch`.

The epoch is the primary's (the lease's; 0 without one); the stream id is chosen by
the primary for each full sync, so a backup can tell a batch of its own stream from a
leftover of an older one. A frame of another version is refused (`StreamError`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from amqbroker.store.journal_segments import Batch
from amqbroker.store.paging import PageBatch

VERSION: Final = 1
SNAPSHOT_FILE_CHUNK: Final = 1
SNAPSHOT_DONE: Final = 2
BATCH: Final = 3

_HEADER: Final = struct.Struct("<BBQ16s")
HEADER_SIZE: Final = _HEADER.size
_U8: Final = struct.Struct("<B")
_U16: Final = struct.Struct("<H")
_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
_JW: Final = struct.Struct("<QI")
_PW: Final = struct.Struct("<QQBI")
_PD: Final = struct.Struct("<QQ")


class StreamError(ValueError):
    """A frame that cannot be decoded (another version, truncated, unknown kind)."""


@dataclass(slots=True)
class Header:
    kind: int
    epoch: int
    stream: bytes


@dataclass(slots=True)
class FileChunk:
    path: str
    offset: int
    data: bytes


@dataclass(slots=True)
class SnapshotDone:
    files: int


@dataclass(slots=True)
class CycleBatch:
    cycle: int
    journal: Batch | None
    pages: PageBatch | None

    @property
    def nbytes(self) -> int:
        n = sum(len(b) for _, b in self.journal.writes) if self.journal else 0
        if self.pages is not None:
            n += sum(len(w[3]) for w in self.pages.writes)
        return n

    @property
    def records(self) -> int:
        return self.journal.records if self.journal is not None else 0


Frame = FileChunk | SnapshotDone | CycleBatch


def _header(kind: int, epoch: int, stream: bytes) -> bytes:
    if len(stream) != 16:
        raise ValueError("a stream id is 16 bytes")
    return _HEADER.pack(VERSION, kind, epoch, stream)


def encode_chunk(epoch: int, stream: bytes, path: str, offset: int, data: bytes) -> bytes:
    p = path.encode()
    return b"".join(
        (_header(SNAPSHOT_FILE_CHUNK, epoch, stream), _U16.pack(len(p)), p, _U64.pack(offset), data)
    )


def encode_done(epoch: int, stream: bytes, files: int) -> bytes:
    return _header(SNAPSHOT_DONE, epoch, stream) + _U32.pack(files)


def encode_batch(
    epoch: int, stream: bytes, cycle: int, batch: Batch | None, pages: PageBatch | None
) -> bytes:
    parts: list[bytes | bytearray] = [
        _header(BATCH, epoch, stream),
        _U64.pack(cycle),
        _U32.pack(batch.records if batch is not None else 0),
    ]
    jw = batch.writes if batch is not None else []
    parts.append(_U32.pack(len(jw)))
    for segno, data in jw:
        parts.append(_JW.pack(segno, len(data)))
        parts.append(data)
    jd = batch.deletes if batch is not None else []
    parts.append(_U32.pack(len(jd)))
    parts.extend(_U64.pack(s) for s in jd)
    parts.append(_U8.pack(1 if pages is not None and pages.durable else 0))
    pw = pages.writes if pages is not None else []
    parts.append(_U32.pack(len(pw)))
    for qid, segno, new, buf in pw:
        parts.append(_PW.pack(qid, segno, 1 if new else 0, len(buf)))
        parts.append(buf)
    pd = pages.deletes if pages is not None else []
    parts.append(_U32.pack(len(pd)))
    parts.extend(_PD.pack(q, s) for q, s in pd)
    return b"".join(parts)


def decode_header(data: bytes | memoryview) -> Header:
    if len(data) < HEADER_SIZE:
        raise StreamError(f"frame of {len(data)} byte(s) is shorter than its header")
    version, kind, epoch, stream = _HEADER.unpack_from(data, 0)
    if version != VERSION:
        raise StreamError(f"replication stream version {version}; this broker reads {VERSION}")
    return Header(kind, epoch, bytes(stream))


def batch_records(data: bytes, offset: int = 0) -> int:
    """The journal records of the BATCH frame at `offset` of `data` (0 for any other
    frame, or one too short): what the backup counts as lag before decoding it."""
    if len(data) < offset + HEADER_SIZE + 12 or data[offset + 1] != BATCH:
        return 0
    n: int = _U32.unpack_from(data, offset + HEADER_SIZE + 8)[0]
    return n


def decode(data: bytes) -> tuple[Header, Frame]:
    """One frame's header and body."""
    h = decode_header(data)
    try:
        if h.kind == SNAPSHOT_FILE_CHUNK:
            return h, _decode_chunk(data)
        if h.kind == SNAPSHOT_DONE:
            return h, SnapshotDone(_U32.unpack_from(data, HEADER_SIZE)[0])
        if h.kind == BATCH:
            return h, _decode_batch(data)
    except (struct.error, UnicodeDecodeError) as exc:
        raise StreamError(f"damaged replication frame of kind {h.kind}: {exc}") from None
    raise StreamError(f"unknown replication frame kind {h.kind}")


def _decode_chunk(data: bytes) -> FileChunk:
    off = HEADER_SIZE
    (n,) = _U16.unpack_from(data, off)
    off += 2
    if off + n + 8 > len(data):
        raise struct.error("path runs past the frame")
    path = data[off : off + n].decode()
    off += n
    (offset,) = _U64.unpack_from(data, off)
    return FileChunk(path, offset, data[off + 8 :])


def _decode_batch(data: bytes) -> CycleBatch:
    off = HEADER_SIZE
    (cycle,) = _U64.unpack_from(data, off)
    (records,) = _U32.unpack_from(data, off + 8)
    off += 12
    (n,) = _U32.unpack_from(data, off)
    off += 4
    writes: list[tuple[int, bytes | bytearray]] = []
    total = 0
    for _ in range(n):
        segno, size = _JW.unpack_from(data, off)
        off += _JW.size
        if off + size > len(data):
            raise struct.error("journal write runs past the frame")
        writes.append((segno, data[off : off + size]))
        total += size
        off += size
    (n,) = _U32.unpack_from(data, off)
    off += 4
    deletes = [_U64.unpack_from(data, off + 8 * i)[0] for i in range(n)]
    off += 8 * n
    (durable,) = _U8.unpack_from(data, off)
    off += 1
    (n,) = _U32.unpack_from(data, off)
    off += 4
    pwrites: list[tuple[int, int, bool, bytearray]] = []
    for _ in range(n):
        qid, segno, new, size = _PW.unpack_from(data, off)
        off += _PW.size
        if off + size > len(data):
            raise struct.error("page write runs past the frame")
        pwrites.append((qid, segno, bool(new), bytearray(data[off : off + size])))
        off += size
    (n,) = _U32.unpack_from(data, off)
    off += 4
    pdeletes = [_PD.unpack_from(data, off + 16 * i) for i in range(n)]
    off += 16 * n
    if off != len(data):
        raise struct.error(f"{len(data) - off} byte(s) after the batch")
    journal = (
        Batch(writes, records=records, nbytes=total, closes=0, deletes=deletes)
        if writes or deletes
        else None
    )
    pages = (
        PageBatch(pwrites, bool(durable), [(q, s) for q, s in pdeletes])
        if pwrites or pdeletes
        else None
    )
    return CycleBatch(cycle, journal, pages)
