"""`epp-sim engine-replay`: requests run one at a time on one simulated engine, as a real vLLM would run
them, reporting each request's `cached_tokens` and (optionally) the KV events. Pure: text in, lines out.

Input: JSONL, one object per non-blank line, `{"prompt_token_ids": [...], "max_tokens": N, "i": ...}`
(`i` optional: the 0-based index among non-blank lines). Every line is validated before anything
runs (`parse_requests`); a bad one raises `EngineReplayError` with its 1-based line number.

The run (`run`): ONE `Engine` (the cluster simulation's engine, not a separate model) with
`num_gpu_blocks = num_blocks` (vLLM's `--num-gpu-blocks-override`, the null block included),
`block_size`, `max_num_seqs=1`; each request is submitted once the previous one finished. Per request:
`{"i", "prompt_tokens", "cached_tokens"}`, `cached_tokens` being what vLLM reports in
`usage.prompt_tokens_details.cached_tokens` (`RequestRecord.reported_cached_tokens`). Events: every
event the engine published while request `i` ran, one JSON object each, in vLLM's map-encoded shape
(`{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
"medium"}`, `{"type": "BlockRemoved", "block_hashes", "medium"}`) with `"i"` first.

Parsing is the hot path for large inputs (2,000-token prompts): a line is decoded by msgspec into a
typed struct with the token list kept raw; a list of non-negative integers is converted by a compiled
pass straight to int64 (`token_text.parse_ids`). Anything else (a sign, a fraction, a non-number, an
id too large for int64) goes through the exact path, msgspec's `list[int]` decoding, which names what
is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt

from simulator.engine import Engine, EngineConfig
from simulator.kernel import Kernel
from simulator.records import SimRequest
from simulator.token_text import IdReader

_INT64_MAX = int(np.iinfo(np.int64).max)


class EngineReplayError(ValueError):
    """Bad input. `line`: 1-based line of the requests file, or None for a problem with the settings."""

    def __init__(self, line: int | None, message: str) -> None:
        super().__init__(message if line is None else f"line {line}: {message}")
        self.line = line
        self.message = message

    def located(self, source: str) -> str:
        """`SOURCE:LINE: message` (or `SOURCE: message`)."""
        return f"{source}: {self.message}" if self.line is None else f"{source}:{self.line}: {self.message}"


class _Line(msgspec.Struct, gc=False):
    prompt_token_ids: msgspec.Raw
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    i: int | None = None


class _Tokens(msgspec.Struct, gc=False):
    prompt_token_ids: list[int]


_line_decoder = msgspec.json.Decoder(_Line)
_tokens_decoder = msgspec.json.Decoder(_Tokens)


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    i: int
    line: int  # 1-based, in the requests file
    prompt: npt.NDArray[np.int64]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class ReplayResult:
    i: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class ReplayOutput:
    results: list[ReplayResult]
    events: list[dict[str, Any]]  # each with "i" first, then vLLM's fields; empty unless asked for


def check_settings(num_blocks: int, block_size: int) -> None:
    if num_blocks < 2:
        raise EngineReplayError(
            None, f"--num-blocks must be >= 2 (one is vLLM's null block), got {num_blocks}"
        )
    if block_size < 1:
        raise EngineReplayError(None, f"--block-size must be >= 1, got {block_size}")


def _tokens_exact(line: bytes, lineno: int) -> npt.NDArray[np.int64]:
    """The token ids through msgspec's typed decoding: a precise error for whatever is wrong."""
    try:
        ids = _tokens_decoder.decode(line).prompt_token_ids
    except msgspec.ValidationError as err:
        raise EngineReplayError(lineno, f"prompt_token_ids: {err}") from None
    if ids and min(ids) < 0:
        j = next(k for k, t in enumerate(ids) if t < 0)
        raise EngineReplayError(lineno, f"prompt_token_ids[{j}] is negative ({ids[j]}); token ids are >= 0")
    if ids and max(ids) > _INT64_MAX:
        j = next(k for k, t in enumerate(ids) if t > _INT64_MAX)
        raise EngineReplayError(lineno, f"prompt_token_ids[{j}] = {ids[j]} does not fit in 64 bits")
    return np.array(ids, dtype=np.int64)


