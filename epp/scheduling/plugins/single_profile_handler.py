"""`single-profile-handler`: every request runs the one configured profile."""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import PluginHandle
from epp.scheduling.registry import NoParams, PluginSpec
from epp.types import InferenceRequest


class SingleProfileHandler:
    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def select(self, request: InferenceRequest, profiles: Sequence[str]) -> str:
        return profiles[0]


def _build(name: str, params: NoParams, handle: PluginHandle) -> SingleProfileHandler:
    return SingleProfileHandler(name)


SPEC = PluginSpec(
    "single-profile-handler", "profile-handler", NoParams, _build, "Runs the single configured profile."
)
