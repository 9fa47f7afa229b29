"""The EPP behind the real Envoy: requests land where the EPP says, in every body mode."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import replace

import pytest

from epp.config import parse_config
from epp.server.app import ServerSettings
from epp.testing.envoy import EnvoyConfig
from tests.support.configs import FALLBACKS

from .stack import CHAT, eventually, stack

MODES = ["FULL_DUPLEX_STREAMED", "BUFFERED"]


@pytest.mark.parametrize("mode", MODES)
async def test_requests_follow_the_epps_load_aware_choice(mode: str) -> None:
    async with stack(3, envoy=EnvoyConfig(request_body_mode=mode)) as st:  # type: ignore[arg-type]
        st.backend("pod-0").waiting = 20
        st.backend("pod-1").waiting = 20
        st.backend("pod-2").waiting = 0
        await eventually(
            lambda: all(
                r.metrics is not None
                and r.metrics.waiting == (0 if r.id == st.backend("pod-2").address else 20)
                for r in st.epp.datastore.records()
            ),
            "new queue lengths scraped",
        )
        served = Counter()
        for _ in range(6):
            status, by, _ = await st.chat()
            assert status == 200
            served[by] += 1
        assert served == {"pod-2": 6}
        # Flip the load: traffic follows the new scrape.
        st.backend("pod-2").waiting = 30
        st.backend("pod-0").waiting = 0
        await eventually(
            lambda: (
                st.epp.datastore.get(st.backend("pod-2").address).metrics.waiting == 30  # type: ignore[union-attr]
                and st.epp.datastore.get(st.backend("pod-0").address).metrics.waiting == 0
            ),  # type: ignore[union-attr]
            "flipped queue lengths scraped",
        )
        status, by, _ = await st.chat()
        assert (status, by) == (200, "pod-0")
        # The served backend is the one the EPP counted as its pick.
        assert await st.metric("epp_picks_total", endpoint=st.backend("pod-2").address) == 6
        assert await st.metric("epp_picks_total", endpoint=st.backend("pod-0").address) == 1


@pytest.mark.parametrize("mode", MODES)
async def test_body_reaches_the_backend_intact(mode: str) -> None:
    async with stack(2, envoy=EnvoyConfig(request_body_mode=mode)) as st:  # type: ignore[arg-type]
        body = {**CHAT, "messages": [{"role": "user", "content": "é" * 100_000 + "end"}]}
        raw = json.dumps(body).encode()
        status, by, _ = await st.chat(data=raw, headers={"content-type": "application/json"})
        assert status == 200
        got = st.backend(by or "").requests[-1]
        assert got.body_len == len(raw)
        assert got.body_sha256 == hashlib.sha256(raw).hexdigest()


async def test_a_5mb_body_in_duplex_mode() -> None:
    async with stack(2) as st:
        raw = json.dumps(
            {**CHAT, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
        ).encode()
        status, by, _ = await st.chat(data=raw, headers={"content-type": "application/json"})
        assert status == 200
        got = st.backend(by or "").requests[-1]
        assert got.body_sha256 == hashlib.sha256(raw).hexdigest()
        await st.wait_idle()


async def test_buffered_mode_body_over_envoys_buffer_gets_413_from_envoy() -> None:
    async with stack(1, envoy=EnvoyConfig(request_body_mode="BUFFERED")) as st:
        raw = json.dumps(
            {**CHAT, "messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}]}
        ).encode()
        status, by, _ = await st.chat(data=raw, headers={"content-type": "application/json"})
        assert (status, by) == (413, None)
        assert (await st.chat())[0] == 200


async def test_streamed_sse_response_arrives_whole_and_usage_is_recorded() -> None:
    async with stack(1, backend_kwargs={"num_chunks": 6}) as st:
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        status, _by, text = await st.chat(body)
        assert status == 200
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] > 0
        await st.wait_idle()
        ep = st.backends[0].address
        assert (
            await st.metric("epp_usage_tokens_total", endpoint=ep, kind="completion")
            == usage["completion_tokens"]
        )
        assert await st.metric("epp_usage_tokens_total", endpoint=ep, kind="prompt") == usage["prompt_tokens"]
        assert await st.metric("epp_time_to_first_byte_seconds_count", endpoint=ep) == 1


async def test_tls_between_envoy_and_the_epp() -> None:
    async with stack(2, settings=ServerSettings(secure_serving=True)) as st:
        assert st.envoy.cfg.epp_tls and st.epp.certificate_pem
        status, by, _ = await st.chat()
        assert status == 200 and by in {"pod-0", "pod-1"}


async def test_header_only_request_is_picked_at_once() -> None:
    async with stack(2) as st:
        async with st.session.get(f"{st.url}/v1/models") as r:
            assert r.status == 200
            assert r.headers.get("x-served-by") in {"pod-0", "pod-1"}
        await st.wait_idle()


async def test_fallback_endpoints_are_listed_in_order_after_the_primary() -> None:
    cfg = parse_config(FALLBACKS, "fallbacks.yaml")
    # ORIGINAL_DST takes one address; Envoy's override_host policy takes the EPP's ordered list.
    async with stack(3, config=cfg, override_host=True, envoy=EnvoyConfig(retries=2)) as st:
        st.backend("pod-0").waiting = 9
        st.backend("pod-1").waiting = 0
        st.backend("pod-2").waiting = 4
        await eventually(
            lambda: (
                st.epp.datastore.get(st.backend("pod-0").address).metrics.waiting == 9  # type: ignore[union-attr]
                and st.epp.datastore.get(st.backend("pod-2").address).metrics.waiting == 4
            ),  # type: ignore[union-attr]
            "queues scraped",
        )
        status, by, _ = await st.chat()
        assert (status, by) == (200, "pod-1")
        header = st.backend("pod-1").requests[-1].headers["x-gateway-destination-endpoint"]
        assert [st.by_address(a).name for a in header.split(",")] == ["pod-1", "pod-2", "pod-0"]
        # The primary goes away: Envoy falls back to the next endpoint the EPP listed.
        await st.backend("pod-1").stop()
        status, by, _ = await st.chat()
        assert (status, by) == (200, "pod-2")


async def test_debug_and_health_endpoints() -> None:
    async with stack(2) as st:
        assert await st.admin("/healthz") == (200, "ok\n")
        assert (await st.admin("/readyz"))[0] == 200
        status, text = await st.admin("/debug/endpoints")
        doc = json.loads(text)
        assert status == 200
        assert sorted(e["address"] for e in doc["endpoints"]) == sorted(b.address for b in st.backends)
        assert all(e["healthy"] and e["metrics"]["models"] == ["fake-model"] for e in doc["endpoints"])
        _, metrics = await st.admin("/metrics")
        for name in (
            "inference_pool_ready_pods",
            "inference_extension_scheduler_e2e_duration_seconds",
            "epp_endpoint_in_flight_requests",
            "epp_endpoint_metrics_age_seconds",
        ):
            assert name in metrics
        assert await st.metric("inference_pool_ready_pods", name="default") == 2


async def test_debug_endpoints_can_be_switched_off() -> None:
    async with stack(1, settings=replace(ServerSettings(), debug_endpoints=False)) as st:
        assert (await st.admin("/debug/endpoints"))[0] == 404
        assert (await st.admin("/metrics"))[0] == 200
