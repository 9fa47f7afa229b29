"""A pod deleted through Kubernetes discovery under traffic (issue #8, part 1).

Three fake engines on 127.0.0.2-4 (one HTTP port, one KV-event port, each with a real publisher), an
InferencePool and its Ready Pods in the fake API server, the EPP in-process following the pool (per-pod
KV events), a real Envoy in front. Continuous seeded traffic (four clients, completions with token-id
prompts) prefers pod-2 for the third of the prompts its KV cache holds; pod-2's engine runs in a process
of its own so that it can really go away, and three long streamed generations are pinned to it (the
gateway's subset hint) so that requests are in flight there when it does. Mid-traffic pod-2 is deleted
in the API, in two ways:

- `rolling`: what `kubectl delete pod` (a rolling update, a scale-down) does: the Pod gets a
  `deletionTimestamp` (the EPP drops it at once), turns unready, its engine drains on SIGTERM and exits,
  then the Pod object goes (DELETED). Requests in flight to it finish normally: every request is a
  complete 200, the pinned streams included.
- `deleted`: the Pod object goes at once (DELETED: a force delete, or a node declared lost), and then
  its engine dies (SIGKILL) with the pinned streams still in flight. Exactly those are cut: the client
  has the 200 headers and the first chunk, then the body ends short (no `[DONE]`; Envoy resets the
  downstream stream, there is nothing to retry mid-response); the EPP releases them as `disconnect`.
  Every other request is a complete 200.

Both: once the EPP's endpoint set no longer has pod-2, no request is served by it; its index entries,
KV subscription (socket) and scrape are gone, a block it publishes afterwards is not indexed, a request
the gateway pins to it is refused by the EPP (503, naming the subset hint), and nothing is left in
flight.

Run as `python -m tests.faults.test_pod_deleted_via_discovery --engine HOST PORT NAME` it is pod-2's
engine process: a `FakeModelServer` that answers `stats` on stdin and drains on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import random
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest

from epp.config import KvEventsConfig, default_config
from epp.discovery.settings import DiscoverySettings
from epp.server.app import EppServer, ServerSettings
from epp.testing.backend import FakeModelServer
from epp.testing.envoy import EnvoyConfig, EnvoyProcess, die_with_parent, free_port
from epp.testing.kube_api import FakeKubeApi
from epp.testing.kv_publisher import KvEventPublisher, stored
from epp.testing.wait import eventually

from .cluster import BS, MODEL, keys_of, tokens
from .test_pod_removal import connections_to

REPO = pathlib.Path(__file__).resolve().parents[2]
POOL = "tiny-pool"
APP = {"app": "tiny-engine"}
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
PIN = "x-pin-endpoint"  # Envoy turns it into the gateway's subset hint: the EPP may pick only that endpoint
PER_TOKEN = 0.0002  # engine seconds per prompt token before answering: a 481-token request takes ~0.1 s
STREAM_DELAY = 20.0  # pod-2's engine waits this long between the chunks of a streamed answer
PROMPTS = [tokens(30, 100_000 * i) for i in range(3)]  # pod i holds PROMPTS[i] in its KV cache
# Long generations pinned to pod-2 (streamed; the traffic is not): still in flight when it goes away.
PROBES = 3
AFTER = 60  # requests sent after the removal, at least


# -- pod-2's engine, in a process of its own -----------------------------------------------------


class EngineProcess:
    """The parent's handle on a child `FakeModelServer`."""

    def __init__(self, host: str, port: int, name: str) -> None:
        module = "tests.faults.test_pod_deleted_via_discovery"
        self.argv = [sys.executable, "-m", module, "--engine", host, str(port), name]
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> EngineProcess:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            preexec_fn=die_with_parent,
        )
        line = await self._line()
        if line != "ready":
            raise RuntimeError(f"engine process did not start: {line!r}")
        return self

    async def _line(self, timeout: float = 30.0) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        return (await asyncio.wait_for(self.proc.stdout.readline(), timeout)).decode().strip()

    async def stats(self) -> dict[str, int]:
        """{"in_flight", "streams" (streamed requests received), "requests", "metrics_scrapes"}."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(b"stats\n")
        await self.proc.stdin.drain()
        return json.loads(await self._line())  # type: ignore[no-any-return]

    async def until(self, what: str, check: Any) -> dict[str, int]:
        """Poll `stats()` (bounded) until `check(stats)` holds."""
        for _ in range(1000):
            s = await self.stats()
            if check(s):
                return s
            await asyncio.sleep(0.01)
        raise AssertionError(f"engine never reached: {what} (last {s})")

    async def end(self, sig: int) -> int:
        """SIGTERM (drain and exit) or SIGKILL (a crash, an OOM kill: the kernel resets its connections)."""
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        return await asyncio.wait_for(self.proc.wait(), 10.0)

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def _engine_child(host: str, port: int, name: str) -> None:
    server = FakeModelServer(
        name, host=host, port=port, model=MODEL, prefill_per_token=PER_TOKEN, stream_delay=STREAM_DELAY
    )
    await server.start()
    loop = asyncio.get_running_loop()
    term = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, term.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def answer() -> None:
        while (await reader.readline()).strip() == b"stats":
            stats = {
                "in_flight": server.in_flight,
                "streams": sum(bool(r.json and r.json.get("stream")) for r in server.requests),
                "requests": len(server.requests),
                "metrics_scrapes": server.metrics_scrapes,
            }
            sys.stdout.write(json.dumps(stats) + "\n")
            sys.stdout.flush()
        term.set()  # stdin closed: the parent is gone

    task = asyncio.create_task(answer())
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await term.wait()
    await server.stop()  # releases the requests it is working on: they are answered, then it exits
    task.cancel()


# -- the pool ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    after: bool  # sent once the EPP's endpoint set no longer had the pod
    status: int
    served: str | None  # x-served-by
    text: str  # the body, or as much of it as arrived
    error: str | None = None  # how reading the body failed


@dataclass
class Rig:
    api: FakeKubeApi
    epp: EppServer
    envoy: EnvoyProcess
    engines: list[FakeModelServer]  # pod-0 and pod-1, in-process
    engine2: EngineProcess
    pubs: list[KvEventPublisher]
    pods: list[str]  # endpoint ids, pod-i at index i
    session: aiohttp.ClientSession

    async def send(
        self, prompt: list[int], after: bool = False, pin: str | None = None, stream: bool = False
    ) -> Result:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
        headers = {PIN: pin} if pin is not None else {}
        async with self.session.post(f"{self.envoy.url}/v1/completions", json=body, headers=headers) as r:
            received = bytearray()
            try:
                async for chunk in r.content.iter_any():
                    received += chunk
            except aiohttp.ClientPayloadError as err:
                return Result(after, r.status, r.headers.get("x-served-by"), received.decode(), repr(err))
            return Result(after, r.status, r.headers.get("x-served-by"), received.decode())

    def held(self, pod: str, prompt: list[int]) -> int:
        return self.epp.kv_index.lookup(keys_of(prompt), [pod])[pod].get("gpu", 0)

    def subscribed(self) -> set[str]:
        assert self.epp.subscriber is not None
        return {pod for pod, _ in self.epp.subscriber._streams}

    def sample(self, name: str, **labels: str) -> float:
        return self.epp.metrics.registry.get_sample_value(name, labels) or 0.0

    async def admin(self, path: str) -> str:
        async with self.session.get(f"http://127.0.0.1:{self.epp.metrics_port}{path}") as r:
            assert r.status == 200, path
            return await r.text()

    async def joined(self, i: int) -> None:
        """Defeat ZeroMQ's slow joiner: empty batches until the EPP has applied one from pod i."""
        for _ in range(500):
            await self.pubs[i].publish([])
            if self.pods[i] in self.epp.ingest.last_seq:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"pod-{i} never received an event batch")


