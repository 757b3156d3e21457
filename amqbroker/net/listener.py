"""TCP listeners: bind, accept, and hand each socket to a connection driver.

Binding happens before the broker reports itself ready, so a port conflict is an
error at start-up that names the address and says what to do.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable

import trio

from amqbroker.core.errors import LocalError

log = logging.getLogger(__name__)


class ListenError(LocalError):
    pass


def bind(host: str, port: int, backlog: int = 1024) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot resolve listener host {host!r}: {exc}") from exc
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(backlog)
        s.setblocking(False)
    except OSError as exc:
        s.close()
        hint = ""
        if exc.errno == errno.EADDRINUSE:
            hint = "; another process is using it: stop it or choose another --port"
        elif exc.errno == errno.EACCES:
            hint = "; ports below 1024 need privileges: choose another --port"
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from exc
    return s


def bound_address(s: socket.socket) -> tuple[str, int]:
    addr = s.getsockname()
    return str(addr[0]), int(addr[1])


async def accept_loop(
    s: socket.socket,
    handler: Callable[[socket.socket, str], Awaitable[None]],
    nursery: trio.Nursery,
) -> None:
    """Accept until cancelled; each connection runs `handler` in `nursery`."""
    try:
        while True:
            await trio.lowlevel.wait_readable(s)
            while True:
                try:
                    conn, addr = s.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        log.error(
                            "cannot accept connections: %s (raise the open-file limit or "
                            "lower max_connections)",
                            exc,
                        )
                        await trio.sleep(0.1)
                        break
                    raise
                conn.setblocking(False)
                if conn.family in (socket.AF_INET, socket.AF_INET6):
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
                nursery.start_soon(handler, conn, peer)
    finally:
        s.close()
