"""The server side of the AMQP 1.0 SASL layer (part 5.3), in front of the Proton engine.

Theory of operation
-------------------
The PyPI Proton wheel has no Cyrus SASL, so its server side only offers ANONYMOUS and
EXTERNAL. The broker therefore runs the SASL exchange itself on the raw bytes of a
connection and, once it succeeded, hands every later byte to a Proton server transport
on which ``sasl()`` is never called (it expects the plain header ``AMQP 0 1 0 0``).

`SaslServer` is a sans-IO state machine: `feed` takes whatever the peer sent (any
chunking, one byte at a time included), `take_output` returns the bytes to send back
(our protocol header and SASL frames) and `take_passthrough` returns the bytes that
belong to the AMQP layer. It never touches a socket or a clock; the caller enforces
the authentication timeout and closes the socket when `failed` is set (after sending
`take_output()`). The caller must always send `take_output()` before anything the
Proton transport produces.

The exchange, as the server sees it::

    client                                   server
    AMQP 3 1 0 0              ->
                              <-    AMQP 3 1 0 0, sasl-mechanisms [PLAIN, ...]
    sasl-init [mech, resp]    ->
                              <-    sasl-outcome [code]
    AMQP 0 1 0 0, open ...    ->    (passthrough to Proton)

A client may pipeline the whole left column in one write. A client that sends
``AMQP 0 1 0 0`` straight away skips SASL: allowed (as user "anonymous", the header
itself is passthrough) unless authentication is required, in which case the server
answers with the SASL header so the client learns that SASL is needed, and fails.

Input is parsed into inputs (`Input`: a protocol header or a SASL frame kind) and each
input is applied through one table, `TRANSITIONS`: (state, input) -> (action, next
state), in the style of h11's ``_state.py``. A pair missing from the table is an
illegal input (`UnexpectedFrame`). Actions and the parser report every problem by
raising a `SaslError` subclass; `_fail` turns it into the FAILED state, an `error`
string and, when the client can still understand one, a reply: our protocol header
before the headers were exchanged, a sasl-outcome (code `SaslError.code`: auth for
refused credentials or a mechanism not offered, sys-perm for protocol errors) after;
no outcome when the offered mechanism list was empty (`NoMechanisms`).

Mechanisms: the server offers `Authenticator.mechanisms()`; PLAIN (RFC 4616, initial
response only) and ANONYMOUS are implemented. When `hostname` is given, a sasl-init
whose hostname field names another host (case-insensitive) is refused (sys-perm); the
client's value is kept in `client_hostname` either way.

Cost: completing a PLAIN sasl-init runs `Authenticator.authenticate_plain`, i.e. up to
one PBKDF2 computation (a cache hit is free). `feed` is synchronous; an event-loop
caller that must not block can run it in a worker thread (hashlib releases the GIL).

Invariants
----------
- The state only moves forward: AWAIT_HEADER -> AWAIT_INIT -> DONE, or to FAILED from
  either of the first two. DONE and FAILED are final.
- Until DONE, nothing is passthrough; after DONE every byte is passthrough, in order,
  starting right after the sasl-init frame (or with the AMQP header when SASL was
  skipped). Once FAILED, input is discarded.
- At most one protocol header and at most one sasl-outcome are ever output; an ok
  outcome is sent exactly when the state becomes DONE through SASL.
- Between calls to `feed`, while not DONE, the input buffer holds less than one frame
  of at most `max_frame` bytes: an oversized frame is refused as soon as its size
  field arrives.
- The result (state, user, output, passthrough, error) does not depend on how the
  input was chunked.
- `user` and `mechanism` are set only when `done`; `error` only when `failed`.

Only the control path uses `proton.Data` (to decode the described lists of SASL
frames); this module does not import trio.
"""

from __future__ import annotations

import enum
import struct
from typing import TYPE_CHECKING, Final, NamedTuple

import proton

if TYPE_CHECKING:
    from collections.abc import Callable

    from amqbroker.core.auth import Authenticator

