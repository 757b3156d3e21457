#!/usr/bin/env python3
"""Generate a large synthetic delivery log (Parquet or JSON lines, written in chunks)
for measuring the audit at scale:

    .venv/bin/python scripts/gen_delivery_log.py --events 10000000 --out /tmp/dl
    .venv/bin/amqbroker audit /tmp/dl --out /tmp/dl-report

The log is valid (every invariant holds) unless --lost N drops N accepted settles.
See tests/pipeline/logs.py (`write_bulk`) for its shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.pipeline.logs import write_bulk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--out", type=Path, required=True, help="directory (becomes delivery-log/)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--groups", type=int, default=10_000)
    ap.add_argument("--consumers", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=250_000, help="messages per file")
    ap.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    ap.add_argument("--lost", type=int, default=0, help="drop this many accepted settles")
    a = ap.parse_args()
    t0 = time.monotonic()
    stats = write_bulk(
        a.out / "delivery-log",
        a.events,
        nodes=a.nodes,
        groups=a.groups,
        consumers=a.consumers,
        chunk_messages=a.chunk,
        fmt_name=a.format,
        lost=a.lost,
    )
    stats["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
