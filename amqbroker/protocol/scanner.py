"""Scan and splice encoded AMQP 1.0 messages without decoding them.

Theory of operation
===================

Why scan instead of decode
--------------------------
The broker forwards the exact bytes a producer sent. Decoding a message into objects
(``proton.Message.decode`` costs ~30 us) and encoding it again would be both slow and
lossy: re-encoding normalises types (an AMQP ``byte`` annotation such as Qpid JMS's
``x-opt-jms-msg-type`` would come back as an ``int``/``long`` and break the JMS client).
So at arrival `scan` walks the encoded sections *just far enough* to read the handful
of fields the broker routes and dispatches on (header durable/priority/ttl/
delivery-count, properties to/absolute-expiry-time/group-id/group-sequence, the
group fallback application properties and the JMS delayed-delivery annotations) and
returns them as a flat tuple. Everything
else is skipped by its encoded size; no intermediate objects are built and the body is
never parsed.

An encoded message is a sequence of sections, each a described type
``0x00 <descriptor> <value>``. The descriptor is a ulong (``0x53 <code>`` or
``0x80 <8 bytes>``) or a symbol (``amqp:header:list`` ...). Section codes, in the only
allowed order::

    0x70 header (list)        0x71 delivery-annotations (map)
    0x72 message-annotations  0x73 properties (list)    0x74 application-properties
    0x75 data* | 0x76 amqp-sequence* | 0x77 amqp-value   (the body: one kind only)
    0x78 footer (map)

The splice rule
---------------
When the broker must change something on the wire (delivery-count on redelivery,
annotations on dead-lettering, the group-first application property) the slow-path
helpers build a new byte string in which every byte they do not mean to change is a
copy of the input: untouched sections are copied as slices, and inside a map that
gets an entry added, the existing entries are copied byte-for-byte and only the map's
size/count prefix is rewritten (widening map8 to map32 when the result no longer fits).
An existing value is never decoded and re-encoded. Only the header is re-encoded as a
whole by `set_delivery_count`, and even there each field other than delivery-count is
copied as its original encoding.

What is validated
-----------------
`scan` raises `ScanError` (the broker rejects with ``amqp:decode-error``) when:

* the data is empty, or something other than a described section appears at the top
  level, or a section descriptor is not one of the nine known ones;
* sections are duplicated or out of order, body kinds are mixed, or an amqp-value
  section repeats;
* a section's value has the wrong shape (header/properties must be a list, the
  annotation, application-properties and footer sections a map, data a binary,
  amqp-sequence a list; ``null`` is tolerated for the non-body sections and reads as
  empty);
* any value it skips or reads uses an unknown constructor, has an impossible size, or
  runs past the end of its list or of the data (truncation). Every section is framed,
  including the body sections and the footer, so the last section must end exactly at
  the end of the data;
* a string it actually reads (to, group-id, the fallback group id) is not UTF-8;
* a map it walks (application-properties for the group fallback, message-annotations
  for delayed delivery, see below) has an odd count or an entry overrunning the map.

A message without a body section is accepted (proton encodes an empty Message as just
header and properties).

Fields read with an unexpected type (say a priority encoded as an int, or a symbol
group-id) are treated as absent, exactly like proton-c does.

Group fallback: when properties.group-id is absent/null and ``app_fallback`` is set,
the group id is the first *string* application property of JMSXGroupID, then
_AMQ_GROUP_ID; likewise an absent group-sequence comes from JMSXGroupSeq, then
_AMQ_GROUP_SEQUENCE (any integral type, folded to signed 32 bits). Application
properties are only walked when a fallback is needed and the raw section contains
one of the key names (a substring test in C).

Delayed delivery (JMS 2.0 delivery delay, as Qpid JMS and ActiveMQ Artemis encode it):
``delivery_time`` is the message annotation ``x-opt-delivery-time`` (absolute epoch
ms; a long, as Qpid JMS sends it, a timestamp, or any other integral type) and
``delivery_delay`` the annotation ``x-opt-delivery-delay`` (ms; any integral type, not
a timestamp). Both read 0 when absent, of another type, or not positive; only symbol
keys match (annotation keys are symbols), and the first entry with a given key wins.
Both can be present: which one applies is the caller's decision (Artemis prefers the
time). The message-annotations map is only walked when its raw bytes contain
``x-opt-delivery-`` (``bytes.find`` within the section), so a message without these
annotations pays one substring test. Delivery-annotations are never read.

Parts that the scan skips by size (annotation and application-properties entries
outside these walks, the properties fields after group-sequence, the body content) are
not looked inside: the map splices walk the map they modify and may raise `ScanError`
for a malformation inside it that `scan` did not look at. Every header field is framed,
so `set_delivery_count` never fails on a message `scan` accepted.

`jms_dest` (not on the hot path) reads the JMS destination type annotation
``x-opt-jms-dest`` with the same map walk. `annotated_body` reads a message that
carries another one (the cluster's forwarding envelope): two annotation strings and
the offsets of the body binary, framing every section like the splices.

Truncated or corrupt input never raises anything but `ScanError` (no IndexError,
struct.error or UnicodeDecodeError escapes), and no input can cause deep recursion:
described values are skipped iteratively and compound values by their size.
"""

from __future__ import annotations

import struct
import uuid
from typing import TYPE_CHECKING, TypeAlias

from amqbroker.core.errors import PeerError

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "ScanError",
    "Scanned",
    "add_application_property",
    "add_message_annotations",
    "annotated_body",
    "application_properties",
    "duplicate_id",
    "jms_dest",
    "log_message_id",
    "message_id",
    "message_id_text",
    "scan",
    "set_delivery_count",
]


class ScanError(PeerError, ValueError):
    """Malformed or truncated message; the broker rejects it with amqp:decode-error.

    The message says what was wrong and at which offset."""


Scanned: TypeAlias = tuple[bool, int, int, int, int, str | None, int, str | None, int, int]
"""(durable, priority, ttl_ms, absolute_expiry_ms, delivery_count, group_id, group_seq, to,
delivery_time_ms, delivery_delay_ms)"""

# --------------------------------------------------------------------------- tables

_HEADER = 0x70
_DELIVERY_ANNOTATIONS = 0x71
_MESSAGE_ANNOTATIONS = 0x72
_PROPERTIES = 0x73
_APPLICATION_PROPERTIES = 0x74
_DATA = 0x75
_SEQUENCE = 0x76
_VALUE = 0x77
_FOOTER = 0x78

_SECTION_NAMES = {
    _HEADER: "header",
    _DELIVERY_ANNOTATIONS: "delivery-annotations",
    _MESSAGE_ANNOTATIONS: "message-annotations",
    _PROPERTIES: "properties",
    _APPLICATION_PROPERTIES: "application-properties",
    _DATA: "data",
    _SEQUENCE: "amqp-sequence",
    _VALUE: "amqp-value",
    _FOOTER: "footer",
}

