"""Request traces for the simulator: real trace formats and synthetic workloads. Pure.

A trace is a list of `TraceRequest`s sorted by arrival time (seconds from the start), each with
its prompt as token ids. Token ids are synthetic but deterministic, and equal wherever prompts
share content, so prefix reuse in the trace becomes prefix reuse in the engines' caches.

- **Mooncake JSONL**: one object per line, `timestamp` (ms), `input_length`, `output_length`,
  `hash_ids` (chained ids of 512-token blocks; equal ids at one position = an identical
  prefix). Each id maps to its own deterministic run of 512 token ids; the last block is cut
  to `input_length - 512 * (len(hash_ids) - 1)` tokens.
- **Azure LLM inference CSV** (`TIMESTAMP,ContextTokens,GeneratedTokens`): arrivals and
  lengths only, so every prompt is unique (no reuse). TIMESTAMP is seconds or an ISO date-time
  (with or without a UTC offset; naive ones are UTC), the same kind on every row.

Both readers shift the arrivals so that the first is at 0 (absolute timestamps, such as epoch
milliseconds, become seconds from the start) and skip a UTF-8 byte order mark. `fits(prompt,
output)`, when given, is asked about every request before its token ids are built: a message
(the request does not fit an engine) is a `TraceError` naming the line, as is a request arriving more
than `trace_span.MAX_SPAN_S` (1e8 s) after the earliest one.
- **Generators**: `shared_prefix` (groups of prompts sharing a system prompt, like
  inference-perf's `shared_prefix`), `multi_turn` (chat sessions whose every turn resends the
  whole conversation so far), `agentic` (loops whose context grows by tool output each step);
  requests, sessions or loops start at Poisson or gamma arrivals (`process`, `cv`).

`scale_rate(trace, factor)` speeds a trace up (factor > 1) or slows it down. Errors are
`TraceError`s naming the file and line.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import numpy as np
import numpy.typing as npt

from simulator.trace_span import LIMIT, first_too_late

MOONCAKE_BLOCK = 512
ARRIVALS = ("poisson", "gamma")
VOCAB = 32_000
Tokens = npt.NDArray[np.int32]
Fits = Callable[[int, int], str | None]
"""`fits(prompt_tokens, output_tokens)`: None if such a request can run, else why it cannot."""


class TraceError(ValueError):
    def __init__(self, source: str, line: int | None, message: str) -> None:
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")
        self.source = source
        self.line = line


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float  # seconds from the start of the trace
    prompt: Tokens
    output_tokens: int
    session: str = ""  # conversation / group it belongs to ("" when none)
    index: int = 0  # position in the trace
    answer: Tokens | None = None  # the answer's tokens, when a later prompt of the trace contains them


class TokenSource:
    """Deterministic token ids per content id: the same id always gives the same tokens."""

    def __init__(self, seed: int = 0, vocab: int = VOCAB) -> None:
        self.seed = seed
        self.vocab = vocab
        self._cache: dict[tuple[str, int, int], Tokens] = {}

    def tokens(self, kind: str, content_id: int, length: int) -> Tokens:
        key = (kind, content_id, length)
        got = self._cache.get(key)
        if got is None:
            mix = _stable(self.seed, kind, content_id)  # not hash(): str hashes vary per process
            rng = np.random.default_rng(mix)
            got = rng.integers(1, self.vocab, size=length, dtype=np.int32)
            if len(self._cache) < 200_000:
                self._cache[key] = got
        return got


def _stable(seed: int, kind: str, content_id: int) -> int:
    h = seed & 0xFFFFFFFF
    for ch in kind.encode():
        h = (h * 1_000_003 + ch) & 0xFFFFFFFFFFFF
    return (h * 2_654_435_761 + content_id * 40_503 + 17) & 0xFFFFFFFFFFFFFFFF


def _positive_int(source: str, line: int, doc: dict[str, object], key: str, minimum: int = 0) -> int:
    value = doc.get(key)
    if type(value) is not int or value < minimum:
        raise TraceError(source, line, f"{key!r} must be an integer >= {minimum}, got {value!r}")
    return value


# -- Mooncake -------------------------------------------------------------------------------------
def read_mooncake(
    text: str, source: str = "<mooncake>", seed: int = 0, fits: Fits | None = None
) -> list[TraceRequest]:
    tokens = TokenSource(seed)
    out: list[TraceRequest] = []
    lines: list[int] = []
    for line_no, line in enumerate(io.StringIO(text.removeprefix("\ufeff")), start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as err:
            raise TraceError(source, line_no, f"not JSON: {err.msg}") from None
        if not isinstance(doc, dict):
            raise TraceError(source, line_no, "each line must be a JSON object")
        ms = _milliseconds(doc.get("timestamp"))
        if ms is None:
            shown = _short(doc.get("timestamp"))
            raise TraceError(source, line_no, f"'timestamp' must be a finite number of ms >= 0, got {shown}")
        n_in = _positive_int(source, line_no, doc, "input_length", 1)
        n_out = _positive_int(source, line_no, doc, "output_length", 1)
        ids = doc.get("hash_ids")
        if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
            raise TraceError(source, line_no, "'hash_ids' must be a non-empty list of integers")
        if not MOONCAKE_BLOCK * (len(ids) - 1) < n_in <= MOONCAKE_BLOCK * len(ids):
            raise TraceError(
                source,
                line_no,
                f"input_length {n_in} does not fit {len(ids)} blocks of {MOONCAKE_BLOCK} tokens",
            )
        _check_fits(fits, source, line_no, n_in, n_out)
        last = n_in - MOONCAKE_BLOCK * (len(ids) - 1)
        parts = [tokens.tokens("mc", i, MOONCAKE_BLOCK) for i in ids[:-1]]
        parts.append(tokens.tokens("mc", ids[-1], MOONCAKE_BLOCK)[:last])
        out.append(TraceRequest(ms / 1000.0, np.concatenate(parts), n_out))
        lines.append(line_no)
    start = min((r.arrival for r in out), default=0.0)  # epoch timestamps: seconds from the first
    shifted = [replace(r, arrival=r.arrival - start) for r in out]
    _check_span(shifted, lines, source, "'timestamp'")
    return _sorted(shifted, source)


def _check_span(trace: list[TraceRequest], lines: list[int], source: str, field: str) -> None:
    """TraceError naming the line of the first request (in file order) that arrives more than
    `MAX_SPAN_S` after the earliest one (`trace`'s arrivals are from it)."""
    late = first_too_late([r.arrival for r in trace])
    if late is not None:
        first = lines[min(range(len(trace)), key=lambda k: trace[k].arrival)]
        raise TraceError(
            source,
            lines[late],
            f"{field} is {trace[late].arrival:.6g} s after the earliest one (line {first}): {LIMIT}",
        )


def _milliseconds(value: object) -> float | None:
    """A Mooncake timestamp as a float, or None if it is not a finite number >= 0 (an integer too
    large for a float included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        ms = float(value)
    except OverflowError:
        return None
    return ms if math.isfinite(ms) and ms >= 0 else None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _check_fits(fits: Fits | None, source: str, line: int, n_in: int, n_out: int) -> None:
    why = fits(n_in, n_out) if fits is not None else None
    if why is not None:
        raise TraceError(source, line, why)


# -- Azure ----------------------------------------------------------------------------------------
def read_azure(
    text: str, source: str = "<azure>", seed: int = 0, fits: Fits | None = None
) -> list[TraceRequest]:
    """Azure LLM inference trace CSV: TIMESTAMP (ISO date-time or seconds), ContextTokens, GeneratedTokens."""
    reader = csv.DictReader(io.StringIO(text.removeprefix("\ufeff")))
    need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    if reader.fieldnames is None or not need <= set(reader.fieldnames):
        raise TraceError(source, 1, f"header must name {', '.join(sorted(need))}, got {reader.fieldnames}")
    tokens = TokenSource(seed)
    out: list[TraceRequest] = []
    lines: list[int] = []
    first_kind: tuple[str, int] | None = None  # the kind of TIMESTAMP of the first row, and its line
    for i, row in enumerate(reader):
        line_no = reader.line_num
        t, kind = _timestamp(source, line_no, row["TIMESTAMP"])
        if first_kind is None:
            first_kind = (kind, line_no)
        elif kind != first_kind[0]:
            raise TraceError(
                source,
                line_no,
                f"TIMESTAMP is {_KINDS[kind]} but line {first_kind[1]}'s is {_KINDS[first_kind[0]]}: "
                "every row must give its time the same way",
            )
        try:
            n_in, n_out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
        except (TypeError, ValueError):
            raise TraceError(source, line_no, "ContextTokens and GeneratedTokens must be integers") from None
        if n_in < 1 or n_out < 1:
            raise TraceError(source, line_no, "ContextTokens and GeneratedTokens must be >= 1")
        _check_fits(fits, source, line_no, n_in, n_out)
        out.append(TraceRequest(t, tokens.tokens("az", i, n_in), n_out))
        lines.append(line_no)
    if not out:
        raise TraceError(source, None, "the trace has no requests")
    first = min(range(len(out)), key=lambda k: out[k].arrival)  # rows need not be in time order
    start = out[first].arrival
    shifted = []
    for r, line_no in zip(out, lines, strict=True):
        arrival = r.arrival - start
        if not math.isfinite(arrival):
            raise TraceError(
                source,
                line_no,
                f"TIMESTAMP {r.arrival} s is too far after the earliest one ({start} s, line "
                f"{lines[first]}): the time between them is not a finite number of seconds",
            )
        shifted.append(replace(r, arrival=arrival))
    _check_span(shifted, lines, source, "TIMESTAMP")
    return _sorted(shifted, source)


_KINDS = {
    "seconds": "a number of seconds",
    "naive": "a date-time without a UTC offset",
    "aware": "a date-time with a UTC offset",
}
_EXTRA_DIGITS = re.compile(r"(\.\d{6})\d+")


def _timestamp(source: str, line: int, value: str | None) -> tuple[float, str]:
    """Seconds, and the kind of timestamp: `seconds`, `naive` (ISO, taken as UTC) or `aware` (ISO
    with a UTC offset)."""
    text = (value or "").strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise TraceError(source, line, f"TIMESTAMP {_short(text)} is not a finite number")
        return seconds, "seconds"
    try:  # Azure writes 7 fractional digits; Python reads at most 6
        stamp = datetime.fromisoformat(_EXTRA_DIGITS.sub(r"\1", text))
    except ValueError:
        raise TraceError(
            source, line, f"TIMESTAMP {_short(text)} is not seconds or an ISO date-time"
        ) from None
    if stamp.tzinfo is None:
        return stamp.replace(tzinfo=UTC).timestamp(), "naive"
    return stamp.timestamp(), "aware"


# -- arrivals and generators ----------------------------------------------------------------------
def arrivals(
    n: int, rate: float, rng: random.Random, process: str = "poisson", cv: float = 1.0
) -> list[float]:
    """`n` arrival times at `rate` per second: Poisson, or gamma with coefficient of variation `cv` of
    the gaps (1 is Poisson's; above it burstier, below it more regular)."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive number, got {rate}")
    if process not in ARRIVALS:
        raise ValueError(f"arrival process must be poisson or gamma, got {process!r}")
    if process == "gamma" and not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"cv must be a finite number > 0, got {cv}")
    shape = 1.0 / (cv * cv) if process == "gamma" else 0.0
    t, out = 0.0, []
    for _ in range(n):
        if process == "poisson":
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(shape, 1.0 / (shape * rate))
        out.append(t)
    return out


def shared_prefix(
    groups: int,
    prompts_per_group: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    rate: float,
    seed: int = 0,
    process: str = "poisson",
    cv: float = 1.0,
) -> list[TraceRequest]:
    """`groups` x `prompts_per_group` prompts; those of a group share a `system_tokens` system prompt,
    each has its own question. Prompts arrive in random order (`arrivals(process, cv)`)."""
    rng = random.Random(seed)
    src = TokenSource(seed)
    prompts = [(g, q) for g in range(groups) for q in range(prompts_per_group)]
    rng.shuffle(prompts)
    times = arrivals(len(prompts), rate, rng, process, cv)
    out = []
    for i, ((g, q), t) in enumerate(zip(prompts, times, strict=True)):
        prompt = np.concatenate(
            [src.tokens("sys", g, system_tokens), src.tokens("q", g * 1_000_003 + q, question_tokens)]
        )
        out.append(TraceRequest(t, prompt, output_tokens, f"group-{g}", i))
    return out


def multi_turn(
    sessions: int,
    turns: int,
    system_tokens: int,
    user_tokens: int,
    output_tokens: int,
    rate: float,
    think_time: float = 5.0,
    seed: int = 0,
    answer_token_s: float = 0.03,
    process: str = "poisson",
    cv: float = 1.0,
) -> list[TraceRequest]:
    """Chat sessions starting at `rate` per second (`arrivals(process, cv)`); each turn resends the
    conversation so far (system prompt, earlier user messages and answers) plus a new user message,
    `think_time` seconds (mean, exponential) after the previous turn's expected end (its arrival plus
    `output_tokens x answer_token_s`). Each request carries its answer's tokens (`answer`), so the
    engine generates exactly what the next turn resends."""
    rng = random.Random(seed)
    src = TokenSource(seed)
    starts = arrivals(sessions, rate, rng, process, cv)
    out: list[TraceRequest] = []
    for s, start in enumerate(starts):
        context = src.tokens("sys", s % 8, system_tokens)  # a few system prompts shared across sessions
        t = start
        for turn in range(turns):
            user = src.tokens("user", s * 1000 + turn, user_tokens)
            prompt = np.concatenate([context, user])
            answer = src.tokens("answer", s * 1000 + turn, output_tokens)
            out.append(TraceRequest(t, prompt, output_tokens, f"session-{s}", answer=answer))
            context = np.concatenate([prompt, answer])
            t += output_tokens * answer_token_s
            t += rng.expovariate(1.0 / think_time) if think_time > 0 else 0.0
    return _sorted(out, "<multi-turn>")


def agentic(
    loops: int,
    steps: int,
    system_tokens: int,
    task_tokens: int,
    tool_tokens: int,
    output_tokens: int,
    rate: float,
    step_gap: float = 1.0,
    seed: int = 0,
    answer_token_s: float = 0.03,
    process: str = "poisson",
    cv: float = 1.0,
) -> list[TraceRequest]:
    """Agent loops starting at `rate` per second (`arrivals(process, cv)`): each step resends the whole
    context, grown by the last output and a tool result; a step starts `step_gap` seconds (mean,
    exponential) after the previous one's expected end."""
    rng = random.Random(seed)
    src = TokenSource(seed)
    starts = arrivals(loops, rate, rng, process, cv)
    out: list[TraceRequest] = []
    for a, start in enumerate(starts):
        context = np.concatenate(
            [src.tokens("agent-sys", 0, system_tokens), src.tokens("task", a, task_tokens)]
        )
        t = start
        for step in range(steps):
            act = src.tokens("act", a * 1000 + step, output_tokens)
            out.append(TraceRequest(t, context, output_tokens, f"agent-{a}", answer=act))
            context = np.concatenate([context, act, src.tokens("tool", a * 1000 + step, tool_tokens)])
            t += output_tokens * answer_token_s
            t += rng.expovariate(1.0 / step_gap) if step_gap > 0 else 0.0
    return _sorted(out, "<agentic>")


def scale_rate(trace: Iterable[TraceRequest], factor: float) -> list[TraceRequest]:
    """Arrivals `factor` times faster (2.0 = twice the request rate)."""
    if factor <= 0 or not math.isfinite(factor):
        raise ValueError(f"rate scale must be a positive number, got {factor}")
    return [replace(r, arrival=r.arrival / factor) for r in trace]


def _sorted(trace: list[TraceRequest], source: str) -> list[TraceRequest]:
    if not trace:
        raise TraceError(source, None, "the trace has no requests")
    order = sorted(range(len(trace)), key=lambda i: (trace[i].arrival, i))
    return [replace(trace[i], index=k) for k, i in enumerate(order)]
