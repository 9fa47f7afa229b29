"""Hostile config files into the loader (`epp/config.py`: YAML -> typed config -> built scheduler).

Random text, random YAML documents shaped like the config (every section and every plugin's
parameters, with values of the right type, the wrong type, or at their limits), deep nesting, alias
bombs, long strings: the result is a config or a `ConfigError` naming the file and the field, never
another exception; an accepted config holds values the server can use.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.config import API_VERSIONS, KIND, ConfigDoc, EppConfig, PluginEntry, build_scheduler, parse_config
from epp.config_sections import ConfigError
from epp.costmodel.calibration import CalibrationSettings
from epp.costmodel.profile import ProfileSpec
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CalibrationSpec, CostModel
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import SERVICE_KEY as KV_KEY
from epp.kvindex.service import KvIndexService
from epp.scheduling.builtin import default_registry
from epp.scheduling.errors import SchedulingError
from epp.testing.fakes import FakeClock, endpoint, token_request

SOURCE = "hostile.yaml"
HEAD = f"apiVersion: {API_VERSIONS[0]}\nkind: {KIND}\n"
REGISTRY = default_registry()
PLUGIN_TYPES = [s.type_name for s in REGISTRY.types()]

# Text YAML can carry (no lone surrogates).
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
special_strings = st.sampled_from(
    [
        "2s",
        "50ms",
        "-1s",
        "1e400s",
        ".5",
        "1.",
        "per-pod",
        "central",
        "off",
        "tcp://*:5557",
        "",
        "*",
        "10.0.0.1:8000",
        "[::1]:80",
        "reject",
        "shared",
        "ttft-scorer",
        "x" * 300,
    ]
)
ints = st.one_of(
    st.integers(0, 100),
    st.integers(-3, 3),
    st.integers(),
    st.sampled_from([2**31 - 1, 2**31, 2**63, 10**30, 65535, 65536, 1024, 1025, 256, 257]),
)
floats = st.one_of(st.floats(), st.sampled_from([0.0, 1.0, -0.5, 1.5, float("nan"), float("inf")]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, special_strings)
anything: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=8,
)


def mostly(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any], one_in: int) -> st.SearchStrategy[Any]:
    """`odd` one time in `one_in`, else `usual`."""
    return st.sampled_from([usual] * (one_in - 1) + [odd]).flatmap(lambda chosen: chosen)


def for_type(t: msgspec.inspect.Type) -> st.SearchStrategy[Any]:
    """Values of type `t` (at their limits), or anything at all now and then."""
    mi = msgspec.inspect
    if isinstance(t, mi.StructType):
        fields = {f.encode_name: for_type(f.type) for f in t.fields}
        return mostly(st.fixed_dictionaries({}, optional=fields), anything, 6)  # type: ignore[arg-type]
    typed: st.SearchStrategy[Any]
    if isinstance(t, mi.UnionType):
        typed = st.one_of(*(for_type(u) for u in t.types))
    elif isinstance(t, mi.ListType):
        typed = st.lists(for_type(t.item_type), max_size=3)
    elif isinstance(t, mi.DictType):
        typed = st.dictionaries(st.one_of(texts, special_strings), for_type(t.value_type), max_size=3)
    elif isinstance(t, mi.IntType):
        typed = ints
    elif isinstance(t, mi.FloatType):
        typed = st.one_of(floats, ints)
    elif isinstance(t, mi.StrType):
        typed = st.one_of(special_strings, texts)
    elif isinstance(t, mi.BoolType):
        typed = st.booleans()
    elif isinstance(t, mi.NoneType):
        typed = st.none()
    else:
        return anything
    return mostly(typed, anything, 8)


def struct(cls: type) -> st.SearchStrategy[Any]:
    return for_type(msgspec.inspect.type_info(cls))


def plugin_entries() -> st.SearchStrategy[dict[str, Any]]:
    def entry(type_name: str) -> st.SearchStrategy[dict[str, Any]]:
        params = struct(REGISTRY.spec(type_name).params_type)
        return st.fixed_dictionaries({"type": st.just(type_name)}, optional={"parameters": params})

    return st.one_of(*(entry(t) for t in PLUGIN_TYPES), struct(PluginEntry))


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    """A config-shaped document: a working core (plugins with their own parameters, a profile naming
    them) plus a few of our sections from the schema, any part of it wrong now and then."""
    info = msgspec.inspect.type_info(ConfigDoc)
    sections = {
        f.encode_name: for_type(f.type)
        for f in info.fields  # type: ignore[attr-defined]
        if f.encode_name not in ("apiVersion", "kind", "plugins", "schedulingProfiles", "costModel")
    }
    sections["costModel"] = st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "profiles": st.lists(struct(ProfileSpec), max_size=2),
                "calibration": struct(CalibrationSpec),
            },
        ),
        anything,
    )
    chosen = draw(st.lists(st.sampled_from(sorted(sections)), max_size=2, unique=True))
    doc: dict[str, Any] = {name: draw(sections[name]) for name in chosen}
    plugins = draw(st.lists(plugin_entries(), min_size=1, max_size=3))
    doc["plugins"] = plugins
    names = [p.get("name") or p.get("type") for p in plugins if isinstance(p, dict)]
    refs = [{"pluginRef": n} for n in names if isinstance(n, str)]
    doc["schedulingProfiles"] = draw(
        mostly(
            st.just([{"name": "default", "plugins": refs}]),
            st.lists(
                st.fixed_dictionaries(
                    {"name": texts},
                    optional={
                        "plugins": st.lists(
                            st.fixed_dictionaries(
                                {"pluginRef": st.sampled_from(names) if names else texts},
                                optional={"weight": st.one_of(floats, ints, anything)},
                            ),
                            max_size=4,
                        )
                    },
                ),
                max_size=2,
            )
            | anything,
            4,
        )
    )
    doc["apiVersion"] = draw(mostly(st.just(API_VERSIONS[0]), scalars, 20))
    doc["kind"] = draw(mostly(st.just(KIND), scalars, 20))
    return doc


def load(text: str) -> EppConfig | ConfigError:
    """The loader and the scheduler build, as `epp serve` runs them; a ConfigError names the file.
    An accepted config's scheduler then schedules a request."""
    try:
        cfg = parse_config(text, SOURCE)
        index = BlockIndex(block_size=cfg.index.block_size, max_entries=cfg.index.max_entries)
        kv = KvIndexService(index, FreshnessTracker(), TokenizerRegistry({}), cfg.index.block_size)
        services = {KV_KEY: kv, COST_KEY: CostModel(cfg.cost_model)}
        clock = FakeClock()
        scheduler = build_scheduler(cfg, REGISTRY, clock, random.Random(0), services=services)
    except ConfigError as err:
        assert err.source == SOURCE and err.message
        assert str(err).startswith(SOURCE)
        return err
    usable(cfg)
    try:
        result = scheduler.schedule(
            token_request(list(range(40))), [endpoint("10.0.0.1:80"), endpoint("10.0.0.2:80")]
        )
        assert result.decision.primary in ("10.0.0.1:80", "10.0.0.2:80")
    except SchedulingError as err:  # e.g. an admission SLO no endpoint meets: a 429, not a crash
        assert 400 <= err.status < 600
    return cfg


