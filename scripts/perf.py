#!/usr/bin/env python3
"""amqbroker's benchmark, kept under its old name: a thin wrapper around `amqbroker perf`.

The load client lives in the package (amqbroker/tools/perf/, see its docstring for
the scenarios, options and what is measured); this script runs it unchanged, so
existing commands keep working::

    .venv/bin/python scripts/perf.py --start-broker --scenario A,C,D,E,L
    .venv/bin/python scripts/perf.py --port 5672 --producers 1 --consumers 4 --groups 1000
    .venv/bin/python scripts/perf.py --report ours=a.jsonl peer=b.jsonl
"""

from __future__ import annotations

import sys

from amqbroker.tools.perf import main

if __name__ == "__main__":
    sys.exit(main())
