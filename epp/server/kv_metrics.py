"""Prometheus view of the KV index, computed at scrape time (nothing is counted per event)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.clock import Clock
from epp.kvindex.freshness import Freshness
from epp.kvindex.ingest import KvIngest
from epp.kvindex.service import KvIndexService


class KvIndexCollector(Collector):
    def __init__(
        self,
        service: KvIndexService,
        ingest: KvIngest,
        clock: Clock,
        served_models: Callable[[], set[str]] | None = None,
        socket_errors: Mapping[str, int] | None = None,
    ) -> None:
        """`served_models`: the models the pool's endpoints serve (those without a tokenizer get a 0)."""
        self.service = service
        self.ingest = ingest
        self.clock = clock
        self.served_models = served_models
        self.socket_errors = socket_errors  # the subscriber's, by what for ("stream", "replay")

    def collect(self) -> Iterator[Metric]:
        now = self.clock.now()
        stats = self.service.index.stats()
        size = GaugeMetricFamily("inference_extension_prefix_indexer_size", "Entries in the prefix index")
        size.add_metric([], stats.entries)
        entries = GaugeMetricFamily("epp_kv_index_entries", "(block, pod, tier) entries in the KV index")
        entries.add_metric([], stats.entries)
        evicted = CounterMetricFamily("epp_kv_index_evictions", "Entries evicted by the index's memory bound")
        evicted.add_metric([], stats.evicted)
        speculative = GaugeMetricFamily(
            "epp_kv_speculative_entries",
            "(block, pod) entries a scorer keeps for prompts it just routed (speculativeTtl), expired ones "
            "not yet dropped included",
            labels=["plugin"],
        )
        for plugin, store in sorted(self.service.speculative.items()):
            speculative.add_metric([plugin], store.size())
        blocks = GaugeMetricFamily(
            "epp_kv_pod_blocks", "Blocks the index holds per pod and tier", labels=["pod", "tier"]
        )
        fresh = GaugeMetricFamily(
            "epp_kv_pod_freshness",
            "1 for the pod's current index state and reason",
            labels=["pod", "state", "reason"],
        )
        per_pod = {
            name: CounterMetricFamily(f"epp_kv_{name}", doc, labels=["pod"])
            for name, doc in (
                ("messages", "Event batches applied per pod"),
                ("events", "Events applied per pod"),
                ("orphans", "BlockStored events whose parent block was unknown"),
                ("gaps", "Sequence gaps seen per pod"),
                ("restarts", "Engine restarts (sequence went back) per pod"),
            )
        }
        drops = CounterMetricFamily(
            "epp_kv_drops", "Messages or events dropped, by pod and reason", labels=["pod", "reason"]
        )
        replays = CounterMetricFamily(
            "epp_kv_replays", "Replays by pod and outcome", labels=["pod", "outcome"]
        )
        unknown = CounterMetricFamily(
            "epp_kv_unknown_tier_events",
            "BlockStored events on tiers the EPP has no name for",
            labels=["pod", "tier"],
        )
        svc = self.service
        for pod in sorted(set(svc.index.pods()) | set(self.ingest.counters) | set(svc.freshness.pods())):
            for tier, n in svc.index.pod_counts(pod).items():
                blocks.add_metric([pod, tier], n)
            v = svc.freshness.state(pod, now)
            for state in Freshness:
                fresh.add_metric(
                    [pod, state.value, v.reason if state is v.state else ""], 1.0 if state is v.state else 0.0
                )
            c = self.ingest.counters.get(pod)
            if c is None:
                continue
            for name, fam in per_pod.items():
                fam.add_metric([pod], getattr(c, name))
            for reason, n in c.drops.items():
                drops.add_metric([pod, reason], n)
            for outcome, n in c.replays.items():
                replays.add_metric([pod, outcome], n)
            for tier, n in c.unknown_tiers.items():
                unknown.add_metric([pod, tier], n)
        tok = GaugeMetricFamily(
            "epp_kv_tokenizer_available",
            "1 when a tokenizer is configured for the model, 0 for a served model without one (precise "
            "scoring is off for its text and chat prompts)",
            labels=["model"],
        )
        configured = svc.tokenizers.models()
        for model in configured:
            tok.add_metric([model], 1.0)
        for model in sorted((self.served_models() if self.served_models else set()) - set(configured)):
            tok.add_metric([model], 0.0)
        unkeyed = CounterMetricFamily(
            "epp_kv_unkeyed_requests",
            "Requests the precise prefix scorer could not key (no tokenizer for the model, tokenizer error)",
            labels=["model", "reason"],
        )
        for (model, reason), n in svc.unkeyed.items():
            unkeyed.add_metric([model, reason], n)
        sockets = CounterMetricFamily(
            "epp_kv_socket_errors",
            "ZeroMQ sockets the KV-event subscriber could not open (file descriptors or sockets "
            "exhausted), by what for: stream (retried at the next sync) or replay (a failed attempt)",
            labels=["kind"],
        )
        for kind in ("stream", "replay"):
            sockets.add_metric([kind], (self.socket_errors or {}).get(kind, 0))
        yield from (
            size,
            entries,
            evicted,
            speculative,
            blocks,
            fresh,
            *per_pod.values(),
            drops,
            replays,
            unknown,
            tok,
            unkeyed,
            sockets,
        )
