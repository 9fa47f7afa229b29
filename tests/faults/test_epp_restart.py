"""The EPP process is killed under traffic behind Envoy and started again: requests during the gap fail
fast (Envoy answers an error at once, well before its ext_proc message timeout), the new process
serves, and its index is rebuilt from the engines' replay buffers."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from epp.testing.backend import FakeModelServer
from epp.testing.envoy import EnvoyConfig, EnvoyProcess, die_with_parent, free_port
from epp.testing.kv_publisher import KvEventPublisher, stored
from epp.testing.wait import eventually, http_ok

from .cluster import BS, HOSTS, MODEL, tokens

MESSAGE_TIMEOUT = 5.0


@dataclass
class EppProcess:
    argv: list[str]
    metrics_port: int
    proc: asyncio.subprocess.Process | None = None

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.proc = await asyncio.create_subprocess_exec(*self.argv, preexec_fn=die_with_parent)
        url = f"http://127.0.0.1:{self.metrics_port}/readyz"
        await http_ok(session, url, "epp serve ready", process=self.proc)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(self.proc.wait(), 10)

    async def debug_index(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(f"http://127.0.0.1:{self.metrics_port}/debug/index") as r:
            return json.loads(await r.text())  # type: ignore[no-any-return]


@dataclass
class Traffic:
    """Clients sending requests one after another until stopped; every outcome recorded in order."""

    url: str
    session: aiohttp.ClientSession
    outcomes: list[tuple[str, float]] = field(default_factory=list)  # (status or error name, seconds taken)
    stopped: bool = False

    async def client(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=MESSAGE_TIMEOUT)
        while not self.stopped:
            body = {
                "model": MODEL,
                "prompt": [*tokens(4, 1000 * n), len(self.outcomes) % 50],
                "max_tokens": 2,
            }
            t0 = loop.time()
            try:
                async with self.session.post(f"{self.url}/v1/completions", json=body, timeout=timeout) as r:
                    await r.read()
                    outcome = str(r.status)
            except TimeoutError:
                outcome = "timeout"
            except aiohttp.ClientError as err:
                outcome = type(err).__name__
            self.outcomes.append((outcome, loop.time() - t0))
            await asyncio.sleep(0.005)

    def since(self, mark: int) -> Counter[str]:
        return Counter(o for o, _ in self.outcomes[mark:])


async def test_epp_killed_and_restarted_under_traffic() -> None:
    http, events, replay = free_port(), free_port(), free_port()
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    hosts = HOSTS[:2]
    backends = [FakeModelServer(f"pod-{i}", host=h, port=http, model=MODEL) for i, h in enumerate(hosts)]
    pubs = [KvEventPublisher(f"tcp://{h}:{events}", replay_endpoint=f"tcp://{h}:{replay}") for h in hosts]
    pods = [f"{h}:{http}" for h in hosts]
    prompts = [tokens(20, 500_000 * (i + 1)) for i in range(2)]
    argv = [
        sys.executable, "-m", "epp", "serve",
        "--endpoints", ",".join(pods),
        "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port),
        "--grpc-health-port", str(health_port),
        "--metrics-port", str(metrics_port),
        "--secure-serving=false",
        "--kv-events-mode", "per-pod",
        "--kv-events-port", str(events),
        "--kv-events-replay-port", str(replay),
        "--seed", "1",
        "--log-level", "error",
    ]  # fmt: skip
    first, second = EppProcess(argv, metrics_port), EppProcess(argv, metrics_port)
    envoy = EnvoyProcess(EnvoyConfig(epp_port=grpc_port, message_timeout_s=MESSAGE_TIMEOUT))
    traffic: Traffic | None = None
    clients: list[asyncio.Task[None]] = []
    try:
        for b in backends:
            await b.start()
        for i, pub in enumerate(pubs):
            await pub.start()
            # Blocks the engines hold before any EPP runs: only replay can tell.
            await pub.publish([stored(list(range(100 * i + 1, 100 * i + 21)), None, prompts[i], BS)])
        async with aiohttp.ClientSession() as session:
            await first.start(session)

            async def indexed(epp: EppProcess) -> bool:
                doc = await epp.debug_index(session)
                return all(doc["pods"].get(p, {}).get("blocks") == {"gpu": 20} for p in pods)

            for _ in range(500):
                if await indexed(first):
                    break
                await asyncio.sleep(0.02)
            assert await indexed(first), json.dumps(await first.debug_index(session))
            await envoy.start()
            traffic = Traffic(envoy.url, session)
            clients = [asyncio.create_task(traffic.client(n)) for n in range(4)]
            await eventually(lambda: traffic.since(0)["200"] >= 20, "traffic flowing")
            assert set(traffic.since(0)) == {"200"}

            await first.kill()
            killed_at = len(traffic.outcomes)
            await eventually(lambda: sum(traffic.since(killed_at).values()) >= 40, "requests during the gap")
            gap = traffic.since(killed_at)
            # Every request of the gap came back, with an error, before Envoy's message timeout.
            assert "timeout" not in gap and gap["200"] <= 4, (
                gap
            )  # (a few may have been picked before the kill)
            assert max(t for _, t in traffic.outcomes[killed_at:]) < MESSAGE_TIMEOUT
            assert all(o.startswith("5") or not o.isdigit() for o, _ in traffic.outcomes[killed_at + 4 :])

            await second.start(session)
            back_at = len(traffic.outcomes)
            await eventually(lambda: traffic.since(back_at)["200"] >= 20, "the new EPP serves", timeout=20)
            for _ in range(500):
                if await indexed(second):
                    break
                await asyncio.sleep(0.02)
            assert await indexed(second), json.dumps(await second.debug_index(session))
            # ...and live events reach it.
            await pubs[0].publish([stored([21], 20, tokens(1, 500_000 + 20 * BS), BS)])
            for _ in range(500):
                if (await second.debug_index(session))["pods"][pods[0]]["blocks"] == {"gpu": 21}:
                    break
                await asyncio.sleep(0.02)
            assert (await second.debug_index(session))["pods"][pods[0]]["blocks"] == {"gpu": 21}
            traffic.stopped = True
            await asyncio.gather(*clients)
            settled = traffic.since(back_at + 4)
            assert set(settled) == {"200"}, settled
    finally:
        if traffic is not None:
            traffic.stopped = True
        for t in clients:
            t.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await envoy.stop()
        await first.kill()
        await second.kill()
        for pub in pubs:
            await pub.stop()
        for b in backends:
            await b.stop()
