"""The index's state as plain data, for /debug/index and the metrics collector. Pure.

It carries counts and states only: never prompt text, token ids or block keys.
"""

from __future__ import annotations

from typing import Any

from epp.kvindex.ingest import KvIngest
from epp.kvindex.service import KvIndexService


def index_report(
    service: KvIndexService, ingest: KvIngest, mode: str, now: float, served_models: set[str] | None = None
) -> dict[str, Any]:
    """`served_models`: models the pool's endpoints serve; those without a tokenizer are listed, since
    precise scoring is off for their text and chat prompts."""
    stats = service.index.stats()
    pods: dict[str, Any] = {}
    names = sorted(set(service.index.pods()) | set(ingest.counters) | set(service.freshness.pods()))
    for pod in names:
        verdict = service.freshness.state(pod, now)
        c = ingest.counters.get(pod)
        pods[pod] = {
            "blocks": service.index.pod_counts(pod),
            "freshness": verdict.state.value,
            "reason": verdict.reason,
            "last_seq": ingest.last_seq.get(pod),
            "messages": c.messages if c else 0,
            "events": c.events if c else 0,
            "orphans": c.orphans if c else 0,
            "gaps": c.gaps if c else 0,
            "restarts": c.restarts if c else 0,
            "drops": dict(c.drops) if c else {},
            "replays": dict(c.replays) if c else {},
            "unknown_tiers": dict(c.unknown_tiers) if c else {},
            "skipped_groups": c.skipped_groups if c else 0,
        }
    unkeyed: dict[str, dict[str, int]] = {}
    for (model, reason), n in service.unkeyed.items():
        unkeyed.setdefault(model, {})[reason] = n
    return {
        "mode": mode,
        "block_size": service.block_size,
        "size": stats.entries,
        "max_entries": stats.max_entries,
        "evicted": stats.evicted,
        "orphans": stats.orphans,
        "tokenizers": {m: True for m in service.tokenizers.models()},
        "models_without_tokenizer": sorted((served_models or set()) - set(service.tokenizers.models())),
        "precise_scoring_off": unkeyed,
        "speculative_entries": {name: store.size() for name, store in sorted(service.speculative.items())},
        "pods": pods,
    }
