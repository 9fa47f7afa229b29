"""Discovery settings for tests against the fake Kubernetes API server (`epp.testing.kube_api`): quick
retries, short watches, and a kubeconfig pointing at the fake."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import AsyncIterator
from typing import Any

from epp.clock import MonotonicClock
from epp.datastore import Datastore
from epp.discovery.settings import DiscoverySettings
from epp.discovery.watcher import PoolWatcher
from epp.testing.kube_api import FakeKubeApi

FAST: dict[str, Any] = {"backoff_initial": 0.02, "backoff_max": 0.2, "watch_timeout": 60}


def fast_settings(kubeconfig: str, pool: str = "", **kw: Any) -> DiscoverySettings:
    """Settings for `pool` (or selector mode, given `endpoint_selector`) with quick retries; `kw` override."""
    return DiscoverySettings(pool, kubeconfig=kubeconfig, **{**FAST, **kw})


def settings_at(api: FakeKubeApi, tmp_path: pathlib.Path, pool: str = "", **kw: Any) -> DiscoverySettings:
    """`fast_settings` with a kubeconfig for `api` written in `tmp_path`."""
    return fast_settings(api.write_kubeconfig(tmp_path / "kubeconfig"), pool, **kw)


@contextlib.asynccontextmanager
async def pool_watching(settings: DiscoverySettings) -> AsyncIterator[tuple[PoolWatcher, Datastore]]:
    """A started `PoolWatcher` over a fresh datastore, stopped on exit."""
    ds = Datastore(MonotonicClock())
    w = PoolWatcher(ds, settings)
    await w.start()
    try:
        yield w, ds
    finally:
        await w.stop()
