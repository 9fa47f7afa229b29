"""Replay one trace against every chosen policy on identical simulated clusters. Pure (no I/O here).

Each policy gets a fresh cluster (same engines, same seed), so the figures differ only by the
routing. `progress` is called once per finished or rejected request, across policies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from epp.scheduling.scrape_settings import check_staleness_filters
from simulator import policies
from simulator.cluster import Cluster, ClusterConfig, build_router, computed_tokens
from simulator.kernel import Kernel
from simulator.results import COMPLETED, Figures, RequestRecord, cache_bounds, summarize
from simulator.traces import TraceRequest


@dataclass(frozen=True, slots=True)
class ReplayResult:
    summary: dict[str, Figures]
    records: dict[str, list[RequestRecord]]  # completed and rejected, by trace index
    bounds: dict[str, float]
    rejected: dict[str, int]


def resolve(names: str | Sequence[str], scrape_interval: float | None = None) -> list[str]:
    """`all`, or comma-separated policies: shipped names, or EPP config files (`PATH.yaml`,
    `NAME=PATH.yaml`, read and checked now: their routers are built, as each run builds them).
    ValueError naming the unknown ones, a file that cannot be read, parsed or built (`ConfigError`), two
    policies going by one name, or `all` beside other policies. With `scrape_interval` (`--scrape-interval`),
    also a `ConfigError` naming the policy, the plugin and both settings when a profile's
    metrics-staleness-filter allows metrics younger than the interval, as `epp serve` refuses it (its
    every request would be rejected; `check_staleness_filters`). Not `oracle`: it scrapes at every
    arrival. The saturation detector's threshold is not checked: it refuses only sheddable requests
    (priority < 0), and the simulator sends none."""
    known = policies.names()
    given = names.split(",") if isinstance(names, str) else list(names)
    wanted = [n.strip() for n in given if n.strip()]
    if "all" in wanted:
        if len(wanted) > 1:
            raise ValueError(f"'all' cannot be combined with other policies, got {','.join(wanted)!r}")
        wanted = known
    unknown = [n for n in wanted if n not in known and not policies.is_file(n)]
    if unknown or not wanted:
        raise ValueError(
            f"unknown policy {', '.join(unknown) or '(none)'}; known: {', '.join(known)}, all, "
            "or an EPP config file (PATH.yaml or NAME=PATH.yaml)"
        )
    wanted = list(dict.fromkeys(wanted))
    seen: dict[str, str] = {}
    for spec in wanted:
        name = policies.check_file(spec) if policies.is_file(spec) else spec
        if name in seen:
            raise ValueError(f"policies {seen[name]!r} and {spec!r} both go by {name!r}; name one NAME=PATH")
        seen[name] = spec
        config = policies.load(spec)
        router = build_router(config, Kernel(), 0)  # every plugin built now, not in a worker later
        if scrape_interval is not None and spec != policies.ORACLE:
            check_staleness_filters(
                config.source, router.scheduler, scrape_interval, flag="--scrape-interval", answer="rejected"
            )
    return wanted


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """One policy's run of the trace: its records (completed and rejected, by trace index), how many it
    rejected, the cluster's pods and its picks by mode."""

    name: str
    records: list[RequestRecord]
    rejected: int
    pods: list[str]
    modes: dict[str, int]


def run_policy(
    trace: Sequence[TraceRequest],
    name: str,
    cluster: ClusterConfig,
    progress: Callable[[RequestRecord], object] | None = None,
) -> PolicyRun:
    """One policy (a shipped name or a config file, see `resolve`); its run goes by `policies.label`."""
    c = Cluster(policies.load(name), cluster, oracle=name == policies.ORACLE, on_done=progress)
    recs = sorted(c.run(trace), key=lambda r: r.index)
    return PolicyRun(policies.label(name), recs, c.rejected, c.pods, dict(c.modes))


def assemble(
    runs: Sequence[PolicyRun], trace: Sequence[TraceRequest], cluster: ClusterConfig
) -> ReplayResult:
    """The result of policies' runs of one trace: their figures side by side, and the trace's bounds."""
    capacity = cluster.pods * (cluster.engine.num_gpu_blocks - 1 + cluster.engine.cpu_blocks)

    def bounds_of(requests: Sequence[TraceRequest]) -> dict[str, float]:
        computed = ((r.prompt, computed_tokens(r)) for r in requests)  # answers' blocks count too
        return cache_bounds(computed, cluster.engine.block_size, capacity)

    bounds = bounds_of(trace)
    summary: dict[str, Figures] = {}
    for run in runs:
        figures = summarize(run.records, run.pods)
        picks = sum(run.modes.values())
        for mode in ("cache-aware", "degraded", "load-only"):  # share of picks; 0 for cache-blind policies
            figures[f"picks_{mode.replace('-', '_')}_rate"] = run.modes.get(mode, 0) / picks if picks else 0.0
        # The bounds over the requests its hit rates are of: a policy that rejected some is measured on
        # the rest, which the trace's bounds (over every request) do not bound.
        done = [trace[r.index] for r in run.records if r.status == COMPLETED]
        own: Mapping[str, float | None] = (
            bounds if len(done) == len(trace) else bounds_of(done) if done else dict.fromkeys(bounds)
        )
        figures.update(own)
        summary[run.name] = figures
    records = {run.name: run.records for run in runs}
    return ReplayResult(summary, records, bounds, {run.name: run.rejected for run in runs})


def replay(
    trace: Sequence[TraceRequest],
    names: Sequence[str],
    cluster: ClusterConfig,
    progress: Callable[[RequestRecord], object] | None = None,
) -> ReplayResult:
    """Every policy in turn, in this process (`parallel.replay_parallel`: in worker processes)."""
    return assemble([run_policy(trace, name, cluster, progress) for name in names], trace, cluster)
