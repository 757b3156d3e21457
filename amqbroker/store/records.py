"""On-disk format of the journal: segment headers and records (pure encode/decode, no I/O).

Theory of operation
-------------------
The journal (`amqbroker.store.journal`) is an append-only log split into segment files
``segment-<n:08d>.log``. This module only knows how bytes are laid out; it opens no
files and holds no state, so both the event-loop side (encoding) and recovery (decoding)
use it.

Segment file layout
-------------------
A segment starts with a fixed header, followed by records back to back::

    [8s magic b"AMQJRNL\\0"][u32 version = 1][u64 segment number]      (20 bytes)

Record layout (all integers little-endian)::

    [u32 length][u32 crc32(type + payload)][u8 type][payload: `length` bytes]

`length` counts the payload only, so a record occupies ``9 + length`` bytes. The CRC
covers the type byte and the payload; the length is protected indirectly (a wrong length
makes the CRC of the bytes it delimits fail, or runs past the end of the file).

Record types and payloads:

- QUEUE (1): ``[u64 qid][u32 name length][name utf-8][attributes as JSON utf-8 ...]``
- QUEUE_DEL (2): ``[u64 qid]``
- ADD (3, read only): ``[u64 qid][u64 seq][u8 priority][i64 expiry][i64 group_seq]
  [u32 delivery_count][i32 group-id length, -1 = absent][group-id utf-8][data ...]``.
  Written by earlier versions; decoded with ``deliver_at = 0``. Never written now.
- ACK (4): ``[u64 qid][u64 seq]``
- DCOUNT (5): ``[u64 qid][u64 seq][u32 delivery_count]``
- ADD2 (6): ``[u64 qid][u64 seq][u8 priority][i64 expiry][i64 deliver_at][i64 group_seq]
  [u32 delivery_count][i32 group-id length, -1 = absent][group-id utf-8][data ...]``.
  What `encode_add` writes: ADD plus `Entry.deliver_at` (epoch ms, 0 = deliver now).
- TXN (7): ``[sub-record][sub-record]...`` - an atomic group (a transaction's commit).
  Each sub-record is framed exactly like a record (9-byte header, then payload) except
  that its CRC field holds ``crc ^ TXN_SUB_CRC_XOR``. Sub-records are of the types
  above except TXN (no nesting). The outer CRC covers them all, so the group is valid
  (and applied, sub-record by sub-record in order) or torn/corrupt (and applied not at
  all). The XOR makes sure a sub-record never passes for a top-level record, so the
  bytes of a torn TXN at the tail look like garbage to `valid_record_after` and the
  tail is recognized as torn rather than as corruption followed by valid records.
  A sub-record has the same size as the stand-alone record, so an ADD inside a TXN
  still occupies `add_record_size` bytes.

Invariants
----------
- A record is valid iff its 9-byte header and its whole payload lie inside the file and
  the CRC matches. Anything else is a torn write (at the tail of the newest segment) or
  corruption (anywhere else); `SegmentReader` reports the offset and the reason and the
  journal decides what to do.
- Message identity is ``(qid, seq)``: `Entry.seq` is per queue.
- `add_record_size` computes the exact encoded size of an ADD2 record from an `Entry`
  without encoding it; the journal's live-byte accounting relies on it being equal to
  ``len(encode_add(...))``. It does not depend on `deliver_at` (ADD2 always carries
  it), so the core may change `deliver_at` of a stored entry without upsetting the
  accounting. (An old ADD record is 8 bytes smaller than `add_record_size` says; the
  journal counts it at `add_record_size` throughout, consistently, until compaction
  rewrites it as ADD2.)
- Only `data`, `durable` (implied), `priority`, `expiry`, `deliver_at`, `group_id`,
  `group_seq`, `delivery_count` and `seq` of an `Entry` are persisted; `fields`,
  `origin` and `gkey` are not.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import TYPE_CHECKING, Any, Final

from amqbroker.core.entry import Entry
from amqbroker.core.errors import LocalError

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

SEGMENT_MAGIC: Final = b"AMQJRNL\x00"
SEGMENT_VERSION: Final = 1
_SEG_HEADER: Final = struct.Struct("<8sIQ")
SEGMENT_HEADER_SIZE: Final = _SEG_HEADER.size

_REC_HEADER: Final = struct.Struct("<IIB")
RECORD_HEADER_SIZE: Final = _REC_HEADER.size  # 9

QUEUE: Final = 1
QUEUE_DEL: Final = 2
ADD: Final = 3
ACK: Final = 4
DCOUNT: Final = 5
ADD2: Final = 6
TXN: Final = 7
RECORD_TYPES: Final = {
    QUEUE: "QUEUE",
    QUEUE_DEL: "QUEUE_DEL",
    ADD: "ADD",
    ACK: "ACK",
    DCOUNT: "DCOUNT",
    ADD2: "ADD2",
    TXN: "TXN",
}
#: XORed into the CRC field of a sub-record of a TXN record
TXN_SUB_CRC_XOR: Final = 0x54584E31

_QUEUE: Final = struct.Struct("<QI")
_QID: Final = struct.Struct("<Q")
_ADD: Final = struct.Struct("<QQBqqIi")  # old format, decoded only
_ADD2: Final = struct.Struct("<QQBqqqIi")
_ACK: Final = struct.Struct("<QQ")
_DCOUNT: Final = struct.Struct("<QQI")

#: bytes of an ADD2 record besides the group id and the message data
ADD_OVERHEAD: Final = RECORD_HEADER_SIZE + _ADD2.size

_U32_MAX: Final = 0xFFFFFFFF
_TYPE_CRC: Final = {t: zlib.crc32(bytes([t])) for t in RECORD_TYPES}


class CorruptRecord(LocalError, ValueError):
    """A record whose framing and CRC are fine but whose payload cannot be decoded."""


# --------------------------------------------------------------------------- encoding


def segment_header(segno: int) -> bytes:
    return _SEG_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, segno)


def check_segment_header(buf: bytes | memoryview, segno: int) -> str | None:
    """None if `buf` starts with a valid header for segment `segno`, else what is wrong."""
    if len(buf) < SEGMENT_HEADER_SIZE:
        return f"short segment header ({len(buf)} of {SEGMENT_HEADER_SIZE} bytes)"
    magic, version, no = _SEG_HEADER.unpack_from(buf, 0)
    if magic != SEGMENT_MAGIC:
        return f"bad segment magic {bytes(magic)!r}"
    if version != SEGMENT_VERSION:
        return f"unsupported segment version {version}"
    if no != segno:
        return f"header says segment {no}, file name says {segno}"
    return None


def _frame(rtype: int, payload: bytes) -> bytes:
    crc = zlib.crc32(payload, _TYPE_CRC[rtype])
    return _REC_HEADER.pack(len(payload), crc, rtype) + payload


def encode_queue(qid: int, name: str, attributes: dict[str, Any]) -> bytes:
    bname = name.encode()
    battrs = json.dumps(attributes, separators=(",", ":"), sort_keys=True).encode()
    return _frame(QUEUE, _QUEUE.pack(qid, len(bname)) + bname + battrs)


def encode_queue_del(qid: int) -> bytes:
    return _frame(QUEUE_DEL, _QID.pack(qid))


def encode_add(qid: int, entry: Entry) -> bytes:
    gid_str = entry.group_id
    if gid_str is None:
        gid = b""
        gid_len = -1
    else:
        gid = gid_str.encode()
        gid_len = len(gid)
    data = entry.data
    fixed = _ADD2.pack(
        qid,
        entry.seq,
        entry.priority,
        entry.expiry,
        entry.deliver_at,
        entry.group_seq,
        min(entry.delivery_count, _U32_MAX),
        gid_len,
    )
    crc = zlib.crc32(data, zlib.crc32(gid, zlib.crc32(fixed, _TYPE_CRC[ADD2])))
    head = _REC_HEADER.pack(len(fixed) + len(gid) + len(data), crc, ADD2)
    return b"".join((head, fixed, gid, data))


def add_record_size(entry: Entry) -> int:
    """Exact size of ``encode_add(qid, entry)`` (an ADD2 record)."""
    gid = entry.group_id
    return ADD_OVERHEAD + len(entry.data) + (0 if gid is None else len(gid.encode()))


def encode_ack(qid: int, seq: int) -> bytes:
    return _frame(ACK, _ACK.pack(qid, seq))


def encode_dcount(qid: int, seq: int, delivery_count: int) -> bytes:
    return _frame(DCOUNT, _DCOUNT.pack(qid, seq, min(delivery_count, _U32_MAX)))


def encode_txn(records: Sequence[bytes]) -> bytes:
    """One TXN record holding the given encoded records (any type but TXN), in order."""
    parts: list[bytes | memoryview] = []
    crc = _TYPE_CRC[TXN]
    total = 0
    for r in records:
        length, rcrc, rtype = _REC_HEADER.unpack_from(r, 0)
        if rtype == TXN or rtype not in RECORD_TYPES:
            raise ValueError(f"record type {rtype} cannot go into a TXN record")
        if RECORD_HEADER_SIZE + length != len(r):
            raise ValueError("not exactly one encoded record")
        head = _REC_HEADER.pack(length, rcrc ^ TXN_SUB_CRC_XOR, rtype)
        body = memoryview(r)[RECORD_HEADER_SIZE:]
        crc = zlib.crc32(body, zlib.crc32(head, crc))
        parts += (head, body)
        total += len(r)
    return b"".join([_REC_HEADER.pack(total, crc, TXN), *parts])


# --------------------------------------------------------------------------- decoding


def record_length_at(buf: bytes | bytearray | memoryview, off: int) -> int:
    """Total size of the (already validated) record starting at `off`."""
    length: int = _REC_HEADER.unpack_from(buf, off)[0]
    return RECORD_HEADER_SIZE + length


def decode_queue(p: memoryview) -> tuple[int, str, dict[str, Any]]:
    try:
        qid, nlen = _QUEUE.unpack_from(p, 0)
        start = _QUEUE.size
        if start + nlen > len(p):
            raise CorruptRecord("queue name runs past the record")
        name = bytes(p[start : start + nlen]).decode()
        attrs = json.loads(bytes(p[start + nlen :]).decode())
    except (struct.error, ValueError) as e:
        raise CorruptRecord(f"undecodable QUEUE record: {e}") from None
    if not isinstance(attrs, dict):
        raise CorruptRecord("QUEUE attributes are not a JSON object")
    return qid, name, attrs


def decode_qid(p: memoryview) -> int:
    if len(p) != _QID.size:
        raise CorruptRecord(f"QUEUE_DEL payload has {len(p)} bytes")
    qid: int = _QID.unpack_from(p, 0)[0]
    return qid


def decode_add(p: memoryview, rtype: int = ADD2) -> tuple[int, Entry]:
    """(qid, a new durable Entry with seq and all persisted fields set).

    `rtype` is the record type: ADD2, or the old ADD (``deliver_at`` = 0).
    """
    try:
        if rtype == ADD2:
            qid, seq, prio, expiry, deliver_at, gseq, dc, gid_len = _ADD2.unpack_from(p, 0)
            start = _ADD2.size
        elif rtype == ADD:
            qid, seq, prio, expiry, gseq, dc, gid_len = _ADD.unpack_from(p, 0)
            deliver_at = 0
            start = _ADD.size
        else:
            raise CorruptRecord(f"record type {rtype} is not an ADD record")
        if gid_len < 0:
            gid = None
        else:
            if start + gid_len > len(p):
                raise CorruptRecord("group id runs past the record")
            gid = bytes(p[start : start + gid_len]).decode()
            start += gid_len
    except (struct.error, ValueError) as e:
        raise CorruptRecord(f"undecodable ADD record: {e}") from None
    entry = Entry(
        bytes(p[start:]),
        durable=True,
        priority=prio,
        expiry=expiry,
        delivery_count=dc,
        group_id=gid,
        group_seq=gseq,
    )
    entry.seq = seq
    entry.deliver_at = deliver_at
    return qid, entry


def decode_ack(p: memoryview) -> tuple[int, int]:
    if len(p) != _ACK.size:
        raise CorruptRecord(f"ACK payload has {len(p)} bytes")
    qid, seq = _ACK.unpack_from(p, 0)
    return qid, seq


def decode_dcount(p: memoryview) -> tuple[int, int, int]:
    if len(p) != _DCOUNT.size:
        raise CorruptRecord(f"DCOUNT payload has {len(p)} bytes")
    qid, seq, dc = _DCOUNT.unpack_from(p, 0)
    return qid, seq, dc


def decode_txn(p: memoryview) -> list[tuple[int, memoryview]]:
    """The sub-records of a TXN record as ``(type, payload)``, in order.

    Raises CorruptRecord (and returns nothing) if any sub-record is badly framed, fails
    its CRC, is a TXN or of an unknown type: a TXN is applied whole or not at all.
    """
    out: list[tuple[int, memoryview]] = []
    size = len(p)
    off = 0
    unpack = _REC_HEADER.unpack_from
    while off < size:
        if off + RECORD_HEADER_SIZE > size:
            raise CorruptRecord(f"TXN sub-record header cut short at {off}")
        length, crc, rtype = unpack(p, off)
        body = off + RECORD_HEADER_SIZE
        if body + length > size:
            raise CorruptRecord(f"TXN sub-record at {off} runs past the record")
        if rtype == TXN or rtype not in RECORD_TYPES:
            raise CorruptRecord(f"TXN sub-record at {off} has type {rtype}")
        payload = p[body : body + length]
        if zlib.crc32(payload, _TYPE_CRC[rtype]) != crc ^ TXN_SUB_CRC_XOR:
            raise CorruptRecord(f"TXN sub-record at {off}: CRC mismatch")
        out.append((rtype, payload))
        off = body + length
    return out


class SegmentReader:
    """Walks the records of one segment image held in memory.

    Iterate `records()` to get ``(offset, type, payload)`` for every well-framed record
    (header and payload inside the image, CRC correct) in order; the type may still be
    one this version does not know. When the iteration ends, `end` is the offset just
    past the last good record and `problem` is None if that is the end of the image, or
    a description of what is wrong with the bytes at `end` (the caller decides whether
    that is a torn tail or corruption).
    """

    __slots__ = ("buf", "end", "problem")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.end = SEGMENT_HEADER_SIZE
        self.problem: str | None = None

    def records(self) -> Iterator[tuple[int, int, memoryview]]:
        buf = self.buf
        mv = memoryview(buf)
        size = len(buf)
        off = SEGMENT_HEADER_SIZE
        unpack = _REC_HEADER.unpack_from
        while off < size:
            problem = _check_record(buf, mv, off)
            if problem is not None:
                self.end = off
                self.problem = problem
                return
            length = unpack(buf, off)[0]
            body = off + RECORD_HEADER_SIZE
            yield off, buf[off + 8], mv[body : body + length]
            off = body + length
            self.end = off

    def valid_record_after(self, off: int) -> int | None:
        """Offset of the first position > `off` where a valid record starts, if any.

        Used to tell a torn tail (only garbage or zeros follow) from corruption in the
        middle of the data (valid records follow). Only records of known types count, and
        zero-filled regions are skipped quickly.
        """
        buf = self.buf
        mv = memoryview(buf)
        size = len(buf)
        pos = off + 1
        while pos + RECORD_HEADER_SIZE <= size:
            rtype = buf[pos + 8]
            if rtype == 0:
                # no record can start where its type byte would be 0: jump over zero runs
                stripped = buf[pos + 8 :].lstrip(b"\x00")
                if len(stripped) == 0:
                    return None
                pos = max(pos + 1, size - len(stripped) - 8)
                continue
            if rtype in RECORD_TYPES and _check_record(buf, mv, pos) is None:
                return pos
            pos += 1
        return None


def _check_record(buf: bytes, mv: memoryview, off: int) -> str | None:
    size = len(buf)
    if off + RECORD_HEADER_SIZE > size:
        return f"record header cut short ({size - off} of {RECORD_HEADER_SIZE} bytes)"
    length, crc, rtype = _REC_HEADER.unpack_from(buf, off)
    body = off + RECORD_HEADER_SIZE
    if body + length > size:
        return (
            f"record length {length} runs past the end of the file by {body + length - size} bytes"
        )
    start_crc = _TYPE_CRC.get(rtype)
    if start_crc is None:
        start_crc = zlib.crc32(bytes((rtype,)))
    if zlib.crc32(mv[body : body + length], start_crc) != crc:
        return f"CRC mismatch (type {rtype}, length {length})"
    return None
