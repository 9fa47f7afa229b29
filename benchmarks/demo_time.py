"""How long `make demo` takes (target: under five minutes), and what it reported.

Runs `epp demo` with its defaults (4 simulated pods, 40 s of mixed traffic per policy, the default
profile then round-robin) as `make demo` does, in a temporary work directory, and prints the wall
time against the target and the demo's own summary figures.

  python benchmarks/demo_time.py [--repeat 1] [-- extra epp demo flags]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 300.0


def run_once(extra: list[str]) -> tuple[float, dict[str, object]]:
    with tempfile.TemporaryDirectory(prefix="epp-demo-") as tmp:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "epp", "demo", "--workdir", tmp, *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        elapsed = time.perf_counter() - t0
        if done.returncode != 0:
            sys.exit(f"epp demo failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        (run,) = Path(tmp).glob("run-*")
        summary: dict[str, object] = json.loads((run / "summary.json").read_text())
        return elapsed, summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("extra", nargs="*", help="flags passed to epp demo (after --)")
    args = p.parse_args()
    times = []
    summary: dict[str, object] = {}
    for _ in range(args.repeat):
        elapsed, summary = run_once(args.extra)
        times.append(elapsed)
    median = statistics.median(times)
    verdict = "meets" if median < TARGET_S else "MISSES"
    print(
        f"epp demo wall time: median {median:.0f} s over {len(times)} run(s) "
        f"({verdict} the {TARGET_S:.0f} s target)"
    )
    policies = summary.get("policies", {})
    assert isinstance(policies, dict)
    for name, fig in policies.items():
        print(
            f"  {name:12} requests {fig['requests']:5}  errors {fig['errors']:3}  "
            f"TTFT p50 {fig['ttft_p50_s'] * 1000:6.0f} ms  p99 {fig['ttft_p99_s'] * 1000:6.0f} ms  "
            f"token hit rate {fig['token_hit_rate']:.1%}"
        )


if __name__ == "__main__":
    main()
