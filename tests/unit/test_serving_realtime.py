"""The real-time driver: kernel events run in order, at their kernel times, never before their wall time."""

from __future__ import annotations

import asyncio

import pytest

from epp.testing.wait import eventually
from simulator.kernel import Kernel
from simulator.serving.realtime import RealtimeDriver


@pytest.mark.parametrize("time_scale", [0.5, 1.0, 3.0])
async def test_events_run_in_kernel_order_and_never_early(time_scale: float) -> None:
    kernel = Kernel()
    driver = RealtimeDriver(kernel, time_scale)
    loop = asyncio.get_running_loop()
    seen: list[tuple[str, float, float]] = []  # (name, kernel time, loop time)

    def mark(name: str) -> None:
        seen.append((name, kernel.now(), loop.time()))

    kernel.schedule(0.02, lambda: mark("b"))
    kernel.schedule(0.01, lambda: mark("a"))
    kernel.schedule(0.02, lambda: mark("c"))
    await driver.start()
    try:
        await eventually(lambda: len(seen) == 3, "three events run")
        assert [s[0] for s in seen] == ["a", "b", "c"]
        assert [s[1] for s in seen] == [0.01, 0.02, 0.02]
        for _, t, wall in seen:
            assert wall >= driver.wall_time(t)  # not before its wall time
    finally:
        await driver.stop()


async def test_work_submitted_later_wakes_the_driver_and_starts_at_now() -> None:
    kernel = Kernel()
    driver = RealtimeDriver(kernel)
    await driver.start()
    try:
        await asyncio.sleep(0.02)  # the driver sleeps on an empty heap
        driver.advance()
        start = kernel.now()
        assert start > 0.0  # the kernel followed the wall clock
        ran: list[float] = []
        kernel.schedule(0.005, lambda: ran.append(kernel.now()))
        driver.wake()
        await eventually(lambda: bool(ran), "the event scheduled after a wake runs")
        assert ran == [pytest.approx(start + 0.005)]
        assert driver.now() >= ran[0]
    finally:
        await driver.stop()
    assert not driver.running


async def test_tick_releases_waiters_after_events_run_and_on_stop() -> None:
    kernel = Kernel()
    driver = RealtimeDriver(kernel)
    await driver.start()
    waiter = asyncio.create_task(driver.tick())
    await asyncio.sleep(0)
    assert not waiter.done()  # nothing ran
    kernel.schedule(0.0, lambda: None)
    driver.wake()
    await asyncio.wait_for(waiter, 10)
    assert driver.advances >= 1
    late = asyncio.create_task(driver.tick())
    await asyncio.sleep(0)
    await driver.stop()
    await asyncio.wait_for(late, 10)  # nobody is left waiting on a stopped driver


def test_bad_time_scale_is_refused() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="time_scale"):
            RealtimeDriver(Kernel(), bad)
