"""The prompt's token count and block keys, computed once per scheduling cycle and shared by plugins."""

from __future__ import annotations

import numpy as np

from epp.kvindex.service import KvIndexService
from epp.scheduling.framework import CycleState
from epp.types import InferenceRequest

KEYS = "prompt_block_keys"
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
