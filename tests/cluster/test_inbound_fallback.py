"""The cluster inbound link resolves `group_id_from_application_properties` per
destination (issue 21): it has no address at attach, and used to group every
forwarded message by its JMSXGroupID application property even where the target
address's settings say false."""

from __future__ import annotations

import json

import pytest
from proton import Message

from tests.cluster.cluster_helpers import Cluster
from tests.integration import mgmt as mgmt_request

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cluster_env() -> dict[str, str]:
    return {
        "AMQBROKER_ADDRESS_SETTINGS": json.dumps(
            {"strict.#": {"group_id_from_application_properties": False}}
        )
    }


async def test_forwarded_messages_group_by_the_target_addresses_settings(
    cluster: Cluster,
) -> None:
    await cluster.start()
    await cluster.wait_linked()
    c2 = await cluster.connect("node2")
    r1 = await c2.receiver("strict.q", credit=10)
    r2 = await c2.receiver("strict.q", credit=10)
    await cluster.wait_announced("strict.q", {"node2": 2})  # node1 forwards there
    async with await cluster.connect("node1") as c1:
        s = await c1.sender("strict.q")
        await s.send_many(
            [Message(body=f"j{i}", properties={"JMSXGroupID": "G"}) for i in range(4)]
        )
    got1 = [str(m.body) for m in await r1.receive_n(2)]
    got2 = [str(m.body) for m in await r2.receive_n(2)]
    # not grouped on node2 either: both consumers got messages
    assert sorted(got1 + got2) == ["j0", "j1", "j2", "j3"]
    groups = await mgmt_request.request(c2, "listGroups", "strict.q")
    assert groups.body["groups"] == [], groups.body
    await c2.close()
