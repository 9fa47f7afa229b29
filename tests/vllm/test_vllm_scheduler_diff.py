"""The simulated engine against vLLM's own `Scheduler`, step by step, on small random workloads.

vLLM's V1 `Scheduler` (from the vLLM venv of `make test-vllm`, driven by `scheduler_driver.py` in that
venv's interpreter: no model runs, the "model" returns the workload's output ids) and our `Engine`
get the same requests at the same steps: shared prefixes (so prefix hits and hit blocks sitting in the
free queue), prompts longer than the token budget (chunked prefill), a KV cache small enough to queue
and preempt, and aborts of waiting and running requests. Compared exactly:

- per request: the step of its first token and of its finish, the cached tokens of its first
  scheduling, its preemptions and output tokens (an aborted one: none from the step it was aborted in);
- per step, after scheduling: running and waiting requests, free blocks, preemptions so far;
- per step, the stats of its end (`update_from_output`), which is what `/metrics` shows and what our
  `Engine.metrics()` must return during the next step: running, waiting, blocks in use, prefix-cache
  queries and hits.

Our steps are numbered as the driver numbers vLLM's (see `scheduler_driver.py`): a kernel event after
each step's end submits the requests of the next step before it is scheduled, and one just after its
start reads the scheduler and aborts. Skipped, as the rest of tests/vllm, without `make test-vllm`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simulator.engine import Engine, EngineConfig
from simulator.kernel import Kernel
from simulator.latency import PROFILES
from simulator.records import RequestRecord, SimRequest
from tests.vllm.conftest import configured

DRIVER = Path(__file__).with_name("scheduler_driver.py")
BS = 16


def workload(seed: int, num_blocks: int, max_batched: int, max_seqs: int, n: int = 60) -> dict[str, Any]:
    """n requests arriving ~3 steps apart: 70% one of five shared prefixes (100-1,000 tokens) plus up to
    600 fresh tokens, 10% an exact repeat of an earlier prompt, 20% fresh (1-1,500 tokens); 1-120 output
    tokens; about one in eight aborted a few steps after it arrived (waiting or running by then)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, 30000, k).tolist() for k in (100, 256, 400, 777, 1000)]
    reqs: list[dict[str, Any]] = []
    step = 0
    for i in range(n):
        step += int(rng.poisson(3))
        kind = rng.random()
        if kind < 0.7:
            prompt = (
                prefixes[int(rng.integers(0, 5))] + rng.integers(1, 30000, int(rng.integers(0, 600))).tolist()
            )
        elif kind < 0.8 and reqs:
            prompt = list(reqs[int(rng.integers(0, len(reqs)))]["prompt"])
        else:
            prompt = rng.integers(1, 30000, int(rng.integers(1, 1500))).tolist()
        max_tokens = int(rng.integers(1, 120))
        abort = step + int(rng.integers(0, 40)) if rng.random() < 0.12 else None
        outputs = rng.integers(1, 30000, max_tokens).tolist()
        reqs.append(
            {"id": i, "prompt": prompt, "outputs": outputs, "max_tokens": max_tokens, "arrive_step": step,
             "abort_step": abort}
        )  # fmt: skip
    cfg = {"num_blocks": num_blocks, "block_size": BS, "max_batched": max_batched, "max_seqs": max_seqs}
    return {"cfg": cfg, "requests": reqs}


WORKLOADS = [
    workload(1, 200, 512, 16),  # the review's case: 33 preemptions before the full-ISL gate, vLLM 5
    workload(2, 160, 256, 8),  # tighter: long queues, chunks of 256
    workload(3, 400, 1024, 32),  # roomier, long prompts in one or two chunks
    workload(4, 130, 384, 4, n=40),  # max_num_seqs binds
]


