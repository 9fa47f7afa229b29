"""The peers' policies as plugins: the reference EPP's approximate prefix index, Dynamo's KV cost, and the
SGLang router's cache-aware switch."""

from __future__ import annotations

import random

import msgspec
import pytest

from epp.config import ConfigError, build_scheduler, parse_config
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import root_key
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import SERVICE_KEY, KvIndexService
from epp.scheduling.builtin import default_registry
from epp.scheduling.plugins.approx_prefix_scorer import ApproxPrefixIndex, prompt_hashes
from epp.scheduling.scheduler import Scheduler
from epp.testing.fakes import FakeClock, chat_request, endpoint, token_request
from epp.types import PrefillWork

HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
NOW = 1000.0


def one_scorer(type_and_params: str, services: dict[str, object] | None = None, seed: int = 0) -> Scheduler:
    text = (
        HEAD
        + f"plugins:\n- {type_and_params}\n- type: max-score-picker\n"
        + ("schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: s\n  - pluginRef: max-score-picker\n")
    )
    return build_scheduler(
        parse_config(text, "p.yaml"),
        default_registry(),
        FakeClock(NOW),
        random.Random(seed),
        services=services,
    )


# -- prefix-cache-scorer (approximate, routing history) --------------------------------------------
def test_prompt_hashes_are_chained_blocks_of_64_chars_seeded_by_model_and_salt() -> None:
    a = prompt_hashes(chat_request("x" * 500), 64, 256)
    b = prompt_hashes(chat_request("x" * 500 + "tail"), 64, 256)
    messages_json = msgspec.json.encode([{"role": "user", "content": "x" * 500}])
    assert len(a) == len(messages_json) // 64
    assert b[: len(a) - 1] == a[: len(a) - 1]  # same leading blocks, same hashes
    assert prompt_hashes(chat_request("x" * 500, model="other"), 64, 256)[0] != a[0]
    assert len(prompt_hashes(chat_request("y" * 100_000), 64, 256)) == 256  # capped
    assert prompt_hashes(chat_request("short"), 64, 256) == []


