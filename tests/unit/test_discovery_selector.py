"""Selector mode's pure parts: the label-selector grammar (what the reference's `labels.Parse`
accepts), the target-port list, and the settings they make; every malformed input is a clear error."""

from __future__ import annotations

import pytest

from epp.clock import MonotonicClock
from epp.datastore import Datastore
from epp.discovery.pool import PoolSpec, exclusion, parse_pool, pool_endpoints
from epp.discovery.selector import LabelSelector, SelectorError, parse_selector
from epp.discovery.selector_watcher import SelectorWatcher, watcher_for
from epp.discovery.settings import DiscoverySettings, check_target_ports, parse_target_ports
from epp.discovery.watcher import PoolWatcher

POD_LABELS = {"app": "vllm", "env": "prod", "tier": "gpu", "gen": "3", "example.com/role": "decode"}


@pytest.mark.parametrize(
    ("text", "canonical", "matches"),
    [
        ("app=vllm", "app=vllm", True),
        ("app==vllm", "app=vllm", True),
        ("app = vllm ,  env=prod", "app=vllm,env=prod", True),
        ("env=prod,app=vllm", "app=vllm,env=prod", True),  # sorted by key, as labels.Parse
        ("app=sglang", "app=sglang", False),
        ("app!=sglang", "app!=sglang", True),
        ("missing!=x", "missing!=x", True),  # a missing label satisfies != (as in Kubernetes)
        ("env in (staging,prod)", "env in (prod,staging)", True),
        ("env in (staging)", "env in (staging)", False),
        ("env notin (dev, staging)", "env notin (dev,staging)", True),
        ("missing notin (a)", "missing notin (a)", True),
        ("tier", "tier", True),
        ("!tier", "!tier", False),
        ("!missing", "!missing", True),
        ("gen>2", "gen>2", True),
        ("gen<3", "gen<3", False),
        ("app>1", "app>1", False),  # not an integer label value: no match
        ("example.com/role=decode", "example.com/role=decode", True),
        ("app=vllm,env in (prod),!canary,tier", "app=vllm,!canary,env in (prod),tier", True),
        ("app=", "app=", False),  # the empty value
    ],
)
def test_selectors_parse_to_their_canonical_form_and_match_as_kubernetes(
    text: str, canonical: str, matches: bool
) -> None:
    selector = parse_selector(text)
    assert str(selector) == canonical
    assert selector.matches(POD_LABELS) is matches
    assert parse_selector(canonical) == selector  # the canonical form reads back the same


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "empty selector"),
        ("   ", "empty selector"),
        ("app=vllm,", "found end of string after ',', expected a requirement"),
        (",app=vllm", "found ',', expected a label key"),
        ("app=vllm env=prod", "found 'env' after app=vllm, expected ',' or end of string"),
        ("app in vllm", "found 'vllm' after 'app in', expected '('"),
        ("app in (a,b", "found end of string in 'app in (...', expected ')'"),
        ("app in ()", "'app in ()': the set of values must not be empty"),
        ("app notin (a b)", "found 'b' in 'app notin (...)', expected a value"),
        ("app=(x)", "found '(' after 'app=', expected a value"),
        ("app=a=b", "found '=' after app=a, expected ',' or end of string"),
        ("app ~ x", "found '~' after 'app', expected one of =, ==, !=, in, notin, >, <"),
        ("gen>x", "'gen>x': '>' needs an integer value"),
        ("-bad=x", "label key '-bad' is not valid"),
        ("Example.com/role=x", "label key 'Example.com/role' is not valid: the prefix"),
        ("/role=x", "label key '/role' is not valid: the prefix"),
        ("app=has space", "found 'space' after app=has"),
        ("app=" + "v" * 64, "value '" + "v" * 64 + "' of label 'app' is not valid"),
        ("app=bad_", "value 'bad_' of label 'app' is not valid"),
        ("!app=x", "found '=' after !app, expected ',' or end of string"),
        ("in", "found 'in', expected a label key"),
    ],
)
def test_malformed_selectors_say_where_and_why(text: str, error: str) -> None:
    with pytest.raises(SelectorError) as err:
        parse_selector(text)
    assert error in str(err.value)


def test_a_pool_selector_is_equality_on_every_label_and_reads_as_before() -> None:
    spec = parse_pool(
        {
            "metadata": {"name": "p"},
            "spec": {
                "selector": {"matchLabels": {"model": "llama", "app": "vllm"}},
                "targetPorts": [{"number": 8000}],
            },
        }
    )
    assert spec.selector == LabelSelector.from_labels([("app", "vllm"), ("model", "llama")])
    assert spec.label_selector() == "app=vllm,model=llama" and spec.labels == {
        "app": "vllm",
        "model": "llama",
    }


