"""`amqbroker cluster status`: nodes, peer links, the grouping arbiter and its epoch, and
optionally the cluster-wide group bindings (README "Cluster"). Parse, call, print."""

from __future__ import annotations

import click

from amqbroker.cli.common import client, connection_options, echo_json, json_option, talking


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
    """Nodes, peer links up/down, the grouping arbiter and its epoch."""
    with talking(url), client(url, user, password) as c:
        st = c.call("clusterStatus", "org.amqbroker.cluster", "")
        rows = c.call("groupingBindings", "org.amqbroker.grouping", "") if bindings else None
    if as_json:
        echo_json({"status": st, "bindings": rows})
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
