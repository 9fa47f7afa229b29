"""The one list of in-tree plugins, and the reference EPP's parameter names they also take.

`prefix-cache-scorer` is registered with the parameters of every reference release: besides our
`blockSizeChars`/`maxPrefixBlocks` and the older reference names its module accepts (`blockSize`,
`hashBlockSize`, `maxPrefixBlocksToMatch`), the newer `blockSizeTokens`, `maxPrefixTokensToMatch`
and `autoTune`, translated here to the scorer's own settings as the reference translates them
(4 characters per token). `metrics-data-source` and `core-metrics-extractor` are the reference's
data-layer plugins, which its Helm chart declares in the default config: accepted when they
describe what this EPP does anyway (scrape `http://<endpoint>/metrics`, read vLLM's and SGLang's
metrics by name), so such a config loads; no profile can use them. `precise-prefix-cache-scorer`
also takes llm-d's `speculativeIndexing`/`speculativeTTL` and `tokenProcessorConfig` (not needed
here), and names where llm-d's `indexerConfig`/`kvEventsConfig` settings go instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from epp.scheduling.framework import Plugin, PluginHandle
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
from epp.scheduling.registry import Params, PluginParamsError, PluginRegistry, PluginSpec

REFERENCE_CHARS_PER_TOKEN = 4
"""The reference EPP's `averageCharactersPerToken`: its token block sizes are this many characters a token."""


class PrefixCacheParams(approx_prefix_scorer.ApproxPrefixParams):
    """`prefix-cache-scorer`'s parameters, with the newer reference EPP's names."""

    block_size_tokens: int | None = None
    max_prefix_tokens_to_match: int | None = None
    auto_tune: bool | None = None  # accepted; this EPP never sizes the index from engine metrics


def _block_chars(params: approx_prefix_scorer.ApproxPrefixParams) -> int:
    given = (params.block_size_chars, params.block_size, params.hash_block_size)
    return next((v for v in given if v is not None), approx_prefix_scorer.BLOCK_CHARS_DEFAULT)


def prefix_cache_settings(params: PrefixCacheParams) -> approx_prefix_scorer.ApproxPrefixParams:
    """The scorer's own parameters for `params`, the reference's token-denominated ones translated.

    As in the reference: `blockSizeTokens` is `4 x blockSizeTokens` characters and wins over its
    deprecated character `blockSize`; `maxPrefixTokensToMatch` (0: unset) is
    `maxPrefixTokensToMatch / blockSizeTokens` blocks and wins over `maxPrefixBlocksToMatch`.
    """
    own = {f: getattr(params, f) for f in approx_prefix_scorer.ApproxPrefixParams.__struct_fields__}
    out = approx_prefix_scorer.ApproxPrefixParams(**own)
    tokens = params.block_size_tokens
    if tokens is not None:
        for key, value in (
            ("blockSizeChars", params.block_size_chars),
            ("hashBlockSize", params.hash_block_size),
        ):
            if value is not None:
                raise PluginParamsError(
                    "blockSizeTokens",
                    f"blockSizeTokens and {key} are the same setting: give only one of them",
                )
        if tokens < 1:
            raise PluginParamsError("blockSizeTokens", f"must be >= 1, got {tokens}")
        out = msgspec.structs.replace(
            out, block_size_chars=tokens * REFERENCE_CHARS_PER_TOKEN, block_size=None
        )
    max_tokens = params.max_prefix_tokens_to_match
    if max_tokens:  # 0 is the reference's "unset"
        if params.max_prefix_blocks is not None:
            raise PluginParamsError(
                "maxPrefixTokensToMatch",
                "maxPrefixTokensToMatch and maxPrefixBlocks set the same limit: give only one of them",
            )
        block_chars = _block_chars(out)
        if block_chars < 1:
            return out  # the scorer names the bad block size
        blocks = max_tokens * REFERENCE_CHARS_PER_TOKEN // block_chars
        if blocks < 1:
            raise PluginParamsError(
                "maxPrefixTokensToMatch",
                f"must cover at least one block ({block_chars} characters, "
                f"{block_chars / REFERENCE_CHARS_PER_TOKEN:g} tokens), got {max_tokens}",
            )
        out = msgspec.structs.replace(out, max_prefix_blocks=blocks, max_prefix_blocks_to_match=None)
    return out


def translated(spec: PluginSpec, params_type: type[Params], settings: Callable[[Any], Any]) -> PluginSpec:
    """`spec` configured with `params_type` (its own parameters plus the reference's names for them),
    which `settings` turns into its own parameters before it is built."""

    def build(name: str, params: Any, handle: PluginHandle) -> Plugin:
        return spec.build(name, settings(params), handle)

    return PluginSpec(spec.type_name, spec.kind, params_type, build, spec.doc)


PREFIX_CACHE_SPEC = translated(approx_prefix_scorer.SPEC, PrefixCacheParams, prefix_cache_settings)


class LlmdTokenProcessorConfig(Params):
    """llm-d's `tokenProcessorConfig`: its block keys must match vLLM's (block size, hash seed).
    Accepted and not needed: this EPP's keys depend on neither (`epp/kvindex/keys.py`)."""

    block_size: int | None = None
    block_size_tokens: int | None = None
    hash_seed: str | None = None
    hash_algorithm: str | None = None


LLMD_SPECULATIVE_TTL = "2s"
"""llm-d's `defaultSpeculativeTTL`, used with `speculativeIndexing: true` and no TTL."""