def run_ours(wl: dict[str, Any]) -> dict[str, Any]:
    cfg = wl["cfg"]
    k = Kernel()
    step = 0
    first: dict[str, int] = {}
    finish: dict[str, int] = {}
    engine = Engine(
        k,
        EngineConfig(
            num_gpu_blocks=cfg["num_blocks"],
            block_size=cfg["block_size"],
            max_num_batched_tokens=cfg["max_batched"],
            max_num_seqs=cfg["max_seqs"],
            async_scheduling=False,  # the driver steps vLLM's Scheduler as its synchronous engine core does
        ),
        PROFILES["llama-3.1-8b-h100"],
        on_first_token=lambda rec, t: first.__setitem__(rec.request_id, step),
        on_finish=lambda rec, t: finish.__setitem__(rec.request_id, step),
        spans=False,  # a kernel event per step: the probes below see every one
    )
    arrivals: dict[int, list[dict[str, Any]]] = {}
    aborts: dict[int, list[str]] = {}
    for r in wl["requests"]:
        arrivals.setdefault(r["arrive_step"], []).append(r)
        if r["abort_step"] is not None:
            aborts.setdefault(r["abort_step"], []).append(str(r["id"]))
    recs: dict[str, RequestRecord] = {}
    sched_log: list[list[int]] = []
    stats_log: list[list[int]] = []
    usable = cfg["num_blocks"] - 1

    ran = False  # a step was scheduled

    def between() -> None:
        """After step `step` ended (its callbacks ran), before the next one is scheduled."""
        nonlocal step, ran
        if ran:
            m = engine.metrics()
            assert m.kv_usage is not None and m.prefix_cache_queries is not None
            used = round(m.kv_usage * usable)
            q, h = int(m.prefix_cache_queries), int(m.prefix_cache_hits or 0)
            stats_log.append([step, m.running, m.waiting, used, q, h])
            step += 1
        if not (engine.waiting or engine.running):
            if not arrivals:
                return
            step = max(step, min(arrivals))
        for r in arrivals.pop(step, []):
            req = SimRequest(str(r["id"]), r["prompt"], r["max_tokens"], output_token_ids=r["outputs"])
            recs[req.request_id] = engine.submit(req)
        k.schedule(0.0, during)  # after the step's start, which the submit or the step's end scheduled

    def during() -> None:
        """Step `step` was scheduled; its end is the engine's only pending event."""
        nonlocal ran
        ran = True
        sched_log.append(
            [step, len(engine.running), len(engine.waiting), engine.pool.num_free, engine.preemptions]
        )
        for rid in aborts.pop(step, []):
            engine.abort(recs[rid])
        # after the step's end event (the same time, scheduled later) and before the next step's start
        k.at(k.peek(), between)

    k.schedule(0.0, between)
    k.run()
    assert engine.idle and engine.pool.num_free == usable
    per_request = {
        rid: [
            first.get(rid),
            finish.get(rid),
            None if rec.scheduled_s is None else rec.cached_tokens,
            rec.preemptions,
            rec.output_tokens,
        ]
        for rid, rec in recs.items()
    }
    return {"sched": sched_log, "stats": stats_log, "requests": per_request}


@pytest.fixture(scope="module")
def vllm_results() -> list[dict[str, Any]]:
    conf = configured()
    if isinstance(conf, str):
        pytest.skip(conf)
    python, model = conf
    done = subprocess.run(
        [str(python), str(DRIVER), str(model.resolve())],
        input=json.dumps(WORKLOADS),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"the vLLM scheduler driver failed ({done.returncode}):\n{done.stderr[-4000:]}")
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


def first_differences(ours: list[list[int]], theirs: list[list[int]], what: str) -> str:
    rows = [f"{what}: ours {a} vLLM {b}" for a, b in zip(ours, theirs, strict=False) if a != b][:8]
    if len(ours) != len(theirs):
        rows.append(f"{what}: {len(ours)} steps against vLLM's {len(theirs)}")
    return "\n".join(rows)


@pytest.mark.parametrize("index", range(len(WORKLOADS)))
def test_the_engine_matches_vllms_scheduler_step_by_step(
    index: int, vllm_results: list[dict[str, Any]]
) -> None:
    wl = WORKLOADS[index]
    ours, theirs = run_ours(wl), vllm_results[index]
    assert sum(r["abort_step"] is not None for r in wl["requests"]) > 0
    # the workload exercises what it is for: chunked prefill, queueing, preemption (on most), aborts
    assert any(len(r["prompt"]) > wl["cfg"]["max_batched"] for r in wl["requests"])
    assert max(row[2] for row in theirs["sched"]) > 0
    diff_requests = {
        rid: (mine, theirs["requests"].get(rid))
        for rid, mine in ours["requests"].items()
        if mine != theirs["requests"].get(rid)
    }
    assert not diff_requests, (
        "per request [first-token step, finish step, cached, preemptions, outputs]:\n"
        + ("\n".join(f"{rid}: ours {a} vLLM {b}" for rid, (a, b) in list(diff_requests.items())[:10]))
    )
    assert set(ours["requests"]) == set(theirs["requests"])
    assert ours["sched"] == theirs["sched"], first_differences(
        ours["sched"], theirs["sched"], "after scheduling [step, running, waiting, free blocks, preemptions]"
    )
    assert ours["stats"] == theirs["stats"], first_differences(
        ours["stats"],
        theirs["stats"],
        "end-of-step stats [step, running, waiting, used blocks, queries, hits]",
    )


def test_the_workloads_preempt_and_abort_in_vllm(vllm_results: list[dict[str, Any]]) -> None:
    """What the comparison is worth: vLLM itself preempted and saw aborted requests of every kind."""
    preempted = [res["sched"][-1][4] for res in vllm_results]
    assert sum(p > 0 for p in preempted) >= 2, preempted
    aborted_running = aborted_waiting = 0
    for wl, res in zip(WORKLOADS, vllm_results, strict=True):
        for r in wl["requests"]:
            if r["abort_step"] is None:
                continue
            first, fin, *_ = res["requests"][str(r["id"])]
            if fin is not None:
                continue  # finished before its abort came
            if first is None and res["requests"][str(r["id"])][2] is None:
                aborted_waiting += 1
            else:
                aborted_running += 1
    assert aborted_running > 0 and aborted_waiting > 0, (aborted_running, aborted_waiting)
