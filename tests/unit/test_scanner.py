"""Tests for amqbroker.protocol.scanner, with proton as the reference codec.

proton.Message builds and decodes the messages; proton.Data splits an encoded message
into its sections independently of the code under test, so byte-level assertions
("this section is an identical slice of the input") do not rely on the scanner.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from proton import (
    Array,
    Data,
    Described,
    Message,
    byte,
    char,
    decimal32,
    decimal64,
    float32,
    int32,
    short,
    symbol,
    timestamp,
    ubyte,
    uint,
    ulong,
    ushort,
)

from amqbroker.protocol.scanner import (
    ScanError,
    Scanned,
    _sections,
    add_application_property,
    add_message_annotations,
    application_properties,
    jms_dest,
    log_message_id,
    message_id,
    message_id_text,
    scan,
    set_delivery_count,
)

HEADER, DA, MA, PROPS, AP, DATA, SEQ, VALUE, FOOTER = range(0x70, 0x79)

SYMBOLIC = {
    HEADER: b"amqp:header:list",
    DA: b"amqp:delivery-annotations:map",
    MA: b"amqp:message-annotations:map",
    PROPS: b"amqp:properties:list",
    AP: b"amqp:application-properties:map",
    DATA: b"amqp:data:binary",
    SEQ: b"amqp:amqp-sequence:list",
    VALUE: b"amqp:amqp-value:*",
    FOOTER: b"amqp:footer:map",
}
CODES = {name.decode(): code for code, name in SYMBOLIC.items()}

# SCANNER_EXAMPLES=5000 for a longer soak
SETTINGS = settings(
    max_examples=int(os.environ.get("SCANNER_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------- helpers


def sections(data: bytes) -> list[tuple[int, bytes, Any]]:
    """(code, raw bytes, decoded value) of each section, split by proton.Data."""
    out: list[tuple[int, bytes, Any]] = []
    p = 0
    while p < len(data):
        d = Data()
        n = d.decode(data[p:])
        assert n > 0
        raw = data[p : p + n]
        assert raw[0] == 0
        if raw[1] == 0x53:
            code = raw[2]
        elif raw[1] == 0x80:
            code = int.from_bytes(raw[2:10], "big")
        elif raw[1] == 0xA3:
            code = CODES[raw[3 : 3 + raw[2]].decode()]
        else:
            code = CODES[raw[6 : 6 + int.from_bytes(raw[2:6], "big")].decode()]
        obj = d.get_object()
        # (proton returns the inner value for an amqp-value holding a described type)
        value = obj.value if isinstance(obj, Described) else obj
        out.append((code, raw, value))
        p += n
    return out


def boundaries(data: bytes) -> set[int]:
    ends = set()
    p = 0
    for _, raw, _ in sections(data):
        p += len(raw)
        ends.add(p)
    return ends


def raw_section(data: bytes, code: int) -> bytes | None:
    for c, raw, _ in sections(data):
        if c == code:
            return raw
    return None


def value_of(data: bytes, code: int) -> Any:
    for c, _, value in sections(data):
        if c == code:
            return value
    return None


def field(lst: Any, i: int) -> Any:
    return lst[i] if lst is not None and i < len(lst) else None


def signed32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def is_integral(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, (bool, timestamp, decimal32, decimal64))


def expected(data: bytes, app_fallback: bool = True) -> Scanned:
    """What scan() must return, from proton's decoding of `data`."""
    m = Message()
    m.decode(data)
    props = value_of(data, PROPS)
    header = value_of(data, HEADER)
    to = field(props, 2)
    to = to if type(to) is str else None
    gid = field(props, 10)
    gid = gid if type(gid) is str else None
    raw_seq = field(props, 11)
    have_seq = type(raw_seq) is uint
    gseq = signed32(raw_seq) if have_seq else 0
    exp = field(props, 8)
    expiry = int(exp) if type(exp) is timestamp else 0
    app = value_of(data, AP) or {}
    if app_fallback and gid is None:
        for k in ("JMSXGroupID", "_AMQ_GROUP_ID"):
            if type(app.get(k)) is str:
                gid = app[k]
                break
    if app_fallback and not have_seq:
        for k in ("JMSXGroupSeq", "_AMQ_GROUP_SEQUENCE"):
            if is_integral(app.get(k)):
                gseq = signed32(app[k])
                break
    # cross-check the header/properties fields proton.Message exposes itself
    ttl = round(m.ttl * 1000)
    dcount = field(header, 4)
    assert (dcount or 0) == m.delivery_count
    assert to == m.address
    assert gid == m.group_id or m.group_id is None
    ann = value_of(data, MA) or {}
    return (
        bool(m.durable),
        m.priority,
        ttl,
        expiry,
        m.delivery_count,
        gid,
        gseq,
        to,
        annotation_ms(ann, "x-opt-delivery-time", timestamp_ok=True),
        annotation_ms(ann, "x-opt-delivery-delay", timestamp_ok=False),
    )


def annotation_ms(ann: dict[Any, Any], key: str, timestamp_ok: bool) -> int:
    """What scan() reads for a delayed-delivery annotation, from proton's decoding."""
    values = [v for k, v in ann.items() if type(k) is symbol and k == key]
    if not values:
        return 0
    v = values[0]
    if is_integral(v) or (timestamp_ok and type(v) is timestamp):
        return max(int(v), 0)
    return 0


def norm(v: Any) -> tuple[str, Any]:
    """Comparison key that tells bools, ints, floats, strings and bytes apart (True != 1)."""
    if v is None or isinstance(v, bool):
        return ("scalar", v)
    if isinstance(v, float):
        return ("float", float(v))
    if isinstance(v, int):
        return ("int", int(v))
    if isinstance(v, str):
        return ("str", str(v))
    if isinstance(v, (bytes, memoryview)):
        return ("bytes", bytes(v))
    return (type(v).__name__, v)


def descriptor_bytes(code: int, style: str) -> bytes:
    if style == "small":
        return bytes((0x00, 0x53, code))
    if style == "ulong":
        return b"\x00\x80" + code.to_bytes(8, "big")
    name = SYMBOLIC[code]
    if style == "sym8":
        return bytes((0x00, 0xA3, len(name))) + name
    return b"\x00\xb3" + len(name).to_bytes(4, "big") + name


def widen(value: bytes) -> bytes:
    """Re-frame a list8/map8 (or list0) as list32/map32, or a list32/map32 as 8-bit."""
    c = value[0]
    if c == 0x45:
        return b"\xd0" + struct.pack(">II", 4, 0)
    if c in (0xC0, 0xC1):
        count, elems = value[2], value[3:]
        return bytes((c + 0x10,)) + struct.pack(">II", len(elems) + 4, count) + elems
    if c in (0xD0, 0xD1):
        count = struct.unpack_from(">I", value, 5)[0]
        elems = value[9:]
        if len(elems) < 255 and count < 256:
            return bytes((c - 0x10, len(elems) + 1, count)) + elems
    return value


def rebuild(data: bytes, styles: list[str], reframe: list[bool]) -> bytes:
    """Re-encode every section descriptor in `styles` and optionally re-frame lists/maps,
    copying all values byte-for-byte."""
    out = []
    for i, (code, raw, _) in enumerate(sections(data)):
        assert raw[:3] == bytes((0, 0x53, code))
        value = raw[3:]
        if reframe[i % len(reframe)] and code not in (DATA, VALUE):
            value = widen(value)
        out.append(descriptor_bytes(code, styles[i % len(styles)]) + value)
    return b"".join(out)


def map_entries(value: bytes) -> bytes:
    """The encoded entries of a map8/map32 value."""
    if value[0] == 0xC1:
        return value[3:]
    assert value[0] == 0xD1
    return value[9:]


MESSAGE_FIELDS = [
    "durable",
    "priority",
    "ttl",
    "first_acquirer",
    "delivery_count",
    "id",
    "user_id",
    "address",
    "subject",
    "reply_to",
    "correlation_id",
    "content_type",
    "content_encoding",
    "expiry_time",
    "creation_time",
    "group_id",
    "group_sequence",
    "reply_to_group_id",
]


