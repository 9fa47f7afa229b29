"""Hostile request bodies, into the parser (`epp/requests.py`) and through the director
(`epp/server/director.py`, with a real tokenizer and chat template behind the TTFT scorer).

Whatever the body, the outcome is an `InferenceRequest` (routed, then released) or a `RequestError`
with a 4xx status and a message naming what is wrong; never any other exception, and nothing stays
in flight.
"""

from __future__ import annotations

import copy
import json
import pathlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from epp.config import build_scheduler, default_config
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.datastore import Datastore
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import MAX_UNKEYED_MODELS, SERVICE_KEY, KvIndexService
from epp.requests import RequestError, build_request, parse_body
from epp.scheduling.builtin import default_registry
from epp.server.director import MAX_MODEL_LABELS, OTHER_MODEL, Director
from epp.server.metrics import EppMetrics
from epp.tenancy import TenantSalter
from epp.testing.fakes import FakeClock
from epp.testing.tokenizer import build_tiny_tokenizer
from epp.types import InferenceRequest, MetricsSnapshot

from .strategies import LITERALS, big_ints, dumps, json_scalars, json_values, nested

CHAT = {":path": "/v1/chat/completions"}
COMPL = {":path": "/v1/completions"}
EMBED = {":path": "/v1/embeddings"}
PATHS = st.sampled_from([CHAT, COMPL, EMBED, {":path": "/v1/responses"}, {":path": "/other"}, {}])
CHAT_BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
COMPL_BODY: dict[str, Any] = {"model": "m", "prompt": "hello there"}
FAST = settings(max_examples=150, deadline=None)


def outcome(headers: dict[str, str], raw: bytes) -> InferenceRequest | RequestError:
    """The parser's answer; a RequestError must be a 4xx with a message."""
    try:
        return build_request(headers, parse_body(raw), {}, len(raw))
    except RequestError as err:
        assert 400 <= err.status < 500 and err.code and err.message
        return err


# -- the parser ---------------------------------------------------------------------------------


@FAST
@given(PATHS, json_values)
def test_any_json_document_is_a_request_or_a_400(headers: dict[str, str], value: Any) -> None:
    result = outcome(headers, dumps(value))
    if not isinstance(value, dict):
        assert isinstance(result, RequestError)
    elif not isinstance(value.get("model"), str) or not value["model"]:
        assert isinstance(result, RequestError)
        # The model is named, unless the document did not even decode (lone surrogates, ints past 64 bits).
        assert "'model'" in result.message or "not valid JSON" in result.message


@FAST
@given(PATHS, st.binary(max_size=300))
def test_arbitrary_bytes_are_a_request_or_a_400(headers: dict[str, str], raw: bytes) -> None:
    outcome(headers, raw)


@FAST
@given(
    st.sampled_from([(CHAT, CHAT_BODY), (COMPL, COMPL_BODY)]),
    st.sampled_from(LITERALS),
    st.integers(min_value=0, max_value=10_000),
)
def test_bad_literals_spliced_into_a_valid_body_are_a_request_or_a_400(
    case: tuple[dict[str, str], dict[str, Any]], literal: bytes, at: int
) -> None:
    headers, body = case
    raw = json.dumps(body).encode()
    at %= len(raw) + 1
    outcome(headers, raw[:at] + literal + raw[at:])


@pytest.mark.parametrize("depth", [1_000, 100_000])
@pytest.mark.parametrize(
    "where",
    [
        lambda inner: inner,
        lambda inner: b'{"model": ' + inner + b', "prompt": "x"}',
        lambda inner: b'{"model": "m", "prompt": ' + inner + b"}",
        lambda inner: b'{"model": "m", "messages": [{"role": "user", "content": ' + inner + b"}]}",
        lambda inner: b'{"model": "m", "prompt": "x", "tools": ' + inner + b"}",
    ],
    ids=["top", "model", "prompt", "content", "tools"],
)
@pytest.mark.parametrize("brackets", [(b"[", b"]"), (b'{"a":', b"}")], ids=["arrays", "objects"])
def test_deep_nesting_is_a_400_not_a_recursion_error(
    depth: int, where: Callable[[bytes], bytes], brackets: tuple[bytes, bytes]
) -> None:
    raw = where(nested(depth, b"1", *brackets))
    err = outcome(COMPL, raw)
    assert isinstance(err, RequestError) and err.status == 400
    assert "nested too deeply" in err.message


def test_shallow_nesting_in_an_ignored_field_is_accepted() -> None:
    raw = b'{"model": "m", "prompt": "x", "tools": ' + nested(100) + b"}"
    assert isinstance(outcome(COMPL, raw), InferenceRequest)


