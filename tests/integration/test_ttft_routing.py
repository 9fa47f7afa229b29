"""The TTFT picker end to end: fake engines publishing real KV events and metrics, the EPP, real Envoy.

Each scenario of the issue: queue beats hit; a CPU-tier prefix beats recomputing a long prompt but not
a short one; a stale index makes picks load-only; calibration corrects a 3x wrong profile; sheddable
requests get 429 + retry-after when the SLO cannot be met; one tenant's prefix never gives another
affinity, and the salt the engine sees is the EPP's, not the client's.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from epp.config import parse_config
from epp.kvindex.keys import block_keys, root_key
from epp.tenancy import TenantSalter
from epp.testing.backend import RecordedRequest
from epp.testing.envoy import EnvoyConfig
from epp.testing.kv_publisher import KvEventPublisher, stored

from .stack import BS, MODEL, eventually, kv_cluster

HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
PROFILE = """\
plugins:
- type: ttft-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: ttft-scorer
"""


async def post(
    c: dict[str, Any], body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, str | None, dict[str, str], str]:
    async with c["session"].post(f"{c['envoy'].url}/v1/completions", json=body, headers=headers) as r:
        text = await r.text()
        return r.status, r.headers.get("x-served-by"), {k.lower(): v for k, v in r.headers.items()}, text


async def served_by(c: dict[str, Any], body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    status, pod, _, text = await post(c, body, headers)
    assert status == 200, text
    assert pod is not None
    return pod


async def last_decision(c: dict[str, Any]) -> dict[str, Any]:
    async with c["session"].get(f"http://127.0.0.1:{c['epp'].metrics_port}/debug/decisions?limit=1") as r:
        assert r.status == 200
        doc = json.loads(await r.text())
    return dict(doc["decisions"][0])


def candidate(decision: dict[str, Any], address: str) -> dict[str, Any]:
    return next(c for c in decision["candidates"] if c["endpoint"] == address)


async def publish(
    pub: KvEventPublisher, tokens: list[int], first_hash: int, medium: str = "GPU", salt: str | None = None
) -> int:
    n = len(tokens) // BS
    extra = [[salt], *([None] * (n - 1))] if salt else None
    await pub.publish(
        [
            stored(
                list(range(first_hash, first_hash + n)), None, tokens[: n * BS], BS, medium, extra_keys=extra
            )
        ]
    )
    return n


async def set_waiting(c: dict[str, Any], index: int, waiting: int) -> None:
    backend = c["backends"][index]
    backend.waiting = waiting
    await eventually(
        lambda: c["epp"].datastore.get(backend.address).metrics.waiting == waiting, "queue scraped"
    )


async def test_a_cached_prefix_behind_a_long_queue_loses_to_an_idle_pod() -> None:
    async with kv_cluster() as c:
        epp, holder = c["epp"], c["backends"][1]
        prompt = list(range(1, 64 * BS + 1))
        await publish(c["pubs"][1], prompt, 100)
        await eventually(lambda: epp.kv_index.pod_counts(holder.address).get("gpu") == 64, "indexed")
        body = {"model": MODEL, "prompt": prompt}
        assert await served_by(c, body) == "pod-1"  # idle everywhere: the cache decides
        # pod-1 now has ~3 s of other traffic waiting (requests this EPP did not route).
        profile = epp.cost.profile(MODEL)
        await set_waiting(c, 1, math.ceil(3.0 / profile.prefill_s(profile.unknown_request_tokens)))
        assert "pod-1" not in {await served_by(c, body) for _ in range(3)}
        d = await last_decision(c)
        held = candidate(d, holder.address)
        assert held["cached_tokens"] == len(prompt) - BS  # the engine recomputes the last (whole) block
        assert held["queue_s"] >= 3.0
        assert candidate(d, d["winner"])["ttft_s"] < held["ttft_s"]
        assert d["mode"] == "cache-aware"


async def test_a_cpu_tier_prefix_wins_for_a_long_prompt_and_not_for_a_short_one() -> None:
    async with kv_cluster() as c:
        epp, holder = c["epp"], c["backends"][1]
        long = [(7 * i) % 30_000 + 1 for i in range(1024 * BS)]  # 16K tokens
        short = [50_000 + i for i in range(4 * BS)]
        await publish(c["pubs"][1], long, 10_000, medium="CPU")
        await publish(c["pubs"][1], short, 20_000, medium="CPU")
        await eventually(lambda: epp.kv_index.pod_counts(holder.address).get("cpu") == 1028, "indexed")
        await set_waiting(c, 1, 2)  # the holder is a little busier than the others
        assert await served_by(c, {"model": MODEL, "prompt": long}) == "pod-1"
        d = await last_decision(c)
        held = candidate(d, holder.address)
        assert held["reloaded_tokens"] == len(long) - BS and held["reload_s"] > 0
        recompute = epp.cost.profile(MODEL).prefill_s(len(long))
        assert held["reload_s"] + held["prefill_s"] < recompute
        assert await served_by(c, {"model": MODEL, "prompt": short}) != "pod-1"
        assert candidate(await last_decision(c), holder.address)["reloaded_tokens"] == 0


async def test_a_stale_index_gives_no_cache_credit_and_picks_turn_load_only() -> None:
    async with kv_cluster() as c:
        epp, holder = c["epp"], c["backends"][1]
        prompt = [(11 * i) % 3000 + 1 for i in range(40 * BS)]
        await publish(c["pubs"][1], prompt, 1)
        await eventually(lambda: epp.kv_index.pod_counts(holder.address).get("gpu") == 40, "indexed")
        body = {"model": MODEL, "prompt": prompt}
        assert await served_by(c, body) == "pod-1"
        assert (await last_decision(c))["mode"] == "cache-aware"
        # pod-1's publisher goes away: stale, so its (still indexed) blocks earn nothing.
        await c["pubs"][1].stop()
        c["pubs"][1] = await KvEventPublisher("tcp://127.0.0.1:*").start()  # placeholder for cleanup
        await eventually(
            lambda: epp.freshness.state(holder.address, epp.clock.now()).reason == "publisher_unreachable",
            "stale",
        )
        await set_waiting(c, 1, 3)
        assert "pod-1" not in {await served_by(c, body) for _ in range(3)}
        d = await last_decision(c)
        assert d["mode"] == "degraded"
        assert candidate(d, holder.address)["cached_tokens"] == 0
        # Every publisher gone: the decision is purely load-aware, and the metric counts it.
        for i in (0, 2):
            await c["pubs"][i].stop()
            c["pubs"][i] = await KvEventPublisher("tcp://127.0.0.1:*").start()
        await eventually(
            lambda: all(
                epp.freshness.state(b.address, epp.clock.now()).state.value == "stale" for b in c["backends"]
            ),
            "all stale",
        )
        await served_by(c, body)
        d = await last_decision(c)
        assert d["mode"] == "load-only"
        assert all(x["cached_tokens"] == 0 for x in d["candidates"])
        async with c["session"].get(f"http://127.0.0.1:{epp.metrics_port}/metrics") as r:
            text = await r.text()
        assert 'epp_pick_mode_total{mode="load-only"} 1.0' in text
        assert 'epp_pick_mode_total{mode="degraded"} 3.0' in text


CALIBRATION = (
    HEAD
    + PROFILE
    + """\