def msg_fields(data: bytes) -> dict[str, Any]:
    m = Message()
    m.decode(data)
    out = {}
    for name in MESSAGE_FIELDS:
        out[name] = norm(getattr(m, name))
    out["annotations"] = {k: norm(v) for k, v in (m.annotations or {}).items()}
    out["instructions"] = {k: norm(v) for k, v in (m.instructions or {}).items()}
    out["properties"] = {k: norm(v) for k, v in (m.properties or {}).items()}
    body = m.body
    out["body"] = repr(bytes(body) if isinstance(body, memoryview) else body)
    return out


# --------------------------------------------------------------------------- strategies


def symbols(max_size: int) -> st.SearchStrategy[symbol]:
    return st.text(alphabet=st.characters(max_codepoint=127), max_size=max_size).map(symbol)


u32 = st.one_of(
    st.sampled_from([0, 1, 255, 256, 2**31 - 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1)
)
typed_ints = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-128, 127).map(byte),
    st.integers(0, 255).map(ubyte),
    st.integers(-(2**15), 2**15 - 1).map(short),
    st.integers(0, 2**16 - 1).map(ushort),
    st.integers(-(2**31), 2**31 - 1).map(int32),
    u32.map(uint),
    st.one_of(st.integers(0, 2**64 - 1), st.just(2**32 + 7)).map(ulong),
)
simple_values = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=12),
    st.binary(max_size=12),
    typed_ints,
    symbols(8),
    st.floats(width=32, allow_nan=False).map(float32),
    st.floats(allow_nan=False),
    st.integers(-(2**40), 2**40).map(timestamp),
    st.uuids(),
    st.characters(exclude_categories=["Cs"]).map(char),
)
group_values = st.one_of(st.text(max_size=8), symbols(4), typed_ints, st.none(), st.booleans())
app_keys = st.sampled_from(
    ["JMSXGroupID", "_AMQ_GROUP_ID", "JMSXGroupSeq", "_AMQ_GROUP_SEQUENCE", "a", "key", ""]
)


@st.composite
def app_properties_st(draw: st.DrawFn) -> dict[str, Any]:
    props: dict[str, Any] = draw(st.dictionaries(st.text(max_size=10), simple_values, max_size=6))
    for k in draw(st.lists(app_keys, max_size=4, unique=True)):
        props[k] = draw(group_values if "GROUP" in k.upper() else simple_values)
    return props


annotation_values = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=10),
    typed_ints,
    symbols(5),
    st.integers(-(2**40), 2**42).map(timestamp),
)
annotation_keys = st.one_of(
    st.sampled_from(
        [
            "x-opt-jms-msg-type",
            "x-opt-jms-dest",
            "x-opt-a",
            "x-opt-b",
            "x-opt-delivery-time",
            "x-opt-delivery-delay",
        ]
    ),
    st.text(alphabet="abcdefgxyz-", min_size=1, max_size=12),
).map(symbol)

bodies = st.one_of(
    st.none().map(lambda b: (b, False)),
    st.text(max_size=300).map(lambda b: (b, False)),
    st.binary(max_size=600).map(lambda b: (b, True)),  # data section
    st.binary(max_size=40).map(lambda b: (b, False)),  # amqp-value binary
    st.lists(st.integers(-1000, 1000), max_size=6).map(lambda b: (b, True)),  # sequence
    st.lists(st.text(max_size=5), max_size=6).map(lambda b: (b, False)),
    st.dictionaries(st.text(max_size=5), st.integers(-100, 100), max_size=4).map(
        lambda b: (b, False)
    ),
    st.integers(-(2**63), 2**63 - 1).map(lambda b: (b, False)),
    st.just((Described(symbol("x:y"), 5), False)),
)


# > 255 UTF-8 bytes: str32, and list32 for the properties
long_text = st.text(alphabet="abcé", min_size=256, max_size=300)


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    m = Message()
    if draw(st.booleans()):
        m.durable = draw(st.booleans())
    if draw(st.booleans()):
        m.priority = draw(st.integers(0, 255))
    if draw(st.booleans()):
        m.ttl = draw(u32) / 1000
    if draw(st.booleans()):
        m.first_acquirer = draw(st.booleans())
    if draw(st.booleans()):
        m.delivery_count = draw(u32)
    m.id = draw(
        st.one_of(
            st.none(),
            st.text(max_size=40),
            st.integers(0, 2**64 - 1).map(ulong),
            st.binary(max_size=20),
            st.uuids(),
        )
    )
    if draw(st.booleans()):
        m.user_id = draw(st.binary(max_size=10))
    m.address = draw(st.none() | st.text(max_size=20) | long_text)
    m.subject = draw(st.none() | st.text(max_size=5))
    m.reply_to = draw(st.none() | st.text(max_size=5))
    m.correlation_id = draw(st.none() | st.text(max_size=5))
    m.content_type = draw(st.none() | symbols(5))
    if draw(st.booleans()):
        m.expiry_time = draw(st.integers(0, 2**42)) / 1000
    if draw(st.booleans()):
        m.creation_time = draw(st.integers(0, 2**42)) / 1000
    m.group_id = draw(st.none() | st.text(max_size=10) | long_text)
    if draw(st.booleans()):
        m.group_sequence = draw(u32)
    m.reply_to_group_id = draw(st.none() | st.text(max_size=5))
    if draw(st.booleans()):
        m.instructions = draw(st.dictionaries(annotation_keys, annotation_values, max_size=3))
    if draw(st.booleans()):
        m.annotations = draw(st.dictionaries(annotation_keys, annotation_values, max_size=5))
    if draw(st.booleans()):
        m.properties = draw(app_properties_st())
    body, inferred = draw(bodies)
    m.body = body
    m.inferred = inferred
    return bytes(m.encode())


def jms_text(**kw: Any) -> bytes:
    args: dict[str, Any] = {
        "durable": True,
        "annotations": {
            symbol("x-opt-jms-msg-type"): byte(5),
            symbol("x-opt-jms-dest"): byte(0),
        },
        "id": "ID:9c1e8a4e-2d3b-4a57-8f25-0123456789ab:1:1:1-1",
        "address": "orders",
        "creation_time": 1700000000.123,
        "properties": {"JMSXDeliveryCount": 0, "customer": "acme"},
        "body": "hello",
    }
    args.update(kw)
    return bytes(Message(**args).encode())


def data_section(payload: bytes) -> bytes:
    return b"\x00\x53\x75" + (
        bytes((0xA0, len(payload))) + payload
        if len(payload) < 256
        else b"\xb0" + len(payload).to_bytes(4, "big") + payload
    )


def hdr(*fields: str) -> bytes:
    body = bytes.fromhex("".join(fields))
    return b"\x00\x53\x70" + bytes((0xC0, len(body) + 1, len(fields))) + body


def props_list(*fields: str) -> bytes:
    body = bytes.fromhex("".join(fields))
    return b"\x00\x53\x73" + bytes((0xC0, len(body) + 1, len(fields))) + body


def str8(s: str | bytes, code: int = 0xA1) -> str:
    b = s.encode() if isinstance(s, str) else s
    return bytes((code, len(b))).hex() + b.hex()


def map8(*entries: str) -> bytes:
    """A map8 value from hex-encoded key+value entries."""
    body = bytes.fromhex("".join(entries))
    return bytes((0xC1, len(body) + 1, 2 * len(entries))) + body


def app_map(*pairs: tuple[str, str]) -> bytes:
    """An application-properties section from (key, hex-encoded value) pairs."""
    return b"\x00\x53\x74" + map8(*(str8(k) + v for k, v in pairs))


BODY = data_section(b"payload")

# --------------------------------------------------------------------------- scan vs proton


@SETTINGS
@given(messages(), st.booleans())
def test_scan_matches_proton(data: bytes, app_fallback: bool) -> None:
    assert scan(data, app_fallback) == expected(data, app_fallback)


