"""Small AMQP messages (the cluster's management requests and answers) encoded and
decoded by hand.

`proton.Message.encode` and `decode` cost 40-70 µs each (ARCHITECTURE decision 2: the
object API is off the hot path). A clustered grouping proposal paid four of them (the
entry node's request, the arbiter's decode, its answer, the entry node's decode), on
the event loops of both nodes, for every new group: in a burst of new groups that was
most of the arbiter's own work. This module does the same in a few µs for the shape
those messages have: a properties section (message-id, to, reply-to,
correlation-id), an application-properties map and an amqp-value body of plain values.

* `encode` writes what `proton.Message` would carry for the same fields (a reader sees
  the same message; the bytes may differ in width choices, e.g. map8 for a small map),
  and raises `Unsupported` for a value it does not encode (`proton.Array`, decimals),
  or, with ``proton_fallback=True``, lets `proton.Message` encode that message.
* `decode` reads any valid message, returning the four properties fields, the
  application properties and the body as `proton.Message` would (symbols as
  `proton.symbol`, ulongs as `proton.ulong`, ...), and raises `Unsupported` for what
  it does not decode (arrays, decimals, amqp-sequence or several data sections) and
  for malformed bytes; `decode_any` then hands the bytes to `proton.Message`, so a
  message this codec refuses reads exactly as it did before it existed (proton reads
  some malformed bytes, e.g. a truncated body, as an empty one).

Invariants: ``decode(encode(...))`` returns the values given; `decode` never returns
for bytes proton would reject.
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass
from typing import Any

import proton

__all__ = ["Message", "Unsupported", "decode", "decode_any", "encode"]


class Unsupported(ValueError):
    """Not a shape this codec handles: use `proton.Message`."""


@dataclass(slots=True)
class Message:
    """The fields of a small message (the names of `proton.Message`)."""

    id: Any = None
    correlation_id: Any = None
    reply_to: str | None = None
    address: str | None = None
    properties: dict[Any, Any] | None = None
    body: Any = None


# ----------------------------------------------------------------------- encoding
_B = struct.Struct(">b").pack
_H = struct.Struct(">H").pack
_h = struct.Struct(">h").pack
_I = struct.Struct(">I").pack
_i = struct.Struct(">i").pack
_Q = struct.Struct(">Q").pack
_q = struct.Struct(">q").pack
_d = struct.Struct(">d").pack
_f = struct.Struct(">f").pack
_II = struct.Struct(">II").pack


def _var(small: int, large: int, raw: bytes) -> bytes:
    n = len(raw)
    return bytes((small, n)) + raw if n < 0x100 else bytes((large,)) + _I(n) + raw


def _compound(small: int, large: int, count: int, body: bytes) -> bytes:
    if len(body) + 1 < 0x100 and count < 0x100:
        return bytes((small, len(body) + 1, count)) + body
    return bytes((large,)) + _II(len(body) + 4, count) + body


def _value(v: Any) -> bytes:
    # the order matters: proton's types subclass int, str and float
    t = type(v)
    if v is None:
        return b"\x40"
    if t is bool:
        return b"\x41" if v else b"\x42"
    if t is str:
        return _var(0xA1, 0xB1, v.encode())
    if t is int:
        if -128 <= v <= 127:
            return b"\x55" + _B(v)
        return b"\x81" + _q(v)
    if t is proton.symbol:
        return _var(0xA3, 0xB3, v.encode("ascii"))
    if t is bytes or t is bytearray or t is memoryview:
        return _var(0xA0, 0xB0, bytes(v))
    if t is dict:
        return _compound(
            0xC1, 0xD1, 2 * len(v), b"".join(_value(k) + _value(x) for k, x in v.items())
        )
    if t is list or t is tuple:
        if not v:
            return b"\x45"
        return _compound(0xC0, 0xD0, len(v), b"".join(_value(x) for x in v))
    if t is float:
        return b"\x82" + _d(v)
    if t is proton.ulong:
        if v == 0:
            return b"\x44"
        return b"\x53" + bytes((v,)) if v < 0x100 else b"\x80" + _Q(v)
    if t is proton.uint:
        if v == 0:
            return b"\x43"
        return b"\x52" + bytes((v,)) if v < 0x100 else b"\x70" + _I(v)
    if t is proton.int32:
        return b"\x54" + _B(v) if -128 <= v <= 127 else b"\x71" + _i(v)
    if t is proton.ushort:
        return b"\x60" + _H(v)
    if t is proton.short:
        return b"\x61" + _h(v)
    if t is proton.ubyte:
        return b"\x50" + bytes((v,))
    if t is proton.byte:
        return b"\x51" + _B(v)
    if t is proton.float32:
        return b"\x72" + _f(v)
    if t is proton.timestamp:
        return b"\x83" + _q(v)
    if t is proton.char:
        return b"\x73" + _I(ord(v))
    if t is uuid.UUID:
        return b"\x98" + bytes(v.bytes)
    if t is proton.Described:
        return b"\x00" + _value(v.descriptor) + _value(v.value)
    raise Unsupported(f"no hand encoding for {t.__name__}")


def _id(v: Any) -> bytes:
    """A message-id or correlation-id: an int is a ulong there (as proton writes it)."""
    return _value(proton.ulong(v) if type(v) is int else v)


def encode(
    *,
    id: Any = None,
    correlation_id: Any = None,
    reply_to: str | None = None,
    to: str | None = None,
    properties: dict[Any, Any] | None = None,
    body: Any = None,
    proton_fallback: bool = False,
) -> bytes:
    """The message's bytes: properties (when any field is set), application
    properties (when given), an amqp-value body (also for None, as proton does).
    `Unsupported` for a value the hand codec does not write, unless `proton_fallback`:
    then `proton.Message` writes it."""
    try:
        return _encode(id, correlation_id, reply_to, to, properties, body)
    except (struct.error, OverflowError, UnicodeEncodeError, Unsupported) as exc:
        if not proton_fallback:
            raise exc if isinstance(exc, Unsupported) else Unsupported(str(exc)) from None
    m: Any = proton.Message(body=body)
    for name, value in (
        ("id", id),
        ("correlation_id", correlation_id),
        ("reply_to", reply_to),
        ("address", to),
    ):
        if value is not None:
            setattr(m, name, value)
    if properties:
        m.properties = dict(properties)
    return bytes(m.encode())


def _encode(
    id: Any,
    correlation_id: Any,
    reply_to: str | None,
    to: str | None,
    properties: dict[Any, Any] | None,
    body: Any,
) -> bytes:
    out = []
    fields = [id, None, to, None, reply_to, correlation_id]
    while fields and fields[-1] is None:
        fields.pop()
    if fields:
        plist = [_id(id), b"\x40"]
        if len(fields) > 2:
            plist.append(_value(to))
        if len(fields) > 3:
            plist += [b"\x40", _value(reply_to)]
        if len(fields) > 5:
            plist.append(_id(correlation_id))
        out.append(b"\x00\x53\x73" + _compound(0xC0, 0xD0, len(plist), b"".join(plist)))
    if properties:
        out.append(b"\x00\x53\x74" + _value(dict(properties)))
    out.append(b"\x00\x53\x77" + _value(body))
    return b"".join(out)


# ----------------------------------------------------------------------- decoding
_UB = struct.Struct(">B").unpack_from
_SB = struct.Struct(">b").unpack_from
_UH = struct.Struct(">H").unpack_from
_SH = struct.Struct(">h").unpack_from
_UI = struct.Struct(">I").unpack_from
_SI = struct.Struct(">i").unpack_from
_UQ = struct.Struct(">Q").unpack_from
_SQ = struct.Struct(">q").unpack_from
_FD = struct.Struct(">d").unpack_from
_FF = struct.Struct(">f").unpack_from


def _need(data: bytes, end: int) -> None:
    if end > len(data):
        raise Unsupported("truncated")


def _variable(width: int, make: Any) -> Any:
    """A reader of a variable-width value (str, sym, bin) with a `width`-byte size."""
    size = _UB if width == 1 else _UI

    def read(data: bytes, p: int) -> tuple[Any, int]:
        _need(data, p + width)
        end = p + width + size(data, p)[0]
        _need(data, end)
        return make(data[p + width : end]), end

    return read


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise Unsupported("bad utf-8") from None


def _sym(raw: bytes) -> proton.symbol:
    try:
        return proton.symbol(raw.decode("ascii"))
    except UnicodeDecodeError:
        raise Unsupported("bad symbol") from None


_str8 = _variable(1, _utf8)


def _fixed(width: int, make: Any) -> Any:
    """A reader of a fixed-width value: `make(data, p)` at p, `width` bytes."""

    def read(data: bytes, p: int) -> tuple[Any, int]:
        end = p + width
        if end > len(data):
            raise Unsupported("truncated")
        return make(data, p), end

    return read


def _const(value: Any) -> Any:
    def read(data: bytes, p: int) -> tuple[Any, int]:
        return value, p

    return read


def _boolean(data: bytes, p: int) -> bool:
    if data[p] > 1:
        raise Unsupported("bad boolean")
    return data[p] == 1


def _char(data: bytes, p: int) -> proton.char:
    try:
        return proton.char(chr(_UI(data, p)[0]))
    except ValueError:
        raise Unsupported("bad char") from None


def _list8(data: bytes, p: int) -> tuple[Any, int]:
    _need(data, p + 2)
    return _items(data, False, p + 2, p + 1 + data[p], data[p + 1])


def _map8(data: bytes, p: int) -> tuple[Any, int]:
    _need(data, p + 2)
    return _items(data, True, p + 2, p + 1 + data[p], data[p + 1])


def _list32(data: bytes, p: int) -> tuple[Any, int]:
    _need(data, p + 8)
    size, count = _II_unpack(data, p)
    return _items(data, False, p + 8, p + 4 + size, count)


def _map32(data: bytes, p: int) -> tuple[Any, int]:
    _need(data, p + 8)
    size, count = _II_unpack(data, p)
    return _items(data, True, p + 8, p + 4 + size, count)


def _described(data: bytes, p: int) -> tuple[Any, int]:
    descriptor, p = _read(data, p)
    value, p = _read(data, p)
    return proton.Described(descriptor, value), p


_II_unpack = struct.Struct(">II").unpack_from

#: constructor -> reader(data, position after the constructor) -> (value, next position)
_READERS: dict[int, Any] = {
    0x40: _const(None),
    0x41: _const(True),
    0x42: _const(False),
    0x45: None,  # the empty list: a new one each time (below)
    0x43: _const(proton.uint(0)),
    0x44: _const(proton.ulong(0)),
    0xA1: _str8,
    0xB1: _variable(4, _utf8),
    0xA3: _variable(1, _sym),
    0xB3: _variable(4, _sym),
    0xA0: _variable(1, bytes),
    0xB0: _variable(4, bytes),
    0xC0: _list8,
    0xD0: _list32,
    0xC1: _map8,
    0xD1: _map32,
    0x00: _described,
    0x56: _fixed(1, _boolean),
    0x55: _fixed(1, lambda d, p: _SB(d, p)[0]),
    0x81: _fixed(8, lambda d, p: _SQ(d, p)[0]),
    0x54: _fixed(1, lambda d, p: proton.int32(_SB(d, p)[0])),
    0x71: _fixed(4, lambda d, p: proton.int32(_SI(d, p)[0])),
    0x53: _fixed(1, lambda d, p: proton.ulong(d[p])),
    0x80: _fixed(8, lambda d, p: proton.ulong(_UQ(d, p)[0])),
    0x52: _fixed(1, lambda d, p: proton.uint(d[p])),
    0x70: _fixed(4, lambda d, p: proton.uint(_UI(d, p)[0])),
    0x60: _fixed(2, lambda d, p: proton.ushort(_UH(d, p)[0])),
    0x61: _fixed(2, lambda d, p: proton.short(_SH(d, p)[0])),
    0x50: _fixed(1, lambda d, p: proton.ubyte(d[p])),
    0x51: _fixed(1, lambda d, p: proton.byte(_SB(d, p)[0])),
    0x82: _fixed(8, lambda d, p: _FD(d, p)[0]),
    0x72: _fixed(4, lambda d, p: proton.float32(_FF(d, p)[0])),
    0x83: _fixed(8, lambda d, p: proton.timestamp(_SQ(d, p)[0])),
    0x73: _fixed(4, _char),
    0x98: _fixed(16, lambda d, p: uuid.UUID(bytes=bytes(d[p : p + 16]))),
}
del _READERS[0x45]
_get_reader = _READERS.get


def _read(data: bytes, p: int) -> tuple[Any, int]:
    """The value at `p` and the position after it."""
    if p >= len(data):
        raise Unsupported("truncated")
    c = data[p]
    if c == 0xA1:  # str8: the most common by far
        return _str8(data, p + 1)  # type: ignore[no-any-return]
    r = _get_reader(c)
    if r is None:
        if c == 0x45:
            return [], p + 1
        raise Unsupported(f"no hand decoding for constructor 0x{c:02x}")
    try:
        return r(data, p + 1)  # type: ignore[no-any-return]
    except (IndexError, struct.error):
        raise Unsupported("truncated") from None


def _items(data: bytes, is_map: bool, p: int, end: int, count: int) -> tuple[Any, int]:
    """The `count` values from `p` (str8 read inline: most of what these messages
    hold), as a list or a map; they must end exactly at `end`."""
    if end > len(data):
        raise Unsupported("truncated")
    items: list[Any] = []
    append = items.append
    try:
        for _ in range(count):
            if data[p] == 0xA1:
                q = p + 2 + data[p + 1]
                append(data[p + 2 : q].decode())
                p = q
            else:
                v, p = _read(data, p)
                append(v)
    except IndexError:
        raise Unsupported("truncated") from None
    except UnicodeDecodeError:
        raise Unsupported("bad utf-8") from None
    if p != end:
        raise Unsupported("compound size and contents disagree")
    if not is_map:
        return items, p
    if count % 2:
        raise Unsupported("odd map count")
    try:
        return dict(zip(items[::2], items[1::2], strict=True)), p
    except TypeError:  # an unhashable key (a list): proton's problem to report
        raise Unsupported("unhashable map key") from None


def decode(data: bytes) -> Message:
    """The message in `data` (see the module docstring for what is read)."""
    if type(data) is not bytes:
        data = bytes(data)
    m = Message()
    p, n = 0, len(data)
    body_seen = False
    while p < n:
        if data[p] != 0x00:
            raise Unsupported("not a section")
        code, q = _read(data, p + 1)
        value, p = _read(data, q)
        if type(code) is not proton.ulong:
            raise Unsupported("section with a symbolic descriptor")
        if code == 0x73:
            f = value if isinstance(value, list) else None
            if f is None:
                raise Unsupported("properties is not a list")
            f = f + [None] * (6 - len(f))
            # ulong ids read as plain ints, as proton.Message gives them
            m.id = int(f[0]) if type(f[0]) is proton.ulong else f[0]
            m.correlation_id = int(f[5]) if type(f[5]) is proton.ulong else f[5]
            m.address, m.reply_to = f[2], f[4]
            if m.address is not None and not isinstance(m.address, str):
                raise Unsupported("to is not a string")
            if m.reply_to is not None and not isinstance(m.reply_to, str):
                raise Unsupported("reply-to is not a string")
        elif code == 0x74:
            if not isinstance(value, dict):
                raise Unsupported("application-properties is not a map")
            m.properties = value
        elif code in (0x77, 0x75):
            if body_seen:
                raise Unsupported("more than one body section")
            body_seen = True
            m.body = value
        elif code in (0x70, 0x71, 0x72, 0x78):
            continue  # header, annotations, footer: not read here
        else:
            raise Unsupported(f"section 0x{code:x}")
    return m


def decode_any(data: bytes) -> Message:
    """`decode`, or `proton.Message` for what the hand codec does not read (proton's
    exception for bytes that are not a message)."""
    try:
        return decode(data)
    except Unsupported:
        pass
    m = proton.Message()
    m.decode(data)
    return Message(
        id=m.id,
        correlation_id=m.correlation_id,
        reply_to=m.reply_to,
        address=m.address,
        properties=m.properties,
        body=m.body,
    )
