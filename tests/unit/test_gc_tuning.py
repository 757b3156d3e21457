"""`amqbroker run` tunes the process's cyclic garbage collector (`gc_young_threshold`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from amqbroker.cli.server import _tune_gc
from amqbroker.settings import SettingsError, load_settings


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_tune_gc_freezes_what_is_loaded_and_sets_the_young_threshold(restored_gc: None) -> None:
    before = gc.get_threshold()
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    _tune_gc(12_345)
    assert gc.get_threshold() == (12_345, before[1], before[2])
    assert gc.get_freeze_count() > 0  # modules, classes, settings: never scanned again
    # objects made afterwards are still collected: a cycle is freed
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1


def test_gc_young_threshold_setting() -> None:
    assert load_settings(environ={}).gc_young_threshold == 10_000
    env = {"AMQBROKER_GC_YOUNG_THRESHOLD": "50000"}
    assert load_settings(environ=env).gc_young_threshold == 50_000
    with pytest.raises(SettingsError, match="gc_young_threshold"):
        load_settings(environ={"AMQBROKER_GC_YOUNG_THRESHOLD": "0"})
