"""`epp-sim engine-replay` through the command: cached_tokens and KV events on hand-built sequences
(vllm-prefix-cache.md's rules), the fast token parser against the exact one, and every bad-input path
(exit 2, `FILE:LINE: message`, nothing written)."""

from __future__ import annotations

import json
import pathlib
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import engine_replay as engine_replay_module
from simulator import request_lines
from simulator.cli import main
from simulator.engine import EngineConfig
from simulator.engine_replay import (
    EngineReplayError,
    _tokens_exact,
    engine_replay,
    parse_requests,
    result_lines,
    run,
)
from simulator.token_text import IdReader


def write_requests(tmp_path: pathlib.Path, rows: list[Any]) -> pathlib.Path:
    """`rows`: dicts (dumped as JSON) or raw lines (str, written as is)."""
    path = tmp_path / "requests.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def req(tokens: list[int], max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {"prompt_token_ids": tokens, "max_tokens": max_tokens, **extra}


def replay_cmd(
    tmp_path: pathlib.Path, rows: list[Any], num_blocks: int, block_size: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    path = write_requests(tmp_path, rows)
    out, ev = tmp_path / "out.jsonl", tmp_path / "events.jsonl"
    argv = ["engine-replay", "--requests", str(path), "--num-blocks", str(num_blocks)]
    argv += ["--block-size", str(block_size), "--out", str(out), "--events", str(ev)]
    assert main(argv) == 0
    results = [json.loads(x) for x in out.read_text().splitlines()]
    events = [json.loads(x) for x in ev.read_text().splitlines()]
    return results, events


def removed(events: list[dict[str, Any]], i: int) -> list[int]:
    return [e["block_hashes"][0] for e in events if e["i"] == i and e["type"] == "BlockRemoved"]


def stored(events: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    return [e for e in events if e["i"] == i and e["type"] == "BlockStored"]


# -- the rules, through the command ------------------------------------------------------------------
def test_repeated_prompts_hit_all_but_the_capped_block(tmp_path: pathlib.Path) -> None:
    # Block size 32. A 608-token prompt (19 full blocks) repeated: the cap floor(607 / 32) = 18 blocks
    # -> 576 tokens. A 512-token prompt (16 blocks) repeated: floor(511 / 32) = 15 blocks -> 480.
    # A 600-token prompt (18 full + a partial block): floor(599 / 32) = 18 -> 576, no cap needed.
    a, b, c = list(range(608)), list(range(10_000, 10_512)), list(range(20_000, 20_600))
    results, _ = replay_cmd(tmp_path, [req(a), req(a), req(b), req(b), req(c), req(c)], 96, 32)
    assert results == [
        {"i": 0, "prompt_tokens": 608, "cached_tokens": 0},
        {"i": 1, "prompt_tokens": 608, "cached_tokens": 576},
        {"i": 2, "prompt_tokens": 512, "cached_tokens": 0},
        {"i": 3, "prompt_tokens": 512, "cached_tokens": 480},
        {"i": 4, "prompt_tokens": 600, "cached_tokens": 0},
        {"i": 5, "prompt_tokens": 600, "cached_tokens": 576},
    ]


def test_eviction_takes_the_deepest_blocks_of_the_least_recent_prompt_first(tmp_path: pathlib.Path) -> None:
    # Block size 2, 5 blocks = 4 usable. r0 = [1..8] fills blocks 1-4 (hashes h1..h4), freed in reverse:
    # free queue [h4, h3, h2, h1]. r1 = [11..14] takes 2 blocks from the front: evicts h4 then h3
    # (BlockRemoved in that order), stores its own 2. Its freeing puts them behind: [h2, h1, b2, b1].
    # r2 = [1..5] still hits h1, h2 (cap floor(4 / 2) = 2 blocks anyway) -> 4 tokens.
    rows = [req(list(range(1, 9))), req(list(range(11, 15))), req([1, 2, 3, 4, 5])]
    results, events = replay_cmd(tmp_path, rows, 5, 2)
    assert [r["cached_tokens"] for r in results] == [0, 0, 4]
    (s0,) = stored(events, 0)
    h = s0["block_hashes"]
    assert len(h) == 4 and s0["parent_block_hash"] is None and s0["token_ids"] == list(range(1, 9))
    assert s0["block_size"] == 2 and s0["medium"] == "GPU"
    assert removed(events, 1) == [h[3], h[2]]
    (s1,) = stored(events, 1)
    assert s1["token_ids"] == [11, 12, 13, 14] and s1["parent_block_hash"] is None
    # r2 allocates one block for its partial last token: the front of [h2, h1, b2, b1] minus its hits
    # h1, h2 (taken out of the queue) is b2, r1's deepest block.
    assert removed(events, 2) == [s1["block_hashes"][1]]
    assert stored(events, 2) == []
    assert [e["type"] for e in events if e["i"] == 1] == ["BlockRemoved", "BlockRemoved", "BlockStored"]
    assert set(events[0]) == {
        "i", "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"
    }  # fmt: skip
    assert set(events[1]) == {"i", "type", "block_hashes", "medium"}


def test_a_repeated_aligned_prompt_stores_a_duplicate_copy_and_both_are_evicted(
    tmp_path: pathlib.Path,
) -> None:
    # Block size 2, 9 blocks = 8 usable, free queue [1..8]. r0 = [1..8] takes blocks 1-4 (h1..h4); freed
    # in reverse: [5, 6, 7, 8, 4, 3, 2, 1]. r1, the same prompt: the cap floor(7 / 2) = 3 blocks hits
    # h1..h3 (6 tokens) and recomputes block 4 into block 5: a second BlockStored of h4 (parent h3).
    # Freed: [6, 7, 8, 4, 5, 3, 2, 1]. r2 = 16 new tokens takes all 8 blocks from the front: empty
    # 6, 7, 8, then h4 (block 4), h4 again (block 5), h3, h2, h1 -> five BlockRemoved, h4 twice.
    a = list(range(1, 9))
    rows = [req(a), req(a), req(list(range(21, 37)))]
    results, events = replay_cmd(tmp_path, rows, 9, 2)
    assert [r["cached_tokens"] for r in results] == [0, 6, 0]
    h = stored(events, 0)[0]["block_hashes"]
    (dup,) = stored(events, 1)
    assert dup["block_hashes"] == [h[3]] and dup["parent_block_hash"] == h[2] and dup["token_ids"] == [7, 8]
    assert removed(events, 1) == []
    assert removed(events, 2) == [h[3], h[3], h[2], h[1], h[0]]


def test_output_tokens_fill_blocks_and_take_room(tmp_path: pathlib.Path) -> None:
    # Block size 4. r0: 6 prompt tokens + 5 output tokens: 6 + 4 fed back = 10 tokens of KV -> blocks
    # [p0..p3], [p4 p5 o0 o1] full (stored while decoding), [o2 o3] partial. r1 repeats the prompt:
    # only the first block is prompt-only -> 4 cached tokens (cap floor(5 / 4) = 1 anyway).
    p = [5, 6, 7, 8, 9, 10]
    results, events = replay_cmd(tmp_path, [req(p, 5), req(p)], 4, 4)
    assert [r["cached_tokens"] for r in results] == [0, 4]
    assert sum(len(e["block_hashes"]) for e in stored(events, 0)) == 2


def test_i_defaults_to_the_index_among_non_blank_lines(tmp_path: pathlib.Path) -> None:
    rows = [req([1, 2, 3]), "", "   ", req([1, 2, 3], i=42), req([4, 5]), req([4, 5], 3, i=-7)]
    results, _ = replay_cmd(tmp_path, rows, 16, 1)
    assert [r["i"] for r in results] == [0, 42, 2, -7]
    assert [r["cached_tokens"] for r in results] == [0, 2, 0, 1]


def test_results_only_without_events(tmp_path: pathlib.Path) -> None:
    path = write_requests(tmp_path, [req([1, 2, 3])])
    out = tmp_path / "o.jsonl"
    argv = ["engine-replay", "--requests", str(path), "--num-blocks", "4", "--block-size", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    assert out.read_text() == '{"i":0,"prompt_tokens":3,"cached_tokens":0}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl", "requests.jsonl"]


def test_the_pure_function_matches_the_command(tmp_path: pathlib.Path) -> None:
    rows = [req(list(range(40))), req(list(range(30)), 4), req(list(range(40)))]
    results, events = replay_cmd(tmp_path, rows, 12, 4)
    text = "\n".join(json.dumps(r) for r in rows)
    res, ev = engine_replay(text, 12, 4, events=True)
    assert [json.loads(x) for x in res.splitlines()] == results
    assert ev is not None and [json.loads(x) for x in ev.splitlines()] == events
    assert engine_replay(text, 12, 4) == (res, None)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 90), st.integers(1, 20)), min_size=1, max_size=25)
)
def test_async_scheduling_changes_nothing_one_request_at_a_time(rows: list[tuple[int, int, int]]) -> None:
    """The command runs the synchronous engine core: each request reaches an idle engine, so vLLM's async
    scheduling would give every request the same hit and every event in the same order."""
    text = "\n".join(json.dumps(req([f * 100 + j for j in range(n)], m)) for f, n, m in rows)
    reqs = parse_requests(text.encode(), 40, 4)  # (room for the longest: 90 + 20 tokens)
    sync = run(reqs, 40, 4, events=True)

    def asynchronous_config(**kw: Any) -> EngineConfig:
        return EngineConfig(**{**kw, "async_scheduling": True})

    with mock.patch.object(engine_replay_module, "EngineConfig", asynchronous_config):
        asynchronous = run(reqs, 40, 4, events=True)
    assert asynchronous.results == sync.results and asynchronous.events == sync.events


