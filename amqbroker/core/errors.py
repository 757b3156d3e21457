"""Errors the core raises, each carrying the AMQP condition it maps to.

The protocol layer turns a `BrokerError` into an AMQP error (condition + description)
once, at the edge. Descriptions are written for the person reading them in a client
log: what happened and what to do about it.
"""

from __future__ import annotations


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
