"""What the core needs to know about message encoding, without importing proton.

The protocol layer provides the implementation (the section scanner's splice
functions); core tests can use `PlainCodec`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

Annotation = str | int | bool | None


class MessageCodec(Protocol):
    def annotate(self, data: bytes, annotations: Mapping[str, Annotation]) -> bytes:
        """A copy of the message with these message-annotations added/replaced."""
        ...

    def message_id(self, data: bytes) -> object:
        """properties.message-id, or None."""
        ...


class PlainCodec:
    """For core tests: leaves the bytes alone."""

    def annotate(self, data: bytes, annotations: Mapping[str, Annotation]) -> bytes:
        return data

    def message_id(self, data: bytes) -> object:
        return None
