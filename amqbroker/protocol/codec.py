"""The core's `MessageCodec`, implemented with the section scanner's splice helpers."""

from __future__ import annotations

from collections.abc import Mapping

from amqbroker.core.codec import Annotation
from amqbroker.protocol import scanner


class ScannerCodec:
    def annotate(self, data: bytes, annotations: Mapping[str, Annotation]) -> bytes:
        return scanner.add_message_annotations(data, annotations)

    def message_id(self, data: bytes) -> object:
        try:
            return scanner.message_id(data)
        except scanner.ScanError:
            return None
