"""Seeding numba's cache from the compiled code an image carries (`epp/server/numba_cache.py`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from epp.server.numba_cache import CACHE_ENV, SEED_ENV, seed_cache


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_seed_fills_what_the_cache_lacks_and_keeps_what_it_has(tmp_path: Path) -> None:
    seed, cache = tmp_path / "seed", tmp_path / "cache"
    for rel, data in {
        "kvindex_1/a.nbi": b"index a",
        "kvindex_1/a.1.nbc": b"code a",
        "cost_2/b.nbi": b"b",
    }.items():
        (seed / rel).parent.mkdir(parents=True, exist_ok=True)
        (seed / rel).write_bytes(data)
    (cache / "kvindex_1").mkdir(parents=True)
    (cache / "kvindex_1" / "a.nbi").write_bytes(b"the pod's own index")  # a restarted container's

    assert seed_cache({SEED_ENV: str(seed), CACHE_ENV: str(cache)}) == 2
    assert _tree(cache) == {
        "kvindex_1/a.nbi": b"the pod's own index",
        "kvindex_1/a.1.nbc": b"code a",
        "cost_2/b.nbi": b"b",
    }
    assert seed_cache({SEED_ENV: str(seed), CACHE_ENV: str(cache)}) == 0  # again: nothing new
    assert _tree(seed) == {
        "kvindex_1/a.nbi": b"index a",
        "kvindex_1/a.1.nbc": b"code a",
        "cost_2/b.nbi": b"b",
    }


def test_without_a_seed_nothing_happens(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="epp.server.numba_cache"):
        assert seed_cache({CACHE_ENV: str(tmp_path / "cache")}) == 0
        assert seed_cache({SEED_ENV: "", CACHE_ENV: str(tmp_path / "cache")}) == 0
    assert not (tmp_path / "cache").exists() and caplog.records == []


def test_a_missing_seed_is_a_warning_that_names_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "no-such-seed"
    with caplog.at_level(logging.WARNING, logger="epp.server.numba_cache"):
        assert seed_cache({SEED_ENV: str(missing), CACHE_ENV: str(tmp_path / "cache")}) == 0
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert str(missing) in caplog.text and "epp warm-up" in caplog.text
    assert not (tmp_path / "cache").exists()


def test_a_seed_without_a_cache_directory_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "x.nbi").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="epp.server.numba_cache"):
        assert seed_cache({SEED_ENV: str(seed)}) == 0
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert CACHE_ENV in caplog.text and SEED_ENV in caplog.text
