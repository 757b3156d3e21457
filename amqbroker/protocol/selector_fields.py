"""The fields a JMS selector reads, taken from an encoded AMQP message.

`extractor(identifiers)` is called once per consumer with the identifiers its selector
references (`amqbroker.core.selector.Selector.identifiers`) and returns a function from
the message bytes (as received) to the ``fields`` mapping of `Selector.matches`. That
function walks the sections only as far as the last one it needs, skipping the others
by their encoded size; inside the header and properties lists it reads only the fields
asked for, and it walks the application-properties map only when one of the wanted
names occurs in its raw bytes, decoding only the wanted values. The body is never
looked at.

Mapping (as Qpid JMS presents an AMQP message, see docs JMS.md):

=================  ==========================================================
JMSPriority        header.priority (4 when absent)
JMSDeliveryMode    'PERSISTENT' when header.durable, else 'NON_PERSISTENT'
JMSXDeliveryCount  header.delivery-count + 1
JMSMessageID       properties.message-id: a string as is, ulong
                   'ID:AMQP_ULONG:<n>', uuid 'ID:AMQP_UUID:<uuid>', binary
                   'ID:AMQP_BINARY:<HEX>'
JMSXUserID         properties.user-id (binary) decoded as UTF-8
JMSType            properties.subject
JMSCorrelationID   properties.correlation-id, mapped like the message-id
JMSExpiration      properties.absolute-expiry-time in ms (0 when absent)
JMSTimestamp       properties.creation-time in ms (0 when absent)
JMSXGroupID        properties.group-id, else the application property JMSXGroupID
JMSXGroupSeq       properties.group-sequence as a signed 32-bit int, else the
                   application property JMSXGroupSeq (integral values folded the same)
anything else      the application property of that name
=================  ==========================================================

A field that is absent (or has a type the mapping does not expect) is left out of the
result: the selector sees NULL. Application-property values are decoded by
`scanner._decode`; those the selector cannot compare (binary, uuid, lists ...) simply
make their comparisons UNKNOWN.

The broker scans (and so validates) every message at arrival, so malformed input is
not expected here; should it happen, the function returns what it could read before
the malformation and never raises.
"""

from __future__ import annotations

import contextlib
import struct
import uuid
from collections.abc import Callable

from amqbroker.protocol.scanner import (
    _VAR8,
    _WIDTH,
    ScanError,
    _decode,
    _integral,
    _low32,
    _section_head,
    _skip,
)

__all__ = ["HEADER_FIELDS", "PROPERTY_FIELDS", "Extractor", "extractor"]

Extractor = Callable[[bytes], dict[str, object]]

HEADER_FIELDS = {"JMSDeliveryMode": 0, "JMSPriority": 1, "JMSXDeliveryCount": 4}
"""Selector identifier -> index of the header field it comes from."""

PROPERTY_FIELDS = {
    "JMSMessageID": 0,
    "JMSXUserID": 1,
    "JMSType": 3,
    "JMSCorrelationID": 5,
    "JMSExpiration": 8,
    "JMSTimestamp": 9,
    "JMSXGroupID": 10,
    "JMSXGroupSeq": 11,
}
"""Selector identifier -> index of the properties field it comes from."""

_GROUP_FALLBACK = ("JMSXGroupID", "JMSXGroupSeq")

_DEFAULTS: dict[str, object] = {
    "JMSDeliveryMode": "NON_PERSISTENT",
    "JMSPriority": 4,
    "JMSXDeliveryCount": 1,
    "JMSExpiration": 0,
    "JMSTimestamp": 0,
}

_HEADER = 0x70
_PROPERTIES = 0x73
_APPLICATION_PROPERTIES = 0x74
_U32 = struct.Struct(">I").unpack_from
_U32x2 = struct.Struct(">II").unpack_from
_I32 = struct.Struct(">i").unpack_from
_I64 = struct.Struct(">q").unpack_from
_F64 = struct.Struct(">d").unpack_from
_ERRORS = (ScanError, IndexError, struct.error, UnicodeDecodeError, ValueError)


def _list_head(data: bytes, v: int) -> tuple[int, int, int]:
    """(count, offset of the first element, end) of the list (or null) at `v`."""
    c = data[v]
    if c == 0xC0:
        return data[v + 2], v + 3, v + 2 + data[v + 1]
    if c == 0xD0:
        size, cnt = _U32x2(data, v + 1)
        return cnt, v + 9, v + 5 + size
    return 0, v + 1, v + 1  # list0, null (or anything else: read as empty)


def _id_string(data: bytes, q: int, end: int) -> str | None:
    """A message-id / correlation-id as Qpid JMS presents it."""
    c = data[q]
    if c in {0xA1, 0xB1}:
        v = _decode(data, q, end)
        return v if isinstance(v, str) else None
    if c in {0x80, 0x53, 0x44}:
        return f"ID:AMQP_ULONG:{_integral(data, q)}"
    if c == 0x98:
        return f"ID:AMQP_UUID:{uuid.UUID(bytes=data[q + 1 : q + 17])}"
    if c in {0xA0, 0xB0}:
        v = _decode(data, q, end)
        return f"ID:AMQP_BINARY:{v.hex().upper()}" if isinstance(v, bytes) else None
    return None


def _header(data: bytes, v: int, wanted: tuple[int, ...], out: dict[str, object]) -> None:
    cnt, q, end = _list_head(data, v)
    last = wanted[-1]
    for idx in range(min(cnt, last + 1)):
        if idx in wanted:
            value = _decode(data, q, end)
            if idx == 0:
                if value is True:
                    out["JMSDeliveryMode"] = "PERSISTENT"
            elif type(value) is int:
                if idx == 1:
                    out["JMSPriority"] = value
                else:
                    out["JMSXDeliveryCount"] = value + 1
        q = _skip(data, q)