_SYMBOLIC = {
    b"amqp:header:list": _HEADER,
    b"amqp:delivery-annotations:map": _DELIVERY_ANNOTATIONS,
    b"amqp:message-annotations:map": _MESSAGE_ANNOTATIONS,
    b"amqp:properties:list": _PROPERTIES,
    b"amqp:application-properties:map": _APPLICATION_PROPERTIES,
    b"amqp:data:binary": _DATA,
    b"amqp:amqp-sequence:list": _SEQUENCE,
    b"amqp:amqp-value:*": _VALUE,
    b"amqp:footer:map": _FOOTER,
}

# Skip table: constructor byte -> total encoded length for fixed-width types (>= 1),
# or one of the negative classes below.
_INVALID = -1
_VAR8 = -2  # vbin8/str8/sym8: 1-byte size, then the bytes
_VAR32 = -3  # vbin32/str32/sym32: 4-byte size, then the bytes
_COMPOUND8 = -4  # list8/map8: 1-byte size (>= 1, covers the count byte)
_COMPOUND32 = -5  # list32/map32: 4-byte size (>= 4, covers the count)
_ARRAY8 = -6  # array8: 1-byte size (>= 2: count and element constructor)
_ARRAY32 = -7  # array32: 4-byte size (>= 5)
_DESCRIBED = -8  # 0x00 descriptor value


def _build_width_table() -> tuple[int, ...]:
    t = [_INVALID] * 256
    for c in (0x40, 0x41, 0x42, 0x43, 0x44, 0x45):
        t[c] = 1
    for c in (0x50, 0x51, 0x52, 0x53, 0x54, 0x55, 0x56):
        t[c] = 2
    for c in (0x60, 0x61):
        t[c] = 3
    for c in (0x70, 0x71, 0x72, 0x73, 0x74):
        t[c] = 5
    for c in (0x80, 0x81, 0x82, 0x83, 0x84):
        t[c] = 9
    t[0x94] = 17
    t[0x98] = 17
    for c in (0xA0, 0xA1, 0xA3):
        t[c] = _VAR8
    for c in (0xB0, 0xB1, 0xB3):
        t[c] = _VAR32
    t[0xC0] = t[0xC1] = _COMPOUND8
    t[0xD0] = t[0xD1] = _COMPOUND32
    t[0xE0] = _ARRAY8
    t[0xF0] = _ARRAY32
    t[0x00] = _DESCRIBED
    return tuple(t)


_WIDTH = _build_width_table()

_U32 = struct.Struct(">I").unpack_from
_U32x2 = struct.Struct(">II").unpack_from
_U64 = struct.Struct(">Q").unpack_from
_I64 = struct.Struct(">q").unpack_from
#: ten nulls: the properties fields message-id .. creation-time of a bare message
_NULLS10 = b"\x40" * 10
#: a properties section (list8) at the start of a message (`scan`'s opening test)
_PROPS8 = b"\x00\x53\x73\xc0"
#: a properties list8 from its count on: eleven fields, ten nulls and the str8 code of
#: a group-id (`scan`'s grouped fast paths, at the start of a message and in the loop)
_COUNT11_NULLS10_STR8 = b"\x0b" + _NULLS10 + b"\xa1"
_PACK_U32 = struct.Struct(">I").pack
_PACK_U32x2 = struct.Struct(">II").pack
_PACK_Q = struct.Struct(">q").pack

# application properties of the group fallback, in order of precedence
_GROUP_KEYS = {
    b"JMSXGroupID": 0,
    b"_AMQ_GROUP_ID": 1,
    b"JMSXGroupSeq": 2,
    b"_AMQ_GROUP_SEQUENCE": 3,
}

# message annotations of delayed delivery (symbol keys)
_DELIVERY_KEYS = {b"x-opt-delivery-time": 0, b"x-opt-delivery-delay": 1}
_DELIVERY_KEY_SIZES = frozenset(len(k) for k in _DELIVERY_KEYS)
_JMS_DEST_KEY = {b"x-opt-jms-dest": 0}
_JMS_DEST_KEY_SIZES = frozenset(len(k) for k in _JMS_DEST_KEY)

_LIST_SHAPES = frozenset((0x40, 0x45, 0xC0, 0xD0))
_MAP_SHAPES = frozenset((0x40, 0xC1, 0xD1))
_BODY_LIST_SHAPES = frozenset((0x45, 0xC0, 0xD0))
_BINARY_SHAPES = frozenset((0xA0, 0xB0))
_STRINGISH = frozenset((0xA1, 0xB1, 0xA3, 0xB3))
_REPEATABLE = frozenset((_DATA, _SEQUENCE))
_LIST_SECTIONS = frozenset((_HEADER, _PROPERTIES))
_INTEGRAL = frozenset(
    (0x43, 0x44, 0x50, 0x51, 0x52, 0x53, 0x54, 0x55, 0x60, 0x61, 0x70, 0x71, 0x80, 0x81)
)

# --------------------------------------------------------------------------- primitives


def _skip(data: bytes, p: int, k: int = 1) -> int:
    """Offset just past the `k` consecutive values encoded at `p`.

    Compound values are skipped by their size, described values iteratively (no
    recursion). The result may lie beyond the end of `data`; callers compare it with
    the end of the enclosing list/section. Reading past the end raises IndexError or
    struct.error, which the public functions turn into ScanError."""
    while k:
        w = _WIDTH[data[p]]
        if w > 0:
            p += w
        elif w == _VAR8:
            p += 2 + data[p + 1]
        elif w == _COMPOUND8:
            s = data[p + 1]
            if s < 1:
                raise ScanError(f"compound value at offset {p} has size {s}")
            p += 2 + s
        elif w == _DESCRIBED:
            # the described value becomes two values: its descriptor and its value
            p += 1
            k += 1
            continue
        elif w == _VAR32:
            p += 5 + _U32(data, p + 1)[0]
        elif w == _COMPOUND32:
            s = _U32(data, p + 1)[0]
            if s < 4:
                raise ScanError(f"compound value at offset {p} has size {s}")
            p += 5 + s
        elif w == _ARRAY8:
            s = data[p + 1]
            if s < 2:
                raise ScanError(f"array at offset {p} has size {s}")
            p += 2 + s
        elif w == _ARRAY32:
            s = _U32(data, p + 1)[0]
            if s < 5:
                raise ScanError(f"array at offset {p} has size {s}")
            p += 5 + s
        else:
            raise ScanError(f"invalid type constructor 0x{data[p]:02x} at offset {p}")
        k -= 1
    return p


