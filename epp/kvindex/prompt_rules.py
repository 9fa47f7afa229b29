"""Where vLLM's prompt ids are not the tokenizer's plain encoding: what the EPP leaves unkeyed, and the
truncation it applies as vLLM does. Pure.

- What vLLM computes another way is not guessed at (`NotReproduced`, with the unkeyed reason to report):
  a gpt-oss model's chats (config.json's `model_type` "gpt_oss"), which vLLM renders with Harmony
  (`openai_harmony`), never with the Jinja template (`OnlineRenderer.use_harmony`,
  `vllm/renderers/online_renderer.py`, for chat completions and Responses); its completions' text prompts
  are encoded as usual (`render_completion` does not use Harmony), and so are embeddings' chats (the
  pooling path renders the template). And every text and chat prompt of a model whose vLLM runs
  `mistral_common`'s tokenizer (`MISTRAL_TOKENIZER`): `--tokenizer-mode mistral`, or `auto` (vLLM's
  default) with Mistral's files in the directory (`tokenizer_files.mistral_files`), unless the server
  settings say `hf`; token-id prompts are keyed as given.
- `truncate_prompt_tokens` (`TokenizeParams`, `vllm/renderers/params.py`): N >= 0 keeps what vLLM keeps
  (`truncate_encoded`: the tokenizer's own truncation of a text prompt, special tokens kept, then the cut
  to N ids, from the request's `truncation_side` or the model's: "left" for completions and chats,
  "right" for embeddings); -1 (the model's length, unknown here) is `PROMPT_TRUNCATION`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from epp.kvindex.prefix_cache import TokenIds
from epp.kvindex.tokenizer_files import TokenizerError, mistral_files
from epp.types import ApiKind, InferenceRequest

HARMONY = "harmony"  # a gpt-oss chat: vLLM renders it with Harmony, not the chat template
MISTRAL_TOKENIZER = "mistral_tokenizer"  # vLLM tokenizes and renders with mistral_common, not transformers
# a `truncate_prompt_tokens` the EPP cannot apply as vLLM does: -1 (the model's length, unknown here), or a
# text prompt encoded with special tokens that are not a fixed prefix/suffix
PROMPT_TRUNCATION = "prompt_truncation"

_Ids = TypeVar("_Ids", list[int], TokenIds, npt.NDArray[Any])


class NotReproduced(TokenizerError):
    """vLLM computes this request's prompt ids in a way the EPP does not reproduce: keying it with the ids
    computed here would give keys no engine holds. `reason` is the unkeyed reason to report."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def truncated(ids: _Ids, count: int, side: str) -> _Ids:
    """vLLM's `TokenizeParams._token_truncation`: the last `count` ids ("left" truncation drops the first
    ones) or the first `count` ("right"); all of them when there are no more than `count`."""
    if count >= len(ids):
        return ids
    if count == 0:
        return ids[:0]
    return ids[-count:] if side == "left" else ids[:count]


def unkeyed_reason(request: InferenceRequest, *, mistral: bool, harmony: bool) -> str | None:
    """Why vLLM's prompt ids for this request cannot be computed here (the reason to report), or None, for
    a model whose vLLM runs `mistral_common` (`mistral`) or renders chats with Harmony (`harmony`). A
    gpt-oss chat (`HARMONY`): vLLM renders chat completions and Responses requests with Harmony; the ids of
    the Jinja template's text would be wrong, not merely unknown. Any text or chat prompt of a model vLLM
    tokenizes with `mistral_common` (`MISTRAL_TOKENIZER`). `truncate_prompt_tokens` -1."""
    if mistral and (request.messages is not None or isinstance(request.prompt, str)):
        return MISTRAL_TOKENIZER
    if harmony and request.messages is not None and request.api_kind is not ApiKind.EMBEDDINGS:
        return HARMONY
    if request.truncate_prompt_tokens == -1 and (request.messages is not None or request.prompt is not None):
        return PROMPT_TRUNCATION
    return None


def truncate_encoded(
    ids: TokenIds,
    request: InferenceRequest,
    affixes: tuple[list[int], list[int]] | None,
    name: str,
    *,
    special: bool,
) -> TokenIds:
    """The ids vLLM keeps of a text or chat prompt encoded as `ids` (`special`: with special tokens, which
    the tokenizer puts around the text as `affixes`, or None when they are no fixed prefix/suffix) when the
    request sets `truncate_prompt_tokens` (>= 0). vLLM encodes with the tokenizer's truncation
    (`TokenizeParams.get_encode_kwargs`: `truncation=True, max_length=N`), whose budget leaves room for the
    tokens the post-processor adds (the prompt's own tokens are cut, the bos and eos stay; a budget smaller
    than they are cuts nothing), then cuts the ids to N (`_token_truncation`)."""
    count, side = request.truncate_prompt_tokens, request.kept_side
    if count is None or count >= len(ids):
        return ids
    if special:
        if affixes is None:
            raise NotReproduced(
                PROMPT_TRUNCATION,
                f"{name}: truncate_prompt_tokens, and the special tokens are no fixed prefix/suffix",
            )
        head, tail = len(affixes[0]), len(affixes[1])
        if head + tail and count >= head + tail:
            body = truncated(ids[head : len(ids) - tail], count - head - tail, side)
            ids = np.concatenate([ids[:head], body, ids[len(ids) - tail :]])
    return truncated(ids, count, side)


def mistral_tokenizer_reason(root: Path, mode: str) -> str | None:
    """Why vLLM runs `mistral_common`'s tokenizer for the model of this directory with this
    `--tokenizer-mode`, or None (Transformers', which the EPP reproduces)."""
    if mode == "mistral":
        return "tokenizerMode: mistral"
    if mode != "auto":
        return None
    found = mistral_files(root)
    if not found:
        return None
    return f"{', '.join(found)} in the directory (vLLM's --tokenizer-mode auto; set tokenizerMode: hf if not)"