__all__ = [
    "AMQP_HEADER",
    "ANONYMOUS_USER",
    "SASL_HEADER",
    "TRANSITIONS",
    "AuthenticationFailed",
    "BadProtocolHeader",
    "FrameTooLarge",
    "Input",
    "MalformedFrame",
    "NoMechanisms",
    "Outcome",
    "SaslError",
    "SaslServer",
    "State",
    "UnexpectedFrame",
    "WrongHost",
    "encode_mechanisms",
    "encode_outcome",
]

SASL_HEADER: Final = b"AMQP\x03\x01\x00\x00"
AMQP_HEADER: Final = b"AMQP\x00\x01\x00\x00"
_MAGIC: Final = b"AMQP"
_FRAME_HEADER = struct.Struct(">IBBH")  # size, doff, type, channel
_SASL_FRAME_TYPE: Final = 1
# MIN-MAX-FRAME-SIZE: part 5.3.1 caps SASL frames at this. We accept up to `max_frame`
# (default 64 KiB) because real clients exceed it (long tokens, big initial responses).
MIN_MAX_FRAME: Final = 512

ANONYMOUS_USER: Final = "anonymous"
_MAX_NAME_IN_ERROR = 64


class Outcome(enum.IntEnum):
    """sasl-code values (part 5.3.3.6)."""

    OK = 0
    AUTH = 1
    SYS = 2
    SYS_PERM = 3
    SYS_TEMP = 4


class State(enum.Enum):
    AWAIT_HEADER = "AWAIT_HEADER"  # nothing received yet: expecting a protocol header
    AWAIT_INIT = "AWAIT_INIT"  # header and sasl-mechanisms sent: expecting sasl-init
    DONE = "DONE"  # authenticated (or SASL skipped): everything is passthrough
    FAILED = "FAILED"  # send take_output() and close; input is discarded


class Input(enum.Enum):
    SASL_HEADER = "SASL header"
    AMQP_HEADER = "AMQP header"
    SASL_MECHANISMS = "sasl-mechanisms"
    SASL_INIT = "sasl-init"
    SASL_CHALLENGE = "sasl-challenge"
    SASL_RESPONSE = "sasl-response"
    SASL_OUTCOME = "sasl-outcome"


class Action(enum.Enum):
    OFFER_MECHANISMS = "offer_mechanisms"
    SKIP_SASL = "skip_sasl"
    AUTHENTICATE = "authenticate"


# (state, input) -> (action, next state). Anything not listed is an UnexpectedFrame.
# Actions may raise a SaslError instead, which always leads to FAILED.
TRANSITIONS: Final[dict[tuple[State, Input], tuple[Action, State]]] = {
    (State.AWAIT_HEADER, Input.SASL_HEADER): (Action.OFFER_MECHANISMS, State.AWAIT_INIT),
    (State.AWAIT_HEADER, Input.AMQP_HEADER): (Action.SKIP_SASL, State.DONE),
    (State.AWAIT_INIT, Input.SASL_INIT): (Action.AUTHENTICATE, State.DONE),
}

_FRAME_KINDS: Final = (
    (0x40, "amqp:sasl-mechanisms:list", Input.SASL_MECHANISMS),
    (0x41, "amqp:sasl-init:list", Input.SASL_INIT),
    (0x42, "amqp:sasl-challenge:list", Input.SASL_CHALLENGE),
    (0x43, "amqp:sasl-response:list", Input.SASL_RESPONSE),
    (0x44, "amqp:sasl-outcome:list", Input.SASL_OUTCOME),
)
# Numeric and symbolic descriptors both identify a frame kind.
_DESCRIPTORS: Final[dict[int | str, Input]] = {
    **{code: kind for code, _, kind in _FRAME_KINDS},
    **{name: kind for _, name, kind in _FRAME_KINDS},
}


# --- errors -----------------------------------------------------------------------------


class SaslError(Exception):
    """The exchange cannot continue; `code` is the sasl-outcome to send if one can be."""

    code: Outcome | None = Outcome.SYS_PERM


class BadProtocolHeader(SaslError):
    """The peer's protocol header is not one we speak (or SASL is required)."""


class FrameTooLarge(SaslError):
    """A frame larger than max_frame."""


class MalformedFrame(SaslError):
    """Bad frame header, not a SASL frame, or a body that is not a valid SASL list."""