@SETTINGS
@given(
    messages(),
    st.lists(st.sampled_from(["small", "ulong", "sym8", "sym32"]), min_size=1, max_size=6),
    st.lists(st.booleans(), min_size=1, max_size=6),
)
def test_scan_descriptor_and_width_variants(
    data: bytes, styles: list[str], reframe: list[bool]
) -> None:
    variant = rebuild(data, styles, reframe)
    assert scan(variant) == expected(data)
    assert scan(variant, False) == expected(data, False)
    assert message_id(variant) == message_id(data)
    assert application_properties(variant) == application_properties(data)
    # the delivery log's id: its inline framing of the heads before the properties
    # (small descriptors, list8/map8/list0/null) and the general one (ulong and
    # symbol descriptors, 32-bit widths) find the same id
    want = message_id_text(message_id(data))
    assert log_message_id(data) == want
    assert log_message_id(variant) == want


@SETTINGS
@given(
    messages(),
    st.lists(st.binary(max_size=300), min_size=1, max_size=3),
    st.sampled_from([b"", b"\x00\x53\x78\xc1\x01\x00", b"\x00\x53\x78\x40"]),
)
def test_scan_multiple_data_sections_and_footer(
    data: bytes, chunks: list[bytes], footer: bytes
) -> None:
    base = b"".join(raw for code, raw, _ in sections(data) if code < DATA)
    full = base + b"".join(data_section(c) for c in chunks) + footer
    assert scan(full) == expected(base)
    assert scan(base + footer) == expected(base)


def test_typical_messages() -> None:
    data = bytes.fromhex("005370c0020141") + data_section(b"x" * 80)
    assert scan(data) == (True, 4, 0, 0, 0, None, 0, None, 0, 0)
    data = bytes.fromhex("005370c0020141") + data_section(b"x" * 300)  # vbin32
    assert scan(data) == (True, 4, 0, 0, 0, None, 0, None, 0, 0)
    data = jms_text(group_id="g1", group_sequence=3, ttl=5, expiry_time=1700000005.0)
    assert scan(data) == (True, 4, 5000, 1700000005000, 0, "g1", 3, "orders", 0, 0)
    assert scan(data) == expected(data)


def test_header_field_encodings() -> None:
    # durable as 0x56 0x01, priority 9, ttl as uint32, first-acquirer, delivery-count uint32
    data = hdr("5601", "5009", "7000010000", "41", "7000000102") + BODY
    assert scan(data) == expected(data) == (True, 9, 65536, 0, 258, None, 0, None, 0, 0)
    # smalluint / uint0 variants, explicit nulls and an extension field
    data = hdr("5600", "40", "5207", "40", "43", "a10178") + BODY
    assert scan(data) == expected(data) == (False, 4, 7, 0, 0, None, 0, None, 0, 0)
    data = hdr("42", "50ff", "43", "42", "52ff") + BODY
    assert scan(data) == expected(data) == (False, 255, 0, 0, 255, None, 0, None, 0, 0)
    # wrong types read as absent, like proton does
    data = hdr("5401", "5405", "a100", "40", "a100") + BODY
    assert scan(data) == expected(data) == (False, 4, 0, 0, 0, None, 0, None, 0, 0)
    # list0 and null headers
    assert scan(b"\x00\x53\x70\x45" + BODY)[:5] == (False, 4, 0, 0, 0)
    assert scan(b"\x00\x53\x70\x40" + BODY)[:5] == (False, 4, 0, 0, 0)


def test_properties_field_encodings() -> None:
    nulls = ["40"] * 8
    # str32 to and group-id, smalluint group-sequence, negative expiry
    to32 = "b1" + (3).to_bytes(4, "big").hex() + b"abc".hex()
    g32 = "b1" + (1).to_bytes(4, "big").hex() + b"G".hex()
    data = (
        props_list(
            "98" + "00" * 16, "a00101", to32, *nulls[:5], "83ffffffffffffffff", "40", g32, "5205"
        )
        + BODY
    )
    assert scan(data) == (False, 4, 0, -1, 0, "G", 5, "abc", 0, 0)
    # group-sequence as uint0: present, so no fallback
    data = props_list(*nulls, "40", "40", str8("g"), "43") + app_map(("JMSXGroupSeq", "5509"))
    assert scan(data + BODY) == (False, 4, 0, 0, 0, "g", 0, None, 0, 0)
    # uint edge cases for group-sequence
    for raw, seq in (("70ffffffff", -1), ("7080000000", -(2**31)), ("707fffffff", 2**31 - 1)):
        data = props_list(*nulls, "40", "40", "40", raw) + BODY
        assert scan(data)[6] == seq
    # symbol to / group-id, int group-sequence: wrong types read as absent
    data = props_list("40", "40", str8("q", 0xA3), *nulls[:6], "40", str8("g", 0xA3), "5405")
    assert scan(data + BODY) == expected(data + BODY) == (False, 4, 0, 0, 0, None, 0, None, 0, 0)
    # an empty group id is a group id
    data = props_list(*nulls, "40", "40", str8("")) + app_map(("JMSXGroupID", str8("x")))
    assert scan(data + BODY)[5] == ""
    # properties list as list0/null and a short list
    assert scan(b"\x00\x53\x73\x45" + BODY) == (False, 4, 0, 0, 0, None, 0, None, 0, 0)
    assert scan(b"\x00\x53\x73\x40" + BODY) == (False, 4, 0, 0, 0, None, 0, None, 0, 0)
    assert scan(props_list("40", "40", str8("q")) + BODY)[7] == "q"


def test_properties_with_ten_null_fields() -> None:
    """A bare grouped message (no message-id, to or times: what Proton and rhea send
    for a message with only a group id) takes the one-test path over the ten nulls;
    every field after them is read as on the field-by-field path."""
    ten = ["40"] * 10
    data = props_list(*ten, str8("g7"), "5205") + BODY
    assert scan(data) == expected(data) == (False, 4, 0, 0, 0, "g7", 5, None, 0, 0)
    data = props_list(*ten, str8("g7")) + BODY
    assert scan(data) == expected(data) == (False, 4, 0, 0, 0, "g7", 0, None, 0, 0)
    data = props_list(*ten) + BODY  # exactly ten fields, all null
    assert scan(data) == expected(data) == (False, 4, 0, 0, 0, None, 0, None, 0, 0)
    # nine nulls then a creation-time: the field-by-field path, same answer
    data = props_list(*ten[:9], "83" + (5).to_bytes(8, "big").hex(), str8("g7")) + BODY
    assert scan(data) == expected(data) == (False, 4, 0, 0, 0, "g7", 0, None, 0, 0)
    # a list whose size is shorter than its ten nulls and group id is refused
    short = props_list(*ten, str8("g7"))
    bad = short[:4] + bytes((4,)) + short[5:]
    with pytest.raises(ScanError, match="overruns its size"):
        scan(bad + BODY)


def test_properties_of_ten_nulls_and_a_group_id_alone() -> None:
    """Exactly ten nulls and a str8 group-id (the bare grouped message) is read in one
    step; what follows the section is read as after any other properties."""
    ten = ["40"] * 10
    props = props_list(*ten, str8("gé7"))
    for data in (
        props + BODY,
        hdr("41") + props + BODY,  # durable, then the section
        props + app_map(("JMSXGroupSeq", "5503")) + BODY,  # the sequence from the fallback
        props + app_map(("JMSXGroupID", str8("other"))) + BODY,  # properties win
        props,  # no body
    ):
        assert scan(data) == expected(data), data.hex()
        assert scan(data)[5] == "gé7"
    assert scan(props + app_map(("JMSXGroupSeq", "5503")) + BODY)[6] == 3
    # the group id running past the data, past the list, or not UTF-8: refused, with
    # the same words whether the section opens the message (read before the loop) or
    # follows a header
    gid_len = 3 + 3 + 10 + 1  # section head; list code, size, count; ten nulls; A1
    long_id = props[:gid_len] + bytes((props[gid_len] + 3,)) + props[gid_len + 1 :]
    for head, at in ((b"", 0), (hdr("41"), len(hdr("41")))):
        with pytest.raises(ScanError, match=f"truncated: the section at offset {at} "):
            scan(head + props[:-1])
        with pytest.raises(ScanError, match=f"properties list at offset {at} overruns its size"):
            scan(head + long_id + BODY)
        with pytest.raises(ScanError, match=f"invalid UTF-8 string in the section at offset {at}"):
            scan(head + props_list(*ten, str8(b"\xff\xfe")) + BODY)
    # shorter than the opening test reads: the loop's words, as before that test
    with pytest.raises(ScanError, match=r"at offset 0, found 0x05$"):
        scan(b"\x05")
    for few in (b"\x00", b"\x00\x53\x73"):
        with pytest.raises(ScanError, match=f"^truncated: .* offset 0 .* \\({len(few)} bytes\\)$"):
            scan(few)


