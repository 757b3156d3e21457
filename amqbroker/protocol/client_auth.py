"""The client side of TLS and SASL for the CLI's connections (`management_client.connect`).

Theory of operation
-------------------
The PyPI Proton wheel has no Cyrus SASL, so as a client it speaks ANONYMOUS, PLAIN and
EXTERNAL but not SCRAM-SHA-256. For SCRAM, and for every ``amqps://`` connection (so
that all TLS connections are checked by one TLS implementation, the stdlib's, with
the same messages), this module opens the connection itself, in front of Proton:

1. a TCP socket to the URL's host and port;
2. for ``amqps://``: TLS with `ssl` (`ClientSecurity.ca_file` or the system's CAs;
   the broker's certificate must name the URL's host; `cert_file`/`key_file` present
   a client certificate);
3. the SASL exchange (part 5.3 of AMQP 1.0, as the broker's `protocol.sasl` sees it
   from the other side): our SASL header, the broker's header and sasl-mechanisms,
   our sasl-init and, for SCRAM, one challenge/response round, then the sasl-outcome
   (`authenticate`; the SCRAM arithmetic is `ScramClient`, RFC 5802 / RFC 7677);
4. the authenticated stream is handed to a Proton `Container` whose I/O handler adopts
   it (`AdoptingIOHandler`) instead of connecting itself; the Proton connection runs
   without a SASL or SSL layer and starts with the plain AMQP header. A plain socket is
   adopted as is; a TLS socket through `TlsBridge`, a thread that carries bytes
   between it and one end of a socket pair (Proton gets the other end), because
   Proton's reactor selects on file descriptors and cannot see what `ssl` buffers.

Every failure is a `ClientAuthError` whose text says what went wrong and whose `hint`
says what to change; `refused` marks a login the broker refused (sasl-outcome auth).

Invariants: nothing of AMQP is sent before a successful sasl-outcome (and, for SCRAM,
before the broker proved that it knows the password: the server signature must
verify); a socket is either handed over (adopted, or owned by the bridge) or closed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import secrets
import select
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Any

import proton
from proton.handlers import IOHandler

from amqbroker.core.auth import MAX_ITERATIONS, saslprep
from amqbroker.protocol.sasl import SCRAM_SHA_256, SaslError
from amqbroker.protocol.sasl_frames import (
    FRAME_HEADER,
    SASL_HEADER,
    Input,
    Outcome,
    decode_body,
    encode_frame,
)

MECHANISMS = ("PLAIN", SCRAM_SHA_256, "EXTERNAL", "ANONYMOUS")
_MAX_FRAME = 65536
_SASL_INIT, _SASL_RESPONSE = 0x41, 0x43
_CREDENTIALS_HINT = "check --user/--password (AMQBROKER_USER, AMQBROKER_PASSWORD)"
_TLS_HINT = (
    "check the URL (a TLS listener?) and --ca-file, --cert-file, --key-file "
    "(AMQBROKER_CA_FILE, AMQBROKER_CERT_FILE, AMQBROKER_KEY_FILE)"
)


@dataclass(frozen=True)
class ClientSecurity:
    """How a client secures its connection beyond user and password.

    `mechanism` None picks PLAIN with a user, EXTERNAL with a client certificate, else
    ANONYMOUS. `cert_file` may hold the key too (then `key_file` is not needed).
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    mechanism: str | None = None

    def choose_mechanism(self, user: str | None) -> str:
        if self.mechanism:
            return self.mechanism.upper()
        if user:
            return "PLAIN"
        return "EXTERNAL" if self.cert_file else "ANONYMOUS"

    @property
    def uses_tls_files(self) -> bool:
        return bool(self.ca_file or self.cert_file or self.key_file)


class ClientAuthError(Exception):
    """TLS or SASL failed; `hint` says what to change, `refused` that the login was refused."""

    def __init__(self, reason: str, hint: str | None = None, *, refused: bool = False) -> None:
        self.reason = reason
        self.hint = hint
        self.refused = refused
        super().__init__(reason)


# --------------------------------------------------------------------- SCRAM-SHA-256


def _hmac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, "sha256").digest()


def _saslname(name: str) -> str:
    return name.replace("=", "=3D").replace(",", "=2C")