def _descriptor(data: bytes, p: int) -> tuple[int, int]:
    """Section code of the descriptor at `p` (just after the 0x00) and the value offset."""
    c = data[p]
    if c == 0x53:
        code = data[p + 1]
        if not _HEADER <= code <= _FOOTER:
            raise ScanError(f"unknown section descriptor 0x{code:x} at offset {p}")
        q = p + 2
    elif c == 0x80:
        v = int(_U64(data, p + 1)[0])
        if not _HEADER <= v <= _FOOTER:
            raise ScanError(f"unknown section descriptor 0x{v:x} at offset {p}")
        code = v
        q = p + 9
    elif c in {0xA3, 0xB3}:
        if c == 0xA3:
            s = p + 2
            q = s + data[p + 1]
        else:
            s = p + 5
            q = s + _U32(data, p + 1)[0]
        if q > len(data):
            raise IndexError
        code = _SYMBOLIC.get(data[s:q], -1)
        if code < 0:
            name = data[s:q][:64]
            raise ScanError(f"unknown section descriptor {name!r} at offset {p}")
    else:
        raise ScanError(
            f"section descriptor at offset {p} has constructor 0x{c:02x}, "
            "expected a ulong or a symbol"
        )
    return code, q


def _section_head(data: bytes, p: int) -> tuple[int, int]:
    """(code, value offset) of the section starting at `p`."""
    if data[p] != 0:
        raise ScanError(
            f"expected a message section (0x00 described type) at offset {p}, found 0x{data[p]:02x}"
        )
    if data[p + 1] == 0x53:
        code = data[p + 2]
        if _HEADER <= code <= _FOOTER:
            return code, p + 3
    return _descriptor(data, p + 1)


def _order_error(code: int, last: int, p: int) -> ScanError:
    """Error for section `code` at `p` after section `last` (which may be 0 or 0x6F
    for none, and `code` may be out of range: an unknown descriptor)."""
    name = _SECTION_NAMES.get(code)
    if name is None:
        return ScanError(f"unknown section descriptor 0x{code:x} at offset {p + 1}")
    if code == last:
        return ScanError(f"duplicate {name} section at offset {p}")
    return ScanError(f"{name} section at offset {p} after the {_SECTION_NAMES[last]} section")


def _shape_error(code: int, c: int, p: int) -> ScanError:
    return ScanError(
        f"{_SECTION_NAMES[code]} section value at offset {p} has constructor 0x{c:02x}"
    )


def _body_rest(data: bytes, p: int, code: int) -> int:
    """Frame what follows the first body section (of kind `code`), whose value ends at
    `p`: more body sections of the same kind, then an optional footer. Returns the end
    offset, which the caller compares with len(data)."""
    n = len(data)
    while p < n:
        start = p
        nxt, p = _section_head(data, p)
        c = data[p]
        if nxt == _FOOTER:
            if c not in _MAP_SHAPES:
                raise _shape_error(nxt, c, p)
            return _skip(data, p)
        if nxt != code or code == _VALUE:
            raise _order_error(nxt, code, start)
        if code == _DATA:
            if c not in _BINARY_SHAPES:
                raise _shape_error(code, c, p)
        elif c not in _BODY_LIST_SHAPES:
            raise _shape_error(code, c, p)
        p = _skip(data, p)
    return p


def _low32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - 0x100000000 if v & 0x80000000 else v


def _integral(data: bytes, q: int) -> int | None:
    """Value of an integral AMQP encoding at `q` (any width, signed or not), else None."""
    c = data[q]
    if c in {0x52, 0x53, 0x50}:
        return data[q + 1]
    if c in {0x54, 0x55, 0x51}:
        v = data[q + 1]
        return v - 0x100 if v & 0x80 else v
    if c in {0x43, 0x44}:
        return 0
    if c in {0x70, 0x71}:
        v = int(_U32(data, q + 1)[0])
        return v - 0x100000000 if c == 0x71 and v & 0x80000000 else v
    if c in {0x60, 0x61}:
        v = (data[q + 1] << 8) | data[q + 2]
        return v - 0x10000 if c == 0x61 and v & 0x8000 else v
    if c == 0x80:
        return int(_U64(data, q + 1)[0])
    if c == 0x81:
        return int(_I64(data, q + 1)[0])
    return None


def _string_at(data: bytes, q: int) -> str | None:
    """The str8/str32 at `q` decoded, or None for any other type. The caller checks
    that the value ends inside its container."""
    c = data[q]
    if c == 0xA1:
        return data[q + 2 : q + 2 + data[q + 1]].decode()
    if c == 0xB1:
        return data[q + 5 : q + 5 + _U32(data, q + 1)[0]].decode()
    return None


def _app_group(data: bytes, p: int) -> tuple[str | None, str | None, int | None, int | None]:
    """Walk the application-properties map whose value is at `p`; return the first
    string JMSXGroupID, string _AMQ_GROUP_ID, integral JMSXGroupSeq and integral
    _AMQ_GROUP_SEQUENCE (the sequences already folded to signed 32 bits)."""
    c = data[p]
    if c == 0xC1:
        end = p + 2 + data[p + 1]
        cnt = data[p + 2]
        q = p + 3
    elif c == 0xD1:
        size, cnt = _U32x2(data, p + 1)
        end = p + 5 + size
        q = p + 9
    else:
        return None, None, None, None
    if cnt & 1:
        raise ScanError(f"application-properties map at offset {p} has an odd count {cnt}")
    ids: list[str | None] = [None, None]  # JMSXGroupID, _AMQ_GROUP_ID
    seqs: list[int | None] = [None, None]  # JMSXGroupSeq, _AMQ_GROUP_SEQUENCE
    for _ in range(cnt >> 1):
        if q >= end:
            break
        c = data[q]
        if c == 0xA1:
            ks = q + 2
            q = ks + data[q + 1]
        elif c == 0xB1:
            ks = q + 5
            q = ks + _U32(data, q + 1)[0]
        else:
            q = _skip(data, q, 2)
            continue
        if q > end:
            break
        i = _GROUP_KEYS.get(data[ks:q])
        if i is not None:
            if i < 2:
                if ids[i] is None:
                    ids[i] = _string_at(data, q)
            elif seqs[i - 2] is None:
                v = _integral(data, q)
                seqs[i - 2] = None if v is None else _low32(v)
        q = _skip(data, q)
    if q > end:
        raise ScanError(f"application-properties map at offset {p} overruns its size")
    return ids[0], ids[1], seqs[0], seqs[1]


