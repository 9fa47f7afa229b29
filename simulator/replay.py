"""Replay one trace against every chosen policy on identical simulated clusters. Pure (no I/O here).

Each policy gets a fresh cluster (same engines, same seed), so the figures differ only by the
routing. `progress` is called once per finished request, across policies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from simulator import policies
from simulator.cluster import Cluster, ClusterConfig
from simulator.results import RequestRecord, cache_bounds, summarize
from simulator.traces import TraceRequest


@dataclass(frozen=True, slots=True)
class ReplayResult:
    summary: dict[str, dict[str, float]]
    records: dict[str, list[RequestRecord]]
    bounds: dict[str, float]
    rejected: dict[str, int]


def resolve(names: str | Sequence[str]) -> list[str]:
    """`all`, or comma-separated policies: shipped names, or EPP config files (`PATH.yaml`,
    `NAME=PATH.yaml`, read and checked now). ValueError naming the unknown ones, a file that cannot be
    read or parsed, or two policies going by one name."""
    known = policies.names()
    given = names.split(",") if isinstance(names, str) else list(names)
    wanted = known if names == "all" else [n.strip() for n in given if n.strip()]
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
    return wanted


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """One policy's run of the trace: its records (by trace index), rejections, the cluster's pods and
    its picks by mode."""

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
    summary: dict[str, dict[str, float]] = {}
    for run in runs:
        figures = summarize(run.records, run.pods)
        figures["rejected"] = float(run.rejected)
        picks = sum(run.modes.values())
        for mode in ("cache-aware", "degraded", "load-only"):  # share of picks; 0 for cache-blind policies
            figures[f"picks_{mode.replace('-', '_')}_rate"] = run.modes.get(mode, 0) / picks if picks else 0.0
        summary[run.name] = figures
    capacity = cluster.pods * (cluster.engine.num_gpu_blocks - 1 + cluster.engine.cpu_blocks)
    bounds = cache_bounds((r.prompt for r in trace), cluster.engine.block_size, capacity)
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
