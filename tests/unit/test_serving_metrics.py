"""The simulated engine's /metrics page: vLLM's names, read back by the EPP's own parser."""

from __future__ import annotations

import numpy as np

from epp.sources.metrics_text import parse_metrics
from simulator.engine import Engine, EngineConfig
from simulator.kernel import Kernel
from simulator.records import SimRequest
from simulator.serving.metrics import TTFT_BUCKETS, EngineMetrics

BS = 16


def sample(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + "{")]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].rsplit(" ", 1)[1])


def build(max_num_seqs: int = 1) -> tuple[Kernel, Engine, EngineMetrics]:
    kernel = Kernel()
    engine = Engine(
        kernel, EngineConfig(num_gpu_blocks=64, block_size=BS, max_num_seqs=max_num_seqs, model="m")
    )
    metrics = EngineMetrics(engine, "m")
    engine.on_first_token = metrics.on_first_token
    engine.on_finish = metrics.on_finish
    return kernel, engine, metrics


def test_queue_and_cache_state_reach_the_epp_parser() -> None:
    kernel, engine, metrics = build()
    prompt = np.arange(5 * BS + 3, dtype=np.int64)
    engine.submit(SimRequest("a", prompt, max_tokens=20))
    engine.submit(SimRequest("b", prompt, max_tokens=20))
    kernel.step()  # the first step starts: "a" runs, "b" waits (max_num_seqs=1)
    snap = parse_metrics(metrics.render().decode(), observed_at=1.0)
    assert (snap.running, snap.waiting, snap.kv_usage) == (0, 0, 0.0)  # no step has ended: vLLM's first stats
    assert engine.pool.num_used > 0  # (though the step took blocks)
    while engine.stats.running == 0:  # until the first step has ended
        kernel.step()
    snap = parse_metrics(metrics.render().decode(), observed_at=1.0)
    assert (snap.running, snap.waiting) == (1, 1)
    assert snap.kv_usage == engine.metrics().kv_usage > 0
    assert (snap.block_size, snap.num_gpu_blocks) == (BS, 64)
    assert snap.models == frozenset({"m"})
    kernel.run()
    snap = parse_metrics(metrics.render().decode(), observed_at=2.0)
    assert (snap.running, snap.waiting) == (0, 0)
    # The second request hit the first one's full prompt blocks, as the engine counted them.
    assert snap.prefix_cache_queries == engine.prefix_cache_queries == 2 * len(prompt)
    assert snap.prefix_cache_hits == engine.prefix_cache_hits == (len(prompt) - 1) // BS * BS


def test_request_counters_and_histograms() -> None:
    kernel, engine, metrics = build(max_num_seqs=4)
    records = [
        engine.submit(SimRequest(f"r{i}", np.arange(30 + i, dtype=np.int64), max_tokens=3)) for i in range(3)
    ]
    kernel.run()
    text = metrics.render().decode()
    labels = '{engine="0",model_name="m"}'
    assert sample(text, "vllm:prompt_tokens_total") == sum(r.prompt_tokens for r in records)
    assert sample(text, "vllm:generation_tokens_total") == 9
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0' in text
    assert f"vllm:time_to_first_token_seconds_count{labels} 3.0" in text
    ttft_sum = sum(r.ttft_s or 0.0 for r in records)
    assert sample(text, "vllm:time_to_first_token_seconds_sum") == ttft_sum
    buckets = [
        line for line in text.splitlines() if line.startswith("vllm:time_to_first_token_seconds_bucket")
    ]
    assert len(buckets) == len(TTFT_BUCKETS) + 1 and buckets[-1].endswith(" 3.0")
    counts = [float(b.rsplit(" ", 1)[1]) for b in buckets]
    assert counts == sorted(counts)  # cumulative
    assert "_created" not in text  # counters come from plain ints, no creation-time series
    assert sample(text, "vllm:num_preemptions_total") == 0
