"""The arbiter's decision log: every group binding decided, synced before the answer.

A small append-only file (`<data_dir>/cluster/decisions.log`) of CRC-framed records,
separate from the message journal: `u32 length, u32 crc32, JSON payload`. A payload is
one `Decision`: `bind` (key -> node/queue) or `unbind` (key), each with the epoch of
the leadership that made it. `append` writes a batch of decisions and fsyncs once
(the caller runs it in a worker thread); the answer to a proposal is sent only after
it returned (D7).

Recovery (`load`): replay the records in order; a torn or corrupt tail (crash in the
middle of a write) is cut off with a warning, everything before it is kept. The live
bindings are then rewritten into a fresh file (write, fsync, rename, fsync the
directory), so the log never grows beyond one record per live binding plus what was
decided since the last start.

Invariant: a binding is in the table returned by `load` iff its last record is a
`bind`; a decision of a lower epoch never overrides one of a higher epoch for the same
key (fencing: a returning old arbiter's late write cannot win on replay).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from amqbroker.store.atomic import replace_file

log = logging.getLogger(__name__)

_HEAD = struct.Struct(">II")
BIND = "bind"
UNBIND = "unbind"


@dataclass(frozen=True)
class Decision:
    """One arbiter decision: `kind` bind/unbind of the full group key
    (`group_id + "." + queue`) to the queue instance `queue` on node `node`."""

    kind: str
    key: str
    node: str
    queue: str
    epoch: int

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, object]) -> Decision:
        return Decision(
            str(d["kind"]), str(d["key"]), str(d["node"]), str(d["queue"]), int(str(d["epoch"]))
        )


def _frame(d: Decision) -> bytes:
    payload = json.dumps(d.to_dict(), separators=(",", ":")).encode()
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


class DecisionLog:
    def __init__(self, path: Path, *, sync: bool = True) -> None:
        self.path = path
        self.sync = sync
        self._f: BinaryIO | None = None
        self.appended = 0
        #: appends (each one write and, with sync, one fsync), after `load`
        self.syncs = 0

    def load(self) -> dict[str, Decision]:
        """Replay the log (cutting a torn tail) and compact it; the live bindings."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        live: dict[str, Decision] = {}
        if self.path.exists():
            data = self.path.read_bytes()
            pos = 0
            while pos < len(data):
                if pos + _HEAD.size > len(data):
                    break
                n, crc = _HEAD.unpack_from(data, pos)
                payload = data[pos + _HEAD.size : pos + _HEAD.size + n]
                if len(payload) < n or zlib.crc32(payload) != crc:
                    break
                try:
                    d = Decision.from_dict(json.loads(payload))
                except (ValueError, KeyError, TypeError):
                    break
                pos += _HEAD.size + n
                old = live.get(d.key)
                if old is not None and old.epoch > d.epoch:
                    continue  # fenced: an older leadership's late decision
                if d.kind == BIND:
                    live[d.key] = d
                else:
                    live.pop(d.key, None)
            if pos < len(data):
                log.warning(
                    "grouping decision log %s: %d byte(s) of torn or corrupt records cut "
                    "off at offset %d (a crash during a write); the decisions before are kept",
                    self.path,
                    len(data) - pos,
                    pos,
                )
        replace_file(self.path, b"".join(_frame(d) for d in live.values()), sync=self.sync)
        self._f = open(self.path, "ab")  # noqa: SIM115 - kept open for appends
        return live

    def append(self, decisions: list[Decision]) -> None:
        """Write and fsync a batch of decisions at once (blocking: run it in a worker
        thread). The arbiter's group commit passes every decision waiting."""
        fh = self._f
        assert fh is not None, "DecisionLog.load() first"
        fh.write(b"".join(_frame(d) for d in decisions))
        fh.flush()
        if self.sync:
            os.fsync(fh.fileno())
        self.appended += len(decisions)
        self.syncs += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
