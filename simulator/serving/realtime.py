"""Drives a discrete-event `Kernel` in wall-clock time on asyncio.

Kernel time `k` happens at wall time `t0 + k * time_scale` (the event loop's monotonic clock; `t0` is
when the driver started). The kernel itself never sleeps: the driver

- `advance()`: runs every kernel event due by "now" (callers do this before submitting work, so a
  request arrives at the right kernel time, and before reading the engine's state);
- runs a task that sleeps until the kernel's next event or until `wake()` (a submission may have
  scheduled something earlier), then advances;
- after every advance that ran something, releases `tick()` waiters (streaming responses pace their
  tokens on these ticks).

Callbacks run inside `Kernel.run` on the event loop, so they must not await; they resolve futures or
queue work. If the loop falls behind, due events run late in wall time but at their own kernel times:
the engine's timeline stays exactly the simulated one, only its observation is delayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

from simulator.kernel import Kernel

_EPSILON = 1e-9  # kernel seconds: a due event is not missed through float rounding of its wall time


class RealtimeDriver:
    def __init__(self, kernel: Kernel, time_scale: float = 1.0) -> None:
        if not (math.isfinite(time_scale) and time_scale > 0):
            raise ValueError(f"time_scale must be a finite number > 0, got {time_scale}")
        self.kernel = kernel
        self.time_scale = time_scale
        self._t0: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._tick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.advances = 0  # advances that ran at least one event

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("RealtimeDriver already started")
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time() - self.kernel.now() * self.time_scale
        self._task = asyncio.create_task(self._run(), name="engine-kernel")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._release_tick()  # nobody waits for a tick that will never come

    @property
    def running(self) -> bool:
        return self._task is not None

    def now(self) -> float:
        """The kernel time that corresponds to the wall clock now (never before the kernel's clock)."""
        if self._loop is None or self._t0 is None:
            return self.kernel.now()
        return max(self.kernel.now(), (self._loop.time() - self._t0) / self.time_scale)

    def wall_time(self, kernel_time: float) -> float:
        """The event loop time at which `kernel_time` happens."""
        if self._t0 is None:
            raise RuntimeError("RealtimeDriver not started")
        return self._t0 + kernel_time * self.time_scale

    def epoch(self, kernel_time: float) -> float:
        """The wall-clock time (seconds since the epoch) at which `kernel_time` happens."""
        if self._loop is None:
            raise RuntimeError("RealtimeDriver not started")
        return time.time() - (self._loop.time() - self.wall_time(kernel_time))

    def advance(self) -> None:
        """Run every kernel event due by now."""
        kernel = self.kernel
        before = kernel.events_run
        kernel.run(until=self.now() + _EPSILON)
        if kernel.events_run != before:
            self.advances += 1
            self._release_tick()

    def wake(self) -> None:
        """Something was scheduled: re-read the kernel's next event time."""
        self._wake.set()

    async def tick(self) -> None:
        """Wait until the next advance that runs something (or until the driver stops)."""
        await self._tick.wait()

    def _release_tick(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def _run(self) -> None:
        assert self._loop is not None
        loop = self._loop
        while True:
            self.advance()
            nxt = self.kernel.peek()
            self._wake.clear()
            if math.isinf(nxt):
                await self._wake.wait()
                continue
            delay = self.wall_time(nxt) - loop.time()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
            else:
                await asyncio.sleep(0)  # let handlers run between bursts of due events
