"""The core's `MessageCodec`, implemented with the section scanner's splice helpers."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Mapping

from amqbroker.core.address import ANYCAST, MULTICAST
from amqbroker.core.codec import Annotation
from amqbroker.core.entry import Entry
from amqbroker.core.selector import compile_selector
from amqbroker.protocol import scanner
from amqbroker.protocol.selector_fields import extractor

#: x-opt-jms-dest values: queue, topic, temporary queue, temporary topic
_JMS_DEST_ROUTING = {0: ANYCAST, 1: MULTICAST, 2: ANYCAST, 3: MULTICAST}

log = logging.getLogger(__name__)

#: one extractor per identifier set, so that consumers whose selectors read the same
#: fields share the decoded fields cached on an entry
_extractor = functools.lru_cache(maxsize=256)(extractor)


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

    def duplicate_id(self, data: bytes) -> Hashable | None:
        try:
            return scanner.duplicate_id(data)
        except scanner.ScanError:
            return None

    def selector_filter(self, selector: str) -> Callable[[Entry], bool]:
        """Compile once; per message, decode only the sections the selector reads and
        cache them on the entry (consumers with the same selector share the work)."""
        sel = compile_selector(selector)
        extract = _extractor(sel.identifiers)
        match = sel.matches

        def fields_of(e: Entry) -> dict[str, object] | None:
            """The entry's decoded fields (cached), or None when undecodable."""
            cached = e.fields
            if cached is not None and cached[0] is extract:
                return cached[1]  # type: ignore[no-any-return]
            try:
                fields = extract(e.data)
            except scanner.ScanError:
                return None
            e.fields = (extract, fields)
            return fields

        if "JMSXDeliveryCount" not in sel.identifiers:

            def accepts(e: Entry) -> bool:
                fields = fields_of(e)
                return fields is not None and match(fields)

            return accepts

        def accepts_counted(e: Entry) -> bool:
            # the header in the stored bytes keeps the count it arrived with; the
            # entry has the current one (redeliveries)
            fields = fields_of(e)
            if fields is None:
                return False
            return match({**fields, "JMSXDeliveryCount": e.delivery_count + 1})

        return accepts_counted

    def destination_routing(self, data: bytes) -> str | None:
        return _JMS_DEST_ROUTING.get(scanner.jms_dest(data) or -1)
