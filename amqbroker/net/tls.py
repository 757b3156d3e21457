"""TLS for the amqps listeners: the server context, the accept-side handshake, and the
client identity.

Theory of operation
-------------------
`server_context` builds one `ssl.SSLContext` at start-up from the ``tls_*`` settings.
It checks each file on its own first (exists, readable, PEM of the right kind, the key
matches the certificate), so a bad file stops the broker with a `TlsConfigError` that
names the setting, the file and what to do, instead of OpenSSL's "PEM lib". An
encrypted private key is refused the same way (OpenSSL would otherwise prompt on the
terminal and hang a service).

A connection accepted on a TLS listener goes through `handshake` before any AMQP: the
socket is wrapped in trio's `SSLStream` (server side) and the handshake must finish by
the connection's handshake deadline (``handshake_timeout`` after the accept; the same
deadline then bounds SASL and the AMQP open). A failed or late handshake is logged once,
at INFO, with the peer and the reason, and closes only that socket; a refused one
first gets the TLS alert OpenSSL chose (protocol version, certificate required...),
which trio's SSLStream leaves unsent (`_send_alert`). The caller then runs
the connection on the stream with `amqbroker.net.driver.StreamDriver`.

The client identity is the subject of the client certificate OpenSSL verified against
``tls_ca_file`` (``tls_client_auth`` "optional" or "required"), as an RFC 4514 string
(last RDN first, e.g. ``CN=app,O=Example``; attribute types beyond RFC 4514's table use
OpenSSL's short names such as ``emailAddress``). It is None without a client
certificate.

Invariants: renegotiation is disabled (a client cannot make the broker redo the
expensive half of a handshake at will); the context never trusts the system's CA store
for client certificates, only ``tls_ca_file``; ``close_notify`` is neither required
nor sent (``https_compatible``): AMQP frames carry their own lengths and the AMQP close
frame is the end of the conversation, so a TLS-level truncation is seen as a lost
connection like a dropped TCP socket. The end of the broker's output is a TCP
half-close, as on the plain path (`StreamDriver`).
"""

from __future__ import annotations

import logging
import socket
import ssl
from pathlib import Path
from typing import Any, Literal

import trio

from amqbroker.core.errors import LocalError

log = logging.getLogger(__name__)

ClientAuth = Literal["none", "optional", "required"]
MinVersion = Literal["TLSv1.2", "TLSv1.3"]

_VERIFY_MODES: dict[str, ssl.VerifyMode] = {
    "none": ssl.CERT_NONE,
    "optional": ssl.CERT_OPTIONAL,
    "required": ssl.CERT_REQUIRED,
}
_VERSIONS: dict[str, ssl.TLSVersion] = {
    "TLSv1.2": ssl.TLSVersion.TLSv1_2,
    "TLSv1.3": ssl.TLSVersion.TLSv1_3,
}

#: RFC 4514's attribute type names, by the long names `SSLSocket.getpeercert` reports;
#: other types keep OpenSSL's short names (as ``openssl x509 -nameopt RFC2253`` shows)
_RFC4514_NAMES = {
    "commonName": "CN",
    "localityName": "L",
    "stateOrProvinceName": "ST",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "streetAddress": "STREET",
    "domainComponent": "DC",
    "userId": "UID",
    "surname": "SN",
    "givenName": "GN",
}


class TlsConfigError(LocalError):
    """A TLS file or setting cannot be used; the message names the setting and the fix."""


# ---------------------------------------------------------------------------- context


def _read_pem(setting: str, path: str) -> str:
    where = f'{setting} = "{path}"'
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise TlsConfigError(f"{where}: the file does not exist; check the path") from None
    except IsADirectoryError:
        raise TlsConfigError(f"{where}: is a directory, not a PEM file") from None
    except PermissionError:
        raise TlsConfigError(
            f"{where}: permission denied; let the broker's user read the file"
        ) from None
    except OSError as exc:
        raise TlsConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise TlsConfigError(
            f"{where}: not a PEM file (binary content; a DER file? convert it with "
            "`openssl x509 -inform der -in FILE -out FILE.pem`)"
        ) from None


def _check_certificates(setting: str, path: str, what: str) -> None:
    """`path` holds at least one PEM certificate OpenSSL can parse."""
    text = _read_pem(setting, path)
    where = f'{setting} = "{path}"'
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise TlsConfigError(f"{where}: no PEM certificate in it (expected {what})")
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        probe.load_verify_locations(cadata=text)
    except ssl.SSLError as exc:
        raise TlsConfigError(
            f"{where}: a certificate in it is damaged ({exc.reason or exc}); expected {what}"
        ) from None


def _refuse_encrypted_key() -> str:
    raise TlsConfigError("encrypted")


def server_context(
    *,
    cert_file: str,
    key_file: str,
    ca_file: str = "",
    client_auth: ClientAuth = "none",
    min_version: MinVersion = "TLSv1.2",
) -> ssl.SSLContext:
    """The server context for the TLS listeners; `TlsConfigError` names what is wrong."""
    if not cert_file:
        raise TlsConfigError("tls_cert_file is not set; a TLS listener needs a certificate")
    if not key_file:
        raise TlsConfigError("tls_key_file is not set; a TLS listener needs a private key")
    _check_certificates("tls_cert_file", cert_file, "the broker's certificate (and its chain), PEM")
    key_text = _read_pem("tls_key_file", key_file)
    key_where = f'tls_key_file = "{key_file}"'
    if "PRIVATE KEY-----" not in key_text:
        raise TlsConfigError(f"{key_where}: no PEM private key in it")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[min_version]
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    try:
        ctx.load_cert_chain(cert_file, key_file, password=_refuse_encrypted_key)
    except TlsConfigError:
        raise TlsConfigError(
            f"{key_where}: the private key is encrypted with a passphrase; give the broker "
            "an unencrypted key (`openssl pkey -in KEY -out PLAIN`) readable only by its "
            "user"
        ) from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TlsConfigError(
                f'{key_where}: the key does not belong to the certificate in tls_cert_file = "'
                f'{cert_file}"; configure the matching pair'
            ) from None
        raise TlsConfigError(
            f"{key_where}: the private key cannot be read ({exc.reason or exc}); expected "
            "an unencrypted PEM private key"
        ) from None
    ctx.verify_mode = _VERIFY_MODES[client_auth]
    if client_auth != "none":
        if not ca_file:
            raise TlsConfigError(
                f'tls_client_auth = "{client_auth}" needs tls_ca_file, the CA certificates '
                "client certificates are verified against"
            )
        _check_certificates("tls_ca_file", ca_file, "CA certificates, PEM")
        ctx.load_verify_locations(cafile=ca_file)
    return ctx


