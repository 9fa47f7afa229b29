"""Fuzz target: config files into the loader and the scheduler build (`parse_config`, `build_scheduler`).
A `ConfigError` naming the file is fine; anything else raised is a finding. Run with
`python fuzz/run.py config SECONDS`."""

from __future__ import annotations

import random
import sys

import atheris

from fuzz import COMPILED

with atheris.instrument_imports(include=["epp"], exclude=COMPILED):
    from epp.config import build_scheduler, parse_config
    from epp.config_sections import ConfigError
    from epp.costmodel.service import SERVICE_KEY as COST_KEY
    from epp.costmodel.service import CostModel
    from epp.kvindex.freshness import FreshnessTracker
    from epp.kvindex.index import BlockIndex
    from epp.kvindex.prompt import TokenizerRegistry
    from epp.kvindex.service import SERVICE_KEY as KV_KEY
    from epp.kvindex.service import KvIndexService
    from epp.scheduling.builtin import default_registry
    from epp.testing.fakes import FakeClock

SOURCE = "fuzz.yaml"
REGISTRY = default_registry()


def TestOneInput(data: bytes) -> None:
    try:
        cfg = parse_config(data.decode("utf-8", "replace"), SOURCE)
        index = BlockIndex(block_size=cfg.index.block_size, max_entries=cfg.index.max_entries)
        kv = KvIndexService(index, FreshnessTracker(), TokenizerRegistry({}), cfg.index.block_size)
        services = {KV_KEY: kv, COST_KEY: CostModel(cfg.cost_model)}
        build_scheduler(cfg, REGISTRY, FakeClock(), random.Random(0), services=services)
    except ConfigError as err:
        if err.source != SOURCE:
            raise AssertionError(f"a ConfigError must name the file: {err}") from None


if __name__ == "__main__":
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
