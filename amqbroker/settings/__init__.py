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

Modules: `model` (the `Settings` fields), `fields` (value types and validators,
`AddressConfig`), `checks` (the checks across several settings), `loading`
(`load_settings`, `SettingsError`) and `messages` (the problem lines).
"""

from amqbroker.settings.fields import AddressConfig, parse_listener, parse_peer
from amqbroker.settings.loading import ENV_PREFIX, SettingsError, load_settings
from amqbroker.settings.model import Settings

__all__ = [
    "ENV_PREFIX",
    "AddressConfig",
    "Settings",
    "SettingsError",
    "load_settings",
    "parse_listener",
    "parse_peer",
]
