"""What an operator sees of a primary/backup pair: one report, the same everywhere.

`report` turns `BrokerApp.ha_status()` (this process's role and its replication
counters: the `Primary`'s stream to its backup, or the `Mirror`'s copy) plus the pair
member's view of the ZooKeeper lease (`LeaseStatus`, set by `amqbroker.pair`) into the
flat map that the management broker entity's ``haStatus`` operation answers,
`amqbroker cluster status` prints and the metrics export (`amqbroker.telemetry`).

Keys (camelCase, as the management node's):

* ``role``: "primary" (live), "backup" (standby: mirroring), "" (no HA);
* ``node``, ``member``: the node id and this member's id (``node1@host:port``);
  ``liveMember``, ``liveAddress``, ``epoch``: the lease's live member and epoch;
  ``members``/``addresses``: the eligible members (those whose store is a complete
  copy) in takeover order; ``backups``: the eligible members other than the live one
  (a backup still in its full sync is not eligible yet: see ``backup``);
* ``backup``: the connection the attached backup mirrors from (None: none attached),
  ``backupState``: none / snapshot / catchup / in-sync;
* ``inSync``: a backup acknowledges every store cycle now; ``unreplicated``: the live
  primary answers without a backup in sync (the opposite, on a primary);
  ``unreplicatedPolicy``: ha_unreplicated; ``refusingDurable``: durable sends are
  being rejected because of it;
* ``lagRecords`` / ``lagBytes``: what the backup does not have yet: on the primary,
  batches queued for a backup catching up plus frames sent and not yet acknowledged;
  on the backup, what it received and has not applied;
* ``fullSyncs``: full syncs started (the primary: to any backup; the backup: streams
  it restarted from scratch); ``drops``: backups the primary dropped (ack timeout,
  refused frame, queue over ha_max_queued_bytes).

Without a lease (a pair without ZooKeeper, or no HA) the lease keys are None/empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from amqbroker.ha.mirror import Mirror
    from amqbroker.ha.primary import Primary


@dataclass(frozen=True)
class LeaseStatus:
    """A pair member's view of its node id's lease (`amqbroker.pair` builds it)."""

    node: str
    member: str
    #: the member's role state (`amqbroker.ha.roles.State`: waiting, mirroring,
    #: synced, live, stopping)
    state: str
    epoch: int
    live_member: str | None
    live_address: str | None
    members: tuple[str, ...] = field(default=())
    addresses: tuple[str, ...] = field(default=())


def process_status(role: str, mirror: Mirror | None, primary: Primary | None) -> dict[str, Any]:
    """`BrokerApp.ha_status()`: the role and the mirror's or the primary's counters."""
    if mirror is not None:
        return {"role": "backup", **mirror.status()}
    if primary is not None:
        return {"role": role, **primary.status()}
    return {"role": role}


def report(
    status: dict[str, Any],
    lease: LeaseStatus | None,
    policy: str = "continue",
    refusing: bool = False,
) -> dict[str, Any]:
    """The operator's view (see the module docstring) of `BrokerApp.ha_status()`;
    `policy`: ha_unreplicated; `refusing`: durable sends are rejected now."""
    role = str(status.get("role") or "")
    out: dict[str, Any] = {
        "role": role,
        "node": lease.node if lease else None,
        "member": lease.member if lease else None,
        "memberState": lease.state if lease else None,
        "liveMember": lease.live_member if lease else None,
        "liveAddress": lease.live_address if lease else None,
        "epoch": lease.epoch if lease else None,
        "members": list(lease.members) if lease else [],
        "addresses": list(lease.addresses) if lease else [],
        "backups": [m for m in lease.members if m != lease.live_member] if lease else [],
        "backup": None,
        "backupState": "none",
        "inSync": False,
        "unreplicated": False,
        "unreplicatedPolicy": policy,
        "refusingDurable": refusing,
        "lagRecords": 0,
        "lagBytes": 0,
        "fullSyncs": 0,
        "drops": 0,
    }
    if role == "backup":
        out.update(
            backup=None,
            backupState="in-sync" if status.get("in_sync") else "syncing",
            primary=status.get("primary"),
            connected=bool(status.get("connected")),
            inSync=bool(status.get("in_sync")),
            syncedEpoch=status.get("epoch"),
            lagRecords=int(status.get("lag_records", 0)),
            lagBytes=int(status.get("lag_bytes", 0)),
            fullSyncs=int(status.get("resyncs", 0)),
        )
    elif "state" in status:  # a primary (its stream to the backup)
        out.update(
            backup=status.get("backup"),
            backupState=status.get("state", "none"),
            inSync=bool(status.get("in_sync")),
            unreplicated=bool(status.get("unreplicated")),
            lagRecords=int(status.get("lag_records", 0)),
            lagBytes=int(status.get("lag_bytes", 0)),
            fullSyncs=int(status.get("full_syncs", 0)),
            drops=int(status.get("dropped", 0)),
            snapshotBytes=int(status.get("snapshot_bytes", 0)),
            snapshotTotal=int(status.get("snapshot_total", 0)),
        )
    return out
