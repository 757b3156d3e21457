"""A cluster peer run as a primary/backup pair: `parse_peer` reads its members'
addresses, and the outbound driver tries them in turn (issue 23)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from amqbroker.net.driver import Hub
from amqbroker.net.outbound import OutboundDriver
from amqbroker.settings import Settings, SettingsError, load_settings, parse_peer


def test_a_peer_names_one_address_or_its_pairs_members() -> None:
    assert parse_peer("node2=127.0.0.1:5673") == ("node2", (("127.0.0.1", 5673),))
    assert parse_peer("node1=127.0.0.1:5672|10.0.0.2:6672") == (
        "node1",
        (("127.0.0.1", 5672), ("10.0.0.2", 6672)),
    )
    assert parse_peer("n=[::1]:5672| host-b:1") == ("n", (("::1", 5672), ("host-b", 1)))
    for bad in ("node1", "node1=", "node1=h:1|", "node1=h:1|h:1", "node1=h:0", "=h:1", "n=h"):
        with pytest.raises(ValueError, match="cluster peer"):
            parse_peer(bad)


def test_the_settings_take_alternatives_from_the_environment() -> None:
    s = load_settings(
        environ={
            "AMQBROKER_CLUSTER_NODE_ID": "node2",
            "AMQBROKER_CLUSTER_PEERS": "node1=127.0.0.1:5672|127.0.0.1:6672,node3=h:5674",
        }
    )
    assert isinstance(s, Settings)
    assert s.cluster_peers == ["node1=127.0.0.1:5672|127.0.0.1:6672", "node3=h:5674"]
    with pytest.raises(SettingsError, match=r"id=host:port\|host:port"):
        load_settings(
            environ={
                "AMQBROKER_CLUSTER_NODE_ID": "node2",
                "AMQBROKER_CLUSTER_PEERS": "node1=127.0.0.1:5672|",
            }
        )


class Scripted(OutboundDriver):
    """A driver whose attempts open or fail as scripted (address -> outcomes)."""

    def __init__(self, script: dict[tuple[str, int], list[bool]], **kw: Any) -> None:
        super().__init__(
            Hub(),
            name="node1",
            factory=lambda wake: None,  # type: ignore[arg-type,return-value]
            on_up=lambda engine: None,
            on_down=lambda engine, err: None,
            **kw,
        )
        self.script = script
        self.tried: list[tuple[str, int, float]] = []

    async def _one(self) -> bool:
        self.tried.append((self.host, self.port, trio.current_time()))
        outcomes = self.script[(self.host, self.port)]
        if not outcomes or not outcomes.pop(0):
            raise OSError("connection refused")
        await trio.sleep(1.0)  # open for a while, then dropped
        return True


async def test_the_driver_tries_the_next_address_and_backs_off_after_a_round(
    autojump_clock: Any,
) -> None:
    a, b = ("a", 1), ("b", 2)
    # a is live, then dies; b (the standby) takes over after a few attempts
    d = Scripted(
        {a: [True, False, False, False], b: [False, False, True]},
        host="a",
        port=1,
        more=[b],
        backoff_initial=0.5,
        backoff_max=4.0,
    )
    t0 = trio.current_time()
    with trio.move_on_after(20):
        await d.run()
    got = [(h, p, round(t - t0, 2)) for h, p, t in d.tried[:7]]
    assert got == [
        ("a", 1, 0.0),  # opens, dropped after 1 s
        ("b", 2, 1.5),  # after the initial backoff: the next member first
        ("a", 1, 1.5),  # refused at once: the other one at once
        ("b", 2, 2.5),  # a whole round failed: backoff doubled (1.0)
        ("a", 1, 2.5),
        ("b", 2, 4.5),  # opens: stuck to until it drops
        ("a", 1, 6.0),
    ]
    assert d.last_error.endswith(": connection refused") and d.last_error[:4] in ("a:1:", "b:2:")


async def test_a_single_address_keeps_the_plain_backoff(autojump_clock: Any) -> None:
    d = Scripted({("a", 1): []}, host="a", port=1, backoff_initial=0.5, backoff_max=1.0)
    t0 = trio.current_time()
    with trio.move_on_after(3.6):
        await d.run()
    assert [round(t - t0, 2) for _, _, t in d.tried] == [0.0, 0.5, 1.5, 2.5, 3.5]
    assert d.last_error == "connection refused"
