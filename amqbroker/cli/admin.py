"""Commands that manage a running broker through its `$management` node: check,
queue, address, groups. Each opens one connection (`common.client`) inside
`common.talking`, which turns failures into messages and exit codes."""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any

import click

from amqbroker.cli.common import (
    EXIT_FAILED,
    client,
    connection_options,
    echo_json,
    json_option,
    table,
    talking,
)
from amqbroker.core.queue_settings import OPTIONS

# ------------------------------------------------------------------------- check


@click.group()
def check() -> None:
    """Health probes: one line, exit 0 ok, 1 failed, 2 the broker is unreachable."""


@check.command("node")
@connection_options
@click.option(
    "--max-memory-percent",
    type=click.FloatRange(0),
    default=None,
    help="fail when message memory is above this share of global_max_size",
)
def check_node(
    url: str, user: str | None, password: str | None, max_memory_percent: float | None
) -> None:
    """The broker answers management requests (and is within the thresholds)."""
    from amqbroker.tools.management_client import check_node as evaluate

    with talking(url), client(url, user, password) as c:
        result = evaluate(c.read("broker", "amqbroker"), max_memory_percent=max_memory_percent)
    click.echo(result.line)
    sys.exit(0 if result.ok else EXIT_FAILED)


@check.command("queue")
@click.argument("name")
@connection_options
@click.option("--max-messages", type=click.IntRange(0), help="fail above this many messages")
@click.option("--min-consumers", type=click.IntRange(0), help="fail below this many consumers")
@click.option(
    "--max-age", type=click.FloatRange(0), help="fail when the oldest message waited longer (s)"
)
@click.option("--max-stuck-groups", type=click.IntRange(0), help="fail above this many")
def check_queue(
    name: str,
    url: str,
    user: str | None,
    password: str | None,
    max_messages: int | None,
    min_consumers: int | None,
    max_age: float | None,
    max_stuck_groups: int | None,
) -> None:
    """The queue exists and is within the thresholds."""
    from amqbroker.tools.management_client import RequestFailed
    from amqbroker.tools.management_client import check_queue as evaluate

    with talking(url), client(url, user, password) as c:
        try:
            attrs = c.read("queue", name)
        except RequestFailed as exc:
            click.echo(f"FAIL: queue {name!r}: {exc.description} ({exc.status})")
            sys.exit(EXIT_FAILED)
    result = evaluate(
        attrs,
        max_messages=max_messages,
        min_consumers=min_consumers,
        max_age=max_age,
        max_stuck_groups=max_stuck_groups,
    )
    click.echo(result.line)
    sys.exit(0 if result.ok else EXIT_FAILED)


# ------------------------------------------------------------------------- queue

#: `queue stat` columns: header, attribute (as Artemis's `queue stat`)
STAT_COLUMNS = (
    ("NAME", "name"),
    ("ADDRESS", "address"),
    ("CONSUMERS", "consumerCount"),
    ("MESSAGES", "messageCount"),
    ("ADDED", "messagesAdded"),
    ("DELIVERING", "deliveringCount"),
    ("ACKED", "messagesAcknowledged"),
    ("SCHEDULED", "scheduledCount"),
    ("GROUPS", "groupCount"),
)


@click.group()
def queue() -> None:
    """Queues: statistics, create, delete, purge, pause, resume, update, move, retry."""


@queue.command("stat")
@connection_options
@json_option
@click.option("--name", "name_filter", default=None, help="only queues whose name contains this")
@click.option("--all", "include_temporary", is_flag=True, help="include temporary (reply) queues")
@click.option(
    "--loop",
    type=click.FloatRange(0.1),
    is_flag=False,
    flag_value=2.0,
    default=None,
    metavar="[SECONDS]",
    help="refresh every SECONDS (2 when only --loop is given) until Ctrl-C",
)
@click.option(
    "--iterations", type=click.IntRange(1), default=None, help="with --loop: stop after N"
)
def queue_stat(
    url: str,
    user: str | None,
    password: str | None,
    as_json: bool,
    name_filter: str | None,
    include_temporary: bool,
    loop: float | None,
    iterations: int | None,
) -> None:
    """One line per queue: name, address, consumers, messages, added, delivering, acked,
    scheduled, groups."""
    from amqbroker.tools.management_client import user_queues

    attrs = [a for _, a in STAT_COLUMNS] + ["temporary"]
    n = 0
    with talking(url), client(url, user, password) as c:
        try:
            while True:
                rows = user_queues(c.query("queue", attrs), include_temporary=include_temporary)
                if name_filter:
                    rows = [r for r in rows if name_filter in str(r["name"])]
                if as_json:
                    shown = [{a: r[a] for _, a in STAT_COLUMNS} for r in rows]
                    click.echo(_json_line(shown) if loop else _json_block(shown))
                else:
                    if loop is not None:
                        if sys.stdout.isatty():
                            click.clear()
                        click.echo(f"{url}  {time.strftime('%H:%M:%S')}")
                    body = [[r[a] for _, a in STAT_COLUMNS] for r in rows]
                    click.echo(table([h for h, _ in STAT_COLUMNS], body))
                n += 1
                if loop is None or (iterations is not None and n >= iterations):
                    return
                time.sleep(loop)
        except KeyboardInterrupt:
            return


