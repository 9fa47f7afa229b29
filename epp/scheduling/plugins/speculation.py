"""What the cache-aware scorers with `speculativeTtl` share: the parameter, and remembering a routed
prompt for the chosen pod (`epp/kvindex/speculative.py`)."""

from __future__ import annotations

from epp.durations import parse_duration
from epp.kvindex.service import KvIndexService
from epp.kvindex.speculative import SpeculativeBlocks
from epp.scheduling.framework import CycleState
from epp.scheduling.plugins.prompt_keys import prompt_key_list, prompt_keys
from epp.scheduling.registry import PluginParamsError
from epp.types import EndpointId, InferenceRequest


def speculative_blocks(
    ttl: str | float, plugin: str, service: KvIndexService | None
) -> SpeculativeBlocks | None:
    """The store for a `speculativeTtl` value of scorer `plugin`; None when it is 0 or there is no index
    (the value is checked all the same). The store is listed in `service.speculative` under the plugin's
    name (its size is reported; a plugin built again replaces its entry). PluginParamsError for a bad
    duration."""
    try:
        seconds = parse_duration(ttl)
    except ValueError as err:
        raise PluginParamsError("speculativeTtl", str(err)) from None
    if service is None:
        return None
    store = SpeculativeBlocks(seconds) if seconds > 0 else None
    if store is None:
        service.speculative.pop(plugin, None)
    else:
        service.speculative[plugin] = store
    return store


def remember(
    store: SpeculativeBlocks | None,
    service: KvIndexService | None,
    state: CycleState,
    request: InferenceRequest,
    endpoint: EndpointId,
) -> None:
    """The routed prompt's blocks count as `endpoint`'s in `store` (if any) from now."""
    if store is None or service is None:
        return
    keys = prompt_keys(state, request, service)
    if keys is not None and len(keys):
        store.add(endpoint, prompt_key_list(state, keys), state.now)