costModel:
  profiles:
  - model: "*"
    prefill: {fixedSeconds: 0.0, perTokenSeconds: 6.0e-5, perPairSeconds: 0.0}
"""
)
TRUE_PER_TOKEN = 2.0e-5  # what the fake engines really take: a profile 3x too slow


async def test_calibration_corrects_a_profile_that_is_three_times_wrong() -> None:
    cfg = parse_config(CALIBRATION, "calibration.yaml")
    async with kv_cluster(config=cfg, backend_kwargs={"prefill_per_token": TRUE_PER_TOKEN}) as c:
        epp = c["epp"]
        rng = random.Random(5)
        for i in range(120):
            n = rng.randrange(2000, 5000)
            prompt = [(i * 7919 + j) % 50_000 + 1 for j in range(n)]
            await served_by(c, {"model": MODEL, "prompt": prompt, "stream": True, "max_tokens": 2})
        fitted = epp.cost.coefficients()[MODEL]
        assert fitted["observations"] >= 100
        # The effective per-token cost moved from 3x the truth to within 20% of it.
        assert fitted["prefill_seconds_per_token"] == pytest.approx(TRUE_PER_TOKEN, rel=0.2)
        async with c["session"].get(f"http://127.0.0.1:{epp.metrics_port}/metrics") as r:
            text = await r.text()
        line = next(x for x in text.splitlines() if x.startswith("epp_cost_model_prefill_scale{"))
        assert float(line.rpartition(" ")[2]) == pytest.approx(fitted["prefill_scale"])
        d = await last_decision(c)
        assert d["calibration"]["prefill_scale"] == pytest.approx(fitted["prefill_scale"], rel=0.05)


SLO = (
    HEAD
    + PROFILE
    + """\