class ScramClient:
    """One SCRAM-SHA-256 exchange, client side (RFC 5802 section 3), without channel
    binding (GS2 flag "n"): `client_first`, `client_final(server_first)`, then
    `verify_server_final(server_final)`. Problems raise `ClientAuthError`."""

    def __init__(self, user: str, password: str, nonce: str | None = None) -> None:
        try:
            self._password = saslprep(password, allow_unassigned=True)
        except ValueError as exc:
            raise ClientAuthError(
                f"the password cannot be used with {SCRAM_SHA_256}: {exc}", _CREDENTIALS_HINT
            ) from None
        self._nonce = nonce or secrets.token_urlsafe(24)
        self._bare = f"n={_saslname(user)},r={self._nonce}"
        self._server_signature: bytes | None = None

    def client_first(self) -> bytes:
        return ("n,," + self._bare).encode("utf-8")

    def client_final(self, server_first: bytes) -> bytes:
        try:
            text = server_first.decode("utf-8")
        except UnicodeDecodeError:
            raise self._bad("its first message is not UTF-8") from None
        fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        if "m" in fields or text.startswith("e="):
            raise self._bad(f"it answered {text[:80]!r}")
        nonce, salt_text, iterations_text = fields.get("r"), fields.get("s"), fields.get("i")
        if nonce is None or salt_text is None or iterations_text is None:
            raise self._bad("its first message lacks r=, s= or i=")
        if not nonce.startswith(self._nonce) or len(nonce) == len(self._nonce):
            raise self._bad("its nonce does not extend ours")
        try:
            salt = base64.b64decode(salt_text, validate=True)
            iterations = int(iterations_text)
        except ValueError:
            raise self._bad("its salt or iteration count is malformed") from None
        if not 1 <= iterations <= MAX_ITERATIONS:
            raise self._bad(f"iteration count {iterations} is out of range")
        salted = hashlib.pbkdf2_hmac("sha256", self._password.encode("utf-8"), salt, iterations)
        client_key = _hmac(salted, b"Client Key")
        without_proof = f"c={base64.b64encode(b'n,,').decode()},r={nonce}"
        auth_message = f"{self._bare},{text},{without_proof}".encode()
        signature = _hmac(hashlib.sha256(client_key).digest(), auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        self._server_signature = _hmac(_hmac(salted, b"Server Key"), auth_message)
        return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()

    def verify_server_final(self, server_final: bytes | None) -> None:
        """The broker's proof that it knows the password (the additional-data of an ok
        sasl-outcome)."""
        expected = self._server_signature
        text = (server_final or b"").decode("utf-8", "replace")
        if expected is None or not text.startswith("v="):
            raise self._bad("it did not send its signature (v=)")
        try:
            got = base64.b64decode(text[2:], validate=True)
        except ValueError:
            raise self._bad("its signature is not base64") from None
        if not hmac.compare_digest(got, expected):
            raise ClientAuthError(
                f"{SCRAM_SHA_256}: the broker's signature is wrong: it does not know this "
                "user's key (not the broker you meant, or a man in the middle)",
                "check the URL",
            )

    @staticmethod
    def _bad(problem: str) -> ClientAuthError:
        return ClientAuthError(
            f"{SCRAM_SHA_256}: the broker's answer is unusable: {problem}", "check the URL"
        )


# -------------------------------------------------------------------- SASL exchange


class _Frames:
    """Reads a protocol header and SASL frames from a blocking socket (exact reads:
    nothing after the sasl-outcome is consumed, the broker sends nothing before our
    AMQP header anyway)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ClientAuthError(
                    "the broker closed the connection during SASL"
                    + (" (it sent nothing: is this an AMQP port?)" if not buf else ""),
                    refused=False,
                )
            buf += chunk
        return bytes(buf)

    def frame(self) -> tuple[Input, list[Any]]:
        size, doff, ftype, _ = FRAME_HEADER.unpack(self.read(8))
        if ftype != 1 or size > _MAX_FRAME or doff < 2 or doff * 4 > size:
            raise ClientAuthError(f"the broker sent a malformed SASL frame (type {ftype})")
        rest = self.read(size - 8)
        try:
            kind, data = decode_body(rest[doff * 4 - 8 :])
        except SaslError as exc:
            raise ClientAuthError(f"the broker sent a malformed SASL frame: {exc}") from None
        fields: list[Any] = []
        while data.next() is not None:
            value = data.get_object()
            # a binary is a view into the Data's buffer: copy it while the Data lives
            fields.append(bytes(value) if isinstance(value, memoryview) else value)
        return kind, fields


def _init_frame(mechanism: str, response: bytes | None, hostname: str | None) -> bytes:
    def fill(data: proton.Data) -> None:
        data.put_symbol(mechanism)
        if response is None:
            data.put_null()
        else:
            data.put_binary(response)
        if hostname:
            data.put_string(hostname)

    return encode_frame(_SASL_INIT, fill)


def _response_frame(response: bytes) -> bytes:
    return encode_frame(_SASL_RESPONSE, lambda data: data.put_binary(response))


def authenticate(
    sock: socket.socket,
    *,
    mechanism: str,
    user: str | None,
    password: str | None,
    hostname: str | None,
) -> None:
    """Run the SASL exchange on a connected (blocking) socket; returns once the broker
    answered ok, raises `ClientAuthError` otherwise. The AMQP header is next."""
    who = f"user {user!r}" if user else "an anonymous login"
    if mechanism in ("PLAIN", SCRAM_SHA_256) and not user:
        raise ClientAuthError(f"{mechanism} needs a user", "give --user and --password")
    scram: ScramClient | None = None
    if mechanism == SCRAM_SHA_256:
        scram = ScramClient(user or "", password or "")
        initial: bytes | None = scram.client_first()
    elif mechanism == "PLAIN":
        initial = b"\0" + (user or "").encode() + b"\0" + (password or "").encode()
    elif mechanism == "EXTERNAL":
        initial = b""
        who = "the client certificate"
    else:
        initial = None
    frames = _Frames(sock)
    sock.sendall(SASL_HEADER)
    header = frames.read(8)
    if header != SASL_HEADER:
        raise ClientAuthError(
            f"the broker answered the SASL header with {header!r}",
            "is this an amqbroker (or another AMQP 1.0) port?",
        )
    kind, fields = frames.frame()
    if kind is not Input.SASL_MECHANISMS:
        raise ClientAuthError(f"the broker sent {kind.value} instead of its mechanisms")
    listed = fields[0] if fields else None
    if isinstance(listed, proton.Array):
        offered = [str(m) for m in listed.elements]
    else:  # a single symbol may stand for a one-element array
        offered = [str(listed)] if listed is not None else []
    if mechanism not in offered:
        raise ClientAuthError(
            f"the broker does not offer SASL {mechanism} here "
            f"(it offers: {', '.join(offered) or 'nothing'})",
            "choose one with --mechanism (AMQBROKER_MECHANISM)"
            + (
                "; EXTERNAL needs a client certificate (--cert-file) the broker verified"
                if mechanism == "EXTERNAL"
                else ""
            ),
        )
    sock.sendall(_init_frame(mechanism, initial, hostname))
    kind, fields = frames.frame()
    if kind is Input.SASL_CHALLENGE and scram is not None:
        sock.sendall(_response_frame(scram.client_final(bytes(fields[0] or b""))))
        kind, fields = frames.frame()
    if kind is not Input.SASL_OUTCOME:
        raise ClientAuthError(f"the broker sent {kind.value} where a sasl-outcome was due")
    code = int(fields[0])
    if code != Outcome.OK:
        if code == Outcome.AUTH:
            raise ClientAuthError(
                f"the broker refused {who} ({mechanism})",
                "check --cert-file and the broker's tls_identity_users"
                if mechanism == "EXTERNAL"
                else _CREDENTIALS_HINT,
                refused=True,
            )
        try:
            name = Outcome(code).name.lower()
        except ValueError:
            name = str(code)
        raise ClientAuthError(
            f"the broker ended SASL with code {name} ({mechanism}); its log says why"
        )
    if scram is not None:
        scram.verify_server_final(bytes(fields[1]) if len(fields) > 1 and fields[1] else None)


# ------------------------------------------------------------------------------ TLS


def tls_context(security: ClientSecurity) -> ssl.SSLContext:
    """Verify the broker (its certificate chains to `ca_file`, or the system's CAs, and
    names the host); present `cert_file` when given."""
    try:
        ctx = ssl.create_default_context(cafile=security.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ClientAuthError(
            f"cannot use --ca-file {security.ca_file}: {_os_reason(exc)}",
            "give a PEM file with the CA certificate(s) that signed the broker's",
        ) from None
    if security.key_file and not security.cert_file:
        raise ClientAuthError("--key-file without --cert-file", "give both (or neither)")
    if security.cert_file:
        try:
            ctx.load_cert_chain(security.cert_file, security.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ClientAuthError(
                f"cannot use --cert-file {security.cert_file}"
                + (f" / --key-file {security.key_file}" if security.key_file else "")
                + f": {_os_reason(exc)}",
                "give the PEM certificate and its unencrypted key (--key-file, unless the "
                "certificate file holds it)",
            ) from None
    return ctx


def _os_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def tls_failure(exc: ssl.SSLError) -> ClientAuthError:
    """A TLS error during the handshake or SASL as a reason and a hint."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ClientAuthError(
            f"TLS: the broker's certificate did not verify ({exc.verify_message.rstrip('.')})",
            "give the CA that signed it with --ca-file (AMQBROKER_CA_FILE), and a URL host "
            "that the certificate names",
        )
    reason = exc.reason or str(exc)
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
        return ClientAuthError(
            f"TLS: the broker did not answer in TLS ({reason})",
            "is this a TLS listener? use amqp:// for a plain one",
        )
    if "CERTIFICATE_REQUIRED" in reason or "HANDSHAKE_FAILURE" in reason:
        return ClientAuthError(
            f"TLS: the broker refused the connection ({reason})",
            "it wants a client certificate: --cert-file/--key-file "
            "(AMQBROKER_CERT_FILE, AMQBROKER_KEY_FILE)",
        )
    if "UNKNOWN_CA" in reason or "BAD_CERTIFICATE" in reason:
        return ClientAuthError(
            f"TLS: the broker refused our client certificate ({reason})",
            "use a certificate signed by a CA in the broker's tls_ca_file",
        )
    return ClientAuthError(f"TLS: {reason}", _TLS_HINT)


