"""How long a new EPP pod takes to have its compiled loops ready: compiling them, against loading the
code an image carries (`epp warm-up` at build time, `epp serve` seeding its cache from it).

Each run is a fresh process, as a new pod is: (1) `epp warm-up` into an empty `NUMBA_CACHE_DIR` (what a
pod whose image carries no code pays at start, and what the image build pays once); (2) a process that
seeds an empty cache directory from (1)'s, as `epp serve` does, and runs the same warm-up. Wall and CPU
seconds of each, for the CPU name the Dockerfile compiles for.

  python benchmarks/startup.py [--repeats 1] [--cpu-name x86-64-v2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEEDED = """
import os
import pathlib
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's packages first

from epp.server.numba_cache import seed_cache
from epp.kvindex import compiled
seed_cache(os.environ)
compiled.warm_up()
"""


def timed(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(args, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cpu-name", default="x86-64-v2", help="NUMBA_CPU_NAME, as the Dockerfile sets it")
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "EPP_"))}
    base["NUMBA_CPU_NAME"] = args.cpu_name
    cold: list[tuple[float, float]] = []
    seeded: list[tuple[float, float]] = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="epp-startup-") as tmp:
            image, pod = Path(tmp, "image"), Path(tmp, "pod")
            cold.append(
                timed([sys.executable, "-m", "epp", "warm-up"], {**base, "NUMBA_CACHE_DIR": str(image)})
            )
            env = {**base, "NUMBA_CACHE_DIR": str(pod), "EPP_NUMBA_CACHE_SEED": str(image)}
            seeded.append(timed([sys.executable, "-c", SEEDED], env))
    for name, runs in (("compiling (no code in the image)", cold), ("seeded from the image's code", seeded)):
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(
            f"{name:34}: {wall:6.1f} s wall, {cpu:6.1f} s CPU (median of {len(runs)}, a fresh process each)"
        )
    ratio = statistics.median(w for w, _ in cold) / statistics.median(w for w, _ in seeded)
    print(f"ratio: seeded is {ratio:.0f}x faster")


if __name__ == "__main__":
    main()