saturationDetector: {queueDepthThreshold: 100000}
objectives:
- {name: batch, priority: -1}
- {name: interactive, priority: 5}
admission: {ttftSlo: 1s}
"""
)


async def test_sheddable_requests_get_429_with_retry_after_when_no_pod_can_meet_the_slo() -> None:
    async with kv_cluster(config=parse_config(SLO, "slo.yaml")) as c:
        epp = c["epp"]
        for i in range(3):
            await set_waiting(c, i, 100)  # ~3.5 s of queue everywhere
        prompt = list(range(1, 101))
        body = {"model": MODEL, "prompt": prompt}
        before = sum(len(b.requests) for b in c["backends"])
        status, _, headers, text = await post(c, body, {"x-gateway-inference-objective": "batch"})
        assert status == 429, text
        p = epp.cost.profile(MODEL)  # every pod: 100 waiting requests of unknown size, then this prompt
        fastest = 100 * p.prefill_s(p.unknown_request_tokens) + p.prefill_s(len(prompt))
        assert headers["retry-after"] == str(math.ceil(fastest - 1.0))
        assert "exceeds the 1s SLO" in json.loads(text)["error"]["message"]
        assert sum(len(b.requests) for b in c["backends"]) == before  # nothing reached an engine
        # Requests that are not sheddable are still routed.
        assert (await post(c, body, {"x-gateway-inference-objective": "interactive"}))[0] == 200
        assert (await post(c, body))[0] == 200
        # One pod back to idle: the SLO can be met, and the sheddable request goes there.
        await set_waiting(c, 2, 0)
        assert await served_by(c, body, {"x-gateway-inference-objective": "batch"}) == "pod-2"


SECRET = "a-server-side-secret-of-enough-bytes"
TENANCY = (  # no speculative entries: the first request's would credit the pod that served it, which
    HEAD  # these fake engines never report holding (the test is about the salt, not about bursts)
    + PROFILE.replace("- type: ttft-scorer\n", "- type: ttft-scorer\n  parameters: {speculativeTtl: 0}\n")
    + """\
