"""Micro-benchmark for JMS selectors: field extraction + matching per message, and the
compile time (prints numbers; not a test).

Run: .venv/bin/python scripts/bench_selector.py
"""

from __future__ import annotations

import functools
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

from proton import Message, byte, symbol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from amqbroker.core.selector import compile_selector
from amqbroker.protocol.selector_fields import extractor


def _message() -> bytes:
    """A JMS TextMessage as Qpid JMS sends it, with 5 application properties."""
    return bytes(
        Message(
            durable=True,
            annotations={symbol("x-opt-jms-msg-type"): byte(5), symbol("x-opt-jms-dest"): byte(0)},
            id="ID:9c1e8a4e-2d3b-4a57-8f25-0123456789ab:1:1:1-1",
            address="orders",
            creation_time=1700000000.123,
            group_id="order-12345",
            group_sequence=3,
            properties={
                "customer": "acme",
                "amount": 12,
                "region": "emea",
                "color": "red",
                "weight": 42,
            },
            body="hello world, this is a typical JMS TextMessage body",
        ).encode()
    )


CASES = {
    "(a) color = 'red' AND weight > 10": "color = 'red' AND weight > 10",
    "(b) JMSXGroupID LIKE 'order-1%'": "JMSXGroupID LIKE 'order-1%'",
    "(c) field not present": "missing = 'x'",
    "(d) IN + BETWEEN + OR": (
        "region IN ('apac', 'emea') AND (amount BETWEEN 10 AND 20 OR JMSPriority > 6)"
    ),
}


def _best(fn: Callable[[], object], number: int) -> float:
    """Best of 5 runs, in microseconds per call."""
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def _both(
    match: Callable[[dict[str, object]], bool],
    ex: Callable[[bytes], dict[str, object]],
    data: bytes,
) -> bool:
    return match(ex(data))


def main() -> None:
    data = _message()
    print(f"message: {len(data)} bytes, 5 application properties\n")
    print(f"{'selector':44} {'compile':>9} {'extract':>9} {'match':>8} {'both':>8}  (us)")
    for label, text in CASES.items():
        sel = compile_selector(text)
        ex = extractor(sel.identifiers)
        fields = ex(data)
        match = sel.matches
        assert match(fields) == (label[1] != "c"), (label, fields)
        t_compile = _best(functools.partial(compile_selector, text), 200)
        t_extract = _best(functools.partial(ex, data), 100_000)
        t_match = _best(functools.partial(match, fields), 200_000)
        t_both = _best(functools.partial(_both, match, ex, data), 100_000)
        print(f"{label:44} {t_compile:9.1f} {t_extract:9.2f} {t_match:8.3f} {t_both:8.2f}")


if __name__ == "__main__":
    main()
