"""The `amqbroker` command line: parse, build settings, call the app. No logic here.

amqbroker run [--host H] [--port P] [--data-dir D] [--config FILE]
amqbroker hash-password
amqbroker groups list|count|reset --queue Q [--group G] [--url URL]
amqbroker audit PATH... [--master URL] [--out DIR] [--format html,md]
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from amqbroker import __version__


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@click.group()
@click.version_option(__version__, prog_name="amqbroker")
def main() -> None:
    """amqbroker: an AMQP 1.0 message broker with message grouping."""


@main.command()
@click.option("--host", help="address to listen on (default 127.0.0.1; AMQBROKER_HOST)")
@click.option("--port", type=int, help="AMQP port (default 5672; 0 = any; AMQBROKER_PORT)")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="where messages are stored (default ./amqbroker-data; AMQBROKER_DATA_DIR)",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="TOML settings file (see config/amqbroker.toml; AMQBROKER_CONFIG)",
)
def run(
    host: str | None, port: int | None, data_dir: Path | None, config_file: Path | None
) -> None:
    """Start the broker; stops gracefully on SIGINT/SIGTERM."""
    import trio

    from amqbroker.app import BrokerApp, StartupError
    from amqbroker.settings import SettingsError, load_settings
    from amqbroker.store.journal import JournalError

    if config_file is None and os.environ.get("AMQBROKER_CONFIG"):
        config_file = Path(os.environ["AMQBROKER_CONFIG"])
    overrides: dict[str, Any] = {"host": host, "port": port, "data_dir": data_dir}
    try:
        settings = load_settings(config_file, {k: v for k, v in overrides.items() if v is not None})
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc
    _setup_logging(settings.log_level)
    app = BrokerApp(settings)

    def ready(a: BrokerApp) -> None:
        for h, p in a.listening:
            click.echo(f"amqbroker {__version__} listening on amqp://{h}:{p}")
        click.echo(f"data directory: {a.data_dir}")
        click.echo("press Ctrl-C to stop")

    try:
        trio.run(lambda: app.run(handle_signals=True, ready=ready))
    except (StartupError, JournalError) as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(app.exit_code)


@main.command("hash-password")
@click.option("--password", prompt=True, hide_input=True, confirmation_prompt=True)
def hash_password_cmd(password: str) -> None:
    """Print a password hash for the `users` setting."""
    from amqbroker.core.auth import hash_password

    click.echo(hash_password(password))


@main.group()
def groups() -> None:
    """Inspect and reset message-group bindings on a running broker."""


_url = click.option(
    "--url", default="amqp://127.0.0.1:5672", show_default=True, help="broker to ask"
)
_user = click.option("--user", default=None, help="user for SASL PLAIN")
_password = click.option("--password", default=None, help="password for SASL PLAIN")
_queue = click.option("--queue", required=True, help="queue name")


def _ask(
    url: str, op: str, queue: str, user: str | None, password: str | None, **props: Any
) -> Any:
    from amqbroker.protocol.management_client import ManagementRequestError, request

    try:
        return request(
            url,
            op,
            type="queue",
            name=queue,
            properties=props or None,
            user=user,
            password=password,
        )
    except ManagementRequestError as exc:
        raise click.ClickException(str(exc)) from exc


@groups.command("list")
@_url
@_user
@_password
@_queue
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def groups_list(
    url: str, user: str | None, password: str | None, queue: str, as_json: bool
) -> None:
    """List the groups bound on a queue: owner, backlog, in-flight, bound since."""
    rows = _ask(url, "listGroups", queue, user, password) or []
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        click.echo(f"queue {queue!r}: no bound groups")
        return
    click.echo(f"{'GROUP':30} {'CONSUMER':40} {'BACKLOG':>8} {'IN-FLIGHT':>9}  BOUND SINCE")
    import datetime

    for r in rows:
        since = datetime.datetime.fromtimestamp(float(r["bound_since"])).isoformat(
            timespec="seconds"
        )
        click.echo(
            f"{r['group']!s:30} {r['consumer']!s:40} {r['backlog']:>8} {r['in_flight']:>9}  {since}"
        )


@groups.command("count")
@_url
@_user
@_password
@_queue
def groups_count(url: str, user: str | None, password: str | None, queue: str) -> None:
    """Number of bound groups (buckets in use when bucketed)."""
    click.echo(_ask(url, "getGroupCount", queue, user, password))


@groups.command("reset")
@_url
@_user
@_password
@_queue
@click.option("--group", default=None, help="group id to unbind (default: all groups)")
def groups_reset(
    url: str, user: str | None, password: str | None, queue: str, group: str | None
) -> None:
    """Unbind one group (--group) or every group of a queue."""
    if group is None:
        n = _ask(url, "resetAllGroups", queue, user, password)
        click.echo(f"queue {queue!r}: {n} group binding(s) removed")
    else:
        found = _ask(url, "resetGroup", queue, user, password, groupId=group)
        click.echo(f"queue {queue!r}: group {group!r} " + ("unbound" if found else "was not bound"))


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--master", default=None, help="Spark master URL (default local[*])")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("audit-report"),
    show_default=True,
    help="directory for report.html, report.md and audit.json",
)
@click.option("--format", "formats", default="html,md", show_default=True, help="html,md")
@click.option(
    "--grace",
    type=float,
    default=0.0,
    show_default=True,
    help="seconds: messages that arrived this close to a node's last event are in flight",
)
@click.option("--samples", type=int, default=20, show_default=True, help="examples per finding")
@click.option("--driver-memory", default="2g", show_default=True, help="local Spark memory")
@click.option("--shuffle-partitions", type=int, default=None, help="spark.sql.shuffle.partitions")
def audit(
    paths: tuple[str, ...],
    master: str | None,
    out: Path,
    formats: str,
    grace: float,
    samples: int,
    driver_memory: str,
    shuffle_partitions: int | None,
) -> None:
    """Audit delivery logs (data dirs, delivery-log dirs or files) with PySpark.

    Exit code 0: every invariant holds; 1: an invariant is broken; 2: could not run.
    """
    from amqbroker.pipeline.audit import AuditOptions, run

    opts = AuditOptions(
        paths=paths,
        master=master,
        out=out,
        formats=[f.strip() for f in formats.split(",") if f.strip()],
        grace_s=grace,
        samples=samples,
        driver_memory=driver_memory,
        shuffle_partitions=shuffle_partitions,
    )
    sys.exit(run(opts, echo=click.echo))


if __name__ == "__main__":
    main()
