"""The cluster's forwarding envelope, encoded and read at the byte level (issue 20).

`peer.wrap_forward` builds the envelope by hand and `peer.unwrap_forward` slices the
original message out of it without decoding it; proton.Message is the reference:
what the new code writes, proton reads back to the same annotations and body, and
the envelopes proton wrote (every earlier version of the broker) still unwrap.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proton import Message, symbol

from amqbroker.protocol.peer import BRIDGE_ID, BRIDGE_TARGET, unwrap_forward, wrap_forward
from amqbroker.protocol.scanner import ScanError, annotated_body

SETTINGS = settings(
    max_examples=int(os.environ.get("SCANNER_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def proton_envelope(
    data: bytes,
    bridge_id: str,
    target: str,
    durable: bool,
    *,
    extra: dict[Any, Any] | None = None,
    as_data_section: bool = False,
) -> bytes:
    """The envelope as earlier versions encoded it (proton.Message: an amqp-value
    binary body), or with the body as a data section (`inferred`)."""
    m = Message(body=data, inferred=as_data_section)
    m.durable = durable
    m.annotations = {symbol(BRIDGE_ID): bridge_id, symbol(BRIDGE_TARGET): target} | (extra or {})
    return bytes(m.encode())


text = st.text(max_size=300)
names = st.text(min_size=1, max_size=300)


@st.composite
def inner_messages(draw: st.DrawFn) -> bytes:
    """An encoded message of any size (vbin8 and vbin32 in the envelope)."""
    body = draw(st.one_of(st.text(max_size=600), st.binary(max_size=600)))
    m = Message(body=body)
    m.durable = draw(st.booleans())
    if draw(st.booleans()):
        m.group_id = draw(text)
    if draw(st.booleans()):
        m.properties = {"k": draw(text)}
    return bytes(m.encode())


def decode(data: bytes) -> Message:
    m = Message()
    m.decode(data)
    return m


@SETTINGS
@given(inner=inner_messages(), bid=names, target=names, durable=st.booleans())
def test_new_envelope_decodes_with_proton(
    inner: bytes, bid: str, target: str, durable: bool
) -> None:
    env = wrap_forward(inner, bridge_id=bid, target=target, durable=durable)
    m = decode(env)
    assert dict(m.annotations or {}) == {symbol(BRIDGE_ID): bid, symbol(BRIDGE_TARGET): target}
    assert bytes(m.body) == inner
    assert m.durable is durable
    assert unwrap_forward(env) == (bid, target, inner)


@SETTINGS
@given(
    inner=inner_messages(),
    bid=names,
    target=names,
    durable=st.booleans(),
    as_data=st.booleans(),
    extra=st.booleans(),
)
def test_proton_envelopes_unwrap(
    inner: bytes, bid: str, target: str, durable: bool, as_data: bool, extra: bool
) -> None:
    more = {symbol("x-opt-other"): "x" * 300, symbol("x-opt-n"): 7} if extra else None
    env = proton_envelope(inner, bid, target, durable, extra=more, as_data_section=as_data)
    assert unwrap_forward(env) == (bid, target, inner)


@pytest.mark.parametrize("size", [0, 1, 255, 256, 70000])
@pytest.mark.parametrize("durable", [False, True])
def test_sizes_at_the_encoding_boundaries(size: int, durable: bool) -> None:
    inner = bytes(range(256)) * (size // 256) + bytes(size % 256)
    for bid, target in (("n:b:1", "q"), ("n" * 120, "t" * 120), ("é" * 200, "ü" * 200)):
        env = wrap_forward(inner, bridge_id=bid, target=target, durable=durable)
        assert unwrap_forward(env) == (bid, target, inner)
        assert bytes(decode(env).body) == inner
        assert unwrap_forward(proton_envelope(inner, bid, target, durable)) == (bid, target, inner)


def test_the_original_bytes_are_not_decoded() -> None:
    """The body is any binary: not even a valid message is required."""
    env = wrap_forward(b"\xff\x00garbage", bridge_id="n:b:1", target="q", durable=False)
    assert unwrap_forward(env) == ("n:b:1", "q", b"\xff\x00garbage")


def test_wire_layout() -> None:
    env = wrap_forward(b"abc", bridge_id="n:b:1", target="q", durable=True)
    assert env.startswith(b"\x00\x53\x70\xc0\x02\x01\x41\x00\x53\x72\xc1")
    assert env.endswith(b"\x00\x53\x75\xa0\x03abc")
    assert not wrap_forward(b"abc", bridge_id="n", target="q", durable=False).startswith(
        b"\x00\x53\x70"
    )


def test_first_annotation_wins_and_other_types_are_absent() -> None:
    m = Message(body=b"x")
    m.annotations = {symbol(BRIDGE_ID): 42, symbol(BRIDGE_TARGET): symbol("q")}
    with pytest.raises(ValueError, match="annotations"):
        unwrap_forward(bytes(m.encode()))
    values, start, _ = annotated_body(
        bytes(m.encode()), (BRIDGE_ID.encode(), BRIDGE_TARGET.encode())
    )
    assert values == [None, "q"]
    assert bytes(m.encode())[start:] == b"x"


@pytest.mark.parametrize(
    "body",
    [
        None,  # no body
        "text",  # amqp-value string
        [b"a", b"b"],  # amqp-sequence... proton writes a list value
    ],
)
def test_other_bodies_are_refused(body: Any) -> None:
    m = Message(body=body)
    m.annotations = {symbol(BRIDGE_ID): "n:b:1", symbol(BRIDGE_TARGET): "q"}
    with pytest.raises(ValueError):
        unwrap_forward(bytes(m.encode()))


def test_two_data_sections_are_refused() -> None:
    env = wrap_forward(b"abc", bridge_id="n:b:1", target="q", durable=False)
    with pytest.raises(ValueError, match="one data section"):
        unwrap_forward(env + b"\x00\x53\x75\xa0\x01z")


def test_missing_annotations_are_refused() -> None:
    with pytest.raises(ValueError, match=BRIDGE_ID):
        unwrap_forward(bytes(Message(body=b"abc").encode()))


@SETTINGS
@given(inner=inner_messages(), cut=st.integers(min_value=0), flip=st.integers(min_value=0))
def test_damaged_envelopes_never_raise_anything_but_value_error(
    inner: bytes, cut: int, flip: int
) -> None:
    env = wrap_forward(inner, bridge_id="node2:b:17", target="queue", durable=True)
    truncated = env[: cut % len(env)]
    with pytest.raises(ValueError):
        unwrap_forward(truncated)
    i = flip % len(env)
    damaged = env[:i] + bytes(((env[i] + 1 + flip % 255) % 256,)) + env[i + 1 :]
    try:
        bid, target, body = unwrap_forward(damaged)
    except ValueError:
        return
    # a change inside the body, or to an equivalent encoding: proton reads the same
    # (unless proton refuses a part the walk only frames by size, e.g. a header's count)
    try:
        m = decode(damaged)
    except Exception:
        return
    ann = {str(k): v for k, v in (m.annotations or {}).items()}
    assert (ann[BRIDGE_ID], ann[BRIDGE_TARGET], bytes(m.body)) == (bid, target, body)


def test_scan_error_is_a_value_error() -> None:
    assert issubclass(ScanError, ValueError)
