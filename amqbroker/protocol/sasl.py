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

and with SCRAM-SHA-256 (RFC 5802, RFC 7677), one challenge round::

    sasl-init [SCRAM-SHA-256, client-first]  ->
                              <-    sasl-challenge [server-first "r=..,s=..,i=.."]
    sasl-response [client-final]             ->
                              <-    sasl-outcome [ok, additional-data server-final "v=.."]

A client may pipeline the whole left column of a one-step mechanism in one write. A
client that sends ``AMQP 0 1 0 0`` straight away skips SASL: allowed (as user
"anonymous", the header itself is passthrough) when anonymous access is allowed
(`Authenticator.anonymous_allowed`); otherwise the server answers with the SASL header
so the client learns that SASL is needed, and fails.

Input is parsed into inputs (`Input`: a protocol header or a SASL frame kind) and each
input is applied through one table, `TRANSITIONS`: (state, input) -> (action, the
states it may lead to), in the style of h11's ``_state.py``. The action returns the
next state, which must be one the table lists (sasl-init leads to DONE for one-step
mechanisms and to AWAIT_RESPONSE for SCRAM). A pair missing from the table is an
illegal input (`UnexpectedFrame`). Actions and the parser report every problem by
raising a `SaslError` subclass; `_fail` turns it into the FAILED state, an `error`
string and, when the client can still understand one, a reply: our protocol header
before the headers were exchanged, a sasl-outcome (code `SaslError.code`: auth for
refused credentials, a mechanism not offered or a malformed mechanism message,
sys-perm for protocol errors) after; no outcome when the offered mechanism list was
empty (`NoMechanisms`). A sasl-outcome carries no text, so `error` (logged by the
connection) is where a person reads what went wrong.

Mechanisms: the server offers `Authenticator.mechanisms(tls_identity)`:

- EXTERNAL (RFC 4422 appendix A), offered only when the connection presented a TLS
  client certificate (`tls_identity`, its subject): the user is
  `Authenticator.tls_user(tls_identity)`; an unmapped identity is refused (auth). The
  initial response, an authzid, must be empty or name that user.
- SCRAM-SHA-256 (`_Scram`): the client-first message must be the initial response.
  Channel binding is not supported (we never offer SCRAM-SHA-256-PLUS): gs2 flag "n"
  and "y" are accepted, "p=" is refused. An authzid ("a=") must equal the user name.
  A user without a SCRAM credential, known or not, gets a complete exchange with fake
  credentials (`Authenticator.scram_credentials`) and then auth, so the exchange does
  not reveal who exists. User names are compared exactly (no SASLprep).
- PLAIN (RFC 4616, initial response only) and ANONYMOUS.

When `hostname` is given, a sasl-init whose hostname field names another host
(case-insensitive) is refused (sys-perm); the client's value is kept in
`client_hostname` either way.

Cost: completing a PLAIN sasl-init runs `Authenticator.authenticate_plain`, i.e. up to
one PBKDF2 computation (a cache hit is free); a SCRAM exchange costs a few HMACs (the
client does the PBKDF2). `feed` is synchronous; an event-loop caller that must not
block can run it in a worker thread (hashlib releases the GIL) whenever `may_block`.

Invariants
----------
- The state only moves forward: AWAIT_HEADER -> AWAIT_INIT -> [AWAIT_RESPONSE ->]
  DONE, or to FAILED from any of the first three. DONE and FAILED are final.
- Until DONE, nothing is passthrough; after DONE every byte is passthrough, in order,
  starting right after the last SASL frame (or with the AMQP header when SASL was
  skipped). Once FAILED, input is discarded.
- At most one protocol header, at most one sasl-challenge and at most one sasl-outcome
  are ever output; an ok outcome is sent exactly when the state becomes DONE through
  SASL, and it carries additional-data exactly for SCRAM (the server-final message).
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

import base64
import binascii
import enum
import secrets
import struct
from typing import TYPE_CHECKING, Final, NamedTuple

import proton