class TlsBridge:
    """Carries bytes between a TLS socket and `proton_end` (one end of a socket pair)
    in a daemon thread, until either side closes; then closes both of its sockets."""

    def __init__(self, tls: ssl.SSLSocket, timeout: float) -> None:
        self._tls = tls
        self._timeout = timeout
        near, self.proton_end = socket.socketpair()
        self._near = near
        self._thread = threading.Thread(target=self._run, name="amqbroker-tls", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        tls, near = self._tls, self._near
        tls.setblocking(False)
        try:
            while True:
                if tls.pending():
                    ready: list[Any] = [tls]
                else:
                    ready, _, _ = select.select([tls, near], [], [])
                if tls in ready:
                    try:
                        data = tls.recv(65536)
                    except ssl.SSLWantReadError:  # a partial record, or a ticket only
                        data = None
                    if data == b"":
                        return
                    if data:
                        near.sendall(data)
                if near in ready:
                    data = near.recv(65536)
                    if not data:
                        return
                    self._send_tls(data)
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError, ValueError):
                tls.unwrap()  # our close_notify (non-blocking: best effort)
            tls.close()
            near.close()

    def _send_tls(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self._tls.send(view) :]
            except ssl.SSLWantWriteError:
                if not select.select([], [self._tls], [], self._timeout)[1]:
                    raise TimeoutError("the broker does not read") from None
            except ssl.SSLWantReadError:
                if not select.select([self._tls], [], [], self._timeout)[0]:
                    raise TimeoutError("the broker does not answer") from None