# --------------------------------------------------------------------------- group fallback


@pytest.mark.parametrize(
    ("pairs", "group_id", "group_seq"),
    [
        ([("JMSXGroupID", str8("j")), ("_AMQ_GROUP_ID", str8("a"))], "j", 0),
        ([("_AMQ_GROUP_ID", str8("a")), ("JMSXGroupID", str8("j"))], "j", 0),
        ([("_AMQ_GROUP_ID", str8("a"))], "a", 0),
        ([("JMSXGroupID", "5505"), ("_AMQ_GROUP_ID", str8("a"))], "a", 0),
        ([("JMSXGroupID", str8("j", 0xA3)), ("_AMQ_GROUP_ID", str8("a"))], "a", 0),
        ([("JMSXGroupID", "a00161")], None, 0),
        ([("JMSXGroupID", "40")], None, 0),
        ([("JMSXGroupID", str8(""))], "", 0),
        ([("JMSXGroupSeq", "5505"), ("_AMQ_GROUP_SEQUENCE", "5507")], None, 5),
        ([("_AMQ_GROUP_SEQUENCE", "5507"), ("JMSXGroupSeq", "5505")], None, 5),
        ([("JMSXGroupSeq", str8("5")), ("_AMQ_GROUP_SEQUENCE", "5507")], None, 7),
        ([("JMSXGroupSeq", "41")], None, 0),
        ([("JMSXGroupSeq", "81ffffffffffffffff")], None, -1),
        ([("JMSXGroupSeq", "800000000100000005")], None, 5),
        ([("JMSXGroupSeq", "7080000000")], None, -(2**31)),
        ([("JMSXGroupSeq", "71fffffffe")], None, -2),
        ([("JMSXGroupSeq", "51ff")], None, -1),
        ([("JMSXGroupSeq", "50ff")], None, 255),
        ([("JMSXGroupSeq", "61ffff")], None, -1),
        ([("JMSXGroupSeq", "60ffff")], None, 65535),
        ([("JMSXGroupSeq", "44")], None, 0),
        ([("JMSXGroupSeq", "83" + "00" * 7 + "05")], None, 0),  # timestamp: not integral
        ([("x", "e0040251" + "0102"), ("JMSXGroupID", str8("j"))], "j", 0),  # array skipped
        ([("x", "005303" + "5501"), ("_AMQ_GROUP_ID", str8("a"))], "a", 0),  # described
    ],
)
def test_group_fallback(pairs: list[tuple[str, str]], group_id: str | None, group_seq: int) -> None:
    data = app_map(*pairs) + BODY
    assert scan(data) == (False, 4, 0, 0, 0, group_id, group_seq, None, 0, 0)
    assert scan(data, app_fallback=False) == (False, 4, 0, 0, 0, None, 0, None, 0, 0)
    assert scan(props_list("40") + data) == scan(data)


def test_properties_win_over_application_properties() -> None:
    nulls = ["40"] * 10
    ap = app_map(("JMSXGroupID", str8("j")), ("_AMQ_GROUP_ID", str8("a")), ("JMSXGroupSeq", "5509"))
    data = props_list(*nulls, str8("p"), "5203") + ap + BODY
    assert scan(data) == (False, 4, 0, 0, 0, "p", 3, None, 0, 0)
    # group-id from properties, sequence still falls back when absent
    data = props_list(*nulls, str8("p")) + ap + BODY
    assert scan(data) == (False, 4, 0, 0, 0, "p", 9, None, 0, 0)
    # a null group-id falls back
    data = props_list(*nulls, "40", "5203") + ap + BODY
    assert scan(data) == (False, 4, 0, 0, 0, "j", 3, None, 0, 0)
    # a message built by proton: JMSXGroupID applies only when group-id is unset
    msg = jms_text(properties={"JMSXGroupID": "j", "JMSXGroupSeq": int32(-1)})
    assert scan(msg)[5:7] == ("j", -1)
    assert scan(msg, app_fallback=False)[5:7] == (None, 0)
    msg = jms_text(group_id="p", properties={"JMSXGroupID": "j"})
    assert scan(msg)[5] == "p"


def test_fallback_ignores_keys_elsewhere() -> None:
    # the key names appear in annotations and as an application property *value*
    ma = b"\x00\x53\x72" + bytes.fromhex("c10f02" + str8("JMSXGroupID", 0xA3) + "41")
    data = ma + app_map(("k", str8("JMSXGroupID"))) + BODY
    assert scan(data) == (False, 4, 0, 0, 0, None, 0, None, 0, 0)


# --------------------------------------------------------------------------- delayed delivery

JMS_ANN = {symbol("x-opt-jms-msg-type"): byte(5), symbol("x-opt-jms-dest"): byte(0)}
DTIME = symbol("x-opt-delivery-time")
DDELAY = symbol("x-opt-delivery-delay")
T = 1700000060123


def ma_section(*entries: str) -> bytes:
    """A message-annotations section (map8) from hex-encoded key+value entries."""
    return b"\x00\x53\x72" + map8(*entries)


@pytest.mark.parametrize(
    ("annotations", "want"),
    [
        ({}, (0, 0)),
        ({DTIME: T}, (T, 0)),  # a long, as Qpid JMS sends it
        ({DTIME: timestamp(T)}, (T, 0)),
        ({DDELAY: 5000}, (0, 5000)),
        ({DDELAY: 100}, (0, 100)),  # smalllong
        ({DTIME: T, DDELAY: 5000}, (T, 5000)),  # both: the caller decides
        ({DDELAY: ulong(7), DTIME: uint(9)}, (9, 7)),  # other integral types
        ({DDELAY: int32(7), DTIME: ubyte(9)}, (9, 7)),
        ({DDELAY: -5000, DTIME: -T}, (0, 0)),  # negative: no delay
        ({DDELAY: timestamp(5000)}, (0, 0)),  # a delay is not a timestamp
        ({DTIME: str(T), DDELAY: "5000"}, (0, 0)),  # wrong types read as absent
        ({DTIME: float(T), DDELAY: True}, (0, 0)),
        ({DTIME: None, DDELAY: symbol("x")}, (0, 0)),
        ({symbol("x-opt-delivery-times"): T, symbol("x-opt-delivery-"): 5}, (0, 0)),
    ],
)
def test_delayed_delivery(annotations: dict[symbol, Any], want: tuple[int, int]) -> None:
    data = jms_text(annotations={**JMS_ANN, **annotations})
    assert scan(data)[8:] == want
    assert scan(data) == expected(data)
    assert scan(data)[:8] == scan(jms_text())[:8]
    # the same entries in a map8 (proton writes map32), and alone
    ma = raw_section(data, MA)
    assert ma is not None
    assert ma[3] == 0xD1
    small = b"\x00\x53\x72" + widen(ma[3:])
    assert small[3] == 0xC1
    assert scan(data.replace(ma, small))[8:] == want
    if annotations:
        assert scan(jms_text(annotations=annotations))[8:] == want


