"""Latency the EPP adds behind real Envoy (issue: EPP core).

In one run, at a fixed open-loop request rate, for 4 KB and 100 KB chat bodies:
  (a) Envoy straight to a backend (destination header set by the client, no ext_proc);
  (b) Envoy + the EPP (16 endpoints, duplex body mode, default profile, plaintext gRPC).
Prints p50/p99 of each, the added latency (b - a) and the EPP's CPU time per request.
Scenarios are interleaved in short rounds so that machine noise hits them alike; the
figures are medians over rounds. Everything runs on 127.0.0.1 and every loop is bounded.

  python benchmarks/overhead.py [--rate 200] [--seconds 4] [--rounds 5] [--endpoints 16]
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before grpc loads: see tests/conftest.py

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from epp.testing.envoy import EnvoyConfig, EnvoyProcess, die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def chat_body(size: int) -> bytes:
    base = {"model": "fake-model", "max_tokens": 16, "messages": [{"role": "user", "content": ""}]}
    overhead = len(json.dumps(base))
    base["messages"][0]["content"] = "lorem ipsum " * ((size - overhead) // 12 + 1)
    return json.dumps(base).encode()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def wait_file(path: Path, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text()
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{path} did not appear")


async def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} not ready")


async def run_load(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    rate: float,
    seconds: float,
) -> tuple[list[float], int]:
    """Open loop: request i starts at i / rate. Returns (latencies in seconds, errors)."""
    n = int(rate * seconds)
    latencies: list[float] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        t0 = time.perf_counter()
        try:
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
                    return
        except aiohttp.ClientError:
            errors += 1
            return
        latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    tasks = []
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=seconds + 60)
    return latencies, errors


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=4.0, help="per scenario per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--endpoints", type=int, default=16)
    ap.add_argument("--scrape-interval", default="50ms", help="the EPP's --refresh-metrics-interval")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--config", help="EPP config file (default: the built-in default profile)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="epp-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        port_file = tmp / "backends"
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "epp.testing.backend",
                    "--count",
                    str(args.endpoints),
                    "--port-file",
                    str(port_file),
                ],
                stdout=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        )
        addresses = (await wait_file(port_file)).split()
        grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
        epp = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "epp",
                "serve",
                "--endpoints",
                ",".join(addresses),
                "--host",
                "127.0.0.1",
                "--grpc-port",
                str(grpc_port),
                "--grpc-health-port",
                str(health_port),
                "--metrics-port",
                str(metrics_port),
                "--secure-serving=false",
                "--refresh-metrics-interval",
                args.scrape_interval,
                "--log-level",
                "warning",
                *(["--config", args.config] if args.config else []),
            ],
            preexec_fn=die_with_parent,
        )
        procs.append(epp)
        await wait_http(f"http://127.0.0.1:{metrics_port}/readyz")
        trivial_port = free_port()
        trivial = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "trivial_ext_proc.py"),
                "--port",
                str(trivial_port),
                "--destination",
                addresses[0],
            ],
            preexec_fn=die_with_parent,
        )
        procs.append(trivial)
        envoys = {
            "direct": EnvoyProcess(EnvoyConfig(ext_proc=False), concurrency=1),
            "trivial": EnvoyProcess(EnvoyConfig(epp_port=trivial_port), concurrency=1),
            "epp": EnvoyProcess(EnvoyConfig(epp_port=grpc_port), concurrency=1),
            "trivial-reqonly": EnvoyProcess(
                EnvoyConfig(epp_port=trivial_port, response_body_mode="NONE"), concurrency=1
            ),
            "epp-reqonly": EnvoyProcess(
                EnvoyConfig(epp_port=grpc_port, response_body_mode="NONE"), concurrency=1
            ),
        }
        for env in envoys.values():
            await env.start()
        bodies = {"4KB": chat_body(4096), "100KB": chat_body(100 * 1024)}
        scenarios = [(kind, size) for size in bodies for kind in envoys]
        results: dict[tuple[str, str], dict[str, list[float]]] = {
            s: {"p50": [], "p99": [], "errors": [], "cpu": []} for s in scenarios
        }
        fixed = {"content-type": "application/json", "x-gateway-destination-endpoint": addresses[0]}
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as session:
            for kind, size in scenarios:  # warm up every path
                url = f"{envoys[kind].url}/v1/chat/completions"
                await run_load(session, url, bodies[size], fixed, args.rate, 1.0)
            idle0, t_idle = cpu_seconds(epp.pid), time.perf_counter()
            await asyncio.sleep(2.0)
            idle_rate = (cpu_seconds(epp.pid) - idle0) / (time.perf_counter() - t_idle)
            for _ in range(args.rounds):
                for kind, size in scenarios:
                    url = f"{envoys[kind].url}/v1/chat/completions"
                    hdr = fixed if kind == "direct" else {"content-type": "application/json"}
                    server = epp if kind.startswith("epp") else trivial
                    c0, t0 = cpu_seconds(server.pid), time.perf_counter()
                    lat, errors = await run_load(session, url, bodies[size], hdr, args.rate, args.seconds)
                    dc, dt = cpu_seconds(server.pid) - c0, time.perf_counter() - t0
                    idle = idle_rate if server is epp else 0.0
                    r = results[(kind, size)]
                    r["p50"].append(pct(lat, 0.5) * 1e3)
                    r["p99"].append(pct(lat, 0.99) * 1e3)
                    r["errors"].append(errors)
                    r["cpu"].append(max(0.0, dc - idle * dt) / max(1, len(lat)) * 1e3)
        for env in envoys.values():
            await env.stop()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)

    med = statistics.median
    print(
        f"\nEPP overhead through Envoy 1.40: {args.endpoints} endpoints, {args.rate:.0f} req/s open loop, "
        f"{args.rounds} rounds x {args.seconds:.0f} s per scenario, medians over rounds"
    )
    print(
        f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}; "
        " EPP: plaintext gRPC, " + (f"config {args.config}" if args.config else "default profile")
    )
    print(
        f"EPP idle CPU (scrapes of {args.endpoints} endpoints every 50 ms): {idle_rate * 100:.1f}% of a core"
    )
    print("direct = no ext_proc; trivial = fixed-destination echo ext_proc (the Python floor);")
    print("*-reqonly = response_body_mode NONE (request path + response headers)")
    print("CPU/req = CPU time of the ext_proc process per request (EPP: minus its idle scraping)\n")
    print(
        f"{'body':>6} {'path':>16} {'p50':>8} {'added p50':>10} {'p99':>8} {'added p99':>10} "
        f"{'CPU/req':>12} {'errors':>7}"
    )
    out: dict[str, dict[str, dict[str, float]]] = {}
    for size in bodies:
        d = results[("direct", size)]
        out[size] = {}
        for kind in envoys:
            r = results[(kind, size)]
            row = {
                "p50_ms": med(r["p50"]),
                "p99_ms": med(r["p99"]),
                "added_p50_ms": med([b - a for a, b in zip(d["p50"], r["p50"], strict=True)]),
                "added_p99_ms": med([b - a for a, b in zip(d["p99"], r["p99"], strict=True)]),
                "ext_proc_cpu_ms_per_request": med(r["cpu"]) if kind != "direct" else float("nan"),
                "errors": float(sum(r["errors"])),
            }
            out[size][kind] = row
            cpu = f"{row['ext_proc_cpu_ms_per_request']:>10.3f}ms" if kind != "direct" else f"{'':>12}"
            print(
                f"{size:>6} {kind:>16} {row['p50_ms']:>6.2f}ms {row['added_p50_ms']:>8.2f}ms "
                f"{row['p99_ms']:>6.2f}ms {row['added_p99_ms']:>8.2f}ms {cpu} {int(row['errors']):>7}"
            )
    print("\ntargets (epp vs direct): added p50 <= 1.0 ms and p99 <= 3 ms (4KB); added p50 <= 2.5 ms (100KB)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
