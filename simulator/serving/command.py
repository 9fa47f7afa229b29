"""`epp-sim serve-engine`: flags -> `EngineServerConfig` -> a running `SimulatedEngineServer` until
SIGINT/SIGTERM.

    epp-sim serve-engine --port 8000 --model tiny --tokenizer ./tok --block-size 16 \\
        --kv-events-endpoint 'tcp://*:5557' --kv-events-replay-endpoint 'tcp://*:5558'

Flag names are vLLM's where vLLM has one (`--served-model-name`, `--num-gpu-blocks-override`,
`--kv-events-config` with its JSON fields are accepted too). Bad values raise ValueError with the
flag's name (the CLI prints it and exits 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from simulator.engine import EngineConfig
from simulator.engine_config import add_scheduling_flags
from simulator.latency import DEFAULT_PROFILE, PROFILES
from simulator.latency_file import load_latency_profile
from simulator.serving.config import KV_EVENTS_MODES, EngineServerConfig
from simulator.serving.server import SimulatedEngineServer


def _number(kind: type[int] | type[float], minimum: float, strict: bool = False) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not {'an integer' if kind is int else 'a number'}: {text!r}"
            ) from None
        if not (value > minimum if strict else value >= minimum) or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum:g}, got {text}")
        return value

    return parse


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add `serve-engine` to the `epp-sim` subcommands."""
    e: argparse.ArgumentParser = sub.add_parser(
        "serve-engine",
        help="run one simulated vLLM engine as an OpenAI-compatible server (KV events, /metrics)",
        description="One simulated vLLM engine behind a real OpenAI-compatible HTTP server, in real time.",
    )
    e.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    e.add_argument("--port", type=_number(int, 0), default=8000, help="HTTP port; 0 picks a free one")
    e.add_argument("--model", "--served-model-name", dest="model", default="model", help="served model name")
    e.add_argument("--tokenizer", help="local Hugging Face tokenizer directory (text prompts and chat)")
    e.add_argument(
        "--num-gpu-blocks",
        "--num-gpu-blocks-override",
        dest="num_gpu_blocks",
        type=_number(int, 2),
        default=4096,
        help="KV blocks, vLLM's reserved null block included",
    )
    e.add_argument("--block-size", type=_number(int, 1), default=16, help="tokens per KV block")
    e.add_argument("--max-num-batched-tokens", type=_number(int, 1), default=8192)
    e.add_argument("--max-num-seqs", type=_number(int, 1), default=1024)
    add_scheduling_flags(e)
    e.add_argument(
        "--cpu-blocks", type=_number(int, 0), default=0, help="CPU offload tier in blocks (0: none)"
    )
    e.add_argument(
        "--latency-profile",
        default=DEFAULT_PROFILE,
        help=f"step times: {', '.join(sorted(PROFILES))}, or a YAML file (a costModel.profiles entry, or an "
        "EPP config) (default %(default)s)",
    )
    e.add_argument("--kv-events-config", help="vLLM's JSON: endpoint, replay_endpoint, topic, buffer_steps")
    e.add_argument(
        "--kv-events-endpoint", help="ZeroMQ PUB endpoint, e.g. tcp://*:5557 (bind) or tcp://host:5557"
    )
    e.add_argument("--kv-events-replay-endpoint", help="ZeroMQ ROUTER endpoint for replay, e.g. tcp://*:5558")
    e.add_argument("--kv-events-topic", help='topic ("" by default); {address} and {model} are filled in')
    e.add_argument(
        "--kv-events-mode", choices=KV_EVENTS_MODES, default="auto", help="bind or connect the PUB"
    )
    e.add_argument(
        "--time-scale",
        type=_number(float, 0, strict=True),
        default=1.0,
        help="wall seconds per engine second",
    )
    e.add_argument("--default-max-tokens", type=_number(int, 1), default=16, help="when a request names none")
    e.add_argument("--stream-interval", type=_number(int, 1), default=1, help="tokens per streamed chunk")
    e.add_argument("--port-file", help="write the bound HTTP port to this file once serving")
    return e


def _kv_events_json(text: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise ValueError(f"--kv-events-config is not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    if doc.get("publisher", "zmq") not in ("zmq", "null"):
        raise ValueError(f'--kv-events-config: publisher must be "zmq", got {doc["publisher"]!r}')
    for key in ("endpoint", "replay_endpoint", "topic"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise ValueError(f"--kv-events-config: {key} must be a string")
    steps = doc.get("buffer_steps")
    if steps is not None and (type(steps) is not int or steps < 1):
        raise ValueError("--kv-events-config: buffer_steps must be an integer >= 1")
    return doc


def config_from_args(args: argparse.Namespace) -> EngineServerConfig:
    """ValueError naming the flag when a value is unusable."""
    endpoint, replay, topic, steps = None, None, "", 10_000
    if args.kv_events_config:
        doc = _kv_events_json(args.kv_events_config)
        # vLLM publishes only with `enable_kv_cache_events: true` (its default is false)
        if doc.get("enable_kv_cache_events", False) is True and doc.get("publisher", "zmq") == "zmq":
            endpoint = doc.get("endpoint") or "tcp://*:5557"
            replay = doc.get("replay_endpoint")
            topic = doc.get("topic") or ""
            steps = doc.get("buffer_steps") or steps
    endpoint = args.kv_events_endpoint or endpoint
    replay = args.kv_events_replay_endpoint or replay
    topic = args.kv_events_topic if args.kv_events_topic is not None else topic
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise ValueError(f"--tokenizer {args.tokenizer}: not a directory")
    try:
        engine = EngineConfig(
            num_gpu_blocks=args.num_gpu_blocks,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            cpu_blocks=args.cpu_blocks,
            cpu_write_policy=args.cpu_write_policy,
            model=args.model,
            async_scheduling=args.async_scheduling,
        )
    except ValueError as err:
        raise ValueError(f"engine flags: {err}") from None
    return EngineServerConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        tokenizer=Path(args.tokenizer) if args.tokenizer else None,
        engine=engine,
        latency=load_latency_profile(args.latency_profile),
        kv_events_endpoint=endpoint,
        kv_replay_endpoint=replay,
        kv_topic=topic,
        kv_events_mode=args.kv_events_mode,
        kv_buffer_steps=steps,
        time_scale=args.time_scale,
        default_max_tokens=args.default_max_tokens,
        stream_interval=args.stream_interval,
    )


def write_port_file(path: Path, port: int) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(f"{port}\n", encoding="utf-8")
        tmp.replace(path)  # atomic: a reader never sees a partial file
    except OSError as err:
        raise ValueError(f"--port-file {path}: cannot write: {err.strerror}") from None


async def serve(config: EngineServerConfig, port_file: Path | None = None) -> None:
    server = SimulatedEngineServer(config)
    try:
        await server.start()
    except OSError as err:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {err.strerror or err}") from None
    try:
        if port_file is not None:
            write_port_file(port_file, server.port)
        events = f", KV events on {server.kv_events_endpoint}" if server.kv_events_endpoint else ""
        print(
            f"epp-sim serve-engine: model {config.model!r} on {server.url}{events}",
            file=sys.stderr,
            flush=True,
        )
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        await done.wait()
    finally:
        await server.stop()


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    asyncio.run(serve(config, Path(args.port_file) if args.port_file else None))
    return 0