# -- parsing ---------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=30),
    st.sampled_from([",", ", ", " ,", ",\t", " , "]),
)
def test_fast_token_parsing_equals_the_exact_path(ids: list[int], sep: str) -> None:
    line = '{"max_tokens": 1, "prompt_token_ids": [ ' + sep.join(map(str, ids)) + " ]}"
    (r,) = parse_requests(line, 2**40, 1)
    exact = _tokens_exact(line.encode(), 1)
    assert r.prompt.dtype == np.int64 and r.prompt.tolist() == exact.tolist() == ids


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2**63 - 1), max_size=40), min_size=1, max_size=30), st.integers(1, 64)
)
def test_the_id_reader_hands_out_distinct_read_only_views_across_arenas(
    lists: list[list[int]], arena_ids: int
) -> None:
    reader = IdReader(arena_ids)  # small arenas: lists land in many of them
    got = [reader.read(json.dumps(ids).encode()) for ids in lists]
    assert [g.tolist() if g is not None else None for g in got] == lists
    assert all(g is not None and not g.flags.writeable for g in got)


@pytest.mark.parametrize(
    "text",
    [b"[1 2]", b"[1,,2]", b"[,1]", b"[1,]", b"[-1]", b"[1.0]", b"[1e3]", b'["1"]', b"[[1]]", b"1", b""],
)
def test_the_id_reader_refuses_all_but_lists_of_non_negative_integers_and_keeps_its_room(text: bytes) -> None:
    reader = IdReader(8)
    assert reader.read(text) is None
    first = reader.read(b"[7, 8]")
    assert first is not None and first.tolist() == [7, 8]
    assert reader.read(b"[9223372036854775807]").tolist() == [2**63 - 1]  # type: ignore[union-attr]
    assert reader.read(b"[9223372036854775808]") is None  # beyond int64: the exact path says so
    assert first.tolist() == [7, 8]


