"""`epp-sim serve-engine` flags and `EngineServerConfig`: vLLM's names, a clear error for each bad value."""

from __future__ import annotations

import argparse
import json
import pathlib
import re
from typing import Any

import pytest

from simulator.cli import build_parser, main
from simulator.engine import EngineConfig
from simulator.serving import EngineServerConfig
from simulator.serving.command import config_from_args
from simulator.serving.config import binds


def config(*argv: str) -> EngineServerConfig:
    return config_from_args(build_parser().parse_args(["serve-engine", *argv]))


def test_flags_become_the_config() -> None:
    cfg = config(
        "--port", "0", "--served-model-name", "tiny", "--num-gpu-blocks-override", "100",
        "--block-size", "32", "--max-num-batched-tokens", "512", "--max-num-seqs", "8",
        "--latency-profile", "llama-3.1-8b-h100",
        "--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint", "tcp://*:5558",
        "--kv-events-topic", "kv@{address}@{model}", "--time-scale", "2.5", "--stream-interval", "4",
    )  # fmt: skip
    assert (cfg.model, cfg.port, cfg.time_scale, cfg.stream_interval) == ("tiny", 0, 2.5, 4)
    assert cfg.engine_config == EngineConfig(
        num_gpu_blocks=100, block_size=32, max_num_batched_tokens=512, max_num_seqs=8, model="tiny"
    )
    assert (cfg.kv_events_endpoint, cfg.kv_replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    assert cfg.kv_topic == "kv@{address}@{model}"
    assert cfg.max_model_len == 99 * 32
    assert config().kv_events_endpoint is None  # no KV events unless asked


def test_vllm_kv_events_config_json_and_explicit_flags_winning() -> None:
    doc = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "replay_endpoint": "tcp://*:6001",
        "topic": "t",
    }
    cfg = config("--kv-events-config", json.dumps(doc))
    assert (cfg.kv_events_endpoint, cfg.kv_replay_endpoint, cfg.kv_topic) == (
        "tcp://*:5557",
        "tcp://*:6001",
        "t",
    )
    cfg = config("--kv-events-config", json.dumps(doc), "--kv-events-endpoint", "tcp://10.0.0.1:5557")
    assert cfg.kv_events_endpoint == "tcp://10.0.0.1:5557"
    off = config("--kv-events-config", json.dumps({**doc, "enable_kv_cache_events": False}))
    assert off.kv_events_endpoint is None
    unset = {k: v for k, v in doc.items() if k != "enable_kv_cache_events"}  # vLLM's default: off
    assert config("--kv-events-config", json.dumps(unset)).kv_events_endpoint is None


@pytest.mark.parametrize(
    ("endpoint", "mode", "bind"),
    [
        ("tcp://*:5557", "auto", True),
        ("tcp://[::]:5557", "auto", True),
        ("ipc:///tmp/kv", "auto", True),
        ("tcp://10.0.0.1:5557", "auto", False),
        ("tcp://127.0.0.2:5557", "bind", True),
        ("tcp://*:5557", "connect", False),
    ],
)
def test_bind_or_connect_as_vllm_decides(endpoint: str, mode: str, bind: bool) -> None:
    assert binds(endpoint, mode) is bind


BAD_FLAGS: list[tuple[list[str], str]] = [
    (["--block-size", "0"], "argument --block-size: must be >= 1"),
    (["--port", "x"], "argument --port: not an integer"),
    (["--time-scale", "0"], "argument --time-scale: must be > 0"),
    (["--time-scale", "nan"], "argument --time-scale: must be > 0"),
    (["--latency-profile", "gpu-9000"], "--latency-profile 'gpu-9000': not a known profile"),
    (["--latency-profile", "/nonexistent/p.yaml"], "--latency-profile /nonexistent/p.yaml: cannot read"),
    (["--kv-events-mode", "both"], "argument --kv-events-mode: invalid choice"),
    (["--port", "70000"], "port must be in 0..65535"),
    (
        ["--max-num-seqs", "64", "--max-num-batched-tokens", "32"],
        "max_num_batched_tokens must be >= max_num_seqs",
    ),
    (["--kv-events-endpoint", "localhost:5557"], "must be a ZeroMQ endpoint"),
    (["--kv-events-replay-endpoint", "tcp://*:5558"], "kv_replay_endpoint needs kv_events_endpoint"),
    (["--kv-events-config", "{not json"], "--kv-events-config is not valid JSON"),
    (["--kv-events-config", '{"publisher": "kafka"}'], 'publisher must be "zmq"'),
    (["--kv-events-config", '{"buffer_steps": 0}'], "buffer_steps must be an integer >= 1"),
    (["--tokenizer", "/nonexistent/tok"], "--tokenizer /nonexistent/tok: not a directory"),
    (["--model", "bad name"], "model must be"),
]


@pytest.mark.parametrize(("argv", "words"), BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_exit_2_with_the_reason(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = main(["serve-engine", *argv])
    except SystemExit as exit_:  # argparse's own errors
        status = int(exit_.code or 0)
    assert status == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"time_scale": -1.0}, "time_scale"),
        ({"latency": "nope"}, "unknown latency profile"),
        ({"default_max_tokens": 0}, "default_max_tokens"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"kv_events_mode": "sometimes"}, "kv_events_mode"),
        ({"host": ""}, "host"),
    ],
)
def test_config_refuses_bad_values(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        EngineServerConfig(**fields)


def test_engine_config_serves_the_server_model() -> None:
    cfg = EngineServerConfig(model="demo", engine=EngineConfig(num_gpu_blocks=10))
    assert cfg.engine_config.model == "demo" and cfg.engine_config.num_gpu_blocks == 10


def test_every_flag_is_documented_in_the_simulator_docs() -> None:
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "simulator.md").read_text()
    section = doc[doc.index("## Simulated engine server") :]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = [f for a in sub.choices["serve-engine"]._actions for f in a.option_strings if f.startswith("--")]
    assert "--kv-events-endpoint" in flags and "--help" in flags
    missing = [f for f in flags if f != "--help" and not re.search(rf"`{re.escape(f)}`", section)]
    assert missing == []
