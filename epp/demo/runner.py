"""`epp demo`: the whole stack on one machine, the EPP's default profile against round-robin.

For each policy in turn, on a fresh set of simulated pods (cold caches, so every policy starts from
the same state): start the pods, `epp serve` with the policy, and a real Envoy; play the same
workload through Envoy; read how many requests each pod got from the EPP; stop everything. Then print
the figures side by side and write `summary.json` (and every process's log) to the run directory.

With `--engines`, the demo drives real model servers instead (their caches are not reset between
policies: the later policies start warm, which the report says).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

from epp.demo.client import run_sessions
from epp.demo.report import PolicyFigures, TurnResult, comparison, figures, table
from epp.demo.stack import (
    Child,
    EngineSpec,
    Stack,
    StackError,
    envoy_in_front,
    start_engines,
    start_epp,
    stop_all,
)
from epp.demo.workload import KINDS, Session, WorkloadSpec, build_sessions
from epp.testing.envoy import free_port
from epp.testing.tokenizer import build_tiny_tokenizer

DEFAULT_POLICY = "default"  # `epp serve` with no --config: the EPP's built-in default profile
POLICY_DIR = Path(str(resources.files("simulator.policies")))


@dataclass(frozen=True, slots=True)
class DemoOptions:
    pods: int = 4
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    policies: tuple[str, ...] = (DEFAULT_POLICY, "round-robin")
    model: str = "demo-model"
    gpu_blocks: int = 1600
    engines: tuple[str, ...] = ()  # real engines instead of simulated pods
    tokenizer: Path | None = None
    kv_events_port: int | None = None  # real engines: their per-pod publisher port
    workdir: Path = Path("build/demo")
    seed: int = 1


def policy_config(name: str) -> Path | None:
    """The EPP config of a policy: None for the built-in default, a shipped policy, or a YAML path."""
    if name == DEFAULT_POLICY:
        return None
    shipped = POLICY_DIR / f"{name}.yaml"
    if shipped.is_file():
        return shipped
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    known = sorted(p.stem for p in POLICY_DIR.glob("*.yaml"))
    raise ValueError(
        f"unknown policy {name!r}: use {DEFAULT_POLICY}, one of {', '.join(known)}, or a .yaml file"
    )


async def _phase(
    opts: DemoOptions, policy: str, sessions: list[Session], tokenizer: Path, logs: Path
) -> tuple[list[TurnResult], dict[str, int]]:
    children: list[Child] = []
    try:
        if opts.engines:
            engines = list(opts.engines)
            kv_args = ["--kv-events-mode", "per-pod", "--kv-events-port", str(opts.kv_events_port)]
            if opts.kv_events_port is None:
                kv_args = ["--kv-events-mode", "off"]
        else:
            bind = f"tcp://127.0.0.1:{free_port()}"
            spec = EngineSpec(opts.model, tokenizer, opts.gpu_blocks)
            pods, engines = await start_engines(spec, opts.pods, bind, logs)
            children += pods
            kv_args = ["--kv-events-mode", "central", "--kv-events-bind", bind]
        epp, grpc, admin = await start_epp(
            policy_config(policy), engines, opts.model, tokenizer, kv_args, logs, f"epp-{_slug(policy)}"
        )
        children.append(epp)
        async with envoy_in_front(grpc) as envoy:
            stack = Stack(engines, envoy.url, admin)
            deadline = opts.workload.duration_s + 90.0
            results = await run_sessions(envoy.url, opts.model, sessions, deadline)
            for child in children:
                child.check_alive()
            per_pod = await stack.picks_per_pod()
            (logs / "envoy.log").write_text(envoy.log_tail(1_000_000))
        return results, per_pod
    finally:
        await stop_all(children)


def _slug(policy: str) -> str:
    return Path(policy).stem if policy.endswith((".yaml", ".yml")) else policy


async def run_demo(opts: DemoOptions, out: Path) -> list[PolicyFigures]:
    for p in opts.policies:
        policy_config(p)  # fail before starting anything
    tokenizer = opts.tokenizer or build_tiny_tokenizer(opts.workdir / "tokenizer")
    sessions = build_sessions(opts.workload, opts.seed)
    turns = sum(len(s.questions) for s in sessions)
    out.mkdir(parents=True, exist_ok=True)
    w = opts.workload
    print(
        f"epp demo: {len(opts.engines) or opts.pods} {'engines' if opts.engines else 'simulated vLLM pods'}, "
        f"workload {w.kind} ({len(sessions)} sessions, {turns} requests over {w.duration_s:.0f}s), "
        f"policies {', '.join(opts.policies)}; logs in {out}",
        flush=True,
    )
    rows: list[PolicyFigures] = []
    for policy in opts.policies:
        logs = out / _slug(policy)
        logs.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        print(f"  {policy}: running ...", end="", flush=True)
        results, per_pod = await _phase(opts, policy, sessions, tokenizer, logs)
        row = figures(_slug(policy), results, per_pod)
        rows.append(row)
        print(f" {row.requests} requests, {row.errors} errors ({time.perf_counter() - t0:.0f}s)", flush=True)
        with (logs / "requests.jsonl").open("w") as f:
            for r in results:
                f.write(json.dumps(asdict(r)) + "\n")
    summary = {
        "workload": asdict(opts.workload),
        "pods": len(opts.engines) or opts.pods,
        "seed": opts.seed,
        "policies": {r.policy: r.as_json() for r in rows},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoOptions()
    p.add_argument("--pods", type=int, default=d.pods, help=f"simulated vLLM pods (default {d.pods})")
    p.add_argument("--workload", choices=KINDS, default=d.workload.kind, help="default mixed")
    p.add_argument(
        "--duration", type=float, default=d.workload.duration_s, help="seconds of traffic per policy"
    )
    p.add_argument("--rate", type=float, default=d.workload.rate, help="new sessions per second")
    p.add_argument(
        "--policies",
        default=",".join(d.policies),
        help="comma-separated: default (the EPP's built-in profile), a simulator policy name "
        "(round-robin, least-load, gie-default, ...) or an EPP config file",
    )
    p.add_argument("--gpu-blocks", type=int, default=d.gpu_blocks, help="KV blocks per simulated pod")
    p.add_argument(
        "--engines", default="", help="comma-separated ip:port of real engines (no simulated pods)"
    )
    p.add_argument("--model", default=d.model, help="served model name")
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the demo's, built locally)")
    p.add_argument(
        "--kv-events-port",
        type=int,
        help="real engines: their KV-event publisher port, e.g. 5557 (without it the EPP runs with KV "
        "events off)",
    )
    p.add_argument("--workdir", type=Path, default=d.workdir, help="where runs and the tokenizer go")
    p.add_argument("--seed", type=int, default=d.seed)


def options(args: argparse.Namespace) -> DemoOptions:
    """DemoOptions from parsed flags; ValueError naming the flag for bad values."""
    if args.pods < 1 or args.pods > 64:
        raise ValueError(f"--pods must be in 1..64, got {args.pods}")
    if args.gpu_blocks < 2:
        raise ValueError(f"--gpu-blocks must be >= 2, got {args.gpu_blocks}")
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    for e in engines:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--engines: {e!r} is not ip:port")
    if engines and args.tokenizer is None:
        raise ValueError("--engines needs --tokenizer: the directory of the tokenizer the engines use")
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    if not policies:
        raise ValueError("--policies: name at least one policy")
    for p in policies:
        policy_config(p)
    workload = replace(WorkloadSpec(), kind=args.workload, duration_s=args.duration, rate=args.rate)
    workload.check()
    return DemoOptions(
        pods=args.pods,
        workload=workload,
        policies=policies,
        model=args.model,
        gpu_blocks=args.gpu_blocks,
        engines=engines,
        tokenizer=args.tokenizer,
        kv_events_port=args.kv_events_port,
        workdir=args.workdir,
        seed=args.seed,
    )


def main(args: argparse.Namespace) -> int:
    try:
        opts = options(args)
    except ValueError as err:
        print(f"epp demo: {err}", file=sys.stderr)
        return 2
    out = opts.workdir / time.strftime("run-%Y%m%d-%H%M%S")
    try:
        rows = asyncio.run(run_demo(opts, out))
    except StackError as err:
        print(f"\nepp demo: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nepp demo: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    print()
    print(table(rows))
    if len(rows) > 1:
        print()
        for other in rows[1:]:
            print(comparison(rows[0], other))
    if opts.engines:
        print("(real engines: caches were not reset between policies; later policies started warm)")
    print(f"\nsummary: {out / 'summary.json'}")
    return 0 if all(r.errors == 0 for r in rows) else 1
