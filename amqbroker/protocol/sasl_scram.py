"""SCRAM-SHA-256 (RFC 5802, RFC 7677), server side: one exchange is one `Scram`.

The engine (`amqbroker.protocol.sasl.SaslServer`) makes a `Scram` for a sasl-init
choosing SCRAM-SHA-256 and calls it twice: `Scram.server_first` with the client-first
message (the sasl-init's initial response; the result is the sasl-challenge) and
`Scram.server_final` with the client-final message (the sasl-response; the result is
the additional-data of the ok sasl-outcome). Every refusal is an `AuthenticationFailed`
(`ChannelBindingNotSupported` for a client requiring channel binding), whose text
names the user and the problem.

Channel binding is not supported (SCRAM-SHA-256-PLUS is never offered): gs2 flag "n"
and "y" are accepted, "p=" is refused. An authzid ("a=") must equal the user name. A
user without a SCRAM credential, known or not, gets a complete exchange with fake
credentials (`Authenticator.scram_credentials`) and then auth, so the exchange does
not reveal who exists. User names are compared exactly (no SASLprep). The exchange
costs a few HMACs (`amqbroker.core.auth.scram_verify`); the client does the PBKDF2.

The engine module imports this one when a client first chooses SCRAM-SHA-256.
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING

from amqbroker.core.auth import scram_verify
from amqbroker.protocol.sasl import (
    SCRAM_SHA_256,
    AuthenticationFailed,
    ChannelBindingNotSupported,
    _clip,
)

if TYPE_CHECKING:
    from amqbroker.core.auth import Authenticator, ScramCredentials

__all__ = ["Scram"]


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


class Scram:
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