# -------------------------------------------------------------- handing over to Proton


class AdoptingIOHandler(IOHandler):
    """Proton's I/O handler, except that the first connection bound to a transport
    uses `sock` (already connected and authenticated) instead of connecting itself.
    (Proton 0.40's own `on_connection_bound` / `ConnectSelectable` do the same steps.)"""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock: socket.socket | None = sock

    def on_connection_bound(self, event: Any) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            super().on_connection_bound(event)
            return
        transport = event.transport
        reactor = event.connection._reactor
        transport._reactor = reactor
        sock.setblocking(False)
        selectable = reactor.selectable(delegate=sock)
        selectable._transport = transport
        transport._selectable = selectable
        self.update(transport, selectable, reactor.now)


def open_authenticated(
    host: str,
    port: int,
    *,
    tls: bool,
    security: ClientSecurity,
    mechanism: str,
    user: str | None,
    password: str | None,
    timeout: float,
) -> socket.socket:
    """Connect, run TLS (when `tls`) and SASL; the socket Proton adopts next (it must
    start with the AMQP header). Raises `ClientAuthError` or `OSError` (the TCP connect)."""
    ctx = tls_context(security) if tls else None
    raw = socket.create_connection((host, port), timeout=timeout)
    sock: socket.socket = raw
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ctx is not None:
            try:
                sock = ctx.wrap_socket(raw, server_hostname=host)
            except ssl.SSLError as exc:
                raise tls_failure(exc) from None
        try:
            authenticate(sock, mechanism=mechanism, user=user, password=password, hostname=host)
        except ssl.SSLError as exc:  # TLS 1.3: the broker refuses a certificate late
            raise tls_failure(exc) from None
        except TimeoutError:
            raise ClientAuthError(f"no SASL answer within {timeout:g} s") from None
        except ConnectionError as exc:
            raise ClientAuthError(
                f"the broker closed the connection during SASL ({exc.strerror or exc})"
            ) from None
        if isinstance(sock, ssl.SSLSocket):
            bridge = TlsBridge(sock, timeout)
            bridge.start()
            return bridge.proton_end
        return sock
    except BaseException:
        sock.close()
        raise


__all__ = [
    "MECHANISMS",
    "AdoptingIOHandler",
    "ClientAuthError",
    "ClientSecurity",
    "ScramClient",
    "TlsBridge",
    "authenticate",
    "open_authenticated",
    "tls_context",
]
