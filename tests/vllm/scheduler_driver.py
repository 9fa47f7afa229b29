"""Drive vLLM's own V1 `Scheduler` (no model, no workers) through workloads; print what it did as JSON.

Run by `test_vllm_scheduler_diff.py` in the vLLM venv's interpreter (it imports vllm and torch, never
our code): `python scheduler_driver.py MODEL_DIR < workloads.json > result.json`. MODEL_DIR only gives
vLLM a model config (the tiny model of tools/build_tiny_model.py); nothing runs on it.

Input: a JSON list of workloads, each `{"cfg": {num_blocks, block_size, max_batched, max_seqs},
"requests": [{"id", "prompt", "outputs", "max_tokens", "arrive_step", "abort_step"}]}` (`abort_step`
may be null). Steps are numbered as the engine core runs them: a request with `arrive_step` k is added
before step k is scheduled (when the scheduler has nothing unfinished, the numbering jumps to the next
arrival, as an idle engine waits); one with `abort_step` k is aborted while step k runs, i.e. after
`schedule()` and before `update_from_output`, where `EngineCore.step` drains its aborts queue. The
"model" samples each request's next id from `outputs`.

Output, per workload: `sched` (per step, after `schedule()`: running, waiting, free blocks, preemptions
so far), `stats` (per step, the `SchedulerStats` of `update_from_output`: running, waiting, blocks in
use, prefix-cache queries and hits so far) and per request its first-token and finish steps, cached
tokens at its first scheduling, preemptions and output tokens.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager


def scheduler(model: str, cfg: dict[str, int]) -> Scheduler:
    """vLLM's scheduler with its defaults (prefix caching, chunked prefill, full-ISL admission)."""
    bs, nb = cfg["block_size"], cfg["num_blocks"]
    model_config = ModelConfig(model=model, max_model_len=65536, dtype="float32", seed=0)
    sched = SchedulerConfig(
        max_num_seqs=cfg["max_seqs"],
        max_num_batched_tokens=cfg["max_batched"],
        max_model_len=65536,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=bs, cache_dtype="auto", enable_prefix_caching=True)
    cache.num_gpu_blocks = nb
    vllm_config = VllmConfig(
        scheduler_config=sched,
        model_config=model_config,
        cache_config=cache,
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=nb, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=bs,
    )


def run(model: str, wl: dict[str, Any]) -> dict[str, Any]:
    cfg = wl["cfg"]
    s = scheduler(model, cfg)
    assert s.scheduler_reserve_full_isl  # vLLM 0.32's default, which the simulated engine follows
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(cfg["block_size"], hash_fn)
    pool = s.kv_cache_manager.block_pool
    usable = cfg["num_blocks"] - 1
    spec = {str(r["id"]): r for r in wl["requests"]}
    arrivals: dict[int, list[dict[str, Any]]] = {}
    aborts: dict[int, list[str]] = {}
    for r in wl["requests"]:
        arrivals.setdefault(r["arrive_step"], []).append(r)
        if r["abort_step"] is not None:
            aborts.setdefault(r["abort_step"], []).append(str(r["id"]))
    reqs: dict[str, Request] = {}
    first: dict[str, int] = {}
    finish: dict[str, int] = {}
    cached: dict[str, int] = {}
    sched_log: list[list[int]] = []
    stats_log: list[list[int]] = []
    step = preemptions = queries = hits = 0
    while arrivals or s.get_num_unfinished_requests():
        if not s.get_num_unfinished_requests():
            step = max(step, min(arrivals))  # idle until the next arrival
        for r in arrivals.pop(step, []):
            sp = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0)
            rq = Request(
                str(r["id"]), list(r["prompt"]), sp, None, block_hasher=hasher, arrival_time=float(step)
            )
            reqs[rq.request_id] = rq
            s.add_request(rq)
        out = s.schedule()
        for new in out.scheduled_new_reqs:
            cached.setdefault(new.req_id, new.num_computed_tokens)
        preemptions += len(out.preempted_req_ids or ())
        running, waiting = s.get_request_counts()
        sched_log.append([step, running, waiting, pool.get_num_free_blocks(), preemptions])
        ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in ids:
            rq = s.requests[rid]
            done = rq.num_computed_tokens >= rq.num_tokens  # (schedule() already advanced it)
            sampled.append([spec[rid]["outputs"][len(rq.output_token_ids)]] if done else [])
        s.finish_requests(aborts.pop(step, []), RequestStatus.FINISHED_ABORTED)  # aborted mid-step
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled
        )
        stats = None
        for eco in s.update_from_output(out, mro).values():
            for o in eco.outputs:
                if o.new_token_ids and o.request_id not in first:
                    first[o.request_id] = step
                if o.finish_reason is not None:
                    finish[o.request_id] = step
            stats = eco.scheduler_stats or stats
        assert stats is not None and stats.prefix_cache_stats is not None
        queries += stats.prefix_cache_stats.queries
        hits += stats.prefix_cache_stats.hits
        used = round(stats.kv_cache_usage * usable)
        stats_log.append([step, stats.num_running_reqs, stats.num_waiting_reqs, used, queries, hits])
        step += 1
    per_request = {
        rid: [first.get(rid), finish.get(rid), cached.get(rid), rq.num_preemptions, len(rq.output_token_ids)]
        for rid, rq in reqs.items()
    }
    return {"sched": sched_log, "stats": stats_log, "requests": per_request}


def main() -> None:
    model = sys.argv[1]
    workloads = json.load(sys.stdin)
    json.dump([run(model, wl) for wl in workloads], sys.stdout)


if __name__ == "__main__":
    main()
