"""Writing a replay's results: `summary.json`, per-request records, PNG plots and a printed table.

`summary.json` maps each policy name to its figures (named with their units; null where a policy
completed no request; with the cache references over the requests it completed) and carries the run's
metadata (trace, pods, seed, version, commit) and the trace's cache references over every request. The
records files hold every request, completed or rejected (`status`); `records-*.jsonl` files of policies
not in the run are removed, so the directory holds one run. `check_out` tries the directory before a
run: one that cannot be written is a ValueError then, not an OSError after the simulation.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a display

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from simulator.results import Figures, RequestRecord

TABLE_COLUMNS = (
    ("ttft_mean_s", "TTFT mean", 1e3, "ms"),
    ("ttft_p50_s", "p50", 1e3, "ms"),
    ("ttft_p90_s", "p90", 1e3, "ms"),
    ("ttft_p99_s", "p99", 1e3, "ms"),
    ("tpot_mean_s", "TPOT", 1e3, "ms"),
    ("e2e_mean_s", "E2E", 1.0, "s"),
    ("throughput_rps", "req/s", 1.0, ""),
    ("token_hit_rate", "tok hit", 100.0, "%"),
    ("request_hit_rate", "req hit", 100.0, "%"),
    ("load_imbalance", "imbal", 1.0, "x"),
    ("rejected_requests", "rejected", 1.0, ""),
)


def _cell(value: float | None, scale: float) -> str:
    if value is None:
        return "-"
    v = value * scale
    return f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"


def rejections(summary: Mapping[str, Figures]) -> list[str]:
    """One line per policy that rejected requests: how many, and what its figures are made of."""
    lines = []
    for policy, figures in summary.items():
        rejected, done = int(figures["rejected_requests"] or 0), int(figures["requests"] or 0)
        if rejected:
            of = f"{rejected} of {rejected + done} requests" if done else f"all {rejected} requests"
            tail = f"its figures are those of the {done} it completed" if done else "it has no figures"
            bound = figures.get("infinite_cache_token_hit_rate")
            if done and bound is not None:
                tail += f" (one infinite shared cache over those: token hit rate {bound * 100:.1f}%)"
            lines.append(f"{policy} rejected {of} (the router found no pod for them); {tail}")
    return lines


def table(summary: Mapping[str, Figures], bounds: Mapping[str, float] | None = None) -> str:
    """The policies side by side, one row each ("-": no figure, the policy completed no request)."""
    head = ["policy", *(f"{name} ({unit})" if unit else name for _, name, _, unit in TABLE_COLUMNS)]
    rows = [head]
    for policy, figures in summary.items():
        row = [policy]
        for key, _, scale, _ in TABLE_COLUMNS:
            value = figures.get(key)
            count = key == "rejected_requests" and value is not None
            row.append(str(int(value or 0)) if count else _cell(value, scale))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    if bounds:
        lines.append(
            "token hit rate of one infinite shared cache (a bound) "
            f"{bounds['infinite_cache_token_hit_rate'] * 100:.1f}%, of one LRU with the cluster's capacity "
            f"(a reference, not a bound) {bounds['cluster_lru_token_hit_rate'] * 100:.1f}%"
        )
    lines += rejections(summary)
    lines += estimate_lines(summary)
    return "\n".join(lines)


def estimate_lines(summary: Mapping[str, Figures]) -> list[str]:
    """A line per policy whose router estimated TTFT: how its estimates compared with what happened."""
    out = []
    for policy, figures in summary.items():
        p10, p50, p90 = (figures.get(f"ttft_estimate_ratio_p{q}") for q in (10, 50, 90))
        if p10 is not None and p50 is not None and p90 is not None:
            out.append(
                f"{policy}: observed / estimated TTFT p10 {p10:.2f}, p50 {p50:.2f}, p90 {p90:.2f} "
                "(1: the router's estimate was exact)"
            )
    return out


SUMMARY = "summary.json"
PLOTS = ("ttft_cdf.png", "hit_rates.png")
RECORDS = "records-*.jsonl"


def records_name(policy: str) -> str:
    return f"records-{policy}.jsonl"


def files(out: pathlib.Path, policies: Sequence[str]) -> list[pathlib.Path]:
    """The files a run of `policies` writes under `out`."""
    return [out / SUMMARY, *(out / records_name(p) for p in policies), *(out / name for name in PLOTS)]


def check_out(out: pathlib.Path, policies: Sequence[str]) -> None:
    """Make sure the results of `policies` can be written under `out` (created): a file can be created
    and removed there, and none of the result files' names is taken by a directory or a file that cannot
    be written. ValueError naming `--out` and what is wrong."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {out}: cannot create the results directory: {err.strerror or err}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".epp-sim-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"--out {out}: cannot write in the results directory: {err.strerror or err}"
        ) from None
    for path in files(out, policies):
        if path.exists() and not path.is_file():
            raise ValueError(f"--out {out}: {path} is in the way: it exists and is not a file")
        if path.is_file() and not os.access(path, os.W_OK):
            raise ValueError(f"--out {out}: {path} exists and cannot be written")


