"""Tenant isolation, end to end: two tenants share a pool of simulated engines that really salt their
prefix caches (vLLM's `cache_salt`), behind a real Envoy and the EPP with `tenancy` configured.

- Tenant B sending exactly tenant A's prompt gains no cache credit, neither in the EPP's index (its
  decision shows 0 cached tokens) nor in the engine (`cached_tokens == 0`), while A's repeat hits both.
- A client-sent `cache_salt` never survives: the engine receives the EPP's salt for the tenant.
- By default no prompt text or token ids appear in the EPP's logs (captured at debug level, in-process
  and from `epp serve`'s stderr), in `/metrics` or in any `/debug/*` output; with
  `--enable-debug-endpoints=false` every `/debug/*` path is 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import signal
import sys
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest

from epp.config import DEFAULT_CONFIG_YAML, StaticEndpoint, parse_config
from epp.server.app import EppServer, ServerSettings
from epp.tenancy import TenantSalter
from epp.testing.envoy import EnvoyConfig, EnvoyProcess, RequestBodyMode, free_port
from epp.testing.tokenizer import build_tiny_tokenizer
from epp.testing.wait import eventually, http_ok
from simulator.engine import EngineConfig
from simulator.records import RequestRecord
from simulator.serving import EngineServerConfig, SimulatedEngineServer

MODEL = "demo"
BS = 16
HOSTS = ("127.0.0.2", "127.0.0.3")
SECRET = "tenant-isolation-test-secret-0001"
SECRET_ENV = "EPP_TEST_TENANCY_SECRET"
TENANT = "x-tenant-id"
PIN = "x-pin-endpoint"  # Envoy turns it into the subset hint: the EPP may pick only that endpoint
SALTER = TenantSalter(TENANT, SECRET.encode())
# Words no log line, metric or debug page has any reason to contain.
MARKERS = ("Quixoblastic", "Zephyrnautica", "Vermicruxian", "Plumbagonzo")
SYSTEM = " ".join(
    f"{MARKERS[i % 4]} ledger {i} balances the {MARKERS[(i + 1) % 4]} orbit." for i in range(24)
)


def config_yaml(kv_port: int, replay_port: int, tok_dir: pathlib.Path, endpoints: Iterable[str] = ()) -> str:
    listed = "".join(f"- {{address: '{a}', model: {MODEL}}}\n" for a in endpoints)
    return (
        DEFAULT_CONFIG_YAML
        + f"kvEvents: {{mode: per-pod, port: {kv_port}, replayPort: {replay_port}}}\n"
        + f"tokenizers: {{{MODEL}: '{tok_dir}'}}\n"
        + f"tenancy: {{header: {TENANT}, secretEnv: {SECRET_ENV}}}\n"
        + "explain: {responseHeader: true}\n"
        + (f"endpoints:\n{listed}" if listed else "")
    )


@dataclass(frozen=True)
class Seen:
    """What an engine was given for one request."""

    salt: str | None
    prompt_ids: tuple[int, ...]


@dataclass(frozen=True)
class Reply:
    status: int
    doc: dict[str, Any]
    decision: dict[str, str]  # the x-epp-decision header, parsed

    @property
    def cached(self) -> int:
        return int(self.doc["usage"]["prompt_tokens_details"]["cached_tokens"])

    @property
    def prompt_tokens(self) -> int:
        return int(self.doc["usage"]["prompt_tokens"])


@dataclass
class Pool:
    epp: EppServer
    envoy: EnvoyProcess
    engines: list[SimulatedEngineServer]
    session: aiohttp.ClientSession
    seen: dict[str, list[Seen]]  # engine address -> requests it finished, in order
    decision_headers: list[str]

    def engine(self, address: str) -> SimulatedEngineServer:
        return next(e for e in self.engines if e.address == address)

    async def post(
        self,
        body: dict[str, Any],
        tenant: str | None = None,
        pin: str | None = None,
        path: str = "/v1/chat/completions",
        headers: dict[str, str] | None = None,
    ) -> Reply:
        h = dict(headers or {})
        if tenant is not None:
            h[TENANT] = tenant
        if pin is not None:
            h[PIN] = pin
        async with self.session.post(f"{self.envoy.url}{path}", json=body, headers=h) as r:
            text = await r.text()
            header = r.headers.get("x-epp-decision", "")
            if header:
                self.decision_headers.append(header)
            doc: dict[str, Any] = {}
            if body.get("stream"):
                for block in text.split("\n\n"):
                    if block.startswith("data: {"):
                        chunk = json.loads(block[len("data: ") :])
                        if chunk.get("usage"):
                            doc = chunk
            elif text:
                doc = json.loads(text)
            decision = dict(p.split("=", 1) for p in header.split("; ")) if header else {}
            return Reply(r.status, doc, decision)

    async def admin(self, path: str) -> tuple[int, str]:
        async with self.session.get(f"http://127.0.0.1:{self.epp.metrics_port}{path}") as r:
            return r.status, await r.text()

    async def last_decision(self) -> dict[str, Any]:
        status, text = await self.admin("/debug/decisions?limit=1")
        assert status == 200, text
        return json.loads(text)["decisions"][0]  # type: ignore[no-any-return]

    async def settled(self) -> None:
        """Every KV event batch the engines have published has been applied by the EPP."""
        await eventually(
            lambda: all(
                self.epp.ingest.last_seq.get(e.address, -1) == e.engine.sink.seq - 1  # type: ignore[union-attr]
                for e in self.engines
            ),
            "the EPP applied every KV event batch",
        )
        # ... and scraped every engine idle, so the next pick sees no queue left from the last request.
        await eventually(
            lambda: all(
                r.metrics is not None and r.metrics.waiting == 0 and r.metrics.running == 0
                for r in self.epp.datastore.records()
            ),
            "every engine scraped idle",
        )


def engine_config(
    host: str, kv_port: int, replay_port: int, tok_dir: pathlib.Path | None
) -> EngineServerConfig:
    return EngineServerConfig(
        model=MODEL,
        host=host,
        port=free_port(),
        tokenizer=tok_dir,
        engine=EngineConfig(num_gpu_blocks=1024, block_size=BS),
        kv_events_endpoint=f"tcp://{host}:{kv_port}",
        kv_replay_endpoint=f"tcp://{host}:{replay_port}",
        kv_events_mode="bind",
    )


def watch(engine: SimulatedEngineServer, seen: list[Seen]) -> None:
    """Record the salt and prompt ids of every request the engine finishes (its finish hook, chained)."""
    chained = engine.runner.finish_hook

    def hook(record: RequestRecord, t: float) -> None:
        req = record.request
        seen.append(Seen(req.cache_salt, tuple(int(x) for x in req.prompt_token_ids)))
        if chained is not None:
            chained(record, t)

    engine.runner.finish_hook = hook


@contextlib.asynccontextmanager
async def tenant_pool(
    tok_dir: pathlib.Path, body_mode: RequestBodyMode = "FULL_DUPLEX_STREAMED"
) -> AsyncIterator[Pool]:
    """Two engines on 127.0.0.2 and .3 (KV events per pod, with replay), the EPP with tenancy and
    decision headers, and a real Envoy in front that maps `PIN` to the subset hint."""
    kv_port, replay_port = free_port(), free_port()
    engines = [SimulatedEngineServer(engine_config(h, kv_port, replay_port, tok_dir)) for h in HOSTS]
    seen: dict[str, list[Seen]] = {}
    cfg = parse_config(config_yaml(kv_port, replay_port, tok_dir), "tenancy.yaml")
    cfg = replace(cfg, kv_events=replace(cfg.kv_events, sync_interval=0.05))
    settings = ServerSettings.loopback(seed=11)
    started: list[SimulatedEngineServer] = []
    epp: EppServer | None = None
    envoy: EnvoyProcess | None = None
    try:
        for e in engines:
            await e.start()
            started.append(e)
            seen[e.address] = []
            watch(e, seen[e.address])
        epp = EppServer(settings, cfg, [StaticEndpoint(e.address, MODEL) for e in engines])
        await epp.start()
        envoy = EnvoyProcess(
            EnvoyConfig(epp_port=epp.grpc_port, subset_hint_from_header=PIN, request_body_mode=body_mode)
        )
        await envoy.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            ready = epp
            await eventually(lambda: all(r.metrics is not None for r in ready.datastore.records()), "scraped")
            await eventually(
                lambda: all(e.kv_peers == 1 for e in engines), "every engine's PUB reaches the EPP"
            )
            yield Pool(epp, envoy, engines, session, seen, [])
    finally:
        if envoy is not None:
            await envoy.stop()
        if epp is not None:
            await epp.stop(grace=0.2)
        for e in started:
            await e.stop()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(autouse=True)
def tenancy_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)


def chat(question: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}


def engine_cached(prompt_tokens: int) -> int:
    """What the engine (as vLLM) serves from cache for a prompt it holds: full blocks, not the last token."""
    return (prompt_tokens - 1) // BS * BS


# -- cache credit ----------------------------------------------------------------------------------


async def test_tenant_b_gains_no_cache_credit_from_tenant_a(tok_dir: pathlib.Path) -> None:
    async with tenant_pool(tok_dir) as pool:
        body = chat("Which ledger balances the orbit?")
        first = await pool.post(body, tenant="tenant-a")
        assert first.status == 200, first.doc
        holder = first.decision["endpoint"]
        n = first.prompt_tokens
        assert n > 8 * BS and first.cached == 0 and int(first.decision["cached_tokens"]) == 0
        await pool.settled()
        # Tenant A's repeat: the index credits the holder and the engine serves it from cache.
        again = await pool.post(body, tenant="tenant-a")
        assert again.decision["endpoint"] == holder
        assert int(again.decision["cached_tokens"]) == engine_cached(n) > 0
        assert again.cached == engine_cached(n)
        # Tenant B, the very same prompt, pinned to the engine holding A's blocks: no credit anywhere.
        b_first = await pool.post(body, tenant="tenant-b", pin=holder)
        assert b_first.status == 200 and b_first.decision["endpoint"] == holder
        assert int(b_first.decision["cached_tokens"]) == 0
        assert b_first.cached == 0  # the engine's own prefix cache: A's blocks are salted apart
        d = await pool.last_decision()
        assert [c["endpoint"] for c in d["candidates"]] == [holder]
        assert d["candidates"][0]["cached_tokens"] == 0
        # B's own blocks (stored on the holder by its first request) are B's to use, and only those.
        await pool.settled()
        b_again = await pool.post(body, tenant="tenant-b")
        assert b_again.decision["endpoint"] == holder and b_again.cached == engine_cached(n)
        d = await pool.last_decision()
        credit = {c["endpoint"]: c["cached_tokens"] for c in d["candidates"]}
        assert credit == {e.address: engine_cached(n) if e.address == holder else 0 for e in pool.engines}
        # A third tenant sees neither A's nor B's blocks, on any candidate or in any engine.
        c_first = await pool.post(body, tenant="tenant-c")
        d = await pool.last_decision()
        assert len(d["candidates"]) == 2 and all(c["cached_tokens"] == 0 for c in d["candidates"])
        assert c_first.cached == 0 == int(c_first.decision["cached_tokens"])
        # The engines received each tenant's EPP-derived salt, and nothing else.
        salts = [str(s.salt) for e in pool.engines for s in pool.seen[e.address]]
        assert sorted(salts) == sorted(
            [SALTER.salt("tenant-a")] * 2 + [SALTER.salt("tenant-b")] * 2 + [SALTER.salt("tenant-c")]
        )
        assert len({s.prompt_ids for e in pool.engines for s in pool.seen[e.address]}) == 1


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def test_a_client_sent_cache_salt_never_survives(
    tok_dir: pathlib.Path, body_mode: RequestBodyMode
) -> None:
    salt_a = SALTER.salt("tenant-a")
    async with tenant_pool(tok_dir, body_mode) as pool:
        body = chat("Who keeps the salt?")
        first = await pool.post(body, tenant="tenant-a")
        assert first.status == 200, first.doc
        holder, n = first.decision["endpoint"], first.prompt_tokens
        await pool.settled()
        seen = pool.seen[holder]
        # Claiming tenant A's salt value (or any value) wins nothing, whoever the client is (each a
        # tenant with no blocks of its own yet).
        for tenant, client_salt in (
            ("tenant-b", salt_a),
            (None, salt_a),  # no tenant header: the shared namespace, still the EPP's salt
            ("tenant-c", "t1-anything-the-client-likes"),
        ):
            reply = await pool.post({**body, "cache_salt": client_salt}, tenant=tenant, pin=holder)
            assert reply.status == 200, reply.doc
            assert reply.cached == 0 and int(reply.decision["cached_tokens"]) == 0, (tenant, client_salt)
            assert seen[-1].salt == SALTER.salt(tenant or "") != client_salt
            await pool.settled()
        # Tenant A sending a made-up salt still gets its own (and so its own cache hit).
        reply = await pool.post({**body, "cache_salt": "made-up"}, tenant="tenant-a")
        assert reply.decision["endpoint"] == holder
        assert reply.cached == engine_cached(n) == int(reply.decision["cached_tokens"]) > 0
        assert seen[-1].salt == salt_a
        # A tenant header sent twice (or a list) is refused before any engine sees the request.
        count = sum(len(s) for s in pool.seen.values())
        refused = await pool.post(body, headers={TENANT: "tenant-a,tenant-b"})
        assert refused.status == 403 and "TenantAmbiguous" in json.dumps(refused.doc)
        assert sum(len(s) for s in pool.seen.values()) == count


# -- nothing of the prompt leaks -------------------------------------------------------------------


def needles(seen: Iterable[Seen], window: int = 4) -> set[str]:
    """The marker words, and every run of `window` consecutive prompt token ids as a number sequence
    written the ways a log line or a JSON document would write it."""
    out = {m.lower() for m in MARKERS}
    for s in seen:
        ids = s.prompt_ids
        for i in range(len(ids) - window + 1):
            run = [str(x) for x in ids[i : i + window]]
            out.update({", ".join(run), ",".join(run), " ".join(run)})
    return out


def leaks(texts: dict[str, str], found_in: set[str]) -> list[tuple[str, str]]:
    return [(where, n) for where, text in texts.items() for n in found_in if n in text.lower()]


async def every_admin_output(pool: Pool) -> dict[str, str]:
    out = {}
    for path in ("/metrics", "/debug/endpoints", "/debug/index", "/debug/decisions?limit=10000"):
        status, text = await pool.admin(path)
        assert status == 200, path
        out[path] = text
    return out


async def leak_traffic(pool: Pool) -> None:
    """Prompts with the markers: chat and completions, streamed and not, token ids, and rejected ones."""
    for i, tenant in enumerate(("tenant-a", "tenant-b", "tenant-a")):
        r = await pool.post(
            chat(f"{MARKERS[i]} and {MARKERS[i + 1]}: which orbit?", stream=bool(i % 2)), tenant
        )
        assert r.status == 200, r.doc
        await pool.settled()
    text = {"model": MODEL, "prompt": f"{SYSTEM} Complete the {MARKERS[0]} ledger.", "max_tokens": 3}
    assert (await pool.post(text, "tenant-b", path="/v1/completions")).status == 200
    ids = {"model": MODEL, "prompt": [300 + (37 * i) % 211 for i in range(6 * BS + 5)], "max_tokens": 3}
    assert (await pool.post(ids, "tenant-a", path="/v1/completions")).status == 200
    assert (await pool.post(ids, "tenant-a", path="/v1/completions")).status == 200
    await pool.settled()
    # A chat the template refuses (its error quotes the role): routed load-only, the engine refuses it.
    odd = {
        "model": MODEL,
        "messages": [{"role": f"{MARKERS[1]}-role", "content": MARKERS[2]}],
        "max_tokens": 2,
    }
    assert (await pool.post(odd, "tenant-b")).status == 400
    # Refused ones: an ambiguous tenant, a body the EPP cannot read.
    assert (await pool.post(chat(MARKERS[2]), headers={TENANT: "a,b"})).status == 403
    bad = {"model": MODEL, "messages": [{"role": "user", "content": MARKERS[3]}], "max_tokens": MARKERS[3]}
    assert (await pool.post(bad, "tenant-a")).status == 400


async def test_no_prompt_text_or_token_ids_in_logs_metrics_or_debug_output(
    tok_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with tenant_pool(tok_dir) as pool:
        await leak_traffic(pool)
        outputs = await every_admin_output(pool)
        seen = [s for e in pool.engines for s in pool.seen[e.address]]
        found_in = needles(seen)
        # The search can succeed: the prompts did reach the engines as text and token ids.
        assert len(seen) == 6 and len(found_in) > 400
        control = {"a request": json.dumps(chat("?")), "its ids": json.dumps(list(seen[0].prompt_ids))}
        assert {where for where, _ in leaks(control, found_in)} == set(control)
        # Logs of everything but the simulated engines (the EPP, grpc, aiohttp, asyncio, ...).
        logs = "\n".join(
            f"{r.name} {r.getMessage()} {r.exc_text or ''}"
            for r in caplog.records
            if not r.name.startswith("simulator")
        )
        assert logging.getLogger("epp").isEnabledFor(logging.DEBUG)
        assert "EPP serving ext_proc" in logs  # the capture was on from the start
        outputs["logs"] = logs
        outputs["x-epp-decision"] = "\n".join(pool.decision_headers)
        assert leaks(outputs, found_in) == []
        # ... and the outputs are not empty: the decisions and the index are there, without content.
        assert json.loads(outputs["/debug/decisions?limit=10000"])["kept"] == 7
        assert (
            sum(p["blocks"].get("gpu", 0) for p in json.loads(outputs["/debug/index"])["pods"].values()) > 0
        )


# -- `epp serve` as a process: debug logs on stderr, /debug/* switched off ----------------------------


async def test_debug_endpoints_off_and_nothing_in_a_debug_level_stderr(
    tok_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    kv_port, replay_port = free_port(), free_port()
    seen: list[Seen] = []
    async with SimulatedEngineServer(engine_config(HOSTS[0], kv_port, replay_port, tok_dir)) as engine:
        watch(engine, seen)
        err, metrics = await serve_with_debug_off(engine, tmp_path, kv_port, replay_port, tok_dir)
    assert "EPP serving ext_proc" in err  # stderr was captured, at debug level
    assert [s.salt for s in seen] == [SALTER.salt("tenant-a")] * 3
    assert leaks({"stderr": err, "/metrics": metrics}, needles(seen)) == []


async def serve_with_debug_off(
    engine: SimulatedEngineServer, tmp: pathlib.Path, kv_port: int, replay_port: int, tok_dir: pathlib.Path
) -> tuple[str, str]:
    """`epp serve --enable-debug-endpoints=false --log-level debug` routing three marker prompts to
    `engine` through Envoy, every /debug/* path checked; its stderr and /metrics."""
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    config = tmp / "epp.yaml"
    config.write_text(config_yaml(kv_port, replay_port, tok_dir, [engine.address]))
    # fmt: off
    args = [
        sys.executable, "-m", "epp", "serve", "--config", str(config), "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
        "--metrics-port", str(metrics_port), "--secure-serving=false", "--seed", "3",
        "--enable-debug-endpoints=false", "--log-level", "debug",
    ]
    # fmt: on
    log_path = tmp / "epp.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: debug logs must never block the process
        proc = await asyncio.create_subprocess_exec(*args, env={**os.environ, SECRET_ENV: SECRET}, stderr=log)
    admin = f"http://127.0.0.1:{metrics_port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def get(path: str) -> tuple[int, str]:
                async with session.get(admin + path) as r:
                    return r.status, await r.text()

            await http_ok(session, admin + "/readyz", "epp serve ready", process=proc)
            await eventually(lambda: engine.kv_peers == 1, "the EPP subscribed to the engine")
            async with EnvoyProcess(EnvoyConfig(epp_port=grpc_port)) as envoy:
                for i, stream in enumerate((False, True, False)):
                    body = chat(f"{MARKERS[i]} orbit?", stream=stream)
                    async with session.post(
                        f"{envoy.url}/v1/chat/completions", json=body, headers={TENANT: "tenant-a"}
                    ) as r:
                        assert r.status == 200, await r.text()
                        await r.read()  # to the end: a client that hangs up has its request aborted
            for path in (
                "/debug/endpoints",
                "/debug/index",
                "/debug/decisions",
                "/debug/decisions?limit=5",
                "/debug/",
                "/debug/anything",
            ):
                assert (await get(path))[0] == 404, path
            status, metrics = await get("/metrics")
            assert status == 200 and "epp_" in metrics
            assert (await get("/healthz"))[0] == 200
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 15)
    assert proc.returncode == 0
    return log_path.read_text(errors="replace"), metrics