def test_delayed_delivery_encodings() -> None:
    ts = "83" + T.to_bytes(8, "big").hex()
    # sym32 key, first entry wins, string keys and delivery-annotations are not read
    sym32 = "b3" + (19).to_bytes(4, "big").hex() + b"x-opt-delivery-time".hex()
    data = ma_section(sym32 + ts) + BODY
    assert scan(data)[8:] == (T, 0)
    data = ma_section(
        str8("x-opt-delivery-delay", 0xA3) + "5505", str8("x-opt-delivery-delay", 0xA3) + "5507"
    )
    assert scan(data + BODY)[8:] == (0, 5)
    data = ma_section(str8("x-opt-delivery-delay") + "5505") + BODY
    assert scan(data)[8:] == (0, 0)
    da = b"\x00\x53\x71" + map8(str8("x-opt-delivery-delay", 0xA3) + "5505")
    assert scan(da + BODY)[8:] == (0, 0)
    assert scan(da + ma_section(str8("x-opt-delivery-delay", 0xA3) + "5506") + BODY)[8:] == (0, 6)
    # the key name as a value, or inside a binary value, is not a key
    data = ma_section(str8("a", 0xA3) + str8("x-opt-delivery-time", 0xA3)) + BODY
    assert scan(data)[8:] == (0, 0)
    blob = b"\xa3\x13x-opt-delivery-time\x55\x05"
    data = ma_section(str8("a", 0xA3) + str8(blob, 0xA0)) + BODY
    assert scan(data)[8:] == (0, 0)
    # non-symbol keys and compound/described values are skipped by size
    data = ma_section(
        "5501" + "c0020140",
        str8("b", 0xA3) + "005303" + "5501",
        str8("x-opt-delivery-delay", 0xA3) + "7000000100",
    )
    assert scan(data + BODY)[8:] == (0, 256)
    # a count larger than the entries present: the walk stops at the end of the map
    body = bytes.fromhex(str8("x-opt-delivery-delay", 0xA3) + "5509")
    data = b"\x00\x53\x72" + bytes((0xC1, len(body) + 1, 6)) + body + BODY
    assert scan(data)[8:] == (0, 9)
    # null message-annotations
    assert scan(b"\x00\x53\x72\x40" + BODY)[8:] == (0, 0)


KEY_DELAY = str8("x-opt-delivery-delay", 0xA3)
# malformed message-annotations holding a delivery key: scan() walks them and rejects
MALFORMED_ANNOTATIONS = [
    b"\x00\x53\x72\xc1" + bytes((len(bytes.fromhex(KEY_DELAY)) + 1, 1)) + bytes.fromhex(KEY_DELAY),
    ma_section(KEY_DELAY + "81" + "00" * 4),  # the value overruns the map
    ma_section(KEY_DELAY + "57"),  # invalid constructor
    ma_section(KEY_DELAY + "a1ff41"),
    ma_section(str8("a", 0xA3) + "a1ff41", KEY_DELAY + "5505"),
    ma_section("a3ff" + KEY_DELAY[4:]),  # the key overruns the map
    ma_section(KEY_DELAY + "c000"),  # list8 of size 0
    # a delivery-sized key running past the end of the map (the name is in a value)
    b"\x00\x53\x72\xc1\x19\x04\xa3\x01a\xa3\x0fx-opt-delivery-\xa3\x14x-",
    b"\x00\x53\x72\xd1" + struct.pack(">II", 4 + 23, 2) + bytes.fromhex(KEY_DELAY + "81"),
]


@pytest.mark.parametrize("ma", MALFORMED_ANNOTATIONS)
def test_delayed_delivery_malformed(ma: bytes) -> None:
    with pytest.raises(ScanError):
        scan(ma + BODY)
    assert jms_dest(ma + BODY) is None
    # without a delivery key the section is skipped by size, malformed or not
    assert scan(ma.replace(b"x-opt-delivery-", b"x-opt-elsewhere") + BODY)[8:] == (0, 0)


def test_delayed_delivery_truncated_message() -> None:
    data = jms_text(annotations={**JMS_ANN, DTIME: T})
    ends = boundaries(data)
    for i in range(len(data)):
        if i in ends:
            assert scan(data[:i]) == expected(data[:i])
        else:
            with pytest.raises(ScanError):
                scan(data[:i])


@SETTINGS
@given(
    st.dictionaries(annotation_keys, annotation_values, max_size=4),
    st.sampled_from([DTIME, DDELAY]),
    annotation_values,
    st.data(),
)
def test_mutated_annotations_raise_only_scan_error(
    annotations: dict[symbol, Any], key: symbol, value: Any, draw: st.DataObject
) -> None:
    data = jms_text(annotations={**annotations, key: value})
    assert scan(data) == expected(data)
    start = data.index(b"\x00\x53\x72")
    ma = raw_section(data, MA)
    assert ma is not None
    b = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 3))):
        # mutate inside the annotations only, mostly keeping the delivery key intact
        op = draw.draw(st.sampled_from(["set", "set", "insert", "delete"]))
        i = draw.draw(st.integers(start + 3, start + len(ma) - 1))
        if op == "set":
            b[i] = draw.draw(st.integers(0, 255))
        elif op == "insert":
            b[i:i] = draw.draw(st.binary(min_size=1, max_size=3))
        else:
            del b[i]
    mutated = bytes(b)
    try:
        out = scan(mutated)
    except ScanError:
        pass
    else:
        assert out[8] >= 0
        assert out[9] >= 0
    assert jms_dest(mutated) in (None, 0, 1, 2, 3)


# --------------------------------------------------------------------------- jms_dest


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (byte(0), 0),
        (byte(1), 1),
        (byte(2), 2),
        (byte(3), 3),
        (ubyte(1), 1),
        (ubyte(3), 3),
        (byte(4), None),
        (byte(-1), None),
        (ubyte(255), None),
        (1, None),  # a long: not what Qpid JMS sends
        (int32(1), None),
        ("queue", None),
        (None, None),
    ],
)
def test_jms_dest(value: Any, want: int | None) -> None:
    data = jms_text(
        annotations={symbol("x-opt-jms-msg-type"): byte(5), symbol("x-opt-jms-dest"): value}
    )
    assert jms_dest(data) == want
    ma = raw_section(data, MA)
    assert ma is not None
    assert ma[3] == 0xD1
    assert jms_dest(data.replace(ma, b"\x00\x53\x72" + widen(ma[3:]))) == want  # as a map8


def test_jms_dest_absent_or_malformed() -> None:
    assert jms_dest(jms_text(annotations={symbol("x-opt-jms-msg-type"): byte(5)})) is None
    assert jms_dest(jms_text(annotations=None)) is None
    assert jms_dest(BODY) is None
    assert jms_dest(b"\x00\x53\x72\x40" + BODY) is None
    # a string key, first symbol entry wins, delivery-annotations are not read
    assert jms_dest(ma_section(str8("x-opt-jms-dest") + "5101") + BODY) is None
    assert (
        jms_dest(
            ma_section(str8("x-opt-jms-dest", 0xA3) + "5101", str8("x-opt-jms-dest", 0xA3) + "5100")
            + BODY
        )
        == 1
    )
    da = b"\x00\x53\x71" + map8(str8("x-opt-jms-dest", 0xA3) + "5101")
    assert jms_dest(da + BODY) is None
    # malformed message or annotations: None, never an exception
    for bad in (
        b"",
        b"\x40",
        jms_text()[:-1],
        MALFORMED[5],
        ma_section(str8("x-opt-jms-dest", 0xA3) + "51"),
    ):
        assert jms_dest(bad) is None
    odd = b"\x00\x53\x72\xc1\x03\x01\xa3\x00" + BODY
    assert jms_dest(odd) is None


# --------------------------------------------------------------------------- errors