tenancy: {header: x-tenant-id, secretEnv: EPP_TEST_TENANT_SECRET, missing: reject}
"""
)


async def test_one_tenants_prefix_never_gives_another_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPP_TEST_TENANT_SECRET", SECRET)
    salter = TenantSalter("x-tenant-id", SECRET.encode())
    salt_a, salt_b = salter.salt("tenant-a"), salter.salt("tenant-b")
    async with kv_cluster(config=parse_config(TENANCY, "tenancy.yaml")) as c:
        epp, holder = c["epp"], c["backends"][1]
        prompt = [(13 * i) % 4000 + 1 for i in range(32 * BS)]
        # Without the trusted header the request is refused before it reaches any engine.
        status, _, _, text = await post(c, {"model": MODEL, "prompt": prompt})
        assert status == 403 and "TenantRequired" in text
        assert all(not b.requests for b in c["backends"])
        # The engine receives the tenant's salt, whatever the client sent, with a correct length.
        a = {"x-tenant-id": "tenant-a"}
        await served_by(c, {"model": MODEL, "prompt": prompt, "cache_salt": "client-chosen"}, a)
        [got] = [r for b in c["backends"] for r in b.requests]
        assert got.json["cache_salt"] == salt_a
        assert got.json["prompt"] == prompt
        assert_framed(got)
        # pod-1 holds the prompt for tenant A (vLLM carries the salt in the first block's extra keys).
        await publish(c["pubs"][1], prompt, 500, salt=salt_a)
        await eventually(lambda: epp.kv_index.pod_counts(holder.address).get("gpu") == 32, "indexed")
        keys_a = block_keys(prompt, BS, root_key(MODEL, salt_a))
        assert epp.kv_index.lookup(keys_a, [holder.address])[holder.address]["gpu"] == 32
        assert [await served_by(c, {"model": MODEL, "prompt": prompt}, a) for _ in range(3)] == ["pod-1"] * 3
        # Tenant B sends the same prompt, even claiming A's salt: no affinity, and B's salt on the wire.
        b = {"x-tenant-id": "tenant-b"}
        for body in (
            {"model": MODEL, "prompt": prompt},
            {"model": MODEL, "prompt": prompt, "cache_salt": salt_a},
        ):
            pod = await served_by(c, body, b)
            d = await last_decision(c)
            assert all(x["cached_tokens"] == 0 for x in d["candidates"])
            assert c["backends"][int(pod[-1])].requests[-1].json["cache_salt"] == salt_b


def assert_framed(got: RecordedRequest) -> None:
    """The engine got a body whose framing matches it: a corrected content-length, or chunked."""
    if "content-length" in got.headers:
        assert int(got.headers["content-length"]) == got.body_len
    else:
        assert got.headers.get("transfer-encoding") == "chunked"


async def test_the_salt_is_injected_in_buffered_mode_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPP_TEST_TENANT_SECRET", SECRET)
    salt = TenantSalter("x-tenant-id", SECRET.encode()).salt("tenant-a")
    envoy = EnvoyConfig(request_body_mode="BUFFERED")
    async with kv_cluster(config=parse_config(TENANCY, "tenancy.yaml"), envoy=envoy) as c:
        body = {"model": MODEL, "prompt": [5, 6, 7], "cache_salt": "client-chosen"}
        assert await served_by(c, body, {"x-tenant-id": "tenant-a"})
        [got] = [r for b in c["backends"] for r in b.requests]
        assert got.json["cache_salt"] == salt and got.json["prompt"] == [5, 6, 7]
        assert_framed(got)


EXPLAIN = HEAD + PROFILE + "explain: {keep: 3, responseHeader: true}\n"


async def test_decisions_are_explained_in_a_header_and_at_debug_decisions() -> None:
    async with kv_cluster(config=parse_config(EXPLAIN, "explain.yaml")) as c:
        epp = c["epp"]
        for i in range(4):
            status, pod, headers, _ = await post(
                c, {"model": MODEL, "prompt": [1, 2, 3, i]}, {"x-request-id": f"req-{i}"}
            )
            assert status == 200
            explained = dict(p.split("=", 1) for p in headers["x-epp-decision"].split("; "))
            assert c["backends"][int(str(pod)[-1])].address == explained["endpoint"]
            assert float(explained["ttft"]) > 0 and explained["mode"] == "cache-aware"
        base = f"http://127.0.0.1:{epp.metrics_port}/debug/decisions"
        async with c["session"].get(f"{base}?limit=2") as r:
            doc = json.loads(await r.text())
        assert doc["kept"] == 3 and doc["capacity"] == 3
        assert [d["request_id"] for d in doc["decisions"]] == ["req-3", "req-2"]
        terms = doc["decisions"][0]["candidates"][0]
        assert {"endpoint", "score", "ttft_s", "queue_s", "prefill_s", "reload_s", "decode_s"} <= set(terms)
        for bad in ("0", "abc", "-1"):
            async with c["session"].get(f"{base}?limit={bad}") as r:
                assert r.status == 400
                assert "limit must be an integer" in (await r.json())["error"]
