"""A small async helper for the broker's `$management` node, over the trio test client.

One request = a sender to `$management`, a dynamic receiver for the answer (its address
is the request's reply-to), application properties `operation` / `type` / `name` (plus
any extras such as `groupId`). Both links are closed again before returning, so the
helper leaves nothing behind on the broker.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from proton import Message

from tests.client import DEFAULT_TIMEOUT, Client

_ids = itertools.count(1)


@dataclass
class Answer:
    status: int | None
    description: str | None
    body: Any
    correlation_id: Any
    request_id: str

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


async def request(
    client: Client,
    operation: str,
    name: str = "",
    *,
    type: str = "queue",
    timeout: float = DEFAULT_TIMEOUT,
    body: Any = None,
    **extra: Any,
) -> Answer:
    """Send one management request and return the whole answer (any status)."""
    reply = await client.receiver(None, dynamic=True, credit=1)
    reply_to = reply.address
    assert reply_to, "the broker gave the dynamic reply receiver no address"
    sender = await client.sender("$management")
    props: dict[str, Any] = {"operation": operation, "type": type}
    if name:
        props["name"] = name
    props.update(extra)
    rid = f"mgmt-{next(_ids)}"
    await sender.send(
        Message(id=rid, reply_to=reply_to, properties=props, body=body), timeout=timeout
    )
    got = await reply.receive(timeout)
    reply.accept(got)
    answer_props = got.properties
    answer = Answer(
        status=answer_props.get("statusCode"),
        description=answer_props.get("statusDescription"),
        body=got.body,
        correlation_id=got.message.correlation_id,
        request_id=rid,
    )
    await sender.close(timeout)
    await reply.close(timeout)
    return answer


async def call(
    client: Client, operation: str, name: str = "", *, expect: int = 200, **kw: Any
) -> Any:
    """Like `request`, but asserts the status (200 unless `expect`) and returns the body."""
    answer = await request(client, operation, name, **kw)
    assert answer.status == expect, (operation, name, answer.status, answer.description)
    return answer.body