# framing errors: scan() and the slow path (which frames sections the same way) reject
MALFORMED = [
    b"",
    b"\x40",
    b"\x00\x53",
    b"\x00\x53\x79\x40",  # unknown descriptor
    b"\x00\x53\x6f\x40",
    b"\x00\x80" + (0x170).to_bytes(8, "big") + b"\x45",
    b"\x00\xa3\x08amqp:foo\x45",
    b"\x00\x55\x70\x45",  # descriptor is not a ulong or symbol
    b"\x00\x53\x70\x45\x00\x53\x70\x45",  # duplicate header
    b"\x00\x53\x73\x45\x00\x53\x70\x45",  # header after properties
    b"\x00\x53\x74\x40\x00\x53\x72\x40",  # annotations after application-properties
    BODY + b"\x00\x53\x73\x45",  # properties after the body
    BODY + b"\x00\x53\x77\x40",  # mixed body kinds
    b"\x00\x53\x77\x40\x00\x53\x77\x40",  # two amqp-value sections
    b"\x00\x53\x76\x45\x00\x53\x75\xa0\x00",
    BODY + b"\x00\x53\x78\x40\x00\x53\x78\x40",  # two footers
    BODY + b"\x00\x53\x78\x40\x40",  # junk after the footer
    b"\x00\x53\x78\x40\x00\x53\x77\x40",  # body after footer
    BODY + b"\x40",  # junk after the body
    b"\x00\x53\x70\xc1\x01\x00" + BODY,  # header as a map
    b"\x00\x53\x73\xa1\x00" + BODY,  # properties as a string
    b"\x00\x53\x72\xc0\x01\x00" + BODY,  # annotations as a list
    b"\x00\x53\x75\xa1\x00",  # data as a string
    b"\x00\x53\x76\xa0\x00",  # amqp-sequence as a binary
    b"\x00\x53\x78\xa0\x00",  # footer as a binary
    b"\x00\x53\x70\xc0\x00\x00" + BODY,  # list8 of size 0
    b"\x00\x53\x72\xc1\x00" + BODY,  # map8 of size 0
    b"\x00\x53\x77\x57",  # invalid constructor
    b"\x00\x53\x77\xe0\x01\x00",  # array8 of size 1
]
# errors inside the fields scan() reads
MALFORMED_CONTENT = [
    b"\x00\x53\x70\xc0\x01\x02\x41" + BODY,  # fields overrun the list
    hdr("41", "40", "40", "40", "40", "a1ff") + BODY,  # a later header field overruns
    b"\x00\x53\x73\xc0\x02\x03\x40\x40\x40" + BODY,
    props_list("40", "40", "a102c3") + BODY,  # invalid UTF-8 in to
    props_list("40", "40", "40", *["40"] * 7, "a102c328") + BODY,
    app_map(("JMSXGroupID", "a102c328")) + BODY,
    app_map(("JMSXGroupID", "a1ff41")) + BODY,  # value overruns the map
    b"\x00\x53\x74\xc1\x05\x01" + bytes.fromhex(str8("JMSXGroupID")) + BODY,  # odd count
    app_map(("JMSXGroupID", "")),  # the key ends the data: no value (and no body)
]


@pytest.mark.parametrize("data", MALFORMED)
def test_scan_rejects(data: bytes) -> None:
    with pytest.raises(ScanError):
        scan(data)
    with pytest.raises(ScanError):
        _sections(data)


@pytest.mark.parametrize("data", MALFORMED_CONTENT)
def test_scan_rejects_content(data: bytes) -> None:
    with pytest.raises(ScanError):
        scan(data)


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x53\x77\xc0\x00",  # list8 of size 0 as the amqp-value
        b"\x00\x53\x77\xd0" + struct.pack(">II", 3, 0),  # list32 of size < 4
        b"\x00\x53\x77\xf0" + struct.pack(">II", 4, 0),  # array32 of size < 5
        b"\x00\x53\x77\x00\x53\x01",  # described value without its value
        b"\x00\x53\x77\x00\x00\x00",
        BODY + b"\x00\x53\x75\xa1\x00",  # second data section is a string
        b"\x00\x53\x76\x45\x00\x53\x76\xa0\x00",  # second amqp-sequence is a binary
        BODY + b"\x00\x53\x78\xa0\x00",  # footer after the body is a binary
        b"\x00\x53\x72\xd1" + struct.pack(">II", 3, 0) + BODY,  # map32 of size < 4
        b"\x00\xa3\x10amqp:header:li",  # truncated symbolic descriptor
        b"\x00\xb3\x00\x00\x00\x10amqp:header:list",
        b"\x00\x80\x00\x00\x00\x00\x00\x00",
        b"\x00\x80\x00\x00\x00\x00\x00\x00\x00\x70",  # ulong descriptor, no value
    ],
)
def test_malformed_values(data: bytes) -> None:
    with pytest.raises(ScanError):
        scan(data)
    for fn in SLOW:
        with pytest.raises(ScanError):
            fn(data)


def test_fallback_walk_edge_cases() -> None:
    # a non-string key before a str32 group key
    key32 = b"\xb1" + struct.pack(">I", 11) + b"JMSXGroupID"
    body = b"\x55\x01\x41" + key32 + bytes.fromhex(str8("j"))
    ap = b"\x00\x53\x74\xc1" + bytes((len(body) + 1, 4)) + body
    assert scan(ap + BODY)[5] == "j"
    with pytest.raises(ScanError, match="not a string"):
        application_properties(ap + BODY)
    # a str32 group id value
    body = bytes.fromhex(str8("_AMQ_GROUP_ID")) + b"\xb1" + struct.pack(">I", 1) + b"g"
    ap = b"\x00\x53\x74\xc1" + bytes((len(body) + 1, 2)) + body
    assert scan(ap + BODY)[5] == "g"
    # a count larger than the entries present: the walk stops at the end of the map
    body = bytes.fromhex(str8("JMSXGroupID") + str8("j"))
    ap = b"\x00\x53\x74\xc1" + bytes((len(body) + 1, 6)) + body
    assert scan(ap + BODY)[5] == "j"
    # a key running past the end of the map
    body = bytes.fromhex(str8("_AMQ_GROUP_ID"))[:-1] + b"\x00"
    ap = b"\x00\x53\x74\xc1" + bytes((len(body) + 1, 2)) + body
    with pytest.raises(ScanError, match="overruns"):
        scan(ap + b"\x00\x53\x75\xa0\x05abcde")
    # null application-properties
    assert scan(b"\x00\x53\x74\x40" + BODY)[5] is None


def test_slow_path_errors_and_decoding() -> None:
    with pytest.raises(TypeError):
        add_message_annotations(BODY, {"k": 1.5})  # type: ignore[dict-item]
    odd = b"\x00\x53\x74\xc1\x03\x01\xa1\x00" + BODY
    for fn in (
        application_properties,
        lambda d: add_application_property(d, "k", True),
    ):
        with pytest.raises(ScanError, match="odd count"):
            fn(odd)
    with pytest.raises(ScanError, match="UTF-8"):
        message_id(props_list("a102c328") + BODY)
    with pytest.raises(ScanError, match="UTF-8"):
        application_properties(app_map(("k", "a102c328")) + BODY)
    with pytest.raises(ScanError, match="char"):
        application_properties(app_map(("k", "7300110000")) + BODY)
    # encodings proton does not produce by itself
    vbin32 = "b0" + struct.pack(">I", 2).hex() + "0102"
    str32 = "b1" + struct.pack(">I", 2).hex() + "6869"
    data = app_map(("b", "5601"), ("v", vbin32), ("s", str32), ("z", "5600")) + BODY
    assert application_properties(data) == {"b": True, "v": b"\x01\x02", "s": "hi", "z": False}
    # str32 keys are matched when splicing
    key32 = b"\xb1" + struct.pack(">I", 1) + b"g"
    data = b"\x00\x53\x74\xc1\x08\x02" + key32 + b"\x42" + BODY
    out = add_application_property(data, "g", True)
    assert out == b"\x00\x53\x74\xc1\x05\x02\xa1\x01g\x41" + BODY


def test_scan_error_says_where() -> None:
    with pytest.raises(ScanError, match="offset 4"):
        scan(b"\x00\x53\x70\x45" + b"\x00\x53\x70\x45")
    with pytest.raises(ScanError, match="truncated"):
        scan(jms_text()[:-1])
    assert issubclass(ScanError, ValueError)


def test_accepts_empty_footer_and_no_body() -> None:
    # proton encodes a body-less message as header + properties only
    assert scan(bytes(Message().encode())) == (False, 4, 0, 0, 0, None, 0, None, 0, 0)
    assert scan(b"\x00\x53\x78\xc1\x01\x00") == (False, 4, 0, 0, 0, None, 0, None, 0, 0)


def assert_only_scan_error(fn: Any, data: bytes) -> None:
    with contextlib.suppress(ScanError):
        fn(data)


SLOW = [
    lambda d: set_delivery_count(d, 7),
    lambda d: add_message_annotations(d, {"x-opt-a": "b"}),
    lambda d: add_application_property(d, "_AMQ_GROUP_FIRST", True),
    message_id,
    application_properties,
]


