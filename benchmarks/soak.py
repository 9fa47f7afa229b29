"""Soak: real Envoy + the EPP + simulated engines under mixed shared-prefix traffic, with faults.

Starts `--pods` simulated vLLM pods (`epp-sim serve-engine`, KV events to the EPP's central SUB),
`epp serve` (the built-in default profile, plus `explain.responseHeader` so every response names
the pod it was sent to) and a real Envoy in front (`epp.demo.stack`). `--clients` load processes
(`benchmarks/soak_load.py`) send open-loop Poisson streamed chat requests through Envoy at
`--rate` in total, for `--duration`, with at most `--max-in-flight` per process (arrivals over the
bound are not sent and are counted as `skipped`). Meanwhile:

- every `--restart-every`, one pod (rotating) is killed (SIGKILL), left down for
  `--restart-downtime`, and started again on the same port: its KV-event sequence restarts from 0,
  so the EPP must clear the pod's blocks and learn them again;
- every `--publisher-dropout-every`, another pod's KV publisher goes away for `--dropout-length`:
  the pod is restarted with KV events off (serve-engine has no switch to pause its publisher), and
  then restarted again with them on. Each of those restarts is an outage like the ones above.

Every `--report-every` it prints, and writes to `--out` (JSON lines), one interval: requests sent,
succeeded, skipped, failures by class, the EPP's added latency p50/p99, client TTFB p50/p99
through Envoy, the EPP's and Envoy's RSS and CPU, and KV-index counters. At the end, a summary
line with PASS/FAIL for the two targets:

- 0 errors attributable to the EPP. Every failed request is classified (benchmarks/soak_parts.py):
  `epp` = a 4xx/5xx the EPP answered itself, a 5xx Envoy made without an upstream cause (the
  ext_proc stream failed), or a connection failure on a pod that had been down for more than
  `--know-after` when the request was sent (the EPP's scrapes had had time to fail: by default
  `--unhealthy-after` x `--refresh-metrics-interval` plus 1 s of slack on this loaded machine);
  `engine` = the request was in flight on a pod that was killed, was sent to it within
  `--know-after` of its going down, or the engine answered 5xx; `unexplained` = anything else
  (counted against the EPP too).
- EPP RSS growth <= 10% after warm-up (`--warmup`, default 5 minutes, at most a third of the run):
  peak RSS after warm-up over the first sample after warm-up.

"Added latency" is the EPP's own request-path time: its `inference_extension_scheduler_e2e_duration_seconds`
histogram (one scheduling cycle: prompt tokenization and keys, index lookup, scorers, picker),
differenced between scrapes for per-interval p50/p99 (bucket-interpolated, Prometheus style). It
does not include gRPC and body parsing; the client TTFB through Envoy (which includes the engine)
is reported beside it.

  python benchmarks/soak.py [--duration 30m] [--rate 200] [--pods 4] [--out soak.jsonl]

Everything started is stopped at the end, on an error, and on Ctrl-C.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before grpc loads: see tests/conftest.py

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.soak_parts import (
    CLASSES,
    Failure,
    Outage,
    TrafficSpec,
    bucket_delta,
    classify,
    histogram_buckets,
    histogram_quantile,
    rss_growth,
    sample_quantile,
)
from epp.config import DEFAULT_CONFIG_YAML
from epp.demo.stack import (
    Child,
    EngineSpec,
    StackError,
    envoy_in_front,
    start_engine,
    start_engines,
    start_epp,
    stop_all,
)
from epp.durations import parse_duration
from epp.testing.envoy import die_with_parent, free_port
from epp.testing.tokenizer import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCHED = "inference_extension_scheduler_e2e_duration_seconds"
MODEL = "soak-model"


@dataclass
class Pod:
    index: int
    port: int
    child: Child
    restarts: int = 0
    busy: bool = False  # being restarted or dropped out

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class State:
    t0: float
    outages: list[Outage] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    batches: list[dict[str, Any]] = field(default_factory=list)
    done_clients: int = 0
    cut: int = 0


# --- faults ------------------------------------------------------------------------------------


async def _kill(pod: Pod) -> None:
    with contextlib.suppress(ProcessLookupError):
        pod.child.proc.kill()
    await pod.child.proc.wait()


async def _outage(
    st: State, pod: Pod, spec: EngineSpec, kv_bind: str | None, down_s: float, logs: Path, why: str
) -> None:
    """Kill `pod`, keep it down `down_s`, start it again (events to `kv_bind`, None: off)."""
    await _kill(pod)
    down_at = time.monotonic()
    i = len(st.outages)
    st.outages.append(Outage(pod.address, down_at, None))
    await asyncio.sleep(down_s)
    pod.restarts += 1
    pod.child = await start_engine(spec, f"pod-{pod.index}-r{pod.restarts}", pod.port, kv_bind, logs)
    up_at = time.monotonic()
    st.outages[i] = Outage(pod.address, down_at, up_at)
    st.events.append(
        {
            "t": round(down_at - st.t0, 2),
            "pod": pod.address,
            "event": why,
            "down_s": round(up_at - down_at, 2),
        }
    )


def _next_pod(pods: list[Pod], start: int) -> tuple[Pod | None, int]:
    for k in range(len(pods)):
        pod = pods[(start + k) % len(pods)]
        if not pod.busy:
            return pod, (start + k + 1) % len(pods)
    return None, start


async def restarter(
    st: State, pods: list[Pod], spec: EngineSpec, kv_bind: str, args: argparse.Namespace, logs: Path
) -> None:
    nxt = 0
    while True:
        await asyncio.sleep(args.restart_every)
        pod, nxt = _next_pod(pods, nxt)
        if pod is None:
            continue
        pod.busy = True
        try:
            await _outage(st, pod, spec, kv_bind, args.restart_downtime, logs, "restart")
        finally:
            pod.busy = False


async def dropper(
    st: State, pods: list[Pod], spec: EngineSpec, kv_bind: str, args: argparse.Namespace, logs: Path
) -> None:
    nxt = len(pods) - 1
    await asyncio.sleep(args.publisher_dropout_every / 2)  # out of phase with the restarts
    while True:
        pod, nxt = _next_pod(pods, nxt)
        if pod is not None:
            pod.busy = True
            try:
                await _outage(st, pod, spec, None, args.restart_downtime, logs, "publisher-off")
                await asyncio.sleep(args.dropout_length)
                await _outage(st, pod, spec, kv_bind, args.restart_downtime, logs, "publisher-on")
            finally:
                pod.busy = False
        await asyncio.sleep(args.publisher_dropout_every)


# --- load ----------------------------------------------------------------------------------------


async def read_client(st: State, proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while True:
        line = await proc.stdout.readline()
        if not line:
            return
        with contextlib.suppress(ValueError):
            batch = json.loads(line)
            st.batches.append(batch)
            if batch.get("type") == "done":
                st.done_clients += 1
                st.cut += int(batch.get("cut", 0))


async def start_clients(
    args: argparse.Namespace, url: str, deadline: float, logs: Path
) -> list[asyncio.subprocess.Process]:
    procs = []
    traffic = asdict(TrafficSpec(max_tokens=args.max_tokens, system_tokens=args.system_tokens))
    for i in range(args.clients):
        cfg = {
            "url": url,
            "model": MODEL,
            "rate": args.rate / args.clients,
            "deadline": deadline,
            "max_in_flight": args.max_in_flight,
            "request_timeout_s": 30.0,
            "drain_s": 30.0,
            "seed": 1000 + i,
            "traffic": traffic,
        }
        err = (logs / f"client-{i}.log").open("wb")
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                str(ROOT / "benchmarks" / "soak_load.py"),
                json.dumps(cfg),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                preexec_fn=die_with_parent,
            )
        )
        err.close()
    return procs


# --- reporting ------------------------------------------------------------------------------------


def _sum_series(text: str, name: str, label: str | None = None) -> dict[str, float]:
    """Sum of `name` samples, per value of `label` (or under "" without one)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        labels, _, value = line.rpartition(" ")
        key = ""
        if label is not None:
            start = labels.find(f'{label}="')
            if start >= 0:
                key = labels[start + len(label) + 2 : labels.index('"', start + len(label) + 2)]
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _freshness(text: str) -> dict[str, str]:
    """Pods the EPP does not consider fresh at this scrape: endpoint -> "state/reason"."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("epp_kv_pod_freshness{") or not line.endswith(" 1.0"):
            continue
        labels = dict(
            part.split("=", 1) for part in line[len("epp_kv_pod_freshness{") : line.rindex("}")].split(",")
        )
        state = labels.get("state", "").strip('"')
        if state != "fresh":
            out[labels.get("pod", "").strip('"')] = f"{state}/{labels.get('reason', '').strip(chr(34))}"
    return out


async def scrape(admin: str) -> str:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
        http.get(f"{admin}/metrics") as r,
    ):
        return await r.text()


class Reporter:
    def __init__(
        self, st: State, args: argparse.Namespace, procs: dict[str, psutil.Process], out: Path
    ) -> None:
        self.st, self.args, self.procs, self.out = st, args, procs, out
        self.prev_buckets: dict[float, float] = {}
        self.first_buckets: dict[float, float] | None = None
        self.last_buckets: dict[float, float] = {}
        self.cpu_prev: dict[str, float] = {}
        self.pod_cpu_prev: dict[int, float] = {}  # per pid: a restarted pod is a new process
        self.pods: list[Pod] = []
        self.t_prev = st.t0
        self.rows: list[dict[str, Any]] = []
        self.all_failures: list[Failure] = []
        self.all_ttfb: list[float] = []
        self.totals = {"sent": 0, "skipped": 0, "ok": 0}
        self.kinds: dict[str, int] = {}
        self.rss: list[tuple[float, int]] = []
        self.last_text = ""
        self.prev_modes: dict[str, float] = {}

    def _cpu(self, name: str) -> float | None:
        p = self.procs.get(name)
        if p is None:
            return None
        try:
            t = p.cpu_times()
            return float(t.user + t.system)
        except psutil.Error:
            return None  # exited

    def _rss(self, name: str) -> int:
        p = self.procs.get(name)
        try:
            return int(p.memory_info().rss) if p is not None else 0
        except psutil.Error:
            return 0

    async def interval(self, baseline: bool = False) -> dict[str, Any] | None:
        st = self.st
        now = time.monotonic()
        text = ""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            text = await scrape(self.args.admin)
        if text:
            self.last_text = text
        buckets = histogram_buckets(text, SCHED) if text else self.prev_buckets
        if self.first_buckets is None:
            self.first_buckets = buckets
        delta = bucket_delta(buckets, self.prev_buckets)
        self.prev_buckets = self.last_buckets = buckets
        batches, st.batches = st.batches, []
        sent = sum(b["sent"] for b in batches)
        skipped = sum(b["skipped"] for b in batches)
        ok = sum(b["ok"] for b in batches)
        ttfb = [x for b in batches for x in b["ttfb"]]
        failures = [Failure(**f) for b in batches for f in b["failures"]]
        for b in batches:
            for k, v in b["kinds"].items():
                self.kinds[k] = self.kinds.get(k, 0) + v
        self.all_failures += failures
        self.all_ttfb += ttfb
        self.totals["sent"] += sent
        self.totals["skipped"] += skipped
        self.totals["ok"] += ok
        classes = dict.fromkeys(CLASSES, 0)
        for f in failures:
            classes[classify(f, st.outages, self.args.know_after)] += 1
        dt = max(1e-9, now - self.t_prev)
        cpu = {}
        for name in self.procs:
            c = self._cpu(name)
            if c is not None:
                cpu[name] = round((c - self.cpu_prev.get(name, c)) / dt * 100, 1)
                self.cpu_prev[name] = c
        pod_cpu = 0.0
        for pod in self.pods:
            pid = pod.child.proc.pid
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(pid).cpu_times()
                pod_cpu += t.user + t.system - self.pod_cpu_prev.get(pid, 0.0)
                self.pod_cpu_prev[pid] = t.user + t.system
        cpu["pods"] = round(pod_cpu / dt * 100, 1)
        self.t_prev = now
        rss = self._rss("epp")
        self.rss.append((now - st.t0, rss))
        if baseline:
            return None
        p50 = histogram_quantile(0.5, delta)
        p99 = histogram_quantile(0.99, delta)
        t50, t99 = sample_quantile(ttfb, 0.5), sample_quantile(ttfb, 0.99)
        restarts = sum(_sum_series(text, "epp_kv_restarts_total").values()) if text else None
        modes = _sum_series(text, "epp_pick_mode_total", "mode") if text else dict(self.prev_modes)
        mode_delta = {k: int(v - self.prev_modes.get(k, 0.0)) for k, v in modes.items()}
        self.prev_modes = modes
        fresh = _freshness(text)
        row = {
            "type": "interval",
            "t_s": round(now - st.t0, 1),
            "sent": sent,
            "rate": round(sent / dt, 1),
            "skipped": skipped,
            "ok": ok,
            "errors": classes,
            "epp_added_p50_ms": None if p50 is None else round(p50 * 1e3, 3),
            "epp_added_p99_ms": None if p99 is None else round(p99 * 1e3, 3),
            "ttfb_p50_ms": None if t50 is None else round(t50 * 1e3, 1),
            "ttfb_p99_ms": None if t99 is None else round(t99 * 1e3, 1),
            "epp_rss_mb": round(rss / 2**20, 1),
            "envoy_rss_mb": round(self._rss("envoy") / 2**20, 1),
            "cpu_pct": cpu,
            "machine_cpu_pct": psutil.cpu_percent(),
            "kv_restarts": restarts,
            "pick_modes": mode_delta,
            "pods_not_fresh": fresh,
            "kv_index_entries": sum(_sum_series(text, "epp_kv_index_entries").values()) if text else None,
            "outages": sum(1 for o in st.outages if o.down_at > now - dt),
        }
        if failures:
            row["failure_samples"] = [
                {**asdict(f), "class": classify(f, st.outages, self.args.know_after)} for f in failures[:3]
            ]
        self.rows.append(row)
        self._print(row)
        with self.out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        return row

    def _print(self, row: dict[str, Any]) -> None:
        if len(self.rows) == 1:
            print(
                f"{'t':>6} {'req/s':>6} {'skip':>5} {'ok':>6} {'epp':>4} {'eng':>4} {'unx':>4} "
                f"{'add p50':>8} {'add p99':>8} {'ttfb50':>7} {'ttfb99':>7} {'EPP RSS':>8} "
                f"{'EPP cpu':>7} {'mach':>5}",
                flush=True,
            )

        def ms(v: float | None, w: int, d: int) -> str:
            return f"{'-':>{w}}" if v is None else f"{v:>{w}.{d}f}"

        e = row["errors"]
        print(
            f"{row['t_s']:>5.0f}s {row['rate']:>6.1f} {row['skipped']:>5} {row['ok']:>6} {e['epp']:>4} "
            f"{e['engine']:>4} {e['unexplained']:>4} {ms(row['epp_added_p50_ms'], 6, 3)}ms "
            f"{ms(row['epp_added_p99_ms'], 6, 3)}ms {ms(row['ttfb_p50_ms'], 5, 0)}ms "
            f"{ms(row['ttfb_p99_ms'], 5, 0)}ms {row['epp_rss_mb']:>6.1f}MB "
            f"{row['cpu_pct'].get('epp', 0):>6.1f}% "
            f"{row['machine_cpu_pct']:>4.0f}%",
            flush=True,
        )

    def summary(self, warmup_s: float, in_flight_after: float | None) -> dict[str, Any]:
        a = self.args
        classes = dict.fromkeys(CLASSES, 0)
        for f in self.all_failures:
            classes[classify(f, self.st.outages, a.know_after)] += 1
        run = bucket_delta(self.last_buckets, self.first_buckets or {})
        p50, p99 = histogram_quantile(0.5, run), histogram_quantile(0.99, run)
        growth = rss_growth(self.rss, warmup_s)
        half = rss_growth(self.rss, self.rss[-1][0] / 2) if self.rss else None
        attributable = classes["epp"] + classes["unexplained"]
        duration = self.rows[-1]["t_s"] if self.rows else 0.0
        out = {
            "type": "summary",
            "duration_s": duration,
            "target_rate": a.rate,
            "achieved_rate": round(self.totals["sent"] / max(1e-9, duration), 1),
            **self.totals,
            "cut_at_end": self.st.cut,
            "kinds": self.kinds,
            "errors": classes,
            "epp_added_p50_ms": None if p50 is None else round(p50 * 1e3, 3),
            "epp_added_p99_ms": None if p99 is None else round(p99 * 1e3, 3),
            "ttfb_p50_ms": _ms(sample_quantile(self.all_ttfb, 0.5)),
            "ttfb_p99_ms": _ms(sample_quantile(self.all_ttfb, 0.99)),
            "warmup_s": warmup_s,
            "epp_rss_start_mb": round(self.rss[0][1] / 2**20, 1) if self.rss else None,
            "epp_rss_baseline_mb": None if growth is None else round(growth[0] / 2**20, 1),
            "epp_rss_peak_mb": None if growth is None else round(growth[1] / 2**20, 1),
            "epp_rss_end_mb": round(self.rss[-1][1] / 2**20, 1) if self.rss else None,
            "epp_rss_growth_pct": None if growth is None else round(growth[2] * 100, 2),
            "epp_rss_growth_second_half_pct": None if half is None else round(half[2] * 100, 2),
            "epp_in_flight_after_load": in_flight_after,
            "outages": list(self.st.events),
            "epp_attributable_errors": attributable,
            "errors_target": "PASS" if attributable == 0 else "FAIL",
            "rss_target": "PASS" if growth is not None and growth[2] <= 0.10 else "FAIL",
        }
        return out


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 1)


def epp_config(path: Path) -> Path:
    path.write_text(DEFAULT_CONFIG_YAML + "explain:\n  responseHeader: true\n")
    return path


async def run(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(args.workdir) / time.strftime("run-%Y%m%d-%H%M%S")
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else run_dir / "soak.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    tokenizer = build_tiny_tokenizer(Path(args.workdir) / "tokenizer")
    spec = EngineSpec(MODEL, tokenizer, args.gpu_blocks, max_num_seqs=128, time_scale=args.time_scale)
    kv_bind = f"tcp://127.0.0.1:{free_port()}"
    children: list[Child] = []
    clients: list[asyncio.subprocess.Process] = []
    tasks: list[asyncio.Task[None]] = []
    pods: list[Pod] = []
    try:
        started, addresses = await start_engines(spec, args.pods, kv_bind, logs)
        children += started
        pods = [
            Pod(i, int(a.rpartition(":")[2]), c)
            for i, (a, c) in enumerate(zip(addresses, started, strict=True))
        ]
        extra = [
            "--kv-events-mode", "central", "--kv-events-bind", kv_bind,
            "--refresh-metrics-interval", args.refresh_metrics_interval,
            "--unhealthy-after", str(args.unhealthy_after), "--log-level", "warning",
        ]  # fmt: skip
        epp, grpc, admin = await start_epp(
            epp_config(run_dir / "epp.yaml"), addresses, MODEL, tokenizer, extra, logs, "epp"
        )
        children.append(epp)
        args.admin = admin
        async with envoy_in_front(grpc) as envoy:
            procs = {"epp": psutil.Process(epp.proc.pid)}
            if envoy.pid is not None:
                procs["envoy"] = psutil.Process(envoy.pid)
            print(
                f"soak: {args.pods} simulated pods (time scale {args.time_scale}), EPP {admin}, "
                f"Envoy {envoy.url}; "
                f"{args.rate:.0f} req/s for {args.duration:.0f}s from {args.clients} client process(es); "
                f"restart every {args.restart_every:.0f}s, publisher dropout every "
                f"{args.publisher_dropout_every:.0f}s for {args.dropout_length:.0f}s; logs {logs}; out {out}",
                flush=True,
            )
            t0 = time.monotonic()
            st = State(t0)
            deadline = t0 + args.duration
            clients = await start_clients(args, envoy.url, deadline, logs)
            for i, c in enumerate(clients):
                procs[f"client-{i}"] = psutil.Process(c.pid)
            readers = [asyncio.create_task(read_client(st, c)) for c in clients]
            reporter = Reporter(st, args, procs, out)
            reporter.pods = pods
            await reporter.interval(baseline=True)  # histogram, CPU and RSS at t = 0
            if args.restart_every > 0:
                tasks.append(asyncio.create_task(restarter(st, pods, spec, kv_bind, args, logs)))
            if args.publisher_dropout_every > 0:
                tasks.append(asyncio.create_task(dropper(st, pods, spec, kv_bind, args, logs)))
            next_report = t0 + args.report_every
            while time.monotonic() < deadline:
                await asyncio.sleep(max(0.0, min(next_report, deadline) - time.monotonic()))
                for p in pods:
                    if not p.busy:
                        p.child.check_alive()
                if time.monotonic() >= next_report:
                    await reporter.interval()
                    next_report += args.report_every
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            tasks.clear()
            # The clients drain (at most their drain_s), then the last interval.
            await asyncio.wait_for(asyncio.gather(*readers), timeout=60.0)
            await reporter.interval()
            await asyncio.sleep(1.0)
            text = ""
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                text = await scrape(admin)
            in_flight = sum(_sum_series(text, "epp_endpoint_in_flight_requests").values()) if text else None
            warmup = min(args.warmup, args.duration / 3)
            summary = reporter.summary(warmup, in_flight)
            (logs / "envoy.log").write_text(envoy.log_tail(1_000_000))
        with out.open("a") as f:
            f.write(json.dumps(summary) + "\n")
        return summary
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in clients:
            if c.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    c.send_signal(signal.SIGTERM)
        for c in clients:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(c.wait(), 10)
        await stop_all([p.child for p in pods] + [c for c in children if c not in {p.child for p in pods}])


def print_summary(s: dict[str, Any]) -> None:
    e = s["errors"]
    print(
        f"\nsoak summary: {s['duration_s']:.0f}s, target {s['target_rate']:.0f} req/s, achieved "
        f"{s['achieved_rate']:.1f} req/s sent ({s['sent']} sent, {s['skipped']} not sent because of the "
        f"in-flight bound, {s['cut_at_end']} cut at the end); {s['ok']} ok; kinds {s['kinds']}"
    )
    print(f"failures: {e['epp']} epp, {e['engine']} engine-side, {e['unexplained']} unexplained")
    print(
        f"EPP added latency (scheduling cycle) over the run: p50 {s['epp_added_p50_ms']} ms, "
        f"p99 {s['epp_added_p99_ms']} ms; client TTFB through Envoy p50 {s['ttfb_p50_ms']} ms, "
        f"p99 {s['ttfb_p99_ms']} ms"
    )
    print(
        f"EPP RSS: start {s['epp_rss_start_mb']} MB, after warm-up ({s['warmup_s']:.0f}s) "
        f"{s['epp_rss_baseline_mb']} MB, peak {s['epp_rss_peak_mb']} MB, end {s['epp_rss_end_mb']} MB "
        f"(growth {s['epp_rss_growth_pct']}%; over the second half of the run "
        f"{s['epp_rss_growth_second_half_pct']}%); "
        f"EPP in-flight after the load: {s['epp_in_flight_after_load']}"
    )
    print(f"outages: {len(s['outages'])} ({', '.join(sorted({o['event'] for o in s['outages']}))})")
    print(f"target 0 errors attributable to the EPP: {s['errors_target']} ({s['epp_attributable_errors']})")
    print(f"target EPP RSS growth <= 10% after warm-up: {s['rss_target']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    dur = parse_duration
    ap.add_argument("--duration", type=dur, default=dur("30m"), help="e.g. 30m, 2m, 90s (default 30m)")
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second in total (default 200)")
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--clients", type=int, default=1, help="load processes sharing the rate (default 1)")
    ap.add_argument("--max-in-flight", type=int, default=256, help="per client process (default 256)")
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (default 8)")
    ap.add_argument("--system-tokens", type=int, default=1000, help="shared system prompts' length")
    ap.add_argument("--restart-every", type=dur, default=dur("150s"), help="0 disables (default 150s)")
    ap.add_argument(
        "--restart-downtime", type=dur, default=dur("5s"), help="how long a killed pod stays down"
    )
    ap.add_argument(
        "--publisher-dropout-every", type=dur, default=dur("300s"), help="0 disables (default 300s)"
    )
    ap.add_argument("--dropout-length", type=dur, default=dur("60s"), help="how long a publisher stays off")
    ap.add_argument("--report-every", type=dur, default=dur("60s"))
    ap.add_argument("--warmup", type=dur, default=dur("5m"), help="at most a third of the run (default 5m)")
    ap.add_argument("--time-scale", type=float, default=0.5, help="simulated engines' --time-scale")
    ap.add_argument("--gpu-blocks", type=int, default=4096, help="KV blocks per simulated pod")
    ap.add_argument("--refresh-metrics-interval", default="50ms")
    ap.add_argument("--unhealthy-after", type=int, default=3)
    ap.add_argument("--know-after", type=dur, help="default: unhealthy-after x refresh interval + 1s")
    ap.add_argument("--out", help="JSON lines: one per interval, then the summary (default: in the run dir)")
    ap.add_argument("--workdir", default="build/soak")
    args = ap.parse_args(argv)
    if args.know_after is None:
        args.know_after = args.unhealthy_after * parse_duration(args.refresh_metrics_interval) + 1.0
    for name in ("rate", "duration", "report_every"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if not 1 <= args.pods <= 64 or args.clients < 1 or args.max_in_flight < 1:
        ap.error("--pods must be in 1..64, --clients and --max-in-flight >= 1")
    return args


def main() -> int:
    args = parse_args()
    # SIGTERM (e.g. `kill` of a background run) stops everything as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda _s, _f: signal.raise_signal(signal.SIGINT))
    try:
        summary = asyncio.run(run(args))
    except StackError as err:
        print(f"\nsoak: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nsoak: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    print_summary(summary)
    return 0 if summary["errors_target"] == summary["rss_target"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
