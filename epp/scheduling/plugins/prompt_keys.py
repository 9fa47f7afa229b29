"""The prompt's token count and block keys, computed once per scheduling cycle and shared by plugins."""

from __future__ import annotations

import numpy as np

from epp.kvindex.service import KvIndexService
from epp.scheduling.framework import CycleState
from epp.types import InferenceRequest

KEYS = "prompt_block_keys"
KEY_LIST = "prompt_block_key_list"
TOKENS = "prompt_tokens"


def prompt_info(
    state: CycleState, request: InferenceRequest, service: KvIndexService
) -> tuple[int | None, np.ndarray | None]:
    """(token count, block keys) of the prompt; both None when it cannot be tokenized."""
    data = state.data
    if KEYS not in data:
        data[TOKENS], data[KEYS] = service.prompt_tokens_and_keys(request)
    keys: np.ndarray | None = data[KEYS]
    tokens: int | None = data[TOKENS]
    return tokens, keys


def prompt_keys(state: CycleState, request: InferenceRequest, service: KvIndexService) -> np.ndarray | None:
    return prompt_info(state, request, service)[1]


def prompt_key_list(state: CycleState, keys: np.ndarray) -> list[int]:
    """The cycle's prompt keys (`keys`, from `prompt_info`) as Python ints, converted once per cycle: the
    speculative store reads them when scoring and again when the pick is remembered."""
    data = state.data
    ks: list[int] | None = data.get(KEY_LIST)
    if ks is None:
        ks = data[KEY_LIST] = keys.tolist()
    return ks
