"""Compiled code that an image carries: numba's cache directory seeded from it. I/O edge.

numba keeps the machine code of the compiled loops (`epp/kvindex/compiled.py`) in `NUMBA_CACHE_DIR`,
which must be writable (numba 0.68 fails the import on a read-only one), and whose code is for the CPU
that compiled it. So the image compiles every loop at build time for a portable CPU (`NUMBA_CPU_NAME`,
x86-64-v2 by default) into a directory of its own (`epp warm-up` with `NUMBA_CACHE_DIR` there), and
names that directory in `EPP_NUMBA_CACHE_SEED`. `epp serve` copies the seed's files into its
`NUMBA_CACHE_DIR` (the pod's emptyDir) before its warm-up, which then loads the code instead of
compiling it: a new pod is ready in about a second, not after 30-40 s of one core. Files already in
the cache stay (a restarted container keeps what it had); a missing seed is a warning, not an error
(the pod compiles, as before).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Final

SEED_ENV: Final = "EPP_NUMBA_CACHE_SEED"
CACHE_ENV: Final = "NUMBA_CACHE_DIR"

log = logging.getLogger(__name__)


def seed_cache(env: Mapping[str, str]) -> int:
    """Copy the files of `env[EPP_NUMBA_CACHE_SEED]` that `env[NUMBA_CACHE_DIR]` lacks into it; how many.
    Call it before the first compiled loop runs (numba reads a loop's cache index at its first call)."""
    seed = env.get(SEED_ENV, "")
    if not seed:
        return 0
    cache = env.get(CACHE_ENV, "")
    if not cache:
        log.warning(
            "%s=%s is set but %s is not: numba caches in the package's own directory, nothing is "
            "seeded and the compiled loops are compiled now (30-40 s of one core)",
            SEED_ENV,
            seed,
            CACHE_ENV,
        )
        return 0
    src = Path(seed)
    if not src.is_dir():
        log.warning(
            "%s=%s is not a directory: nothing is seeded and the compiled loops are compiled now "
            "(30-40 s of one core); was the image built with `epp warm-up`?",
            SEED_ENV,
            seed,
        )
        return 0
    dest = Path(cache)
    copied = 0
    for path in sorted(src.rglob("*")):
        if not path.is_file():
            continue
        target = dest / path.relative_to(src)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        copied += 1
    log.info("seeded %d files of compiled code from %s into %s", copied, src, dest)
    return copied


def cache_dir(env: Mapping[str, str] = os.environ) -> str:
    """Where numba keeps the compiled code: `NUMBA_CACHE_DIR`, else next to the package's sources."""
    return env.get(CACHE_ENV) or "the __pycache__ directories of the installed package"
