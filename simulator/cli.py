"""`epp-sim` command line: `epp-sim replay` runs a trace against every chosen policy side by side.

    epp-sim replay --trace conversation.jsonl --pods 16 --policies all --seed 1 --out results/
    epp-sim replay --workload shared-prefix --rate 20 --pods 8 --policies ttft,random

`epp-sim engine-replay` runs requests one at a time on one simulated engine and reports each one's
`cached_tokens` (and optionally the KV events), to compare with a real vLLM:

    epp-sim engine-replay --requests reqs.jsonl --num-blocks 96 --block-size 32 --out results.jsonl \
        --events events.jsonl

`epp-sim serve-engine` runs one simulated engine in real time as an OpenAI-compatible server with vLLM's
KV events and `/metrics` (a stand-in for vLLM; see `simulator/serving/`):

    epp-sim serve-engine --port 8000 --model tiny --tokenizer ./tok --kv-events-endpoint 'tcp://*:5557'

Writes `summary.json` (each policy mapped to its figures, named with their units), per-request
records and PNG plots under `--out`, prints the table, and shows a progress bar on a terminal.
The policies run side by side in `--jobs` worker processes (default: one per core, at most one per
policy; the figures are the same as one after the other).
Bad input exits with status 2 and a message naming the file and line or the flag. A policy that
rejects requests (its router found no pod for them) is reported with them; if no policy completed
any request, the results are still written and the status is 1.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from importlib import metadata
from typing import Any

from tqdm import tqdm

from simulator import policies, report
from simulator.cluster import MIN_SCRAPE_INTERVAL, ClusterConfig
from simulator.engine import EngineConfig
from simulator.engine_config import add_scheduling_flags
from simulator.engine_replay import EngineReplayError, engine_replay
from simulator.latency import DEFAULT_PROFILE, PROFILES
from simulator.latency_file import load_latency_profile
from simulator.parallel import replay_parallel
from simulator.replay import resolve
from simulator.serving import command as serve_engine
from simulator.trace_span import LIMIT, first_too_late, scaled_span_error
from simulator.traces import (
    ARRIVALS,
    Fits,
    TraceError,
    TraceRequest,
    agentic,
    multi_turn,
    read_azure,
    read_mooncake,
    scale_rate,
    shared_prefix,
)

WORKLOADS = ("shared-prefix", "multi-turn", "agentic")


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epp-sim",
        description="Replay request traces against simulated engines with the production scheduler.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    r = sub.add_parser("replay", help="replay a trace against routing policies side by side")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake JSONL (.jsonl) or Azure LLM inference CSV (.csv)")
    src.add_argument("--workload", choices=WORKLOADS, help="a synthetic workload instead of a trace file")
    r.add_argument("--trace-format", choices=("mooncake", "azure"), help="default: from the file extension")
    r.add_argument("--requests", type=_positive(int), default=600, help="synthetic: about this many requests")
    r.add_argument(
        "--rate", type=_positive(float), default=10.0, help="synthetic: requests (or sessions) per s"
    )
    r.add_argument("--rate-scale", type=_positive(float), default=1.0, help="speed the trace up (>1) or down")
    r.add_argument(
        "--arrivals", choices=ARRIVALS, help="synthetic: arrival process of requests or sessions (poisson)"
    )
    r.add_argument(
        "--arrival-cv",
        type=_positive(float),
        help="synthetic, --arrivals gamma: coefficient of variation of the gaps (default 1; >1 burstier)",
    )
    r.add_argument("--pods", type=_positive(int), default=16)
    r.add_argument(
        "--policies",
        default="all",
        help="comma-separated policy names or EPP config files (PATH.yaml, NAME=PATH.yaml), or all",
    )
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--out", default="results", help="directory for summary.json, records and plots")
    r.add_argument("--scrape-interval", type=_positive(float), default=0.05, help="seconds")
    r.add_argument("--event-delay", type=float, default=0.002, help="seconds from engine to router")
    r.add_argument("--event-loss", type=float, default=0.0, help="fraction of KV-event messages lost")
    r.add_argument("--num-gpu-blocks", type=_positive(int), default=4096, help="per engine")
    r.add_argument("--block-size", type=_positive(int), default=16)
    r.add_argument("--cpu-blocks", type=int, default=0, help="CPU offload tier per engine (0: none)")
    r.add_argument(
        "--cpu-bandwidth",
        type=_positive(float),
        default=None,
        help="GB/s from the CPU tier back to the GPU (default: the latency profile's)",
    )
    r.add_argument(
        "--max-num-batched-tokens", type=_positive(int), default=8192, help="token budget of an engine step"
    )
    r.add_argument(
        "--max-num-seqs",
        type=_positive(int),
        default=1024,
        help="requests running at most (vLLM's default for its server on an H100-class GPU)",
    )
    add_scheduling_flags(r)
    r.add_argument(
        "--latency-profile",
        default=DEFAULT_PROFILE,
        help=f"step times: {', '.join(sorted(PROFILES))}, or a YAML file (a costModel.profiles entry, or an "
        "EPP config) (default %(default)s)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument(
        "--jobs",
        type=_positive(int),
        default=None,
        help="policies run side by side in this many processes (default: one per core)",
    )
    e = sub.add_parser(
        "engine-replay", help="run requests one at a time on one simulated engine; report cached_tokens"
    )
    e.add_argument("--requests", required=True, help="JSONL: prompt_token_ids, max_tokens, optional i")
    e.add_argument(
        "--num-blocks", type=_positive(int), required=True, help="KV blocks, as --num-gpu-blocks-override"
    )
    e.add_argument("--block-size", type=_positive(int), required=True, help="tokens per block")
    e.add_argument("--out", required=True, help="results JSONL: i, prompt_tokens, cached_tokens")
    e.add_argument("--events", help="also write the KV events (JSONL, vLLM's shapes, tagged with i)")
    e.add_argument(
        "--max-num-batched-tokens",
        type=_positive(int),
        default=8192,
        help="token budget per step, as vLLM's flag (longer prompts are prefilled in chunks)",
    )
    serve_engine.add_parser(sub)
    return p


def _cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _write(path: pathlib.Path, text: str, flag: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write: {err.strerror}") from None


def run_engine_replay(args: argparse.Namespace) -> int:
    path = pathlib.Path(args.requests)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{path}: cannot read: {err.strerror}") from None
    try:  # everything is validated and run before any output is written
        results, events = engine_replay(
            data,
            args.num_blocks,
            args.block_size,
            events=bool(args.events),
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    except EngineReplayError as err:
        raise ValueError(err.located(str(path))) from None
    _write(pathlib.Path(args.out), results, "--out")
    if args.events and events is not None:
        _write(pathlib.Path(args.events), events, "--events")
    return 0


def kv_room(num_gpu_blocks: int, block_size: int) -> Fits:
    """Whether a request fits one engine's KV cache: its prompt and every output token but the last (which
    is never fed back) in the engine's blocks less vLLM's reserved null block."""
    room = (num_gpu_blocks - 1) * block_size

    def fits(prompt: int, output: int) -> str | None:
        need = prompt + output - 1
        if need <= room:
            return None
        return (
            f"{prompt} prompt + {output} output tokens need {need} tokens of KV cache ({prompt} + {output} "
            f"- 1: the last output token is never stored); an engine holds {room} = ({num_gpu_blocks} - 1) "
            f"x {block_size} (--num-gpu-blocks less the reserved null block, x --block-size)"
        )

    return fits


def load_trace(args: argparse.Namespace) -> tuple[list[TraceRequest], str, str | None]:
    """The trace, its source (a path or `synthetic:WORKLOAD`) and its file format (None: synthetic).
    Every request fits an engine (`kv_room`), else a ValueError naming the file's line or the generated
    request; a file's requests are checked before their token ids are built."""
    fits = kv_room(args.num_gpu_blocks, args.block_size)
    if args.trace:
        if args.arrivals or args.arrival_cv is not None:
            raise ValueError("--arrivals and --arrival-cv are for --workload; a --trace has its own arrivals")
        path = pathlib.Path(args.trace)
        fmt = args.trace_format or ("azure" if path.suffix.lower() == ".csv" else "mooncake")
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise TraceError(str(path), None, f"cannot read: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise TraceError(str(path), None, f"not UTF-8 text (byte {err.start})") from None
        reader = read_azure if fmt == "azure" else read_mooncake
        return reader(text, str(path), seed=args.seed, fits=fits), str(path), fmt
    workload = args.workload or "shared-prefix"
    n, rate, seed = args.requests, args.rate, args.seed
    process, cv = args.arrivals or "poisson", args.arrival_cv
    if cv is not None and process != "gamma":
        raise ValueError("--arrival-cv needs --arrivals gamma (Poisson gaps have a CV of 1)")
    cv = 1.0 if cv is None else cv
    if workload == "shared-prefix":
        groups = max(1, n // 5)
        trace = shared_prefix(groups, 5, 2000, 400, 100, rate, seed, process, cv)
    elif workload == "multi-turn":
        trace = multi_turn(max(1, n // 5), 5, 600, 150, 150, rate / 5, seed=seed, process=process, cv=cv)
    else:
        trace = agentic(max(1, n // 6), 6, 1500, 200, 300, 100, rate / 6, seed=seed, process=process, cv=cv)
    for r in trace:
        why = fits(len(r.prompt), r.output_tokens)
        if why is not None:
            raise ValueError(f"synthetic:{workload}: generated request {r.index} (in arrival order): {why}")
    late = first_too_late([r.arrival for r in trace])
    if late is not None:
        raise ValueError(
            f"synthetic:{workload}: generated request {late} (in arrival order) arrives at "
            f"{trace[late].arrival:.6g} s: {LIMIT}; raise --rate ({rate:g} per s)"
        )
    return trace, f"synthetic:{workload}", None


PACKAGE = pathlib.Path(__file__).resolve().parent


def _git(here: pathlib.Path, *args: str) -> str | None:
    """`git ARGS` in directory `here` (not the working directory); None if it fails."""
    try:
        out = subprocess.run(
            ["git", "-C", str(here), *args], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _commit(package: pathlib.Path = PACKAGE) -> tuple[str, bool | None]:
    """The simulator's commit, and whether tracked files differ from it; ("unknown", None) without git or
    when `package` is not the checked-out package of a repository: one whose top is the package's parent
    and that tracks its `cli.py` (not a repository the package was merely installed inside)."""
    top = (_git(package, "rev-parse", "--show-toplevel") or "").strip()
    if not top or pathlib.Path(top).resolve() != package.resolve().parent:
        return "unknown", None
    if _git(package, "ls-files", "--error-unmatch", "--", "cli.py") is None:  # (relative to package)
        return "unknown", None
    head = (_git(package, "rev-parse", "HEAD") or "").strip()
    if not head:
        return "unknown", None
    status = _git(package, "status", "--porcelain", "--untracked-files=no")
    return head, None if status is None else bool(status.strip())


def _version() -> str:
    try:
        return metadata.version("epp")
    except metadata.PackageNotFoundError:
        return "unknown"


def run_replay(args: argparse.Namespace) -> int:
    if not args.scrape_interval >= MIN_SCRAPE_INTERVAL:
        raise ValueError(
            f"--scrape-interval must be at least {MIN_SCRAPE_INTERVAL:g} s (1 ms), "
            f"got {args.scrape_interval:g}"
        )
    names = resolve(args.policies, args.scrape_interval)
    if not 0.0 <= args.event_loss < 1.0:
        raise ValueError(f"--event-loss must be in [0, 1), got {args.event_loss}")
    if not 0.0 <= args.event_delay < float("inf"):
        raise ValueError(f"--event-delay must be a finite number >= 0, got {args.event_delay}")
    if args.cpu_blocks < 0:
        raise ValueError(f"--cpu-blocks must be >= 0, got {args.cpu_blocks}")
    if args.max_num_seqs > args.max_num_batched_tokens:
        raise ValueError(
            f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be >= --max-num-seqs "
            f"({args.max_num_seqs}): every running request decodes one token a step"
        )
    latency = load_latency_profile(args.latency_profile)
    if args.cpu_bandwidth is not None:
        latency = replace(latency, cpu_bandwidth_bytes_per_s=args.cpu_bandwidth * 1e9)
    if args.cpu_blocks and latency.cpu_bandwidth_bytes_per_s is None:
        raise ValueError(
            f"--cpu-blocks needs a reload bandwidth: the latency profile {latency.name!r} has no cpu tier "
            "(give --cpu-bandwidth, or a tiers.cpu entry in the profile)"
        )
    trace, source, fmt = load_trace(args)
    if args.rate_scale != 1.0:
        stretched = scaled_span_error(trace, args.rate_scale, source)
        if stretched is not None:
            raise ValueError(stretched)
        trace = scale_rate(trace, args.rate_scale)
    out = pathlib.Path(args.out)
    report.check_out(out, [policies.label(name) for name in names])  # before the simulation, not after it
    engine = EngineConfig(
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        cpu_blocks=args.cpu_blocks,
        cpu_write_policy=args.cpu_write_policy,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        async_scheduling=args.async_scheduling,
    )
    cluster = ClusterConfig(
        pods=args.pods,
        engine=engine,
        latency=latency,
        scrape_interval=args.scrape_interval,
        event_delay=args.event_delay,
        event_loss=args.event_loss,
        seed=args.seed,
    )
    bar = tqdm(total=len(trace) * len(names), unit="req", disable=args.no_progress or None, file=sys.stderr)
    try:
        jobs = args.jobs or _cores()
        result = replay_parallel(trace, names, cluster, jobs, bar.update)
    finally:
        bar.close()
    commit, dirty = _commit()
    gamma = not args.trace and args.arrivals == "gamma"
    meta = {
        "trace": source,
        "trace_format": fmt,
        "workload": None if args.trace else (args.workload or "shared-prefix"),
        "synthetic_requests": None if args.trace else args.requests,
        "synthetic_rate": None if args.trace else args.rate,
        "arrivals": None if args.trace else (args.arrivals or "poisson"),
        "arrival_cv": (args.arrival_cv or 1.0) if gamma else None,
        "policies": names,
        "requests": len(trace),
        "pods": args.pods,
        "seed": args.seed,
        "rate_scale": args.rate_scale,
        "scrape_interval_s": args.scrape_interval,
        "event_delay_s": args.event_delay,
        "event_loss": args.event_loss,
        "num_gpu_blocks": args.num_gpu_blocks,
        "block_size": args.block_size,
        "cpu_blocks": args.cpu_blocks,
        "cpu_write_policy": args.cpu_write_policy,
        "cpu_bandwidth_gb_per_s": args.cpu_bandwidth,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "async_scheduling": args.async_scheduling,
        "latency_profile": args.latency_profile,
        "latency_coefficients": asdict(latency),
        "version": _version(),
        "commit": commit,
        "dirty": dirty,
    }
    print(report.table(result.summary, result.bounds), flush=True)  # first: a failed write loses nothing
    try:
        report.write(out, result.summary, result.records, meta, result.bounds)
    except OSError as err:
        where = err.filename if err.filename is not None else out
        raise ValueError(f"--out {out}: cannot write {where}: {err.strerror or err}") from None
    print(f"results in {out}/ (summary.json, records-*.jsonl, ttft_cdf.png, hit_rates.png)")
    if not any(figures["requests"] for figures in result.summary.values()):
        lines = "; ".join(report.rejections(result.summary))
        print(f"epp-sim: no policy completed any request: {lines}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "engine-replay":
            return run_engine_replay(args)
        if args.command == "serve-engine":
            return serve_engine.run(args)
        return run_replay(args)
    except (TraceError, ValueError, KeyError) as err:
        print(f"epp-sim: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
