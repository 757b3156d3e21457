"""SASL frames (AMQP 1.0 part 5.3): their layout, kinds and codes, and their codec.

The server engine (`amqbroker.protocol.sasl`) and the CLI's client side
(`amqbroker.protocol.client_auth`) share it. A frame is the 8-byte frame header (size,
data offset 2, type 1 = SASL, channel 0) and a body: one described list whose
descriptor (numeric or symbolic) names the frame kind (`Input`). Only this control
path uses `proton.Data`, to encode and decode those described lists.

Decoding problems raise `MalformedFrame`. The SASL exception classes live in the engine
module, which imports this one, so `_malformed` imports it where a problem is raised.
"""

from __future__ import annotations

import enum
import struct
from typing import TYPE_CHECKING, Final, NamedTuple

import proton

if TYPE_CHECKING:
    from collections.abc import Callable

    from amqbroker.protocol.sasl import MalformedFrame

__all__ = [
    "AMQP_HEADER",
    "FRAME_HEADER",
    "MAGIC",
    "SASL_FRAME_TYPE",
    "SASL_HEADER",
    "Init",
    "Input",
    "Outcome",
    "Payload",
    "Response",
    "decode_body",
    "decode_init",
    "decode_response",
    "encode_challenge",
    "encode_frame",
    "encode_mechanisms",
    "encode_outcome",
    "header_problem",
]

SASL_HEADER: Final = b"AMQP\x03\x01\x00\x00"
AMQP_HEADER: Final = b"AMQP\x00\x01\x00\x00"
MAGIC: Final = b"AMQP"
FRAME_HEADER = struct.Struct(">IBBH")  # size, doff, type, channel
SASL_FRAME_TYPE: Final = 1


class Outcome(enum.IntEnum):
    """sasl-code values (part 5.3.3.6)."""

    OK = 0
    AUTH = 1
    SYS = 2
    SYS_PERM = 3
    SYS_TEMP = 4


class Input(enum.Enum):
    SASL_HEADER = "SASL header"
    AMQP_HEADER = "AMQP header"
    SASL_MECHANISMS = "sasl-mechanisms"
    SASL_INIT = "sasl-init"
    SASL_CHALLENGE = "sasl-challenge"
    SASL_RESPONSE = "sasl-response"
    SASL_OUTCOME = "sasl-outcome"


FRAME_KINDS: Final = (
    (0x40, "amqp:sasl-mechanisms:list", Input.SASL_MECHANISMS),
    (0x41, "amqp:sasl-init:list", Input.SASL_INIT),
    (0x42, "amqp:sasl-challenge:list", Input.SASL_CHALLENGE),
    (0x43, "amqp:sasl-response:list", Input.SASL_RESPONSE),
    (0x44, "amqp:sasl-outcome:list", Input.SASL_OUTCOME),
)
# Numeric and symbolic descriptors both identify a frame kind.
DESCRIPTORS: Final[dict[int | str, Input]] = {
    **{code: kind for code, _, kind in FRAME_KINDS},
    **{name: kind for _, name, kind in FRAME_KINDS},
}


class Init(NamedTuple):
    mechanism: str
    initial_response: bytes | None
    hostname: str | None


class Response(NamedTuple):
    response: bytes


Payload = Init | Response | None


def encode_frame(descriptor: int, fill: Callable[[proton.Data], None]) -> bytes:
    data = proton.Data()
    data.put_described()
    data.enter()
    data.put_ulong(descriptor)
    data.put_list()
    data.enter()
    fill(data)
    data.exit()
    data.exit()
    body: bytes = data.encode()
    return FRAME_HEADER.pack(FRAME_HEADER.size + len(body), 2, SASL_FRAME_TYPE, 0) + body


def encode_mechanisms(mechanisms: list[str]) -> bytes:
    def fill(data: proton.Data) -> None:
        data.put_array(False, proton.Data.SYMBOL)
        data.enter()
        for mech in mechanisms:
            data.put_symbol(mech)
        data.exit()

    return encode_frame(0x40, fill)


