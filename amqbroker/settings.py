"""The broker's settings: the `Settings` model and `load_settings`, which builds it.

Sources and precedence
----------------------
``load_settings`` merges, from lowest to highest precedence:

1. the defaults declared on `Settings`;
2. the TOML file given with ``--config`` (keys are the field names; kebab-case such as
   ``max-frame-size`` is accepted too; unknown keys are an error, with a "did you mean");
3. environment variables ``AMQBROKER_<NAME>`` (prefix and name case-insensitive, e.g.
   ``AMQBROKER_MAX_FRAME_SIZE``); structured settings (``users``,
   ``tls_identity_users``, ``address_settings``, ``addresses``) take JSON;
   the listener lists (``extra_listeners``, ``tls_listeners``, ``ws_listeners``,
   ``wss_listeners``) take JSON or a comma-separated list;
   environment variables naming no setting are ignored;
4. command-line flags (``overrides``; None values mean "flag not given").

A higher layer replaces a key's whole value (tables are not merged across layers).
Relative paths (``data_dir``) are relative to the working directory, not to the file.

`Settings()` itself reads nothing: it is the defaults plus keyword arguments, so code
and tests that build one never pick up the environment by accident. Only
`load_settings` reads the file and the environment, because only it knows where each
value came from: every problem it reports names the key, the bad value, its source
(file path, environment variable or CLI flag) and what is allowed, e.g.
``port = 99999 (from AMQBROKER_PORT): must be between 0 and 65535``. All problems are
reported together in one `SettingsError`.

Every broker limit is a named setting here; per-address policy lives in
`amqbroker.core.address_settings` (its queue settings, the grouping and dispatch ones,
are declared once in `amqbroker.core.queue_settings`), authorisation rules (``roles``,
``security``) in `amqbroker.core.authz`.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from amqbroker.core.address_settings import (
    DEFAULT_CACHE_SIZE,
    AddressPattern,
    AddressSettings,
    AddressSettingsRepository,
    ConfigFloat,
    ConfigInt,
    Routing,
    check_address_name,
)
from amqbroker.core.authz import ANONYMOUS_USER, RoleName, SecurityRule
from amqbroker.core.authz import DEFAULT_CACHE_SIZE as AUTHZ_CACHE_SIZE

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from pydantic.fields import FieldInfo
    from pydantic_core import ErrorDetails

__all__ = [
    "ENV_PREFIX",
    "AddressConfig",
    "Settings",
    "SettingsError",
    "load_settings",
    "parse_listener",
]

ENV_PREFIX: Final = "AMQBROKER_"
KIB: Final = 1024
MIB: Final = 1024 * KIB
UINT32_MAX: Final = 2**32 - 1


class SettingsError(Exception):
    """The settings could not be loaded; ``str()`` is the complete message for a person.

    `problems` holds one line per problem (a single entry for file-level errors).
    """

    def __init__(self, message: str, problems: Sequence[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems) if problems is not None else [message]

    @classmethod
    def from_problems(cls, problems: Sequence[str]) -> SettingsError:
        if len(problems) == 1:
            return cls(f"invalid setting: {problems[0]}", problems)
        lines = "\n".join(f"  - {p}" for p in problems)
        return cls(f"{len(problems)} problems with the settings:\n{lines}", problems)


# --------------------------------------------------------------------------- field types


def parse_listener(text: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6-address]:port`` for IPv6); ValueError if malformed."""
    usage = "must be host:port, e.g. 0.0.0.0:5673 or [::1]:5673"
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or not rest.startswith(":"):
            raise ValueError(usage)
        port_text = rest[1:]
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon:
            raise ValueError(usage)
        if ":" in host:
            raise ValueError(f"{usage} (put an IPv6 address in brackets)")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"{usage} (the host is missing or contains spaces)")
    if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
        raise ValueError(f"{usage} (the port must be between 0 and 65535)")
    return host, int(port_text)


def _check_listener(text: str) -> str:
    parse_listener(text)
    return text


