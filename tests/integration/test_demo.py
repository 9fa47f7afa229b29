"""`epp demo` end to end: simulated pods (or given engines), the EPP and a real Envoy, as processes.

Short runs: the figures themselves are the demo's business (and vary with the machine); what is
checked is that every policy served every request, the report and summary say so, and that the demo
stops every process it started.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import psutil
import pytest

from epp.testing.envoy import free_port
from epp.testing.tokenizer import build_tiny_tokenizer
from simulator.engine import EngineConfig
from simulator.serving import EngineServerConfig, SimulatedEngineServer

pytestmark = pytest.mark.envoy


async def _demo(*argv: str, timeout_s: float = 240.0) -> tuple[int, str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp", "demo", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _leftovers(marker: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if marker in cmd:
            found.append(cmd)
    return found


def _summary(workdir: Path) -> dict[str, object]:
    (run,) = workdir.glob("run-*")
    loaded: dict[str, object] = json.loads((run / "summary.json").read_text())
    return loaded


async def test_demo_compares_the_default_profile_with_round_robin_and_stops_all(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    code, out, err = await _demo(
        "--pods", "2", "--duration", "4", "--rate", "3", "--workdir", str(workdir), "--seed", "7"
    )  # fmt: skip
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "default vs round-robin" in out and "token hit rate" in out
    policies = _summary(workdir)["policies"]
    assert isinstance(policies, dict) and set(policies) == {"default", "round-robin"}
    requests = {name: fig["requests"] for name, fig in policies.items()}
    assert requests["default"] == requests["round-robin"] > 0  # the same workload for both
    for name, fig in policies.items():
        assert fig["errors"] == 0, name
        per_pod = fig["requests_per_pod"]
        assert len(per_pod) == 2 and sum(per_pod.values()) == fig["requests"], name
        assert fig["token_hit_rate"] > 0, name  # multi-turn sessions resend their prefix
    for policy in ("default", "round-robin"):
        logs = next(workdir.glob("run-*")) / policy
        assert (logs / "requests.jsonl").is_file() and (logs / "pod-0.log").is_file()
    assert _leftovers(str(workdir)) == []


async def test_demo_drives_given_engines_with_per_pod_kv_events(tmp_path: Path) -> None:
    tokenizer = build_tiny_tokenizer(tmp_path / "tok")
    events_port = free_port()
    cfg = EngineServerConfig(
        model="real-model",
        tokenizer=tokenizer,
        engine=EngineConfig(num_gpu_blocks=2048, model="real-model"),
        kv_events_endpoint=f"tcp://127.0.0.1:{events_port}",
        kv_events_mode="bind",
    )
    async with SimulatedEngineServer(cfg) as engine:
        code, out, err = await _demo(
            "--engines", engine.address, "--model", "real-model", "--tokenizer", str(tokenizer),
            "--kv-events-port", str(events_port), "--policies", "default", "--workload", "shared-prefix",
            "--duration", "3", "--rate", "3", "--workdir", str(tmp_path / "demo"),
        )  # fmt: skip
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "caches were not reset" in out
    fig = _summary(tmp_path / "demo")["policies"]["default"]  # type: ignore[index]
    assert fig["errors"] == 0 and fig["requests_per_pod"] == {engine.address: fig["requests"]}


async def test_demo_refuses_bad_flags_before_starting_anything(tmp_path: Path) -> None:
    code, _, err = await _demo("--policies", "default,fastest", "--workdir", str(tmp_path / "d"))
    assert code == 2 and "unknown policy 'fastest'" in err
    assert not (tmp_path / "d").exists()