from amqbroker.core.auth import scram_verify
from amqbroker.core.errors import PeerError

if TYPE_CHECKING:
    from collections.abc import Callable

    from amqbroker.core.auth import Authenticator, ScramCredentials

__all__ = [
    "AMQP_HEADER",
    "ANONYMOUS_USER",
    "BLOCKING_MECHANISMS",
    "SASL_HEADER",
    "SCRAM_SHA_256",
    "SINGLE_STEP_MECHANISMS",
    "TRANSITIONS",
    "AuthenticationFailed",
    "BadProtocolHeader",
    "ChannelBindingNotSupported",
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
    "encode_challenge",
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
SCRAM_SHA_256: Final = "SCRAM-SHA-256"
#: mechanisms whose server side may verify a password with PBKDF2 (PLAIN does; a SCRAM
#: exchange itself costs a few HMACs, but is listed so that any password mechanism runs
#: off the event loop)
BLOCKING_MECHANISMS: Final = frozenset({"PLAIN", SCRAM_SHA_256})
_MAX_NAME_IN_ERROR = 64
_MAX_SUBJECT_IN_ERROR = 256


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
    AWAIT_RESPONSE = "AWAIT_RESPONSE"  # sasl-challenge sent: expecting sasl-response
    DONE = "DONE"  # authenticated (or SASL skipped): everything is passthrough
    FAILED = "FAILED"  # send take_output() and close; input is discarded


_RUNNING: Final = frozenset({State.AWAIT_HEADER, State.AWAIT_INIT, State.AWAIT_RESPONSE})


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
    VERIFY_RESPONSE = "verify_response"


# (state, input) -> (action, the states it may lead to; the action returns which).
# Anything not listed is an UnexpectedFrame. Actions may raise a SaslError instead,
# which always leads to FAILED.
TRANSITIONS: Final[dict[tuple[State, Input], tuple[Action, tuple[State, ...]]]] = {
    (State.AWAIT_HEADER, Input.SASL_HEADER): (Action.OFFER_MECHANISMS, (State.AWAIT_INIT,)),
    (State.AWAIT_HEADER, Input.AMQP_HEADER): (Action.SKIP_SASL, (State.DONE,)),
    (State.AWAIT_INIT, Input.SASL_INIT): (
        Action.AUTHENTICATE,
        (State.DONE, State.AWAIT_RESPONSE),
    ),
    (State.AWAIT_RESPONSE, Input.SASL_RESPONSE): (Action.VERIFY_RESPONSE, (State.DONE,)),
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


class SaslError(PeerError):
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
    """Nothing to offer (auth required, no way to authenticate on this connection).

    No outcome is sent: a client cannot choose from an empty sasl-mechanisms list, and
    Proton reads an outcome that follows it as garbage AMQP.
    """

    code = None


class WrongHost(SaslError):
    """The sasl-init hostname names a host other than the configured `hostname`."""


class AuthenticationFailed(SaslError):
    """Credentials refused, a mechanism we do not offer, or a malformed mechanism message."""

    code = Outcome.AUTH


class ChannelBindingNotSupported(AuthenticationFailed):
    """A SCRAM client that requires channel binding (GS2 flag "p=")."""


# --- frame codec -------------------------------------------------------------------------


class _Init(NamedTuple):
    mechanism: str
    initial_response: bytes | None
    hostname: str | None


class _Response(NamedTuple):
    response: bytes


_Payload = _Init | _Response | None


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


def encode_challenge(challenge: bytes) -> bytes:
    def fill(data: proton.Data) -> None:
        data.put_binary(challenge)

    return _encode_frame(0x42, fill)


def encode_outcome(code: Outcome, additional_data: bytes | None = None) -> bytes:
    def fill(data: proton.Data) -> None:
        data.put_ubyte(int(code))
        if additional_data is not None:
            data.put_binary(additional_data)

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


def _decode_response(data: proton.Data) -> _Response:
    """Fields of a sasl-response list: response, mandatory (part 5.3.3.4)."""
    if data.next() != proton.Data.BINARY:
        raise MalformedFrame("sasl-response response is missing or not binary")
    return _Response(bytes(data.get_binary()))


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


def _clip(name: str, limit: int = _MAX_NAME_IN_ERROR) -> str:
    if len(name) > limit:
        name = name[:limit] + "..."
    return repr(name)


# --- SCRAM-SHA-256 (RFC 5802, RFC 7677), server side ---------------------------------------


def _scram_malformed(what: str, problem: str) -> AuthenticationFailed:
    return AuthenticationFailed(f"malformed {SCRAM_SHA_256} {what}: {problem}")


def _scram_text(message: bytes, what: str) -> str:
    try:
        return message.decode("utf-8")
    except UnicodeDecodeError:
        raise _scram_malformed(what, "not UTF-8") from None


def _saslname(value: str, what: str) -> str:
    """Decode a SCRAM saslname ("=2C" is ',', "=3D" is '='; a bare '=' or NUL is illegal)."""
    if not value:
        raise _scram_malformed("client-first message", f"empty {what}")
    out: list[str] = []
    i = 0
    while i < len(value):
        c = value[i]
        if c == "=":
            code = value[i + 1 : i + 3]
            if code not in ("2C", "3D"):
                raise _scram_malformed(
                    "client-first message", f"{what} has '=' not followed by 2C or 3D"
                )
            out.append("," if code == "2C" else "=")
            i += 3
            continue
        if c == "\0":
            raise _scram_malformed("client-first message", f"{what} contains NUL")
        out.append(c)
        i += 1
    return "".join(out)


def _check_nonce(nonce: str) -> None:
    if not nonce:
        raise _scram_malformed("client-first message", "empty client nonce (r=)")
    if not all(0x21 <= ord(c) <= 0x7E for c in nonce):  # ',' cannot occur: split on it
        raise _scram_malformed(
            "client-first message", "the client nonce (r=) has non-printable characters"
        )


def _check_extensions(attributes: list[str], what: str) -> None:
    for attribute in attributes:
        if not (len(attribute) >= 2 and attribute[0].isascii() and attribute[0].isalpha()):
            raise _scram_malformed(what, f"attribute {_clip(attribute)} is not 'x=value'")
        if attribute[1] != "=":
            raise _scram_malformed(what, f"attribute {_clip(attribute)} is not 'x=value'")


def _b64_attribute(text: str, what: str, name: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise _scram_malformed(what, f"{name} is not valid base64") from None


class _Scram:
    """One SCRAM-SHA-256 exchange, server side (RFC 5802 section 5): two calls."""

    def __init__(self, auth: Authenticator, server_nonce: str) -> None:
        self._auth = auth
        self._server_nonce = server_nonce
        self.user = ""
        self._gs2_header = ""
        self._client_first_bare = ""
        self._server_first = ""
        self._nonce = ""
        self._creds: ScramCredentials | None = None
        self._problem: str | None = None

    def server_first(self, client_first: bytes) -> bytes:
        """Take the client-first message; the server-first message (the challenge)."""
        what = "client-first message"
        text = _scram_text(client_first, what)
        parts = text.split(",", 2)
        if len(parts) < 3:
            raise _scram_malformed(
                what, "no GS2 header (expected e.g. 'n,,n=user,r=nonce' without channel binding)"
            )
        flag, authz, bare = parts
        if flag.startswith("p="):
            raise ChannelBindingNotSupported(
                f"the {SCRAM_SHA_256} client requires channel binding ({_clip(flag[2:])}), "
                "which this broker does not support (it offers SCRAM-SHA-256, not "
                "SCRAM-SHA-256-PLUS); configure the client without channel binding"
            )
        if flag not in ("n", "y"):
            raise _scram_malformed(
                what, f"GS2 channel-binding flag {_clip(flag)} is not 'n', 'y' or 'p=<name>'"
            )
        authzid: str | None = None
        if authz:
            if not authz.startswith("a="):
                raise _scram_malformed(what, f"GS2 authzid {_clip(authz)} is not 'a=<name>'")
            authzid = _saslname(authz[2:], "authzid (a=)")
        attributes = bare.split(",")
        if attributes[0].startswith("m="):
            raise AuthenticationFailed(
                f"the {SCRAM_SHA_256} client requires a mandatory extension (m=), "
                "which this broker does not support"
            )
        if not attributes[0].startswith("n="):
            raise _scram_malformed(what, "no user name (n=) after the GS2 header")
        user = _saslname(attributes[0][2:], "user name (n=)")
        if len(attributes) < 2 or not attributes[1].startswith("r="):
            raise _scram_malformed(what, "no client nonce (r=) after the user name")
        client_nonce = attributes[1][2:]
        _check_nonce(client_nonce)
        _check_extensions(attributes[2:], what)  # other extensions are ignored
        if authzid is not None and authzid != user:
            raise AuthenticationFailed(
                f"authentication failed for user {_clip(user)} acting as {_clip(authzid)} "
                f"({SCRAM_SHA_256}): acting as another user is not supported"
            )
        self.user = user
        self._gs2_header = f"{flag},{authz},"
        self._client_first_bare = bare
        self._creds, self._problem = self._auth.scram_credentials(user)
        self._nonce = client_nonce + self._server_nonce
        salt = base64.b64encode(self._creds.salt).decode("ascii")
        self._server_first = f"r={self._nonce},s={salt},i={self._creds.iterations}"
        return self._server_first.encode("ascii")

    def server_final(self, client_final: bytes) -> bytes:
        """Take the client-final message; the server-final message ("v=...") if the
        proof is right, else AuthenticationFailed."""
        assert self._creds is not None, "server_first must come first"
        what = "client-final message"
        text = _scram_text(client_final, what)
        attributes = text.split(",")
        if len(attributes) < 3 or not attributes[0].startswith("c="):
            raise _scram_malformed(what, "expected 'c=<binding>,r=<nonce>,...,p=<proof>'")
        if not attributes[1].startswith("r="):
            raise _scram_malformed(what, "no nonce (r=) after the channel binding")
        if not attributes[-1].startswith("p="):
            raise _scram_malformed(what, "no proof (p=) at the end")
        _check_extensions(attributes[2:-1], what)
        binding = _b64_attribute(attributes[0][2:], what, "the channel binding (c=)")
        if binding != self._gs2_header.encode("utf-8"):
            raise AuthenticationFailed(
                f"authentication failed for user {_clip(self.user)} ({SCRAM_SHA_256}): the "
                "channel binding (c=) does not repeat the GS2 header of the client-first "
                "message (channel binding is not supported)"
            )
        if attributes[1][2:] != self._nonce:
            raise AuthenticationFailed(
                f"authentication failed for user {_clip(self.user)} ({SCRAM_SHA_256}): the "
                "nonce (r=) is not the one of this exchange (a replayed or altered message)"
            )
        proof = _b64_attribute(attributes[-1][2:], what, "the proof (p=)")
        if len(proof) != 32:
            raise _scram_malformed(what, f"the proof (p=) is {len(proof)} bytes, expected 32")
        without_proof = text[: len(text) - len(attributes[-1]) - 1]
        auth_message = ",".join((self._client_first_bare, self._server_first, without_proof))
        signature = scram_verify(self._creds, auth_message.encode("utf-8"), proof)
        if signature is None or self._problem is not None:
            problem = self._problem or "wrong password (the client proof does not match)"
            raise AuthenticationFailed(
                f"authentication failed for user {_clip(self.user)} ({SCRAM_SHA_256}): {problem}"
            )
        return b"v=" + base64.b64encode(signature)


def _new_server_nonce() -> str:
    return secrets.token_urlsafe(24)  # 32 characters of [A-Za-z0-9_-]


# --- the state machine ------------------------------------------------------------------


class SaslServer:
    """Server-side SASL exchange for one connection: bytes in, bytes out.

    `tls_identity` is the subject of the client's TLS certificate, when it presented
    one (EXTERNAL is offered only then). `scram_nonce` makes the server nonce (tests).
    """

    def __init__(
        self,
        auth: Authenticator,
        *,
        max_frame: int = 65536,
        hostname: str | None = None,
        tls_identity: str | None = None,
        scram_nonce: Callable[[], str] = _new_server_nonce,
    ) -> None:
        if max_frame < MIN_MAX_FRAME:
            raise ValueError(f"max_frame must be at least {MIN_MAX_FRAME}")
        self._auth = auth
        self._max_frame = max_frame
        self._hostname = hostname
        self._tls_identity = tls_identity
        self._scram_nonce = scram_nonce
        self._scram: _Scram | None = None
        self._may_block = bool(BLOCKING_MECHANISMS.intersection(auth.mechanisms(tls_identity)))
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
        self._actions: dict[Action, Callable[[_Payload], State]] = {
            Action.OFFER_MECHANISMS: self._offer_mechanisms,
            Action.SKIP_SASL: self._skip_sasl,
            Action.AUTHENTICATE: self._authenticate,
            Action.VERIFY_RESPONSE: self._verify_response,
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

    @property
    def may_block(self) -> bool:
        """`feed` may verify a password (a password mechanism is offered and the
        exchange still runs): an event-loop caller should feed from a worker thread."""
        return self._may_block and self._state in _RUNNING

    def feed(self, data: bytes) -> None:
        """Input from the peer. May run a password check (PBKDF2) when a sasl-init completes."""
        if self._state is State.DONE:
            self._passthrough += data
            return
        if self._state is State.FAILED:
            return
        self._inbuf += data
        while self._state in _RUNNING:
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

    def _apply(self, kind: Input, payload: _Payload) -> None:
        """Apply one input through TRANSITIONS (the only place the state changes, bar _fail)."""
        try:
            action, targets = TRANSITIONS[self._state, kind]
        except KeyError:
            hint = ""
            if kind is Input.SASL_RESPONSE and self._state is State.AWAIT_INIT:
                hint = " (sasl-init must come first)"
            elif self._state is State.AWAIT_RESPONSE:
                hint = f" ({SCRAM_SHA_256} expects a sasl-response)"
            raise UnexpectedFrame(
                f"unexpected {kind.value} in state {self._state.value}{hint}"
            ) from None
        next_state = self._actions[action](payload)
        if next_state not in targets:  # a bug in an action, not the peer's fault
            raise AssertionError(f"{action} led to {next_state}, not one of {targets}")
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
        self._scram = None
        self._state = State.FAILED
        self._inbuf.clear()

    # -- actions (return the next state; raise SaslError to fail)

    def _offer_mechanisms(self, _payload: _Payload) -> State:
        self._offered = self._auth.mechanisms(self._tls_identity)
        self._output += SASL_HEADER
        self._output += encode_mechanisms(self._offered)
        self._header_sent = True
        if not self._offered:
            raise NoMechanisms(
                "no SASL mechanism to offer this connection: anonymous access is not "
                "allowed (require_auth / allow_anonymous), no users with passwords are "
                "configured, and EXTERNAL needs a TLS client certificate, which this "
                "connection did not present"
            )
        return State.AWAIT_INIT

    def _skip_sasl(self, _payload: _Payload) -> State:
        if not self._auth.anonymous_allowed:
            raise BadProtocolHeader(
                "client sent the AMQP header without SASL, but authentication is required"
            )
        self._passthrough += AMQP_HEADER
        self.user = ANONYMOUS_USER
        self.mechanism = None
        return State.DONE

    def _authenticate(self, payload: _Payload) -> State:
        if not isinstance(payload, _Init):  # the parser always decodes a sasl-init
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
        if mech == SCRAM_SHA_256:
            if payload.initial_response is None:
                raise AuthenticationFailed(
                    f"{SCRAM_SHA_256} without an initial response: the client-first "
                    "message must be in the sasl-init (empty first challenges are not "
                    "supported)"
                )
            scram = _Scram(self._auth, self._scram_nonce())
            challenge = scram.server_first(payload.initial_response)
            self._scram = scram
            self._output += encode_challenge(challenge)
            return State.AWAIT_RESPONSE
        check = SINGLE_STEP_MECHANISMS.get(mech)
        if check is None:  # offered by the Authenticator but unknown here
            raise SaslError(f"SASL mechanism {mech!r} is not implemented")
        user = check(self, payload.initial_response)
        self.user = user
        self.mechanism = mech
        self._output += encode_outcome(Outcome.OK)
        return State.DONE

    def _verify_response(self, payload: _Payload) -> State:
        if not isinstance(payload, _Response) or self._scram is None:
            raise MalformedFrame("sasl-response without a response")
        server_final = self._scram.server_final(payload.response)
        self.user = self._scram.user
        self.mechanism = SCRAM_SHA_256
        self._scram = None
        self._output += encode_outcome(Outcome.OK, server_final)
        return State.DONE

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

    def _check_external(self, response: bytes | None) -> str:
        identity = self._tls_identity
        if identity is None:  # EXTERNAL is offered only with an identity
            raise AuthenticationFailed("EXTERNAL without a TLS client certificate")
        user = self._auth.tls_user(identity)
        if user is None:
            raise AuthenticationFailed(
                f"TLS client certificate {_clip(identity, _MAX_SUBJECT_IN_ERROR)} is not "
                "mapped to a user (EXTERNAL); add it to tls_identity_users "
                '("<certificate subject>" = "<user>") or use another mechanism'
            )
        try:
            authzid = (response or b"").decode("utf-8")
        except UnicodeDecodeError:
            raise AuthenticationFailed("malformed EXTERNAL authzid (not UTF-8)") from None
        if authzid and authzid != user:
            raise AuthenticationFailed(
                f"EXTERNAL: TLS client certificate {_clip(identity, _MAX_SUBJECT_IN_ERROR)} "
                f"maps to user {_clip(user)}, not {_clip(authzid)} (acting as another user "
                "is not supported)"
            )
        return user

    # -- parser

    def _next_input(self) -> tuple[Input, _Payload] | None:
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
        # AWAIT_INIT, AWAIT_RESPONSE: SASL frames
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
        try:
            kind, data = _decode_body(body)
            payload: _Payload = None  # decoded only where legal: else UnexpectedFrame says why
            if kind is Input.SASL_INIT and self._state is State.AWAIT_INIT:
                payload = _decode_init(data)
            elif kind is Input.SASL_RESPONSE and self._state is State.AWAIT_RESPONSE:
                payload = _decode_response(data)
        except UnicodeDecodeError as exc:
            # Proton decodes symbols (ASCII) and strings (UTF-8) as they are read: a
            # peer's bad byte must fail the exchange, not escape `feed` (fuzz-found)
            raise MalformedFrame(
                f"a symbol or string in the SASL frame is not valid {exc.encoding} "
                f"({exc.reason} at byte {exc.start})"
            ) from None
        return kind, payload


def _anonymous(_server: SaslServer, _response: bytes | None) -> str:
    return ANONYMOUS_USER


#: the mechanisms decided by the sasl-init alone: name -> check(server, initial
#: response) -> the authenticated user (raise `AuthenticationFailed` to refuse). A new
#: one is a function and a line here, plus offering it in `Authenticator.mechanisms`
#: (and `BLOCKING_MECHANISMS` if its check may block, e.g. runs PBKDF2). SCRAM, with
#: its challenge round, is the `AWAIT_RESPONSE` state of `TRANSITIONS`.
SINGLE_STEP_MECHANISMS: Final[dict[str, Callable[[SaslServer, bytes | None], str]]] = {
    "ANONYMOUS": _anonymous,
    "PLAIN": SaslServer._check_plain,
    "EXTERNAL": SaslServer._check_external,
}
