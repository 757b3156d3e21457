"""`amqbroker perf`: the load client (`amqbroker.tools.perf`), as Artemis's `perf client`."""

from __future__ import annotations

import sys
from typing import Any

import click

from amqbroker.cli.common import connection_options


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@connection_options
@click.argument("perf_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def perf(
    ctx: click.Context, url: str, user: str | None, password: str | None, perf_args: tuple[str, ...]
) -> None:
    """Measure a broker: a multi-process AMQP load client with live progress and a
    summary table (`amqbroker perf --help` lists its options and scenarios)."""
    from amqbroker.tools.perf import main as perf_main
    from amqbroker.tools.perf import url_defaults

    source = ctx.get_parameter_source("url")
    defaults: dict[str, Any] = {}
    if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
        try:
            defaults = url_defaults(url)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--url") from None
    if user is not None:
        defaults["user"] = user
    if password is not None:
        defaults["password"] = password
    sys.exit(perf_main(list(perf_args), prog="amqbroker perf", summary=True, defaults=defaults))
