"""Settings: sources and precedence, validation messages, the example config file."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from amqbroker.core.address_settings import AddressSettings, ResolvedAddressSettings
from amqbroker.core.auth import hash_password
from amqbroker.settings import (
    AddressConfig,
    Settings,
    SettingsError,
    load_settings,
    parse_listener,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "amqbroker.toml"
GOOD_HASH = hash_password("secret", iterations=1, salt=b"0123456789abcdef")


def write(tmp_path: Path, text: str, name: str = "amqbroker.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load(
    config_file: Path | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    return load_settings(config_file, overrides, environ if environ is not None else {})


def problems_of(
    config_file: Path | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> SettingsError:
    with pytest.raises(SettingsError) as info:
        load(config_file, overrides, environ)
    return info.value


# ------------------------------------------------------------------------------ defaults


def test_defaults() -> None:
    s = Settings()
    assert (s.host, s.port, s.extra_listeners) == ("127.0.0.1", 5672, [])
    assert s.data_dir == Path("amqbroker-data")
    assert s.log_level == "INFO"
    assert s.shutdown_timeout == 10
    assert s.max_connections == 1000
    assert s.max_frame_size == 65536
    assert s.channel_max == 255
    assert s.max_sessions_per_connection == 64
    assert s.max_links_per_connection == 1000
    assert s.idle_timeout == 60
    assert s.handshake_timeout == 10
    assert s.max_message_size == 100 * 1024 * 1024
    assert s.link_credit == 1000
    assert s.output_high_water == 1024 * 1024
    assert s.output_low_water == 256 * 1024
    assert s.read_buffer_size == 64 * 1024
    assert s.require_auth is False and s.users == {}
    assert s.store_sync is True
    assert s.store_segment_size == 64 * 1024 * 1024
    assert s.store_max_batch_bytes == 4 * 1024 * 1024
    assert s.store_compact_min_bytes == 16 * 1024 * 1024
    assert s.store_compact_live_ratio == 0.5
    assert s.expiry_scan_period == 30
    assert s.temporary_queue_prefix == "tmp."
    assert s.dispatch_batch == 10000
    assert s.address_settings == {"#": AddressSettings()}
    assert s.addresses == []


def test_settings_constructor_does_not_read_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AMQBROKER_PORT", "1234")
    assert Settings().port == 5672
    assert Settings.model_validate({}).port == 5672
    assert load_settings(environ={"AMQBROKER_PORT": "1234"}).port == 1234


def test_load_settings_reads_os_environ_when_environ_is_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AMQBROKER_PORT", "1234")
    assert load_settings().port == 1234


def test_no_sources_gives_defaults() -> None:
    assert load().model_dump() == Settings().model_dump()


# -------------------------------------------------------------------------- the example


def test_example_config_loads_to_exactly_the_defaults() -> None:
    assert load(EXAMPLE).model_dump() == Settings().model_dump()


def test_example_config_names_every_setting() -> None:
    data = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))
    assert set(data) == set(Settings.model_fields)


def test_example_config_documents_every_address_setting_with_its_default() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    section = text[text.index('[address_settings."#"]') :]
    documented: dict[str, object] = {}
    for line in section.splitlines():
        m = re.fullmatch(r"# ([a-z_]+) = (.+)", line)
        if m:
            documented.update(tomllib.loads(line[2:]))
    defaults = ResolvedAddressSettings().model_dump()
    assert set(documented) == set(defaults)
    for key, value in defaults.items():
        if value is not None:  # None defaults are shown with an example value
            assert documented[key] == value, key


def test_example_config_comments_every_key() -> None:
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if re.match(r"[a-z_]+ = ", line):
            assert lines[i - 1].startswith("#"), f"{line!r} has no comment"
            block = []
            j = i - 1
            while j >= 0 and lines[j].startswith("#"):
                block.append(lines[j])
                j -= 1
            assert "Default" in " ".join(block), f"{line!r} does not state its default"


# ------------------------------------------------------------------------- precedence


def test_precedence_file_env_cli(tmp_path: Path) -> None:
    cfg = write(tmp_path, 'port = 1000\nhost = "0.0.0.0"\nmax_frame_size = 4096\n')
    env = {"AMQBROKER_PORT": "2000", "AMQBROKER_MAX_FRAME_SIZE": "8192"}
    s = load(cfg, {"port": 3000, "host": None}, env)
    assert (s.port, s.host, s.max_frame_size) == (3000, "0.0.0.0", 8192)
    s = load(cfg, None, env)
    assert (s.port, s.max_frame_size) == (2000, 8192)
    s = load(cfg)
    assert (s.port, s.max_frame_size) == (1000, 4096)
    assert load(None, {"data-dir": "/srv/q"}).data_dir == Path("/srv/q")


def test_env_replaces_a_structured_value_from_the_file(tmp_path: Path) -> None:
    cfg = write(tmp_path, '[address_settings."orders.#"]\nmax_delivery_attempts = 5\n')
    env = {"AMQBROKER_ADDRESS_SETTINGS": '{"#": {"max_delivery_attempts": 7}}'}
    s = load(cfg, None, env)
    assert s.address_settings == {"#": AddressSettings(max_delivery_attempts=7)}


def test_kebab_case_keys(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        "max-frame-size = 131072\nstore-sync = false\n"
        '[address-settings."orders.#"]\nmax-delivery-attempts = 3\n'
        "default-address-routing-type = 'multicast'\n",
    )
    s = load(cfg)
    assert s.max_frame_size == 131072 and s.store_sync is False
    resolved = s.address_settings_repository().resolve("orders.eu")
    assert resolved.max_delivery_attempts == 3
    assert resolved.default_routing_type == "multicast"


def test_same_setting_in_snake_and_kebab_case_is_an_error(tmp_path: Path) -> None:
    cfg = write(tmp_path, "max-frame-size = 1024\nmax_frame_size = 2048\n")
    err = problems_of(cfg)
    assert "max_frame_size" in str(err) and "keep one" in str(err)


def test_env_names_are_case_insensitive_and_unknown_ones_ignored() -> None:
    env = {"amqbroker_Port": "7000", "AMQBROKER_NO_SUCH_THING": "x", "AMQBROKER_CONFIG": "/x"}
    assert load(environ=env).port == 7000


# ----------------------------------------------------------------- env var encodings


def test_env_json_for_structured_settings() -> None:
    env = {
        "AMQBROKER_ADDRESS_SETTINGS": json.dumps(
            {"orders.#": {"max-delivery-attempts": 2, "dead_letter_address": "DLQ"}}
        ),
        "AMQBROKER_USERS": json.dumps({"alice": GOOD_HASH}),
        "AMQBROKER_REQUIRE_AUTH": "true",
        "AMQBROKER_EXTRA_LISTENERS": '["0.0.0.0:5673", "[::1]:5674"]',
        "AMQBROKER_ADDRESSES": '[{"name": "orders", "routing": "anycast"}]',
    }
    s = load(environ=env)
    assert s.address_settings == {
        "orders.#": AddressSettings(max_delivery_attempts=2, dead_letter_address="DLQ")
    }
    assert s.users == {"alice": GOOD_HASH}
    assert s.require_auth is True
    assert s.extra_listeners == ["0.0.0.0:5673", "[::1]:5674"]
    assert s.addresses == [AddressConfig(name="orders", routing="anycast", durable=True)]
    assert s.listen_addresses() == [("127.0.0.1", 5672), ("0.0.0.0", 5673), ("::1", 5674)]


def test_env_extra_listeners_comma_separated() -> None:
    s = load(environ={"AMQBROKER_EXTRA_LISTENERS": "0.0.0.0:5673, [::]:5674,"})
    assert s.extra_listeners == ["0.0.0.0:5673", "[::]:5674"]


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("AMQBROKER_ADDRESS_SETTINGS", "{orders: 1}"),
        ("AMQBROKER_ADDRESSES", "[{"),
        ("AMQBROKER_EXTRA_LISTENERS", '["a:1",'),
    ],
)
def test_env_invalid_json_names_the_variable(var: str, value: str) -> None:
    message = str(problems_of(environ={var: value}))
    assert f"(from {var})" in message
    assert "not valid JSON" in message
    assert "expected e.g." in message


def test_env_invalid_users_json_does_not_repeat_the_value() -> None:
    env = {"AMQBROKER_USERS": '{"alice": "hunter2"', "AMQBROKER_REQUIRE_AUTH": "true"}
    err = problems_of(environ=env)
    assert "AMQBROKER_USERS" in str(err) and "not valid JSON" in str(err)
    assert "hunter2" not in str(err)
    # no follow-on "require_auth without users" complaint
    assert len(err.problems) == 1


# ------------------------------------------------------------------ validation errors


@pytest.mark.parametrize(
    ("key", "toml_value", "env_value", "shown", "allowed"),
    [
        ("port", "99999", "99999", "99999", "must be between 0 and 65535"),
        ("port", "true", None, "true", "not true/false"),
        ("port", '"http"', "http", '"http"', "must be a whole number"),
        ("host", '"a b"', None, '"a b"', "without spaces"),
        ("max_frame_size", "100", "100", "100", "must be between 512 and 4294967295"),
        ("channel_max", "-1", "-1", "-1", "must be between 0 and 65535"),
        ("max_connections", "0", "0", "0", "must be at least 1"),
        ("idle_timeout", "-1.5", "-1.5", "-1.5", "between 0 and 4294967"),
        ("idle_timeout", "nan", "nan", "nan", "between 0 and 4294967"),
        ("shutdown_timeout", "inf", "inf", "inf", "must be a finite number"),
        ("max_message_size", "0", "0", "0", "must be at least 1"),
        ("link_credit", "0", "0", "0", "between 1 and"),
        ("read_buffer_size", "10", "10", "10", "at least 512"),
        ("shutdown_timeout", '"soon"', "soon", '"soon"', "must be a number"),
        ("log_level", '"LOUD"', "LOUD", '"LOUD"', "'DEBUG', 'INFO', 'WARNING' or 'ERROR'"),
        ("store_sync", '"maybe"', "maybe", '"maybe"', "must be true or false"),
        ("store_compact_live_ratio", "0", "0", "0", "greater than 0 and at most 1"),
        ("store_compact_live_ratio", "1.5", "1.5", "1.5", "greater than 0 and at most 1"),
        ("store_segment_size", "1", "1", "1", "at least 4096"),
        ("temporary_queue_prefix", '""', "", '""', "must not be empty"),
        ("temporary_queue_prefix", '"tmp.#"', "tmp.#", '"tmp.#"', "'*', '#' or '?'"),
        ("data_dir", '""', "", '""', "must not be empty"),
        ("dispatch_batch", "0", "0", "0", "must be at least 1"),
        ("expiry_scan_period", "-1", "-1", "-1", "must be at least 0"),
    ],
)
def test_validation_errors_name_key_value_source_and_rule(
    tmp_path: Path,
    key: str,
    toml_value: str,
    env_value: str | None,
    shown: str,
    allowed: str,
) -> None:
    cfg = write(tmp_path, f"{key} = {toml_value}\n")
    message = str(problems_of(cfg))
    assert f"{key} = {shown} (from {cfg}): " in message
    assert allowed in message
    if env_value is not None:
        var = f"AMQBROKER_{key.upper()}"
        message = str(problems_of(environ={var: env_value}))
        env_shown = env_value or '""'
        assert f"{key} = {env_shown} (from {var}): " in message
        assert allowed in message


def test_example_from_the_issue() -> None:
    err = problems_of(environ={"AMQBROKER_PORT": "99999"})
    assert str(err) == (
        "invalid setting: port = 99999 (from AMQBROKER_PORT): must be between 0 and 65535"
    )
    assert err.problems == ["port = 99999 (from AMQBROKER_PORT): must be between 0 and 65535"]


def test_cli_errors_name_the_flag() -> None:
    message = str(problems_of(overrides={"port": 70000}))
    assert "port = 70000 (from --port): must be between 0 and 65535" in message
    message = str(problems_of(overrides={"data_dir": ""}))
    assert "(from --data-dir)" in message


def test_unknown_override_is_an_error() -> None:
    assert "unknown setting 'prot'" in str(problems_of(overrides={"prot": 1}))


def test_several_errors_are_listed_in_one_message(tmp_path: Path) -> None:
    cfg = write(tmp_path, "port = -1\nchannel_max = 70000\nmax_frame_sise = 1\n")
    err = problems_of(cfg, {"max_connections": 0}, {"AMQBROKER_LINK_CREDIT": "many"})
    message = str(err)
    assert message.startswith("5 problems with the settings:\n")
    assert len(err.problems) == 5
    for fragment in [
        "port = -1 (from",
        "channel_max = 70000 (from",
        "unknown key 'max_frame_sise'",
        "max_connections = 0 (from --max-connections)",
        "link_credit = many (from AMQBROKER_LINK_CREDIT)",
    ]:
        assert fragment in message


# ------------------------------------------------------------------------ unknown keys


def test_unknown_key_suggests_the_closest_setting(tmp_path: Path) -> None:
    message = str(problems_of(write(tmp_path, "max_frame_sise = 1024\n")))
    assert "unknown key 'max_frame_sise'" in message
    assert str(tmp_path) in message
    assert "did you mean 'max_frame_size'?" in message
    message = str(problems_of(write(tmp_path, "max-frame-sise = 1024\n")))
    assert "did you mean 'max-frame-size'?" in message


def test_unknown_key_without_a_close_match(tmp_path: Path) -> None:
    message = str(problems_of(write(tmp_path, "banana = 1\n")))
    assert "unknown key 'banana'" in message
    assert "did you mean" not in message


def test_unknown_nested_key_suggests_the_closest(tmp_path: Path) -> None:
    cfg = write(tmp_path, '[address_settings."orders.#"]\nmax-delivary-attempts = 3\n')
    message = str(problems_of(cfg))
    assert 'address_settings."orders.#".max-delivary-attempts = 3' in message
    assert "did you mean 'max-delivery-attempts'?" in message
    cfg = write(tmp_path, '[[addresses]]\nname = "q"\nrouting = "anycast"\ndurabel = true\n')
    assert "did you mean 'durable'?" in str(problems_of(cfg))


# ---------------------------------------------------------------------- file problems


def test_missing_config_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    message = str(problems_of(path))
    assert str(path) in message and "does not exist" in message


def test_config_file_that_is_a_directory(tmp_path: Path) -> None:
    assert "is a directory" in str(problems_of(tmp_path))


def test_config_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b'host = "\xff"\n')
    message = str(problems_of(path))
    assert str(path) in message and "UTF-8" in message


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [
        ("port = 5672\nhost = \n", 2, 8),
        ("port = 5672\n\n[users\n", 3, 7),
        ("port = 5672\nport = 5673\n", 2, 12),
    ],
)
def test_invalid_toml_reports_file_line_and_column(
    tmp_path: Path, text: str, line: int, column: int
) -> None:
    cfg = write(tmp_path, text)
    message = str(problems_of(cfg))
    assert f"invalid TOML in {cfg} at line {line}, column {column}: " in message


def test_invalid_toml_at_end_of_file_still_has_a_position(tmp_path: Path) -> None:
    cfg = write(tmp_path, "extra_listeners = [\n")
    assert re.search(r"at line \d+, column \d+: ", str(problems_of(cfg)))


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbfport = 6000\n")
    assert load(path).port == 6000


# ------------------------------------------------------------------------------- auth


def test_users_with_valid_hashes(tmp_path: Path) -> None:
    cfg = write(tmp_path, f'require_auth = true\n[users]\nalice = "{GOOD_HASH}"\n')
    s = load(cfg)
    assert s.require_auth and s.users == {"alice": GOOD_HASH}


def test_bad_password_hash_names_the_user_but_not_the_value(tmp_path: Path) -> None:
    cfg = write(tmp_path, '[users]\nalice = "hunter2"\n')
    message = str(problems_of(cfg))
    assert f"users.alice = <hidden> (from {cfg}): invalid password hash" in message
    assert "hunter2" not in message
    assert "amqbroker hash-password" in message


def test_empty_user_name(tmp_path: Path) -> None:
    cfg = write(tmp_path, f'[users]\n"" = "{GOOD_HASH}"\n')
    assert "must not be empty" in str(problems_of(cfg))


def test_require_auth_without_users_says_how_to_add_one() -> None:
    message = str(problems_of(environ={"AMQBROKER_REQUIRE_AUTH": "yes"}))
    assert "require_auth = true (from AMQBROKER_REQUIRE_AUTH)" in message
    assert "no users" in message
    assert "amqbroker hash-password" in message


# --------------------------------------------------------------------- cross-field rules


def test_low_water_must_be_below_high_water() -> None:
    env = {"AMQBROKER_OUTPUT_LOW_WATER": "2000000"}
    message = str(problems_of(environ=env))
    assert "output_low_water = 2000000 (from AMQBROKER_OUTPUT_LOW_WATER)" in message
    assert "output_high_water = 1048576 (default)" in message
    assert "must be less than output_high_water" in message
    s = load(environ={**env, "AMQBROKER_OUTPUT_HIGH_WATER": "4000000"})
    assert s.output_low_water < s.output_high_water


# -------------------------------------------------------------------------- listeners


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.0.0.0:5673", ("0.0.0.0", 5673)),
        ("broker.example:0", ("broker.example", 0)),
        ("[::1]:5674", ("::1", 5674)),
        ("[::]:65535", ("::", 65535)),
    ],
)
def test_parse_listener(text: str, expected: tuple[str, int]) -> None:
    assert parse_listener(text) == expected


@pytest.mark.parametrize(
    "text", ["5673", "host:", ":5673", "::1:5673", "[::1]5673", "h:65536", "h:-1", "h:x"]
)
def test_bad_listeners(tmp_path: Path, text: str) -> None:
    cfg = write(tmp_path, f'extra_listeners = ["0.0.0.0:1", "{text}"]\n')
    message = str(problems_of(cfg))
    assert f'extra_listeners[1] = "{text}" (from {cfg}): must be host:port' in message


def test_duplicate_listener() -> None:
    message = str(problems_of(environ={"AMQBROKER_EXTRA_LISTENERS": "127.0.0.1:5672"}))
    assert "repeats host/port" in message
    message = str(problems_of(environ={"AMQBROKER_EXTRA_LISTENERS": "a:1,a:1"}))
    assert "repeats extra listener a:1" in message
    # port 0 (ephemeral) never clashes
    load(environ={"AMQBROKER_PORT": "0", "AMQBROKER_EXTRA_LISTENERS": "127.0.0.1:0"})


# --------------------------------------------------------------- addresses and patterns


def test_addresses(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        'addresses = [{ name = "orders", routing = "ANYCAST" },'
        ' { name = "prices", routing = "multicast", durable = false }]\n',
    )
    assert load(cfg).addresses == [
        AddressConfig(name="orders", routing="anycast"),
        AddressConfig(name="prices", routing="multicast", durable=False),
    ]


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ('{ name = "orders" }', "addresses[0].routing (from {cfg}): is required"),
        ('{ name = "a.#", routing = "anycast" }', 'addresses[0].name = "a.#"'),
        ('{ name = "", routing = "anycast" }', "must not be empty"),
        ('{ name = "q", routing = "fanout" }', "'anycast' or 'multicast'"),
    ],
)
def test_bad_addresses(tmp_path: Path, entry: str, fragment: str) -> None:
    cfg = write(tmp_path, f"addresses = [{entry}]\n")
    assert fragment.format(cfg=cfg) in str(problems_of(cfg))


def test_duplicate_address(tmp_path: Path) -> None:
    line = '{ name = "q", routing = "anycast" }'
    cfg = write(tmp_path, f"addresses = [{line}, {line}]\n")
    assert "'q' is listed more than once" in str(problems_of(cfg))


def test_bad_address_pattern_is_named(tmp_path: Path) -> None:
    cfg = write(tmp_path, '[address_settings."ord*"]\nmax_delivery_attempts = 3\n')
    message = str(problems_of(cfg))
    assert f'address_settings."ord*" (from {cfg}): invalid address pattern' in message


def test_bad_address_setting_value_is_named(tmp_path: Path) -> None:
    cfg = write(tmp_path, '[address_settings."orders.#"]\nmax_delivery_attempts = 0\n')
    message = str(problems_of(cfg))
    assert (
        f'address_settings."orders.#".max_delivery_attempts = 0 (from {cfg}): '
        "must be -1 (unlimited) or at least 1"
    ) in message


def test_address_settings_repository_from_settings(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        '[address_settings."#"]\ndead_letter_address = "DLQ"\n'
        '[address_settings."orders.*"]\nmax_delivery_attempts = 4\n',
    )
    repo = load(cfg).address_settings_repository(cache_size=8)
    r = repo.resolve("orders.eu")
    assert (r.max_delivery_attempts, r.dead_letter_address) == (4, "DLQ")


# -------------------------------------------------------------------------- odds and ends


def test_log_level_is_case_insensitive() -> None:
    assert load(environ={"AMQBROKER_LOG_LEVEL": "debug"}).log_level == "DEBUG"
    assert load(environ={"AMQBROKER_LOG_LEVEL": "warn"}).log_level == "WARNING"


def test_data_dir_expands_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load(overrides={"data_dir": "~/store"}).data_dir == tmp_path / "store"


def test_settings_are_frozen() -> None:
    s = Settings()
    with pytest.raises(Exception, match="frozen"):
        s.port = 1
