"""The demo's load generator: plays a workload's sessions against an OpenAI-compatible URL (Envoy).

Every turn is a streamed `/v1/chat/completions` request with `stream_options.include_usage`; the
client records the time to the first content chunk (TTFT as the user sees it, through Envoy and the
EPP), the end-to-end time, and `usage.prompt_tokens` / `prompt_tokens_details.cached_tokens` (the
engine's own account of its prefix-cache hit). A session's next turn starts `think_s` after the
previous answer and resends the conversation with that answer. Sessions start at their `start_s`
(open loop); the run is bounded by `deadline_s` (sessions not finished by then are cancelled and
counted as errors).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from epp.demo.report import TurnResult
from epp.demo.workload import Session, messages


class _Stream:
    """What one SSE response carried."""

    def __init__(self) -> None:
        self.first_content: float | None = None
        self.text: list[str] = []
        self.usage: dict[str, Any] | None = None

    def feed(self, line: bytes, now: float) -> None:
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            return
        chunk = json.loads(data)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                if self.first_content is None:
                    self.first_content = now
                self.text.append(content)


async def _turn(
    session: aiohttp.ClientSession, url: str, model: str, s: Session, answers: list[str]
) -> tuple[TurnResult, str]:
    body = {
        "model": model,
        "messages": messages(s, answers),
        "max_tokens": s.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    turn = len(answers)
    start = time.perf_counter()
    stream = _Stream()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                detail = (await r.text())[:200]
                return TurnResult(
                    s.session_id, s.kind, turn, r.status, None, time.perf_counter() - start, 0, 0, detail
                ), ""
            async for line in r.content:
                stream.feed(line, time.perf_counter())
    except (TimeoutError, aiohttp.ClientError, ValueError) as err:
        detail = f"{type(err).__name__}: {err}"
        return TurnResult(s.session_id, s.kind, turn, 0, None, time.perf_counter() - start, 0, 0, detail), ""
    end = time.perf_counter()
    usage = stream.usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    ttft = None if stream.first_content is None else stream.first_content - start
    error = None if stream.usage is not None else "no usage in the stream"
    result = TurnResult(
        s.session_id,
        s.kind,
        turn,
        200,
        ttft,
        end - start,
        int(usage.get("prompt_tokens", 0)),
        int(cached),
        error,
    )
    return result, "".join(stream.text)


async def _session(
    http: aiohttp.ClientSession, url: str, model: str, s: Session, t0: float, out: list[TurnResult]
) -> None:
    await asyncio.sleep(max(0.0, t0 + s.start_s - time.perf_counter()))
    answers: list[str] = []
    for _ in s.questions:
        result, answer = await _turn(http, url, model, s, answers)
        out.append(result)
        if not result.ok:
            return  # a failed turn ends its session: the next one would resend an answer it never got
        answers.append(answer)
        if s.think_s > 0 and len(answers) < len(s.questions):
            await asyncio.sleep(s.think_s)


async def run_sessions(
    url: str, model: str, sessions: list[Session], deadline_s: float, request_timeout_s: float = 60.0
) -> list[TurnResult]:
    """Play `sessions` against `url`; every turn's result, including the ones cut off at the deadline."""
    out: list[TurnResult] = []
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_session(http, url, model, s, t0, out)) for s in sessions]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    done = {(r.session_id, r.turn) for r in out}
    for s in sessions:
        for turn in range(len(s.questions)):
            if (s.session_id, turn) not in done and not any(
                r.session_id == s.session_id and r.turn < turn and not r.ok for r in out
            ):
                out.append(
                    TurnResult(s.session_id, s.kind, turn, 0, None, 0.0, 0, 0, "not finished by the deadline")
                )
    return out
