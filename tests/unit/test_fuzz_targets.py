"""The fuzz targets (`make fuzz`, opt-in) leave every module with numba-compiled functions out of
atheris' instrumentation: numba cannot compile instrumented bytecode, so a compiled loop that is
compiled while fuzzing (a new argument type) failed in the target instead of finding bugs."""

from __future__ import annotations

import re
from pathlib import Path

from fuzz import COMPILED

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_with_compiled_loops_is_left_out_of_instrumentation() -> None:
    compiled = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "epp").rglob("*.py")
        if re.search(r"@numba\.njit|@njit\b", path.read_text(encoding="utf-8"))
    )
    assert compiled, "no compiled loops found: the scan is wrong"
    assert sorted(set(compiled) - set(COMPILED)) == []