@pytest.mark.parametrize(
    "literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"1" * 5000, b"-" + b"9" * 30]
)
@pytest.mark.parametrize("field", ["model", "prompt", "max_tokens", "stream", "cache_salt"])
def test_huge_and_non_finite_numbers_are_400s(literal: bytes, field: str) -> None:
    raw = json.dumps(COMPL_BODY | {field: "@"}).encode().replace(b'"@"', literal)
    err = outcome(COMPL, raw)
    assert isinstance(err, RequestError) and err.status == 400
    assert "not valid JSON" in err.message or f"'{field}'" in err.message


def test_invalid_utf8_is_a_400_naming_the_encoding() -> None:
    raw = json.dumps(COMPL_BODY).encode().replace(b"hello", b"hel\xfflo")
    err = outcome(COMPL, raw)
    assert isinstance(err, RequestError) and "UTF-8" in err.message


# -- every field with a wrong type ---------------------------------------------------------------


def _token(v: Any) -> bool:
    return type(v) is int and 0 <= v < 2**31


def _lax_bool(v: Any) -> bool | None:
    """What vLLM's pydantic models read a plain `bool` field's value as (lax mode), None: a 400. Written
    out here rather than imported: 1.0 and 0.0 count, 2 and 0.5 do not, nor does null."""
    if isinstance(v, bool):
        return v
    if type(v) in (int, float) and v in (0, 1):
        return v == 1
    if isinstance(v, str):
        return {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False, "y": True,
                "n": False, "t": True, "f": False, "on": True, "off": False}.get(v.lower())  # fmt: skip
    return None


def _prompt_ok(v: Any) -> bool:
    if isinstance(v, str):
        return True
    if not isinstance(v, list) or not v:
        return False
    # a list of strings or of token lists is a batch: one item at least must be non-empty (SGLang's
    # "Prompt cannot be empty"; see epp/requests.py)
    return all(map(_token, v)) or (
        any(p for p in v)
        and (
            all(isinstance(p, str) for p in v) or all(isinstance(p, list) and all(map(_token, p)) for p in v)
        )
    )


def _message_ok(m: Any) -> bool:
    return (
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and (m.get("content") is None or isinstance(m["content"], str | list))
    )


# (base, path to the field, is the value valid?, what the error must name)
FIELDS: dict[str, tuple[dict[str, Any], dict[str, Any], tuple[Any, ...], Callable[[Any], bool], str]] = {
    "model": (COMPL, COMPL_BODY, ("model",), lambda v: isinstance(v, str) and v != "", "'model'"),
    # (vLLM's CompletionRequest refuses an empty prompt: "Either prompt or prompt_embeds must be provided")
    "prompt": (COMPL, COMPL_BODY, ("prompt",), lambda v: _prompt_ok(v) and v != "", "'prompt'"),
    "input": (
        EMBED,
        {"model": "m", "input": "x"},
        ("input",),
        lambda v: (
            _prompt_ok(v)
            or (
                isinstance(v, list)
                and bool(v)
                and all(isinstance(m, dict) for m in v)
                and all(map(_message_ok, v))
            )
        ),
        "'input",
    ),
    "messages": (
        CHAT,
        CHAT_BODY,
        ("messages",),
        lambda v: isinstance(v, list) and bool(v) and all(map(_message_ok, v)),
        "'messages",
    ),
    "message": (CHAT, CHAT_BODY, ("messages", 0), _message_ok, "'messages[0]"),
    "role": (CHAT, CHAT_BODY, ("messages", 0, "role"), lambda v: isinstance(v, str), "'messages[0]'"),
    "content": (
        CHAT,
        CHAT_BODY,
        ("messages", 0, "content"),
        lambda v: v is None or isinstance(v, str | list),
        "'messages[0].content'",
    ),
    # (`bool | None` in vLLM's models: null is not streamed)
    "stream": (COMPL, COMPL_BODY, ("stream",), lambda v: v is None or _lax_bool(v) is not None, "'stream'"),
    "cache_salt": (
        COMPL,
        COMPL_BODY,
        ("cache_salt",),
        lambda v: v is None or (isinstance(v, str) and v != ""),
        "'cache_salt'",
    ),
    "max_tokens": (
        COMPL,
        COMPL_BODY,
        ("max_tokens",),
        lambda v: v is None or (type(v) is int and v >= 0),
        "'max_tokens'",
    ),
    "max_completion_tokens": (
        COMPL,
        COMPL_BODY,
        ("max_completion_tokens",),
        lambda v: v is None or (type(v) is int and v >= 0),
        "'max_completion_tokens'",
    ),
    # Fields the EPP passes on without reading: any value is fine.
    "tools": (CHAT, CHAT_BODY, ("tools",), lambda v: _objects(v), "'tools'"),
    "documents": (CHAT, CHAT_BODY, ("documents",), lambda v: _objects(v), "'documents'"),
    "chat_template_kwargs": (
        CHAT,
        CHAT_BODY,
        ("chat_template_kwargs",),
        lambda v: v is None or isinstance(v, dict),
        "'chat_template_kwargs'",
    ),
    # a chat that brings its own template is routed unkeyed; one that is not a string, a 400 (as vLLM's)
    "chat_template": (
        CHAT,
        CHAT_BODY,
        ("chat_template",),
        lambda v: v is None or isinstance(v, str),
        "'chat_template'",
    ),
    "add_generation_prompt": (
        CHAT,
        CHAT_BODY,
        ("add_generation_prompt",),
        lambda v: _lax_bool(v) is not None,
        "'add_generation_prompt'",
    ),
    # (true as well: with add_generation_prompt's default, true, the pair is refused, naming both)
    "continue_final_message": (
        CHAT,
        CHAT_BODY,
        ("continue_final_message",),
        lambda v: _lax_bool(v) is False,
        "'continue_final_message'",
    ),
    "content_part": (CHAT, CHAT_BODY, ("messages", 0, "content"), lambda v: True, ""),
    "temperature": (COMPL, COMPL_BODY, ("temperature",), lambda v: True, ""),
}


