"""Blocks whose vLLM `extra_keys` carry a multimodal item (an `(identifier, offset)` pair) or a prompt-embeds
digest are indexed under keys of their own (`batch_reader.opaque_tokens`): the same image on two pods shares
keys, another image with the same placeholder token ids does not, and a token-id prompt of those ids gets
no credit from them (vLLM's hashes differ, so its cache would miss)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from epp.kvindex.batch_reader import decode, opaque_tokens
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import KvIngest
from epp.kvindex.keys import block_keys, root_key
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.service import KvIndexService
from epp.testing.tokenizer import build_tiny_tokenizer
from epp.types import ApiKind, InferenceRequest, PromptTokens

BS = 4
PLACEHOLDER = 151_655  # an image token: the same ids whatever the image
TOKENS = [1, 2, 3, 4] + [PLACEHOLDER] * 8 + [5, 6, 7, 8]  # text, a 2-block image, text


def extra(image: str | None) -> list[object] | None:
    """vLLM 0.32's `extra_keys` for TOKENS: the image's (identifier, offset from the block start) pairs on
    blocks 1 and 2 (`to_event_extra_keys`), None elsewhere; None for the whole event without an image."""
    if image is None:
        return None
    return [None, [[image, 0]], [[image, -BS]], None]


def stored(image: str | None) -> bytes:
    event = {
        "type": "BlockStored",
        "block_hashes": [11, 12, 13, 14],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "lora_id": None,
        "block_size": BS,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": extra(image),
        "group_idx": 0,
    }
    return msgspec.msgpack.encode([1.0, [event], 0])


def test_image_blocks_are_keyed_by_their_image_not_their_placeholder_ids() -> None:
    index = BlockIndex(block_size=BS)
    ingest = KvIngest(index, FreshnessTracker(), lambda pod: "m")
    for pod, image in (("a", "mm-A"), ("a2", "mm-A"), ("b", "mm-B"), ("text", None)):
        ingest.on_live(pod, 0, 0, stored(image), 0.0)
    pods = ["a", "a2", "b", "text"]
    plain = index.lookup(block_keys(TOKENS, BS, root_key("m")), pods)
    assert {p: plain[p].get("any", 0) for p in pods} == {
        "a": 1,
        "a2": 1,
        "b": 1,
        "text": 4,
    }  # (block 0 is text)
    a = decode(stored("mm-A")).runs[0][7]
    assert list(a[:4]) == TOKENS[:4] and list(a[12:]) == TOKENS[12:] and min(a[4:12]) < 0  # type: ignore[index]
    image_a = index.lookup(block_keys(list(a), BS, root_key("m")), pods)  # type: ignore[arg-type]
    assert {p: image_a[p].get("any", 0) for p in pods} == {"a": 4, "a2": 4, "b": 1, "text": 1}


def test_blocks_of_strings_only_keep_their_ids() -> None:
    ids = tuple(TOKENS)
    assert opaque_tokens(ids, [None, None, None, None], BS) is ids
    assert opaque_tokens(ids, [["tenant"], None, None, None], BS) is ids  # a salt (the root carries it)
    digest = opaque_tokens(ids, [None, None, None, [b"\x00" * 32]], BS)  # prompt embeddings
    assert list(digest[:12]) == TOKENS[:12] and len(set(digest[12:])) == 1 and digest[12] < 0


def test_a_chat_with_an_image_is_unkeyed_as_multimodal_not_as_a_tokenizer_error(tmp_path: Path) -> None:
    """The EPP cannot know an image's tokens or hashes: such a chat is routed by load, and counted under a
    reason of its own, so operators do not read it as a broken tokenizer."""
    kv = KvIndexService(
        BlockIndex(block_size=BS),
        FreshnessTracker(),
        TokenizerRegistry({"m": build_tiny_tokenizer(tmp_path)}),
        BS,
    )
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    chat = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    request = InferenceRequest("r", ApiKind.CHAT_COMPLETIONS, "m", messages=chat, body_bytes=200)
    assert kv.tokenize(request) == PromptTokens(None, "multimodal")
    text_only = InferenceRequest(
        "r", ApiKind.CHAT_COMPLETIONS, "m", messages=[{"role": "user", "content": "hi"}]
    )
    assert kv.tokenize(text_only).unkeyed is None
