"""Prompts whose ids vLLM computes in a way the EPP does not reproduce are routed unkeyed, with the reason,
instead of being keyed with ids no engine computes.

gpt-oss (vLLM 0.32, `vllm/renderers/online_renderer.py`): `OnlineRenderer.use_harmony` is
`hf_config.model_type == "gpt_oss"`; `render_chat` and `render_responses` then build Harmony messages and
render them with `openai_harmony` (`render_for_completion`), never the chat template; `render_completion`
tokenizes the prompt as for any model.

Mistral's format (vLLM 0.32, `resolve_tokenizer_args` in `vllm/tokenizers/registry.py`): with
`--tokenizer-mode auto` (the default), a repo with `tekken.json` or `tokenizer.model.v*` files (by base name,
anywhere in it) and `consolidated*.safetensors` weights runs `mistral_common`'s tokenizer and renderer;
`--tokenizer-mode hf` keeps Transformers'. The EPP's directory seldom has the weights: the files alone count.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from epp.config import DEFAULT_CONFIG_YAML, ConfigError, parse_config
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import HARMONY, MISTRAL_TOKENIZER, NotReproduced, TokenizerRegistry
from epp.kvindex.server_chat import ServerChatSettings, TokenizerSpec
from epp.kvindex.service import KvIndexService
from epp.kvindex.tokenizer_files import mistral_files
from epp.requests import build_request
from epp.server.app import EppServer, ServerSettings
from epp.testing.tokenizer import build_tiny_tokenizer

CHAT = {":path": "/v1/chat/completions"}
RESP = {":path": "/v1/responses"}
CMPL = {":path": "/v1/completions"}
EMB = {":path": "/v1/embeddings"}
MSGS = [{"role": "user", "content": "Which pod holds this prompt's blocks?"}]
BS = 4


def _copy(tiny: Path, dst: Path, config: dict[str, Any] | None) -> Path:
    shutil.copytree(tiny, dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> KvIndexService:
    tiny = build_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))
    root = tmp_path_factory.mktemp("models")
    paths = {
        "gpt-oss": _copy(tiny, root / "gpt-oss", {"model_type": "gpt_oss"}),
        "llama": _copy(tiny, root / "llama", {"model_type": "llama"}),
    }
    return KvIndexService(BlockIndex(BS, 1000), FreshnessTracker(), TokenizerRegistry(paths), BS)


def _tokens(svc: KvIndexService, headers: dict[str, str], body: dict[str, Any]) -> tuple[Any, str | None]:
    result = svc.tokenize(build_request(headers, body, {}))
    return result.ids, result.unkeyed


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        (CHAT, {"messages": MSGS}),
        (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]}),
        (RESP, {"input": "Which pod holds this prompt's blocks?"}),
        (RESP, {"input": MSGS, "instructions": "Be brief."}),
    ],
)
def test_a_gpt_oss_chat_or_responses_request_is_unkeyed_as_harmony(
    svc: KvIndexService, headers: dict[str, str], body: dict[str, Any]
) -> None:
    assert _tokens(svc, headers, {"model": "gpt-oss", **body}) == (None, HARMONY)
    # the same request to a model vLLM renders with its template is keyed
    ids, reason = _tokens(svc, headers, {"model": "llama", **body})
    assert reason is None and ids is not None and len(ids) > 0


def test_a_harmony_chat_is_counted_under_its_reason_and_gets_no_keys(svc: KvIndexService) -> None:
    request = build_request(CHAT, {"model": "gpt-oss", "messages": MSGS}, {})
    before = svc.unkeyed[("gpt-oss", HARMONY)]
    assert svc.prompt_tokens_and_keys(request) == (None, None)
    assert svc.unkeyed[("gpt-oss", HARMONY)] == before + 1


def test_a_harmony_chat_is_not_sent_to_the_tokenizing_worker(svc: KvIndexService) -> None:
    # the worker would render it for nothing
    request = build_request(CHAT, {"model": "gpt-oss", "messages": MSGS}, {})
    assert svc.tokenizing_chars(request) == 0
    assert svc.tokenizing_chars(build_request(CHAT, {"model": "llama", "messages": MSGS}, {})) > 0


def test_a_long_harmony_chat_reports_harmony_not_too_long(svc: KvIndexService) -> None:
    long = [{"role": "user", "content": "x" * (svc.max_keyed_prompt_chars + 1)}]
    assert _tokens(svc, CHAT, {"model": "gpt-oss", "messages": long}) == (None, HARMONY)


def test_a_gpt_oss_completion_is_tokenized_as_usual(svc: KvIndexService) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids, reason = _tokens(svc, CMPL, {"model": "gpt-oss", "prompt": text})
    tok = svc.tokenizers.get("gpt-oss")
    assert tok is not None and reason is None
    assert [int(i) for i in ids] == tok.encode_uncached(text, add_special_tokens=True)


def test_a_gpt_oss_embeddings_chat_is_rendered_with_the_template(svc: KvIndexService) -> None:
    # vLLM's pooling path renders chats with the template: no Harmony there
    ids, reason = _tokens(svc, EMB, {"model": "gpt-oss", "messages": MSGS})
    llama_ids, _ = _tokens(svc, EMB, {"model": "llama", "messages": MSGS})
    assert reason is None and [int(i) for i in ids] == [int(i) for i in llama_ids]


def test_encode_request_refuses_a_harmony_chat_with_its_reason(svc: KvIndexService) -> None:
    tok = svc.tokenizers.get("gpt-oss")
    assert tok is not None
    with pytest.raises(NotReproduced) as err:
        tok.encode_request(build_request(CHAT, {"model": "gpt-oss", "messages": MSGS}, {}))
    assert err.value.reason == HARMONY and "gpt-oss" in str(err.value)


# --- Mistral's tokenizer ---


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


def _with_files(tiny: Path, dst: Path, *files: str) -> Path:
    shutil.copytree(tiny, dst)
    for name in files:
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_text("{}")
    return dst


def _service(paths: dict[str, Path | TokenizerSpec]) -> KvIndexService:
    return KvIndexService(BlockIndex(BS, 1000), FreshnessTracker(), TokenizerRegistry(paths), BS)


def _hf(path: Path) -> TokenizerSpec:
    return TokenizerSpec(str(path), ServerChatSettings(tokenizer_mode="hf"))


def test_mistral_files_are_found_by_base_name_anywhere_in_the_directory(tiny: Path, tmp_path: Path) -> None:
    d = _with_files(tiny, tmp_path / "d", "tekken.json", "sub/tokenizer.model.v7", "tokenizer.model")
    assert mistral_files(d) == [
        "sub/tokenizer.model.v7",
        "tekken.json",
    ]  # not tokenizer.model (sentencepiece)
    plain = _with_files(tiny, tmp_path / "plain", "tokenizer.model", "tekken.json.bak")
    assert mistral_files(plain) == []


@pytest.mark.parametrize("files", [("tekken.json",), ("tokenizer.model.v3",), ("nested/tekken.json",)])
def test_a_mistral_format_directory_leaves_text_and_chat_prompts_unkeyed(
    tiny: Path, tmp_path: Path, files: tuple[str, ...]
) -> None:
    svc = _service({"mistral": _with_files(tiny, tmp_path / "mistral", *files)})
    for headers, body in (
        (CHAT, {"messages": MSGS}),
        (RESP, {"input": "hello"}),
        (CMPL, {"prompt": "hello there"}),
        (EMB, {"input": "hello there"}),
        (EMB, {"messages": MSGS}),
    ):
        request = build_request(headers, {"model": "mistral", **body}, {})
        assert svc.tokenize(request).unkeyed == MISTRAL_TOKENIZER, (headers, body)
        assert svc.tokenizing_chars(request) == 0
    # token ids are the engine's whatever its tokenizer: keyed as given
    assert svc.tokenize(build_request(CMPL, {"model": "mistral", "prompt": [1, 2, 3, 4, 5]}, {})).ids == [
        1,
        2,
        3,
        4,
        5,
    ]
    request = build_request(CHAT, {"model": "mistral", "messages": MSGS}, {})
    assert svc.prompt_keys(request) is None and svc.unkeyed[("mistral", MISTRAL_TOKENIZER)] == 1


def test_tokenizer_mode_hf_keys_a_mistral_format_directory_and_mistral_mode_keys_nothing(
    tiny: Path, tmp_path: Path
) -> None:
    files = _with_files(tiny, tmp_path / "files", "tekken.json")
    svc = _service(
        {
            "hf": _hf(files),
            "forced": TokenizerSpec(str(tiny), ServerChatSettings(tokenizer_mode="mistral")),
            "plain": tiny,
        }
    )
    for model, reason in (("hf", None), ("forced", MISTRAL_TOKENIZER), ("plain", None)):
        result = svc.tokenize(build_request(CHAT, {"model": model, "messages": MSGS}, {}))
        assert result.unkeyed == reason, model
        assert (result.ids is None) == (reason is not None)
    assert svc.tokenizers.mistral_models() == {"forced": "tokenizerMode: mistral"}


def test_the_server_logs_the_mistral_models_once_at_load_time(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = _with_files(tiny, tmp_path / "m", "tekken.json")
    text = (
        DEFAULT_CONFIG_YAML
        + f"tokenizers: {{mistral: '{d}', plain: '{tiny}', hf: {{path: '{d}', tokenizerMode: hf}}}}\n"
    )
    with caplog.at_level(logging.WARNING, logger="epp.server"):
        EppServer(ServerSettings(secure_serving=False), parse_config(text, "m.yaml"))
    logged = [r.getMessage() for r in caplog.records if "Mistral" in r.getMessage()]
    assert len(logged) == 1
    assert "'mistral'" in logged[0] and "tekken.json" in logged[0] and "mistral_tokenizer" in logged[0]


def test_tokenizer_mode_is_read_from_the_config_and_checked() -> None:
    cfg = parse_config(
        DEFAULT_CONFIG_YAML + "tokenizers: {m: {path: /m, tokenizerMode: hf}, n: {path: /n}}\n", "e"
    )
    assert cfg.tokenizers == {"m": TokenizerSpec("/m", ServerChatSettings(tokenizer_mode="hf")), "n": "/n"}
    for bad in ("slow", "HF", "''"):
        with pytest.raises(ConfigError) as err:
            parse_config(
                DEFAULT_CONFIG_YAML + f"tokenizers: {{m: {{path: /m, tokenizerMode: {bad}}}}}\n", "e"
            )
        assert err.value.field == "tokenizerMode" and "must be one of auto, hf, mistral" in err.value.message
