"""One worker thread for work that must not run on the event loop, taken in order.

The loop keeps the count of jobs submitted and not finished (and their weight, e.g. characters), so
it can tell whether the worker is busy without a lock: a job counts until it has really ended in the
thread, not until the coroutine awaiting it goes away. Callers use `busy` to keep work that shares
state with the worker (a tokenizer's prefix cache) off the loop while the worker runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class SerialWorker:
    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._jobs = 0
        self._weight = 0
        self.completed = 0  # jobs that ran (those dropped before they started are not counted)

    @property
    def busy(self) -> bool:
        return self._jobs > 0

    @property
    def queued(self) -> int:
        """The weight of the jobs submitted and not finished."""
        return self._weight

    async def run(self, fn: Callable[[], T], weight: int = 0) -> T:
        """`fn()` in the worker thread, after the jobs before it. Raises what `fn` raises; RuntimeError
        after `close`."""
        loop = asyncio.get_running_loop()
        job: Future[T] = self._executor.submit(fn)
        self._jobs += 1
        self._weight += weight
        job.add_done_callback(lambda f: _call_soon(loop, lambda: self._done(weight, not f.cancelled())))
        return await asyncio.wrap_future(job)

    def _done(self, weight: int, ran: bool) -> None:
        self._jobs -= 1
        self._weight -= weight
        self.completed += ran

    def close(self) -> None:
        """Queued jobs are dropped; a job running finishes in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop was closed: nothing is waiting any more
        loop.call_soon_threadsafe(fn)