def write(
    out: pathlib.Path,
    summary: Mapping[str, Figures],
    records: Mapping[str, Sequence[RequestRecord]],
    meta: Mapping[str, Any],
    bounds: Mapping[str, float],
) -> list[pathlib.Path]:
    """Write every result file under `out` (created), then remove the `records-*.jsonl` files of policies
    not in `records` (left by an earlier run); returns the paths written. OSError if a file cannot be
    written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    doc = {"meta": dict(meta), "bounds": dict(bounds), "policies": {k: dict(v) for k, v in summary.items()}}
    path = out / SUMMARY
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    written.append(path)
    for policy, recs in records.items():
        path = out / records_name(policy)
        with path.open("w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r.to_json()) + "\n")
        written.append(path)
    written += plots(out, summary, records, bounds)
    ours = {p.name for p in written}
    for stale in sorted(out.glob(RECORDS)):
        if stale.name not in ours and stale.is_file():
            stale.unlink()
    return written


def ttft_cdf(ax: Axes, names: Sequence[str], records: Mapping[str, Sequence[RequestRecord]]) -> None:
    """Each policy's TTFT distribution of its completed requests on `ax`: a step from probability 0 up to
    1, so a single request is a visible vertical step too; one marker per request up to 50."""
    for name in names:
        ttft = np.sort([r.ttft_s for r in records[name] if r.ttft_s is not None])  # completed ones
        if ttft.size:
            xs = np.concatenate([ttft[:1], ttft])
            ys = np.concatenate([[0.0], np.arange(1, ttft.size + 1) / ttft.size])
            marker = "o" if ttft.size <= 50 else None
            total = len(records[name])
            label = name if ttft.size == total else f"{name} ({ttft.size} of {total} completed)"
            ax.step(xs, ys, where="post", label=label, marker=marker, markersize=3)
    ax.set_xscale("log")
    ax.set_ylim(0.0, 1.0)


def plots(
    out: pathlib.Path,
    summary: Mapping[str, Figures],
    records: Mapping[str, Sequence[RequestRecord]],
    bounds: Mapping[str, float],
) -> list[pathlib.Path]:
    names = list(summary)
    fig, ax = plt.subplots(figsize=(8, 5))
    ttft_cdf(ax, names, records)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution by policy")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:  # (no line when no policy completed a request)
        ax.legend(fontsize="small")
    ttft_path = out / PLOTS[0]
    _save(fig, ttft_path)

    fig, ax = plt.subplots(figsize=(10, 5))
    x = np.arange(len(names))
    for shift, key in ((-0.2, "token_hit_rate"), (0.2, "request_hit_rate")):  # none completed: no bar
        ax.bar(x + shift, [(summary[n][key] or 0.0) * 100 for n in names], 0.4, label=key.replace("_", " "))
    for key, style, what in (
        ("infinite_cache_token_hit_rate", "--", "infinite shared cache (bound)"),
        ("cluster_lru_token_hit_rate", ":", "LRU of the cluster's capacity (reference)"),
    ):
        if key in bounds:
            ax.axhline(bounds[key] * 100, linestyle=style, color="gray", label=what)
    # A policy that rejected requests is measured on the rest: its own bound, over those, as a marker.
    trace_bound = bounds.get("infinite_cache_token_hit_rate")
    own: list[tuple[int, float]] = []
    for i, n in enumerate(names):
        b = summary[n].get("infinite_cache_token_hit_rate")
        if b is not None and b != trace_bound:
            own.append((i, b))
    if own:
        ax.scatter(
            [x[i] - 0.2 for i, _ in own],
            [b * 100 for _, b in own],
            marker="_",
            s=400,
            color="black",
            label="infinite cache over the requests it completed",
        )
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.set_ylabel("%")
    ax.set_title("Prefix cache hit rates by policy")
    ax.set_ylim(0, 100)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not on them
    hits_path = out / PLOTS[1]
    _save(fig, hits_path)
    return [ttft_path, hits_path]


def _save(fig: Figure, path: pathlib.Path) -> None:
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)  # (closed when the file cannot be written too)
