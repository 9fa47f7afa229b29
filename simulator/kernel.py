"""A tiny deterministic discrete-event kernel (in the style of SimPy's core). Pure.

The kernel keeps a heap of `(time, priority, seq, handle)` entries and calls each handle's
callback in that order. The rules:

- **time**: an event runs at the time it was scheduled for; the clock (`now()`) jumps to it.
- **priority**: among events at the same time, the smaller priority runs first (default 0;
  negative priorities run before, positive ones after).
- **seq**: among events with the same time and priority, the one scheduled first runs first
  (FIFO). `seq` is a per-kernel counter, so two kernels fed the same calls run identically.
  An event a callback schedules for the current time and priority therefore runs after every
  event already waiting at that time and priority.
- **cancel** is lazy: a cancelled entry stays in the heap and is skipped when it comes up.
- **the past is an error**: `schedule` with a negative (or NaN) delay and `at` with a time
  before `now()` raise `ValueError`.
- `run(until=None)` runs events until the heap is empty, or, with `until`, every event whose
  time is `<= until`, then sets the clock to `until` (never backwards).
- **keys**: `key(delay)` gives the `(time, priority, seq)` an event scheduled now would get, without
  scheduling one, and `current()` the key of the event running now. A caller that keeps its own queue
  of due work (the cluster's KV-event inbox) orders it exactly as the heap would have.

The kernel implements `epp.clock.Clock` (`now()`), so the production core can run on it.
`repeat_before` gives, in a few steps, the time a chain of `schedule(delay)` calls (each from the event
the previous one scheduled) reaches before a limit, so a caller may skip links of the chain exactly.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

Callback = Callable[[], object]


class Handle:
    """A scheduled event; pass it to `Kernel.cancel`."""

    __slots__ = ("callback", "priority", "seq", "time")

    def __init__(self, time: float, priority: int, seq: int, callback: Callback) -> None:
        self.time = time
        self.priority = priority
        self.seq = seq
        self.callback: Callback | None = callback

    @property
    def cancelled(self) -> bool:
        """True once cancelled or run (a handle fires at most once)."""
        return self.callback is None

    def __repr__(self) -> str:
        state = "done" if self.callback is None else "pending"
        return f"Handle(time={self.time}, priority={self.priority}, seq={self.seq}, {state})"


class Kernel:
    """Discrete-event kernel; `now()` makes it an `epp.clock.Clock`."""

    __slots__ = ("_current", "_heap", "_now", "_running", "_seq", "events_run")

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"start time must be finite, got {start}")
        self._now = float(start)
        self._heap: list[tuple[float, int, int, Handle]] = []
        self._seq = 0
        self._running = False
        self._current: tuple[float, int, int] = (self._now, 0, -1)
        self.events_run = 0

    def now(self) -> float:
        return self._now

    def schedule(self, delay: float, callback: Callback, priority: int = 0) -> Handle:
        """Run `callback` `delay` seconds from now."""
        if not delay >= 0.0:  # also catches NaN
            raise ValueError(f"cannot schedule in the past: delay {delay} at time {self._now}")
        time = self._now + delay
        seq = self._seq
        self._seq = seq + 1
        handle = Handle(time, priority, seq, callback)
        heapq.heappush(self._heap, (time, priority, seq, handle))
        return handle

    def key(self, delay: float, priority: int = 0) -> tuple[float, int, int]:
        """The key `schedule(delay, ..., priority)` would give its event now (it takes a seq number, so
        that events scheduled after it order after it); nothing is scheduled."""
        if not delay >= 0.0:
            raise ValueError(f"cannot schedule in the past: delay {delay} at time {self._now}")
        seq = self._seq
        self._seq = seq + 1
        return (self._now + delay, priority, seq)

    def current(self) -> tuple[float, int, int]:
        """The `(time, priority, seq)` of the event running now (of the last one run, between events)."""
        return self._current

    def at(self, time: float, callback: Callback, priority: int = 0) -> Handle:
        """Run `callback` at absolute `time` (>= now)."""
        if not time >= self._now:
            raise ValueError(f"cannot schedule in the past: time {time} < now {self._now}")
        if math.isinf(time):
            raise ValueError("cannot schedule at an infinite time")
        return self._push(float(time), callback, priority)

    def _push(self, time: float, callback: Callback, priority: int) -> Handle:
        seq = self._seq
        self._seq = seq + 1
        handle = Handle(time, priority, seq, callback)
        heapq.heappush(self._heap, (time, priority, seq, handle))
        return handle

    def cancel(self, handle: Handle) -> bool:
        """Cancel a pending event; False if it already ran or was cancelled."""
        if handle.callback is None:
            return False
        handle.callback = None
        return True

    def peek(self) -> float:
        """Time of the next pending event; infinity when there is none."""
        heap = self._heap
        while heap and heap[0][3].callback is None:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def __len__(self) -> int:
        """Entries in the heap (cancelled ones included until they are skipped)."""
        return len(self._heap)

    def step(self) -> bool:
        """Run the next pending event; False when there is none."""
        if self._running:
            raise RuntimeError("Kernel.step() called from inside a callback")
        self._running = True
        try:
            return self._run_one(math.inf)
        finally:
            self._running = False

    def run(self, until: float | None = None) -> None:
        """Run events in order until the heap is empty or the next one is later than `until`."""
        if self._running:
            raise RuntimeError("Kernel.run() called from inside a callback")
        limit = math.inf if until is None else float(until)
        if until is not None and not limit >= self._now:
            raise ValueError(f"until {until} is before now {self._now}")
        self._running = True
        heap = self._heap
        pop = heapq.heappop
        try:
            # `_run_one`'s loop, inlined: a call per event is a good part of a simulation's kernel time
            while heap:
                entry = heap[0]
                if entry[0] > limit:
                    break
                pop(heap)
                handle = entry[3]
                callback = handle.callback
                if callback is None:
                    continue
                handle.callback = None
                self._now = entry[0]
                self._current = entry[:3]
                self.events_run += 1
                callback()
        finally:
            self._running = False
        if until is not None and limit > self._now:
            self._now = limit

    def _run_one(self, limit: float) -> bool:
        heap = self._heap
        pop = heapq.heappop
        while heap:
            entry = heap[0]
            if entry[0] > limit:
                return False
            pop(heap)
            handle = entry[3]
            callback = handle.callback
            if callback is None:
                continue
            handle.callback = None
            self._now = entry[0]
            self._current = entry[:3]
            self.events_run += 1
            callback()
            return True
        return False


def repeat_before(start: float, delay: float, limit: float) -> tuple[float, int]:
    """The last time before `limit` of the chain `start`, `start + delay`, `(start + delay) + delay`, ...
    (each sum rounded as `schedule(delay)` rounds it, from the time of the event that schedules the
    next), and its number of delays from `start` (0: `start + delay` is not before `limit`, or does not
    move the clock). Exactly the float that many additions give, at a cost of a few steps per binade
    (power of two) crossed: inside a binade, adding a fixed `delay` rounds to a fixed multiple of its
    ulp (after at most one step, a tie may round either way once), so once two steps agree the chain is
    an arithmetic progression, all of it exactly representable, up to the binade's end."""
    t, n = start, 0
    while True:
        a = t + delay
        if not a < limit or not a > t:  # (NaN, or a delay too small to move the clock at t)
            return t, n
        b = a + delay
        c = b + delay
        step = b - a  # (exact: a and b are in one binade, or b is the next power of two)
        exponent = math.frexp(a)[1]
        if c < limit and step > 0 and c - b == step and math.frexp(c)[1] == exponent:
            top = min(limit, math.ldexp(1.0, exponent))  # a, b, c are in [top / 2, top)
            jump = math.floor((top - c) / step) - 2  # the last sum from c + (jump - 1) * step is < top
            if jump > 0:
                t, n = c + jump * step, n + 3 + jump  # (jump * step < 2**53 ulps: exact, as is the sum)
                continue
        t, n = a, n + 1
