"""InferenceModelRewrite: the pure rule table (`epp.discovery.rewrites`) and the director applying it.

The reference: the Inference Extension's `apix/v1alpha2/inferencemodelrewrite_types.go` (the schema),
`pkg/epp/controller/inferencemodelrewrite_reconciler.go` (which objects apply: `spec.poolRef` name and
group), `pkg/epp/datastore` (precedence: exact over generic, then the oldest object) and
`pkg/epp/requestcontrol/director.go` (`applyWeightedModelRewrite` / `selectWeightedModel`, after the
`x-gateway-model-name-rewrite` header set the target, so a matching rule wins over the header)."""

from __future__ import annotations

import json
import pathlib
import random
from collections import Counter
from typing import Any

import pytest

from epp.discovery.rewrites import (
    EMPTY,
    ModelRewrite,
    RewriteError,
    RewriteTable,
    Rule,
    Target,
    parse_rewrite,
)
from epp.discovery.settings import GROUP_V1, GROUP_V1ALPHA2, DiscoverySettings
from epp.server.ext_proc import RequestStream

from .test_architecture import violations
from .test_ext_proc_interop import error_message, forwarded_body, sample, set_headers, with_headers
from .test_ext_proc_stream import body, director, headers

POOL = "llama"


def obj(
    name: str = "canary",
    rules: list[Any] | None = None,
    *,
    pool: str = POOL,
    group: str | None = GROUP_V1,
    created: str = "2025-01-01T00:00:00Z",
    **spec: Any,
) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": pool, "kind": "InferencePool"}
    if group is not None:
        ref["group"] = group
    if rules is None:
        rules = [exact_rule("food-review", ("food-review-v1", 90), ("food-review-v2", 10))]
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "namespace": "default", "creationTimestamp": created},
        "spec": {"poolRef": ref, "rules": rules, **spec},
    }


def exact_rule(*models_and_targets: Any) -> dict[str, Any]:
    models = [m for m in models_and_targets if isinstance(m, str)]
    targets = [t for t in models_and_targets if isinstance(t, tuple)]
    return {
        "matches": [{"model": {"type": "Exact", "value": m}} for m in models],
        "targets": [
            {"modelRewrite": t, "weight": w} if w is not None else {"modelRewrite": t} for t, w in targets
        ],
    }


def generic_rule(*targets: str) -> dict[str, Any]:
    return {"targets": [{"modelRewrite": t} for t in targets]}


def parsed(o: dict[str, Any], group: str = GROUP_V1) -> ModelRewrite:
    rw = parse_rewrite(o, POOL, group)
    assert rw is not None
    return rw


def table(*objs: dict[str, Any]) -> RewriteTable:
    return RewriteTable.build(parsed(o) for o in objs)


# -- parsing --------------------------------------------------------------------------------------


def test_an_object_is_read_into_rules_with_weighted_targets() -> None:
    rw = parsed(obj())
    assert rw.name == "canary" and rw.created.isoformat() == "2025-01-01T00:00:00+00:00"
    assert rw.rules == (
        Rule("canary", 0, ("food-review",), (Target("food-review-v1", 90), Target("food-review-v2", 10))),
    )
    assert rw.warnings == ()


def test_unknown_fields_and_the_status_are_ignored() -> None:
    o = obj(extra={"x": 1})
    o["status"] = {"conditions": [{"type": "Accepted", "status": "Unknown"}]}
    o["spec"]["rules"][0]["future"] = True
    assert parsed(o).rules[0].models == ("food-review",)


def test_which_objects_apply_to_the_pool() -> None:
    # poolRef.group defaults to the CRD's default (inference.networking.k8s.io) when absent
    assert parse_rewrite(obj(group=None), POOL, GROUP_V1) is not None
    assert parse_rewrite(obj(group=None), POOL, GROUP_V1ALPHA2) is None
    assert parse_rewrite(obj(group=GROUP_V1ALPHA2), POOL, GROUP_V1ALPHA2) is not None
    assert parse_rewrite(obj(pool="other"), POOL, GROUP_V1) is None
    # another pool's object is not validated here: it is that pool's EPP's business
    assert parse_rewrite(obj(pool="other", rules=[{"targets": []}]), POOL, GROUP_V1) is None


