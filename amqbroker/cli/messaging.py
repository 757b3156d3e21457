"""producer, consumer, browser: send, take or look at messages (`tools.messaging`)."""

from __future__ import annotations

import json
from typing import Any

import click

from amqbroker.cli.common import connection_options, progress, talking

_progress_option = click.option(
    "--progress",
    "force_progress",
    is_flag=True,
    help="show the progress bar (on stderr) even when stderr is not a terminal",
)


def _connection(url: str, user: str | None, password: str | None) -> Any:
    from amqbroker.tools.messaging import Connection

    return Connection(url, user, password)


@click.command()
@click.argument("address")
@click.option("--count", type=click.IntRange(1), default=1, show_default=True)
@click.option(
    "--message",
    "text",
    default="message {n}",
    show_default=True,
    help="body text; {n} is replaced by the message's index",
)
@click.option("--group", default=None, help="group id of every message")
@click.option(
    "--group-seq",
    type=click.IntRange(0),
    default=None,
    help="group sequence of the first message (then +1 per message)",
)
@click.option(
    "--properties", default=None, help='application properties as JSON: \'{"region": "eu"}\''
)
@click.option("--durable", is_flag=True, help="durable messages (kept across a restart)")
@click.option("--ttl", type=click.IntRange(1), default=None, help="time to live (ms)")
@connection_options
@_progress_option
def producer(
    address: str,
    count: int,
    text: str,
    group: str | None,
    group_seq: int | None,
    properties: str | None,
    durable: bool,
    ttl: int | None,
    url: str,
    user: str | None,
    password: str | None,
    force_progress: bool,
) -> None:
    """Send COUNT messages to ADDRESS; each is settled on the broker's outcome."""
    from amqbroker.tools.messaging import SendSpec, parse_properties, send

    try:
        props = parse_properties(properties)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--properties") from None
    spec = SendSpec(
        address,
        count=count,
        text=text,
        group=group,
        group_seq=group_seq,
        properties=props,
        durable=durable,
        ttl_ms=ttl,
    )
    with talking(url), progress(count, f"sending to {address}", force_progress) as bar:
        result = send(_connection(url, user, password), spec, on_progress=bar)
    click.echo(f"sent {result.accepted} message(s) to {address!r}")
    if result.refused:
        raise click.ClickException(
            f"{result.refused} message(s) not accepted by the broker, the first: "
            f"{result.first_refusal}"
        )


def _receiving_options(f: Any) -> Any:
    f = click.option(
        "--timeout",
        type=click.FloatRange(0),
        default=2.0,
        show_default=True,
        help="stop when no message came for this long (s)",
    )(f)
    f = click.option("--count", type=click.IntRange(1), default=None, help="stop after N")(f)
    f = click.option("--selector", default=None, help="JMS selector, e.g. \"region = 'eu'\"")(f)
    f = click.option("--group", default=None, help="only messages of this group")(f)
    f = click.option("--json", "as_json", is_flag=True, help="one JSON object per message")(f)
    f = click.option("--quiet", is_flag=True, help="print only the count")(f)
    return f


def _printer(as_json: bool, quiet: bool) -> Any:
    def show(m: dict[str, Any]) -> None:
        if quiet:
            return
        if as_json:
            click.echo(json.dumps(m, default=str))
            return
        group = f"[{m['group']}#{m['groupSeq']}] " if m["group"] is not None else ""
        props = f" {json.dumps(m['properties'])}" if m["properties"] else ""
        body = m["body"] if isinstance(m["body"], str) else json.dumps(m["body"])
        click.echo(f"{group}{body}{props}")

    return show


def _receive(
    *,
    browse: bool,
    address: str,
    url: str,
    user: str | None,
    password: str | None,
    count: int | None,
    timeout: float,
    selector: str | None,
    group: str | None,
    as_json: bool,
    quiet: bool,
    force_progress: bool,
) -> None:
    from amqbroker.tools.messaging import receive

    show = _printer(as_json, quiet)
    verb = "browsed" if browse else "received"
    with talking(url), progress(count or 0, f"{verb} from {address}", force_progress) as bar:
        seen = 0

        def on_message(m: dict[str, Any]) -> None:
            nonlocal seen
            seen += 1
            show(m)
            bar(seen)

        n = receive(
            _connection(url, user, password),
            address,
            count=count,
            idle_timeout=timeout,
            selector=selector,
            group=group,
            browse=browse,
            on_message=on_message,
        )
    click.echo(f"{verb} {n} message(s) from {address!r}", err=not quiet)


@click.command()
@click.argument("address")
@_receiving_options
@connection_options
@_progress_option
def consumer(address: str, **kw: Any) -> None:
    """Take messages from ADDRESS (accepting each) and print them, until --count or
    none came for --timeout seconds."""
    _receive(browse=False, address=address, **kw)


@click.command()
@click.argument("address")
@_receiving_options
@connection_options
@_progress_option
def browser(address: str, **kw: Any) -> None:
    """Print the messages waiting in a queue without taking them."""
    _receive(browse=True, address=address, **kw)
