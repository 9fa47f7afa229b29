"""`epp-sim replay --jobs`: policies in worker processes give exactly the one-after-the-other figures,
report their progress, and a worker's failure is a clear error."""

from __future__ import annotations

import os
import pickle

import pytest

from epp.config import ConfigError
from simulator import parallel
from simulator.cli import main
from simulator.cluster import ClusterConfig
from simulator.engine import EngineConfig
from simulator.replay import replay
from simulator.traces import shared_prefix

SMALL = ClusterConfig(pods=3, engine=EngineConfig(num_gpu_blocks=2048), seed=3)
NAMES = ["ttft", "random", "gie-default"]


def small_trace() -> list:  # type: ignore[type-arg]
    return shared_prefix(6, 4, system_tokens=800, question_tokens=100, output_tokens=20, rate=15, seed=2)


def test_workers_give_the_figures_and_records_of_one_after_the_other() -> None:
    trace = small_trace()
    seen: list[int] = []
    side = parallel.replay_parallel(trace, NAMES, SMALL, jobs=2, advance=seen.append)
    alone = replay(trace, NAMES, SMALL)
    assert list(side.summary) == NAMES  # in the order asked, whichever finished first
    assert side.summary == alone.summary
    assert side.records == alone.records
    assert (side.bounds, side.rejected) == (alone.bounds, alone.rejected)
    assert sum(seen) == len(trace) * len(NAMES)  # every request of every policy, once


def test_one_job_runs_here_with_a_tick_per_request() -> None:
    trace = small_trace()
    seen: list[int] = []
    result = parallel.replay_parallel(trace, ["random"], SMALL, jobs=1, advance=seen.append)
    assert seen == [1] * len(trace)
    assert result.summary == replay(trace, ["random"], SMALL).summary


def test_a_workers_exception_is_raised_with_its_message(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_args: object) -> None:
        raise ValueError("policy exploded in the worker")

    monkeypatch.setattr(parallel, "run_policy", fail)  # (forked workers inherit the patch)
    with pytest.raises(ValueError, match="policy exploded in the worker"):
        parallel.replay_parallel(small_trace(), NAMES, SMALL, jobs=2)


def test_a_config_error_pickles_with_its_fields() -> None:
    err = pickle.loads(pickle.dumps(ConfigError("p.yaml", "plugin 'x'", "type", "unknown plugin type")))
    assert isinstance(err, ConfigError)
    assert (err.source, err.where, err.field, err.message) == (
        "p.yaml",
        "plugin 'x'",
        "type",
        "unknown plugin type",
    )
    assert str(err) == "p.yaml: plugin 'x': field 'type': unknown plugin type"


def test_a_workers_config_error_is_raised_as_such_not_as_a_dead_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(*_args: object) -> None:
        raise ConfigError("mine.yaml", "plugin 'x'", "type", "unknown plugin type")

    monkeypatch.setattr(parallel, "run_policy", fail)
    with pytest.raises(ConfigError, match=r"mine\.yaml: plugin 'x'"):
        parallel.replay_parallel(small_trace(), NAMES, SMALL, jobs=2)


class _Unpicklable(Exception):
    def __init__(self, a: str, b: str) -> None:  # pickle rebuilds it with one argument: TypeError
        super().__init__(f"{a} {b}")


def test_a_workers_exception_that_cannot_be_pickled_keeps_its_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(*_args: object) -> None:
        raise _Unpicklable("odd", "failure")

    monkeypatch.setattr(parallel, "run_policy", fail)
    with pytest.raises(ValueError, match=r"^odd failure$"):
        parallel.replay_parallel(small_trace(), NAMES, SMALL, jobs=2)


def test_rejected_requests_tick_the_progress_of_workers() -> None:
    cluster = ClusterConfig(pods=2, engine=EngineConfig(num_gpu_blocks=2048), scrape_interval=1000.0, seed=3)
    trace = shared_prefix(4, 4, system_tokens=100, question_tokens=20, output_tokens=5, rate=0.2, seed=2)
    seen: list[int] = []
    result = parallel.replay_parallel(trace, ["ttft", "random"], cluster, jobs=2, advance=seen.append)
    assert result.rejected["ttft"] == len(trace)  # (its staleness filter: metrics 1,000 s old)
    assert sum(seen) == 2 * len(trace)


def test_a_worker_that_dies_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def die(*_args: object) -> None:
        os._exit(9)

    monkeypatch.setattr(parallel, "run_policy", die)
    with pytest.raises(ValueError, match=r"a simulator worker process died.*fewer --jobs"):
        parallel.replay_parallel(small_trace(), NAMES, SMALL, jobs=2)


def test_jobs_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="jobs must be at least 1, got 0"):
        parallel.replay_parallel(small_trace(), NAMES, SMALL, jobs=0)
    with pytest.raises(SystemExit) as exit_:
        main(["replay", "--no-progress", "--requests", "10", "--jobs", "0"])
    assert exit_.value.code == 2
    assert "--jobs" in capsys.readouterr().err