class UnexpectedFrame(SaslError):
    """A well-formed input that is illegal in the current state (not in TRANSITIONS)."""


class NoMechanisms(SaslError):
    """Nothing to offer (auth required, no users): the client fails on the empty list.

    No outcome is sent: a client cannot choose from an empty sasl-mechanisms list, and
    Proton reads an outcome that follows it as garbage AMQP.
    """

    code = None


class WrongHost(SaslError):
    """The sasl-init hostname names a host other than the configured `hostname`."""


class AuthenticationFailed(SaslError):
    """Credentials refused, or a mechanism we do not offer."""

    code = Outcome.AUTH


# --- frame codec -------------------------------------------------------------------------


class _Init(NamedTuple):
    mechanism: str
    initial_response: bytes | None
    hostname: str | None


def _encode_frame(descriptor: int, fill: Callable[[proton.Data], None]) -> bytes:
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
    return _FRAME_HEADER.pack(_FRAME_HEADER.size + len(body), 2, _SASL_FRAME_TYPE, 0) + body


def encode_mechanisms(mechanisms: list[str]) -> bytes:
    def fill(data: proton.Data) -> None:
        data.put_array(False, proton.Data.SYMBOL)
        data.enter()
        for mech in mechanisms:
            data.put_symbol(mech)
        data.exit()

    return _encode_frame(0x40, fill)


def encode_outcome(code: Outcome) -> bytes:
    def fill(data: proton.Data) -> None:
        data.put_ubyte(int(code))

    return _encode_frame(0x44, fill)


def _decode_body(body: bytes) -> tuple[Input, proton.Data]:
    """Decode a SASL frame body; returns its kind and the Data positioned in its list."""
    data = proton.Data()
    try:
        consumed = data.decode(body)
    except (proton.DataException, ValueError, TypeError, OverflowError) as exc:
        raise MalformedFrame(f"undecodable SASL frame body ({exc})") from None
    if consumed != len(body):
        raise MalformedFrame(f"{len(body) - consumed} stray bytes after the SASL frame body")
    data.rewind()
    if data.next() != proton.Data.DESCRIBED:
        raise MalformedFrame("SASL frame body is not a described type")
    data.enter()
    kind_type = data.next()
    descriptor: int | str | None = None
    if kind_type == proton.Data.ULONG:
        descriptor = int(data.get_ulong())
    elif kind_type == proton.Data.SYMBOL:
        descriptor = str(data.get_symbol())
    kind = _DESCRIPTORS.get(descriptor) if descriptor is not None else None
    if kind is None:
        raise MalformedFrame(f"unknown SASL frame descriptor {descriptor!r}")
    if data.next() != proton.Data.LIST:
        raise MalformedFrame(f"{kind.value} body is not a list")
    data.enter()
    return kind, data


def _decode_init(data: proton.Data) -> _Init:
    """Fields of a sasl-init list: mechanism, initial-response, hostname (part 5.3.3.2)."""
    if data.next() != proton.Data.SYMBOL:
        raise MalformedFrame("sasl-init mechanism is missing or not a symbol")
    mechanism = str(data.get_symbol())
    response: bytes | None = None
    hostname: str | None = None
    kind = data.next()
    if kind == proton.Data.BINARY:
        response = bytes(data.get_binary())
    elif kind not in (None, proton.Data.NULL):
        raise MalformedFrame("sasl-init initial-response is not binary")
    if kind is not None:
        kind = data.next()
        if kind == proton.Data.STRING:
            hostname = str(data.get_string())
        elif kind not in (None, proton.Data.NULL):
            raise MalformedFrame("sasl-init hostname is not a string")
    # Further fields (a later protocol revision) are ignored.
    return _Init(mechanism, response, hostname)


def _header_problem(received: bytes | bytearray) -> str | None:
    """Why `received` (a prefix of the peer's input) cannot start a header we accept."""
    for i, byte in enumerate(received[: len(_MAGIC)]):
        if byte != _MAGIC[i]:
            return (
                f"not an AMQP protocol header (byte {i} is 0x{byte:02x}, expected "
                f"{_MAGIC[i : i + 1]!r}{'; a TLS handshake?' if i == 0 and byte == 0x16 else ''})"
            )
    if len(received) < len(SASL_HEADER) or received[:8] in (SASL_HEADER, AMQP_HEADER):
        return None
    header = bytes(received[:8])
    if header[4] == 2:
        return f"TLS protocol header {header!r}: TLS is not offered on this port"
    return f"unsupported protocol header {header!r} (expected {SASL_HEADER!r})"


