"""Seed inputs for the fuzz targets (written into the corpus directory by `run.py`), so the fuzzer
starts from real shapes: OpenAI bodies, vLLM event batches, a vLLM /metrics page, our configs."""

from __future__ import annotations

import json

from epp.config import DEFAULT_CONFIG_YAML, LOAD_AWARE_CONFIG_YAML
from epp.testing.kv_wire import cleared, encode_batch, removed, stored

FRAME_SEP = b"\x00\xff\x00"  # kv_frames splits its input into ZeroMQ frames at this marker


def _body(path_index: int, doc: object) -> bytes:
    return bytes([path_index]) + json.dumps(doc).encode()


def _frames(mode: int, *frames: bytes) -> bytes:
    """`mode` 0: per-pod, 1: central (the target's first byte)."""
    return bytes([mode]) + FRAME_SEP.join(frames)


_BATCH = encode_batch(
    [
        stored([1, 2], None, list(range(32)), 16),
        removed([2]),
        stored([3], 1, list(range(16)), 16, medium="CPU"),
    ],
    None,
    1.0,
)
_ARRAY_BATCH = encode_batch([stored([7], None, list(range(16)), 16, form="array"), cleared("array")], 0, 2.0)

SEEDS: dict[str, list[bytes]] = {
    "request_body": [
        _body(0, {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "stream": True}),
        _body(
            0,
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": [{"type": "text", "text": "x"}]},
                    {"role": "developer", "content": "be brief"},
                ],
            },
        ),
        _body(1, {"model": "m", "prompt": "once upon a time", "max_tokens": 16, "cache_salt": "s"}),
        _body(1, {"model": "m", "prompt": [1, 2, 3, 4] * 10}),
        _body(1, {"model": "m", "prompt": [[1, 2], [3]]}),
        _body(2, {"model": "m", "input": ["a", "b"]}),
        _body(3, {"model": "m", "input": [{"role": "user", "content": "hi"}]}),
    ],
    "kv_frames": [
        _frames(1, b"kv@10.0.0.1:8000@m", (0).to_bytes(8, "big"), _BATCH),
        _frames(0, b"", (1).to_bytes(8, "big"), _ARRAY_BATCH),
        _frames(0, b"", (2).to_bytes(8, "big"), _BATCH),
        _frames(1, b"kv@10.0.0.1@m", (5).to_bytes(8, "big"), encode_batch([], 3, 0.0)),
    ],
    "metrics_text": [
        b"# HELP vllm:num_requests_waiting waiting\n# TYPE vllm:num_requests_waiting gauge\n"
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        b'vllm:cache_config_info{block_size="16",num_gpu_blocks="2048"} 1.0\n'
        b'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
        b'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0\n'
        b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9\n',
        b"sglang:num_queue_reqs 1\nsglang:num_running_reqs 2\nsglang:token_usage 0.5\n",
    ],
    "config": [
        DEFAULT_CONFIG_YAML.encode(),
        LOAD_AWARE_CONFIG_YAML.encode(),
        (
            DEFAULT_CONFIG_YAML + "kvEvents: {mode: per-pod, port: 5557, replayPort: 5558, dpRanks: 2}\n"
            "index: {blockSize: 16, maxEntries: 1000}\nadmission: {ttftSlo: 2s}\nexplain: {keep: 10}\n"
            "saturationDetector: {queueDepthThreshold: 5, metricsStalenessThreshold: 200ms}\n"
            "endpoints: [10.0.0.1:8000, {address: '[::1]:80', model: m}]\n"
            "objectives: [{name: batch, priority: -1}]\n"
            "costModel: {profiles: [{model: m, kvBytesPerToken: 131072}], calibration: {warmup: 3}}\n"
        ).encode(),
    ],
}
