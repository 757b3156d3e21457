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
* ``("write", epochs, first seq, explicit seqs, values)`` (a `Batch`: flat) ->
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
import subprocess
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from amqbroker.store.delivery_log import DeliveryLogWriter
    from amqbroker.store.delivery_log_batch import Batch

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
    write_bytes(f, marshal.dumps(obj))


def write_bytes(f: IO[bytes], data: bytes) -> None:
    """One frame of an already serialised payload."""
    f.write(_LEN.pack(len(data)))
    f.write(data)
    f.flush()


def main() -> int:
    from amqbroker.store.delivery_log import DeliveryLogWriter
    from amqbroker.store.delivery_log_batch import Batch

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
            batch = Batch(rows, first_seq, [tuple(e) for e in explicit])
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


class ChildWriter:
    """The parent's end of `amqbroker.store.delivery_log_worker`: one request at a
    time, from the writer's worker thread (the reads and writes release the GIL)."""

    def __init__(self, w: DeliveryLogWriter) -> None:
        self._w = w
        self.file_open = False
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "amqbroker.store.delivery_log_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self.pid = self._proc.pid
        # the reply is read with the first request (the child imports pyarrow meanwhile)
        self._init_pending = True
        write_frame(
            self._stdin,
            ("init", str(w.root), w.node, w.format, w.rotate_bytes, w.max_bytes),
        )

    @property
    def _stdin(self) -> Any:
        return self._proc.stdin

    @property
    def _stdout(self) -> Any:
        return self._proc.stdout

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def _reply(self) -> None:
        msg = read_frame(self._stdout)
        written, closed, self.file_open = msg[-1]
        w = self._w
        w.written = self._written0 + written
        w._closed = [(Path(p), n) for p, n in closed]
        if msg[0] != "ok":
            raise OSError(msg[1])

    def _request(self, data: bytes) -> None:
        if self._init_pending:
            self._init_pending = False
            self._written0 = self._w.written
            self._reply()
        write_bytes(self._stdin, data)
        self._reply()

    def write(self, epochs: list[tuple[int, int]], batch: Batch) -> None:
        # a value marshal refuses raises ValueError before anything is sent; the
        # values list is the buffer itself, not a copy (see `Batch`)
        data = marshal.dumps(("write", epochs, batch.first_seq, batch.explicit, batch.values))
        self._request(data)

    def close(self) -> None:
        """Publish the current file and stop the child."""
        try:
            self._request(marshal.dumps(("close",)))
        finally:
            self.kill()

    def kill(self) -> None:
        """Close the pipes (the child publishes its file and exits at the end of its
        input); killed when it does not exit within the writer's `child_exit_timeout`
        seconds."""
        p = self._proc
        for f in (p.stdin, p.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()
        try:
            p.wait(timeout=self._w.child_exit_timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