def _json_line(v: Any) -> str:
    import json

    return json.dumps(v, default=str)


def _json_block(v: Any) -> str:
    import json

    return json.dumps(v, indent=2, default=str)


@queue.command("show")
@click.argument("name")
@connection_options
@json_option
def queue_show(name: str, url: str, user: str | None, password: str | None, as_json: bool) -> None:
    """Every attribute of one queue."""
    with talking(url), client(url, user, password) as c:
        attrs = c.read("queue", name)
    _print_attributes(attrs, as_json)


def _print_attributes(attrs: dict[str, Any], as_json: bool) -> None:
    if as_json:
        echo_json(attrs)
        return
    click.echo(table(["ATTRIBUTE", "VALUE"], [[k, _text(v)] for k, v in attrs.items()]))


def _text(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return ", ".join(str(x) for x in v) or "-"
    return str(v)


def _queue_options(f: Any) -> Any:
    """The queue options of CREATE and UPDATE (only those given are sent), one flag
    per queue option of the table (`amqbroker.core.queue_settings`)."""
    for s in reversed(OPTIONS):
        flag = s.cli_flag or f"--{s.option}"
        kind: dict[str, Any] = {"type": int} if s.type.kind == "int" else {}
        if s.type.kind == "bool":
            flag = f"{flag}/--no-{flag.removeprefix('--')}"
        f = click.option(flag, s.name, default=None, help=s.doc, **kind)(f)
    return f


_OPTION_ATTRS = {s.name: s.attribute or s.name for s in OPTIONS}


def _option_body(opts: dict[str, Any]) -> dict[str, Any]:
    """The management attributes of the queue options given on the command line (in
    the order given)."""
    return {_OPTION_ATTRS[k]: v for k, v in opts.items() if k in _OPTION_ATTRS and v is not None}


@queue.command("create")
@click.argument("name")
@click.option("--address", default=None, help="the address (default: the queue's name)")
@click.option(
    "--routing",
    type=click.Choice(["anycast", "multicast"], case_sensitive=False),
    default=None,
    help="routing type of a new address (default anycast, or the existing address's)",
)
@click.option("--durable/--no-durable", default=True, show_default=True)
@_queue_options
@connection_options
@json_option
def queue_create(
    name: str,
    address: str | None,
    routing: str | None,
    durable: bool,
    url: str,
    user: str | None,
    password: str | None,
    as_json: bool,
    **opts: Any,
) -> None:
    """Create a queue (and its address when it does not exist)."""
    body: dict[str, Any] = {"durable": durable, **_option_body(opts)}
    if address:
        body["address"] = address
    if routing:
        body["routingType"] = routing.upper()
    with talking(url), client(url, user, password) as c:
        attrs = c.call("CREATE", "queue", name, body=body)
    if as_json:
        echo_json(attrs)
        return
    click.echo(
        f"created queue {name!r} on address {attrs['address']!r} ({attrs['routingType']}, "
        + ("durable" if attrs["durable"] else "not durable")
        + ")"
    )


@queue.command("update")
@click.argument("name")
@_queue_options
@connection_options
@json_option
def queue_update(
    name: str, url: str, user: str | None, password: str | None, as_json: bool, **opts: Any
) -> None:
    """Change a queue's options (only those given)."""
    body = _option_body(opts)
    if not body:
        raise click.UsageError("give at least one option to change (see --help)")
    with talking(url), client(url, user, password) as c:
        attrs = c.call("UPDATE", "queue", name, body=body)
    if as_json:
        echo_json(attrs)
        return
    changed = ", ".join(f"{k}={_text(attrs[k])}" for k in body)
    click.echo(f"queue {name!r} updated: {changed}")


def _delete_command(group: click.Group, entity: str, force_help: str, doc: str) -> None:
    """`queue delete` and `address delete`: DELETE, with force=true when --force."""

    @group.command("delete", help=doc)
    @click.argument("name")
    @click.option("--force", is_flag=True, help=force_help)
    @connection_options
    def command(name: str, force: bool, url: str, user: str | None, password: str | None) -> None:
        with talking(url), client(url, user, password) as c:
            c.call("DELETE", entity, name, force=force or None)
        click.echo(f"deleted {entity} {name!r}")


_delete_command(
    queue,
    "queue",
    "also when it has consumers (they are detached)",
    "Delete a queue and its messages.",
)


@queue.command("purge")
@click.argument("name")
@connection_options
def queue_purge(name: str, url: str, user: str | None, password: str | None) -> None:
    """Remove every waiting message of a queue (not those in flight)."""
    with talking(url), client(url, user, password) as c:
        removed = c.call("purge", "queue", name)["removed"]
    click.echo(f"queue {name!r}: {removed} message(s) removed")


def _switch_command(verb: str, done: str, doc: str) -> None:
    """`queue pause` and `queue resume`: the management operation of that name, which
    answers nothing to show."""

    @queue.command(verb, help=doc)
    @click.argument("name")
    @connection_options
    def command(name: str, url: str, user: str | None, password: str | None) -> None:
        with talking(url), client(url, user, password) as c:
            c.call(verb, "queue", name)
        click.echo(f"queue {name!r} {done}")


_switch_command("pause", "paused", "Stop delivering from a queue (messages keep arriving).")
_switch_command("resume", "resumed", "Deliver from a paused queue again.")


@queue.command("move")
@click.argument("name")
@click.argument("to_queue", metavar="TO_QUEUE")
@click.option(
    "--selector",
    "--filter",
    "selector",
    default=None,
    help="only the messages this JMS selector matches, e.g. \"region = 'eu'\"",
)
@connection_options
@json_option
def queue_move(
    name: str,
    to_queue: str,
    selector: str | None,
    url: str,
    user: str | None,
    password: str | None,
    as_json: bool,
) -> None:
    """Move the waiting messages of queue NAME (those --selector matches) to TO_QUEUE."""
    with talking(url), client(url, user, password) as c:
        answer = c.call("moveMessages", "queue", name, body=_move_body(to_queue, selector))
    moved = answer["moved"]
    if as_json:
        echo_json({"queue": name, "toQueue": to_queue, "selector": selector, "moved": moved})
        return
    which = f" matching {selector!r}" if selector else ""
    click.echo(f"queue {name!r}: {moved} message(s){which} moved to {to_queue!r}")


def _move_body(to_queue: str, selector: str | None) -> dict[str, Any]:
    body = {"toQueue": to_queue}
    if selector is not None:
        body["filter"] = selector
    return body


@queue.command("retry")
@click.argument("name")
@connection_options
@json_option
def queue_retry(name: str, url: str, user: str | None, password: str | None, as_json: bool) -> None:
    """Send the dead letters waiting in queue NAME back to their original addresses
    (x-opt-ORIG-ADDRESS); other messages stay."""
    with talking(url), client(url, user, password) as c:
        retried = c.call("retryMessages", "queue", name)["retried"]
    if as_json:
        echo_json({"queue": name, "retried": retried})
        return
    click.echo(f"queue {name!r}: {retried} message(s) sent back to their original address")


# ----------------------------------------------------------------------- address


@click.group()
def address() -> None:
    """Addresses: create, delete, show."""


@address.command("create")
@click.argument("name")
@click.option(
    "--routing",
    type=click.Choice(["anycast", "multicast"], case_sensitive=False),
    default="anycast",
    show_default=True,
)
@click.option("--durable/--no-durable", default=True, show_default=True)
@connection_options
def address_create(
    name: str, routing: str, durable: bool, url: str, user: str | None, password: str | None
) -> None:
    """Create an address."""
    body = {"routingType": routing.upper(), "durable": durable}
    with talking(url), client(url, user, password) as c:
        attrs = c.call("CREATE", "address", name, body=body)
    click.echo(f"created address {name!r} ({attrs['routingType']})")


_delete_command(
    address, "address", "also when its queues have consumers", "Delete an address and its queues."
)


ADDRESS_COLUMNS = (
    ("NAME", "name"),
    ("ROUTING", "routingType"),
    ("QUEUES", "queueCount"),
    ("PRODUCERS", "producerCount"),
    ("MESSAGES", "messageCount"),
    ("SIZE", "addressSize"),
    ("FULL", "full"),
)


@address.command("show")
@click.argument("name", required=False)
@connection_options
@json_option
@click.option("--all", "include_temporary", is_flag=True, help="include temporary addresses")
def address_show(
    name: str | None,
    url: str,
    user: str | None,
    password: str | None,
    as_json: bool,
    include_temporary: bool,
) -> None:
    """Every attribute of one address, or (without NAME) a table of all of them."""
    with talking(url), client(url, user, password) as c:
        if name is not None:
            _print_attributes(c.read("address", name), as_json)
            return
        rows = c.query("address", [a for _, a in ADDRESS_COLUMNS] + ["autoCreated"])
        temp = {q["address"] for q in c.query("queue", ["address", "temporary"]) if q["temporary"]}
    rows = sorted(
        (r for r in rows if include_temporary or r["name"] not in temp), key=lambda r: r["name"]
    )
    if as_json:
        echo_json([{a: r[a] for _, a in ADDRESS_COLUMNS} for r in rows])
        return
    click.echo(
        table([h for h, _ in ADDRESS_COLUMNS], [[r[a] for _, a in ADDRESS_COLUMNS] for r in rows])
    )


# ------------------------------------------------------------------------ groups


@click.group()
def groups() -> None:
    """Inspect and reset message-group bindings on a running broker."""


def _queue_arg(positional: str | None, option: str | None) -> str:
    if positional and option and positional != option:
        raise click.UsageError(f"two queues given: {positional!r} and --queue {option!r}")
    name = positional or option
    if not name:
        raise click.UsageError("name the queue: `amqbroker groups ... QUEUE` (or --queue QUEUE)")
    return name


_queue_option = click.option("--queue", "queue_opt", default=None, help="the queue (older form)")


@groups.command("list")
@click.argument("queue_name", metavar="QUEUE", required=False)
@_queue_option
@click.option("--top", type=click.IntRange(1), default=None, help="only the N largest backlogs")
@connection_options
@json_option
def groups_list(
    queue_name: str | None,
    queue_opt: str | None,
    top: int | None,
    url: str,
    user: str | None,
    password: str | None,
    as_json: bool,
) -> None:
    """The groups bound on a queue: owner, backlog, in flight, oldest message's age."""
    from amqbroker.tools.management_client import duration

    name = _queue_arg(queue_name, queue_opt)
    with talking(url), client(url, user, password) as c:
        answer = c.call("listGroups", "queue", name, top=top, orderBy="backlog" if top else None)
    rows = answer["groups"]
    if as_json:
        # the table's OWNER column: one name in both (the management reply says consumer)
        echo_json([{("owner" if k == "consumer" else k): v for k, v in r.items()} for r in rows])
        return
    if not rows:
        click.echo(f"queue {name!r}: no bound groups")
        return
    click.echo(
        table(
            [
                "GROUP",
                "OWNER",
                "CONNECTION",
                "BACKLOG",
                "IN FLIGHT",
                "OLDEST",
                "BOUND SINCE",
                "STATE",
            ],
            [
                [
                    r["group"],
                    r["consumer"],
                    r["connection"],
                    r["backlog"],
                    r["inFlight"],
                    duration(r["oldestMessageAge"]),
                    datetime.datetime.fromtimestamp(r["boundSince"] / 1000).isoformat(
                        timespec="seconds"
                    ),
                    "stuck" if r["stuck"] else ("blocked" if r["blocked"] else "ok"),
                ]
                for r in rows
            ],
        )
    )


@groups.command("count")
@click.argument("queue_name", metavar="QUEUE", required=False)
@_queue_option
@connection_options
def groups_count(
    queue_name: str | None, queue_opt: str | None, url: str, user: str | None, password: str | None
) -> None:
    """Number of bound groups (buckets in use when bucketed)."""
    name = _queue_arg(queue_name, queue_opt)
    with talking(url), client(url, user, password) as c:
        click.echo(c.call("getGroupCount", "queue", name))


@groups.command("reset")
@click.argument("queue_name", metavar="QUEUE", required=False)
@click.argument("group_id", metavar="[GROUP]", required=False)
@_queue_option
@click.option("--group", "group_opt", default=None, help="the group (older form)")
@connection_options
def groups_reset(
    queue_name: str | None,
    group_id: str | None,
    queue_opt: str | None,
    group_opt: str | None,
    url: str,
    user: str | None,
    password: str | None,
) -> None:
    """Unbind one group, or every group of the queue when none is named."""
    name = _queue_arg(queue_name, queue_opt)
    if group_id and group_opt and group_id != group_opt:
        raise click.UsageError(f"two groups given: {group_id!r} and --group {group_opt!r}")
    group = group_id or group_opt
    with talking(url), client(url, user, password) as c:
        if group is None:
            n = c.call("resetAllGroups", "queue", name)["reset"]
            click.echo(f"queue {name!r}: {n} group binding(s) removed")
        else:
            found = c.call("resetGroup", "queue", name, group=group)["reset"]
            click.echo(
                f"queue {name!r}: group {group!r} " + ("unbound" if found else "was not bound")
            )
