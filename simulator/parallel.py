"""`epp-sim replay --jobs N`: the policies of one replay in worker processes, one policy per task.

Each policy's run is independent (a fresh cluster from the same seed), so running them side by side
gives exactly the figures `replay.replay` gives one after the other, in as many times less wall time
as there are cores for them. Workers are forked: they inherit the trace, the cluster settings and the
compiled loops instead of unpickling and compiling them; they send back each policy's `PolicyRun`
and, every `_TICK` requests, how many they finished or rejected (the progress bar). An exception in a
worker is raised here, with its own message (as a ValueError if it cannot be pickled); a worker that
dies (killed, out of memory) is a ValueError that says so. Where fork does not exist, the policies run
here, one after the other.
"""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Final

from simulator.cluster import ClusterConfig
from simulator.replay import PolicyRun, ReplayResult, assemble, replay, run_policy
from simulator.results import RequestRecord
from simulator.traces import TraceRequest

_TICK: Final = 64
_POLL_S: Final = 0.1

_work: dict[str, Any] = {}
"""In a worker process: the trace, the cluster settings and the progress queue (`_start`)."""


def _start(trace: Sequence[TraceRequest], cluster: ClusterConfig, done: Any) -> None:
    _work.update(trace=trace, cluster=cluster, done=done)


def _run(name: str) -> PolicyRun:
    done = _work["done"]
    finished = 0

    def tick(_r: RequestRecord) -> None:
        nonlocal finished
        finished += 1
        if finished % _TICK == 0:
            done.put(_TICK)

    try:
        run = run_policy(_work["trace"], name, _work["cluster"], tick)
    except Exception as err:
        raise _sendable(err) from None
    done.put(finished % _TICK)
    return run


def _sendable(err: Exception) -> Exception:
    """`err`, or a ValueError with its message if it would not survive the trip to the parent (where
    it would break the pool and be reported as a dead worker)."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return ValueError(str(err))
    return err


def replay_parallel(
    trace: Sequence[TraceRequest],
    names: Sequence[str],
    cluster: ClusterConfig,
    jobs: int,
    advance: Callable[[int], object] | None = None,
) -> ReplayResult:
    """`replay.replay` with up to `jobs` policies at a time in worker processes; `advance(n)`: n more
    requests finished (across policies)."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    step = advance or (lambda _n: None)
    if jobs == 1 or len(names) == 1 or "fork" not in multiprocessing.get_all_start_methods():
        return replay(trace, names, cluster, lambda _r: step(1))
    ctx = multiprocessing.get_context("fork")
    done = ctx.SimpleQueue()
    workers = min(jobs, len(names))
    try:
        with ProcessPoolExecutor(workers, ctx, initializer=_start, initargs=(trace, cluster, done)) as pool:
            futures = [pool.submit(_run, name) for name in names]
            while running := [f for f in futures if not f.done()]:
                _drain(done, step)
                wait(running, timeout=_POLL_S, return_when=FIRST_COMPLETED)
            runs = [f.result() for f in futures]  # (a worker's exception is raised here)
    except BrokenProcessPool as err:
        raise ValueError(
            f"a simulator worker process died ({err}); with fewer --jobs each has more memory"
        ) from None
    _drain(done, step)
    return assemble(runs, trace, cluster)


def _drain(done: Any, step: Callable[[int], object]) -> None:
    while not done.empty():
        step(done.get())