@contextlib.asynccontextmanager
async def discovered_pool(tmp_path: pathlib.Path) -> AsyncIterator[Rig]:
    http, events = free_port(), free_port()
    pods = [f"{h}:{http}" for h in HOSTS]
    engines = [
        FakeModelServer(f"pod-{i}", host=h, port=http, model=MODEL, prefill_per_token=PER_TOKEN)
        for i, h in enumerate(HOSTS[:2])
    ]
    engine2 = EngineProcess(HOSTS[2], http, "pod-2")
    pubs = [KvEventPublisher(f"tcp://{h}:{events}") for h in HOSTS]
    # The subscriber's own reconcile is far slower than the test: it follows the set through discovery.
    cfg = replace(
        default_config(), kv_events=KvEventsConfig(mode="per-pod", port=events, sync_interval=300.0)
    )
    async with FakeKubeApi() as api:
        api.add_pool(POOL, APP, [http])
        for i, h in enumerate(HOSTS):
            api.add_pod(f"pod-{i}", h, APP)
        discovery = DiscoverySettings(
            POOL,
            kubeconfig=api.write_kubeconfig(tmp_path / "kubeconfig"),
            backoff_initial=0.02,
            backoff_max=0.2,
            watch_timeout=60,
        )
        epp = EppServer(ServerSettings.loopback(seed=5, pool_name=POOL, discovery=discovery), cfg)
        # The fake engines serve without publishing events for it; see `tests/faults/cluster.py`.
        epp.freshness.silence = 3600.0
        envoy: EnvoyProcess | None = None
        try:
            for e in engines:
                await e.start()
            await engine2.start()
            for p in pubs:
                await p.start()
            await epp.start()
            envoy = EnvoyProcess(EnvoyConfig(epp_port=epp.grpc_port, subset_hint_from_header=PIN))
            await envoy.start()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                assert envoy is not None
                rig = Rig(api, epp, envoy, engines, engine2, pubs, pods, session)
                await eventually(lambda: set(epp.datastore.ids()) == set(pods), "the pool's pods discovered")
                await eventually(
                    lambda: all(r.metrics is not None for r in epp.datastore.records()), "every pod scraped"
                )
                await eventually(lambda: rig.subscribed() == set(pods), "subscribed to every pod")
                yield rig
        finally:
            if envoy is not None:
                await envoy.stop()
            await epp.stop(grace=0.2)
            for p in pubs:
                await p.stop()
            await engine2.close()
            for e in engines:
                await e.stop()


