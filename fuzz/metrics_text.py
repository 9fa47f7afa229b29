"""Fuzz target: scraped /metrics text into `parse_metrics`. A snapshot must hold sane values; a
`MetricsParseError` is fine; anything else raised is a finding. Run with
`python fuzz/run.py metrics_text SECONDS`."""

from __future__ import annotations

import math
import sys

import atheris

from fuzz import COMPILED

with atheris.instrument_imports(include=["epp"], exclude=COMPILED):
    from epp.sources.metrics_text import MetricsParseError, parse_metrics


def TestOneInput(data: bytes) -> None:
    try:
        snap = parse_metrics(data.decode("utf-8", "replace"), 1.0)
    except MetricsParseError:
        return
    if snap.waiting < 0 or snap.running < 0 or not 0.0 <= snap.kv_usage <= 1.0:
        raise AssertionError(f"insane snapshot: {snap}")
    for v in (snap.prefix_cache_queries, snap.prefix_cache_hits):
        if v is not None and not math.isfinite(v):
            raise AssertionError(f"non-finite prefix cache counter: {snap}")


if __name__ == "__main__":
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
