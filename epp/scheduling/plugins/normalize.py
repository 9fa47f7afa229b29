"""Score normalisations shared by load scorers."""

from __future__ import annotations

from collections.abc import Sequence


def inverse_minmax(values: Sequence[float]) -> list[float]:
    """Lowest value scores 1, highest 0, linear between; all equal scores 1."""
    if not values:
        return []
    lo = min(values)
    hi = max(values)
    if hi <= lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]
