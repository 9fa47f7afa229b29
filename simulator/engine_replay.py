"""`epp-sim engine-replay`: requests run one at a time on one simulated engine, as a real vLLM would run
them, reporting each request's `cached_tokens` and (optionally) the KV events. No I/O: text in, lines
out (a second thread reads the text ahead; the results do not depend on it).

Input: JSONL, one object per non-blank line, `{"prompt_token_ids": [...], "max_tokens": N, "i": ...}`
(`i` optional: the 0-based index among non-blank lines). A bad line raises `EngineReplayError` with
its 1-based line number: `parse_requests` checks every line first; `engine_replay` (the command)
checks each when the engine reaches it and stops there, before any output exists.

The run (`run`): ONE `Engine` (the cluster simulation's engine, not a separate model) with
`num_gpu_blocks = num_blocks` (vLLM's `--num-gpu-blocks-override`, the null block included),
`block_size`, `max_num_seqs=1`; each request is submitted once the previous one finished. Per request:
`{"i", "prompt_tokens", "cached_tokens"}`, `cached_tokens` being what vLLM reports in
`usage.prompt_tokens_details.cached_tokens` (`RequestRecord.reported_cached_tokens`). Events: every
event the engine published while request `i` ran, one JSON object each, in vLLM's map-encoded shape
(`{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
"medium"}`, `{"type": "BlockRemoved", "block_hashes", "medium"}`) with `"i"` first.

Reading the file is the hot path for large inputs (2,000-token prompts). A second thread scans it
slice by slice in compiled code (`request_lines.scan`, without the GIL, so it overlaps the engine's
work): a line of the strict shape gives its ids straight into an int64 array. Any other line goes to
msgspec's typed decoding, the token list kept raw and converted by `token_text` when it holds only
non-negative integers, else by msgspec's `list[int]` decoding, which names what is wrong (a sign, a
fraction, a non-number, an id too large for int64).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple, NoReturn

import msgspec
import numpy as np
import numpy.typing as npt

from simulator import request_lines as lines
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


class ReplayRequest(NamedTuple):  # (a tuple: built ~3x faster than a frozen dataclass, per line)
    i: int
    line: int  # 1-based, in the requests file
    prompt: npt.NDArray[np.int64]
    max_tokens: int


class ReplayResult(NamedTuple):
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
    return list(iter_requests(data, num_blocks, block_size))


def iter_requests(
    data: bytes | str, num_blocks: int, block_size: int, *, reuse: bool = False
) -> Iterator[ReplayRequest]:
    """The requests of a JSONL text, in order, each validated when it is reached (EngineReplayError
    naming its line). A second thread scans the file ahead (`request_lines.scan`, compiled, without
    the GIL) while the caller works on the requests already given. `reuse`: the caller is done with a
    request's prompt when it asks for the next one (`run` is), so the scan may write later prompts over
    it: a few buffers of ids serve the whole file (fresh memory for every prompt costs page faults)."""
    check_settings(num_blocks, block_size)
    if isinstance(data, str):
        data = data.encode()
    room = (num_blocks - 1) * block_size  # tokens whose KV the engine can hold
    scanned: queue.SimpleQueue[_Scanned | BaseException | None] = queue.SimpleQueue()
    spare: queue.Queue[npt.NDArray[np.int64]] | None = queue.Queue() if reuse else None
    stop = threading.Event()
    thread = threading.Thread(
        target=_scan_all, args=(data, scanned, spare, stop), name="engine-replay-scan", daemon=True
    )
    thread.start()
    exact = IdReader()
    lineno = k = 0
    held: npt.NDArray[np.int64] | None = None
    try:
        while (item := scanned.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            scanned_rows, ids = item
            if spare is not None and held is not None:
                spare.put(held)  # every request of the previous slice is done with
            held = ids
            for row in scanned_rows.tolist():
                lineno += 1
                status = row[lines.STATUS]
                if status == lines.BLANK:
                    continue
                if status == lines.TAKEN:
                    at = row[lines.IDS_AT]
                    prompt = ids[at : at + row[lines.IDS_N]]
                    m = row[lines.MAX_TOKENS]
                    i = row[lines.I_VALUE] if row[lines.I_SET] else None
                else:
                    got = _exact_line(data[row[lines.START] : row[lines.END]], lineno, exact)
                    if got is None:
                        continue  # a blank line
                    prompt, m, i = got
                n = len(prompt)
                if n == 0 or n + m - 1 > room:
                    _refuse(n, m, lineno, num_blocks, block_size)
                yield ReplayRequest(k if i is None else i, lineno, prompt, m)
                k += 1
    finally:
        stop.set()
        if spare is not None:
            spare.put(np.zeros(0, dtype=np.int64))  # wakes a scan waiting for a buffer


_Scanned = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]
_SCAN_FIRST = 256 << 10  # bytes of the file in the first slice (the first request waits for it) ...
_SCAN_MAX = 8 << 20  # ... doubling up to this (measured: smaller slices cost more handovers)
_BUFFERS = 4  # with `reuse`: slices of ids in use at once (the caller's, those scanned ahead)


def _scan_all(
    data: bytes,
    out: queue.SimpleQueue[_Scanned | BaseException | None],
    spare: queue.Queue[npt.NDArray[np.int64]] | None,
    stop: threading.Event,
) -> None:
    """The scanning thread: each slice of whole lines as (rows, ids); then None."""
    try:
        buf = np.frombuffer(data, dtype=np.uint8)
        made = 0
        a, size = 0, _SCAN_FIRST
        while a < len(data) and not stop.is_set():
            b = min(len(data), a + size)
            if b < len(data):
                nl = data.find(b"\n", b - 1)
                b = len(data) if nl < 0 else nl + 1
            need = (b - a) // 2 + 1
            ids = None
            if spare is not None and made >= _BUFFERS:
                ids = spare.get()  # a slice the caller is done with
                if stop.is_set():
                    return
            if ids is None or len(ids) < need:
                ids = np.empty(max(need, _SCAN_MAX // 2 + 1) if spare is not None else need, dtype=np.int64)
                made += 1
            rows = lines.scan_slice(buf, a, b, ids)
            if spare is None:
                ids.flags.writeable = False  # the prompts are views of it, kept by the caller
            out.put((rows, ids))
            a, size = b, min(2 * size, _SCAN_MAX)
    except BaseException as err:  # handed to the consuming thread, which raises it
        out.put(err)
    finally:
        out.put(None)


def _exact_line(
    line: bytes, lineno: int, ids: IdReader
) -> tuple[npt.NDArray[np.int64], int, int | None] | None:
    """A line outside the scan's strict shape, through msgspec: (prompt, max_tokens, i), or None when it
    is blank; EngineReplayError for whatever is wrong with it."""
    try:
        obj = _line_decoder.decode(line)
    except msgspec.ValidationError as err:
        raise EngineReplayError(lineno, str(err)) from None
    except msgspec.DecodeError as err:
        if not line.strip():
            return None
        raise EngineReplayError(lineno, f"not a JSON object: {err}") from None
    prompt = ids.read(obj.prompt_token_ids)
    if prompt is None:
        prompt = _tokens_exact(line, lineno)
    return prompt, obj.max_tokens, obj.i


def _refuse(n: int, m: int, lineno: int, num_blocks: int, block_size: int) -> NoReturn:
    """An empty prompt, or one whose KV the cache cannot hold (the last output token's is never
    computed)."""
    if n == 0:
        raise EngineReplayError(lineno, "empty prompt: prompt_token_ids needs at least one token")
    need = -(-(n + m - 1) // block_size)
    raise EngineReplayError(
        lineno,
        f"{n} prompt + {m} output tokens need {need} blocks of {block_size} tokens; the cache holds "
        f"{num_blocks - 1} (--num-blocks {num_blocks}, one is the null block)",
    )


def run(
    requests: Iterable[ReplayRequest],
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
        # one request at a time, each submitted to an idle engine: async scheduling changes no result and
        # no event here (tests/unit/test_engine_replay.py), and its per-step bookkeeping costs ~20%
        async_scheduling=False,
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
    data: bytes | str,
    num_blocks: int,
    block_size: int,
    *,
    events: bool = False,
    max_num_batched_tokens: int = 8192,
) -> tuple[str, str | None]:
    """JSONL requests in; (results JSONL, events JSONL or None) out (EngineReplayError for a bad line:
    no output). `max_num_batched_tokens`: the engine's token budget per step (vLLM's flag; a prompt
    longer than it is prefilled in chunks, one `BlockStored` per chunk)."""
    requests = iter_requests(data, num_blocks, block_size, reuse=True)
    out = run(requests, num_blocks, block_size, events=events, max_num_batched_tokens=max_num_batched_tokens)
    return result_lines(out.results), event_lines(out.events) if events else None
