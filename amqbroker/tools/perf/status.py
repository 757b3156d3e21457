"""The status file shared by the orchestrator and its worker processes (mmap): one
`SLOT` of eight signed 64-bit fields per worker, written by the worker after every
loop pass, read by the orchestrator while it waits (no pipes, no locks: each slot has
one writer).
"""

from __future__ import annotations

import struct
import sys

#: status slot of a worker in the shared file: state, then role-specific counters
SLOT = struct.Struct("<8q")
ST_STARTING, ST_READY, ST_DONE, ST_STOPPED, ST_FAILED = 0, 1, 2, 3, -1
# producer: state, sent, acked, errors, not_accepted, t_first_send, t_last, 0
# consumer: state, received, ungrouped, errors, order_violations, t_first, t_last, t_last_ungrouped
F_STATE, F_COUNT, F_AUX, F_ERRORS, F_BAD, F_T_FIRST, F_T_LAST, F_T_AUX = range(8)

#: how the orchestrator starts this tool's own processes (workers, the null broker)
SELF = (sys.executable, "-m", "amqbroker.tools.perf")
