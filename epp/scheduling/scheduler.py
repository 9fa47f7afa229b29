"""schedule(request, candidates) -> Decision. Pure: the clock and random source are given."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epp.clock import Clock
from epp.scheduling.admission import Admission
from epp.scheduling.errors import NoEndpointsError, PoolSaturatedError
from epp.scheduling.framework import ESTIMATES, FASTEST, MODE, RANKING, CycleState, ProfileHandler
from epp.scheduling.profile import PluginTiming, SchedulerProfile
from epp.scheduling.saturation import SaturationDetector
from epp.types import Decision, Endpoint, InferenceRequest


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    decision: Decision
    timings: tuple[PluginTiming, ...] = ()


class Scheduler:
    def __init__(
        self,
        profiles: Mapping[str, SchedulerProfile],
        handler: ProfileHandler,
        clock: Clock,
        rng: random.Random,
        saturation: SaturationDetector | None = None,
        timer: Clock | None = None,
        admission: Admission | None = None,
    ) -> None:
        if not profiles:
            raise ValueError("a scheduler needs at least one profile")
        self.profiles = dict(profiles)
        self._names = tuple(self.profiles)
        self.handler = handler
        self.clock = clock
        self.rng = rng
        self.saturation = saturation or SaturationDetector()
        self.timer = timer
        self.admission = admission or Admission()

    def precheck(
        self, request: InferenceRequest, candidates: Sequence[Endpoint], filters: bool = False
    ) -> None:
        """The refusals that come before any scorer: no candidates; a sheddable request while the pool is
        saturated; with `filters`, and a single profile, its filters leaving none (they run on a scratch
        cycle state with their own random source: the scheduler's is not drawn from). Raises what
        `schedule` would. The server asks before tokenizing a prompt ahead."""
        self._refuse(request, candidates, self.clock.now(), filters)

    def _refuse(
        self, request: InferenceRequest, candidates: Sequence[Endpoint], now: float, filters: bool
    ) -> None:
        if not candidates:
            raise NoEndpointsError("no endpoints available")
        if request.sheddable and self.saturation.pool_saturated(candidates, now):
            raise PoolSaturatedError("pool is saturated and the request is sheddable")
        if filters and len(self.profiles) == 1:
            (profile,) = self.profiles.values()
            profile.filter(CycleState(now=now, rng=random.Random(0)), request, candidates)

    def schedule(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> ScheduleResult:
        now = self.clock.now()
        self._refuse(request, candidates, now, filters=False)  # (the filters run in the profile)
        profile = self.profiles[self.handler.select(request, self._names)]
        state = CycleState(now=now, rng=self.rng)
        timings: list[PluginTiming] = []
        result = profile.run(state, request, candidates, self.timer, timings)
        data = state.data
        self.admission.check(request, data.get(FASTEST))
        profile.picked(state, request, result.endpoints[0])
        decision = Decision(
            endpoints=tuple(result.endpoints),
            profile=profile.name,
            reason=data.get("reason", "scored"),
            scores=result.scores,
            mode=data.get(MODE, ""),
            estimates=data.get(ESTIMATES) or {},
            ranking=data.get(RANKING),
        )
        return ScheduleResult(decision, tuple(timings))
