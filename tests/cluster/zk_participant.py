"""One election participant in its own process, for tests that SIGSTOP/SIGKILL it.

    python -m tests.cluster.zk_participant HOSTS PATH NODE_ID SESSION_TIMEOUT_MS

Prints one JSON line per role change (``{"event": "leader", "epoch": 3}``,
``{"event": "backup"|"follower", "leader": "n2", "epoch": 4}``, ``{"event": "lost"}``)
and answers each stdin line ``answer <group>`` the way an arbiter would: if it
believes it leads, ``{"event": "answer", "group": g, "epoch": <its leader epoch>}``
(a decision stamped with its epoch), else ``{"event": "not-leader", "group": g}``.
A test pauses it, queues a request on its stdin, and checks that the answer it gives
on resuming is fenced everywhere.
"""

from __future__ import annotations

import json
import os
import sys

import trio

from amqbroker.cluster.election import Role, ZkElection


def emit(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class Printer:
    def on_leader(self, epoch: int) -> None:
        emit(event="leader", epoch=epoch)

    def on_backup(self, leader_id: str | None, epoch: int) -> None:
        emit(event="backup", leader=leader_id, epoch=epoch)

    def on_follower(self, leader_id: str | None, epoch: int) -> None:
        emit(event="follower", leader=leader_id, epoch=epoch)

    def on_lost(self) -> None:
        emit(event="lost")


async def main(hosts: str, path: str, node_id: str, session_ms: int) -> None:
    election = ZkElection(hosts, path, node_id, Printer(), session_timeout_ms=session_ms)
    async with trio.open_nursery() as nursery:
        await nursery.start(election.run)
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buf = b""
        while chunk := await stdin.receive_some():
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                verb, _, group = line.decode().strip().partition(" ")
                if verb != "answer":
                    continue
                if election.view.role is Role.LEADER:
                    emit(event="answer", group=group, epoch=election.view.epoch)
                else:
                    emit(event="not-leader", group=group)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
