"""One simulated engine run in real time: submissions become `Pending` requests whose futures resolve
when the engine's `on_first_token` and `on_finish` fire.

Pacing a stream: a decoding request gets one token per engine step, so its tokens so far are 1 + the
steps that ended since its first token (`Pending.tokens_out`). That is exact unless the request is
preempted after its first token (its recomputation steps then count as tokens); the count is capped
below the total until `on_finish`, which always delivers the rest. A request whose client went away is
aborted (`abort`), as vLLM's server does: it leaves the engine before its next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from simulator import block_map, free_queue, hashing, records
from simulator.engine import Engine
from simulator.events import OnEvents
from simulator.kernel import Kernel
from simulator.records import RequestRecord, SimRequest
from simulator.serving.config import EngineServerConfig
from simulator.serving.realtime import RealtimeDriver

RecordHook = Callable[[RequestRecord, float], object]


class EngineStopped(Exception):
    """The server stopped before the request finished."""


@dataclass(eq=False)
class Pending:
    """A submitted request. `first_token` and `finished` resolve to kernel times."""

    output_ids: npt.NDArray[np.int64]
    first_token: asyncio.Future[float]
    finished: asyncio.Future[float]
    steps_at_first: int = 0  # engine steps ended when the first token came
    record: RequestRecord = field(init=False)  # set by `EngineRunner.submit`

    @property
    def max_tokens(self) -> int:
        return self.record.max_tokens

    def tokens_out(self, steps_ended: int) -> int:
        """Output tokens produced so far (see the module docstring)."""
        if self.finished.done():
            return self.max_tokens
        if not self.first_token.done():
            return 0
        return min(self.max_tokens - 1, 1 + steps_ended - self.steps_at_first)


class EngineRunner:
    """The kernel, the engine on it and the real-time driver; `first_token_hook` and `finish_hook` (settable
    until the engine runs) see every first token and finish."""

    def __init__(
        self,
        config: EngineServerConfig,
        *,
        on_events: OnEvents | None = None,
        on_first_token: RecordHook | None = None,
        on_finish: RecordHook | None = None,
    ) -> None:
        self.kernel = Kernel()
        self.engine = Engine(
            self.kernel,
            config.engine_config,
            config.latency,
            on_events=on_events,
            on_first_token=self._first_token,
            on_finish=self._finish,
        )
        self.driver = RealtimeDriver(self.kernel, config.time_scale)
        self.first_token_hook = on_first_token
        self.finish_hook = on_finish
        self.pending: set[Pending] = set()
        self.submitted = 0
        self.aborted = 0

    async def start(self) -> None:
        block_map.warm_up()  # compile (or load) the engine's compiled loops before the first request
        hashing.warm_up()
        free_queue.warm_up()
        records.warm_up()
        await self.driver.start()

    async def stop(self) -> None:
        await self.driver.stop()
        for p in self.pending:
            for fut in (p.first_token, p.finished):
                if not fut.done():
                    fut.set_exception(EngineStopped("the server is stopping"))
                    fut.exception()  # retrieved: no "never retrieved" warning if nobody awaits it
        self.pending.clear()

    def steps_ended(self) -> int:
        """Engine steps completed so far (one is in progress while the engine is busy)."""
        return self.engine.steps_ended()

    def advance(self) -> None:
        """Bring the engine to the wall clock's now (before reading its state)."""
        self.driver.advance()

    def submit(
        self,
        request_id: str,
        prompt_ids: npt.NDArray[np.int64],
        max_tokens: int,
        output_ids: npt.NDArray[np.int64],
        cache_salt: str | None = None,
    ) -> Pending:
        """Queue a request now; ValueError (nothing queued) if the engine refuses it. `output_ids`: the
        tokens it generates (at least `max_tokens - 1`)."""
        if not self.driver.running:
            raise EngineStopped("the engine is not running")
        self.driver.advance()
        loop = asyncio.get_running_loop()
        pending = Pending(output_ids, loop.create_future(), loop.create_future())
        req = SimRequest(request_id, prompt_ids, max_tokens, cache_salt, None, output_ids, context=pending)
        pending.record = self.engine.submit(req)
        self.pending.add(pending)
        self.submitted += 1
        self.driver.wake()
        return pending

    def reset_prefix_cache(self) -> bool:
        """`Engine.reset_prefix_cache` at the wall clock's now: False while requests are queued or running."""
        self.driver.advance()
        return self.engine.reset_prefix_cache()

    def abort(self, pending: Pending) -> bool:
        """Its client went away: the engine drops it (`Engine.abort`) and its futures are cancelled. False
        when it had finished already."""
        self.driver.advance()
        self.pending.discard(pending)
        for fut in (pending.first_token, pending.finished):
            fut.cancel()
        if not self.engine.abort(pending.record):
            return False
        self.aborted += 1
        self.driver.wake()
        return True

    def _first_token(self, record: RequestRecord, t: float) -> None:
        pending: Pending = record.request.context
        pending.steps_at_first = self.engine.steps  # called at the end of the step: every step has ended
        if not pending.first_token.done():
            pending.first_token.set_result(t)
        if self.first_token_hook is not None:
            self.first_token_hook(record, t)

    def _finish(self, record: RequestRecord, t: float) -> None:
        pending: Pending = record.request.context
        self.pending.discard(pending)
        if not pending.first_token.done():
            pending.first_token.set_result(record.first_token_s if record.first_token_s is not None else t)
        if not pending.finished.done():
            pending.finished.set_result(t)
        if self.finish_hook is not None:
            self.finish_hook(record, t)
