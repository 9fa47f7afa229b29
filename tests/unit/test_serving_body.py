"""Request bodies of the simulated engine server -> what the engine runs, tokenized as the EPP does."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest

from epp.kvindex.prompt import PromptTokenizer
from epp.requests import build_request
from epp.testing.tokenizer import build_tiny_tokenizer
from simulator.serving.request_body import ApiError, BodyReader, decode_body

MODEL = "tiny"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def reader(tok_dir: pathlib.Path) -> BodyReader:
    return BodyReader(MODEL, PromptTokenizer.from_dir(tok_dir), 512, default_max_tokens=16)


@pytest.fixture(scope="module")
def bare() -> BodyReader:
    return BodyReader(MODEL, None, None, default_max_tokens=7)


def epp_ids(tok_dir: pathlib.Path, path: str, body: dict[str, Any]) -> list[int]:
    """What the EPP computes for the same body (its request parser, then its tokenizer)."""
    request = build_request({":path": path}, body, {})
    ids = PromptTokenizer.from_dir(tok_dir).encode_request(request)
    assert ids is not None
    return [int(t) for t in ids]


def test_chat_is_tokenized_exactly_as_the_epp_does(reader: BodyReader, tok_dir: pathlib.Path) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are terse. " * 5},
            {"role": "user", "content": [{"type": "text", "text": "What is a KV block?"}]},
        ],
    }
    gen = reader.read(body, chat=True)
    assert gen.chat and gen.model == MODEL and not gen.stream
    assert gen.prompt_ids.tolist() == epp_ids(tok_dir, "/v1/chat/completions", body)
    assert gen.max_tokens == 16  # the default


def test_text_prompt_is_tokenized_exactly_as_the_epp_does(reader: BodyReader, tok_dir: pathlib.Path) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time there was a cache.", "max_tokens": 3}
    gen = reader.read(body, chat=False)
    assert gen.prompt_ids.tolist() == epp_ids(tok_dir, "/v1/completions", body)
    assert gen.prompt_ids[0] == 0  # the tokenizer's post-processor adds <|begin_of_text|>
    # add_special_tokens=false (vLLM's field) drops it.
    plain = reader.read({**body, "add_special_tokens": False}, chat=False)
    assert plain.prompt_ids.tolist() == gen.prompt_ids.tolist()[1:]


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_token_id_prompts_are_used_as_given(bare: BodyReader, prompt: list[Any]) -> None:
    gen = bare.read({"prompt": prompt, "max_tokens": 2, "cache_salt": "t1"}, chat=False)
    assert gen.prompt_ids.dtype == np.int64
    assert gen.prompt_ids.tolist() == [5, 6, 7]
    assert gen.model == MODEL  # no model named: the served one
    assert (gen.max_tokens, gen.cache_salt) == (2, "t1")


def test_one_text_prompt_in_a_list_is_one_prompt(reader: BodyReader) -> None:
    one = reader.read({"prompt": ["a cache"]}, chat=False)
    assert one.prompt_ids.tolist() == reader.read({"prompt": "a cache"}, chat=False).prompt_ids.tolist()


def test_stream_options_and_max_completion_tokens(reader: BodyReader) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 9,
        "max_completion_tokens": 4,
    }
    gen = reader.read(body, chat=True)
    assert (gen.stream, gen.include_usage, gen.max_tokens) == (True, True, 4)
    assert reader.read({"prompt": [1], "max_tokens": 9}, chat=False).max_tokens == 9


BAD: list[tuple[str, dict[str, Any], bool, int, str, str]] = [
    # (case, body, chat, status, param, words in the message)
    ("wrong model", {"model": "other", "prompt": [1]}, False, 404, "model", "`other` does not exist"),
    ("model type", {"model": 3, "prompt": [1]}, False, 400, "model", "'model' must be a string"),
    ("no prompt", {"model": MODEL}, False, 400, "prompt", "'prompt' is required"),
    ("prompt type", {"prompt": 12}, False, 400, "prompt", "must be a string or a list of token ids"),
    ("id type", {"prompt": [1, "x"]}, False, 400, "prompt", "'prompt[1]' must be an integer"),
    ("bool id", {"prompt": [1, True]}, False, 400, "prompt", "'prompt[1]' must be an integer"),
    ("negative id", {"prompt": [1, -2]}, False, 400, "prompt", "token id -2"),
    ("out of vocabulary", {"prompt": [1, 512]}, False, 400, "prompt", "out of vocabulary (size 512)"),
    ("batch", {"prompt": [[1], [2]]}, False, 400, "prompt", "batch of 2 prompts"),
    ("text batch", {"prompt": ["a", "b"]}, False, 400, "prompt", "batch of 2 prompts"),
    ("empty ids", {"prompt": []}, False, 400, "prompt", "the prompt is empty"),
    ("embeds", {"prompt": [1], "prompt_embeds": "abc"}, False, 400, "prompt_embeds", "not supported"),
    ("max_tokens type", {"prompt": [1], "max_tokens": "9"}, False, 400, "max_tokens", "must be an integer"),
    ("max_tokens zero", {"prompt": [1], "max_tokens": 0}, False, 400, "max_tokens", "at least 1"),
    ("n", {"prompt": [1], "n": 2}, False, 400, "n", "'n' must be 1"),
    ("stream type", {"prompt": [1], "stream": "maybe"}, False, 400, "stream", "'stream' must be a boolean"),
    ("stream number", {"prompt": [1], "stream": 2}, False, 400, "stream", "'stream' must be a boolean"),
    ("options without stream", {"prompt": [1], "stream_options": {}}, False, 400, "stream_options", "only"),
    ("salt", {"prompt": [1], "cache_salt": ""}, False, 400, "cache_salt", "non-empty string"),
    ("no messages", {"model": MODEL}, True, 400, "messages", "'messages' must be a non-empty list"),
    ("message shape", {"messages": [{"content": "x"}]}, True, 400, "messages", "string 'role'"),
    ("content type", {"messages": [{"role": "user", "content": 5}]}, True, 400, "messages", "content"),
    ("bad role", {"messages": [{"role": "robot", "content": "x"}]}, True, 400, "messages", "roles must be"),
    ("tools type", {"messages": [{"role": "user", "content": "x"}], "tools": 1}, True, 400, "tools", "list"),
    (
        "image part",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        True,
        400,
        "messages",
        "image_url",
    ),
]


@pytest.mark.parametrize(("case", "body", "chat", "status", "param", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_bodies_name_the_field(
    reader: BodyReader, case: str, body: dict[str, Any], chat: bool, status: int, param: str, words: str
) -> None:
    with pytest.raises(ApiError) as info:
        reader.read(body, chat=chat)
    err = info.value
    assert (err.status, err.param) == (status, param)
    assert words in err.message
    doc = err.body()["error"]
    assert doc == {"message": err.message, "type": err.type, "param": param, "code": status}
    assert err.type == ("NotFoundError" if status == 404 else "BadRequestError")


@pytest.mark.parametrize(
    ("chat", "body"), [(False, {"prompt": "text"}), (True, {"messages": [{"role": "user"}]})]
)
def test_without_a_tokenizer_text_is_refused_with_the_reason(
    bare: BodyReader, chat: bool, body: dict[str, Any]
) -> None:
    with pytest.raises(ApiError) as info:
        bare.read(body, chat=chat)
    assert info.value.status == 400
    assert "needs a tokenizer" in info.value.message and "--tokenizer" in info.value.message
    # Token ids are fine without one, even large ones (below 2^31).
    assert bare.read({"prompt": [2**31 - 1]}, chat=False).prompt_ids.tolist() == [2**31 - 1]
    with pytest.raises(ApiError, match="not in"):
        bare.read({"prompt": [2**31]}, chat=False)


@pytest.mark.parametrize(
    ("raw", "words"), [(b"", "empty"), (b"{nope", "not valid JSON"), (b"[1]", "JSON object")]
)
def test_bodies_that_are_not_json_objects(raw: bytes, words: str) -> None:
    with pytest.raises(ApiError) as info:
        decode_body(raw)
    assert info.value.status == 400 and words in info.value.message
    assert decode_body(b'{"a": 1}') == {"a": 1}


@pytest.mark.parametrize(("value", "streamed"), [("yes", True), ("off", False), (1, True), ("FALSE", False)])
def test_booleans_are_read_as_vllms_pydantic_models_read_them(
    reader: BodyReader, value: object, streamed: bool
) -> None:
    assert reader.read({"prompt": [1], "stream": value}, chat=False).stream is streamed
