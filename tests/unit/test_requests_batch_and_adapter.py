"""Completions given a list of prompts (a batch: each item its own engine request, never joined), and
SGLang's `<base model>:<adapter>` model syntax: what is keyed, under which root, and the 400s."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from epp.config import build_scheduler, default_config
from epp.datastore import Datastore
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.keys import block_keys, root_key
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import KvIndexService
from epp.requests import RequestError, build_request, parse_body, sglang_adapter
from epp.scheduling.builtin import default_registry
from epp.server.director import Director
from epp.server.metrics import EppMetrics
from epp.testing.fakes import FakeClock
from epp.types import InferenceRequest, MetricsSnapshot

COMPL = {":path": "/v1/completions"}
CHAT = {":path": "/v1/chat/completions"}
EMBED = {":path": "/v1/embeddings"}
BS = 4
A = list(range(100, 112))  # three full blocks
B = list(range(200, 208))


def build(
    body: dict[str, Any], headers: dict[str, str] = COMPL, served: tuple[str, ...] = ()
) -> InferenceRequest:
    raw = json.dumps(body).encode()
    return build_request(headers, parse_body(raw), {}, len(raw), served_models=served)


def service() -> KvIndexService:
    return KvIndexService(BlockIndex(BS, 1000), FreshnessTracker(), TokenizerRegistry({}), BS)


def keys(request: InferenceRequest) -> list[int]:
    found = service().prompt_keys(request)
    assert found is not None
    return [int(k) for k in found]


def test_a_token_id_batch_is_keyed_as_its_first_prompt_alone() -> None:
    batch = build({"model": "m", "prompt": [A, B]})
    single = build({"model": "m", "prompt": A})
    assert (
        batch.prompt == A and batch.prompt_tokens_estimate == len(A) + len(B) and batch.batch_tokens == len(B)
    )
    assert build({"model": "m", "prompt": A}).batch_tokens == 0  # a list of ints is one prompt
    assert keys(batch) == keys(single) == [int(k) for k in block_keys(A, BS, root_key("m"))]
    # not the joined prompt's keys (what the EPP computed before): its 4th block would span A and B
    assert len(keys(build({"model": "m", "prompt": A + B}))) == 5


@pytest.mark.parametrize(
    ("prompt", "keyed", "estimate"),
    [
        (["only one"], "only one", 2),
        ([[7, 8, 9]], [7, 8, 9], 3),
        (["", "abcdefgh"], "", 2),  # an empty first item is keyed as it is (no full block), the rest counted
        (["abcd", "efgh", "ijklmnop"], "abcd", 4),
    ],
)
def test_batches_key_their_first_item_and_count_every_item(prompt: Any, keyed: Any, estimate: int) -> None:
    r = build({"model": "m", "prompt": prompt, "max_tokens": 3, "stream": True})
    assert r.prompt == keyed and r.prompt_tokens_estimate == estimate
    first = len(keyed) if isinstance(keyed, list) else (len(keyed) + 3) // 4
    assert r.batch_tokens == estimate - first  # the items after the first
    assert r.max_tokens == 3 and r.stream  # the rest of the body is kept


def test_an_embeddings_batch_is_keyed_as_its_first_input() -> None:
    r = build({"model": "m", "input": ["first", "second input"]}, EMBED)
    assert r.prompt == "first" and r.prompt_tokens_estimate == 2 + 3 and r.batch_tokens == 3


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": []}, "'prompt' must not be an empty list"),
        ({"prompt": [[], []]}, "'prompt' has only empty prompts"),
        ({"prompt": ["", ""]}, "'prompt' has only empty prompts"),
        ({"prompt": ["a", [1]]}, "or a list of token-id lists"),
        ({"prompt": [[1], 2]}, "or a list of token-id lists"),
        ({"prompt": [1, "a"]}, "or a list of token-id lists"),
        ({"prompt": [[[1]]]}, "or a list of token-id lists"),
        ({"prompt": [[1, -1]]}, "ints in 0..2147483647"),
        ({"prompt": [[1, True]]}, "ints in 0..2147483647"),
        ({"prompt": [None]}, "or a list of token-id lists"),
    ],
)
def test_bad_prompt_lists_are_400s_and_a_good_one_still_parses(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(RequestError) as err:
        build({"model": "m", **body})
    assert err.value.status == 400 and err.value.code == "BadRequest"
    assert needle in err.value.message
    # the same body with a good prompt is accepted: only the prompt was wrong
    assert build({"model": "m", **body, "prompt": [[1, 2]]}).prompt == [1, 2]


def test_an_empty_embeddings_input_list_names_input() -> None:
    with pytest.raises(RequestError) as err:
        build({"model": "m", "input": []}, EMBED)
    assert "'input' must not be an empty list" in err.value.message


@pytest.mark.parametrize(
    ("model", "served", "adapter"),
    [
        ("base:sql", ("base",), "sql"),
        ("base : sql ", ("base",), "sql"),  # SGLang strips both parts
        ("org/base:a:b", ("org/base",), "a:b"),  # split at the first ':' only
        ("base:sql", (), None),  # no served base model known: the name is left alone
        ("gpt-oss:120b", ("gpt-oss",), "120b"),  # (SGLang's own reading too)
        ("gpt-oss:120b", ("gpt-oss", "gpt-oss:120b"), None),  # a served model named with a ':' (vLLM)
        ("other:sql", ("base",), None),  # the base part is not served here
        ("base:", ("base",), None),  # no adapter part: SGLang runs the base model
        ("base: ", ("base",), None),
        ("base", ("base",), None),
    ],
)
def test_sglang_adapter_syntax(model: str, served: tuple[str, ...], adapter: str | None) -> None:
    assert sglang_adapter(model, served) == adapter


def test_an_sglang_adapter_request_is_keyed_under_the_adapter() -> None:
    r = build({"model": "base:sql", "prompt": A, "cache_salt": "s"}, served=("base",))
    assert r.model == "sql" and r.cache_salt == "s"
    assert keys(r) == [int(k) for k in block_keys(A, BS, root_key("sql", "s"))]
    # as a vLLM request naming the adapter is
    assert keys(r) == keys(build({"model": "sql", "prompt": A, "cache_salt": "s"}))


def test_a_chat_with_the_adapter_syntax_is_an_adapter_request_too() -> None:
    r = build({"model": "base:sql", "messages": [{"role": "user", "content": "x"}]}, CHAT, ("base",))
    assert r.model == "sql" and r.messages == [{"role": "user", "content": "x"}]


def test_a_served_model_named_with_a_colon_keeps_its_name() -> None:
    r = build({"model": "gpt-oss:120b", "prompt": A}, served=("gpt-oss:120b",))
    assert r.model == "gpt-oss:120b"
    assert keys(r) == [int(k) for k in block_keys(A, BS, root_key("gpt-oss:120b"))]
    # and without served models (the default) no name is split
    assert build({"model": "base:sql", "prompt": A}).model == "base:sql"


def test_the_director_reads_sglang_adapter_names_against_the_pools_models() -> None:
    """The served models come from the endpoints (configured, or named by their metrics): `base:sql` is
    keyed as adapter `sql` once an endpoint serves `base`, and left alone otherwise."""

    def parsed_model(
        configured: str | None, by_metrics: frozenset[str], adapters: frozenset[str] = frozenset()
    ) -> str:
        clock = FakeClock()
        ds = Datastore(clock)
        ds.add_endpoint("10.0.0.1:80", configured)
        snapshot = MetricsSnapshot(observed_at=clock.now(), models=by_metrics, running_lora_adapters=adapters)
        ds.record_metrics("10.0.0.1:80", snapshot)
        sched = build_scheduler(default_config(), default_registry(), clock, random.Random(0))
        d = Director(ds, sched, EppMetrics(), clock, {})
        raw = json.dumps({"model": "base:sql", "prompt": "hello"}).encode()
        return d.parse({":path": "/v1/completions"}, raw).request.model

    assert parsed_model("base", frozenset()) == "sql"
    assert parsed_model(None, frozenset({"base"})) == "sql"
    assert parsed_model("other", frozenset({"other"})) == "base:sql"
    # a vLLM adapter whose own name is `<base>:<x>` is served under that name: not split
    assert parsed_model("base", frozenset(), frozenset({"base:sql"})) == "base:sql"
