"""End to end: an EndpointPickerConfig whose scheduling profile scores with `precise-prefix-cache-scorer`,
in a live EPP fed by real ZeroMQ KV-event publishers, behind a real Envoy."""

from __future__ import annotations

import json
from typing import Any

from epp.config import EppConfig, parse_config
from epp.testing.wait import eventually

from .stack import BS, MODEL, kv_cluster
from .test_kv_routing import post, publish_prompt

PLUGIN = "precise"


def precise_config(parameters: str = "{}") -> EppConfig:
    return parse_config(
        f"""\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  name: {PLUGIN}
  parameters: {parameters}
- type: max-score-picker
schedulingProfiles:
- name: precise-profile
  plugins:
  - pluginRef: {PLUGIN}
  - pluginRef: max-score-picker
""",
        "<precise e2e config>",
    )


async def admin(c: dict[str, Any], path: str) -> dict[str, Any]:
    async with c["session"].get(f"http://127.0.0.1:{c['epp'].metrics_port}{path}") as r:
        assert r.status == 200, await r.text()
        return dict(json.loads(await r.text()))


async def last_decision(c: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """The newest scheduling decision, and each candidate's score in it."""
    d = (await admin(c, "/debug/decisions?limit=1"))["decisions"][0]
    return d, {cand["endpoint"]: cand["score"] for cand in d["candidates"]}


def completion(prompt: list[int]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt}


async def test_precise_scorer_routes_a_held_prompt_to_its_holder_and_nothing_else() -> None:
    async with kv_cluster(config=precise_config()) as c:
        epp, backends = c["epp"], c["backends"]
        holder = backends[1]
        prompt = [(13 * i) % 7000 for i in range(40 * BS)]
        await publish_prompt(c["pubs"][1], prompt, 100)
        await eventually(lambda: epp.kv_index.pod_counts(holder.address).get("gpu") == 40, "blocks indexed")

        served = [await post(c, "/v1/completions", completion([*prompt, 1, 2, 3])) for _ in range(6)]
        assert served == ["pod-1"] * 6
        decision, scores = await last_decision(c)
        assert decision["profile"] == "precise-profile" and decision["winner"] == holder.address
        assert decision["mode"] in ("cache-aware", "degraded")  # pods are credited (none stale)
        # The holder has every one of the prompt's 40 full blocks; the others none.
        assert scores == {b.address: (1.0 if b is holder else 0.0) for b in backends}

        # Prompts sharing nothing with the held one tie at 0 everywhere: the seeded random tie-break
        # spreads them, so they do not all go to the holder.
        others = [
            await post(c, "/v1/completions", completion([20_000 + 1000 * k + i for i in range(40 * BS)]))
            for k in range(12)
        ]
        assert set(others) != {"pod-1"}
        _, scores = await last_decision(c)
        assert scores == {b.address: 0.0 for b in backends}

        report = await admin(c, "/debug/index")
        assert report["pods"][holder.address]["blocks"] == {"gpu": 40}
        assert all(report["pods"][b.address]["blocks"] == {} for b in backends if b is not holder)
        assert report["pods"][holder.address]["freshness"] in ("fresh", "degraded")
        assert report["speculative_entries"] == {}  # speculativeTtl is off by default


async def test_precise_scorer_speculative_entries_follow_a_routed_prompt() -> None:
    """With `speculativeTtl`, a prompt no engine has reported yet counts as the pod it was routed to's,
    so the requests behind it follow; the entries are kept apart from the exact index."""
    async with kv_cluster(config=precise_config("{speculativeTtl: 60s}")) as c:
        backends = c["backends"]
        prompt = [30_000 + (17 * i) % 5000 for i in range(40 * BS)]
        first = await post(c, "/v1/completions", completion(prompt))
        _, scores = await last_decision(c)
        assert scores == {b.address: 0.0 for b in backends}  # nothing known yet: a tie
        chosen = next(b for b in backends if b.name == first)

        report = await admin(c, "/debug/index")
        assert report["speculative_entries"] == {PLUGIN: 40}  # the prompt's 40 blocks, for one pod
        assert all(report["pods"][b.address]["blocks"] == {} for b in backends)  # the exact index: none

        follow = [await post(c, "/v1/completions", completion(prompt)) for _ in range(8)]
        assert follow == [first] * 8
        decision, scores = await last_decision(c)
        assert decision["winner"] == chosen.address
        assert scores == {b.address: (1.0 if b is chosen else 0.0) for b in backends}
        report = await admin(c, "/debug/index")
        assert report["speculative_entries"] == {PLUGIN: 40}  # the same blocks, refreshed, not added