def parse_requests(data: bytes | str, num_blocks: int, block_size: int) -> list[ReplayRequest]:
    """Every request of a JSONL text, validated (EngineReplayError naming the first bad line)."""
    check_settings(num_blocks, block_size)
    if isinstance(data, str):
        data = data.encode()
    room = (num_blocks - 1) * block_size  # tokens whose KV the engine can hold
    out: list[ReplayRequest] = []
    decode = _line_decoder.decode
    ids = IdReader()
    text = memoryview(data)  # lines are slices of it, not copies
    find = data.find
    pos = lineno = 0
    while pos < len(data):
        end = find(b"\n", pos)
        if end < 0:
            end = len(data)
        line, pos = text[pos:end], end + 1
        lineno += 1
        try:
            obj = decode(line)
        except msgspec.ValidationError as err:
            raise EngineReplayError(lineno, str(err)) from None
        except msgspec.DecodeError as err:
            if not bytes(line).strip():
                continue  # a blank line
            raise EngineReplayError(lineno, f"not a JSON object: {err}") from None
        prompt = ids.read(obj.prompt_token_ids)
        if prompt is None:
            prompt = _tokens_exact(bytes(line), lineno)
        n = len(prompt)
        if n == 0:
            raise EngineReplayError(lineno, "empty prompt: prompt_token_ids needs at least one token")
        m = obj.max_tokens
        if n + m - 1 > room:  # the last output token's KV is never computed
            need = -(-(n + m - 1) // block_size)
            raise EngineReplayError(
                lineno,
                f"{n} prompt + {m} output tokens need {need} blocks of {block_size} tokens; the cache holds "
                f"{num_blocks - 1} (--num-blocks {num_blocks}, one is the null block)",
            )
        out.append(ReplayRequest(len(out) if obj.i is None else obj.i, lineno, prompt, m))
    return out


def run(
    requests: Sequence[ReplayRequest],
    num_blocks: int,
    block_size: int,
    *,
    events: bool = False,
    max_num_batched_tokens: int = 8192,
) -> ReplayOutput:
    """The requests one at a time, in order, on one engine (see the module docstring)."""
    check_settings(num_blocks, block_size)
    kernel = Kernel()
    cfg = EngineConfig(
        num_gpu_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=1,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    out_events: list[dict[str, Any]] = []
    current = [0]

    def on_events(_seq: int, payload: bytes, _at: float) -> None:
        i = current[0]
        for ev in msgspec.msgpack.decode(payload)[1]:
            out_events.append({"i": i, **ev})

    engine = Engine(kernel, cfg, on_events=on_events if events else None)
    results: list[ReplayResult] = []
    submit, drain = engine.submit, kernel.run
    for r in requests:
        current[0] = r.i
        try:
            rec = submit(SimRequest(f"line-{r.line}", r.prompt, r.max_tokens))
        except ValueError as err:
            raise EngineReplayError(r.line, str(err)) from None
        drain()
        results.append(ReplayResult(r.i, rec.prompt_tokens, rec.reported_cached_tokens))
    return ReplayOutput(results, out_events)


_encoder = msgspec.json.Encoder()


def result_lines(results: Sequence[ReplayResult]) -> str:
    """One `{"i", "prompt_tokens", "cached_tokens"}` JSON object per line."""
    return "".join(
        f'{{"i":{r.i},"prompt_tokens":{r.prompt_tokens},"cached_tokens":{r.cached_tokens}}}\n'
        for r in results
    )


def event_lines(events: Sequence[dict[str, Any]]) -> str:
    return "".join(_encoder.encode(ev).decode() + "\n" for ev in events)


def engine_replay(
    data: bytes | str, num_blocks: int, block_size: int, *, events: bool = False
) -> tuple[str, str | None]:
    """JSONL requests in; (results JSONL, events JSONL or None) out. Validates everything first."""
    requests = parse_requests(data, num_blocks, block_size)
    out = run(requests, num_blocks, block_size, events=events)
    return result_lines(out.results), event_lines(out.events) if events else None
