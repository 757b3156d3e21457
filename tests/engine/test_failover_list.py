"""The open's ``failover-server-list`` property (Qpid JMS reads it to learn where it
may reconnect): advertised only when the broker has servers to name."""

from __future__ import annotations

from proton import symbol

from amqbroker.protocol.connection import ConnectionLimits
from tests.engine.test_engine_pump import Harness


def _open_properties(limits: ConnectionLimits) -> dict[object, object]:
    h = Harness(None)
    p = h.peer("c", limits=limits)
    h.pump()
    return dict(p.conn.remote_properties or {})


def test_failover_server_list_names_each_server() -> None:
    servers = [("10.0.0.1", 5672), ("10.0.0.2", 5673)]
    props = _open_properties(ConnectionLimits(failover_servers=lambda: servers))
    assert props[symbol("product")] == "amqbroker"
    assert props[symbol("failover-server-list")] == [
        {symbol("network-host"): "10.0.0.1", symbol("port"): 5672},
        {symbol("network-host"): "10.0.0.2", symbol("port"): 5673},
    ]


def test_no_failover_server_list_without_servers() -> None:
    assert symbol("failover-server-list") not in _open_properties(ConnectionLimits())
    empty = ConnectionLimits(failover_servers=lambda: [])
    assert symbol("failover-server-list") not in _open_properties(empty)
