"""The checks that involve several settings, run after every field is valid.

Each problem raises a `CrossFieldError` naming the settings involved (name -> value),
which `amqbroker.settings.messages` reports with their sources, e.g.
``output_low_water = 2097152 (from AMQBROKER_OUTPUT_LOW_WATER), output_high_water =
1048576 (default): output_low_water must be less than output_high_water``. The first
problem found is the one reported.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from amqbroker.core.authz import ANONYMOUS_USER
from amqbroker.settings.fields import parse_listener, parse_peer

if TYPE_CHECKING:
    from collections.abc import Mapping

    from amqbroker.settings.model import Settings


class CrossFieldError(ValueError):
    """A problem involving several settings; `fields` (name -> value) are named in it."""

    def __init__(self, fields: Mapping[str, object], problem: str) -> None:
        super().__init__(problem)
        self.fields = dict(fields)


def check_cross_fields(settings: Settings) -> None:
    """Raise `CrossFieldError` for the first problem among several settings."""
    if settings.output_low_water >= settings.output_high_water:
        raise CrossFieldError(
            {
                "output_low_water": settings.output_low_water,
                "output_high_water": settings.output_high_water,
            },
            "output_low_water must be less than output_high_water",
        )
    if (settings.require_auth or not settings.allow_anonymous) and not (
        settings.users or settings.tls_identity_users
    ):
        policy: dict[str, object] = (
            {"require_auth": True} if settings.require_auth else {"allow_anonymous": False}
        )
        raise CrossFieldError(
            {**policy, "users": settings.users, "tls_identity_users": settings.tls_identity_users},
            ("require_auth is true" if settings.require_auth else "allow_anonymous is false")
            + " but no users are configured, so no client could connect; create a "
            "password hash with `amqbroker hash-password --scram` and add it under "
            '[users] in the config file (alice = "scram-sha-256$...") or as '
            'AMQBROKER_USERS=\'{"alice": "<hash>"}\', map TLS client certificates to '
            "users under [tls_identity_users], or allow anonymous access "
            "(require_auth = false, allow_anonymous = true)",
        )
    known = [*settings.users, *settings.tls_identity_users.values(), ANONYMOUS_USER]
    for user in settings.roles:
        if user not in known:
            close = difflib.get_close_matches(user, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise CrossFieldError(
                {"roles": settings.roles},
                f"roles names user {user!r}, who is not under [users] or "
                f"[tls_identity_users] (nor {ANONYMOUS_USER!r}, the user of connections "
                f"without credentials); {hint}add the user or correct the name",
            )
    if (settings.cluster_peers or settings.cluster_grouping) and not settings.cluster_node_id:
        raise CrossFieldError(
            {"cluster_node_id": settings.cluster_node_id, "cluster_peers": settings.cluster_peers},
            "a cluster node needs a cluster_node_id (unique in the cluster, e.g. 'node1')",
        )
    peer_ids = [parse_peer(p)[0] for p in settings.cluster_peers]
    if len(set(peer_ids)) != len(peer_ids) or settings.cluster_node_id in peer_ids:
        raise CrossFieldError(
            {"cluster_node_id": settings.cluster_node_id, "cluster_peers": settings.cluster_peers},
            "every cluster peer needs its own id, different from cluster_node_id",
        )
    if settings.cluster_reconnect_initial > settings.cluster_reconnect_max:
        raise CrossFieldError(
            {
                "cluster_reconnect_initial": settings.cluster_reconnect_initial,
                "cluster_reconnect_max": settings.cluster_reconnect_max,
            },
            "cluster_reconnect_initial must not exceed cluster_reconnect_max",
        )
    if settings.ha_role == "backup" and not settings.ha_primary and not settings.cluster_zookeeper:
        raise CrossFieldError(
            {"ha_role": settings.ha_role, "ha_primary": settings.ha_primary},
            "a backup (ha_role = backup) needs ha_primary, the host:port of its primary's "
            "AMQP listener, or cluster_zookeeper (the lease in ZooKeeper names the live "
            "member to mirror)",
        )
    if (
        settings.ha_role
        and settings.cluster_zookeeper
        and not (settings.cluster_node_id or settings.node_id)
    ):
        raise CrossFieldError(
            {"ha_role": settings.ha_role, "cluster_node_id": settings.cluster_node_id},
            "a primary/backup pair with cluster_zookeeper needs the node id both members "
            "share: set cluster_node_id (in a cluster) or node_id",
        )
    if settings.ha_failback and not (settings.ha_role and settings.cluster_zookeeper):
        raise CrossFieldError(
            {"ha_failback": settings.ha_failback, "ha_role": settings.ha_role},
            "fail back (ha_failback) hands a pair's node id back through its lease in "
            "ZooKeeper: set ha_role and cluster_zookeeper too, or leave ha_failback off",
        )
    if settings.ha_role and not settings.cluster_user:
        raise CrossFieldError(
            {"ha_role": settings.ha_role, "cluster_user": settings.cluster_user},
            "a primary/backup pair authenticates its replication stream as the cluster "
            "user: set cluster_user (and cluster_password) on both",
        )
    if 0 <= settings.delivery_log_max_bytes < 2 * settings.delivery_log_rotate_bytes:
        raise CrossFieldError(
            {
                "delivery_log_max_bytes": settings.delivery_log_max_bytes,
                "delivery_log_rotate_bytes": settings.delivery_log_rotate_bytes,
            },
            "delivery_log_max_bytes must be at least twice delivery_log_rotate_bytes "
            "(or -1 for no bound), so that the newest complete file is kept",
        )
    seen: dict[tuple[str, int], str] = {}
    if settings.port:
        seen[(settings.host, settings.port)] = "host/port"
    for text in settings.extra_listeners:
        listener = parse_listener(text)
        if listener[1] and listener in seen:
            raise CrossFieldError(
                {
                    "extra_listeners": settings.extra_listeners,
                    "host": settings.host,
                    "port": settings.port,
                },
                f"extra listener {text} repeats {seen[listener]}; each listener needs "
                "its own host:port",
            )
        seen[listener] = f"extra listener {text}"
    _check_tls(settings, seen)


def _check_tls(settings: Settings, seen: dict[tuple[str, int], str]) -> None:
    """TLS listeners need their own host:port, a certificate and its key; client
    certificates need a CA. The files themselves are checked at start
    (`amqbroker.net.tls.server_context`)."""
    for text in settings.tls_listeners:
        listener = parse_listener(text)
        if listener[1] and listener in seen:
            raise CrossFieldError(
                {"tls_listeners": settings.tls_listeners},
                f"TLS listener {text} repeats {seen[listener]}; each listener needs "
                "its own host:port",
            )
        seen[listener] = f"TLS listener {text}"
    _check_websocket(settings, seen)
    for key in ("tls_listeners", "wss_listeners"):
        for name, what in (("tls_cert_file", "certificate"), ("tls_key_file", "private key")):
            if getattr(settings, key) and not getattr(settings, name):
                raise CrossFieldError(
                    {key: getattr(settings, key), name: ""},
                    f"{'TLS' if key == 'tls_listeners' else 'wss (WebSocket over TLS)'} "
                    f"listeners need the broker's {what}: set {name} to a PEM file",
                )
    if settings.tls_client_auth != "none" and not settings.tls_ca_file:
        raise CrossFieldError(
            {"tls_client_auth": settings.tls_client_auth, "tls_ca_file": ""},
            "client certificates are verified against tls_ca_file: set it to a PEM "
            'file of the CA certificates, or set tls_client_auth = "none"',
        )


def _check_websocket(settings: Settings, seen: dict[tuple[str, int], str]) -> None:
    """WebSocket listeners need their own host:port; a client may send a frame of
    max_frame_size in one message, so ws_max_message_size must allow it."""
    for key, what in (("ws_listeners", "WebSocket"), ("wss_listeners", "wss")):
        for text in getattr(settings, key):
            listener = parse_listener(text)
            if listener[1] and listener in seen:
                raise CrossFieldError(
                    {key: getattr(settings, key)},
                    f"{what} listener {text} repeats {seen[listener]}; each listener "
                    "needs its own host:port",
                )
            seen[listener] = f"{what} listener {text}"
    if (settings.ws_listeners or settings.wss_listeners) and (
        settings.ws_max_message_size < settings.max_frame_size
    ):
        raise CrossFieldError(
            {
                "ws_max_message_size": settings.ws_max_message_size,
                "max_frame_size": settings.max_frame_size,
            },
            "ws_max_message_size must be at least max_frame_size: a WebSocket client "
            "may send a whole AMQP frame in one message",
        )
