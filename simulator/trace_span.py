"""How long a trace's arrivals may span in simulated time, and the errors that say so. Pure.

`MAX_SPAN_S` = 1e8 simulated seconds (about 3.2 years) from the first arrival to the last, checked
before a run starts: by the trace readers (`FILE:LINE` of the first request past it), for a synthetic
workload (its `--rate`) and after `--rate-scale` (naming it). Why a bound, and why this one:

- **Time precision.** The kernel's clock is a float64 of seconds since the first arrival, and every
  event time is a sum (`now + step time`, `now + scrape interval`). At t seconds its resolution is
  about t x 2.2e-16: 15 ns at 1e8 s, millionths of an engine step (milliseconds), so records keep
  their times to well under a microsecond. At 1e11 s it is 15 us (steps and TTFTs visibly rounded), at
  1e13 s 2 ms (a step), and from ~6e14 s on adding the default 50 ms scrape interval no longer moves
  the clock: the scrape timer stops and the run never ends. A trace of timestamps 0 and 1e300 ms is
  refused instead of silently running with no time resolution.
- **Run time.** The cluster skips the scrapes of idle gaps (`simulator/cluster.py`), so a long quiet
  stretch costs a few arithmetic steps; busy time still costs a scrape round per interval. Real traces
  span an hour (Mooncake) to a few weeks (Azure's): 3 years leaves ample room and refuses only
  timestamps that are wrong (mixed units, a stray epoch, garbage) before they cost anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

MAX_SPAN_S = 1e8
LIMIT = f"more than the {MAX_SPAN_S:g} s (about 3 years) of simulated time a trace may span"


class _Arrival(Protocol):
    @property
    def arrival(self) -> float: ...


def too_long(span: float) -> bool:
    """Whether arrivals `span` seconds after the first are refused (NaN and infinity too)."""
    return not span <= MAX_SPAN_S


def first_too_late(arrivals: Sequence[float]) -> int | None:
    """The position of the first arrival (seconds from the earliest) past the bound, or None."""
    return next((i for i, t in enumerate(arrivals) if too_long(t)), None)


def scaled_span_error(trace: Sequence[_Arrival], factor: float, source: str) -> str | None:
    """Why `--rate-scale factor` cannot apply to a trace (arrivals from 0) from `source`: None if the
    scaled arrivals stay within the bound."""
    span = max((r.arrival for r in trace), default=0.0)
    scaled = span / factor
    if not too_long(scaled):
        return None
    least = _round_up(span / MAX_SPAN_S)
    return (
        f"--rate-scale {factor:g} stretches the arrivals of {source} from {span:.6g} s to {_shown(scaled)}: "
        f"{LIMIT}; give a --rate-scale of at least {least:.3g}"
    )


def _round_up(x: float) -> float:
    """`x` rounded up to 3 significant digits (so that the factor shown is enough)."""
    unit = 10.0 ** (math.floor(math.log10(x)) - 2)
    return math.ceil(x / unit) * unit


def _shown(seconds: float) -> str:
    return f"{seconds:.6g} s" if math.isfinite(seconds) else "beyond any finite number of seconds"
