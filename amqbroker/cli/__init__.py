"""The `amqbroker` command line (click): parse, call, print. No logic here: the work
is done by the app (`run`), the management client (`tools.management_client`) and
the client tools (`amqbroker.tools`).

Commands::

    amqbroker create DIR                 an instance folder (config, data, start script)
    amqbroker run [DIR] [--host H] [--port P] [--data-dir D] [--config FILE]
    amqbroker hash-password [--scram] [--iterations N]
    amqbroker config show [--config FILE] [--json]
    amqbroker check node|queue NAME      probes: exit 0 ok, 1 failed, 2 unreachable
    amqbroker queue stat|show|create|delete|purge|pause|resume|update|move|retry
    amqbroker address create|delete|show
    amqbroker groups list|count|reset QUEUE
    amqbroker producer|consumer|browser ADDRESS
    amqbroker perf [perf options]        the load client (scripts/perf.py)
    amqbroker cluster status [--bindings] nodes, links, arbiter and epoch
    amqbroker audit PATH... [--master URL] [--out DIR]   the PySpark delivery audit

Every command that talks to a broker takes --url (amqp:// or amqps://), --user,
--password, --mechanism, --ca-file, --cert-file, --key-file (or AMQBROKER_URL,
AMQBROKER_USER, AMQBROKER_PASSWORD, AMQBROKER_MECHANISM, AMQBROKER_CA_FILE,
AMQBROKER_CERT_FILE, AMQBROKER_KEY_FILE); every table has --json. Exit
codes: 0 success, 1 the broker refused (status code and description printed) or a
check failed, 2 the broker could not be reached or the command line is wrong.
Modules: `common` (options, errors, output), `server` (create, run, hash-password,
config), `admin` (check, queue, address, groups), `messaging` (producer, consumer,
browser), `perf`.
"""

from __future__ import annotations

import click

from amqbroker import __version__
from amqbroker.cli import admin, audit, cluster, messaging, perf, server


@click.group()
@click.version_option(__version__, prog_name="amqbroker")
def main() -> None:
    """amqbroker: an AMQP 1.0 message broker with message grouping."""


for _command in (
    server.create,
    server.run,
    server.hash_password_cmd,
    server.config,
    admin.check,
    admin.queue,
    admin.address,
    admin.groups,
    messaging.producer,
    messaging.consumer,
    messaging.browser,
    perf.perf,
    cluster.cluster,
    audit.audit,
):
    main.add_command(_command)

__all__ = ["main"]
