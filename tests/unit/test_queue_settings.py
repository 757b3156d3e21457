"""The queue settings table (`amqbroker.core.queue_settings`) and what is derived from
it: the address-settings models, queue options, `QueuePolicy`, management, the CLI,
the example config and the README."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import get_args

import pytest
from click.testing import CliRunner

from amqbroker.cli import main
from amqbroker.cli.admin import _option_body
from amqbroker.core.address_settings import (
    _VALUE_TYPES,
    QUEUE_OPTION_KEYS,
    AddressSettings,
    AddressSettingsRepository,
    GroupOwnerPolicy,
    QueueConfig,
    QueueOptions,
    ResolvedAddressSettings,
    parse_address_options,
)
from amqbroker.core.broker import Broker
from amqbroker.core.queue import QueuePolicy
from amqbroker.core.queue_settings import (
    GROUP_OWNER_POLICIES,
    OPTIONS,
    QUEUE_SETTINGS,
    SETTINGS_BY_NAME,
    QueueSetting,
    example_config_block,
    sync_example_config,
)
from amqbroker.protocol.management.entities import QUEUE, QUEUE_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
#: QueuePolicy fields that are broker-wide tuning (top-level settings), not queue settings
BROKER_TUNING = {"dispatch_batch", "age_resolution", "age_marks"}

#: a value other than the default for each setting, by name
OTHER = {
    "group_buckets": 8,
    "group_rebalance": True,
    "group_rebalance_pause_dispatch": True,
    "group_first_key": "first",
    "exclusive": True,
    "consumers_before_dispatch": 2,
    "delay_before_dispatch": 250,
    "group_skip_ahead": False,
    "group_id_from_application_properties": False,
    "group_owner_policy": "least-loaded",
    "group_unbind_on_undeliverable": True,
    "group_pause_dispatch_timeout": 5000,
    "max_delivery_attempts": 3,
    "redelivery_delay": 100,
}

# -------------------------------------------------------------------------- the table


def test_table_rows_are_consistent() -> None:
    names = [s.name for s in QUEUE_SETTINGS]
    keys = [s.address_setting for s in QUEUE_SETTINGS]
    assert len(set(names)) == len(names) and len(set(keys)) == len(keys)
    assert set(OTHER) == set(names), "give a new setting a non-default value in OTHER"
    option_keys: list[str] = []
    for s in QUEUE_SETTINGS:
        assert s.doc.endswith("."), s.name
        if s.option is None:
            assert (s.attribute, s.cli_flag, s.option_aliases) == (None, None, ()), s.name
            assert s.address_setting == s.name, s.name
        else:
            assert s.attribute and s.cli_flag == f"--{s.option}", s.name
            assert s.option == s.name.replace("_", "-"), s.name
            option_keys += {k.lower() for k in (s.option, s.name, *s.option_aliases)}
    assert len(set(option_keys)) == len(option_keys), "an option key names two settings"
    assert tuple(s for s in QUEUE_SETTINGS if s.option) == OPTIONS


def test_every_value_type_has_its_pydantic_type() -> None:
    assert {s.type for s in QUEUE_SETTINGS} <= set(_VALUE_TYPES)
    assert get_args(GroupOwnerPolicy) == GROUP_OWNER_POLICIES


def test_queue_policy_has_a_field_per_setting_with_the_same_default() -> None:
    """QueuePolicy (core/queue.py) is declared by hand for the typed hot path: it must
    agree with the table."""
    fields = {f.name: f.default for f in dataclasses.fields(QueuePolicy)}
    assert set(fields) == set(SETTINGS_BY_NAME) | BROKER_TUNING
    for s in QUEUE_SETTINGS:
        assert fields[s.name] == s.default, s.name


# ---------------------------------------------------------------------------- models


def test_models_have_the_table_fields_and_defaults() -> None:
    resolved = ResolvedAddressSettings()
    for s in QUEUE_SETTINGS:
        assert getattr(resolved, s.address_setting) == s.default, s.name
        assert ResolvedAddressSettings.model_fields[s.address_setting].description == s.doc
        assert s.address_setting in AddressSettings.model_fields
    assert set(QueueOptions.model_fields) == {s.name for s in OPTIONS}
    assert QueueConfig().model_dump() == {s.name: s.default for s in QUEUE_SETTINGS}


def test_every_setting_reaches_the_queue_policy() -> None:
    """Set through address_settings (kebab-case keys), every setting ends up in the
    QueuePolicy of a queue; options given in the address string override them."""
    entry = AddressSettings.model_validate(
        {s.address_setting.replace("_", "-"): OTHER[s.name] for s in QUEUE_SETTINGS}
    )
    broker = Broker(clock=lambda: 0.0, address_settings=AddressSettingsRepository({"#": entry}))
    policy = broker._policy("orders", None)
    for s in QUEUE_SETTINGS:
        assert getattr(policy, s.name) == OTHER[s.name], s.name
    _, options = parse_address_options("orders?group-buckets=0&exclusive=false")
    policy = broker._policy("orders", options)
    assert (policy.group_buckets, policy.exclusive, policy.group_rebalance) == (0, False, True)
    assert policy.dispatch_batch == broker.dispatch_batch


def test_default_policy_is_the_table_defaults() -> None:
    policy = Broker(clock=lambda: 0.0)._policy("q", None)
    assert policy == QueuePolicy(dispatch_batch=policy.dispatch_batch)


def test_clearable_first_key_resolves_to_none() -> None:
    repo = AddressSettingsRepository(
        {
            "#": AddressSettings(default_group_first_key="first"),
            "orders.#": AddressSettings(default_group_first_key=""),
        }
    )
    assert repo.resolve("orders.eu").default_group_first_key is None
    assert repo.resolve("other").default_group_first_key == "first"


def test_address_option_keys_come_from_the_table() -> None:
    assert (
        *(s.option for s in OPTIONS),
        *(a for s in OPTIONS for a in s.option_aliases),
    ) == QUEUE_OPTION_KEYS


# ------------------------------------------------------------- management and the CLI


def test_management_queue_attributes_come_from_the_table() -> None:
    assert {s.attribute: s.name for s in OPTIONS} == QUEUE_OPTIONS
    assert set(QUEUE_OPTIONS) <= set(QUEUE.attributes)


def test_cli_flags_come_from_the_table() -> None:
    for command in ("create", "update"):
        out = CliRunner().invoke(main, ["queue", command, "--help"], terminal_width=200).output
        for s in OPTIONS:
            assert f"{s.cli_flag} " in out, (command, s.cli_flag)
            if s.type.kind == "bool":
                assert f"--no-{s.option}" in out
    given = {s.name: OTHER[s.name] for s in OPTIONS} | {"url": "amqp://x"}
    assert _option_body(given) == {s.attribute: OTHER[s.name] for s in OPTIONS}
    assert _option_body({s.name: None for s in OPTIONS}) == {}
    # in the order given on the command line (queue update echoes them that way)
    assert list(_option_body({"exclusive": True, "group_buckets": -1})) == [
        "exclusive",
        "groupBuckets",
    ]


# ------------------------------------------------------------------------------ docs


EXAMPLE = ROOT / "config" / "amqbroker.toml"


@pytest.mark.parametrize("setting", QUEUE_SETTINGS, ids=lambda s: s.name)
def test_example_config_documents_the_setting_as_the_table_says(setting: QueueSetting) -> None:
    block = "\n".join(example_config_block(setting))
    assert f"\n{block}\n" in EXAMPLE.read_text(encoding="utf-8"), (
        f"config/amqbroker.toml should carry (run scripts/sync_queue_settings.py):\n{block}"
    )


def test_example_config_is_in_sync_with_the_table() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    assert sync_example_config(text) == text, "run scripts/sync_queue_settings.py"


def test_sync_rewrites_a_stale_block_and_adds_a_missing_one() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    owner = "\n".join(example_config_block(SETTINGS_BY_NAME["group_owner_policy"])) + "\n"
    skip = example_config_block(SETTINGS_BY_NAME["group_skip_ahead"])
    assert owner in text
    damaged = text.replace(owner, "").replace(skip[0], "# An old description.\n# More of it.")
    assert sync_example_config(damaged) == text
    twice = text.replace(skip[-1], skip[-1] + "\n" + skip[-1])
    with pytest.raises(ValueError, match="group_skip_ahead 2 times"):
        sync_example_config(twice)


def test_readme_lists_every_queue_option() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for s in OPTIONS:
        row = rf"\| `{s.option}`[^|]*\| `{s.address_setting}` \|"
        assert re.search(row, text), f"README's option table lacks {s.option}"