def test_an_empty_rules_list_is_an_object_without_rules() -> None:
    rw = parsed(obj(rules=[]))
    assert rw.rules == () and not RewriteTable.build([rw])


def _without(o: dict[str, Any], *path: Any) -> dict[str, Any]:
    cur: Any = o
    for key in path[:-1]:
        cur = cur[key]
    del cur[path[-1]]
    return o


def _with(o: dict[str, Any], value: Any, *path: Any) -> dict[str, Any]:
    cur: Any = o
    for key in path[:-1]:
        cur = cur[key]
    cur[path[-1]] = value
    return o


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (_without(obj(), "metadata", "name"), "InferenceModelRewrite: metadata.name is missing"),
        (_without(obj(), "spec"), "InferenceModelRewrite 'canary': spec is missing"),
        (_without(obj(), "spec", "poolRef"), "'canary': spec.poolRef is missing"),
        (_with(obj(), "", "spec", "poolRef", "name"), "'canary': spec.poolRef.name is missing or empty"),
        (_with(obj(), 7, "spec", "poolRef", "group"), "'canary': spec.poolRef.group must be a string"),
        (_without(obj(), "metadata", "creationTimestamp"), "'canary': metadata.creationTimestamp is missing"),
        (_with(obj(), "yesterday", "metadata", "creationTimestamp"), "not an RFC 3339 time ('yesterday')"),
        (_without(obj(), "spec", "rules"), "'canary': spec.rules is missing or not a list"),
        (obj(rules=["x"]), "'canary': spec.rules[0] must be an object"),
        (
            obj(rules=[{"matches": {}, "targets": [{"modelRewrite": "a"}]}]),
            "spec.rules[0].matches must be a list",
        ),
        (
            obj(rules=[{"matches": [{}], "targets": [{"modelRewrite": "a"}]}]),
            "spec.rules[0].matches[0].model is missing",
        ),
        (
            obj(
                rules=[
                    {
                        "matches": [{"model": {"type": "Prefix", "value": "a"}}],
                        "targets": [{"modelRewrite": "a"}],
                    }
                ]
            ),
            "spec.rules[0].matches[0].model.type must be 'Exact', got 'Prefix'",
        ),
        (
            obj(rules=[{"matches": [{"model": {"value": ""}}], "targets": [{"modelRewrite": "a"}]}]),
            "spec.rules[0].matches[0].model.value is missing or empty",
        ),
        (obj(rules=[{"matches": []}]), "'canary': spec.rules[0].targets must list at least one target"),
        (obj(rules=[{"targets": []}]), "'canary': spec.rules[0].targets must list at least one target"),
        (obj(rules=[{"targets": ["a"]}]), "spec.rules[0].targets[0] must be an object"),
        (
            obj(rules=[{"targets": [{"weight": 1}]}]),
            "spec.rules[0].targets[0].modelRewrite is missing or empty",
        ),
        (
            obj(rules=[generic_rule("a"), {"targets": [{"modelRewrite": "a", "weight": 0}]}]),
            "'canary': spec.rules[1].targets[0].weight must be an integer from 1 to 1000000, got 0",
        ),
        (
            obj(rules=[{"targets": [{"modelRewrite": "a", "weight": 1_000_001}]}]),
            "spec.rules[0].targets[0].weight must be an integer from 1 to 1000000, got 1000001",
        ),
        (obj(rules=[{"targets": [{"modelRewrite": "a", "weight": -3}]}]), "weight must be an integer"),
        (obj(rules=[{"targets": [{"modelRewrite": "a", "weight": 2.5}]}]), "got 2.5"),
        (obj(rules=[{"targets": [{"modelRewrite": "a", "weight": True}]}]), "got True"),
        (obj(rules=[{"targets": [{"modelRewrite": "a", "weight": "5"}]}]), "got '5'"),
        ([], "InferenceModelRewrite: expected an object, got list"),
    ],
)
def test_bad_objects_are_refused_naming_the_object_and_the_field(bad: Any, needle: str) -> None:
    with pytest.raises(RewriteError) as info:
        parse_rewrite(bad, POOL, GROUP_V1)
    assert needle in str(info.value)