@SETTINGS
@given(
    st.one_of(
        messages(),
        st.just(jms_text(properties={"JMSXGroupID": "j"})),
        st.just(
            jms_text(
                annotations={
                    symbol("x-opt-jms-msg-type"): byte(5),
                    symbol("x-opt-delivery-time"): 1700000060123,
                    symbol("x-opt-delivery-delay"): 5000,
                }
            )
        ),
    )
)
def test_truncation_at_every_offset(data: bytes) -> None:
    ends = boundaries(data)
    for i in range(len(data)):
        cut = data[:i]
        if i in ends:
            assert scan(cut) == expected(cut)
        else:
            with pytest.raises(ScanError):
                scan(cut)
            if i < 100 or i % 7 == 0:  # (the slow path on a sample of the long tail)
                for fn in SLOW:
                    with pytest.raises(ScanError):
                        fn(cut)


@SETTINGS
@given(st.binary(max_size=200))
@example(b"\x00" * 100)
@example(b"\x00\x53\x72\xc1\x18\x02\xa3\x14x-opt-delivery-delay\x81\x00")
@example(b"\x00\x53\x72\xc1\x17\x02\xa3\x14x-opt-delivery-delay\x57")
@example(b"\x00\x53\x77" + b"\x00" * 5000)
@example(b"\x00\x53\x77" + b"\x00\x53\x01" * 2000 + b"\x40")
def test_random_bytes_raise_only_scan_error(data: bytes) -> None:
    for fn in (scan, *SLOW):
        assert_only_scan_error(fn, data)
    assert jms_dest(data) in (None, 0, 1, 2, 3)


@SETTINGS
@given(messages(), st.data())
def test_mutated_messages_raise_only_scan_error(data: bytes, draw: st.DataObject) -> None:
    b = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 4))):
        op = draw.draw(st.sampled_from(["set", "insert", "delete"]))
        i = draw.draw(st.integers(0, max(len(b) - 1, 0)))
        if op == "set" and b:
            b[i] = draw.draw(st.integers(0, 255))
        elif op == "insert":
            b[i:i] = draw.draw(st.binary(min_size=1, max_size=3))
        elif b:
            del b[i]
    mutated = bytes(b)
    for fn in (scan, *SLOW):
        assert_only_scan_error(fn, mutated)
    assert_only_scan_error(lambda d: scan(d, False), mutated)
    assert jms_dest(mutated) in (None, 0, 1, 2, 3)
    # the slow path frames sections exactly like scan() does, and a message scan()
    # accepts can always get a new delivery-count
    try:
        scan(mutated, app_fallback=False)
    except ScanError:
        return
    _sections(mutated)
    assert scan(set_delivery_count(mutated, 3), app_fallback=False)[4] == 3


# --------------------------------------------------------------------------- rewriters


def check_splice(before: bytes, after: bytes, code: int) -> tuple[bytes | None, bytes]:
    """Every section but `code` is an identical slice; sections stay in order. Returns
    the old and new raw `code` sections."""
    b = sections(before)
    a = sections(after)
    assert [(c, raw) for c, raw, _ in b if c != code] == [(c, raw) for c, raw, _ in a if c != code]
    codes = [c for c, _, _ in a]
    assert codes == sorted(codes)
    assert codes.count(code) == 1
    new = raw_section(after, code)
    assert new is not None
    return raw_section(before, code), new


def same_except(before: bytes, after: bytes, *changed: str) -> None:
    fb = msg_fields(before)
    fa = msg_fields(after)
    for k in changed:
        del fb[k], fa[k]
    assert fb == fa


@SETTINGS
@given(messages(), u32)
def test_set_delivery_count(data: bytes, count: int) -> None:
    out = set_delivery_count(data, count)
    old, new = check_splice(data, out, HEADER)
    same_except(data, out, "delivery_count")
    m = Message()
    m.decode(out)
    assert m.delivery_count == count
    assert scan(out) == (*scan(data)[:4], count, *scan(data)[5:])
    assert new[:3] == b"\x00\x53\x70"
    if old is not None:
        old_fields = value_of(data, HEADER)
        new_fields = value_of(out, HEADER)
        for i in range(4):
            assert norm(field(old_fields, i)) == norm(field(new_fields, i))
            assert type(field(old_fields, i)) is type(field(new_fields, i))


def test_set_delivery_count_copies_field_encodings() -> None:
    # durable as boolean 0x56 0x01 and ttl as uint32: copied as they were
    data = (
        b"\x00\x80"
        + (0x70).to_bytes(8, "big")
        + bytes.fromhex("c00c045601500970000000055601")
        + BODY
    )
    out = set_delivery_count(data, 300)
    assert out == (
        b"\x00\x80"
        + (0x70).to_bytes(8, "big")
        + bytes.fromhex("c011055601500970000000055601" + "700000012c")
        + BODY
    )
    assert scan(out) == (True, 9, 5, 0, 300, None, 0, None, 0, 0)
    # no header: one is inserted at the front
    out = set_delivery_count(BODY, 2)
    assert out == bytes.fromhex("005370c0070540404040" + "5202") + BODY
    assert scan(out)[4] == 2
    assert set_delivery_count(BODY, 0)[: -len(BODY)] == bytes.fromhex("005370c006054040404043")
    # list0 header and list32 header
    assert scan(set_delivery_count(b"\x00\x53\x70\x45" + BODY, 1))[4] == 1
    l32 = b"\x00\x53\x70\xd0" + struct.pack(">II", 7, 2) + b"\x41\x50\x07" + BODY
    out = set_delivery_count(l32, 1)
    assert scan(out) == (True, 7, 0, 0, 1, None, 0, None, 0, 0)
    with pytest.raises(ValueError, match="uint"):
        set_delivery_count(BODY, -1)
    with pytest.raises(ValueError, match="uint"):
        set_delivery_count(BODY, 2**32)


new_annotations = st.dictionaries(
    st.sampled_from(["x-opt-jms-msg-type", "x-opt-a", "x-opt-delivery-count", "x-opt-dlq"]),
    st.one_of(st.none(), st.booleans(), st.text(max_size=300), st.integers(-(2**63), 2**63 - 1)),
    min_size=1,
    max_size=3,
)


@SETTINGS
@given(messages(), new_annotations)
def test_add_message_annotations(data: bytes, new: dict[str, Any]) -> None:
    out = add_message_annotations(data, new)
    old, raw = check_splice(data, out, MA)
    same_except(data, out, "annotations")
    before = Message()
    before.decode(data)
    after = Message()
    after.decode(out)
    want = {str(k): norm(v) for k, v in (before.annotations or {}).items()}
    want.update({k: norm(v) for k, v in new.items()})
    got = {str(k): norm(v) for k, v in after.annotations.items()}
    assert got == want
    assert all(type(k) is symbol for k in after.annotations)
    # kept entries keep their exact AMQP types
    for k, v in (before.annotations or {}).items():
        if k not in new:
            assert type(after.annotations[k]) is type(v)
    # no replaced key: the old entries are copied as one byte-identical run
    if old is not None and old[3] != 0x40 and not set(new) & set(before.annotations or {}):
        assert map_entries(raw[3:]).startswith(map_entries(old[3:]))
    assert scan(out) == scan(data)


@SETTINGS
@given(
    messages(),
    st.sampled_from(["_AMQ_GROUP_FIRST", "JMSXGroupFirstForConsumer", "a"]),
    st.booleans(),
)
def test_add_application_property(data: bytes, key: str, value: bool) -> None:
    out = add_application_property(data, key, value)
    old, raw = check_splice(data, out, AP)
    same_except(data, out, "properties")
    before = Message()
    before.decode(data)
    after = Message()
    after.decode(out)
    want = {k: norm(v) for k, v in (before.properties or {}).items()}
    want[key] = norm(value)
    assert {k: norm(v) for k, v in after.properties.items()} == want
    if old is not None and old[3] != 0x40 and key not in (before.properties or {}):
        assert map_entries(raw[3:]).startswith(map_entries(old[3:]))
    assert application_properties(out) == {**application_properties(data), key: value}
    assert scan(out) == scan(data)