# -------------------------------------------------------------------------- handshake


def subject_rfc4514(cert: dict[str, Any]) -> str | None:
    """The subject of a certificate as `SSLSocket.getpeercert` decodes it, RFC 4514."""
    rdns = cert.get("subject")
    if not rdns:
        return None
    parts = []
    for rdn in reversed(rdns):
        parts.append("+".join(f"{_RFC4514_NAMES.get(k, k)}={_escape(v)}" for k, v in rdn))
    return ",".join(parts)


def _escape(value: str) -> str:
    out = []
    for i, ch in enumerate(value):
        if ch in '"+,;<>\\' or (ch == "#" and i == 0):
            out.append("\\" + ch)
        elif ch == " " and (i == 0 or i == len(value) - 1):
            out.append("\\ ")
        elif ch == "\0":
            out.append("\\00")
        else:
            out.append(ch)
    return "".join(out)


def _reason(exc: BaseException | None) -> str:
    """A handshake failure in words, with a hint when the cause is a usual one."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"client certificate rejected: {exc.verify_message} (not signed by tls_ca_file?)"
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or ""
        if reason in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL"):
            return (
                f"{reason}: the client did not speak TLS (a plain amqp:// client on an "
                "amqps:// listener?)"
            )
        if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return (
                "the client sent no certificate and tls_client_auth is required; give the "
                "client a certificate signed by a CA in tls_ca_file"
            )
        if reason in ("UNSUPPORTED_PROTOCOL", "TLSV1_ALERT_PROTOCOL_VERSION"):
            return f"{reason}: the client's TLS versions are below tls_min_version"
        if reason in ("NO_SHARED_CIPHER", "NO_SUITABLE_SIGNATURE_ALGORITHM"):
            return f"{reason}: the client offered no cipher the broker accepts"
        return reason or str(exc)
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if exc is None:
        return "the client closed the connection"
    return str(exc) or type(exc).__name__


def _send_alert(stream: trio.SSLStream[trio.SocketStream], sock: socket.socket) -> None:
    """Send the alert OpenSSL wrote when it refused the handshake (protocol version,
    certificate required, unknown CA...), so the client can say why instead of
    "unexpected EOF". trio's SSLStream raises before sending what the failed step left
    in its outgoing buffer; an alert is a few dozen bytes, so one non-blocking send
    into the empty socket buffer takes it. Then a TCP half-close, and the input that
    has already arrived is read, so closing the socket sends a FIN after the alert
    rather than a reset that could make the client drop it. Best effort: any socket
    error just ends it."""
    outgoing = getattr(stream, "_outgoing", None)  # the stream's ssl.MemoryBIO
    if not isinstance(outgoing, ssl.MemoryBIO):
        return
    alert = outgoing.read()
    try:
        if alert:
            sock.send(alert)
        sock.shutdown(socket.SHUT_WR)
        for _ in range(16):  # bounded: a peer that keeps sending gets the reset
            if not sock.recv(65536):
                break
    except OSError:
        pass


async def handshake(
    sock: socket.socket,
    context: ssl.SSLContext,
    *,
    peer: str,
    deadline: float,
    handshake_timeout: float,
) -> tuple[trio.SSLStream[trio.SocketStream], str | None] | None:
    """The server side of the TLS handshake on an accepted socket, by `deadline`
    (trio time; `handshake_timeout` is only for the message). Returns the stream and the client
    identity, or None after logging why (the socket is then closed)."""
    tsock = trio.socket.from_stdlib_socket(sock)
    stream = trio.SSLStream(
        trio.SocketStream(tsock), context, server_side=True, https_compatible=True
    )
    handed_over = False
    reason: str | None = None
    try:
        with trio.move_on_at(deadline):
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError as exc:
                reason = _reason(exc.__cause__)
                if isinstance(exc.__cause__, ssl.SSLError):
                    _send_alert(stream, sock)
            else:
                cert = stream.getpeercert()
                identity = subject_rfc4514(cert) if cert else None
                handed_over = True
                return stream, identity
    finally:
        if not handed_over:  # failed, late or cancelled (shutdown): close it now
            tsock.close()
    if reason is None:
        reason = f"not finished within handshake_timeout ({handshake_timeout:.1f} s)"
    log.info("TLS handshake with %s failed: %s; connection closed", peer, reason)
    return None


def client_context(ca_file: str = "") -> ssl.SSLContext:
    """The context of the broker's own outbound TLS connections (cluster peers, an HA
    backup's link to the live member): the peer's certificate is verified against
    `ca_file` (PEM; "" = the system's CAs) and must name the host connected to;
    `TlsConfigError` names what is wrong with the file."""
    if ca_file:
        _check_certificates("cluster_tls_ca_file", ca_file, "CA certificates, PEM")
    ctx = ssl.create_default_context(cafile=ca_file or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION
    return ctx