def test_a_bad_object_costs_only_itself() -> None:
    good, newer = obj("good"), obj("newer", [generic_rule("base")], created="2025-02-01T00:00:00Z")
    bad = obj("bad", [{"targets": []}], created="2024-01-01T00:00:00Z")  # the oldest: it would win
    read = []
    for o in (bad, good, newer):
        try:
            rw = parse_rewrite(o, POOL, GROUP_V1)
        except RewriteError:
            continue
        assert rw is not None
        read.append(rw)
    t = RewriteTable.build(read)
    assert t.sources == ("good", "newer")
    assert t.lookup("food-review") == parsed(good).rules[0]
    assert t.lookup("anything") == parsed(newer).rules[0]


def test_mixed_weights_are_usable_with_a_warning_and_the_unweighted_never_picked() -> None:
    rw = parsed(obj(rules=[exact_rule("m", ("a", 5), ("b", None), ("c", 1))]))
    assert rw.warnings == (
        "InferenceModelRewrite 'canary': spec.rules[0].targets: weights are set on some targets only; "
        "targets 1 (no weight) are never picked",
    )
    rng = random.Random(3)
    picks = Counter(rw.rules[0].pick(rng) for _ in range(600))
    assert set(picks) == {"a", "c"} and picks["a"] > picks["c"]


# -- precedence -----------------------------------------------------------------------------------


def test_no_rule_no_rewrite() -> None:
    assert EMPTY.lookup("m") is None and EMPTY.rewrite("m", random.Random(0)) is None and not EMPTY
    assert table(obj()).lookup("other-model") is None


def test_an_exact_match_beats_an_older_generic_rule() -> None:
    old_generic = obj("catch-all", [generic_rule("base")], created="2024-01-01T00:00:00Z")
    new_exact = obj("exact", [exact_rule("m", ("m-v2", None))], created="2025-06-01T00:00:00Z")
    t = table(old_generic, new_exact)
    rule = t.lookup("m")
    assert rule is not None and rule.source == "exact"
    other = t.lookup("x")
    assert other is not None and other.source == "catch-all"


def test_the_oldest_object_wins_then_its_name_then_the_first_rule() -> None:
    older = obj("zz-older", [exact_rule("m", ("from-older", None))], created="2025-01-01T00:00:00Z")
    newer = obj("aa-newer", [exact_rule("m", ("from-newer", None))], created="2025-01-01T00:00:01Z")
    rule = table(newer, older).lookup("m")
    assert rule is not None and rule.source == "zz-older"
    # the same second: the name breaks the tie (the reference sorts unstably: any of them)
    a = obj("a", [exact_rule("m", ("from-a", None))])
    b = obj("b", [exact_rule("m", ("from-b", None))])
    rule = table(b, a).lookup("m")
    assert rule is not None and rule.source == "a"
    # within one object, the first rule in list order
    two = obj("two", [exact_rule("m", ("first", None)), exact_rule("m", "n", ("second", None))])
    t = table(two)
    first, second = t.lookup("m"), t.lookup("n")
    assert first is not None and first.index == 0 and second is not None and second.index == 1
    gen = obj("gen", [generic_rule("g1"), generic_rule("g2")])
    g = table(gen).lookup("anything")
    assert g is not None and g.index == 0


def test_a_rule_matches_any_of_its_models() -> None:
    t = table(obj(rules=[exact_rule("a", "b", ("ab-v2", None))]))
    assert t.lookup("a") is t.lookup("b") is not None
    assert t.lookup("c") is None


# -- the weighted pick ----------------------------------------------------------------------------


