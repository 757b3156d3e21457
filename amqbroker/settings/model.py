"""`Settings`: every setting, its type, default and bounds (config/amqbroker.toml
describes each one). The cross-field checks are `amqbroker.settings.checks`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from amqbroker.core.address_settings import (
    DEFAULT_CACHE_SIZE,
    AddressPattern,
    AddressSettings,
    AddressSettingsRepository,
    ConfigFloat,
    ConfigInt,
)
from amqbroker.core.authz import DEFAULT_CACHE_SIZE as AUTHZ_CACHE_SIZE
from amqbroker.core.authz import RoleName, SecurityRule
from amqbroker.settings.checks import check_cross_fields
from amqbroker.settings.fields import (
    KIB,
    MIB,
    UINT32_MAX,
    AddressConfig,
    Host,
    Listener,
    LogLevel,
    PasswordHash,
    SlowConsumerPolicy,
    UserName,
    check_cluster_peer,
    check_node_id,
    check_optional_listener,
    check_queue_prefix,
    check_znode_path,
    check_zookeeper,
    off_or_positive,
    parse_data_dir,
    parse_listener,
    unlimited_or_positive,
)


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
    data_dir: Annotated[Path, BeforeValidator(parse_data_dir)] = Field(
        default=Path("amqbroker-data"), description="directory of the message store"
    )
    log_level: LogLevel = "INFO"
    shutdown_timeout: ConfigFloat = Field(
        default=10.0, ge=0, description="seconds to drain connections on shutdown"
    )
    #: Python's cyclic garbage collector: net allocations of tracked objects between
    #: two young-generation collections (`amqbroker.cli.server`; Python's default 700)
    gc_young_threshold: ConfigInt = Field(default=10_000, ge=1)

    # connection limits
    max_connections: ConfigInt = Field(default=1000, ge=1)
    max_connections_per_address: Annotated[ConfigInt, AfterValidator(unlimited_or_positive)] = 100
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
    temporary_queue_prefix: Annotated[str, AfterValidator(check_queue_prefix)] = Field(
        default="tmp.", min_length=1
    )
    dispatch_batch: ConfigInt = Field(default=10000, ge=1)
    # management: message ages and group settle times (Queue "admin pause and ages")
    message_age_resolution: ConfigFloat = Field(default=1.0, gt=0)
    message_age_marks: ConfigInt = Field(default=1024, ge=2)
    global_max_size: ConfigInt = Field(default=1 << 30, ge=-1)

    # cluster (issue 15; amqbroker.cluster)
    cluster_node_id: str = Field(default="", pattern=r"^[A-Za-z0-9_-]*$")
    cluster_peers: list[Annotated[str, AfterValidator(check_cluster_peer)]] = Field(
        default_factory=list
    )
    cluster_user: str = ""
    #: the broker's own outbound links (cluster peers, an HA backup's stream) use TLS
    cluster_tls: bool = False
    cluster_tls_ca_file: str = ""
    cluster_password: str = ""
    cluster_reconnect_initial: ConfigFloat = Field(default=0.2, gt=0)
    cluster_reconnect_max: ConfigFloat = Field(default=5.0, gt=0)
    cluster_node_timeout: ConfigFloat = Field(default=5.0, gt=0)
    cluster_node_loss_policy: Literal["wait", "move"] = "wait"
    cluster_accept_after_forward: bool = True
    cluster_topology_period: ConfigFloat = Field(default=0.2, gt=0)
    cluster_duplicate_window: ConfigInt = Field(default=100_000, ge=1)
    cluster_grouping: Literal["", "LOCAL", "REMOTE"] = ""
    grouping_timeout: ConfigInt = Field(default=20000, ge=1)
    grouping_group_timeout: ConfigInt = Field(default=-1, ge=-1)
    grouping_reaper_period: ConfigInt = Field(default=30000, ge=0)
    grouping_timeout_policy: Literal["reject", "ungrouped"] = "reject"
    grouping_retries: ConfigInt = Field(default=10, ge=0, le=1000)
    grouping_consumerless_timeout: ConfigInt = Field(default=-1, ge=-1)

    # primary/backup replication (issue 23; amqbroker.ha)
    ha_role: Literal["", "primary", "backup"] = ""
    ha_primary: Annotated[str, AfterValidator(check_optional_listener)] = ""
    ha_advertise: Annotated[str, AfterValidator(check_optional_listener)] = ""
    ha_sync: bool = True
    ha_window: ConfigInt = Field(default=64, ge=1, le=10_000)
    ha_chunk_bytes: ConfigInt = Field(default=MIB, ge=4 * KIB, le=64 * MIB)
    ha_max_queued_bytes: ConfigInt = Field(default=256 * MIB, ge=MIB)
    ha_ack_timeout: ConfigFloat = Field(default=10.0, gt=0, le=3600)
    ha_unreplicated: Literal["continue", "refuse"] = "continue"
    ha_failback: bool = False

    # slow consumers (amqbroker.core.slow_consumers)
    slow_consumer_threshold: Annotated[ConfigFloat, AfterValidator(off_or_positive)] = -1.0
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
    node_id: Annotated[str, AfterValidator(check_node_id)] = ""
    delivery_log: bool = False
    delivery_log_format: Literal["parquet", "jsonl"] = "parquet"
    delivery_log_rotate_bytes: ConfigInt = Field(default=64 * MIB, ge=4 * KIB)
    delivery_log_max_bytes: ConfigInt = Field(default=1 << 30, ge=-1)
    delivery_log_buffer_records: ConfigInt = Field(default=200_000, ge=100)
    delivery_log_overflow: Literal["block", "drop"] = "block"
    delivery_log_flush_interval: ConfigFloat = Field(default=1.0, gt=0, le=3600)
    delivery_log_child_failures: ConfigInt = Field(default=3, ge=1, le=1000)
    delivery_log_child_exit_timeout: ConfigFloat = Field(default=10.0, gt=0, le=3600)

    # addresses
    address_settings: dict[AddressPattern, AddressSettings] = Field(
        default_factory=lambda: {"#": AddressSettings()}
    )
    addresses: list[AddressConfig] = Field(default_factory=list)

    # cluster: arbiter election in ZooKeeper (amqbroker/cluster/election.py)
    cluster_zookeeper: Annotated[str, AfterValidator(check_zookeeper)] = Field(
        default="", description="ZooKeeper ensemble 'host:port,...'; empty = static arbiter"
    )
    cluster_zookeeper_path: Annotated[str, AfterValidator(check_znode_path)] = Field(
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
        check_cross_fields(self)
        return self

    def listen_addresses(self) -> list[tuple[str, int]]:
        """Every (host, port) to listen on: the main listener first, then the extras."""
        return [(self.host, self.port), *(parse_listener(t) for t in self.extra_listeners)]

    def address_settings_repository(
        self, cache_size: int = DEFAULT_CACHE_SIZE
    ) -> AddressSettingsRepository:
        return AddressSettingsRepository(self.address_settings, cache_size=cache_size)