def _check_host(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("must be a host name or IP address without spaces, e.g. 127.0.0.1")
    return text


def _check_password_hash(stored: str) -> str:
    from amqbroker.core.auth import check_hash_format

    try:
        check_hash_format(stored)
    except ValueError as exc:
        raise ValueError(f"{exc}; create one with `amqbroker hash-password`") from None
    return stored


def _log_level(value: object) -> object:
    if isinstance(value, str):
        value = value.strip().upper()
        return "WARNING" if value == "WARN" else value
    return value


def _data_dir(value: object) -> object:
    if isinstance(value, str | Path):
        if str(value) == "":
            raise ValueError("must not be empty")
        return Path(value).expanduser()
    return value


def _unlimited_or_positive(value: int) -> int:
    if value == 0 or value < -1:
        raise ValueError("must be -1 (unlimited) or at least 1")
    return value


def _off_or_positive(value: float) -> float:
    if value != -1 and value <= 0:
        raise ValueError("must be -1 (off) or greater than 0")
    return value


def _upper(value: object) -> object:
    return value.strip().upper() if isinstance(value, str) else value


def _queue_prefix(value: str) -> str:
    if any(c in value for c in "*#?"):
        raise ValueError("must not contain '*', '#' or '?'")
    return value


def _check_zookeeper(text: str) -> str:
    """``host:port[,host:port...]`` (empty = no ZooKeeper); whitespace around items ok."""
    if not text.strip():
        return ""
    items = [item.strip() for item in text.split(",")]
    for item in items:
        try:
            parse_listener(item)
        except ValueError:
            raise ValueError(
                f"{item!r} is not host:port; give the ZooKeeper servers as "
                "'host:port,host:port', e.g. 127.0.0.1:2181, or leave it empty for a "
                "static arbiter"
            ) from None
    return ",".join(items)


def _check_znode_path(text: str) -> str:
    if text and (not text.startswith("/") or text.endswith("/") or "//" in text):
        raise ValueError(
            "must be an absolute znode path such as /amqbroker/prod (no trailing '/'), "
            "or empty for /amqbroker/default"
        )
    return text


Listener = Annotated[str, AfterValidator(_check_listener)]
Host = Annotated[str, AfterValidator(_check_host)]
UserName = Annotated[str, Field(min_length=1)]
PasswordHash = Annotated[str, AfterValidator(_check_password_hash)]
LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], BeforeValidator(_log_level)]
SlowConsumerPolicy = Annotated[Literal["NOTIFY", "KILL"], BeforeValidator(_upper)]