def test_jms_msg_type_stays_a_byte() -> None:
    data = jms_text()
    out = add_message_annotations(data, {"x-opt-dlq-reason": "expired", "x-opt-n": 5})
    m = Message()
    m.decode(out)
    assert type(m.annotations[symbol("x-opt-jms-msg-type")]) is byte
    assert m.annotations[symbol("x-opt-jms-msg-type")] == 5
    assert type(m.annotations[symbol("x-opt-jms-dest")]) is byte
    assert m.annotations[symbol("x-opt-dlq-reason")] == "expired"
    # exact bytes: same descriptor, same width (map32), old entries, then the new ones
    old = raw_section(data, MA)
    assert old is not None
    new = raw_section(out, MA)
    assert new is not None
    entries = map_entries(old[3:])
    added = bytes.fromhex(str8("x-opt-dlq-reason", 0xA3) + str8("expired")) + bytes.fromhex(
        str8("x-opt-n", 0xA3) + "5505"
    )
    body = entries + added
    assert new == b"\x00\x53\x72\xd1" + struct.pack(">II", len(body) + 4, 8) + body


def test_add_message_annotations_replaces_and_keeps_order() -> None:
    ma = map8(
        str8("a", 0xA3) + "5101",
        str8("x-opt-b", 0xA3) + "a100",
        str8("c", 0xA3) + "7000000003",
    )
    data = hdr("41") + b"\x00\x53\x72" + ma + BODY
    out = add_message_annotations(data, {"x-opt-b": 7})
    # the replaced entry moves to the end; long 7 is encoded as a smalllong
    expect = (
        str8("a", 0xA3) + "5101" + str8("c", 0xA3) + "7000000003" + str8("x-opt-b", 0xA3) + "5507"
    )
    body = bytes.fromhex(expect)
    assert out == hdr("41") + b"\x00\x53\x72" + bytes((0xC1, len(body) + 1, 6)) + body + BODY
    # big longs, None, bools
    out = add_message_annotations(data, {"x-opt-b": None, "n": 2**40, "t": True, "f": False})
    m = Message()
    m.decode(out)
    assert dict(m.annotations) == {
        "a": 1,
        "c": 3,
        "x-opt-b": None,
        "n": 2**40,
        "t": True,
        "f": False,
    }
    assert type(m.annotations["a"]) is byte
    assert type(m.annotations["c"]) is uint
    with pytest.raises(ValueError):
        add_message_annotations(data, {"n": 2**63})
    with pytest.raises(UnicodeEncodeError):
        add_message_annotations(data, {"ключ": 1})


def test_add_message_annotations_widens_map8() -> None:
    value = "x" * 240
    entry = str8("k", 0xA3) + str8(value)
    ma = bytes.fromhex("c1" + f"{len(entry) // 2 + 1:02x}" + "02" + entry)
    data = b"\x00\x53\x72" + ma + BODY
    out = add_message_annotations(data, {"x-opt-more": "y" * 20})
    _, new = check_splice(data, out, MA)
    assert new[3] == 0xD1
    assert map_entries(new[3:]).startswith(bytes.fromhex(entry))
    m = Message()
    m.decode(out)
    assert m.annotations == {"k": value, "x-opt-more": "y" * 20}
    # a long string value goes to str32
    out = add_message_annotations(BODY, {"big": "z" * 300})
    m.decode(out)
    assert m.annotations == {"big": "z" * 300}


def test_sections_are_created_in_place() -> None:
    da = b"\x00\x53\x71\xc1\x01\x00"
    base = [hdr("41"), da, props_list("40"), app_map(("a", "41")), BODY, b"\x00\x53\x78\x40"]
    data = b"".join(base)
    out = add_message_annotations(data, {"x": 1})
    assert out == b"".join(base[:2]) + b"\x00\x53\x72\xc1\x06\x02\xa3\x01x\x55\x01" + b"".join(
        base[2:]
    )
    out = add_message_annotations(BODY, {"x": 1})
    assert out == b"\x00\x53\x72\xc1\x06\x02\xa3\x01x\x55\x01" + BODY
    # application-properties: after properties, before the body
    base2 = [hdr("41"), props_list("40"), BODY, b"\x00\x53\x78\x40"]
    out = add_application_property(b"".join(base2), "g", True)
    assert out == b"".join(base2[:2]) + b"\x00\x53\x74\xc1\x05\x02\xa1\x01g\x41" + b"".join(
        base2[2:]
    )
    out = add_application_property(b"\x00\x53\x73\x45", "g", False)
    assert out == b"\x00\x53\x73\x45\x00\x53\x74\xc1\x05\x02\xa1\x01g\x42"
    # a null-valued section is replaced by a map
    out = add_application_property(b"\x00\x53\x74\x40" + BODY, "g", True)
    assert out == b"\x00\x53\x74\xc1\x05\x02\xa1\x01g\x41" + BODY
    # symbolic descriptor is kept
    sym = descriptor_bytes(AP, "sym8")
    out = add_application_property(sym + b"\xc1\x01\x00" + BODY, "g", True)
    assert out == sym + b"\xc1\x05\x02\xa1\x01g\x41" + BODY


def test_add_application_property_replaces() -> None:
    data = app_map(("a", "41"), ("g", "42"), ("z", str8("q"))) + BODY
    out = add_application_property(data, "g", True)
    assert out == app_map(("a", "41"), ("z", str8("q")), ("g", "41")) + BODY
    assert application_properties(out) == {"a": True, "z": "q", "g": True}


# --------------------------------------------------------------------------- slow-path readers


@SETTINGS
@given(messages())
def test_message_id_and_application_properties(data: bytes) -> None:
    m = Message()
    m.decode(data)
    mid = message_id(data)
    assert norm(mid) == norm(m.id)
    assert type(mid) in (str, int, bytes, uuid.UUID, type(None))
    props = application_properties(data)
    assert {k: norm(v) for k, v in props.items()} == {
        k: norm(v) for k, v in (m.properties or {}).items()
    }


def test_message_id_types() -> None:
    u = uuid.uuid4()
    assert message_id(jms_text(id="abc")) == "abc"
    assert message_id(jms_text(id=ulong(2**64 - 1))) == 2**64 - 1
    assert message_id(jms_text(id=b"\x00\x01")) == b"\x00\x01"
    assert message_id(jms_text(id=u)) == u
    assert message_id(jms_text(id=None)) is None
    assert message_id(BODY) is None
    assert message_id(b"\x00\x53\x73\x45" + BODY) is None
    assert message_id(props_list("5307") + BODY) == 7
    assert message_id(props_list("44") + BODY) == 0
    with pytest.raises(ScanError, match="message-id"):
        message_id(props_list("41") + BODY)


def test_log_message_id_agrees_with_message_id_text() -> None:
    """The delivery log's fast path (string and null ids read in place) gives the
    same text as the general decoder for every id type."""
    samples = [
        jms_text(id="abc"),
        jms_text(id=ulong(2**64 - 1)),
        jms_text(id=b"\x00\x01"),
        jms_text(id=uuid.uuid4()),
        jms_text(id=None, group_id="g1"),  # properties sent, message-id null
        props_list("40") + BODY,
        props_list("5307") + BODY,
        BODY,
    ]
    for data in samples:
        assert log_message_id(data) == message_id_text(message_id(data))
    assert log_message_id(props_list("40") + BODY) is None


def test_application_properties_exotic_values() -> None:
    arr = Array(symbol("x"), Data.INT, 1, 2)
    data = jms_text(
        properties={
            "l": [1, 2],
            "m": {"a": 1},
            "arr": arr,
            "d": decimal32(7),
            "dv": Described(symbol("x:y"), 5),
            "c": char("é"),
            "f": float32(1.5),
            "ts": timestamp(1234),
            "u": uuid.UUID(int=7),
            "s": symbol("sym"),
        }
    )
    props = application_properties(data)
    for k in ("l", "m", "arr", "d", "dv"):
        assert isinstance(props[k], bytes)
    assert props["c"] == "é"
    assert props["f"] == 1.5
    assert props["ts"] == 1234
    assert props["u"] == uuid.UUID(int=7)
    assert props["s"] == "sym"
    assert application_properties(BODY) == {}
    with pytest.raises(ScanError, match="not a string"):
        application_properties(b"\x00\x53\x74\xc1\x04\x02\x55\x01\x41" + BODY)
