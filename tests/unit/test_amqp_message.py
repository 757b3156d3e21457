"""The hand codec of small messages (`protocol/amqp_message.py`) against proton's:
what one writes the other reads to the same values, in both directions."""

from __future__ import annotations

import uuid
from typing import Any

import proton
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amqbroker.protocol import amqp_message as am

I64 = st.integers(-(1 << 63), (1 << 63) - 1)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    I64,
    st.text(max_size=300),
    st.binary(max_size=300),
    st.floats(allow_nan=False),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz:.-", max_size=40).map(proton.symbol),
    st.integers(0, (1 << 64) - 1).map(proton.ulong),
    st.integers(0, (1 << 32) - 1).map(proton.uint),
    st.integers(-(1 << 31), (1 << 31) - 1).map(proton.int32),
    st.integers(0, 0xFFFF).map(proton.ushort),
    st.integers(-(1 << 15), (1 << 15) - 1).map(proton.short),
    st.integers(0, 255).map(proton.ubyte),
    st.integers(-128, 127).map(proton.byte),
    st.integers(-(1 << 62), 1 << 62).map(proton.timestamp),
    st.uuids(),
    st.characters(blacklist_categories=("Cs",)).map(proton.char),
)
keys = st.one_of(
    st.text(max_size=20).map(lambda s: "s" + s),
    st.text(max_size=20).map(lambda s: proton.symbol("y" + s.encode("ascii", "replace").decode())),
    st.integers(0, 1000),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=8), st.dictionaries(keys, inner, max_size=8)),
    max_leaves=30,
)
ids = st.one_of(
    st.none(),
    st.text(max_size=60),
    st.integers(0, (1 << 64) - 1),  # a ulong id: proton reads it as an int
    st.uuids(),
    st.binary(max_size=30),
)
addresses = st.one_of(
    st.none(),
    # proton reads these as C strings: no NUL
    st.text(
        st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
        min_size=1,
        max_size=60,
    ),
)
app_props = st.one_of(
    st.none(),
    st.dictionaries(
        st.text(max_size=20),
        st.one_of(st.none(), st.booleans(), I64, st.text(max_size=40), st.floats(allow_nan=False)),
        max_size=6,
    ),
)


def _proton_encode(**f: Any) -> bytes:
    m = proton.Message(body=f["body"])
    if f["id"] is not None:
        m.id = f["id"]
    if f["correlation_id"] is not None:
        m.correlation_id = f["correlation_id"]
    if f["reply_to"] is not None:
        m.reply_to = f["reply_to"]
    if f["to"] is not None:
        m.address = f["to"]
    if f["properties"]:
        m.properties = dict(f["properties"])
    return bytes(m.encode())


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same AMQP type all the way down (proton reads binary as a
    memoryview, this codec as bytes)."""
    a, b = (bytes(x) if isinstance(x, memoryview) else x for x in (a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            any(_same(k, k2) and _same(v, b[k2]) for k2 in b if k2 == k) for k, v in a.items()
        )
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, proton.Described):
        return _same(a.descriptor, b.descriptor) and _same(a.value, b.value)
    return bool(a == b)


fields = st.fixed_dictionaries(
    {
        "id": ids,
        "correlation_id": ids,
        "reply_to": addresses,
        "to": addresses,
        "properties": app_props,
        "body": values,
    }
)


@settings(max_examples=400, deadline=None)
@given(fields)
def test_proton_reads_what_we_write(f: dict[str, Any]) -> None:
    m = proton.Message()
    m.decode(am.encode(**f))
    assert _same(m.body, f["body"])
    assert _same(m.id, f["id"]) and _same(m.correlation_id, f["correlation_id"])
    assert m.reply_to == f["reply_to"] and m.address == f["to"]
    assert _same(dict(m.properties or {}), dict(f["properties"] or {}))


@settings(max_examples=400, deadline=None)
@given(fields)
def test_we_read_what_proton_writes(f: dict[str, Any]) -> None:
    m = am.decode(_proton_encode(**f))
    assert _same(m.body, f["body"])
    assert _same(m.id, f["id"]) and _same(m.correlation_id, f["correlation_id"])
    assert m.reply_to == f["reply_to"] and m.address == f["to"]
    assert _same(dict(m.properties or {}), dict(f["properties"] or {}))


def test_a_grouping_proposal_round_trip() -> None:
    body = {"key": "g1.orders", "node": "node2", "queue": "orders"}
    props = {"operation": "groupingPropose", "type": "org.amqbroker.grouping"}
    data = am.encode(id="node2:7", reply_to="$cluster.reply", properties=props, body=body)
    m = am.decode(data)
    assert (m.id, m.reply_to, m.properties, m.body) == ("node2:7", "$cluster.reply", props, body)
    assert type(m.id) is str
    # the map went as an amqp-value section (descriptor 0x77; a data section is 0x75)
    assert data.endswith(b"\x00\x53\x77" + am.encode(body=body)[3:])


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x53\x77\xa1\x05abc",  # truncated string
        b"\x00\x53\x77\xf0\x00",  # an array: proton's job
        b"\x00\x53\x77\x74\x00\x00\x00\x00",  # decimal32
        b"\x00\x53\x73\xa1\x01x",  # properties that are not a list
        b"\x00\x53\x77\x40\x00\x53\x77\x40",  # two bodies
        b"\x00\x53\x76\x45",  # amqp-sequence
        b"\x53\x77\x40",  # not a section
        b"\x00\x53\x77\xc1\x03\x01\x40",  # odd map count
        b"\x00\x53\x77\xc0\x05\x01\x40",  # list size that disagrees with its contents
    ],
)
def test_what_it_does_not_read_is_left_to_proton(data: bytes) -> None:
    with pytest.raises(am.Unsupported):
        am.decode(data)


@pytest.mark.parametrize(
    "body",
    [proton.Array(proton.UNDESCRIBED, proton.Data.INT, 1, 2), proton.decimal32(1), 1 << 70],
)
def test_what_it_does_not_write_is_left_to_proton(body: Any) -> None:
    with pytest.raises(am.Unsupported):
        am.encode(body=body)


def test_a_uuid_id() -> None:
    u = uuid.uuid4()
    assert am.decode(am.encode(id=u, correlation_id=u)).correlation_id == u


def test_the_any_variants_fall_back_to_proton() -> None:
    arr = proton.Array(proton.UNDESCRIBED, proton.Data.INT, 1, 2)
    data = am.encode(id="x", body=arr, proton_fallback=True)  # the hand codec cannot
    m = am.decode_any(data)  # nor read one: proton does, into the same fields
    assert m.id == "x" and list(m.body.elements) == [1, 2]
    # bytes neither reads: what proton makes of them (it reads a truncated body as none)
    assert am.decode_any(b"\x00\x53\x77\xa1\x05abc").body is None