def _clip(name: str) -> str:
    if len(name) > _MAX_NAME_IN_ERROR:
        name = name[:_MAX_NAME_IN_ERROR] + "..."
    return repr(name)


# --- the state machine ------------------------------------------------------------------


class SaslServer:
    """Server-side SASL exchange for one connection: bytes in, bytes out."""

    def __init__(
        self, auth: Authenticator, *, max_frame: int = 65536, hostname: str | None = None
    ) -> None:
        if max_frame < MIN_MAX_FRAME:
            raise ValueError(f"max_frame must be at least {MIN_MAX_FRAME}")
        self._auth = auth
        self._max_frame = max_frame
        self._hostname = hostname
        self._state = State.AWAIT_HEADER
        self._inbuf = bytearray()
        self._output = bytearray()
        self._passthrough = bytearray()
        self._header_sent = False
        self._offered: list[str] = []
        self.user: str | None = None
        self.mechanism: str | None = None
        self.error: str | None = None
        self.client_hostname: str | None = None  # hostname field of the client's sasl-init
        self._actions: dict[Action, Callable[[_Init | None], None]] = {
            Action.OFFER_MECHANISMS: self._offer_mechanisms,
            Action.SKIP_SASL: self._skip_sasl,
            Action.AUTHENTICATE: self._authenticate,
        }

    # -- public surface

    @property
    def state(self) -> State:
        return self._state

    @property
    def done(self) -> bool:
        return self._state is State.DONE

    @property
    def failed(self) -> bool:
        return self._state is State.FAILED

    def feed(self, data: bytes) -> None:
        """Input from the peer. May run a password check (PBKDF2) when a sasl-init completes."""
        if self._state is State.DONE:
            self._passthrough += data
            return
        if self._state is State.FAILED:
            return
        self._inbuf += data
        while self._state in (State.AWAIT_HEADER, State.AWAIT_INIT):
            try:
                item = self._next_input()
                if item is None:
                    break
                self._apply(*item)
            except SaslError as exc:
                self._fail(exc)

    def take_output(self) -> bytes:
        out = bytes(self._output)
        self._output.clear()
        return out

    def take_passthrough(self) -> bytes:
        out = bytes(self._passthrough)
        self._passthrough.clear()
        return out

    # -- the table

    def _apply(self, kind: Input, payload: _Init | None) -> None:
        """Apply one input through TRANSITIONS (the only place the state changes, bar _fail)."""
        try:
            action, next_state = TRANSITIONS[self._state, kind]
        except KeyError:
            raise UnexpectedFrame(
                f"unexpected {kind.value} in state {self._state.value}"
                + (" (sasl-init must come first)" if kind is Input.SASL_RESPONSE else "")
            ) from None
        self._actions[action](payload)
        self._state = next_state
        if next_state is State.DONE:  # the rest of the input belongs to the AMQP layer
            self._passthrough += self._inbuf
            self._inbuf.clear()

    def _fail(self, exc: SaslError) -> None:
        if not self._header_sent:
            self._output += SASL_HEADER
            self._header_sent = True
        elif exc.code is not None:
            self._output += encode_outcome(exc.code)
        self.error = str(exc)
        self.user = None
        self.mechanism = None
        self._state = State.FAILED
        self._inbuf.clear()

    # -- actions (raise SaslError to fail)

    def _offer_mechanisms(self, _payload: _Init | None) -> None:
        self._offered = self._auth.mechanisms()
        self._output += SASL_HEADER
        self._output += encode_mechanisms(self._offered)
        self._header_sent = True
        if not self._offered:
            raise NoMechanisms(
                "no SASL mechanism to offer (authentication is required but no users exist)"
            )

    def _skip_sasl(self, _payload: _Init | None) -> None:
        if self._auth.require_auth:
            raise BadProtocolHeader(
                "client sent the AMQP header without SASL, but authentication is required"
            )
        self._passthrough += AMQP_HEADER
        self.user = ANONYMOUS_USER
        self.mechanism = None

    def _authenticate(self, payload: _Init | None) -> None:
        if payload is None:  # the parser always decodes a sasl-init
            raise MalformedFrame("sasl-init without fields")
        mech = payload.mechanism
        self.client_hostname = payload.hostname
        if mech not in self._offered:
            raise AuthenticationFailed(
                f"client chose SASL mechanism {_clip(mech)}, which is not offered"
                f" (offered: {', '.join(self._offered) or 'none'})"
            )
        if self._hostname is not None and payload.hostname is not None:
            wanted = payload.hostname.rstrip(".").lower()
            if wanted != self._hostname.rstrip(".").lower():
                raise WrongHost(
                    f"client asked for host {_clip(payload.hostname)}, "
                    f"this broker is {self._hostname!r}"
                )
        if mech == "ANONYMOUS":
            user = ANONYMOUS_USER
        elif mech == "PLAIN":
            user = self._check_plain(payload.initial_response)
        else:  # offered by the Authenticator but unknown here
            raise SaslError(f"SASL mechanism {mech!r} is not implemented")
        self.user = user
        self.mechanism = mech
        self._output += encode_outcome(Outcome.OK)

    def _check_plain(self, response: bytes | None) -> str:
        if response is None:
            raise AuthenticationFailed("PLAIN without an initial response (challenges unsupported)")
        parts = response.split(b"\0")
        if len(parts) != 3:
            raise AuthenticationFailed(
                "malformed PLAIN response (expected authzid NUL authcid NUL password)"
            )
        try:
            authzid, authcid, password = (part.decode("utf-8") for part in parts)
        except UnicodeDecodeError:
            raise AuthenticationFailed("malformed PLAIN response (not UTF-8)") from None
        if not authcid:
            raise AuthenticationFailed("malformed PLAIN response (empty user name)")
        user = self._auth.authenticate_plain(authzid, authcid, password)
        if user is None:
            who = _clip(authcid)
            if authzid and authzid != authcid:
                who += f" acting as {_clip(authzid)}"
            raise AuthenticationFailed(f"authentication failed for user {who} (PLAIN)")
        return user

    # -- parser

    def _next_input(self) -> tuple[Input, _Init | None] | None:
        """The next complete input from the buffer (consumed), None if more bytes are needed."""
        buf = self._inbuf
        if self._state is State.AWAIT_HEADER:
            problem = _header_problem(buf)
            if problem is not None:
                raise BadProtocolHeader(problem)
            if len(buf) < len(SASL_HEADER):
                return None
            header = bytes(buf[:8])
            del buf[:8]
            return (Input.SASL_HEADER if header == SASL_HEADER else Input.AMQP_HEADER), None
        # AWAIT_INIT: SASL frames
        if buf[:4] == _MAGIC:
            raise UnexpectedFrame("protocol header received where a SASL frame was expected")
        if len(buf) < 4:
            return None
        (size,) = struct.unpack_from(">I", buf)
        if size > self._max_frame:
            raise FrameTooLarge(f"SASL frame of {size} bytes exceeds max_frame {self._max_frame}")
        if size < _FRAME_HEADER.size:
            raise MalformedFrame(f"frame size {size} is smaller than a frame header")
        if len(buf) < size:
            return None
        _, doff, frame_type, _channel = _FRAME_HEADER.unpack_from(buf)
        if frame_type != _SASL_FRAME_TYPE:
            raise MalformedFrame(
                f"frame type {frame_type} where a SASL frame (type 1) was expected"
                + (" (an AMQP frame before SASL completed)" if frame_type == 0 else "")
            )
        if doff < 2 or doff * 4 > size:
            raise MalformedFrame(f"bad data offset {doff} in a frame of {size} bytes")
        body = bytes(buf[doff * 4 : size])
        del buf[:size]
        if not body:
            raise MalformedFrame("empty SASL frame")
        kind, data = _decode_body(body)
        payload = _decode_init(data) if kind is Input.SASL_INIT else None
        return kind, payload