def usable(cfg: EppConfig) -> None:
    """What the server builds from an accepted config takes its values without complaint."""
    kv = cfg.kv_events
    assert kv.check() is None
    assert 1 <= kv.rcvhwm < 2**31 and kv.port + kv.dp_ranks - 1 <= 65535
    assert isinstance(cfg.cost_model.calibration, CalibrationSettings)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_random_text_is_a_config_or_a_config_error(text: str) -> None:
    load(text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_random_text_after_a_valid_header_is_a_config_or_a_config_error(text: str) -> None:
    load(HEAD + text)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
def test_config_shaped_documents_are_a_config_or_an_error_naming_the_field(doc: dict[str, Any]) -> None:
    result = load(yaml.safe_dump(doc))
    if isinstance(result, ConfigError):
        assert result.where or result.field, str(result)  # the document is a mapping: say where


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,
        "a: " + "{b: " * 20_000,
        HEAD + "plugins: " + "[" * 5_000 + "]" * 5_000,
        HEAD + "costModel: " + "{a: " * 3_000 + "1" + "}" * 3_000,
        HEAD + "".join("  " * i + "- \n" for i in range(3_000)),
    ],
    ids=["flow-lists", "flow-maps", "plugins", "costModel", "block-lists"],
)
def test_deep_nesting_is_a_config_error(text: str) -> None:
    err = load(text)
    assert isinstance(err, ConfigError)