def _symbol_keyed(data: bytes, p: int, keys: dict[bytes, int], sizes: frozenset[int]) -> list[int]:
    """Walk the annotations map whose value is at `p` (map8/map32; anything else reads
    as empty). For each key of `keys` (raw symbol bytes -> index; `sizes` holds their
    lengths) return the offset of the value of its first entry with a symbol key, or
    -1. Every entry is skipped by size; the value at an offset returned ends inside the
    map. Raises ScanError for an odd count or an entry overrunning the map
    (IndexError/struct.error when the data ends first)."""
    found = [-1] * len(keys)
    c = data[p]
    if c == 0xC1:
        end = p + 2 + data[p + 1]
        cnt = data[p + 2]
        q = p + 3
    elif c == 0xD1:
        size, cnt = _U32x2(data, p + 1)
        end = p + 5 + size
        q = p + 9
    else:
        return found
    if cnt & 1:
        raise ScanError(f"annotations map at offset {p} has an odd count {cnt}")
    for _ in range(cnt >> 1):
        if q >= end:
            break
        c = data[q]
        if c == 0xA3:
            k = data[q + 1]
            ks = q + 2
        elif c == 0xB3:
            k = _U32(data, q + 1)[0]
            ks = q + 5
        else:
            q = _skip(data, q, 2)
            continue
        q = ks + k
        if k in sizes:  # (a C-level test first: most keys are of other lengths)
            if q > end:
                break
            i = keys.get(data[ks:q])
            if i is not None and found[i] < 0:
                found[i] = q
        # the value; fixed-width (the usual annotation values) inline
        w = _WIDTH[data[q]]
        q = q + w if w > 0 else _skip(data, q)
    if q > end:
        raise ScanError(f"annotations map at offset {p} overruns its size")
    return found


def _delivery_ms(data: bytes, q: int, timestamp_ok: bool) -> int:
    """The integral (or, when `timestamp_ok`, timestamp) value at `q` when positive,
    else 0."""
    c = data[q]
    if c == 0x81 or (c == 0x83 and timestamp_ok):
        v = int(_I64(data, q + 1)[0])
    else:
        v = _integral(data, q) or 0
    return v if v > 0 else 0


def _delayed_delivery(data: bytes, p: int) -> tuple[int, int]:
    """(delivery_time, delivery_delay) from the message-annotations value at `p`."""
    try:
        t, d = _symbol_keyed(data, p, _DELIVERY_KEYS, _DELIVERY_KEY_SIZES)
        return (
            _delivery_ms(data, t, True) if t >= 0 else 0,
            _delivery_ms(data, d, False) if d >= 0 else 0,
        )
    except (IndexError, struct.error):
        raise ScanError(f"message-annotations at offset {p} overrun the end of the data") from None


# --------------------------------------------------------------------------- scan


