"""The core's `MessageCodec`, implemented with the section scanner's splice helpers."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from amqbroker.core.codec import Annotation
from amqbroker.protocol import scanner

log = logging.getLogger(__name__)


class ScannerCodec:
    def annotate(self, data: bytes, annotations: Mapping[str, Annotation]) -> bytes:
        try:
            return scanner.add_message_annotations(data, annotations)
        except scanner.ScanError as exc:
            log.warning("cannot annotate a message (%s); it is moved as received", exc)
            return data

    def message_id(self, data: bytes) -> object:
        try:
            return scanner.message_id(data)
        except scanner.ScanError:
            return None
