"""Fixtures of the cluster tests: `cluster` (three broker processes, not started, with
the `cluster_env` a module may override) and the ZooKeeper server (`zookeeper`,
`zk_path`) for the modules that elect the arbiter."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.cluster.cluster_helpers import Cluster, running_cluster
from tests.cluster.zk_harness import zk_path, zookeeper

__all__ = ["cluster", "cluster_env", "zk_path", "zookeeper"]


@pytest.fixture
def cluster_env() -> dict[str, str]:
    """Settings every node of `cluster` gets (override in a module)."""
    return {}


@pytest.fixture
async def cluster(
    nursery: trio.Nursery, tmp_path: Path, cluster_env: dict[str, str]
) -> AsyncIterator[Cluster]:
    async with running_cluster(nursery, tmp_path, cluster_env) as c:
        yield c