def bomb(levels: int = 9) -> str:
    """`[x0, x1, ..., *a8]` with each anchor ten copies of the previous: 10^9 leaves once expanded."""
    defs = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    defs += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "[" + ", ".join(defs) + f", *a{levels - 1}]"


@pytest.mark.parametrize(
    "section",
    [
        "featureGates: {b}",
        "plugins:\n- type: ttft-scorer\n  parameters: {{tieBand: {b}}}",
        "plugins:\n- type: precise-prefix-cache-scorer\n  parameters: {{tierWeights: {{gpu: {b}}}}}",
        "costModel: {{profiles: {b}}}",
        "costModel: {{calibration: {{warmup: {b}}}}}",
        "tokenizers: {{m: {b}}}",
        "endpoints: {b}",
        "kvEvents: {{topicFilters: {b}}}",
    ],
)
def test_alias_bombs_are_config_errors_without_expanding(section: str) -> None:
    err = load(HEAD + section.format(b=bomb()) + "\n")
    assert isinstance(err, ConfigError) and err.field


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ("saturationDetector: {{metricsStalenessThreshold: '{s}'}}", "metricsStalenessThreshold"),
        ("kvEvents: {{replayTimeout: '{s}'}}", "replayTimeout"),
        ("admission: {{ttftSlo: '{s}'}}", "ttftSlo"),
    ],
)
@pytest.mark.parametrize(
    "value",
    [
        "1" * 200_000 + "x",
        "1 " + " " * 200_000 + "x",
        "." + "1" * 200_000 + "e",
        "1" * 200_000,
        "1m" * 100_000 + "x",  # Go's compound form, broken at the end
        "1ms" * 70_000 + "1",
    ],
)
def test_long_durations_are_read_in_linear_time(section: str, field: str, value: str) -> None:
    # Before the fix, the duration pattern backtracked quadratically: ~12 s for 16,000 digits.
    result = load(HEAD + section.format(s=value) + "\n")
    assert isinstance(result, ConfigError) and result.field == field


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ("kvEvents: {receiveHighWaterMark: 99999999999}", "receiveHighWaterMark"),
        ("kvEvents: {dpRanks: 1000000000}", "dpRanks"),
        ("kvEvents: {port: 65000, dpRanks: 1000}", "dpRanks"),
        ("kvEvents: {replayPort: 65535, dpRanks: 2}", "dpRanks"),
        ("kvEvents: {mode: central, bind: 'ipc:///tmp/kv', verifyPeer: true}", "verifyPeer"),
        ("kvEvents: {verifyPeer: maybe}", "verifyPeer"),
        ("index: {blockSize: 100000000000000000}", "blockSize"),
        ("1: 2", "(a key)"),
        ("tokenizers: {1: x}", "(a key)"),
    ],
)
def test_values_the_server_could_not_use_are_config_errors(section: str, field: str) -> None:
    err = load(HEAD + section + "\n")
    assert isinstance(err, ConfigError) and err.field == field, err