def scan(data: bytes, app_fallback: bool = True) -> Scanned:
    """Read the routing fields of an encoded message (see the module docstring).

    Returns (durable, priority, ttl_ms, absolute_expiry_ms, delivery_count, group_id,
    group_seq, to, delivery_time_ms, delivery_delay_ms). Raises ScanError for malformed
    or truncated data."""
    # Hot path: constructor and section codes are literals (a module constant costs a
    # dict lookup); the usual encodings are tested first and everything else goes
    # through _skip. Reads past the end raise IndexError/struct.error, turned into
    # ScanError below; lists are checked against their own size after parsing.
    n = len(data)
    if not n:
        raise ScanError("empty message: no sections")
    durable = False
    priority = 4
    ttl = 0
    expiry = 0
    dcount = 0
    gid: str | None = None
    gseq = 0
    have_gseq = False
    to: str | None = None
    ap = -1  # offset of the application-properties value, if any
    ap_end = 0
    ma = -1  # offset of the message-annotations value, if any
    ma_end = 0
    last = 0x6F  # code of the previous section (0x6F: none yet)
    p = 0
    start = 0  # offset of the current section (for error messages)
    try:
        if (
            n > 17
            and data[2] == 0x73
            and data[5:17] == _COUNT11_NULLS10_STR8
            and data[:4] == _PROPS8
        ):
            # the message opens with properties that carry only a str8 group-id (what
            # Proton and rhea send for a non-durable grouped message): read before
            # the loop, which saves the section head's tests (about 0.15 us). Slices,
            # not `startswith`, which parses its optional arguments per call (60 ns)
            p = 5 + data[4]
            q = 18 + data[17]
            gid = data[18:q].decode()
            if q > p:
                raise ScanError("properties list at offset 0 overruns its size")
            last = 0x73
        while p < n:
            start = p
            # ---- section head: 0x00 0x53 <code> is by far the usual form
            if data[p]:
                raise ScanError(
                    f"expected a message section (0x00 described type) at offset {p}, "
                    f"found 0x{data[p]:02x}"
                )
            if data[p + 1] == 0x53:
                code = data[p + 2]
                p += 3
            else:
                code, p = _descriptor(data, p + 1)
            if code <= last or code > 0x78:
                raise _order_error(code, last, start)
            last = code
            c = data[p]

            if code == 0x70:  # header
                if c == 0xC0:
                    end = p + 2 + data[p + 1]
                    cnt = data[p + 2]
                    q = p + 3
                elif c in {0x45, 0x40}:
                    end = q = p + 1
                    cnt = 0
                elif c == 0xD0:
                    size, cnt = _U32x2(data, p + 1)
                    end = p + 5 + size
                    q = p + 9
                else:
                    raise _shape_error(code, c, p)
                if cnt:
                    # durable
                    c = data[q]
                    if c == 0x41:
                        durable = True
                        q += 1
                    elif c in {0x42, 0x40}:
                        q += 1
                    elif c == 0x56:
                        durable = data[q + 1] != 0
                        q += 2
                    else:
                        q = _skip(data, q)
                    if cnt > 1:
                        # priority
                        c = data[q]
                        if c == 0x50:
                            priority = data[q + 1]
                            q += 2
                        elif c == 0x40:
                            q += 1
                        else:
                            q = _skip(data, q)
                        if cnt > 2:
                            # ttl
                            c = data[q]
                            if c == 0x70:
                                ttl = _U32(data, q + 1)[0]
                                q += 5
                            elif c == 0x52:
                                ttl = data[q + 1]
                                q += 2
                            elif c in {0x40, 0x43}:
                                q += 1
                            else:
                                q = _skip(data, q)
                            if cnt > 3:
                                # first-acquirer (not reported)
                                if data[q] in {0x40, 0x41, 0x42}:
                                    q += 1
                                else:
                                    q = _skip(data, q)
                                if cnt > 4:
                                    # delivery-count
                                    c = data[q]
                                    if c == 0x52:
                                        dcount = data[q + 1]
                                        q += 2
                                    elif c == 0x70:
                                        dcount = _U32(data, q + 1)[0]
                                        q += 5
                                    elif c in {0x40, 0x43}:
                                        q += 1
                                    else:
                                        q = _skip(data, q)
                                    if cnt > 5:
                                        # fields from a later AMQP version: framed too, so
                                        # set_delivery_count can copy every field
                                        q = _skip(data, q, cnt - 5)
                if q > end:
                    raise ScanError(f"header list at offset {start} overruns its size")
                p = end

            elif code == 0x73:  # properties
                if c == 0xC0 and data[p + 2 : p + 14] == _COUNT11_NULLS10_STR8:
                    # ten nulls and a str8 group-id, nothing after: what Proton and rhea
                    # send for a message that sets only a group id
                    end = p + 2 + data[p + 1]
                    s = p + 15
                    q = s + data[p + 14]
                    gid = data[s:q].decode()
                else:
                    if c == 0xC0:
                        end = p + 2 + data[p + 1]
                        cnt = data[p + 2]
                        q = p + 3
                    elif c in {0x45, 0x40}:
                        end = q = p + 1
                        cnt = 0
                    elif c == 0xD0:
                        size, cnt = _U32x2(data, p + 1)
                        end = p + 5 + size
                        q = p + 9
                    else:
                        raise _shape_error(code, c, p)
                    if cnt > 9 and data.startswith(_NULLS10, q):
                        # message-id .. creation-time all null (one test for ten fields)
                        q += 10
                    else:
                        if cnt:
                            # message-id
                            c = data[q]
                            if c == 0xA1:
                                q += 2 + data[q + 1]
                            elif c == 0x40:
                                q += 1
                            else:
                                q = _skip(data, q)
                        if cnt > 1:
                            # user-id
                            if data[q] == 0x40:
                                q += 1
                            else:
                                q = _skip(data, q)
                        if cnt > 2:
                            # to
                            c = data[q]
                            if c == 0xA1:
                                s = q + 2
                                q = s + data[q + 1]
                                to = data[s:q].decode()
                            elif c == 0x40:
                                q += 1
                            elif c == 0xB1:
                                s = q + 5
                                q = s + _U32(data, q + 1)[0]
                                to = data[s:q].decode()
                            else:
                                q = _skip(data, q)
                        if cnt > 3:
                            # subject, reply-to, correlation-id, content-type,
                            # content-encoding
                            if cnt > 7 and data.startswith(b"\x40\x40\x40\x40\x40", q):
                                q += 5
                            else:
                                q = _skip(data, q, (cnt if cnt < 8 else 8) - 3)
                        if cnt > 8:
                            # absolute-expiry-time
                            c = data[q]
                            if c == 0x40:
                                q += 1
                            elif c == 0x83:
                                expiry = _I64(data, q + 1)[0]
                                q += 9
                            else:
                                q = _skip(data, q)
                        if cnt > 9:
                            # creation-time
                            c = data[q]
                            if c == 0x83:
                                q += 9
                            elif c == 0x40:
                                q += 1
                            else:
                                q = _skip(data, q)
                    if cnt > 10:
                        # group-id
                        c = data[q]
                        if c == 0xA1:
                            s = q + 2
                            q = s + data[q + 1]
                            gid = data[s:q].decode()
                        elif c == 0x40:
                            q += 1
                        elif c == 0xB1:
                            s = q + 5
                            q = s + _U32(data, q + 1)[0]
                            gid = data[s:q].decode()
                        else:
                            q = _skip(data, q)
                        if cnt > 11:
                            # group-sequence
                            c = data[q]
                            if c == 0x52:
                                gseq = data[q + 1]
                                have_gseq = True
                                q += 2
                            elif c == 0x70:
                                gseq = _U32(data, q + 1)[0]
                                if gseq & 0x80000000:
                                    gseq -= 0x100000000
                                have_gseq = True
                                q += 5
                            elif c == 0x43:
                                have_gseq = True
                                q += 1
                            elif c == 0x40:
                                q += 1
                            else:
                                q = _skip(data, q)
                if q > end:
                    raise ScanError(f"properties list at offset {start} overruns its size")
                p = end

            elif code < 0x75:
                # delivery-annotations, message-annotations, application-properties:
                # skipped by size
                if c == 0xD1:
                    size = _U32(data, p + 1)[0]
                    if size < 4:
                        raise ScanError(f"map at offset {p} has size {size}")
                    e = p + 5 + size
                elif c == 0xC1:
                    size = data[p + 1]
                    if size < 1:
                        raise ScanError(f"map at offset {p} has size {size}")
                    e = p + 2 + size
                elif c == 0x40:
                    e = p + 1
                else:
                    raise _shape_error(code, c, p)
                if code == 0x74:
                    ap = p
                    ap_end = e
                elif code == 0x72:
                    ma = p
                    ma_end = e
                p = e

            elif code != 0x78:
                # the first body section: frame the rest without looking inside
                # usual: data binary, amqp-value binary or string (JMS TextMessage)
                if (c == 0xA0 and code != 0x76) or (c == 0xA1 and code == 0x77):
                    p += 2 + data[p + 1]
                elif code == 0x75:
                    if c != 0xB0:
                        raise _shape_error(code, c, p)
                    p += 5 + _U32(data, p + 1)[0]
                else:
                    if code == 0x76 and c not in _BODY_LIST_SHAPES:
                        raise _shape_error(code, c, p)
                    p = _skip(data, p)
                if p < n:
                    p = _body_rest(data, p, code)
                break

            else:  # footer
                if c not in _MAP_SHAPES:
                    raise _shape_error(code, c, p)
                p = _skip(data, p)
                break
    except (IndexError, struct.error):
        raise ScanError(
            f"truncated: the section at offset {start} runs past the end of the data ({n} bytes)"
        ) from None
    except UnicodeDecodeError:
        raise ScanError(f"invalid UTF-8 string in the section at offset {start}") from None
    if p != n:
        if p > n:
            raise ScanError(
                f"truncated: the section at offset {start} runs past the end of the data "
                f"({n} bytes)"
            )
        raise ScanError(f"unexpected data after the footer at offset {p}")

    if (
        ap >= 0
        and app_fallback
        and (gid is None or not have_gseq)
        and (data.find(b"JMSXGroup", ap, ap_end) >= 0 or data.find(b"_AMQ_GROUP_", ap, ap_end) >= 0)
    ):
        try:
            jid, aid, jseq, aseq = _app_group(data, ap)
        except (IndexError, struct.error):
            raise ScanError(
                f"application-properties at offset {ap} overruns the end of the data"
            ) from None
        except UnicodeDecodeError:
            raise ScanError(f"invalid UTF-8 string in application-properties at {ap}") from None
        if gid is None:
            gid = jid if jid is not None else aid
        if not have_gseq:
            gseq = jseq if jseq is not None else aseq if aseq is not None else 0
    if ma >= 0 and data.find(b"x-opt-delivery-", ma, ma_end) >= 0:
        dtime, ddelay = _delayed_delivery(data, ma)
        return (durable, priority, ttl, expiry, dcount, gid, gseq, to, dtime, ddelay)
    return (durable, priority, ttl, expiry, dcount, gid, gseq, to, 0, 0)


