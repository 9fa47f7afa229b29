"""Run one fuzz target for a while: `python fuzz/run.py TARGET SECONDS` (TARGET: request_body,
kv_frames, metrics_text, config). Needs `atheris` (`make fuzz` installs it).

The corpus lives in build/fuzz/TARGET (seeded from `fuzz/seeds.py`, grown by each run); findings are
written to build/fuzz/findings/TARGET/. libFuzzer's limits turn the other failures into findings too:
an input that takes longer than 10 s (a hang) or a process over 2 GB (unbounded allocation).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGETS = ("request_body", "kv_frames", "metrics_text", "config")


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in TARGETS or not argv[2].isdigit():
        print(f"usage: python fuzz/run.py {{{','.join(TARGETS)}}} SECONDS", file=sys.stderr)
        return 2
    target, seconds = argv[1], int(argv[2])
    sys.path.insert(0, str(ROOT))
    from fuzz.seeds import SEEDS

    corpus = ROOT / "build" / "fuzz" / target
    findings = ROOT / "build" / "fuzz" / "findings" / target
    corpus.mkdir(parents=True, exist_ok=True)
    findings.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(SEEDS[target]):
        (corpus / f"seed-{i}").write_bytes(seed)
    cmd = [
        sys.executable,
        str(ROOT / "fuzz" / f"{target}.py"),
        str(corpus),
        f"-max_total_time={seconds}",
        "-timeout=10",
        "-rss_limit_mb=2048",
        "-max_len=65536",
        f"-artifact_prefix={findings}/",
        "-print_final_stats=1",
    ]
    print(" ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv))
