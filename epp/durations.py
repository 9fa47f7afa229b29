"""Durations as users write them: `50ms`, `2s`, `1m`, `1.5s`, Go's compound form (`1m30s`, `1h2m3.5s`: the
reference EPP's flags are Go durations), or a bare number of seconds."""

from __future__ import annotations

import math
import re

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
# One way to match each number (no nested quantifiers over the same digits): linear on any input.
_RE = re.compile(r"^\s*((?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*(?:(ns|us|µs|ms|s|m|h)\s*)?$")
_PART = r"(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?:ns|us|µs|ms|s|m|h)"
_COMPOUND = re.compile(rf"^\s*(?:{_PART})+\s*$")  # Go's `1m30s`: every part with its unit
_PARTS = re.compile(r"([0-9]+(?:\.[0-9]+)?|\.[0-9]+)(ns|us|µs|ms|s|m|h)")


def parse_duration(value: str | float | int) -> float:
    """Seconds as a float. Raises ValueError with the offending text otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _RE.match(value)
        if m:
            seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
        elif _COMPOUND.match(value):
            seconds = sum(float(n) * _UNITS[unit] for n, unit in _PARTS.findall(value))
        else:
            raise ValueError(
                f"not a duration: {value!r} (use e.g. '50ms', '2s', '1m30s' or a number of seconds)"
            )
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration must be a finite number >= 0, got {value!r}")
    return seconds
