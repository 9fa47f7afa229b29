"""Selector mode (the asyncio edge): the Pods `--endpoint-selector` matches in the namespace are the
endpoints, on `--endpoint-target-ports`, without an InferencePool -- the reference EPP's "standalone"
mode (llm-d-router `cmd/epp/runner/runner.go`: with an endpoint selector it builds a fixed endpoint
pool from the flags and starts only its Pod reconciler, no InferencePool, InferenceObjective or
InferenceModelRewrite reconciler).

The spec is fixed, so this is `PodTracker` (`tracker.py`: the list/watch, backoff, metrics and
endpoint mapping the pool mode uses too) tracking it from the start: one task lists the matching
Pods and watches them. `ready` becomes true once they have been listed and stays true (there is no
pool to lose); outages keep the last known endpoint set.
"""

from __future__ import annotations

from collections.abc import Callable

from epp.datastore import Datastore
from epp.discovery.pool import PoolSpec
from epp.discovery.settings import DiscoverySettings
from epp.discovery.tracker import DiscoveryObserver, PodTracker, log
from epp.discovery.watcher import PoolWatcher


class SelectorWatcher(PodTracker):
    def _settings_problem(self, settings: DiscoverySettings) -> str | None:
        if settings.endpoint_selector is None:
            return "SelectorWatcher needs --endpoint-selector settings"
        return super()._settings_problem(settings)

    def _setup(self) -> None:
        settings = self.settings
        assert settings.endpoint_selector is not None  # `_settings_problem`
        selector = str(settings.endpoint_selector)
        self.spec = PoolSpec(selector, settings.endpoint_selector, settings.target_ports)
        self.subject = f"pods of {settings.namespace} matching --endpoint-selector {selector!r}"
        self.pods_subject = self.subject

    def _begin(self) -> None:
        log.info(
            "selector mode: %s, target ports %s (no InferencePool)",
            self.subject,
            ",".join(map(str, self.spec.ports)),
        )
        self._track(self.spec)


def watcher_for(
    datastore: Datastore,
    settings: DiscoverySettings,
    *,
    observer: DiscoveryObserver | None = None,
    on_change: Callable[[set[str]], None] | None = None,
) -> PodTracker:
    """The watcher `settings` ask for: `SelectorWatcher` in selector mode, else `PoolWatcher`."""
    cls = SelectorWatcher if settings.selector_mode else PoolWatcher
    return cls(datastore, settings, observer=observer, on_change=on_change)
