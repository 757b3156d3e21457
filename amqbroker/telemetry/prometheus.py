"""The Prometheus endpoint: GET /metrics over a minimal HTTP/1.1 server on trio.

Served on the event loop (not prometheus_client's threaded server) so that collecting,
which reads core structures, never runs concurrently with the broker. One request per
connection (`Connection: close`); a request head larger than `MAX_HEAD` or slower
than `HEAD_TIMEOUT` seconds is dropped. Any path other than /metrics is a 404, any
method other than GET/HEAD a 405.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import trio

log = logging.getLogger(__name__)

MAX_HEAD = 8192
HEAD_TIMEOUT = 10.0


def _response(status: str, body: bytes, content_type: str, head_only: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head if head_only else head + body


async def _handle(stream: trio.SocketStream, render: Callable[[], tuple[bytes, str]]) -> None:
    try:
        buf = b""
        with trio.move_on_after(HEAD_TIMEOUT):
            while b"\r\n\r\n" not in buf and len(buf) < MAX_HEAD:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                buf += chunk
        if b"\r\n\r\n" not in buf:
            return
        parts = buf.split(b"\r\n", 1)[0].split()
        method = parts[0] if parts else b""
        path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""
        if method not in (b"GET", b"HEAD"):
            out = _response("405 Method Not Allowed", b"only GET /metrics\n", "text/plain")
        elif path != b"/metrics":
            out = _response("404 Not Found", b"metrics are at /metrics\n", "text/plain")
        else:
            body, ctype = render()
            out = _response("200 OK", body, ctype, head_only=method == b"HEAD")
        await stream.send_all(out)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


async def serve(
    sock: socket.socket,
    render: Callable[[], tuple[bytes, str]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve /metrics on the bound, listening socket `sock` until cancelled."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

    async def handler(stream: trio.SocketStream) -> None:
        await _handle(stream, render)

    try:
        async with trio.open_nursery() as n:
            await n.start(trio.serve_listeners, handler, [listener])
            task_status.started()
    finally:
        # closed now, not when collected: the same process may bind the port again
        # (a pair member that goes from live to backup and back)
        listener.socket.close()