# --------------------------------------------------------------------------- slow path

# One section: (code, offset of the section, offset of its value, end offset)
_Section: TypeAlias = tuple[int, int, int, int]


def _sections(data: bytes) -> list[_Section]:
    """Frame every section, with the same validation as `scan`."""
    n = len(data)
    if not n:
        raise ScanError("empty message: no sections")
    out: list[_Section] = []
    last = 0
    p = 0
    start = 0
    try:
        while p < n:
            start = p
            code, v = _section_head(data, p)
            in_body = _DATA <= last <= _VALUE
            if (code <= last or (in_body and code <= _VALUE)) and not (
                code == last and code in _REPEATABLE
            ):
                raise _order_error(code, last, start)
            c = data[v]
            if code in _LIST_SECTIONS:
                ok = c in _LIST_SHAPES
            elif code == _DATA:
                ok = c in _BINARY_SHAPES
            elif code == _SEQUENCE:
                ok = c in _BODY_LIST_SHAPES
            elif code == _VALUE:
                ok = True
            else:
                ok = c in _MAP_SHAPES
            if not ok:
                raise _shape_error(code, c, v)
            p = _skip(data, v)
            if p > n:
                raise IndexError
            out.append((code, start, v, p))
            last = code
    except (IndexError, struct.error):
        raise ScanError(
            f"truncated: the section at offset {start} runs past the end of the data ({n} bytes)"
        ) from None
    return out


def _find(sections: list[_Section], code: int) -> _Section | None:
    for s in sections:
        if s[0] == code:
            return s
    return None


def _insert_at(sections: list[_Section], code: int) -> int:
    """Offset where a new section `code` goes: after every section that precedes it."""
    pos = 0
    for s in sections:
        if s[0] < code:
            pos = s[3]
    return pos


def _compound(data: bytes, v: int) -> tuple[int, int, int]:
    """(count, offset of the first element, end) of the list or map value at `v`."""
    c = data[v]
    if c in {0xC0, 0xC1}:
        size = data[v + 1]
        if size < 1:
            raise ScanError(f"compound value at offset {v} has size {size}")
        return data[v + 2], v + 3, v + 2 + size
    if c in {0xD0, 0xD1}:
        size, cnt = _U32x2(data, v + 1)
        if size < 4:
            raise ScanError(f"compound value at offset {v} has size {size}")
        return cnt, v + 9, v + 5 + size
    if c in {0x45, 0x40}:
        return 0, v + 1, v + 1
    raise ScanError(f"expected a list or map at offset {v}, found constructor 0x{c:02x}")


def _elements(data: bytes, v: int) -> list[tuple[int, int]]:
    """(start, end) of each element of the list/map value at `v`."""
    cnt, q, end = _compound(data, v)
    out: list[tuple[int, int]] = []
    try:
        for _ in range(cnt):
            e = _skip(data, q)
            if e > end:
                raise IndexError
            out.append((q, e))
            q = e
    except (IndexError, struct.error):
        raise ScanError(f"the compound value at offset {v} overruns its size") from None
    return out


def _enc_uint(v: int) -> bytes:
    if v == 0:
        return b"\x43"
    if v < 0x100:
        return bytes((0x52, v))
    return b"\x70" + _PACK_U32(v)


def _enc_var(small: int, large: int, raw: bytes) -> bytes:
    if len(raw) < 0x100:
        return bytes((small, len(raw))) + raw
    return bytes((large,)) + _PACK_U32(len(raw)) + raw


def _enc_compound(small: int, large: int, count: int, body: bytes) -> bytes:
    if len(body) < 0xFF and count < 0x100:
        return bytes((small, len(body) + 1, count)) + body
    return bytes((large,)) + _PACK_U32x2(len(body) + 4, count) + body


def _enc_value(v: str | int | bool | None) -> bytes:
    if v is None:
        return b"\x40"
    if v is True:
        return b"\x41"
    if v is False:
        return b"\x42"
    if isinstance(v, str):
        return _enc_var(0xA1, 0xB1, v.encode())
    if isinstance(v, int):
        if -0x80 <= v < 0x80:
            return bytes((0x55, v & 0xFF))
        if not -(1 << 63) <= v < (1 << 63):
            raise ValueError(f"{v} does not fit an AMQP long")
        return b"\x81" + _PACK_Q(v)
    raise TypeError(f"cannot encode {type(v).__name__} as an annotation value")


def _key_bytes(data: bytes, p: int) -> bytes | None:
    """Raw UTF-8 of a string or symbol key at `p`, else None."""
    c = data[p]
    if c in {0xA1, 0xA3}:
        return data[p + 2 : p + 2 + data[p + 1]]
    if c in {0xB1, 0xB3}:
        return data[p + 5 : p + 5 + _U32(data, p + 1)[0]]
    return None


def _splice_map(
    data: bytes,
    code: int,
    new: list[tuple[bytes, bytes]],
) -> bytes:
    """Add the (raw key, encoded key + value) entries `new` to the map section `code`,
    replacing entries with an equal key; all other bytes are copied."""
    sections = _sections(data)
    sec = _find(sections, code)
    new_body = b"".join(enc for _, enc in new)
    if sec is None:
        value = _enc_compound(0xC1, 0xD1, 2 * len(new), new_body)
        pos = _insert_at(sections, code)
        return b"".join((data[:pos], bytes((0, 0x53, code)), value, data[pos:]))
    _, _, v, end = sec
    elements = _elements(data, v)
    if len(elements) & 1:
        raise ScanError(f"map at offset {v} has an odd count {len(elements)}")
    replaced = {key for key, _ in new}
    parts: list[bytes] = []
    run_start = -1  # start of the current run of kept entries
    run_end = -1
    kept = 0
    for i in range(0, len(elements), 2):
        ks = elements[i][0]
        ve = elements[i + 1][1]
        if _key_bytes(data, ks) in replaced:
            continue
        kept += 1
        if ks == run_end:
            run_end = ve  # extends the current run: copied as one slice
        else:
            if run_start >= 0:
                parts.append(data[run_start:run_end])
            run_start, run_end = ks, ve
    if run_start >= 0:
        parts.append(data[run_start:run_end])
    parts.append(new_body)
    body = b"".join(parts)
    count = 2 * (kept + len(new))
    if data[v] == 0xD1:
        value = b"\xd1" + _PACK_U32x2(len(body) + 4, count) + body
    else:
        value = _enc_compound(0xC1, 0xD1, count, body)
    return b"".join((data[:v], value, data[end:]))


