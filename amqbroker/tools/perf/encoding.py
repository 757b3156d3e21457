"""The messages the load client sends, hand-encoded (no Proton on this path).

A message is [header durable=true] [properties with group-id] [application-properties
kind='load', n=<index> for --selector/--app-props runs] and a data section whose first
32 bytes are the payload head `PAYLOAD`: a magic, the CLOCK_MONOTONIC send time (ns),
the producer, the message index, the group (NO_GROUP when ungrouped) and the group
sequence. Consumers find the head at the tail of the received bytes (the body is the
message's last section), so they measure latency and check group order without
decoding anything. Also the coordinator bodies of --txn-batch (Declare, Discharge).
"""

from __future__ import annotations

import struct

# ----------------------------------------------------------------------------- payload

MAGIC = 0x31465245_50514D41  # "AMQPERF1" little-endian
#: magic, send time (CLOCK_MONOTONIC ns), producer, message index, group, group sequence
PAYLOAD = struct.Struct("<QqIIII")
MIN_SIZE = PAYLOAD.size
NO_GROUP = 0xFFFFFFFF

#: header section {durable: true}
DURABLE_HEADER = b"\x00\x53\x70\xc0\x02\x01\x41"
#: properties section, list8 of 11 fields: 10 nulls then group-id as str8
_PROPS_HEAD = b"\x00\x53\x73\xc0"
_PROPS_NULLS = b"\x0b" + b"\x40" * 10 + b"\xa1"

#: application properties of --selector runs: kind='load' (str8), n=<message index> (long)
_APP_PROPS_FIXED = b"\xa1\x04kind\xa1\x04load"
N_FIELD = struct.Struct(">q")
#: offset of n's 8 value bytes in the section app_props() returns
APP_PROPS_N_OFFSET = 6 + len(_APP_PROPS_FIXED) + 4
DEFAULT_SELECTOR = "kind = 'load' AND n >= 0"
#: the JMS selector filter (Qpid JMS sends it under the key jms-selector)
SELECTOR_FILTER_KEY = "jms-selector"
SELECTOR_FILTER_CODE = 0x0000468C00000004
#: transactions (AMQP 1.0 part 4): declare, discharge, declared, transactional-state
TXN_DECLARE, TXN_DISCHARGE, TXN_DECLARED, TXN_STATE = 0x31, 0x32, 0x33, 0x34
#: amqp-value section holding a Declare with an empty field list
DECLARE_MESSAGE = b"\x00\x53\x77\x00\x53\x31\x45"


def discharge_message(txn_id: bytes, fail: bool = False) -> bytes:
    """amqp-value section holding Discharge [txn-id, fail]."""
    fields = b"\xa0%c%s%s" % (len(txn_id), txn_id, b"\x41" if fail else b"\x42")
    return b"\x00\x53\x77\x00\x53\x32\xc0%c\x02%s" % (len(fields) + 1, fields)


def data_section_head(size: int) -> bytes:
    """Descriptor and length of a data section of `size` bytes."""
    if size <= 255:
        return b"\x00\x53\x75\xa0" + bytes((size,))
    return b"\x00\x53\x75\xb0" + size.to_bytes(4, "big")


def group_id(g: int) -> bytes:
    return b"g%d" % g


def app_props(n: int) -> bytes:
    """The application-properties section of --selector/--app-props runs:
    {kind: 'load', n: <n as long>} (map8; n fixed-width, so a template is rewritten in
    place at APP_PROPS_N_OFFSET)."""
    body = _APP_PROPS_FIXED + b"\xa1\x01n\x81" + N_FIELD.pack(n)
    return b"\x00\x53\x74\xc1%c\x04%s" % (len(body) + 1, body)


def message_head(
    size: int, *, durable: bool = False, group: int | None = None, n: int | None = None
) -> bytes:
    """Everything of a message before its body's bytes: [header] [properties]
    [application-properties, when `n` is given] and the data section's descriptor and
    length."""
    head = DURABLE_HEADER if durable else b""
    if group is not None:
        gid = group_id(group)
        head += b"%s%c%s%c%s" % (_PROPS_HEAD, 13 + len(gid), _PROPS_NULLS, len(gid), gid)
    if n is not None:
        head += app_props(n)
    return head + data_section_head(size)


def encode_message(
    payload: bytes,
    size: int,
    *,
    durable: bool = False,
    group: int | None = None,
    n: int | None = None,
) -> bytes:
    """A complete bare message as the producers build it. `payload` is the packed
    32-byte head of the body; the rest of the body is padding."""
    head = message_head(size, durable=durable, group=group, n=n)
    return head + payload + b"x" * (size - len(payload))
