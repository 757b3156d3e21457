"""The delivery log's Parquet side in a child process (issue 22).

Building Arrow columns from Python tuples holds the GIL (about 0.8 µs per record),
and Parquet/zstd encoding takes a core: in the broker's process both competed with
the event loop. With ``delivery_log_format = parquet`` the broker's writer thread
only serialises a batch with `marshal` (C speed) and sends it over a pipe to this
process, which turns it into columns and appends it to the file
(`DeliveryLogWriter.write_batch`, the same code as in-process).

Protocol (the parent is `ChildWriter`): frames of a 4-byte little-endian length and a
`marshal` payload, request then reply, one request in flight at a time (so the pipe
and this process hold at most one batch: a slow child blocks the broker's writer
thread, its buffer fills, and the overflow policy applies as before).

* ``("init", root, node, format, rotate_bytes, max_bytes)`` -> ``("ok", state)``:
  repairs what a dead child left (``.inprogress``), lists the closed files.
* ``("write", epochs, first seq, explicit seqs, rows)`` (a `Batch`) ->
  ``("ok", state)`` or ``("error", text, state)`` (after an error the current file
  is abandoned as in-process: published when it still closes cleanly, else
  deleted).
* ``("close",)`` -> ``("ok", state)``: publishes the current file.

state = (written, [(path, size), ...] of closed files, a file is open).

End of input (the broker stopped or died) publishes the current file and exits, so a
broker crash loses only what its buffer held; SIGINT/SIGTERM are ignored (the broker
directs the shutdown).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import marshal
import os
import signal
import struct
import sys
from pathlib import Path
from typing import IO, Any

_LEN = struct.Struct("<I")
#: the child's scheduling niceness, added to the broker's (lower priority)
CHILD_NICE = 10


def read_frame(f: IO[bytes]) -> Any:
    """One frame's object; EOFError at the end of input."""
    head = f.read(4)
    if len(head) < 4:
        raise EOFError
    (n,) = _LEN.unpack(head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return marshal.loads(data)


def write_frame(f: IO[bytes], obj: Any) -> None:
    data = marshal.dumps(obj)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def main() -> int:
    from amqbroker.store.delivery_log import Batch, DeliveryLogWriter

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # millions of short-lived tuples and no reference cycles: the cyclic collector
    # only costs time here (about 9 % of this process's CPU, measured)
    gc.disable()
    # background work: on a busy machine the broker's event loop and its clients go
    # first (the buffer and the overflow policy bound what waits meanwhile)
    with contextlib.suppress(OSError):
        os.nice(CHILD_NICE)
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s amqbroker.delivery_log_worker: %(message)s"
    )
    inp = sys.stdin.buffer
    out = sys.stdout.buffer
    w: DeliveryLogWriter | None = None

    def state() -> tuple[int, list[tuple[str, int]], bool]:
        assert w is not None
        return (w.written, [(str(p), n) for p, n in w._closed], w._cur is not None)

    while True:
        try:
            msg = read_frame(inp)
        except EOFError:
            break
        op = msg[0]
        if op == "init":
            _, root, node, file_format, rotate_bytes, max_bytes = msg
            w = DeliveryLogWriter(
                Path(root),
                file_format=file_format,
                rotate_bytes=rotate_bytes,
                max_bytes=max_bytes,
                clock=lambda: 0.0,
                message_id=lambda data: None,
                child=False,
            )
            w.attach(node)
            write_frame(out, ("ok", state()))
        elif op == "write":
            assert w is not None
            _, epochs, first_seq, explicit, rows = msg
            w._epochs = [tuple(e) for e in epochs]
            batch = Batch(rows)
            batch.first_seq = first_seq
            batch.explicit = [tuple(e) for e in explicit]
            try:
                w.write_batch(batch)
            except Exception as exc:
                w.abandon_file()
                write_frame(out, ("error", f"{type(exc).__name__}: {exc}", state()))
            else:
                write_frame(out, ("ok", state()))
        elif op == "close":
            assert w is not None
            try:
                w.close()
            except Exception as exc:
                write_frame(out, ("error", f"{type(exc).__name__}: {exc}", state()))
            else:
                write_frame(out, ("ok", state()))
        else:  # pragma: no cover - a bug in the parent
            write_frame(out, ("error", f"unknown request {op!r}", state()))
    if w is not None and w._cur is not None:
        w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
