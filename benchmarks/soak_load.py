"""One load process of the soak benchmark: open-loop Poisson chat requests through Envoy.

Started by `benchmarks/soak.py` (one or more, each with its share of the rate); takes its settings
as one JSON argument and prints one JSON line per second on stdout (`batch`), then `done`:

  {"type": "batch", "t": <monotonic>, "sent": n, "skipped": n, "ok": n, "ttfb": [s, ...],
   "failures": [{"start", "end", "status", "detail", "endpoint"}], "kinds": {...}}

A request is sent at each arrival of a Poisson process of the given rate unless `max_in_flight`
are already in flight: then it is not sent and counted in `skipped` (the bound keeps an overloaded
machine from piling up connections; the count says how far the achieved rate fell short). Every
request is a streamed `/v1/chat/completions`; TTFB is the time to the first response body byte
through Envoy; a request succeeds on a 200 whose stream ends with `data: [DONE]`. Arrivals stop at
`deadline` (a `time.monotonic()` value, which is system-wide on Linux); requests still in flight
then get `drain_s` to finish and are then cancelled (counted in `cut`, not as failures).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict
from typing import Any

import aiohttp

try:
    from benchmarks.soak_parts import Failure, Traffic, TrafficSpec
except ImportError:  # run as a script: benchmarks/ is not a package on sys.path
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from benchmarks.soak_parts import Failure, Traffic, TrafficSpec

DECISION_HEADER = "x-epp-decision"


def _endpoint(headers: Any) -> str | None:
    value = headers.get(DECISION_HEADER)
    if not value:
        return None
    for part in value.split(";"):
        key, _, v = part.strip().partition("=")
        if key == "endpoint":
            return str(v)
    return None


class Load:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.url = f"{cfg['url']}/v1/chat/completions"
        self.model = cfg["model"]
        self.rate = float(cfg["rate"])
        self.deadline = float(cfg["deadline"])
        self.max_in_flight = int(cfg["max_in_flight"])
        self.timeout = float(cfg["request_timeout_s"])
        self.drain_s = float(cfg["drain_s"])
        self.rng = random.Random(cfg["seed"])
        self.traffic = Traffic(TrafficSpec(**cfg["traffic"]), cfg["seed"])
        self.in_flight = 0
        self._reset()

    def _reset(self) -> None:
        self.sent = self.skipped = self.ok = 0
        self.ttfb: list[float] = []
        self.failures: list[Failure] = []
        self.kinds: dict[str, int] = {}

    def flush(self, kind: str = "batch", **extra: Any) -> None:
        line = {
            "type": kind,
            "t": time.monotonic(),
            "sent": self.sent,
            "skipped": self.skipped,
            "ok": self.ok,
            "ttfb": [round(x, 6) for x in self.ttfb],
            "failures": [asdict(f) for f in self.failures],
            "kinds": self.kinds,
            "in_flight": self.in_flight,
            **extra,
        }
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
        self._reset()

    async def one(self, http: aiohttp.ClientSession, kind: str, msgs: list[dict[str, str]]) -> None:
        body = {
            "model": self.model,
            "messages": msgs,
            "max_tokens": self.traffic.spec.max_tokens,
            "stream": True,
        }
        start = time.monotonic()
        status, endpoint, first = 0, None, None
        try:
            async with http.post(self.url, json=body) as r:
                status, endpoint = r.status, _endpoint(r.headers)
                if status != 200:
                    detail = (await r.text())[:300]
                    self.failures.append(Failure(start, time.monotonic(), status, detail, endpoint))
                    return
                tail = b""
                async for chunk in r.content.iter_any():
                    if first is None:
                        first = time.monotonic()
                    tail = (tail + chunk)[-64:]
                if b"[DONE]" not in tail:
                    self.failures.append(
                        Failure(start, time.monotonic(), 0, "stream ended without [DONE]", endpoint)
                    )
                    return
        except (TimeoutError, aiohttp.ClientError, ValueError) as err:
            detail = f"{type(err).__name__}: {err}"[:300]
            self.failures.append(Failure(start, time.monotonic(), 0, detail, endpoint))
            return
        finally:
            self.in_flight -= 1
        self.ok += 1
        self.ttfb.append((first or time.monotonic()) - start)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        connector = aiohttp.TCPConnector(limit=0)
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            next_flush = time.monotonic() + 1.0
            t = time.monotonic()
            while True:
                t += self.rng.expovariate(self.rate)
                if t >= self.deadline:
                    break
                while next_flush <= min(t, self.deadline):
                    await asyncio.sleep(max(0.0, next_flush - time.monotonic()))
                    self.flush()
                    next_flush += 1.0
                delay = t - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.in_flight >= self.max_in_flight:
                    self.skipped += 1
                    continue
                kind, msgs = self.traffic.next()
                self.in_flight += 1
                self.sent += 1
                task = asyncio.create_task(self.one(http, kind, msgs))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(set(tasks), timeout=self.drain_s)
            cut = len(tasks)
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.flush("done", cut=cut)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    asyncio.run(Load(cfg).run())


if __name__ == "__main__":
    main()
