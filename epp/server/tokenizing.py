"""Long prompts are tokenized in a worker thread, so that the event loop keeps serving meanwhile.

Tokenizing a text or chat prompt costs about 1 ms per KB when its prefix is not cached (a 220 KB chat:
~200 ms). On the event loop that time would stop every other stream, the KV-event subscriber and the
metrics scrapes with it. So a prompt of at least `offload_chars` characters is tokenized ahead of
scheduling in one worker thread (the tokenizer's long calls let go of the GIL: `kvindex/prompt.py`),
and its ids reach the scorers with the request (`InferenceRequest.tokens`). Shorter prompts are
tokenized by the scorers on the loop as before (a thread hop costs more than they do), except while
the worker has work: then they queue behind it, so the loop never waits for the tokenizer's lock and
requests are tokenized in the order they came. The queue is bounded (`MAX_QUEUED_CHARS`); a request that
will be refused anyway (no endpoint, a sheddable one while the pool is saturated, the filters leaving
none) is refused before its prompt is tokenized (`Director.precheck`); and the server tokenizes ahead
only when a plugin that a profile uses reads prompts' tokens (`KvIndexService.prompt_readers`).

One thread: the prefix cache is shared by all of a model's prompts and takes one caller at a time, and
the work is bounded by `index.maxKeyedPromptChars` per request.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from epp.kvindex.service import KvIndexService
from epp.server.serial_worker import SerialWorker
from epp.types import InferenceRequest, PromptTokens

OFFLOAD_CHARS = 16 * 1024
"""Prompts of at least this many characters are tokenized in the worker thread (~15 ms cold)."""
MAX_QUEUED_CHARS = 2 * 1024 * 1024
"""Characters of prompts the worker may have queued (about 2 s of cold tokenizing). A prompt that would
go past it is routed at once without cache credit (unkeyed, `tokenizer_busy`): under a flood of long
prompts the wait to be routed stays bounded, and so does the memory of the requests held meanwhile."""

BUSY = PromptTokens(None, "tokenizer_busy")


class PromptTokenizing:
    def __init__(
        self,
        service: KvIndexService,
        offload_chars: int = OFFLOAD_CHARS,
        max_queued_chars: int = MAX_QUEUED_CHARS,
    ) -> None:
        self.service = service
        self.offload_chars = offload_chars
        self.max_queued_chars = max_queued_chars
        self._worker = SerialWorker("epp-tokenize")

    @property
    def busy(self) -> bool:
        return self._worker.busy

    @property
    def queued_chars(self) -> int:
        """Characters of the prompts submitted to the worker and not finished."""
        return self._worker.queued

    @property
    def offloaded(self) -> int:
        """Prompts the worker tokenized (or tried to) so far."""
        return self._worker.completed

    def plan(self, request: InferenceRequest) -> InferenceRequest | None:
        """None when `request`'s prompt should be tokenized in the worker first (`tokenize`): a long text
        or chat prompt with a tokenizer, a chat with tools or documents (however short its body: a
        template may render their JSON at many times its size, e.g. `tojson(indent=4)` of nested
        schemas), or any prompt to tokenize while the worker has work. Else the request to route now: as
        it is (the scorers tokenize it on the loop, or there is nothing to tokenize), or marked `BUSY`
        when the worker's queue is full."""
        if request.tokens is not None:
            return request
        chars = self.service.tokenizing_chars(request)
        busy = self._worker.busy
        if chars == 0 or (chars < self.offload_chars and not busy and not _renders_json(request)):
            return request
        if busy and self._worker.queued + chars > self.max_queued_chars:
            return dataclasses.replace(request, tokens=BUSY)
        return None

    async def tokenize(self, request: InferenceRequest) -> InferenceRequest:
        """`request` with its prompt's ids (or why there are none) computed in the worker thread. The
        job counts as the worker's work until it has ended there, even when the awaiting stream goes
        away first: until then, prompts that the loop would tokenize itself queue behind it."""
        chars = self.service.tokenizing_chars(request)
        tokens = await self._worker.run(partial(self.service.tokenize, request), weight=chars)
        return dataclasses.replace(request, tokens=tokens)

    def close(self) -> None:
        """Queued jobs are dropped; a job running finishes in the background."""
        self._worker.close()


def _renders_json(request: InferenceRequest) -> bool:
    """Whether the chat template is given JSON values to render: tools, documents, or any list or object
    in `chat_template_kwargs` (where a client may pass `tools` too, which vLLM's templates read alike)."""
    chat = request.chat
    if chat is None:
        return False
    if chat.tools or chat.documents:
        return True
    kwargs = chat.chat_template_kwargs
    return kwargs is not None and any(isinstance(v, (list, dict)) for v in kwargs.values())
