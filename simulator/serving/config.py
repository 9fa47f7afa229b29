"""What a simulated engine server is told: `EngineServerConfig`, checked when it is built.

Field names follow vLLM's flags where vLLM has one. `engine` holds `--num-gpu-blocks-override`,
`--block-size`, `--max-num-batched-tokens` and `--max-num-seqs` (it serves `model`, whatever model
it names); `kv_events_*` are the fields of `--kv-events-config`. `kv_events_mode`: "auto" binds the
PUB socket when the endpoint contains `*` or `::` or is `ipc://`/`inproc://` and connects otherwise,
exactly as vLLM decides; "bind" and "connect" force one (e.g. several engines on loopback binding
`tcp://127.0.0.N:5557`). The topic may contain `{address}` (the server's `host:port`, known once
the HTTP port is bound) and `{model}`, so central mode works with an ephemeral HTTP port.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from simulator.engine import EngineConfig
from simulator.latency import DEFAULT_PROFILE, LatencyProfile, latency_profile

KvEventsMode = Literal["auto", "bind", "connect"]
KV_EVENTS_MODES: tuple[str, ...] = ("auto", "bind", "connect")
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


def binds(endpoint: str, mode: str = "auto") -> bool:
    """Does the PUB socket bind `endpoint` (else connect)? vLLM's rule for "auto"."""
    if mode != "auto":
        return mode == "bind"
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True, slots=True)
class EngineServerConfig:
    """`time_scale`: wall-clock seconds per engine second (2.0 runs the engine twice as slow as its
    latency profile says, 0.5 twice as fast). `default_max_tokens`: when a request names none.
    `stream_interval`: tokens per streamed chunk (vLLM's `--stream-interval`). `kv_buffer_steps`: batches
    kept for replay (vLLM's `buffer_steps`)."""

    model: str = "model"
    host: str = "127.0.0.1"
    port: int = 0
    tokenizer: Path | str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    latency: str | LatencyProfile = DEFAULT_PROFILE  # a name in `latency.PROFILES`, or a profile
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_topic: str = ""
    kv_events_mode: KvEventsMode = "auto"
    kv_buffer_steps: int = 10_000
    time_scale: float = 1.0
    default_max_tokens: int = 16
    stream_interval: int = 1

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise ValueError(problem)

    def _problem(self) -> str | None:
        if not self.model or any(c.isspace() for c in self.model):
            return f"model must be a non-empty name without spaces, got {self.model!r}"
        if not 0 <= self.port < 65536:
            return f"port must be in 0..65535, got {self.port}"
        if not self.host:
            return "host must not be empty"
        if isinstance(self.latency, str):
            try:
                latency_profile(self.latency)
            except ValueError as err:
                return str(err)
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            return f"time_scale must be a finite number > 0, got {self.time_scale}"
        if self.default_max_tokens < 1:
            return f"default_max_tokens must be >= 1, got {self.default_max_tokens}"
        if self.stream_interval < 1:
            return f"stream_interval must be >= 1, got {self.stream_interval}"
        if self.kv_buffer_steps < 1:
            return f"kv_buffer_steps must be >= 1, got {self.kv_buffer_steps}"
        if self.kv_events_mode not in KV_EVENTS_MODES:
            return f"kv_events_mode must be one of {', '.join(KV_EVENTS_MODES)}, got {self.kv_events_mode!r}"
        for name in ("kv_events_endpoint", "kv_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(_ZMQ_SCHEMES):
                return f"{name} must be a ZeroMQ endpoint such as tcp://*:5557, got {value!r}"
        if self.kv_replay_endpoint is not None and self.kv_events_endpoint is None:
            return "kv_replay_endpoint needs kv_events_endpoint (there is nothing to replay)"
        return None

    @property
    def engine_config(self) -> EngineConfig:
        """`engine` serving `model` (its metrics' `model_name`), whatever model it named."""
        return replace(self.engine, model=self.model)

    @property
    def max_model_len(self) -> int:
        """Tokens one request can hold (prompt + output): every usable KV block."""
        return (self.engine.num_gpu_blocks - 1) * self.engine.block_size