def _objects(v: Any) -> bool:
    """None, or a list of objects: what `tools` and `documents` may be."""
    return v is None or (isinstance(v, list) and all(isinstance(x, dict) for x in v))


# A mix of plausible shapes and arbitrary JSON for the mutated field.
field_values = st.one_of(
    json_values,
    json_scalars,
    st.lists(big_ints, min_size=1, max_size=5),
    st.lists(st.lists(big_ints, max_size=3), min_size=1, max_size=3),
    st.lists(st.text(max_size=5), min_size=1, max_size=3),
    st.lists(st.fixed_dictionaries({"role": json_scalars, "content": json_values}), min_size=1, max_size=3),
)


def _set(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    target: Any = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


@settings(max_examples=40, deadline=None)
@given(field_values, st.data())
@pytest.mark.parametrize("field", sorted(FIELDS))
def test_every_field_with_a_wrong_type_is_a_400_naming_it(
    field: str, value: Any, data: st.DataObject
) -> None:
    headers, base, path, valid, name = FIELDS[field]
    if field == "content_part":  # a list of arbitrary parts
        value = data.draw(st.lists(json_values, max_size=4))
    raw = dumps(_set(base, path, value))
    result = outcome(headers, raw)
    if not decodes(raw):  # JSON cannot carry it (ints past 64 bits, lone surrogates): a 400 saying so
        assert isinstance(result, RequestError) and "not valid JSON" in result.message
    elif valid(value):
        assert isinstance(result, InferenceRequest), result
    else:
        assert isinstance(result, RequestError) and result.status == 400
        assert name in result.message, (name, result.message)


def decodes(raw: bytes) -> bool:
    try:
        msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return False
    return True


# -- the director: scheduling with a real tokenizer and chat template -----------------------------

roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), json_scalars)
parts = st.one_of(
    st.fixed_dictionaries(
        {"type": st.one_of(st.sampled_from(["text", "input_text", "thinking", "image_url"]), json_scalars)},
        optional={"text": st.one_of(st.text(max_size=40), json_values), "thinking": json_values},
    ),
    st.text(max_size=20),
    json_values,
)
contents = st.one_of(st.text(max_size=200), st.lists(parts, max_size=4), st.none(), json_values)
calls = st.lists(
    st.fixed_dictionaries(
        {
            "function": st.fixed_dictionaries(
                {"name": json_scalars, "arguments": st.one_of(st.text(max_size=20), json_values)}
            )
        }
    ),
    max_size=2,
)
messages = st.fixed_dictionaries(
    {"role": roles},
    optional={
        "content": contents,
        "tool_calls": st.one_of(calls, json_values),
        "name": json_scalars,
        "reasoning": json_scalars,
        "tool_call_id": json_scalars,
    },
)
prompts = st.one_of(
    st.text(max_size=300),
    st.lists(st.integers(0, 60_000), min_size=1, max_size=80),
    st.lists(big_ints, min_size=1, max_size=20),
    st.lists(st.text(max_size=10), min_size=1, max_size=4),
    st.lists(st.lists(st.integers(0, 5000), max_size=20), min_size=1, max_size=3),
    json_values,
)
bodies = st.fixed_dictionaries(
    {"model": st.one_of(st.just("m"), st.just("other-model"), json_scalars)},
    optional={
        "messages": st.one_of(st.lists(messages, max_size=4), json_values),
        "prompt": prompts,
        "input": st.one_of(prompts, st.lists(messages, max_size=2)),
        "stream": st.one_of(st.booleans(), json_scalars),
        "max_tokens": st.one_of(st.integers(0, 10_000), big_ints, json_scalars),
        "cache_salt": st.one_of(st.text(max_size=10), json_scalars),
        "tools": json_values,
    },
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


KV_OF: dict[int, KvIndexService] = {}  # id(director) -> its KV index service


def make_director(tokenizer_dir: pathlib.Path, tenancy: TenantSalter | None = None) -> Director:
    clock = FakeClock()
    ds = Datastore(clock)
    for i in range(3):
        ds.add_endpoint(f"10.0.0.{i}:80")
        ds.record_metrics(f"10.0.0.{i}:80", MetricsSnapshot(observed_at=clock.now(), waiting=i))
    kv = KvIndexService(
        BlockIndex(16, 10_000), FreshnessTracker(), TokenizerRegistry({"m": tokenizer_dir}), 16
    )
    cost = CostModel()
    services = {SERVICE_KEY: kv, COST_KEY: cost}
    sched = build_scheduler(default_config(), default_registry(), clock, random.Random(0), services=services)
    director = Director(ds, sched, EppMetrics(), clock, cost=cost, tenancy=tenancy)
    KV_OF[id(director)] = kv
    return director


@pytest.fixture(scope="module")
def directors(tokenizer_dir: pathlib.Path) -> Iterator[dict[str, Director]]:
    yield {
        "plain": make_director(tokenizer_dir),
        "tenancy": make_director(tokenizer_dir, TenantSalter("x-tenant-id", b"0123456789abcdef0123")),
    }


def route(d: Director, headers: dict[str, str], raw: bytes) -> InferenceRequest | RequestError:
    """The parsed request (as scheduled: a routed request keeps no prompt), or the 4xx it got."""
    try:
        parsed = d.parse(headers, raw)
        routed = d.route_parsed(parsed)
    except RequestError as err:
        assert 400 <= err.status < 500 and err.message
        assert d.datastore.total_in_flight() == 0
        return err
    assert routed.decision.primary in d.datastore.ids()
    if d.tenancy is not None:  # the forwarded body carries the tenant's salt, whatever the client sent
        assert routed.body is not None
        assert msgspec.json.decode(routed.body)["cache_salt"] == d.tenancy.salt("acme")
    d.finish(routed, "complete")
    assert d.datastore.total_in_flight() == 0
    return parsed.request


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PATHS, bodies)
@pytest.mark.parametrize("variant", ["plain", "tenancy"])
def test_the_director_routes_or_rejects_any_body_with_a_4xx(
    directors: dict[str, Director], variant: str, headers: dict[str, str], body: dict[str, Any]
) -> None:
    d = directors[variant]
    headers = {**headers, "x-tenant-id": "acme"}
    result = route(d, headers, dumps(body))
    if d.tenancy is not None:  # the tenant's salt replaces the client's before validation
        body = body | {"cache_salt": d.tenancy.salt("acme")}
    parsed = outcome(headers, dumps(body))
    # The director accepts exactly what the parser accepts: the scheduler and the tokenizer never fail.
    assert isinstance(result, RequestError) == isinstance(parsed, RequestError), (result, parsed)


