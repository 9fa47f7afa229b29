"""Fast builders of frozen dataclasses (`epp/frozen.py`): what they build is the ordinary instance."""

from __future__ import annotations

import dataclasses

import pytest

from epp.frozen import twin
from epp.types import Endpoint, MetricsSnapshot, PrefillWork, endpoint_view, metrics_snapshot


def test_the_fast_views_equal_the_ordinary_ones_and_stay_frozen() -> None:
    m = MetricsSnapshot(
        12.5, 3, 4, 0.25, 16, 1024, 100.0, 40.0, frozenset({"m"}), frozenset({"l"}), frozenset()
    )
    fast_m = metrics_snapshot(
        12.5, 3, 4, 0.25, 16, 1024, 100.0, 40.0, frozenset({"m"}), frozenset({"l"}), frozenset()
    )
    assert type(fast_m) is MetricsSnapshot and fast_m == m and hash(fast_m) == hash(m)
    args = ("10.0.0.1:8000", m, True, 2, 300, "m", {"a": "b"}, PrefillWork(1, 200, 5.0), 1, 700)
    names = [f.name for f in dataclasses.fields(Endpoint) if f.init]
    e = Endpoint(**dict(zip(names, args, strict=True)))
    fast = endpoint_view(*args)
    assert type(fast) is Endpoint and fast == e
    assert fast.load_row == e.load_row and len(fast.load_row) == 9 * 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.healthy = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast_m.waiting = 0  # type: ignore[misc]


def test_a_twin_needs_the_same_slot_layout() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        x: int

    with pytest.raises(TypeError):
        twin(NoSlots)
