"""Rewrite the queue settings' comments in config/amqbroker.toml from the table
(amqbroker/core/queue_settings.py): each setting's doc, default and commented-out key.
A setting the file lacks is added after the one before it in the table.

Run: .venv/bin/python scripts/sync_queue_settings.py [--check]
(--check: change nothing, exit 1 when the file is out of date)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from amqbroker.core.queue_settings import sync_example_config

EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "amqbroker.toml"


def main() -> int:
    text = EXAMPLE.read_text(encoding="utf-8")
    synced = sync_example_config(text)
    if synced == text:
        print(f"{EXAMPLE}: up to date")
        return 0
    if "--check" in sys.argv[1:]:
        print(f"{EXAMPLE}: out of date; run scripts/sync_queue_settings.py")
        return 1
    EXAMPLE.write_text(synced, encoding="utf-8")
    print(f"{EXAMPLE}: rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