class PrecisePrefixCacheParams(Params):
    """`precise-prefix-cache-scorer`'s parameters (`PrecisePrefixParams`), with llm-d's names for the same
    settings; `speculativeTtl` is unset unless given, so that `speculativeIndexing` can tell."""

    tier_weights: dict[str, float] = msgspec.field(default_factory=dict)
    unknown_tier_weight: float = 0.0
    speculative_ttl: str | float | None = None  # unset: off unless speculativeIndexing is true
    speculative_indexing: bool | None = None
    speculative_ttl_llmd: str | float | None = msgspec.field(default=None, name="speculativeTTL")
    token_processor_config: LlmdTokenProcessorConfig | None = None
    indexer_config: dict[str, Any] | None = None
    kv_events_config: dict[str, Any] | None = None


_LLMD_SECTIONS = {
    "indexerConfig": (
        "llm-d's indexer settings are not parameters here: give each model's tokenizer directory under "
        "the top-level `tokenizers` section (no downloads) and the index size under `index`"
    ),
    "kvEventsConfig": (
        "llm-d's KV-event settings are not parameters here: set the top-level `kvEvents` section "
        "(mode per-pod with the engines' port, or central with the address to bind)"
    ),
}


def precise_prefix_settings(params: PrecisePrefixCacheParams) -> precise_prefix_scorer.PrecisePrefixParams:
    """The scorer's own parameters for `params`. llm-d's `speculativeIndexing: true` is a speculative TTL
    of `speculativeTTL` (2s unless given); `false` turns it off, as in llm-d."""
    for key, value in (("indexerConfig", params.indexer_config), ("kvEventsConfig", params.kv_events_config)):
        if value is not None:
            raise PluginParamsError(key, _LLMD_SECTIONS[key])
    if params.speculative_ttl is not None and params.speculative_ttl_llmd is not None:
        raise PluginParamsError("speculativeTTL", "speculativeTTL and speculativeTtl are the same setting")
    ttl = params.speculative_ttl if params.speculative_ttl is not None else params.speculative_ttl_llmd
    if params.speculative_indexing is False:
        ttl = 0.0
    elif params.speculative_indexing and ttl is None:
        ttl = LLMD_SPECULATIVE_TTL
    return precise_prefix_scorer.PrecisePrefixParams(
        tier_weights=params.tier_weights,
        unknown_tier_weight=params.unknown_tier_weight,
        speculative_ttl=0.0 if ttl is None else ttl,
    )


PRECISE_PREFIX_SPEC = translated(
    precise_prefix_scorer.SPEC, PrecisePrefixCacheParams, precise_prefix_settings
)


class DataLayerPlugin:
    """A reference data-layer plugin that names what this EPP already does; it does nothing itself."""

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name


class MetricsDataSourceParams(Params):
    scheme: str = "http"
    path: str = "/metrics"
    insecure_skip_verify: bool = True  # https only


SCRAPED_SCHEME = "http"
SCRAPED_PATH = "/metrics"


def _build_metrics_data_source(
    name: str, params: MetricsDataSourceParams, handle: PluginHandle
) -> DataLayerPlugin:
    for key, value, scraped in (
        ("scheme", params.scheme, SCRAPED_SCHEME),
        ("path", params.path, SCRAPED_PATH),
    ):
        if value != scraped:
            raise PluginParamsError(
                key,
                f"this EPP scrapes every endpoint at {SCRAPED_SCHEME}://<endpoint>{SCRAPED_PATH}; "
                f"{key} {value!r} is not supported",
            )
    return DataLayerPlugin(name)


class CoreMetricsExtractorParams(Params):
    engine_label_key: str | None = None
    default_engine: str | None = None
    engine_configs: list[dict[str, Any]] | None = None


def _build_core_metrics_extractor(
    name: str, params: CoreMetricsExtractorParams, handle: PluginHandle
) -> DataLayerPlugin:
    for key, value in (
        ("engineLabelKey", params.engine_label_key),
        ("defaultEngine", params.default_engine),
        ("engineConfigs", params.engine_configs),
    ):
        if value is not None:
            raise PluginParamsError(
                key,
                "custom metric mappings are not supported: this EPP reads vLLM's and SGLang's metrics by "
                "their names on every endpoint",
            )
    return DataLayerPlugin(name)


METRICS_DATA_SOURCE_SPEC = PluginSpec(
    "metrics-data-source",
    "data-source",
    MetricsDataSourceParams,
    _build_metrics_data_source,
    "The reference's metrics source: accepted for http://<endpoint>/metrics, what this EPP scrapes.",
)
CORE_METRICS_EXTRACTOR_SPEC = PluginSpec(
    "core-metrics-extractor",
    "data-extractor",
    CoreMetricsExtractorParams,
    _build_core_metrics_extractor,
    "The reference's metrics extractor: accepted without parameters (vLLM/SGLang metrics read by name).",
)

BUILTIN_SPECS: tuple[PluginSpec, ...] = (
    queue_scorer.SPEC,
    kv_cache_utilization_scorer.SPEC,
    running_requests_scorer.SPEC,
    active_request_scorer.SPEC,
    token_load_scorer.SPEC,
    PRECISE_PREFIX_SPEC,
    PREFIX_CACHE_SPEC,
    dynamo_kv_scorer.SPEC,
    sglang_cache_aware_scorer.SPEC,
    ttft_scorer.SPEC,
    max_score_picker.SPEC,
    random_picker.SPEC,
    round_robin_picker.SPEC,
    softmax_picker.SPEC,
    staleness_filter.SPEC,
    single_profile_handler.SPEC,
    METRICS_DATA_SOURCE_SPEC,
    CORE_METRICS_EXTRACTOR_SPEC,
)


def default_registry() -> PluginRegistry:
    """A fresh registry holding every in-tree plugin."""
    registry = PluginRegistry()
    for spec in BUILTIN_SPECS:
        registry.register(spec)
    return registry
