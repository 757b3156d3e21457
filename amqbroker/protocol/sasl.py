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
- SCRAM-SHA-256 (`sasl_scram.Scram`): the client-first message must be the initial
  response. Channel binding is not supported (we never offer SCRAM-SHA-256-PLUS): gs2
  flag "n" and "y" are accepted, "p=" is refused. An authzid ("a=") must equal the user
  name. A user without a SCRAM credential, known or not, gets a complete exchange with fake
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

Modules: this one is the engine (the states, `TRANSITIONS`, the actions, the
exceptions and `SINGLE_STEP_MECHANISMS`); `sasl_frames` is the frame layout and
codec (`Input`, `Outcome`, the encoders and decoders, re-exported here);
`sasl_scram` is the SCRAM-SHA-256 server side.
"""

from __future__ import annotations

import enum
import secrets
import struct
from typing import TYPE_CHECKING, Final

from amqbroker.core.errors import PeerError
from amqbroker.protocol.sasl_frames import (
    AMQP_HEADER,
    FRAME_HEADER,
    MAGIC,
    SASL_FRAME_TYPE,
    SASL_HEADER,
    Init,
    Input,
    Outcome,
    Payload,
    Response,
    decode_body,
    decode_init,
    decode_response,
    encode_challenge,
    encode_mechanisms,
    encode_outcome,
    header_problem,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from amqbroker.core.auth import Authenticator
    from amqbroker.protocol.sasl_scram import Scram

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


class State(enum.Enum):
    AWAIT_HEADER = "AWAIT_HEADER"  # nothing received yet: expecting a protocol header
    AWAIT_INIT = "AWAIT_INIT"  # header and sasl-mechanisms sent: expecting sasl-init
    AWAIT_RESPONSE = "AWAIT_RESPONSE"  # sasl-challenge sent: expecting sasl-response
    DONE = "DONE"  # authenticated (or SASL skipped): everything is passthrough
    FAILED = "FAILED"  # send take_output() and close; input is discarded


_RUNNING: Final = frozenset({State.AWAIT_HEADER, State.AWAIT_INIT, State.AWAIT_RESPONSE})


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


def _clip(name: str, limit: int = _MAX_NAME_IN_ERROR) -> str:
    if len(name) > limit:
        name = name[:limit] + "..."
    return repr(name)


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
        self._scram: Scram | None = None
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
        self._actions: dict[Action, Callable[[Payload], State]] = {
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

    def _apply(self, kind: Input, payload: Payload) -> None:
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

    def _offer_mechanisms(self, _payload: Payload) -> State:
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

    def _skip_sasl(self, _payload: Payload) -> State:
        if not self._auth.anonymous_allowed:
            raise BadProtocolHeader(
                "client sent the AMQP header without SASL, but authentication is required"
            )
        self._passthrough += AMQP_HEADER
        self.user = ANONYMOUS_USER
        self.mechanism = None
        return State.DONE

    def _authenticate(self, payload: Payload) -> State:
        if not isinstance(payload, Init):  # the parser always decodes a sasl-init
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
            from amqbroker.protocol.sasl_scram import Scram  # it imports this module

            scram = Scram(self._auth, self._scram_nonce())
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

    def _verify_response(self, payload: Payload) -> State:
        if not isinstance(payload, Response) or self._scram is None:
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

    def _next_input(self) -> tuple[Input, Payload] | None:
        """The next complete input from the buffer (consumed), None if more bytes are needed."""
        buf = self._inbuf
        if self._state is State.AWAIT_HEADER:
            problem = header_problem(buf)
            if problem is not None:
                raise BadProtocolHeader(problem)
            if len(buf) < len(SASL_HEADER):
                return None
            header = bytes(buf[:8])
            del buf[:8]
            return (Input.SASL_HEADER if header == SASL_HEADER else Input.AMQP_HEADER), None
        # AWAIT_INIT, AWAIT_RESPONSE: SASL frames
        if buf[:4] == MAGIC:
            raise UnexpectedFrame("protocol header received where a SASL frame was expected")
        if len(buf) < 4:
            return None
        (size,) = struct.unpack_from(">I", buf)
        if size > self._max_frame:
            raise FrameTooLarge(f"SASL frame of {size} bytes exceeds max_frame {self._max_frame}")
        if size < FRAME_HEADER.size:
            raise MalformedFrame(f"frame size {size} is smaller than a frame header")
        if len(buf) < size:
            return None
        _, doff, frame_type, _channel = FRAME_HEADER.unpack_from(buf)
        if frame_type != SASL_FRAME_TYPE:
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
            kind, data = decode_body(body)
            payload: Payload = None  # decoded only where legal: else UnexpectedFrame says why
            if kind is Input.SASL_INIT and self._state is State.AWAIT_INIT:
                payload = decode_init(data)
            elif kind is Input.SASL_RESPONSE and self._state is State.AWAIT_RESPONSE:
                payload = decode_response(data)
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
