"""The WebSocket listener settings: parsing, defaults and the errors that name them."""

from __future__ import annotations

import pytest

from amqbroker.settings import Settings, SettingsError, load_settings


def test_defaults() -> None:
    s = Settings()
    assert s.ws_listeners == [] and s.wss_listeners == []
    assert s.ws_max_message_size == 1024 * 1024


def test_listeners_from_the_environment_as_a_list_or_json() -> None:
    s = load_settings(None, None, {"AMQBROKER_WS_LISTENERS": "127.0.0.1:5680,[::1]:5680"})
    assert s.ws_listeners == ["127.0.0.1:5680", "[::1]:5680"]
    env = {
        "AMQBROKER_WSS_LISTENERS": '["127.0.0.1:5681"]',
        "AMQBROKER_TLS_CERT_FILE": "broker.crt",
        "AMQBROKER_TLS_KEY_FILE": "broker.key",
    }
    assert load_settings(None, None, env).wss_listeners == ["127.0.0.1:5681"]


@pytest.mark.parametrize(
    ("env", "phrases"),
    [
        ({"AMQBROKER_WS_LISTENERS": "5680"}, ["ws_listeners", "must be host:port"]),
        (
            {"AMQBROKER_WSS_LISTENERS": "127.0.0.1:5681"},
            ["wss (WebSocket over TLS) listeners need", "tls_cert_file"],
        ),
        (
            {"AMQBROKER_WS_LISTENERS": "127.0.0.1:5672"},
            ["WebSocket listener 127.0.0.1:5672 repeats host/port"],
        ),
        (
            {
                "AMQBROKER_WS_LISTENERS": "127.0.0.1:5680",
                "AMQBROKER_WSS_LISTENERS": "127.0.0.1:5680",
                "AMQBROKER_TLS_CERT_FILE": "c",
                "AMQBROKER_TLS_KEY_FILE": "k",
            },
            ["wss listener 127.0.0.1:5680 repeats WebSocket listener 127.0.0.1:5680"],
        ),
        (
            {"AMQBROKER_WS_LISTENERS": "127.0.0.1:5680", "AMQBROKER_WS_MAX_MESSAGE_SIZE": "1000"},
            ["ws_max_message_size must be at least max_frame_size"],
        ),
        ({"AMQBROKER_WS_MAX_MESSAGE_SIZE": "100"}, ["ws_max_message_size", "512"]),
    ],
)
def test_invalid_settings_name_the_setting(env: dict[str, str], phrases: list[str]) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(None, None, env)
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)


def test_message_size_below_frame_size_is_fine_without_websocket_listeners() -> None:
    assert Settings(ws_max_message_size=1000).ws_max_message_size == 1000