def _properties(data: bytes, v: int, wanted: tuple[int, ...], out: dict[str, object]) -> None:
    cnt, q, end = _list_head(data, v)
    last = wanted[-1]
    width = _WIDTH
    for idx in range(min(cnt, last + 1)):
        if idx in wanted and data[q] != 0x40:
            if idx in {0, 5}:
                s = _id_string(data, q, end)
                if s is not None:
                    out["JMSMessageID" if idx == 0 else "JMSCorrelationID"] = s
            elif idx == 1:
                raw = _decode(data, q, end)
                if isinstance(raw, bytes):
                    with contextlib.suppress(UnicodeDecodeError):
                        out["JMSXUserID"] = raw.decode()
            elif idx in {3, 10}:
                if data[q] in {0xA1, 0xB1}:
                    with contextlib.suppress(UnicodeDecodeError):
                        out["JMSType" if idx == 3 else "JMSXGroupID"] = _decode(data, q, end)
            elif idx in {8, 9}:
                if data[q] == 0x83:
                    out["JMSExpiration" if idx == 8 else "JMSTimestamp"] = _decode(data, q, end)
            elif idx == 11:
                n = _integral(data, q)
                if n is not None:
                    out["JMSXGroupSeq"] = _low32(n)
        w = width[data[q]]
        if w > 0:
            q += w
        elif w == _VAR8:
            q += 2 + data[q + 1]
        else:
            q = _skip(data, q)
    if q > end:
        raise ScanError("properties overrun")


def _value(data: bytes, q: int, e: int) -> object:
    """The simple value at `q` (ending at `e`), the usual encodings inline."""
    c = data[q]
    if c == 0xA1:
        return data[q + 2 : e].decode()
    if c in {0x55, 0x54}:
        v = data[q + 1]
        return v - 0x100 if v & 0x80 else v
    if c == 0x41:
        return True
    if c == 0x42:
        return False
    if c == 0x71:
        return _I32(data, q + 1)[0]
    if c == 0x81:
        return _I64(data, q + 1)[0]
    if c == 0x82:
        return _F64(data, q + 1)[0]
    return _decode(data, q, e)


def _application(data: bytes, v: int, keys: dict[bytes, str], out: dict[str, object]) -> None:
    c = data[v]
    if c == 0xC1:
        end = v + 2 + data[v + 1]
        cnt = data[v + 2]
        q = v + 3
    elif c == 0xD1:
        size, cnt = _U32x2(data, v + 1)
        end = v + 5 + size
        q = v + 9
    else:
        return
    # only walk the map when a wanted name occurs in it
    for k in keys:
        if data.find(k, q, end) >= 0:
            break
    else:
        return
    width = _WIDTH
    remaining = len(keys)
    for _ in range(cnt >> 1):
        c = data[q]
        if c in {0xA1, 0xA3}:
            ks = q + 2
            q = ks + data[q + 1]
        elif c in {0xB1, 0xB3}:
            ks = q + 5
            q = ks + _U32(data, q + 1)[0]
        else:
            q = _skip(data, q, 2)
            continue
        name = keys.get(data[ks:q])
        c = data[q]
        w = width[c]
        if w > 0:
            e = q + w
        elif w == _VAR8:
            e = q + 2 + data[q + 1]
        else:
            e = _skip(data, q)
        if name is None or name in out:
            q = e
            continue
        if e > end:
            return
        try:
            value = _value(data, q, e)
        except UnicodeDecodeError:
            value = None
        if value is not None:
            if name == "JMSXGroupSeq" and type(value) is int:
                value = _low32(value)
            out[name] = value
        q = e
        remaining -= 1
        if not remaining:
            return


def extractor(identifiers: frozenset[str]) -> Extractor:
    """A function from encoded message bytes to the selector fields for `identifiers`."""
    header = tuple(sorted({HEADER_FIELDS[i] for i in identifiers if i in HEADER_FIELDS}))
    props = tuple(sorted({PROPERTY_FIELDS[i] for i in identifiers if i in PROPERTY_FIELDS}))
    app = {
        i.encode(): i
        for i in identifiers
        if (i not in HEADER_FIELDS and i not in PROPERTY_FIELDS) or i in _GROUP_FALLBACK
    }
    defaults = {k: v for k, v in _DEFAULTS.items() if k in identifiers}
    if app:
        last = _APPLICATION_PROPERTIES
    elif props:
        last = _PROPERTIES
    elif header:
        last = _HEADER
    else:

        def constant(data: bytes) -> dict[str, object]:
            return {}

        return constant

    def extract(data: bytes) -> dict[str, object]:
        out = dict(defaults)
        if type(data) is not bytes:  # bytearray / memoryview: slices must be hashable
            data = bytes(data)
        n = len(data)
        p = 0
        try:
            while p < n:
                if data[p + 1] == 0x53 and not data[p]:
                    code = data[p + 2]
                    v = p + 3
                else:
                    code, v = _section_head(data, p)
                if code > last:
                    break
                if code == _APPLICATION_PROPERTIES:
                    _application(data, v, app, out)
                    break
                if code == _PROPERTIES:
                    if props:
                        _properties(data, v, props, out)
                elif code == _HEADER and header:
                    _header(data, v, header, out)
                c = data[v]
                if c in {0xC0, 0xC1}:
                    p = v + 2 + data[v + 1]
                elif c in {0xD0, 0xD1}:
                    p = v + 5 + _U32(data, v + 1)[0]
                else:
                    p = _skip(data, v)
        except _ERRORS:
            pass
        return out

    return extract
