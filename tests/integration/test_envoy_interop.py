"""Through real Envoy: the subset hint's bare IPs and malformed entries, `x-gateway-model-name-rewrite`, and
`x-request-id` reaching the model server (tests/unit/test_ext_proc_interop.py has the details)."""

from __future__ import annotations

import json

import pytest

from epp.testing.envoy import EnvoyConfig

from .stack import CHAT, ENVOY_MARKS, stack

pytestmark = ENVOY_MARKS

HINT = "x-test-subset"


def message(text: str) -> str:
    return str(json.loads(text)["error"]["message"])


async def test_a_bare_ip_hint_allows_that_ips_endpoints_and_malformed_entries_are_named() -> None:
    async with stack(2, envoy=EnvoyConfig(subset_hint_from_header=HINT)) as st:
        # every fake backend listens on 127.0.0.1: the bare IP allows them all
        status, served, _ = await st.chat(headers={HINT: "127.0.0.1"})
        assert status == 200 and served in {"pod-0", "pod-1"}
        # a malformed entry beside a good one is ignored: the good one routes
        status, served, _ = await st.chat(headers={HINT: f"localhost:80,{st.backend('pod-1').address}"})
        assert (status, served) == (200, "pod-1")
        status, _, text = await st.chat(headers={HINT: "localhost:80"})
        assert status == 503
        assert "neither ip:port nor an IP, ignored: 'localhost:80')" in message(text)
        assert (await st.chat())[0] == 200
        await st.wait_idle()


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def test_the_model_server_gets_the_rewritten_model(mode: str) -> None:
    async with stack(1, envoy=EnvoyConfig(request_body_mode=mode)) as st:  # type: ignore[arg-type]
        status, _, text = await st.chat(headers={"x-gateway-model-name-rewrite": "served-lora"})
        assert status == 200, text
        [seen] = st.backend("pod-0").served("/v1/chat/completions")
        assert seen.json == {**CHAT, "model": "served-lora"}
        # (in FULL_DUPLEX_STREAMED Envoy forwards the body chunked; where it sends a length, it is right)
        assert int(seen.headers.get("content-length", seen.body_len)) == seen.body_len
        got = await st.metric(
            "inference_objective_request_total", model_name="fake-model", target_model_name="served-lora"
        )
        assert got == 1


async def test_the_request_id_reaches_the_model_server_once() -> None:
    async with stack(1) as st:
        assert (await st.chat(headers={"x-request-id": "client-42"}))[0] == 200
        assert (await st.chat())[0] == 200
        first, second = st.backend("pod-0").served("/v1/chat/completions")
        assert first.headers["x-request-id"] == "client-42"
        # without one, Envoy generates it before ext_proc (its default), and the EPP keeps that one
        assert second.headers["x-request-id"] and "," not in second.headers["x-request-id"]
