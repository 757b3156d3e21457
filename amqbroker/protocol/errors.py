"""Errors shared by both ends of the protocol layer.

`ManagementError` is the one error of the `$management` node, on either side of it:
the node (`amqbroker.protocol.management`) raises it to answer a request with that
`status` (an HTTP-style statusCode) and description; the CLI's client
(`amqbroker.tools.management_client`) raises its subclass `RequestFailed` when an
answer is not 2xx, or when no answer came (its status is then None). So code that reads a
management result catches one class, whichever side produced it.

Who is at fault (the peer's bad input vs. our own failure) is said by the bases in
`amqbroker.core.errors` (`PeerError`, `LocalError`), which the protocol exceptions
(the SASL family, `ScanError`) derive from.

This module imports nothing of the broker, so the client tools can import it without
pulling in the server side.
"""

from __future__ import annotations


class ManagementError(Exception):
    """A management request that did not succeed: `status` and a description a
    person can act on."""

    def __init__(self, status: int, description: str) -> None:
        super().__init__(description)
        self.status = status
        self.description = description
