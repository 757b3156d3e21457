"""Errors the core raises, each carrying the AMQP condition it maps to, and the two
bases that say who is at fault.

The protocol layer turns a `BrokerError` into an AMQP error (condition + description)
once, at the edge. Descriptions are written for the person reading them in a client
log: what happened and what to do about it.

Who is at fault (as h11's RemoteProtocolError / LocalProtocolError): `PeerError` is
the peer's bad input (malformed bytes, an illegal frame, a failed login, a refused
WebSocket upgrade): the broker answers with the condition or outcome the subclass
carries, closes what it must and goes on; nothing in the broker is wrong, so it is
logged at info at most. `LocalError` is our own failure (a corrupt journal, a port we
cannot bind, a TLS or election setup that does not work): an operator must act. The
protocol exceptions derive from one of them besides their own family (the SASL
errors and `ScanError` from `PeerError`; `JournalError`, `CorruptRecord`,
`ListenError`, `TlsConfigError`, `ElectionUnavailable` from `LocalError`), so what
each `except` catches and the conditions sent are unchanged. `BrokerError` answers a
request and belongs to neither: a missing queue may be the client's typo or the
operator's configuration.
"""

from __future__ import annotations


class PeerError(Exception):
    """The peer sent something we cannot accept: its fault, not ours."""


class LocalError(Exception):
    """The broker itself failed (disk, configuration, environment): ours to fix."""


class BrokerError(Exception):
    condition = "amqp:internal-error"

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self.description = description


class NotFound(BrokerError):
    condition = "amqp:not-found"


class Unauthorized(BrokerError):
    condition = "amqp:unauthorized-access"


class ResourceLimitExceeded(BrokerError):
    condition = "amqp:resource-limit-exceeded"


class PreconditionFailed(BrokerError):
    condition = "amqp:precondition-failed"


class NotImplementedFeature(BrokerError):
    condition = "amqp:not-implemented"


class InvalidField(BrokerError):
    condition = "amqp:invalid-field"