def set_delivery_count(data: bytes, count: int) -> bytes:
    """Copy of `data` whose header says delivery-count=`count`.

    Only the header section is re-encoded (durable, priority, ttl, first-acquirer and any
    later fields keep their original encodings); a header is inserted at the front when
    there is none. Every other byte is copied unchanged. Never raises ScanError for a
    message that `scan` accepted (scan frames every header field)."""
    if not 0 <= count <= 0xFFFFFFFF:
        raise ValueError(f"delivery-count {count} is not a uint")
    sections = _sections(data)
    dc = _enc_uint(count)
    hdr = _find(sections, _HEADER)
    if hdr is None:
        return b"\x00\x53\x70" + _enc_compound(0xC0, 0xD0, 5, b"\x40\x40\x40\x40" + dc) + data
    _, _, v, end = hdr
    fields = [data[s:e] for s, e in _elements(data, v)]
    while len(fields) < 5:
        fields.append(b"\x40")
    fields[4] = dc
    value = _enc_compound(0xC0, 0xD0, len(fields), b"".join(fields))
    return b"".join((data[:v], value, data[end:]))


def add_message_annotations(
    data: bytes, annotations: Mapping[str, str | int | bool | None]
) -> bytes:
    """Copy of `data` with `annotations` added to the message-annotations.

    Keys are encoded as AMQP symbols (ASCII); values: str -> string, bool -> boolean,
    int -> long (as smalllong when it fits a byte), None -> null. New entries go after
    the existing ones. An existing entry whose key (symbol, or string) has the same text
    is removed; all other entries are copied byte-for-byte and only the map's size/count
    prefix is rewritten (map8 becomes map32 when needed; map32 stays map32). The section
    is created (after header and delivery-annotations, before properties) when absent.
    Raises ScanError for a malformed message, UnicodeEncodeError for a non-ASCII key
    and ValueError for an int outside the long range."""
    new: list[tuple[bytes, bytes]] = []
    for k, val in annotations.items():
        raw = k.encode("ascii")
        new.append((raw, _enc_var(0xA3, 0xB3, raw) + _enc_value(val)))
    return _splice_map(data, _MESSAGE_ANNOTATIONS, new)


def add_application_property(data: bytes, key: str, value: bool) -> bytes:
    """Copy of `data` with application property `key` (an AMQP string) set to `value`.

    Same splice rule as `add_message_annotations`; the section is created right before
    the body when absent. Walks the existing map, so it raises ScanError for a map
    whose entries are malformed even when `scan` accepted the message (scan does not
    look inside application-properties unless it needs the group fallback)."""
    raw = key.encode()
    return _splice_map(
        data, _APPLICATION_PROPERTIES, [(raw, _enc_var(0xA1, 0xB1, raw) + _enc_value(value))]
    )


def _decode(data: bytes, p: int, end: int) -> object:
    """Decode the simple value at `p` (which must end by `end`); compound, described
    and decimal values come back as their raw encoding."""
    e = _skip(data, p)
    if e > end:
        raise IndexError
    c = data[p]
    if c == 0x40:
        return None
    if c == 0x41:
        return True
    if c == 0x42:
        return False
    if c == 0x56:
        return data[p + 1] != 0
    v = _integral(data, p)
    if v is not None:
        return v
    if c in {0xA1, 0xA3}:
        return data[p + 2 : e].decode()
    if c in {0xB1, 0xB3}:
        return data[p + 5 : e].decode()
    if c == 0xA0:
        return data[p + 2 : e]
    if c == 0xB0:
        return data[p + 5 : e]
    if c == 0x72:
        return float(struct.unpack_from(">f", data, p + 1)[0])
    if c == 0x82:
        return float(struct.unpack_from(">d", data, p + 1)[0])
    if c == 0x83:
        return int(_I64(data, p + 1)[0])
    if c == 0x98:
        return uuid.UUID(bytes=data[p + 1 : e])
    if c == 0x73:
        cp = _U32(data, p + 1)[0]
        if cp > 0x10FFFF:
            raise ScanError(f"invalid char 0x{cp:x} at offset {p}")
        return chr(cp)
    return data[p:e]


def message_id(data: bytes) -> str | int | bytes | uuid.UUID | None:
    """properties.message-id (string, ulong, binary or uuid), None when absent.

    Other integral encodings come back as int too; any other type raises ScanError.
    Only the first field of the properties list is read."""
    sec = _find(_sections(data), _PROPERTIES)
    if sec is None:
        return None
    cnt, p, end = _compound(data, sec[2])
    if not cnt:
        return None
    c = data[p]
    try:
        value = _decode(data, p, end)
    except UnicodeDecodeError:
        raise ScanError(f"invalid UTF-8 in the message-id at offset {p}") from None
    except (IndexError, struct.error):
        raise ScanError(f"the message-id at offset {p} overruns the properties") from None
    if value is None:
        return None
    if isinstance(value, (str, bytes, uuid.UUID)) and (
        c in _STRINGISH or c in _BINARY_SHAPES or c == 0x98
    ):
        return value
    if isinstance(value, int) and c in _INTEGRAL:
        return value
    raise ScanError(f"message-id at offset {p} has unsupported type constructor 0x{c:02x}")


