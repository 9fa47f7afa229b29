"""The functional core stays pure: no I/O libraries, no wall clock, no module-level random."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PURE = [
    "epp/scheduling",
    "epp/kvindex",
    "epp/costmodel",
    "epp/tenancy.py",
    "epp/types.py",
    "epp/config.py",
    "epp/config_sections.py",
    "epp/requests.py",
    "epp/responses_api.py",
    "epp/usage.py",
    "epp/datastore.py",
    "epp/accounting.py",
    "epp/durations.py",
    "epp/sources/metrics_text.py",
    "epp/testing/fakes.py",
    "epp/testing/kv_wire.py",
    "epp/discovery/pool.py",
    "epp/discovery/settings.py",
    "epp/discovery/rewrites.py",
    "epp/discovery/selector.py",
    "epp/demo/workload.py",
    "epp/demo/report.py",
    "simulator/kernel.py",
    "simulator/latency.py",
    "simulator/hashing.py",
    "simulator/blocks.py",
    "simulator/offload.py",
    "simulator/events.py",
    "simulator/records.py",
    "simulator/kvcache.py",
    "simulator/engine.py",
    "simulator/scheduler.py",
    "simulator/cpu_loads.py",
    "simulator/decode_batch.py",
    "simulator/engine_config.py",
    "simulator/step_stats.py",
    "simulator/trace_span.py",
    "simulator/engine_replay.py",
]
FORBIDDEN_MODULES = {"asyncio", "grpc", "aiohttp", "zmq", "prometheus_client", "kubernetes_asyncio", "time"}
FORBIDDEN_CALLS = {
    ("random", "random"),
    ("random", "choice"),
    ("random", "shuffle"),
    ("random", "randint"),
    ("random", "randrange"),
    ("random", "sample"),
    ("random", "uniform"),
    ("time", "time"),
    ("time", "monotonic"),
    ("time", "perf_counter"),
    ("datetime", "now"),
}


def _files() -> list[pathlib.Path]:
    out: list[pathlib.Path] = []
    for p in PURE:
        path = ROOT / p
        out.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return out


def violations(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(node.module)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = node.func.value
            if isinstance(base, ast.Name) and (base.id, node.func.attr) in FORBIDDEN_CALLS:
                found.append(f"{base.id}.{node.func.attr}()")
    return found


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_module_has_no_io_clock_or_global_random(path: pathlib.Path) -> None:
    assert violations(path.read_text()) == []


@pytest.mark.parametrize(
    "source",
    [
        "import asyncio",
        "from grpc import aio",
        "import zmq.asyncio",
        "x = time.monotonic()",
        "random.shuffle(x)",
        "from prometheus_client import Counter",
    ],
)
def test_the_scanner_catches_violations(source: str) -> None:
    assert violations(source)


def test_the_simulator_core_loads_no_io_library_even_indirectly() -> None:
    """The simulator runs the production router without asyncio, sockets or metrics exporters."""
    import subprocess
    import sys

    code = (
        "import sys, simulator.cluster, simulator.replay, epp.scheduling.builtin\n"
        "io = ('asyncio', 'zmq', 'grpc', 'aiohttp', 'prometheus_client')\n"
        "print(sorted(m for m in io if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
