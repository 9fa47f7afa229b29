"""What an engine with vLLM's async scheduling has decided a step ahead. Pure.

vLLM's engine core (`EngineCore.step_with_batch_queue`, two batches in flight) schedules step k+1 while
step k runs. So, in the simulator's terms (`engine.py` schedules step k+1 when step k ends):

- a request submitted while step k runs was not seen when step k+1 was scheduled: it is held and
  reaches the scheduler at step k+2 (`hold`, `release`), unless nothing runs or waits then (vLLM's
  step scheduled ahead was empty and it schedules the next one at once);
- the blocks and running slots that the requests ending with step k free were still theirs when step
  k+1 was scheduled: admission into step k+1 leaves them alone (`held_back`, read by
  `Scheduler.schedule`), except the blocks a request's prefix hit finds among them (vLLM found those
  in use, so they cost nothing of its free queue);
- `pipelined`: the step being scheduled follows one that ran, so vLLM scheduled it during that one and
  sent its KV events and stats when that one ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from simulator.scheduler import NOTHING_HELD, HeldBack

if TYPE_CHECKING:
    from simulator.kvcache import ReqState


class StepAhead:
    __slots__ = ("_freed", "_freed_ids", "held", "pipelined")

    def __init__(self) -> None:
        self.held: list[tuple[int, ReqState]] = []  # (the step in flight at submission, the request)
        self.pipelined = False
        self._freed = (0, 0)  # (blocks, running slots) the requests ending with the last step freed
        self._freed_ids: set[int] = set()  # the blocks they held

    def hold(self, flight: int, r: ReqState) -> None:
        """r was submitted while step `flight` ran."""
        self.held.append((flight, r))

    def drop(self, r: ReqState) -> bool:
        """r, aborted, leaves if it is held (True)."""
        for i, (_, h) in enumerate(self.held):
            if h is r:
                del self.held[i]
                return True
        return False

    def release(self, s: int, busy: bool) -> list[ReqState]:
        """The held requests that reach the scheduler at step s, in arrival order: those submitted while
        step s - 2 or earlier ran; all of them when none is due and nothing runs or waits (`busy` False)."""
        held = self.held
        keep = [h for h in held if h[0] + 2 > s]
        if len(keep) == len(held):
            if busy:
                return []
            keep = []
        self.held = keep
        if not keep:
            return [r for _, r in held]
        return [r for flight, r in held if flight + 2 <= s]

    def release_all(self) -> list[ReqState]:
        out = [r for _, r in self.held]
        self.held = []
        return out

    def step_ends(self) -> None:
        """A step ends: what the step before freed no longer matters."""
        if self._freed_ids:
            self._freed_ids = set()

    def freeing(self, r: ReqState) -> None:
        """r's blocks are freed as this step ends (it finished or was aborted)."""
        self._freed_ids.update(r.table[: r.nblocks].tolist())

    def freed(self, blocks: int, slots: int) -> None:
        """What the requests that ended with this step freed, in all."""
        self._freed = (max(blocks, 0), max(slots, 0))

    def held_back(self) -> HeldBack:
        """For `Scheduler.held_back` when the next step is scheduled while something runs."""
        if self._freed == (0, 0):
            return NOTHING_HELD
        return (*self._freed, self._freed_ids)
