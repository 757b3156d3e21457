"""What every command of the CLI shares: the connection options, error handling with
exit codes, and output (tables, JSON, durations, progress bars).

Exit codes: 0 success; 1 the broker answered with an error (its status code and
description are printed) or a check failed; 2 the broker could not be reached (or
refused the login), or the command line was wrong (click's usage errors).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FAILED = 1
EXIT_UNREACHABLE = 2


class Unreachable(click.ClickException):
    """The broker could not be reached: exit status 2."""

    exit_code = EXIT_UNREACHABLE


#: ctx.meta key of the TLS and mechanism options given so far (see `connection_options`)
_SECURITY_META = "amqbroker.client_security"
#: commands whose client has its own transport without TLS or SCRAM (the load client)
_PLAIN_ONLY = frozenset({"perf"})


def _remember_security(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Callback of the TLS and mechanism options: they are not passed to the command
    function but become the context's `ClientSecurity` (`management_client.use_security`),
    which every connection the command opens uses (management and messaging alike)."""
    from amqbroker.protocol.client_auth import ClientSecurity
    from amqbroker.tools.management_client import use_security

    if value is not None and ctx.command.name in _PLAIN_ONLY:
        raise click.UsageError(
            f"{ctx.command.name} connects over amqp:// with PLAIN or ANONYMOUS only; "
            f"it does not take {param.opts[0]} (or its environment variable)"
        )
    given: dict[str, Any] = ctx.meta.setdefault(_SECURITY_META, {})
    given[str(param.name)] = value
    use_security(ClientSecurity(**given))
    return value


def connection_options(f: F) -> F:
    """--url, --user, --password (AMQBROKER_URL, AMQBROKER_USER, AMQBROKER_PASSWORD),
    passed to the command; --ca-file, --cert-file, --key-file, --mechanism
    (AMQBROKER_CA_FILE, AMQBROKER_CERT_FILE, AMQBROKER_KEY_FILE, AMQBROKER_MECHANISM),
    which are not: they set the context's `ClientSecurity` (`_remember_security`)."""
    from amqbroker.protocol.client_auth import MECHANISMS
    from amqbroker.tools.management_client import DEFAULT_URL

    security: dict[str, Any] = {"expose_value": False, "callback": _remember_security}
    #: (flag, environment variable, click.option keywords), in the order --help lists them
    options: list[tuple[str, str, dict[str, Any]]] = [
        (
            "--url",
            "AMQBROKER_URL",
            {
                "default": DEFAULT_URL,
                "show_default": True,
                "help": "the broker (amqp://host:port, or amqps:// for TLS)",
            },
        ),
        (
            "--user",
            "AMQBROKER_USER",
            {"help": "user for SASL PLAIN or SCRAM-SHA-256 (default: anonymous)"},
        ),
        ("--password", "AMQBROKER_PASSWORD", {"help": "password for SASL PLAIN or SCRAM-SHA-256"}),
        (
            "--ca-file",
            "AMQBROKER_CA_FILE",
            {
                **security,
                "help": "CA certificate(s), PEM, that the broker's must chain to (amqps://; "
                "default: the system's)",
            },
        ),
        (
            "--cert-file",
            "AMQBROKER_CERT_FILE",
            {
                **security,
                "help": "client certificate, PEM, for amqps:// (SASL EXTERNAL without --user)",
            },
        ),
        (
            "--key-file",
            "AMQBROKER_KEY_FILE",
            {**security, "help": "its private key, PEM, unencrypted (if not in --cert-file)"},
        ),
        (
            "--mechanism",
            "AMQBROKER_MECHANISM",
            {
                **security,
                "type": click.Choice(MECHANISMS, case_sensitive=False),
                "help": "SASL mechanism (default: PLAIN with --user, EXTERNAL with "
                "--cert-file, else ANONYMOUS)",
            },
        ),
    ]
    for name, envvar, kw in reversed(options):
        f = click.option(name, envvar=envvar, show_envvar=True, **{"default": None, **kw})(f)
    return f


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")(f)


@contextlib.contextmanager
def talking(url: str) -> Iterator[None]:
    """Map the client's errors to messages and exit codes (2 unreachable, 1 refused)."""
    from amqbroker.tools.management_client import ConnectError, RequestFailed
    from amqbroker.tools.messaging import MessagingError

    try:
        yield
    except ConnectError as exc:
        raise Unreachable(str(exc)) from None
    except RequestFailed as exc:
        code = exc.status if exc.status is not None else "no status"
        raise click.ClickException(
            f"the broker refused {exc.operation} ({code}): {exc.description}"
        ) from None
    except MessagingError as exc:
        raise click.ClickException(str(exc)) from None


def client(url: str, user: str | None, password: str | None) -> Any:
    """A `ManagementClient` (use inside `talking`)."""
    from amqbroker.tools.management_client import ManagementClient

    return ManagementClient(url, user=user, password=password)


# ------------------------------------------------------------------------ output


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table: numbers right-aligned, None as '-'."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = [
        bool(rows) and all(isinstance(r[i], int | float) or r[i] is None for r in rows)
        for i in range(len(headers))
    ]
    lines = []
    for row in [list(headers), *cells]:
        parts = [
            c.rjust(w) if num else c.ljust(w)
            for c, w, num in zip(row, widths, numeric, strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


@contextlib.contextmanager
def progress(length: int, label: str, force: bool) -> Iterator[Callable[[int], None]]:
    """A click progress bar on stderr when stderr is a terminal or `force`; yields a
    function taking the count done so far."""
    show = force or sys.stderr.isatty()
    if not show or length <= 1:
        yield lambda n: None
        return
    with click.progressbar(length=length, label=label, file=sys.stderr, show_pos=True) as bar:
        if force:
            # drawn even when stderr is not a terminal (click would print the label only)
            bar._is_atty = True
        done = 0

        def update(n: int) -> None:
            nonlocal done
            if n > done:
                bar.update(n - done)
                done = n

        yield update