def message_id_text(value: object) -> str | None:
    """A message-id as text (delivery log): strings as they are, ulongs in decimal,
    uuids in their canonical form, binaries in hex."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def log_message_id(data: bytes) -> str | None:
    """The message-id as text for the delivery log, fast for a string id (what Qpid JMS
    and most clients send): walks the section heads up to the properties and decodes
    only their first field; other id types go through `message_id`. Never raises:
    None when absent or malformed.

    Called once per received message while the delivery log is on: the usual section
    heads (small descriptor) and the usual header and annotation encodings (list8,
    map8, list0, null) are framed inline, everything else through `_section_head` and
    `_skip`."""
    try:
        p = 0
        n = len(data)
        while p < n:
            if data[p] == 0 and data[p + 1] == 0x53:
                code = data[p + 2]
                v = p + 3
            else:
                code, v = _section_head(data, p)
            c = data[v]
            if code == 0x73:  # properties
                if c == 0xC0:
                    cnt, q = data[v + 2], v + 3
                elif c == 0xD0:
                    cnt, q = _U32x2(data, v + 1)[1], v + 9
                else:
                    return None
                if not cnt:
                    return None
                c = data[q]
                if c == 0xA1:
                    return data[q + 2 : q + 2 + data[q + 1]].decode()
                if c == 0xB1:
                    return data[q + 5 : q + 5 + _U32(data, q + 1)[0]].decode()
                if c == 0x40:  # null: properties sent for other fields (a group id)
                    return None
                return message_id_text(message_id(data))
            if code > 0x73 or code < 0x70:
                return None
            # header, delivery-annotations, message-annotations: skipped by size
            if c in {0xC0, 0xC1}:
                p = v + 2 + data[v + 1]
            elif c in {0x45, 0x40}:
                p = v + 1
            else:
                p = _skip(data, v)
    except (ScanError, IndexError, struct.error, UnicodeDecodeError):
        return None
    return None


_DUPL_ID_KEY = b"_AMQ_DUPL_ID"


def duplicate_id(data: bytes) -> str | int | bytes | uuid.UUID | None:
    """The id duplicate detection compares: the application property ``_AMQ_DUPL_ID``
    (string or binary, as Artemis clients send it) when present, else the message-id.
    Raises ScanError on a malformed message. Reads only the properties' first field and
    the application-properties keys (values are skipped by size)."""
    sections = _sections(data)
    sec = _find(sections, _APPLICATION_PROPERTIES)
    if sec is not None:
        elements = _elements(data, sec[2])
        for i in range(0, len(elements) - 1, 2):
            ks, _ = elements[i]
            if _key_bytes(data, ks) == _DUPL_ID_KEY:
                vs, ve = elements[i + 1]
                try:
                    value = _decode(data, vs, ve)
                except (UnicodeDecodeError, IndexError, struct.error):
                    raise ScanError(f"malformed _AMQ_DUPL_ID value at offset {vs}") from None
                if isinstance(value, (str, bytes, int, uuid.UUID)) and not isinstance(value, bool):
                    return value
                break
    return message_id(data)


def jms_dest(data: bytes) -> int | None:
    """The JMS destination type of the message annotation ``x-opt-jms-dest``: 0 queue,
    1 topic, 2 temporary queue, 3 temporary topic (Qpid JMS sends an AMQP byte).

    None when the annotation is absent (only a symbol key matches; the first such entry
    wins), is not a byte/ubyte, holds any other number, or when the message or its
    message-annotations are malformed: never raises. Not on the hot path: frames every
    section (like the splices) and walks the message-annotations map."""
    try:
        sec = _find(_sections(data), _MESSAGE_ANNOTATIONS)
        if sec is None:
            return None
        (q,) = _symbol_keyed(data, sec[2], _JMS_DEST_KEY, _JMS_DEST_KEY_SIZES)
        if q < 0:
            return None
        c = data[q]
        if c in {0x51, 0x50}:  # byte, ubyte
            v = data[q + 1]
            return v if v <= 3 else None
    except (ScanError, IndexError, struct.error):
        return None
    return None


def application_properties(data: bytes) -> dict[str, object]:
    """The decoded application-properties (empty when absent).

    Strings, symbols (as str), integers of any width, booleans, floats, timestamps (as
    epoch ms ints), uuids, binaries (as bytes), chars and None are decoded; anything
    else (lists, maps, arrays, described values, decimals) comes back as its raw
    encoding (bytes)."""
    sec = _find(_sections(data), _APPLICATION_PROPERTIES)
    if sec is None:
        return {}
    v = sec[2]
    elements = _elements(data, v)
    if len(elements) & 1:
        raise ScanError(f"application-properties map at offset {v} has an odd count")
    out: dict[str, object] = {}
    try:
        for i in range(0, len(elements), 2):
            ks, ke = elements[i]
            vs, ve = elements[i + 1]
            if data[ks] not in _STRINGISH:
                raise ScanError(f"application-properties key at offset {ks} is not a string")
            key = _decode(data, ks, ke)
            assert isinstance(key, str)
            out[key] = _decode(data, vs, ve)
    except UnicodeDecodeError:
        raise ScanError(f"invalid UTF-8 in application-properties at offset {v}") from None
    except (IndexError, struct.error):  # pragma: no cover - _elements framed them
        raise ScanError(f"application-properties at offset {v} overruns its size") from None
    return out


def annotated_body(data: bytes, keys: tuple[bytes, ...]) -> tuple[list[str | None], int, int]:
    """Read a message that carries another one (the cluster's forwarding envelope):
    the text of the message annotations `keys` (raw key bytes, symbol or string keys;
    string or symbol values, anything else reads as None; the first entry with a given
    key wins) and the offsets (start, end) of the binary that forms the body: one data
    section, or an amqp-value holding a binary (how `proton.Message(body=bytes)`
    encodes it). Raises ScanError for a malformed message or any other body.

    Frames every section like the splices do (validation as `scan`); walks only the
    message-annotations map and never looks inside the body binary."""
    sections = _sections(data)
    values: list[str | None] = [None] * len(keys)
    body: _Section | None = None
    for sec in sections:
        code = sec[0]
        if code == _MESSAGE_ANNOTATIONS:
            _envelope_keys(data, sec[2], keys, values)
        elif _DATA <= code <= _VALUE:
            if body is not None:
                raise ScanError(
                    f"{_SECTION_NAMES[code]} section at offset {sec[1]}: expected one "
                    "data section holding a binary"
                )
            body = sec
    if body is None:
        raise ScanError("no body: expected one data section holding a binary")
    code, start, v, end = body
    c = data[v]
    if code == _SEQUENCE or (code == _VALUE and c not in _BINARY_SHAPES):
        raise ScanError(
            f"{_SECTION_NAMES[code]} body at offset {start}: expected one data section "
            "holding a binary"
        )
    return values, (v + 2 if c == 0xA0 else v + 5), end


def _envelope_keys(data: bytes, v: int, keys: tuple[bytes, ...], out: list[str | None]) -> None:
    """Fill `out` with the string values of `keys` in the map at `v`."""
    elements = _elements(data, v)
    if len(elements) & 1:
        raise ScanError(f"message-annotations map at offset {v} has an odd count")
    seen = 0
    try:
        for i in range(0, len(elements), 2):
            key = _key_bytes(data, elements[i][0])
            if key is None or key not in keys:
                continue
            j = keys.index(key)
            if seen & (1 << j):
                continue  # the first entry wins
            seen |= 1 << j
            vs, ve = elements[i + 1]
            c = data[vs]
            if c in {0xA1, 0xA3}:
                out[j] = data[vs + 2 : ve].decode()
            elif c in {0xB1, 0xB3}:
                out[j] = data[vs + 5 : ve].decode()
    except UnicodeDecodeError:
        raise ScanError(f"invalid UTF-8 in message-annotations at offset {v}") from None