class AddressConfig(BaseModel):
    """An address created at start-up (one ``[[addresses]]`` entry)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[str, AfterValidator(check_address_name)]
    routing: Routing
    durable: bool = True


_PEER_RE: Final = re.compile(r"^([A-Za-z0-9_-]+)=(.+):(\d{1,5})$")


def parse_peer(text: str) -> tuple[str, str, int]:
    """`id=host:port` -> (id, host, port)."""
    m = _PEER_RE.match(text)
    if m is None or not 0 < int(m.group(3)) <= 65535:
        raise ValueError(
            f"cluster peer {text!r} must look like 'node2=127.0.0.1:5673' (id=host:port)"
        )
    host = m.group(2)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return m.group(1), host, int(m.group(3))


def _cluster_peer(text: str) -> str:
    parse_peer(text)
    return text


_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _node_id(value: str) -> str:
    if value and not _NODE_ID.fullmatch(value):
        raise ValueError(
            "must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or "
            "digit (it names a directory), or empty for <hostname>-<port>"
        )
    return value


class _CrossFieldError(ValueError):
    """A problem involving several settings; `fields` (name -> value) are named in it."""

    def __init__(self, fields: Mapping[str, object], problem: str) -> None:
        super().__init__(problem)
        self.fields = dict(fields)


# ------------------------------------------------------------------------------ Settings


class Settings(BaseSettings):
    """Everything the broker can be configured with; see config/amqbroker.toml.

    Sizes are bytes, durations in seconds unless the name says otherwise. Build one
    with `load_settings` (file + environment + CLI); ``Settings()`` is the defaults.
    """

    model_config = SettingsConfigDict(frozen=True, extra="forbid", validate_default=True)

    # listeners
    host: Host = Field(default="127.0.0.1", description="address the AMQP listener binds")
    port: ConfigInt = Field(default=5672, ge=0, le=65535, description="AMQP port (0 = any)")
    extra_listeners: list[Listener] = Field(
        default_factory=list, description="more listeners, each 'host:port'"
    )

    # TLS (amqbroker.net.tls); file paths are "" when not set
    tls_listeners: list[Listener] = Field(
        default_factory=list, description="TLS (amqps) listeners, each 'host:port'"
    )
    tls_cert_file: str = Field(default="", description="PEM certificate (+ chain)")
    tls_key_file: str = Field(default="", description="PEM private key, unencrypted")
    tls_ca_file: str = Field(default="", description="PEM CAs for client certificates")
    tls_client_auth: Literal["none", "optional", "required"] = "none"
    tls_min_version: Literal["TLSv1.2", "TLSv1.3"] = "TLSv1.2"

    # AMQP over WebSocket (amqbroker.net.websocket); wss uses the tls_* files
    ws_listeners: list[Listener] = Field(
        default_factory=list, description="WebSocket (ws://) listeners, each 'host:port'"
    )
    wss_listeners: list[Listener] = Field(
        default_factory=list, description="WebSocket over TLS (wss://) listeners"
    )
    ws_max_message_size: ConfigInt = Field(default=1 * MIB, ge=512)

    # process
    data_dir: Annotated[Path, BeforeValidator(_data_dir)] = Field(
        default=Path("amqbroker-data"), description="directory of the message store"
    )
    log_level: LogLevel = "INFO"
    shutdown_timeout: ConfigFloat = Field(
        default=10.0, ge=0, description="seconds to drain connections on shutdown"
    )

    # connection limits
    max_connections: ConfigInt = Field(default=1000, ge=1)
    max_connections_per_address: Annotated[ConfigInt, AfterValidator(_unlimited_or_positive)] = 100
    max_frame_size: ConfigInt = Field(default=64 * KIB, ge=512, le=UINT32_MAX)
    channel_max: ConfigInt = Field(default=255, ge=0, le=65535)
    max_sessions_per_connection: ConfigInt = Field(default=64, ge=1, le=65536)
    max_links_per_connection: ConfigInt = Field(default=1000, ge=1, le=UINT32_MAX)
    idle_timeout: ConfigFloat = Field(default=60.0, ge=0, le=UINT32_MAX // 1000)
    handshake_timeout: ConfigFloat = Field(default=10.0, gt=0, le=3600)
    max_message_size: ConfigInt = Field(default=100 * MIB, ge=1)
    link_credit: ConfigInt = Field(default=1000, ge=1, le=UINT32_MAX)
    max_transaction_messages: ConfigInt = Field(default=100_000, ge=1)
    output_high_water: ConfigInt = Field(default=1 * MIB, ge=1)
    output_low_water: ConfigInt = Field(default=256 * KIB, ge=0)
    read_buffer_size: ConfigInt = Field(default=64 * KIB, ge=512)

    # authentication (amqbroker.core.auth, amqbroker.protocol.sasl)
    require_auth: bool = False
    allow_anonymous: bool = True
    users: dict[UserName, PasswordHash] = Field(default_factory=dict)
    tls_identity_users: dict[Annotated[str, Field(min_length=1)], UserName] = Field(
        default_factory=dict, description="TLS client certificate subject -> user (EXTERNAL)"
    )

    # authorisation (amqbroker.core.authz)
    security_enabled: bool = False
    roles: dict[UserName, list[RoleName]] = Field(default_factory=dict)
    security: dict[AddressPattern, SecurityRule] = Field(default_factory=dict)
    security_cache_size: ConfigInt = Field(default=AUTHZ_CACHE_SIZE, ge=0)
    security_relay_cache_size: ConfigInt = Field(default=256, ge=0)

    # message store
    store_sync: bool = True
    store_segment_size: ConfigInt = Field(default=64 * MIB, ge=4 * KIB)
    store_max_batch_bytes: ConfigInt = Field(default=4 * MIB, ge=1)
    store_compact_min_bytes: ConfigInt = Field(default=16 * MIB, ge=0)
    store_compact_live_ratio: ConfigFloat = Field(default=0.5, gt=0, le=1)
    store_delivery_count_before_delivery: bool = True
    # paging (address_full_policy PAGE, amqbroker.store.paging)
    page_size_bytes: ConfigInt = Field(default=10 * MIB, ge=4 * KIB)
    page_read_ahead_bytes: ConfigInt = Field(default=4 * MIB, ge=1)
    page_low_water: ConfigFloat = Field(default=0.5, gt=0, le=1)

    # dispatch and queues
    expiry_scan_period: ConfigFloat = Field(default=30.0, ge=0)
    temporary_queue_prefix: Annotated[str, AfterValidator(_queue_prefix)] = Field(
        default="tmp.", min_length=1
    )
    dispatch_batch: ConfigInt = Field(default=10000, ge=1)
    # management: message ages and group settle times (Queue "admin pause and ages")
    message_age_resolution: ConfigFloat = Field(default=1.0, gt=0)
    message_age_marks: ConfigInt = Field(default=1024, ge=2)
    global_max_size: ConfigInt = Field(default=1 << 30, ge=-1)

    # cluster (issue 15; amqbroker.cluster)
    cluster_node_id: str = Field(default="", pattern=r"^[A-Za-z0-9_-]*$")
    cluster_peers: list[Annotated[str, AfterValidator(_cluster_peer)]] = Field(default_factory=list)
    cluster_user: str = ""
    cluster_password: str = ""
    cluster_reconnect_initial: ConfigFloat = Field(default=0.2, gt=0)
    cluster_reconnect_max: ConfigFloat = Field(default=5.0, gt=0)
    cluster_node_timeout: ConfigFloat = Field(default=5.0, gt=0)
    cluster_node_loss_policy: Literal["wait", "move"] = "wait"
    cluster_topology_period: ConfigFloat = Field(default=0.2, gt=0)
    cluster_duplicate_window: ConfigInt = Field(default=100_000, ge=1)
    cluster_grouping: Literal["", "LOCAL", "REMOTE"] = ""
    grouping_timeout: ConfigInt = Field(default=20000, ge=1)
    grouping_group_timeout: ConfigInt = Field(default=-1, ge=-1)
    grouping_reaper_period: ConfigInt = Field(default=30000, ge=0)
    grouping_timeout_policy: Literal["reject", "ungrouped"] = "reject"
    grouping_retries: ConfigInt = Field(default=10, ge=0, le=1000)
    grouping_consumerless_timeout: ConfigInt = Field(default=-1, ge=-1)

    # slow consumers (amqbroker.core.slow_consumers)
    slow_consumer_threshold: Annotated[ConfigFloat, AfterValidator(_off_or_positive)] = -1.0
    slow_consumer_check_period: ConfigFloat = Field(default=5.0, gt=0, le=86400)
    slow_consumer_policy: SlowConsumerPolicy = "NOTIFY"

    # telemetry (amqbroker.telemetry)
    metrics_prometheus_port: ConfigInt = Field(default=-1, ge=-1, le=65535)
    metrics_prometheus_host: str = Field(default="127.0.0.1", min_length=1)
    metrics_top_groups: ConfigInt = Field(default=10, ge=0, le=1000)
    otlp_endpoint: str = ""
    otlp_export_interval: ConfigFloat = Field(default=30.0, gt=0, le=86400)
    tracing: bool = False
    tracing_sample_ratio: ConfigFloat = Field(default=1.0, ge=0, le=1)

    # node identity and the delivery log
    node_id: Annotated[str, AfterValidator(_node_id)] = ""
    delivery_log: bool = False
    delivery_log_format: Literal["parquet", "jsonl"] = "parquet"
    delivery_log_rotate_bytes: ConfigInt = Field(default=64 * MIB, ge=4 * KIB)
    delivery_log_max_bytes: ConfigInt = Field(default=1 << 30, ge=-1)
    delivery_log_buffer_records: ConfigInt = Field(default=200_000, ge=100)
    delivery_log_overflow: Literal["block", "drop"] = "block"
    delivery_log_flush_interval: ConfigFloat = Field(default=1.0, gt=0, le=3600)

    # addresses
    address_settings: dict[AddressPattern, AddressSettings] = Field(
        default_factory=lambda: {"#": AddressSettings()}
    )
    addresses: list[AddressConfig] = Field(default_factory=list)

    # cluster: arbiter election in ZooKeeper (amqbroker/cluster/election.py)
    cluster_zookeeper: Annotated[str, AfterValidator(_check_zookeeper)] = Field(
        default="", description="ZooKeeper ensemble 'host:port,...'; empty = static arbiter"
    )
    cluster_zookeeper_path: Annotated[str, AfterValidator(_check_znode_path)] = Field(
        default="", description="znode of this cluster's election; empty = /amqbroker/default"
    )
    cluster_zookeeper_session_timeout: ConfigInt = Field(default=10000, ge=200, le=600_000)
    cluster_zookeeper_reconnect_max_delay: ConfigInt = Field(default=2000, ge=10, le=600_000)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Only keyword arguments: load_settings reads file and environment itself.
        return (init_settings,)

    @field_validator("addresses")
    @classmethod
    def _unique_addresses(cls, addresses: list[AddressConfig]) -> list[AddressConfig]:
        seen: set[str] = set()
        for entry in addresses:
            if entry.name in seen:
                raise ValueError(f"address {entry.name!r} is listed more than once")
            seen.add(entry.name)
        return addresses

    @model_validator(mode="after")
    def _cross_checks(self) -> Settings:
        if self.output_low_water >= self.output_high_water:
            raise _CrossFieldError(
                {
                    "output_low_water": self.output_low_water,
                    "output_high_water": self.output_high_water,
                },
                "output_low_water must be less than output_high_water",
            )
        if (self.require_auth or not self.allow_anonymous) and not (
            self.users or self.tls_identity_users
        ):
            policy: dict[str, object] = (
                {"require_auth": True} if self.require_auth else {"allow_anonymous": False}
            )
            raise _CrossFieldError(
                {**policy, "users": self.users, "tls_identity_users": self.tls_identity_users},
                ("require_auth is true" if self.require_auth else "allow_anonymous is false")
                + " but no users are configured, so no client could connect; create a "
                "password hash with `amqbroker hash-password --scram` and add it under "
                '[users] in the config file (alice = "scram-sha-256$...") or as '
                'AMQBROKER_USERS=\'{"alice": "<hash>"}\', map TLS client certificates to '
                "users under [tls_identity_users], or allow anonymous access "
                "(require_auth = false, allow_anonymous = true)",
            )
        known = [*self.users, *self.tls_identity_users.values(), ANONYMOUS_USER]
        for user in self.roles:
            if user not in known:
                close = difflib.get_close_matches(user, known, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise _CrossFieldError(
                    {"roles": self.roles},
                    f"roles names user {user!r}, who is not under [users] or "
                    f"[tls_identity_users] (nor {ANONYMOUS_USER!r}, the user of connections "
                    f"without credentials); {hint}add the user or correct the name",
                )
        if (self.cluster_peers or self.cluster_grouping) and not self.cluster_node_id:
            raise _CrossFieldError(
                {"cluster_node_id": self.cluster_node_id, "cluster_peers": self.cluster_peers},
                "a cluster node needs a cluster_node_id (unique in the cluster, e.g. 'node1')",
            )
        peer_ids = [parse_peer(p)[0] for p in self.cluster_peers]
        if len(set(peer_ids)) != len(peer_ids) or self.cluster_node_id in peer_ids:
            raise _CrossFieldError(
                {"cluster_node_id": self.cluster_node_id, "cluster_peers": self.cluster_peers},
                "every cluster peer needs its own id, different from cluster_node_id",
            )
        if self.cluster_reconnect_initial > self.cluster_reconnect_max:
            raise _CrossFieldError(
                {
                    "cluster_reconnect_initial": self.cluster_reconnect_initial,
                    "cluster_reconnect_max": self.cluster_reconnect_max,
                },
                "cluster_reconnect_initial must not exceed cluster_reconnect_max",
            )
        if 0 <= self.delivery_log_max_bytes < 2 * self.delivery_log_rotate_bytes:
            raise _CrossFieldError(
                {
                    "delivery_log_max_bytes": self.delivery_log_max_bytes,
                    "delivery_log_rotate_bytes": self.delivery_log_rotate_bytes,
                },
                "delivery_log_max_bytes must be at least twice delivery_log_rotate_bytes "
                "(or -1 for no bound), so that the newest complete file is kept",
            )
        seen: dict[tuple[str, int], str] = {}
        if self.port:
            seen[(self.host, self.port)] = "host/port"
        for text in self.extra_listeners:
            listener = parse_listener(text)
            if listener[1] and listener in seen:
                raise _CrossFieldError(
                    {"extra_listeners": self.extra_listeners, "host": self.host, "port": self.port},
                    f"extra listener {text} repeats {seen[listener]}; each listener needs "
                    "its own host:port",
                )
            seen[listener] = f"extra listener {text}"
        self._check_tls(seen)
        return self

    def _check_tls(self, seen: dict[tuple[str, int], str]) -> None:
        """TLS listeners need their own host:port, a certificate and its key; client
        certificates need a CA. The files themselves are checked at start
        (`amqbroker.net.tls.server_context`)."""
        for text in self.tls_listeners:
            listener = parse_listener(text)
            if listener[1] and listener in seen:
                raise _CrossFieldError(
                    {"tls_listeners": self.tls_listeners},
                    f"TLS listener {text} repeats {seen[listener]}; each listener needs "
                    "its own host:port",
                )
            seen[listener] = f"TLS listener {text}"
        self._check_websocket(seen)
        for key in ("tls_listeners", "wss_listeners"):
            for name, what in (("tls_cert_file", "certificate"), ("tls_key_file", "private key")):
                if getattr(self, key) and not getattr(self, name):
                    raise _CrossFieldError(
                        {key: getattr(self, key), name: ""},
                        f"{'TLS' if key == 'tls_listeners' else 'wss (WebSocket over TLS)'} "
                        f"listeners need the broker's {what}: set {name} to a PEM file",
                    )
        if self.tls_client_auth != "none" and not self.tls_ca_file:
            raise _CrossFieldError(
                {"tls_client_auth": self.tls_client_auth, "tls_ca_file": ""},
                "client certificates are verified against tls_ca_file: set it to a PEM "
                'file of the CA certificates, or set tls_client_auth = "none"',
            )

    def _check_websocket(self, seen: dict[tuple[str, int], str]) -> None:
        """WebSocket listeners need their own host:port; a client may send a frame of
        max_frame_size in one message, so ws_max_message_size must allow it."""
        for key, what in (("ws_listeners", "WebSocket"), ("wss_listeners", "wss")):
            for text in getattr(self, key):
                listener = parse_listener(text)
                if listener[1] and listener in seen:
                    raise _CrossFieldError(
                        {key: getattr(self, key)},
                        f"{what} listener {text} repeats {seen[listener]}; each listener "
                        "needs its own host:port",
                    )
                seen[listener] = f"{what} listener {text}"
        if (self.ws_listeners or self.wss_listeners) and (
            self.ws_max_message_size < self.max_frame_size
        ):
            raise _CrossFieldError(
                {
                    "ws_max_message_size": self.ws_max_message_size,
                    "max_frame_size": self.max_frame_size,
                },
                "ws_max_message_size must be at least max_frame_size: a WebSocket client "
                "may send a whole AMQP frame in one message",
            )

    def listen_addresses(self) -> list[tuple[str, int]]:
        """Every (host, port) to listen on: the main listener first, then the extras."""
        return [(self.host, self.port), *(parse_listener(t) for t in self.extra_listeners)]

    def address_settings_repository(
        self, cache_size: int = DEFAULT_CACHE_SIZE
    ) -> AddressSettingsRepository:
        return AddressSettingsRepository(self.address_settings, cache_size=cache_size)


FIELD_NAMES: Final = frozenset(Settings.model_fields)
#: settings given as JSON in environment variables
_JSON_FIELDS: Final = frozenset(
    {"users", "address_settings", "addresses", "roles", "security", "tls_identity_users"}
)
_JSON_EXAMPLES: Final = {
    "users": '{"alice": "scram-sha-256$..."}',
    "tls_identity_users": '{"CN=app1,O=Example": "app1"}',
    "address_settings": '{"orders.#": {"max_delivery_attempts": 5}}',
    "addresses": '[{"name": "orders", "routing": "anycast"}]',
    "roles": '{"alice": ["app"]}',
    "security": '{"orders.#": {"send": ["app"], "consume": ["app"]}}',
    "extra_listeners": '["0.0.0.0:5673"] or 0.0.0.0:5673,[::1]:5674',
    "cluster_peers": '["node2=127.0.0.1:5673"] or node2=127.0.0.1:5673,node3=127.0.0.1:5674',
    "tls_listeners": '["0.0.0.0:5671"] or 0.0.0.0:5671,[::1]:5671',
    "ws_listeners": '["0.0.0.0:5680"] or 0.0.0.0:5680,[::1]:5680',
    "wss_listeners": '["0.0.0.0:5681"] or 0.0.0.0:5681,[::1]:5681',
}
#: listener lists: JSON or a comma-separated list in environment variables
_LISTENER_FIELDS: Final = frozenset(
    {"extra_listeners", "tls_listeners", "ws_listeners", "wss_listeners"}
)
#: values never repeated in messages
_SECRET_FIELDS: Final = frozenset({"users", "cluster_password"})


# ------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class _Source:
    label: str  # "config/amqbroker.toml", "AMQBROKER_PORT", "--port", "default"
    key: str  # the key as written there (snake_case for environment and defaults)
    whole_string: bool = False  # the value is an environment variable's raw text

    def describe(self) -> str:
        return "default" if self.label == "default" else f"from {self.label}"


def load_settings(
    config_file: Path | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    sources_out: dict[str, str] | None = None,
) -> Settings:
    """Build `Settings` from defaults < `config_file` < `environ` < `overrides`.

    `environ` defaults to ``os.environ``; `overrides` holds CLI flags by setting name
    (snake or kebab case), None meaning "not given". Raises `SettingsError`.
    `sources_out`, when given, receives where each setting not left at its default came
    from (name -> the file path, ``AMQBROKER_<NAME>`` or ``--flag``), for
    ``amqbroker config show``.
    """
    values: dict[str, object] = {}
    sources: dict[str, _Source] = {}
    problems: list[str] = []

    if config_file is not None:
        data = _read_toml(Path(config_file))
        label = str(config_file)
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in FIELD_NAMES:
                problems.append(f"unknown key {key!r} in {label}{_did_you_mean(key, FIELD_NAMES)}")
            elif name in sources:
                problems.append(
                    f"{key!r} in {label} sets {name} again (already set as "
                    f"{sources[name].key!r}); keep one of them"
                )
            else:
                values[name] = value
                sources[name] = _Source(label, key)

    env = os.environ if environ is None else environ
    seen_env: set[str] = set()
    undecodable: set[str] = set()
    for var in sorted(env):  # upper-case spellings sort first and win
        if not var.upper().startswith(ENV_PREFIX):
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name not in FIELD_NAMES or name in seen_env:
            continue
        seen_env.add(name)
        source = _Source(var, name, whole_string=True)
        try:
            values[name] = _decode_env(name, env[var])
        except ValueError as exc:
            values.pop(name, None)
            undecodable.add(name)
            problems.append(_line(name, env[var], source, str(exc), whole=True))
        sources[name] = source

    for key, value in (overrides or {}).items():
        if value is None:
            continue
        name = key.replace("-", "_")
        if name not in FIELD_NAMES:
            problems.append(
                f"unknown setting {key!r} given on the command line"
                f"{_did_you_mean(key, FIELD_NAMES)}"
            )
            continue
        values[name] = value
        sources[name] = _Source("--" + name.replace("_", "-"), name)

    try:
        settings = Settings.model_validate(values)
    except ValidationError as exc:
        for err in exc.errors():
            cross = (err.get("ctx") or {}).get("error")
            if isinstance(cross, _CrossFieldError) and undecodable & cross.fields.keys():
                continue  # a consequence of a value already reported as unreadable
            problems.append(_describe_error(err, sources))
    else:
        if not problems:
            if sources_out is not None:
                sources_out.update({name: src.label for name, src in sources.items()})
            return settings
    raise SettingsError.from_problems(problems)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SettingsError(
            f"config file {path} does not exist; check the --config path "
            "(config/amqbroker.toml is an example with every setting)"
        ) from None
    except IsADirectoryError:
        raise SettingsError(f"config file {path} is a directory, not a TOML file") from None
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SettingsError(
            f"config file {path} is not UTF-8 text (bad byte at line {line}); save it as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line, col, msg = _toml_position(exc, text)
        raise SettingsError(f"invalid TOML in {path} at line {line}, column {col}: {msg}") from None


_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")
_AT_END = re.compile(r"\s*\(at end of document\)$")


def _toml_position(exc: tomllib.TOMLDecodeError, text: str) -> tuple[int, int, str]:
    message = str(exc)
    lineno, colno = getattr(exc, "lineno", None), getattr(exc, "colno", None)
    if isinstance(lineno, int) and isinstance(colno, int):  # Python >= 3.14
        return lineno, colno, getattr(exc, "msg", message)
    if m := _POSITION.search(message):
        return int(m[1]), int(m[2]), message[: m.start()]
    last = text.split("\n")
    end_msg = _AT_END.sub("", message)
    return len(last), len(last[-1]) + 1, f"{end_msg} (at the end of the file)"


def _decode_env(name: str, text: str) -> object:
    """Turn an environment variable's text into the value to validate."""
    if name in _JSON_FIELDS or (
        (name in _LISTENER_FIELDS or name == "cluster_peers") and text.lstrip().startswith("[")
    ):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"not valid JSON ({exc.msg} at column {exc.colno}); expected e.g. "
                f"{_JSON_EXAMPLES[name]}"
            ) from None
    if name in _LISTENER_FIELDS or name == "cluster_peers":
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


