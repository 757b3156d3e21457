"""`amqbroker cluster status`: nodes, peer links, the grouping arbiter and its epoch,
optionally the cluster-wide group bindings (README "Cluster"), and the node's
primary/backup pair when it has one (the broker entity's `haStatus`: live member,
backups, epoch, in sync, lag, full syncs, drops, unreplicated). Parse, call, print."""

from __future__ import annotations

from typing import Any

import click

from amqbroker.cli.common import client, connection_options, echo_json, json_option, talking
from amqbroker.tools.management_client import RequestFailed


@click.group()
def cluster() -> None:
    """Inspect a running cluster node (README "Cluster")."""


@cluster.command("status")
@connection_options
@json_option
@click.option("--bindings", is_flag=True, help="also list the cluster-wide group bindings")
def cluster_status(
    url: str, user: str | None, password: str | None, as_json: bool, bindings: bool
) -> None:
    """Nodes, peer links up/down, the grouping arbiter and its epoch; the node's
    primary/backup pair (live, backup, epoch, in sync, lag) when it has one."""
    with talking(url), client(url, user, password) as c:
        ha = _ha_status(c)
        try:
            st = c.call("clusterStatus", "org.amqbroker.cluster", "")
        except RequestFailed as exc:
            if exc.status != 404 or not ha:
                raise
            st = None  # a pair that is not a cluster node: its HA status alone
        rows = (
            c.call("groupingBindings", "org.amqbroker.grouping", "")
            if bindings and st is not None
            else None
        )
    if as_json:
        echo_json({"status": st, "bindings": rows, "ha": ha})
        return
    if ha:
        for line in ha_lines(ha):
            click.echo(line)
    if st is None:
        click.echo("not a cluster node (no cluster_node_id)")
        return
    click.echo(
        f"node {st['node']} (grouping {st['grouping']}); arbiter: "
        f"{st['arbiter'] or 'unknown'}, epoch {st['epoch']}; "
        f"{st['bindings']} binding(s) here, {st['cachedAnswers']} cached answer(s)"
    )
    if st.get("election") == "zookeeper":
        click.echo(f"elected in ZooKeeper; backup arbiter: {st.get('backup') or 'none'}")
    elif st.get("election") == "static":
        click.echo("static arbiter (no ZooKeeper): a single point of failure for new groups")
    if st.get("nodeLossPolicy"):
        click.echo(f"node loss policy: {st['nodeLossPolicy']}")
    for w in st.get("waitingFor") or []:
        click.echo(
            f"waiting for {w['node']} since {w['sinceMillis'] / 1000:.1f} s: "
            f"{w['groups']} group(s) stay bound to it, {w['bridgeDepth']} message(s) "
            "held in order in this node's bridge"
        )
    click.echo(f"{'PEER':12} {'ADDRESS':22} {'LINK':5} {'BRIDGE':>7} {'FORWARDED':>10}  ERROR")
    for p in st["peers"]:
        click.echo(
            f"{p['node']:12} {p['address']:22} {p['link']:5} {p['bridgeDepth']:>7} "
            f"{p['forwarded']:>10}  {p['lastError']}"
        )
    if rows is not None:
        click.echo(f"{'GROUP KEY':40} {'NODE':12} {'QUEUE':20} EPOCH")
        for b in rows:
            waiting = (
                f"  waiting for {b['waitingFor']} since {b['waitingSinceMillis'] / 1000:.1f} s"
                if b.get("waitingFor")
                else ""
            )
            click.echo(f"{b['key']!s:40} {b['node']!s:12} {b['queue']!s:20} {b['epoch']}{waiting}")


def _ha_status(c: Any) -> dict[str, Any] | None:
    """The broker's `haStatus` (None: no HA, or a broker older than the operation)."""
    try:
        ha = c.call("haStatus", "org.amqbroker.broker", "amqbroker")
    except RequestFailed as exc:
        if exc.status in (404, 405):
            return None
        raise
    return ha if isinstance(ha, dict) and ha.get("role") else None


def _n(v: Any) -> str:
    return "-" if v is None else str(v)


def ha_lines(ha: dict[str, Any]) -> list[str]:
    """The HA section of `cluster status` (`amqbroker.ha.status.report`)."""
    role = ha.get("role")
    backups = ", ".join(ha.get("backups") or []) or "none eligible"
    out = [
        f"HA pair {_n(ha.get('node'))}: live {_n(ha.get('liveMember'))} at "
        f"{_n(ha.get('liveAddress'))}, epoch {_n(ha.get('epoch'))}; this member "
        f"{_n(ha.get('member'))} is {'live' if role == 'primary' else 'standby'}",
        f"backup member(s): {backups}",
    ]
    lag = f"lag {ha.get('lagRecords', 0)} record(s), {ha.get('lagBytes', 0)} byte(s)"
    if role == "primary":
        state = ha.get("backupState") or "none"
        where = f" (connection {ha['backup']})" if ha.get("backup") else ""
        sync = "IN SYNC" if ha.get("inSync") else "NOT in sync"
        out.append(f"backup {state}{where}: {sync}; {lag}")
        if state in ("snapshot", "catchup") and ha.get("snapshotTotal"):
            out.append(
                f"full sync: {ha.get('snapshotBytes', 0)} of {ha['snapshotTotal']} byte(s) sent"
            )
        out.append(f"full syncs {ha.get('fullSyncs', 0)}, drops {ha.get('drops', 0)}")
        if ha.get("unreplicated"):
            out.append(
                "UNREPLICATED: no backup in sync; "
                + (
                    "durable sends are REFUSED (ha_unreplicated = refuse)"
                    if ha.get("refusingDurable")
                    else "answering alone (ha_unreplicated = continue)"
                )
            )
        else:
            out.append("replicated: every store cycle waits for the backup")
    else:
        sync = "in sync" if ha.get("inSync") else "NOT in sync"
        conn = "connected" if ha.get("connected") else "not connected"
        out.append(
            f"mirroring {_n(ha.get('primary'))} ({conn}): {sync}; {lag}; "
            f"full syncs {ha.get('fullSyncs', 0)}"
        )
    return out