# Chats that pass validation (string roles, content a string, a list or null) and so reach the chat
# template, with arbitrary values inside the parts.
text_parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "input_text", "thinking", "tool_reference"])},
    # keys no part type declares reach an "openai" template as they are (vLLM's `_collect_extra_fields`)
    optional={
        "text": json_scalars,
        "thinking": json_scalars,
        "name": json_scalars,
        "cache_control": json_values,
    },
)
valid_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
    optional={
        "content": st.one_of(
            st.text(max_size=50), st.lists(st.one_of(text_parts, parts), max_size=3), st.none()
        ),
        "tool_calls": st.one_of(calls, json_values),
        "name": json_scalars,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(valid_messages, min_size=1, max_size=5))
# Found by this test: a developer message merged into the system prompt with a non-string text part.
@example([{"role": "system"}, {"role": "developer", "content": [{"type": "text", "text": False}]}])
def test_any_valid_chat_is_routed_whatever_its_parts_hold(
    directors: dict[str, Director], chat: list[dict[str, Any]]
) -> None:
    d = directors["plain"]
    kv = KV_OF[id(d)]
    before = sum(kv.unkeyed.values())
    result = route(d, CHAT, dumps({"model": "m", "messages": chat}))
    assert isinstance(result, InferenceRequest), result
    # A chat the template cannot render is counted (unkeyed, tokenizer_error), and routed load-only.
    unkeyed = sum(kv.unkeyed.values()) - before
    assert unkeyed == (1 if kv.prompt_tokens(result) is None else 0)