BAD = [
    ("{not json", "not a JSON object"),
    ("[1, 2]", "Expected `object`, got `array`"),
    (
        '{"prompt_token_ids": [1, 2.5], "max_tokens": 1}',
        "Expected `int`, got `float` - at `$.prompt_token_ids[1]`",
    ),
    (
        '{"prompt_token_ids": [1, "2"], "max_tokens": 1}',
        "Expected `int`, got `str` - at `$.prompt_token_ids[1]`",
    ),
    ('{"prompt_token_ids": [true], "max_tokens": 1}', "Expected `int`, got `bool`"),
    ('{"prompt_token_ids": [[1]], "max_tokens": 1}', "Expected `int`, got `array`"),
    ('{"prompt_token_ids": "1 2", "max_tokens": 1}', "Expected `array`, got `str`"),
    ('{"prompt_token_ids": [1, -3], "max_tokens": 1}', "prompt_token_ids[1] is negative (-3)"),
    ('{"prompt_token_ids": [9223372036854775808], "max_tokens": 1}', "does not fit in 64 bits"),
    ('{"prompt_token_ids": [], "max_tokens": 1}', "empty prompt"),
    ('{"max_tokens": 1}', "missing required field `prompt_token_ids`"),
    ('{"prompt_token_ids": [1]}', "missing required field `max_tokens`"),
    ('{"prompt_token_ids": [1], "max_tokens": 0}', "Expected `int` >= 1 - at `$.max_tokens`"),
    ('{"prompt_token_ids": [1], "max_tokens": 2.0}', "Expected `int`, got `float` - at `$.max_tokens`"),
    ('{"prompt_token_ids": [1], "max_tokens": 1, "i": "a"}', "Expected `int | null`, got `str` - at `$.i`"),
    # 8 blocks of 4 = 7 usable (28 tokens): 25 prompt + 5 output need 29 tokens of KV -> 8 blocks.
    ('{"prompt_token_ids": [' + ",".join(["1"] * 25) + '], "max_tokens": 5}', "need 8 blocks of 4 tokens"),
]


