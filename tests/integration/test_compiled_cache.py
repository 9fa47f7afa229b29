"""The compiled code an image carries: `epp warm-up` at build time, `epp serve` seeding its cache from it.

A pod whose cache was seeded must compile nothing, neither in its warm-up nor while it serves: every
argument type serving gives a compiled loop must be in what `epp warm-up` compiled. The serving workload
below is wider than the warm-up's own (`epp/kvindex/compiled.py`): other batch shapes and hashes, engine
block sizes, more pods than one mask chunk, every lookup. Any loop it compiles is a signature the warm-up
misses (the run's cache holds only the seed), and the test names it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp

from epp.testing.backend import FakeModelServer
from epp.testing.envoy import free_port
from epp.testing.wait import http_ok

CPU = "x86-64-v2"  # as the Dockerfile builds it

SERVING = r"""
import json, os
import numpy as np
from numba.core import event
compiled = []
class Listener(event.Listener):
    def on_start(self, e): compiled.append(e.data["dispatcher"].py_func.__qualname__)
    def on_end(self, e): pass
event.register("numba:compile", Listener())

from epp.server.numba_cache import seed_cache
from epp.kvindex import compiled as loops
seeded = seed_cache(os.environ)
loops.warm_up()
in_warm_up = list(compiled)

from epp.costmodel.estimate import estimate_all
from epp.costmodel.profile import DEFAULT_REFERENCE, REFERENCE_PROFILES
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import KvIngest
from epp.kvindex.keys import block_keys, root_key
from epp.testing.kv_wire import cleared, encode_batch, removed, stored
from epp.types import Endpoint

def tokens(n, seed):
    return [(seed * 7919 + t) % 60_000 for t in range(n)]

pods = [f"10.0.{i // 200}.{i % 200}:8000" for i in range(40)]  # two 32-pod mask chunks
for block_size, max_entries in ((16, 100_000), (16, 700), (64, 100_000)):
    index = BlockIndex(block_size=block_size, max_entries=max_entries)
    ingest = KvIngest(index, FreshnessTracker(), lambda pod: "m")
    seq = {}
    def send(pod, events, rank=0, dp=None):
        seq[pod] = seq.get(pod, -1) + 1
        ingest.on_live(pod, rank, seq[pod], encode_batch(events, dp, 2.0), 2.0)
    for p, pod in enumerate(pods):
        form = "array" if p % 3 == 0 else "map"
        parent = None
        for batch in range(6):
            events = []
            for e in range(1 + (p + batch) % 9):
                ebs = 32 if p % 5 == 0 else 16
                n = 1 + (e + p) % 6
                plain = [p * 10_000 + batch * 100 + e * 10 + j for j in range(n)]
                hashes = [2**64 - 1 - h for h in plain] if p % 2 else plain  # above 2**63 too
                ntok = n * ebs - (3 if e == 0 and p % 7 == 0 else 0)
                medium = ("GPU", "CPU", "cpu_pinned", "DISK", None, "HBM")[(p + e) % 6]
                lora = "adapter" if p % 4 == 1 else None
                events.append(stored(hashes, parent, tokens(ntok, p + e), ebs, medium, lora, form=form))
                parent = hashes[-1]
            if batch >= 2:
                events.append(removed([p * 10_000 + (batch - 2) * 100 + 1], "GPU", form=form))
                events.append(removed([12345678], "CPU", form=form))
            send(pod, events, dp=p % 2 if p % 6 == 0 else None)
        send(pod, [stored([99, 98], None, tokens(32, 5), 16, "GPU", extra_keys=[["tenant-salt"], None])])
    send(pods[0], [cleared()])
    for p, pod in enumerate(pods[:8]):
        root = root_key("m")
        index.store(pod, [p + 1, p + 2], None, np.array(tokens(32, p), dtype=np.int32), 16, "gpu", root)
        u32 = np.array(tokens(16, p), dtype=np.uint32)
        more = [([p + 3], p + 2, tokens(16, p), 16, "cpu", root), ([p + 4], p + 3, u32, 16, "cpu", root)]
        index.store_many(pod, more)
        index.remove(pod, [p + 1], "gpu")
        index.discard(pod, [p + 3, 424242], "cpu")
    for dtype in (np.int64, np.int32, np.uint32, np.uint64):
        keys = block_keys(np.array(tokens(2048, 3), dtype=dtype), block_size, root_key("m"))
    keys_list = block_keys(tokens(300, 1), block_size, root_key("adapter", "tenant"))
    for k in (keys, keys_list, keys[:1]):
        index.lookup(k, pods + ["unknown:1"])
        index.lookup_weighted(k, pods, {"gpu": 1.0, "cpu": 0.8, "storage": 0.5}, 0.1)
        index.lookup_by_best_tier(k, pods, lambda t: {"gpu": 1.0}.get(t, 0.3))
        for order in (["gpu"], ["gpu", "cpu"], ["gpu", "cpu", "storage"], ["gpu", "cpu", "storage", "hbm"]):
            index.lookup_tier_runs(k, pods, order)
    index.clear_pod(pods[1])
    index.stats()
    index.pods()
    index.pod_counts(pods[2])