# Keys with a meaning to vLLM or transformers (the call's parameters, names it passes itself, a template of
# the request's own) and others, with any JSON value.
template_kwargs = st.dictionaries(
    st.one_of(
        st.sampled_from(
            [
                "tools", "documents", "chat_template", "tokenize", "padding", "truncation", "max_length",
                "return_assistant_tokens_mask", "messages", "conversation", "self", "enable_thinking",
                "add_generation_prompt", "bos_token",
            ]
        ),
        st.text(max_size=8),
    ),
    json_values,
    max_size=4,
)  # fmt: skip


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(template_kwargs, st.one_of(st.none(), st.lists(st.dictionaries(st.text(max_size=4), json_values))))
def test_any_chat_template_kwargs_are_routed_keyed_or_counted(
    directors: dict[str, Director], kwargs: dict[str, Any], documents: Any
) -> None:
    """Whatever the client's kwargs hold, the chat is routed: keyed, or counted as unkeyed (a template of its
    own, kwargs vLLM fails on, a template that cannot render them)."""
    d = directors["plain"]
    kv = KV_OF[id(d)]
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body |= {"chat_template_kwargs": kwargs} | ({} if documents is None else {"documents": documents})
    before = sum(kv.unkeyed.values())
    result = route(d, CHAT, dumps(body))
    assert isinstance(result, InferenceRequest), result
    unkeyed = sum(kv.unkeyed.values()) - before
    assert unkeyed == (1 if kv.prompt_tokens(result) is None else 0)


@pytest.mark.parametrize("variant", ["plain", "tenancy"])
def test_the_director_rejects_deep_nesting_and_keeps_serving(
    directors: dict[str, Director], variant: str
) -> None:
    d = directors[variant]
    headers = {**CHAT, "x-tenant-id": "acme"}
    deep = b'{"model": "m", "messages": ' + nested(100_000) + b"}"
    err = route(d, headers, deep)
    assert isinstance(err, RequestError) and "nested too deeply" in err.message
    ok = route(d, headers, json.dumps(CHAT_BODY).encode())
    assert isinstance(ok, InferenceRequest) and ok.prompt_tokens_estimate > 0


def test_token_ids_past_int32_are_a_400_not_a_500(directors: dict[str, Director]) -> None:
    d = directors["plain"]
    for ids in ([2**63] * 40, [-1] * 40, [[2**40] * 20]):
        err = route(d, COMPL, json.dumps({"model": "m", "prompt": ids}).encode())
        assert isinstance(err, RequestError) and "'prompt'" in err.message and "2147483647" in err.message
    assert isinstance(
        route(d, COMPL, json.dumps({"model": "m", "prompt": [2**31 - 1] * 40}).encode()), InferenceRequest
    )


def test_model_names_cannot_grow_the_metrics_without_bound(tokenizer_dir: pathlib.Path) -> None:
    d = make_director(tokenizer_dir)
    kv = KV_OF[id(d)]
    n = MAX_MODEL_LABELS + 300
    for i in range(n):  # every request names another model; some names are 100 KB long
        name = f"model-{i}" if i % 50 else "x" * 100_000 + str(i)
        routed = d.route(COMPL, json.dumps({"model": name, "prompt": "hello"}).encode())
        d.finish(routed, "complete")
    registry = d.metrics.registry
    labels = {
        s.labels["model_name"]
        for family in registry.collect()
        for s in family.samples
        if s.name == "inference_objective_request_total"
    }
    assert len(labels) == MAX_MODEL_LABELS + 1 and OTHER_MODEL in labels
    assert max(map(len, labels)) <= 256
    assert (
        sum(
            registry.get_sample_value(
                "inference_objective_request_total", {"model_name": m, "target_model_name": m}
            )
            or 0
            for m in labels
        )
        == n
    )
    assert registry.get_sample_value("inference_objective_running_requests", {"model_name": OTHER_MODEL}) == 0
    assert len({m for m, _ in kv.unkeyed}) <= MAX_UNKEYED_MODELS + 1 and sum(kv.unkeyed.values()) == n
    assert d.datastore.total_in_flight() == 0
