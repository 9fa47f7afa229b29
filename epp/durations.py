"""Durations as users write them: `50ms`, `2s`, `1m`, `1.5s`, or a bare number of seconds."""

from __future__ import annotations

import math
import re

_UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
# One way to match each number (no nested quantifiers over the same digits): linear on any input.
_RE = re.compile(r"^\s*((?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*(?:(us|µs|ms|s|m|h)\s*)?$")


def parse_duration(value: str | float | int) -> float:
    """Seconds as a float. Raises ValueError with the offending text otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _RE.match(value)
        if not m:
            raise ValueError(f"not a duration: {value!r} (use e.g. '50ms', '2s' or a number of seconds)")
        seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration must be a finite number >= 0, got {value!r}")
    return seconds
