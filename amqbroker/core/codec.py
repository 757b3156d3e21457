"""What the core needs to know about message encoding, without importing proton.

The protocol layer provides the implementation (the section scanner's splice
functions); core tests can use `PlainCodec`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from amqbroker.core.entry import Entry

Annotation = str | int | bool | None


class MessageCodec(Protocol):
    def annotate(self, data: bytes, annotations: Mapping[str, Annotation]) -> bytes:
        """A copy of the message with these message-annotations added/replaced."""
        ...

    def message_id(self, data: bytes) -> object:
        """properties.message-id, or None."""
        ...

    def duplicate_id(self, data: bytes) -> Hashable | None:
        """The id duplicate detection compares: application property _AMQ_DUPL_ID
        when present, else properties.message-id; None when neither (or malformed)."""
        ...

    def selector_filter(self, selector: str) -> Callable[[Entry], bool]:
        """A compiled JMS selector as a filter on messages (raises
        `amqbroker.core.selector.SelectorError` for an invalid selector)."""
        ...

    def destination_routing(self, data: bytes) -> str | None:
        """The routing type a message names for its destination (anycast for a
        queue, multicast for a topic), or None."""
        ...


class PlainCodec:
    """For core tests: leaves the bytes alone."""

    def annotate(self, data: bytes, annotations: Mapping[str, Annotation]) -> bytes:
        return data

    def message_id(self, data: bytes) -> object:
        return None

    def duplicate_id(self, data: bytes) -> Hashable | None:
        return None

    def selector_filter(self, selector: str) -> Callable[[Entry], bool]:
        from amqbroker.core.selector import compile_selector

        sel = compile_selector(selector)
        # core tests' messages carry no decodable fields: every identifier is NULL
        return lambda e: sel.matches({})

    def destination_routing(self, data: bytes) -> str | None:
        return None
