"""The ha_* settings and their cross-field checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from amqbroker.settings import Settings


def test_defaults_are_no_replication() -> None:
    s = Settings()
    assert (s.ha_role, s.ha_primary, s.ha_sync, s.ha_window) == ("", "", True, 64)


def test_a_backup_needs_its_primary_and_the_cluster_user() -> None:
    with pytest.raises(ValidationError, match="needs ha_primary"):
        Settings(ha_role="backup", cluster_user="c")
    with pytest.raises(ValidationError, match="set cluster_user"):
        Settings(ha_role="primary")
    s = Settings(ha_role="backup", ha_primary="127.0.0.1:5672", cluster_user="c")
    assert s.ha_primary == "127.0.0.1:5672"


def test_fail_back_needs_a_pair_with_zookeeper() -> None:
    assert Settings().ha_failback is False
    with pytest.raises(ValidationError, match="ha_failback"):
        Settings(ha_failback=True)
    with pytest.raises(ValidationError, match="set ha_role and cluster_zookeeper"):
        Settings(ha_failback=True, ha_role="backup", ha_primary="127.0.0.1:5672", cluster_user="c")
    s = Settings(
        ha_failback=True,
        ha_role="backup",
        cluster_zookeeper="127.0.0.1:2181",
        cluster_user="c",
        node_id="node1",
    )
    assert s.ha_failback


@pytest.mark.parametrize(
    "bad",
    [{"ha_role": "spare"}, {"ha_primary": "nohost"}, {"ha_window": 0}, {"ha_ack_timeout": 0}],
)
def test_bad_values_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Settings(**bad)  # type: ignore[arg-type]