def test_the_approximate_index_follows_routing_and_forgets_lru_first() -> None:
    index = ApproxPrefixIndex(capacity_per_pod=4)
    index.record("a", [1, 2, 3])
    index.record("b", [1, 2])
    assert index.matched([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    index.record("a", [9, 8])  # capacity 4: block 1 (least recently used) is forgotten for a
    assert index.matched([1, 2, 3], ["a", "b"]) == {"a": 0, "b": 2}
    assert index.matched([2, 3], ["a"]) == {"a": 2}
    index.forget("b")
    assert index.matched([1, 2], ["b"]) == {"b": 0}
    assert index.size() == 4


def test_prefix_cache_scorer_sends_a_repeated_prompt_where_it_was_routed() -> None:
    s = one_scorer("{type: prefix-cache-scorer, name: s}")
    eps = [endpoint(f"10.0.0.{i}:80") for i in range(4)]
    prompt = "You are a helpful assistant. " * 30
    first = s.schedule(chat_request(prompt + "Question one?"), eps).decision.primary
    again = [s.schedule(chat_request(prompt + f"Question {i}?"), eps).decision.primary for i in range(5)]
    assert again == [first] * 5
    # an unrelated prompt is not drawn there: ties are broken at random
    others = {s.schedule(chat_request(f"{i} " * 400), eps).decision.primary for i in range(20)}
    assert len(others) > 1


def test_a_rejected_request_is_not_recorded_as_routed() -> None:
    text = HEAD + (
        "plugins:\n- {type: prefix-cache-scorer, name: s}\n- type: ttft-scorer\n"
        "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: s\n  - pluginRef: ttft-scorer\n"
        "saturationDetector: {queueDepthThreshold: 100000}\nadmission: {ttftSlo: 0.001s}\n"
    )
    s = build_scheduler(parse_config(text), default_registry(), FakeClock(NOW), random.Random(0))
    scorer = s.profiles["p"].scorers[0].scorer
    with pytest.raises(Exception, match="SLO"):
        s.schedule(chat_request("z" * 4000, priority=-1), [endpoint("a:1", waiting=50)])
    assert scorer.index.size() == 0  # type: ignore[attr-defined]
    s.schedule(chat_request("z" * 4000), [endpoint("a:1", waiting=50)])
    assert scorer.index.size() > 0  # type: ignore[attr-defined]


# -- dynamo-kv-scorer ----------------------------------------------------------------------------
def kv() -> KvIndexService:
    fresh = FreshnessTracker()
    svc = KvIndexService(BlockIndex(16, 100_000), fresh, TokenizerRegistry({}), 16)
    for pod in ("a:1", "b:1", "c:1"):
        fresh.connected(pod, 0.0)
        fresh.message(pod, NOW)
    return svc


def test_dynamo_cost_credits_overlap_by_tier_and_charges_load() -> None:
    svc = kv()
    tokens = list(range(1, 32 * 16 + 1))  # 32 blocks
    root = root_key("m", None)
    svc.index.store("a:1", list(range(32)), None, tokens, 16, "gpu", root)  # all on GPU
    svc.index.store("b:1", list(range(32)), None, tokens, 16, "cpu", root)  # all on CPU (host)
    s = one_scorer("{type: dynamo-kv-scorer, name: s}", {SERVICE_KEY: svc})
    scorer = s.profiles["p"].scorers[0].scorer
    from epp.scheduling.framework import CycleState

    eps = [endpoint("a:1"), endpoint("b:1"), endpoint("c:1")]
    costs = scorer.costs(CycleState(NOW, random.Random(0)), token_request(tokens), eps)  # type: ignore[attr-defined]
    # prompt 32 blocks; credit a 32 x 1.0, b 32 x 0.75, c 0; no load
    assert costs.tolist() == pytest.approx([0.0, 8.0, 32.0])
    assert s.schedule(token_request(tokens), eps).decision.primary == "a:1"
    # load on a: 40 uncached prefill blocks queued and 100 blocks decoding -> b is cheaper now
    busy = [endpoint("a:1", backlog=PrefillWork(2, 640, 0.0), in_flight_tokens=1600), eps[1], eps[2]]
    costs = scorer.costs(CycleState(NOW, random.Random(0)), token_request(tokens), busy)  # type: ignore[attr-defined]
    assert costs.tolist() == pytest.approx([40.0 + 100.0, 8.0, 32.0])
    assert s.schedule(token_request(tokens), busy).decision.primary == "b:1"


def test_dynamo_needs_the_kv_index_and_valid_weights() -> None:
    with pytest.raises(ConfigError, match="needs the KV index"):
        one_scorer("{type: dynamo-kv-scorer, name: s}")
    with pytest.raises(ConfigError, match="hostWeight"):
        one_scorer("{type: dynamo-kv-scorer, name: s, parameters: {hostWeight: -1}}", {SERVICE_KEY: kv()})


# -- sglang-cache-aware-scorer -------------------------------------------------------------------
def test_sglang_follows_the_cache_when_balanced_and_load_when_not() -> None:
    s = one_scorer("{type: sglang-cache-aware-scorer, name: s, parameters: {balanceAbsThreshold: 4}}")
    eps = [endpoint("a:1"), endpoint("b:1"), endpoint("c:1")]
    prompt = "shared system prompt " * 40
    first = s.schedule(chat_request(prompt + "q1"), eps).decision.primary
    assert s.schedule(chat_request(prompt + "q2"), eps).decision.primary == first  # match > 50%
    # the holder is now far busier than the others: imbalance wins over the cache
    loaded = [endpoint(e.id, in_flight=10 if e.id == first else 0) for e in eps]
    assert s.schedule(chat_request(prompt + "q3"), loaded).decision.primary != first
    # a prompt matching little of the history goes to the least loaded
    light = [endpoint(e.id, in_flight=0 if e.id == "c:1" else 2) for e in eps]
    assert s.schedule(chat_request("something else entirely " * 40), light).decision.primary == "c:1"


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ("{balanceRelThreshold: 0.5}", "balanceRelThreshold"),
        ("{cacheThreshold: 2}", "cacheThreshold"),
        ("{blockSizeChars: 0}", "blockSizeChars"),
        ("{balanceAbsThreshold: -1}", "balanceAbsThreshold"),
    ],
)
def test_sglang_rejects_bad_parameters(params: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        one_scorer(f"{{type: sglang-cache-aware-scorer, name: s, parameters: {params}}}")


def test_a_profile_without_ttft_estimates_still_puts_its_prompts_in_the_prefill_backlog() -> None:
    """Dynamo's cost reads the prefill load: the accounting must count it for its picks too."""
    from epp import accounting
    from epp.costmodel.service import CostModel
    from epp.datastore import Datastore

    clock = FakeClock(NOW)
    ds = Datastore(clock)
    ds.add_endpoint("a:1")
    s = one_scorer("{type: dynamo-kv-scorer, name: s}", {SERVICE_KEY: kv()})
    request = token_request(list(range(640)))
    decision = s.schedule(request, ds.candidates()).decision
    assert not decision.estimates  # no TTFT estimate in this profile
    cost = CostModel()
    ticket = accounting.begin(ds, request, decision, NOW, True, cost)
    view = ds.candidates()[0]
    assert view.prefill_backlog.tokens == 640 and view.prefill_backlog.requests == 1
    # and Dynamo's cost sees it: 640 / 16 = 40 active prefill blocks on a:1
    scorer = s.profiles["p"].scorers[0].scorer
    from epp.scheduling.framework import CycleState

    costs = scorer.costs(CycleState(NOW, random.Random(0)), token_request(list(range(16))), [view])  # type: ignore[attr-defined]
    assert costs.tolist() == pytest.approx(
        [40.0 + 1.0 + 40.0]
    )  # prefill 40 + prompt 1 block; decode 40 blocks
    ds.first_token(ticket)
    assert ds.candidates()[0].prefill_backlog.tokens == 0