# -- the test ------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["rolling", "deleted"])
async def test_a_pod_deleted_through_discovery_gets_no_traffic_and_leaves_nothing_behind(
    how: str, tmp_path: pathlib.Path
) -> None:
    async with discovered_pool(tmp_path) as rig:
        epp = rig.epp
        gone = rig.pods[2]
        gone_host = HOSTS[2]
        events_port = int(rig.pubs[2].endpoint.rpartition(":")[2])
        for i, prompt in enumerate(PROMPTS):
            await rig.joined(i)
            first = 1000 * (i + 1)
            await rig.pubs[i].publish([stored(list(range(first, first + 30)), None, prompt, BS)])
        await eventually(
            lambda: all(rig.held(pod, prompt) == 30 for pod, prompt in zip(rig.pods, PROMPTS, strict=True)),
            "every pod's prompt indexed",
        )
        assert connections_to(gone_host, events_port) == 1
        assert (await rig.send([*PROMPTS[2], 1])).served == "pod-2"  # the cache-aware pick

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 25
        removed = asyncio.Event()
        stop = asyncio.Event()
        results: list[Result] = []

        async def client(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                assert loop.time() < deadline, "traffic took too long"
                after = removed.is_set()
                results.append(await rig.send([*rng.choice(PROMPTS), rng.randrange(50)], after))

        def after() -> list[Result]:
            return [r for r in results if r.after]

        clients = [asyncio.create_task(client(seed)) for seed in range(4)]
        probes: list[asyncio.Task[Result]] = []
        try:
            await eventually(
                lambda: sum(r.served == "pod-2" for r in results) >= 5, "pod-2 serving its prompt"
            )
            for i in range(PROBES):
                probes.append(asyncio.create_task(rig.send([*PROMPTS[2], 100 + i], pin=gone, stream=True)))
            await rig.engine2.until(f"{PROBES} streams at pod-2", lambda s: s["streams"] == PROBES)
            scrapes_seen = rig.sample("epp_metrics_scrapes_total", endpoint=gone, outcome="ok")
            assert scrapes_seen > 0

            # -- the API server deletes pod-2 ---------------------------------------------------
            if how == "rolling":
                rig.api.update_pod("pod-2", deleting=True)
            else:
                rig.api.delete_pod("pod-2")
            await eventually(lambda: gone not in epp.datastore.ids(), "pod-2 left the endpoint set")
            removed.set()
            picks = rig.sample("epp_picks_total", endpoint=gone, profile="default", reason="scored")
            assert set(epp.datastore.ids()) == set(rig.pods[:2])
            # The engine still works on what it was given: leaving the set cuts no request.
            assert (await rig.engine2.stats())["in_flight"] >= PROBES
            assert not any(p.done() for p in probes)

            # Its subscription, index entries and scrape are gone.
            await eventually(lambda: rig.subscribed() == set(rig.pods[:2]), "pod-2's subscription closed")
            await eventually(lambda: connections_to(gone_host, events_port) == 0, "pod-2's socket closed")
            assert gone not in epp.kv_index.pods() and gone not in epp.ingest.counters
            assert rig.held(gone, PROMPTS[2]) == 0
            assert gone not in json.loads(await rig.admin("/debug/index"))["pods"]
            assert f'pod="{gone}"' not in await rig.admin("/metrics")
            scraper = epp.scraper
            assert scraper is not None
            await eventually(lambda: gone not in scraper.scraping, "pod-2's scrape stopped")
            await asyncio.sleep(0.2)  # a scrape already on the wire when it stopped may still land
            engine_scrapes = (await rig.engine2.stats())["metrics_scrapes"]
            epp_scrapes = rig.sample("epp_metrics_scrapes_total", endpoint=gone, outcome="ok")
            epp_scrape_errors = rig.sample("epp_metrics_scrapes_total", endpoint=gone, outcome="error")
            # A block it still publishes goes nowhere (pod-0's, published after it, is indexed).
            await rig.pubs[2].publish([stored([9000], None, tokens(1, 7), BS)])
            await rig.pubs[0].publish([stored([9001], None, tokens(1, 8), BS)])
            await eventually(lambda: rig.held(rig.pods[0], tokens(1, 8)) == 1, "pod-0's new block indexed")
            await asyncio.sleep(0.2)
            assert rig.held(gone, tokens(1, 7)) == 0 and gone not in epp.kv_index.pods()
            # A request the gateway pins to it is refused by the EPP, saying why.
            pinned = await rig.send([*PROMPTS[2], 2], pin=gone)
            assert pinned.status == 503 and pinned.served is None, pinned
            assert "no eligible endpoint in the gateway's subset hint" in pinned.text, pinned.text

            await eventually(lambda: len(after()) >= AFTER // 2, "traffic after the removal", timeout=15)
            assert (await rig.engine2.stats())["metrics_scrapes"] == engine_scrapes  # the engine's own count

            # -- the engine really goes away ----------------------------------------------------
            if how == "rolling":
                rig.api.update_pod("pod-2", ready=False)  # its readiness probe fails as it drains
                assert await rig.engine2.end(signal.SIGTERM) == 0  # drains: answers what it has, exits
                rig.api.delete_pod("pod-2")
                watcher = epp.discovery
                assert watcher is not None
                await eventually(lambda: "pod-2" not in watcher.pods, "pod-2 forgotten")
            else:
                # Only the pinned requests are left there (nothing new arrives; the rest have finished).
                await rig.engine2.until("only the streams in flight", lambda s: s["in_flight"] == PROBES)
                assert await rig.engine2.end(signal.SIGKILL) == -signal.SIGKILL
            await rig.pubs[2].stop()
            probe_results = await asyncio.wait_for(asyncio.gather(*probes), 10)
            await eventually(lambda: len(after()) >= AFTER, "traffic after the engine went away", timeout=15)
        finally:
            stop.set()
            await asyncio.gather(*clients, *probes, return_exceptions=True)
        for c in clients:
            c.result()  # a client's own failure (e.g. the deadline) surfaces here

        # What happened to the requests that were at pod-2 when it went away.
        for r in probe_results:
            assert (r.status, r.served) == (200, "pod-2"), r
            chunks = [c for c in r.text.split("\n\n") if c]
            if how == "rolling":  # drained: the whole stream
                assert r.error is None and chunks[-1] == "data: [DONE]" and len(chunks) == 5, r
            else:  # cut: the first chunk, then the connection ends without the stream's end
                assert r.error is not None and "Response payload is not completed" in r.error, r
                assert (
                    len(chunks) == 1 and json.loads(chunks[0].removeprefix("data: "))["choices"][0]["text"]
                ), r
        # Every other request was answered, none by pod-2 once it had left the set.
        assert [r for r in results if r.status != 200] == []
        assert len(after()) >= AFTER
        assert {r.served for r in after()} <= {"pod-0", "pod-1"}
        assert {r.served for r in after()} >= {"pod-0", "pod-1"}  # the load went on, to both
        assert rig.sample("epp_picks_total", endpoint=gone, profile="default", reason="scored") == picks
        # Nor was it scraped again (nor tried: an engine that is gone would have been an error).
        assert rig.sample("epp_metrics_scrapes_total", endpoint=gone, outcome="ok") == epp_scrapes
        assert rig.sample("epp_metrics_scrapes_total", endpoint=gone, outcome="error") == epp_scrape_errors
        # Nothing is left in flight.
        await eventually(lambda: epp.datastore.total_in_flight() == 0, "nothing in flight")
        await eventually(
            lambda: rig.sample("inference_objective_running_requests", model_name=MODEL) == 0, "running 0"
        )
        # Every routed request was released once: the traffic and the first request as complete; the
        # streams cut by the crash as disconnects (the ext_proc stream ended before the response did).
        cut = PROBES if how == "deleted" else 0
        released = {
            c: rig.sample("epp_requests_released_total", cause=c) for c in ("complete", "error", "disconnect")
        }
        assert released == {"complete": len(results) + 1 + PROBES - cut, "error": 0, "disconnect": cut}
        # The others are untouched.
        for pod, prompt in zip(rig.pods[:2], PROMPTS[:2], strict=True):
            assert rig.held(pod, prompt) == 30
        assert set(epp.datastore.ids()) == set(rig.pods[:2]) == rig.subscribed()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", nargs=3, metavar=("HOST", "PORT", "NAME"), required=True)
    host, port, name = p.parse_args().engine
    asyncio.run(_engine_child(host, int(port), name))


if __name__ == "__main__":
    main()