def encode_challenge(challenge: bytes) -> bytes:
    def fill(data: proton.Data) -> None:
        data.put_binary(challenge)

    return encode_frame(0x42, fill)


def encode_outcome(code: Outcome, additional_data: bytes | None = None) -> bytes:
    def fill(data: proton.Data) -> None:
        data.put_ubyte(int(code))
        if additional_data is not None:
            data.put_binary(additional_data)

    return encode_frame(0x44, fill)


def decode_body(body: bytes) -> tuple[Input, proton.Data]:
    """Decode a SASL frame body; returns its kind and the Data positioned in its list."""
    data = proton.Data()
    try:
        consumed = data.decode(body)
    except (proton.DataException, ValueError, TypeError, OverflowError) as exc:
        raise _malformed(f"undecodable SASL frame body ({exc})") from None
    if consumed != len(body):
        raise _malformed(f"{len(body) - consumed} stray bytes after the SASL frame body")
    data.rewind()
    if data.next() != proton.Data.DESCRIBED:
        raise _malformed("SASL frame body is not a described type")
    data.enter()
    kind_type = data.next()
    descriptor: int | str | None = None
    if kind_type == proton.Data.ULONG:
        descriptor = int(data.get_ulong())
    elif kind_type == proton.Data.SYMBOL:
        descriptor = str(data.get_symbol())
    kind = DESCRIPTORS.get(descriptor) if descriptor is not None else None
    if kind is None:
        raise _malformed(f"unknown SASL frame descriptor {descriptor!r}")
    if data.next() != proton.Data.LIST:
        raise _malformed(f"{kind.value} body is not a list")
    data.enter()
    return kind, data


def decode_init(data: proton.Data) -> Init:
    """Fields of a sasl-init list: mechanism, initial-response, hostname (part 5.3.3.2)."""
    if data.next() != proton.Data.SYMBOL:
        raise _malformed("sasl-init mechanism is missing or not a symbol")
    mechanism = str(data.get_symbol())
    response: bytes | None = None
    hostname: str | None = None
    kind = data.next()
    if kind == proton.Data.BINARY:
        response = bytes(data.get_binary())
    elif kind not in (None, proton.Data.NULL):
        raise _malformed("sasl-init initial-response is not binary")
    if kind is not None:
        kind = data.next()
        if kind == proton.Data.STRING:
            hostname = str(data.get_string())
        elif kind not in (None, proton.Data.NULL):
            raise _malformed("sasl-init hostname is not a string")
    # Further fields (a later protocol revision) are ignored.
    return Init(mechanism, response, hostname)


def decode_response(data: proton.Data) -> Response:
    """Fields of a sasl-response list: response, mandatory (part 5.3.3.4)."""
    if data.next() != proton.Data.BINARY:
        raise _malformed("sasl-response response is missing or not binary")
    return Response(bytes(data.get_binary()))


def header_problem(received: bytes | bytearray) -> str | None:
    """Why `received` (a prefix of the peer's input) cannot start a header we accept."""
    for i, byte in enumerate(received[: len(MAGIC)]):
        if byte != MAGIC[i]:
            return (
                f"not an AMQP protocol header (byte {i} is 0x{byte:02x}, expected "
                f"{MAGIC[i : i + 1]!r}{'; a TLS handshake?' if i == 0 and byte == 0x16 else ''})"
            )
    if len(received) < len(SASL_HEADER) or received[:8] in (SASL_HEADER, AMQP_HEADER):
        return None
    header = bytes(received[:8])
    if header[4] == 2:
        return f"TLS protocol header {header!r}: TLS is not offered on this port"
    return f"unsupported protocol header {header!r} (expected {SASL_HEADER!r})"


def _malformed(problem: str) -> MalformedFrame:
    from amqbroker.protocol.sasl import MalformedFrame

    return MalformedFrame(problem)