# ------------------------------------------------------------------------ error messages


def _did_you_mean(key: str, candidates: Iterable[str]) -> str:
    pool = {c: c for c in candidates}
    if "-" in key:
        pool = {c.replace("_", "-"): c for c in pool}
    close = difflib.get_close_matches(key, list(pool), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return "; see config/amqbroker.toml for every setting"


def _path_text(top: str, rest: Sequence[int | str]) -> str:
    text = top
    for part in rest:
        if isinstance(part, int):
            text += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z0-9_-]+", part):
            text += f".{part}"
        else:
            text += "." + json.dumps(part, ensure_ascii=False)
    return text


def _value_text(value: object, source: _Source, whole: bool) -> str:
    if whole and source.whole_string and isinstance(value, str):
        text = value if value and value.strip() == value else json.dumps(value)
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, Path):
        text = json.dumps(str(value), ensure_ascii=False)
    else:
        text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _assignment(field: str, key: str, value: object, source: _Source, whole: bool) -> str:
    """``key = value (from source)``; values of secret fields are not repeated."""
    if field in _SECRET_FIELDS and value not in ({}, ""):
        shown = "<hidden>"
    else:
        shown = _value_text(value, source, whole)
    return f"{key} = {shown} ({source.describe()})"


def _line(field: str, value: object, source: _Source, problem: str, *, whole: bool) -> str:
    return f"{_assignment(field, source.key, value, source, whole)}: {problem}"