profile = REFERENCE_PROFILES[DEFAULT_REFERENCE]
endpoints = [Endpoint(f"e{i}:1") for i in range(64)]
held = {"gpu": np.arange(64, dtype=np.float64), "cpu": np.ones(64)}
estimate_all(profile, endpoints, 6000, held)
estimate_all(profile, endpoints[:1], 10, None, 0.5, 2.0)
print(json.dumps({"seeded": seeded, "in_warm_up": in_warm_up, "serving": compiled[len(in_warm_up):]}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "EPP_"))}
    return {**env, "NUMBA_CPU_NAME": CPU, **extra}


async def _run(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out, err = await asyncio.wait_for(proc.communicate(), 600)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_a_pod_seeded_from_the_image_compiles_nothing_while_it_serves(tmp_path: Path) -> None:
    seed = tmp_path / "image-numba-cache"
    rc, out, err = await _run(sys.executable, "-m", "epp", "warm-up", env=_env(NUMBA_CACHE_DIR=str(seed)))
    assert rc == 0, err
    assert "compiled loops" in out and str(seed) in out
    built = sorted(p.name for p in seed.rglob("*.nbi"))
    assert built, "epp warm-up left no cache index"

    run = tmp_path / "pod-numba-cache"
    rc, out, err = await _run(
        sys.executable, "-c", SERVING, env=_env(NUMBA_CACHE_DIR=str(run), EPP_NUMBA_CACHE_SEED=str(seed))
    )
    assert rc == 0, err
    result = json.loads(out.splitlines()[-1])
    assert result["seeded"] == sum(1 for p in seed.rglob("*") if p.is_file())
    assert result["in_warm_up"] == [], "the warm-up compiled what the image should carry"
    assert result["serving"] == [], "serving compiled loops the warm-up does not cover"
    assert sorted(p.name for p in run.rglob("*.nbi")) == built  # nothing new was cached either

    # `epp serve` itself seeds its cache from the image's before it loads the loops
    served = tmp_path / "serve-numba-cache"
    metrics_port = free_port()
    async with FakeModelServer("pod-0") as backend:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "epp", "serve", "--endpoints", backend.address, "--host", "127.0.0.1"),
            *("--grpc-port", str(free_port()), "--grpc-health-port", str(free_port())),
            *("--metrics-port", str(metrics_port), "--secure-serving=false", "--log-level", "info"),
            env=_env(NUMBA_CACHE_DIR=str(served), EPP_NUMBA_CACHE_SEED=str(seed)),
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with aiohttp.ClientSession() as s:
                await http_ok(s, f"http://127.0.0.1:{metrics_port}/readyz", "epp serve ready", process=proc)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err_bytes = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err_bytes.decode()
    assert f"seeded {result['seeded']} files of compiled code" in err_bytes.decode()
    assert sorted(p.name for p in served.rglob("*.nbi")) == built