def test_the_pick_follows_the_weights_with_a_seeded_generator() -> None:
    rule = parsed(obj()).rules[0]  # 90 : 10
    rng = random.Random(11)
    many = Counter(rule.pick(rng) for _ in range(5000))
    assert set(many) == {"food-review-v1", "food-review-v2"}
    assert 0.85 < many["food-review-v1"] / 5000 < 0.95
    # the same seed, the same sequence (no module-level random)
    a, b = random.Random(5), random.Random(5)
    assert [rule.pick(a) for _ in range(50)] == [rule.pick(b) for _ in range(50)]


def test_without_weights_the_pick_is_uniform_and_one_target_is_always_it() -> None:
    rule = parsed(obj(rules=[generic_rule("a", "b", "c")])).rules[0]
    rng = random.Random(2)
    picks = Counter(rule.pick(rng) for _ in range(3000))
    assert set(picks) == {"a", "b", "c"} and all(800 < n < 1200 for n in picks.values())
    single = parsed(obj(rules=[exact_rule("m", ("only", 3))])).rules[0]
    assert {single.pick(rng) for _ in range(20)} == {"only"}


def test_the_rule_module_is_pure() -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    assert violations((root / "epp/discovery/rewrites.py").read_text()) == []


def test_settings_check_the_rewrite_group() -> None:
    assert DiscoverySettings(POOL).check() is None
    assert DiscoverySettings(POOL, rewrite_group="llm-d.ai").check() is None
    problem = DiscoverySettings(POOL, rewrite_group="example.com").check()
    assert (
        problem is not None
        and "'example.com' is not an InferenceModelRewrite group: use inference.networking.x-k8s.io, llm-d.ai"
        in problem
    )


# -- the director ---------------------------------------------------------------------------------

