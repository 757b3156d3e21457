"""Micro-benchmark for amqbroker.protocol.scanner (prints numbers; not a test).

Run: .venv/bin/python scripts/bench_scanner.py
"""

from __future__ import annotations

import sys
import timeit
import uuid
from pathlib import Path
from typing import Any

from proton import Message, byte, symbol, timestamp, ulong

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from amqbroker.protocol import scanner


def _messages() -> dict[str, bytes]:
    msgs: dict[str, bytes] = {}
    # 100 bytes: header (durable) + one data section, as a non-proton client sends it
    msgs["header + data"] = bytes.fromhex("005370c0020141005375a058") + b"x" * 88
    # proton adds an empty properties section
    msgs["header + props + data (proton)"] = bytes(
        Message(body=b"x" * 80, durable=True, inferred=True).encode()
    )
    ann = {symbol("x-opt-jms-msg-type"): byte(5), symbol("x-opt-jms-dest"): byte(0)}

    def jms(**kw: Any) -> bytes:
        args: dict[str, Any] = {
            "durable": True,
            "annotations": ann,
            "id": "ID:9c1e8a4e-2d3b-4a57-8f25-0123456789ab:1:1:1-1",
            "address": "orders",
            "creation_time": 1700000000.123,
            "properties": {"JMSXDeliveryCount": 0, "customer": "acme", "amount": 12},
            "body": "hello world, this is a typical JMS TextMessage body",
        }
        args.update(kw)
        return bytes(Message(**args).encode())

    msgs["JMS text, no group"] = jms()
    # Qpid JMS sends the delivery time as a long; other clients as a timestamp
    msgs["JMS text, delivery-time (long)"] = jms(
        annotations={**ann, symbol("x-opt-delivery-time"): 1700000060123}
    )
    msgs["JMS text, delivery-time (timestamp)"] = jms(
        annotations={**ann, symbol("x-opt-delivery-time"): timestamp(1700000060123)}
    )
    msgs["JMS text, delivery-delay"] = jms(
        annotations={**ann, symbol("x-opt-delivery-delay"): 5000}
    )
    msgs["JMS text, properties.group-id"] = jms(group_id="customer-42", group_sequence=7)
    msgs["JMS text, JMSXGroupID fallback"] = jms(
        properties={"JMSXGroupID": "customer-42", "JMSXGroupSeq": 7, "customer": "acme"}
    )
    big = Message(
        id=uuid.uuid4(),
        address="q",
        durable=True,
        priority=7,
        ttl=30.0,
        delivery_count=2,
        annotations={symbol(f"x-{i}"): ulong(i) for i in range(20)},
        properties={f"key-{i}": f"value-{i}" for i in range(50)},
        body=b"y" * 4000,
        inferred=True,
    )
    msgs["4 KB, 20 annotations, 50 props"] = big.encode()
    return msgs


def _bench(label: str, fn: Any, number: int) -> float:
    t = min(timeit.repeat(fn, number=number, repeat=7))
    us = t / number * 1e6
    print(f"  {label:<42} {us:8.2f} us/call")
    return us


def main() -> None:
    msgs = _messages()
    scan = scanner.scan
    print("scan()")
    for label, data in msgs.items():
        _bench(f"{label} ({len(data)} B)", lambda d=data: scan(d), 100_000)
    print("proton.Message.decode() for comparison")
    for label, data in msgs.items():
        _bench(f"{label} ({len(data)} B)", lambda d=data: Message().decode(d), 10_000)
    jms = msgs["JMS text, no group"]
    print("slow path (JMS text message)")
    _bench("set_delivery_count", lambda: scanner.set_delivery_count(jms, 3), 20_000)
    _bench(
        "add_message_annotations (2 keys)",
        lambda: scanner.add_message_annotations(
            jms, {"x-opt-dlq-reason": "expired", "x-opt-delivery-count": 5}
        ),
        20_000,
    )
    _bench(
        "add_application_property",
        lambda: scanner.add_application_property(jms, "_AMQ_GROUP_FIRST", True),
        20_000,
    )
    _bench("message_id", lambda: scanner.message_id(jms), 20_000)
    _bench("jms_dest", lambda: scanner.jms_dest(jms), 20_000)
    _bench("application_properties", lambda: scanner.application_properties(jms), 20_000)


if __name__ == "__main__":
    main()