def _field_info(top: str, rest: Sequence[int | str]) -> FieldInfo | None:
    if not rest:
        return Settings.model_fields.get(top)
    nested: type[BaseModel] | None = None
    if top == "address_settings" and len(rest) == 2:
        nested = AddressSettings
    elif top == "addresses" and len(rest) == 2:
        nested = AddressConfig
    elif top == "security" and len(rest) == 2:
        nested = SecurityRule
    if nested is None or not isinstance(rest[-1], str):
        return None
    name = rest[-1]
    for field_name, info in nested.model_fields.items():
        if name in (field_name, info.alias):
            return info
    return None


def _nested_candidates(top: str, rest: Sequence[int | str]) -> list[str]:
    if top == "address_settings" and len(rest) == 2:
        return [n for f, i in AddressSettings.model_fields.items() for n in (f, i.alias) if n]
    if top == "addresses" and len(rest) == 2:
        return list(AddressConfig.model_fields)
    if top == "security" and len(rest) == 2:
        return [n for f, i in SecurityRule.model_fields.items() for n in (f, i.alias) if n]
    return []


def _range_text(info: FieldInfo | None, ctx: Mapping[str, Any]) -> str:
    bounds: dict[str, Any] = dict(ctx)
    if info is not None:
        for item in info.metadata:
            for attr in ("ge", "gt", "le", "lt"):
                if getattr(item, attr, None) is not None:
                    bounds[attr] = getattr(item, attr)
    if "ge" in bounds and "le" in bounds:
        return f"must be between {bounds['ge']} and {bounds['le']}"
    parts = []
    if "ge" in bounds:
        parts.append(f"at least {bounds['ge']}")
    if "gt" in bounds:
        parts.append(f"greater than {bounds['gt']}")
    if "le" in bounds:
        parts.append(f"at most {bounds['le']}")
    if "lt" in bounds:
        parts.append(f"less than {bounds['lt']}")
    return "must be " + " and ".join(parts)