BODY = {"model": "food-review", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def send(d: Any, doc: dict[str, Any], **extra: str) -> tuple[RequestStream, list[Any]]:
    s = RequestStream(d, 1 << 30)
    s.on_message(with_headers(headers(), **extra))
    return s, list(s.on_message(body(json.dumps(doc).encode(), True)))


def test_a_matching_rule_rewrites_the_body_and_the_metrics_keep_the_clients_model() -> None:
    d = director()
    d.model_rewrites = table(obj(rules=[exact_rule("food-review", ("food-review-v2", None))]))
    s, out = send(d, BODY)
    forwarded = forwarded_body(out)
    assert json.loads(forwarded) == {**BODY, "model": "food-review-v2"}
    assert set_headers(out[0].request_headers.response)["content-length"] == str(len(forwarded))
    assert s.routed is not None and s.routed.request.model == "food-review-v2"  # scheduled for the target
    assert s.routed.incoming_model == "food-review"
    labels = {"model_name": "food-review", "target_model_name": "food-review-v2"}
    assert sample(d, "inference_objective_request_total", labels) == 1
    assert d.rewrite_decisions == Counter({("canary", "food-review", "food-review-v2"): 1})
    rewrite = {"model_rewrite_name": "canary", "model_name": "food-review", "target_model": "food-review-v2"}
    assert sample(d, "inference_extension_model_rewrite_decisions_total", rewrite) == 1
    s.close()
    assert sample(d, "inference_objective_request_duration_seconds_count", labels) == 1


def test_the_split_uses_the_directors_generator() -> None:
    d1, d2 = director(), director()
    d1.rewrite_rng, d2.rewrite_rng = random.Random(9), random.Random(9)
    for d in (d1, d2):
        d.model_rewrites = table(obj())  # 90 : 10
    seq1 = [json.loads(forwarded_body(send(d1, BODY)[1]))["model"] for _ in range(40)]
    seq2 = [json.loads(forwarded_body(send(d2, BODY)[1]))["model"] for _ in range(40)]
    assert seq1 == seq2 and set(seq1) == {"food-review-v1", "food-review-v2"}
    assert sum(d1.rewrite_decisions.values()) == 40
    assert d1.rewrite_decisions[("canary", "food-review", "food-review-v2")] == seq1.count("food-review-v2")


def test_a_matching_rule_takes_precedence_over_the_header() -> None:
    d = director()
    d.model_rewrites = table(obj(rules=[exact_rule("food-review", ("from-rule", None))]))
    _, out = send(d, BODY, x_gateway_model_name_rewrite="from-header")
    assert json.loads(forwarded_body(out))["model"] == "from-rule"
    # a model no rule matches: the header applies
    _, out = send(d, {**BODY, "model": "other"}, x_gateway_model_name_rewrite="from-header")
    assert json.loads(forwarded_body(out))["model"] == "from-header"
    labels = {"model_name": "other", "target_model_name": "from-header"}
    assert sample(d, "inference_objective_request_total", labels) == 1


def test_the_rule_matches_the_clients_model_not_the_headers() -> None:
    d = director()
    d.model_rewrites = table(obj(rules=[exact_rule("served-lora", ("never", None))]))
    _, out = send(d, BODY, x_gateway_model_name_rewrite="served-lora")
    assert json.loads(forwarded_body(out))["model"] == "served-lora"
    assert not d.rewrite_decisions


def test_no_match_leaves_the_body_alone() -> None:
    d = director()
    d.model_rewrites = table(obj())
    doc = {**BODY, "model": "unrelated"}
    _, out = send(d, doc)
    assert forwarded_body(out) == json.dumps(doc).encode()
    assert "content-length" not in set_headers(out[0].request_headers.response)
    assert not d.rewrite_decisions


def test_a_rule_picking_the_clients_model_changes_nothing_but_counts() -> None:
    d = director()
    d.model_rewrites = table(obj(rules=[exact_rule("food-review", ("food-review", None))]))
    _, out = send(d, BODY)
    assert forwarded_body(out) == json.dumps(BODY).encode()
    assert d.rewrite_decisions == Counter({("canary", "food-review", "food-review"): 1})


def test_the_header_sent_twice_is_still_400_with_a_rule() -> None:
    d = director()
    d.model_rewrites = table(obj())
    s = RequestStream(d, 1 << 30)
    req = with_headers(headers(), x_gateway_model_name_rewrite="a")
    s.on_message(with_headers(req, x_gateway_model_name_rewrite="b"))
    [resp] = s.on_message(body(json.dumps(BODY).encode(), True))
    assert resp.immediate_response.status.code == 400
    assert "must name one model, once (got 'a,b')" in error_message(resp)
    assert s.routed is None and d.datastore.total_in_flight() == 0
    # the rules still work for the next request
    _, out = send(d, BODY)
    assert json.loads(forwarded_body(out))["model"] in {"food-review-v1", "food-review-v2"}


def test_a_body_without_a_model_is_400_whatever_the_rules_say() -> None:
    d = director()
    d.model_rewrites = table(obj(rules=[generic_rule("base")]))
    s = RequestStream(d, 1 << 30)
    s.on_message(headers())
    [resp] = s.on_message(body(json.dumps({"prompt": "x"}).encode(), True))
    assert resp.immediate_response.status.code == 400
    assert not d.rewrite_decisions


def test_a_request_refused_after_the_rule_matched_is_not_counted() -> None:
    """The rule matches the model, but the request is refused (400: `messages` is not a list): no decision
    is counted, nothing is in flight, and the next valid request is counted once."""
    d = director()
    d.model_rewrites = table(obj(rules=[exact_rule("food-review", ("food-review-v2", None))]))
    s = RequestStream(d, 1 << 30)
    s.on_message(headers())
    [resp] = s.on_message(body(json.dumps({**BODY, "messages": "not a list"}).encode(), True))
    assert resp.immediate_response.status.code == 400
    assert not d.rewrite_decisions and d.datastore.total_in_flight() == 0
    rewrite = {"model_rewrite_name": "canary", "model_name": "food-review", "target_model": "food-review-v2"}
    assert not sample(d, "inference_extension_model_rewrite_decisions_total", rewrite)
    _, out = send(d, BODY)
    assert json.loads(forwarded_body(out))["model"] == "food-review-v2"
    assert d.rewrite_decisions == Counter({("canary", "food-review", "food-review-v2"): 1})
    assert sample(d, "inference_extension_model_rewrite_decisions_total", rewrite) == 1
