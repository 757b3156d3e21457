"""A small blocking client for the `$management` node, used by the operator CLI.

It runs in the CLI process (never inside the broker's event loop), so Proton's
BlockingConnection is fine here.
"""

from __future__ import annotations

import uuid
from typing import Any

from proton import Message
from proton.utils import BlockingConnection


class ManagementRequestError(Exception):
    pass


def request(
    url: str,
    operation: str,
    *,
    type: str,
    name: str = "",
    properties: dict[str, Any] | None = None,
    timeout: float = 10.0,
    user: str | None = None,
    password: str | None = None,
) -> Any:
    """Send one management request and return the answer's body (raises on failure)."""
    try:
        conn = BlockingConnection(
            url,
            timeout=timeout,
            user=user,
            password=password,
            allowed_mechs="PLAIN" if user else "ANONYMOUS",
            sasl_enabled=True,
            allow_insecure_mechs=True,
        )
    except Exception as exc:
        raise ManagementRequestError(
            f"cannot connect to {url}: {exc}; is the broker running there?"
        ) from exc
    try:
        receiver = conn.create_receiver(None, dynamic=True)
        sender = conn.create_sender("$management")
        props = {"operation": operation, "type": type, "name": name}
        props.update(properties or {})
        req = Message(
            id=str(uuid.uuid4()), reply_to=receiver.remote_source.address, properties=props
        )
        sender.send(req, timeout=timeout)
        reply = receiver.receive(timeout=timeout)
        receiver.accept()
        answer: dict[str, Any] = dict(reply.properties or {})
        status = answer.get("statusCode")
        if status != 200:
            desc = answer.get("statusDescription")
            raise ManagementRequestError(f"{operation} failed ({status}): {desc}")
        return reply.body
    finally:
        conn.close()