def ready_pod(name: str, ip: str, labels: dict[str, str]) -> dict[str, object]:
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_a_set_based_selector_picks_the_candidates_one_endpoint_per_port() -> None:
    spec = PoolSpec("s", parse_selector("app=vllm,env in (prod,staging),!canary"), (8000, 8001))
    pods = [
        ready_pod("prod", "10.0.0.1", {"app": "vllm", "env": "prod"}),
        ready_pod("staging", "10.0.0.2", {"app": "vllm", "env": "staging"}),
        ready_pod("dev", "10.0.0.3", {"app": "vllm", "env": "dev"}),
        ready_pod("canary", "10.0.0.4", {"app": "vllm", "env": "prod", "canary": "yes"}),
    ]
    assert pool_endpoints(spec, pods) == ["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001"]
    assert exclusion(pods[2], spec) == "selector" and exclusion(pods[3], spec) == "selector"


@pytest.mark.parametrize(
    ("values", "ports", "repeated"),
    [
        (["8000"], (8000,), ()),
        (["8000,8001, 8002"], (8000, 8001, 8002), ()),
        (["8000", "8001"], (8000, 8001), ()),  # a repeated flag adds ports (pflag's int slice)
        (["8001,8000,8001", "8000"], (8001, 8000), (8001, 8000)),  # repeats dropped, order kept
    ],
)
def test_target_ports_are_read_in_order_without_repeats(
    values: list[str], ports: tuple[int, ...], repeated: tuple[int, ...]
) -> None:
    assert parse_target_ports(values) == (ports, repeated)
    assert check_target_ports(ports) is None


@pytest.mark.parametrize("value", ["", "8000,", "http", "80a", "8000;8001", "٨٠٠٠", "1.5"])
def test_an_entry_that_is_not_a_number_is_named(value: str) -> None:
    with pytest.raises(ValueError, match="is not a port number"):
        parse_target_ports([value])


@pytest.mark.parametrize(
    ("ports", "error"),
    [
        ((), "--endpoint-selector needs --endpoint-target-ports (the pods' ports to route to)"),
        ((0,), "--endpoint-target-ports: 0 is not a port number 1-65535"),
        ((8000, 65536), "--endpoint-target-ports: 65536 is not a port number 1-65535"),
        ((-1,), "--endpoint-target-ports: -1 is not a port number 1-65535"),
        (tuple(range(8000, 8009)), "--endpoint-target-ports has 9 ports, at most 8"),
        ((8000, 8000), "--endpoint-target-ports: a port is listed twice"),
    ],
)
def test_bad_target_ports_are_refused(ports: tuple[int, ...], error: str) -> None:
    assert check_target_ports(ports) == error
    settings = DiscoverySettings(endpoint_selector=parse_selector("app=vllm"), target_ports=ports)
    assert settings.check() == error


def test_settings_take_a_pool_or_a_selector_never_both_nor_neither() -> None:
    selector = parse_selector("app=vllm")
    good = DiscoverySettings(endpoint_selector=selector, target_ports=(8000,))
    assert good.check() is None and good.selector_mode and not good.pool_name
    both = DiscoverySettings("pool", endpoint_selector=selector, target_ports=(8000,))
    assert (both.check() or "").startswith("--pool-name and --endpoint-selector cannot be used together")
    assert DiscoverySettings().check() == "--pool-name must not be empty"
    empty = DiscoverySettings(endpoint_selector=LabelSelector(()), target_ports=(8000,))
    assert (empty.check() or "").startswith("--endpoint-selector must not be empty")
    ports_only = DiscoverySettings("pool", target_ports=(8000,))
    assert (ports_only.check() or "").startswith("--endpoint-target-ports needs --endpoint-selector")
    assert DiscoverySettings("pool").check() is None and not DiscoverySettings("pool").selector_mode


def test_each_watcher_takes_its_own_mode_only() -> None:
    ds = Datastore(MonotonicClock())
    selector_mode = DiscoverySettings(endpoint_selector=parse_selector("app=vllm"), target_ports=(8000,))
    pool_mode = DiscoverySettings("pool")
    assert isinstance(watcher_for(ds, selector_mode), SelectorWatcher)
    assert isinstance(watcher_for(ds, pool_mode), PoolWatcher)
    with pytest.raises(ValueError, match="read no pool"):
        PoolWatcher(ds, selector_mode)
    with pytest.raises(ValueError, match="needs --endpoint-selector"):
        SelectorWatcher(ds, pool_mode)
    with pytest.raises(ValueError, match="discovery: --endpoint-target-ports: 0 is not a port number"):
        SelectorWatcher(ds, DiscoverySettings(endpoint_selector=parse_selector("a"), target_ports=(0,)))
    assert ds.ids() == []  # nothing was published by a refused watcher
