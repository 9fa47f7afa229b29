"""The one list of in-tree plugins."""

from __future__ import annotations

from epp.scheduling.plugins import (
    active_request_scorer,
    approx_prefix_scorer,
    dynamo_kv_scorer,
    kv_cache_utilization_scorer,
    max_score_picker,
    precise_prefix_scorer,
    queue_scorer,
    random_picker,
    round_robin_picker,
    running_requests_scorer,
    sglang_cache_aware_scorer,
    single_profile_handler,
    softmax_picker,
    staleness_filter,
    token_load_scorer,
    ttft_scorer,
)
from epp.scheduling.registry import PluginRegistry, PluginSpec

BUILTIN_SPECS: tuple[PluginSpec, ...] = (
    queue_scorer.SPEC,
    kv_cache_utilization_scorer.SPEC,
    running_requests_scorer.SPEC,
    active_request_scorer.SPEC,
    token_load_scorer.SPEC,
    precise_prefix_scorer.SPEC,
    approx_prefix_scorer.SPEC,
    dynamo_kv_scorer.SPEC,
    sglang_cache_aware_scorer.SPEC,
    ttft_scorer.SPEC,
    max_score_picker.SPEC,
    random_picker.SPEC,
    round_robin_picker.SPEC,
    softmax_picker.SPEC,
    staleness_filter.SPEC,
    single_profile_handler.SPEC,
)


def default_registry() -> PluginRegistry:
    """A fresh registry holding every in-tree plugin."""
    registry = PluginRegistry()
    for spec in BUILTIN_SPECS:
        registry.register(spec)
    return registry