_SIMPLE_MESSAGES: Final = {
    "int_parsing": "must be a whole number",
    "int_type": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "string_too_short": "must not be empty",
    "too_short": "must not be empty",
    "dict_type": "must be a table (a JSON object in an environment variable)",
    "list_type": "must be a list",
    "model_type": "must be a table (a JSON object in an environment variable)",
    "model_attributes_type": "must be a table (a JSON object in an environment variable)",
    "path_type": "must be a path",
    "missing": "is required",
}


def _describe_error(err: ErrorDetails, sources: Mapping[str, _Source]) -> str:
    loc = err["loc"]
    ctx: Mapping[str, Any] = err.get("ctx") or {}
    kind = err["type"]
    if not loc:
        exc = ctx.get("error")
        if not isinstance(exc, _CrossFieldError):
            return str(exc) if exc is not None else err["msg"]
        named = []
        for name, value in exc.fields.items():
            source = sources.get(name, _Source("default", name))
            named.append(_assignment(name, source.key, value, source, whole=False))
        return ", ".join(named) + f": {exc}"

    top = str(loc[0])
    rest = list(loc[1:])
    is_key = bool(rest) and rest[-1] == "[key]"
    if is_key:
        rest = rest[:-1]
    source = sources.get(top, _Source("default", top))
    path = _path_text(source.key, rest)

    if kind == "extra_forbidden":
        problem = "unknown key" + _did_you_mean(str(rest[-1]), _nested_candidates(top, rest))
    elif kind == "value_error":
        problem = str(ctx.get("error", err["msg"]))
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        problem = _range_text(_field_info(top, rest), ctx)
    elif kind == "literal_error":
        problem = f"must be {ctx.get('expected', '')}"
    elif kind in _SIMPLE_MESSAGES:
        problem = _SIMPLE_MESSAGES[kind]
    else:
        msg = err["msg"]
        problem = msg[:1].lower() + msg[1:]

    if is_key or kind == "missing":
        return f"{path} ({source.describe()}): {problem}"
    key_value = _assignment(top, path, err["input"], source, whole=not rest)
    return f"{key_value}: {problem}"