@pytest.mark.parametrize(("line", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_input_names_the_file_and_line_and_writes_nothing(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    ok = json.dumps(req([1, 2, 3, 4]))
    path = write_requests(tmp_path, [ok, "", ok, line, ok])  # the bad one is line 4
    out, ev = tmp_path / "out.jsonl", tmp_path / "events.jsonl"
    argv = ["engine-replay", "--requests", str(path), "--num-blocks", "8", "--block-size", "4"]
    assert main([*argv, "--out", str(out), "--events", str(ev)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"epp-sim: {path}:4: "), err
    assert message in err, err
    assert not out.exists() and not ev.exists()


def test_a_request_that_fits_exactly_is_accepted() -> None:
    # 7 usable blocks of 4 = 28 tokens: 25 prompt + 4 output need 28 (the last output is never fed back).
    (r,) = parse_requests(json.dumps(req([1] * 25, 4)), 8, 4)
    assert len(r.prompt) == 25 and r.max_tokens == 4


def test_parse_errors_carry_the_line() -> None:
    with pytest.raises(EngineReplayError) as info:
        parse_requests('\n\n{"prompt_token_ids": [], "max_tokens": 1}\n', 8, 4)
    assert info.value.line == 3 and info.value.located("f.jsonl").startswith("f.jsonl:3: empty prompt")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-blocks", "1", "--block-size", "4"], "--num-blocks must be >= 2"),
        (["--num-blocks", "0", "--block-size", "4"], None),
        (["--num-blocks", "8", "--block-size", "x"], None),
    ],
)
def test_bad_settings_exit_2(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str | None
) -> None:
    path = write_requests(tmp_path, [req([1])])
    out = tmp_path / "out.jsonl"
    argv = ["engine-replay", "--requests", str(path), *flags, "--out", str(out)]
    if message is None:  # argparse's own check
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    else:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()


def test_unreadable_requests_file_exits_2(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["engine-replay", "--requests", str(tmp_path / "nope.jsonl"), "--num-blocks", "8"]
    assert main([*argv, "--block-size", "4", "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "nope.jsonl: cannot read" in capsys.readouterr().err


# -- the compiled line scan ------------------------------------------------------------------------------
_SPACE = st.sampled_from(["", " ", "  ", "\t", " \r"])


@st.composite
def request_line(draw: st.DrawFn) -> tuple[str, bool]:
    """A request line as a JSON writer might format it, and whether it was bent out of the strict shape
    (a leading zero, a fraction, an exponent, a sign, a repeated or extra key, an escape in a key)."""
    ids = draw(st.lists(st.integers(0, 2**63 - 1), max_size=6))
    sp = draw(_SPACE)
    fields = {
        "prompt_token_ids": "[" + sp + ("," + sp).join(map(str, ids)) + sp + "]",
        "max_tokens": str(draw(st.integers(1, 40))),
    }
    i = draw(
        st.one_of(st.none(), st.just("null"), st.integers(1 - 2**63, 2**63 - 1).map(str))
    )  # -2^63: exact path
    if i is not None:
        fields["i"] = i
    bend = draw(
        st.sampled_from(["", "", "", "lead0", "float", "dup", "extra", "escape", "sign", "exp", "zero"])
    )
    items = [f'"{k}"{sp}:{draw(_SPACE)}{v}' for k, v in fields.items()]
    if bend in ("lead0", "sign") and not ids:
        bend = ""
    if bend == "lead0":
        items[0] = items[0].replace("[" + sp + str(ids[0]), "[" + sp + "0" + str(ids[0]), 1)
    elif bend == "float":
        items[1] += ".0"
    elif bend == "dup":
        items.append(items[1])
    elif bend == "extra":
        items.append('"model": "m"')
    elif bend == "escape":
        items[1] = items[1].replace('"max_tokens"', '"max_\\u0074okens"')
    elif bend == "sign":
        items[0] = items[0].replace("[" + sp + str(ids[0]), "[" + sp + "-" + str(ids[0]), 1)
    elif bend == "exp":
        items[1] += "e0"
    elif bend == "zero":  # max_tokens 0: valid JSON, refused by the schema
        items[1] = items[1].rsplit(":", 1)[0] + ": 0"
    order = draw(st.permutations(items))
    line = draw(_SPACE) + "{" + draw(_SPACE) + ("," + sp).join(order) + sp + "}" + draw(_SPACE)
    return line, bend != ""


@settings(max_examples=400, deadline=None)
@given(st.lists(request_line(), min_size=1, max_size=8))
def test_the_scan_takes_lines_of_the_strict_shape_as_json_reads_them_and_leaves_the_rest(
    drawn: list[tuple[str, bool]],
) -> None:
    text_lines = [line for line, _ in drawn]
    data = ("\n".join(text_lines) + "\n").encode()
    buf = np.frombuffer(data, dtype=np.uint8)
    info = np.empty((len(text_lines) + 1, request_lines.COLUMNS), dtype=np.int64)
    ids = np.empty(len(data) // 2 + 1, dtype=np.int64)
    rows, _ = request_lines.scan(buf, 0, len(data), ids, 0, info, 0)
    assert rows == len(text_lines)
    for row, (line, bent) in zip(info[:rows].tolist(), drawn, strict=True):
        assert data[row[request_lines.START] : row[request_lines.END]] == line.encode()
        if bent:  # msgspec's typed decoding decides (and names what is wrong)
            assert row[request_lines.STATUS] == request_lines.EXACT, line
            continue
        assert row[request_lines.STATUS] == request_lines.TAKEN, line
        obj = json.loads(line)
        at, n = row[request_lines.IDS_AT], row[request_lines.IDS_N]
        assert ids[at : at + n].tolist() == obj["prompt_token_ids"]
        assert row[request_lines.MAX_TOKENS] == obj["max_tokens"]
        assert (row[request_lines.I_VALUE] if row[request_lines.I_SET] else None) == obj.get("i")


def test_reused_scan_buffers_give_every_request_its_own_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of a few lines, so that the three id buffers are written over many times while the engine
    works: the results equal those of prompts parsed apart first."""
    import simulator.engine_replay as er

    rng = np.random.default_rng(5)
    rows = [
        json.dumps(req(rng.integers(0, 50, int(rng.integers(1, 60))).tolist(), int(rng.integers(1, 4))))
        for _ in range(300)
    ]
    text = "\n".join(rows) + "\n"
    expected = run(parse_requests(text, 64, 4), 64, 4).results
    monkeypatch.setattr(er, "_SCAN_FIRST", 200)
    monkeypatch.setattr(er, "_SCAN_MAX", 800)
    assert run(er.iter_requests(text, 64, 4, reuse=True), 64, 4).results == expected
    assert engine_replay(text, 64, 4)[0] == result_lines(expected)


def test_a_smaller_step_budget_chunks_a_long_prompts_prefill_as_vllm_does(tmp_path: pathlib.Path) -> None:
    """With `--max-num-batched-tokens 16` a 40-token prompt is prefilled in 3 steps, one BlockStored each
    (4 + 4 + 2 blocks of 4), against one event of 10 blocks with the default budget; the results are the
    same, and a budget of 0 is refused."""
    rows = [req(list(range(40)))]
    results, events = replay_cmd(tmp_path, rows, 64, 4)
    path = write_requests(tmp_path, rows)
    out, ev = tmp_path / "small.jsonl", tmp_path / "small-events.jsonl"
    argv = ["engine-replay", "--requests", str(path), "--num-blocks", "64", "--block-size", "4"]
    assert main([*argv, "--out", str(out), "--events", str(ev), "--max-num-batched-tokens", "16"]) == 0
    small = [json.loads(x) for x in ev.read_text().splitlines()]
    stored = [e for e in events if e["type"] == "BlockStored"]
    chunked = [e for e in small if e["type"] == "BlockStored"]
    assert [len(e["block_hashes"]) for e in stored] == [10]
    assert [len(e["block_hashes"]) for e in chunked] == [4, 4, 2]
    assert [json.loads(x) for x in out.read_text().splitlines()] == results
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(out), "--max-num-batched-tokens", "0"])
    assert exit_.value.code == 2
