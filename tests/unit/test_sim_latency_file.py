"""`--latency-profile` from a YAML file: a profile entry or an EPP config's, checked before anything
runs, and what the engines then run."""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict

import pytest

from epp.costmodel.profile import REFERENCE_PROFILES
from simulator import cli
from simulator.cli import main
from simulator.latency import PROFILES, LatencyProfile
from simulator.latency_file import load_latency_profile

QUICK = ["replay", "--no-progress", "--jobs", "1", "--pods", "1", "--num-gpu-blocks", "1024"]
SLOW_PREFILL = "reference: llama-3.1-8b-h100\nprefill:\n  perTokenSeconds: 1.0e-3\n"
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
costModel:
  profiles:
{entries}
"""


def write(tmp_path: pathlib.Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_name_is_the_named_profile() -> None:
    assert load_latency_profile("llama-3.1-8b-h100") is PROFILES["llama-3.1-8b-h100"]


def test_an_entry_file_overrides_what_it_sets_and_keeps_the_rest(tmp_path: pathlib.Path) -> None:
    p = load_latency_profile(write(tmp_path, "slow.yaml", SLOW_PREFILL + "model: ignored-here\n"))
    ref = PROFILES["llama-3.1-8b-h100"]
    assert p.prefill_per_token_s == 1.0e-3 != ref.prefill_per_token_s
    assert asdict(p) | {"name": "", "prefill_per_token_s": 0} == asdict(ref) | {
        "name": "",
        "prefill_per_token_s": 0,
    }
    assert p.name == "slow.yaml"


def test_an_architecture_sets_the_kv_bytes_and_a_cpu_tier_the_reload(tmp_path: pathlib.Path) -> None:
    text = (
        "architecture: {layers: 80, kvHeads: 8, headDim: 128}\n"
        "tiers:\n  cpu: {bandwidthBytesPerSecond: 1.0e+10, latencySeconds: 0.001}\n"
    )
    p = load_latency_profile(write(tmp_path, "70b.yml", text))
    assert p.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert (p.cpu_bandwidth_bytes_per_s, p.cpu_latency_s) == (1.0e10, 0.001)
    assert p.reload_seconds(1000) == pytest.approx(0.001 + 1000 * p.kv_bytes_per_token / 1.0e10)


def test_an_epp_config_gives_its_only_profile_or_the_one_for_every_model(tmp_path: pathlib.Path) -> None:
    one = CONFIG.format(entries="  - model: m\n    prefill: {perTokenSeconds: 2.0e-3}\n")
    assert load_latency_profile(write(tmp_path, "one.yaml", one)).prefill_per_token_s == 2.0e-3
    two = CONFIG.format(
        entries="  - model: m\n    prefill: {perTokenSeconds: 2.0e-3}\n"
        "  - model: '*'\n    prefill: {perTokenSeconds: 3.0e-3}\n"
    )
    assert load_latency_profile(write(tmp_path, "two.yaml", two)).prefill_per_token_s == 3.0e-3


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("x.yaml", "prefill: {perTokenSeconds: -1}\n", "prefill.perTokenSeconds: must be a finite number"),
        ("x.yaml", "prefil: {}\n", "prefil"),
        ("x.yaml", "reference: gpt-9\n", "unknown reference profile 'gpt-9'"),
        ("x.yaml", "- a\n- b\n", "must be a YAML mapping"),
        ("x.yaml", "a: [\n", "not valid YAML"),
        ("x.yaml", CONFIG.format(entries="  []").replace("profiles:\n  []", "profiles: []"), "declares no"),
        (
            "x.yaml",
            CONFIG.format(entries="  - model: a\n  - model: b\n"),
            "has profiles for 'a', 'b'; the simulated engines take one",
        ),
        ("x.yaml", CONFIG.format(entries="  - model: a\n    decode: {fixedSeconds: x}\n"), "decode"),
        ("x.yaml", "kind: EndpointPickerConfig\n", "apiVersion"),
    ],
)
def test_a_bad_file_is_named_with_what_is_wrong(
    tmp_path: pathlib.Path, name: str, text: str, fragment: str
) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ValueError, match="--latency-profile") as err:
        load_latency_profile(path)
    assert fragment in str(err.value)


def test_an_unknown_name_or_a_missing_file_is_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"not a known profile \(llama-3\.1-8b-h100\) nor a YAML file"):
        load_latency_profile("gpt-9")
    with pytest.raises(ValueError, match="cannot read"):
        load_latency_profile(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_latency_profile(str(bad))


def summary(out: pathlib.Path) -> dict:  # type: ignore[type-arg]
    return json.loads((out / "summary.json").read_text())  # type: ignore[no-any-return]


def test_the_engines_run_the_file_s_profile_and_the_meta_records_it(tmp_path: pathlib.Path) -> None:
    """A prefill 10x slower per token makes every TTFT longer; `meta` has the coefficients used."""
    args = [*QUICK, "--requests", "20", "--policies", "random"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    slow = write(tmp_path, "slow.yaml", SLOW_PREFILL)
    assert main([*args, "--latency-profile", slow, "--out", str(tmp_path / "b")]) == 0
    a, b = summary(tmp_path / "a"), summary(tmp_path / "b")
    assert b["policies"]["random"]["ttft_mean_s"] > a["policies"]["random"]["ttft_mean_s"]
    assert b["meta"]["latency_profile"] == slow
    assert b["meta"]["latency_coefficients"]["prefill_per_token_s"] == 1.0e-3
    ref = REFERENCE_PROFILES["llama-3.1-8b-h100"]
    assert a["meta"]["latency_coefficients"] == asdict(LatencyProfile.from_model(ref))


def test_a_bad_profile_or_a_cpu_tier_without_bandwidth_stops_before_the_trace_is_read(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the trace was read")

    monkeypatch.setattr(cli, "load_trace", never)
    bad = write(tmp_path, "bad.yaml", "decode: {perSequenceSeconds: -2}\n")
    out = tmp_path / "o"
    assert main([*QUICK, "--latency-profile", bad, "--out", str(out)]) == 2
    assert "decode.perSequenceSeconds: must be a finite number >= 0" in capsys.readouterr().err
    no_cpu = write(tmp_path, "nocpu.yaml", "reference: llama-3.1-8b-h100\n")
    assert load_latency_profile(no_cpu).cpu_bandwidth_bytes_per_s is not None  # the reference has one
    gpu_only = LatencyProfile.from_model(REFERENCE_PROFILES["llama-3.1-8b-h100"].__class__(
        **{**asdict(REFERENCE_PROFILES["llama-3.1-8b-h100"]), "tiers": {}}
    ))  # fmt: skip
    monkeypatch.setattr(cli, "load_latency_profile", lambda _spec: gpu_only)
    assert main([*QUICK, "--cpu-blocks", "64", "--out", str(out)]) == 2
    assert "--cpu-blocks needs a reload bandwidth" in capsys.readouterr().err
    assert not out.exists()
