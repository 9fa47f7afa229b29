"""The clock the pure core is given: it never reads the wall clock itself."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds. The server passes `MonotonicClock`, tests a `FakeClock`,
    the simulator its event kernel."""

    def now(self) -> float: ...


class MonotonicClock:
    """The process's monotonic clock (the only place the core's clock touches time)."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()
