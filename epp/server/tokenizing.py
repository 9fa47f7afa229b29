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

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from epp.kvindex.service import KvIndexService
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
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epp-tokenize")
        self._jobs = 0  # submitted and not finished (counted on the loop)
        self._queued_chars = 0  # their prompts' characters
        self.offloaded = 0  # prompts the worker tokenized (or tried to) so far

    @property
    def busy(self) -> bool:
        return self._jobs > 0

    @property
    def queued_chars(self) -> int:
        return self._queued_chars

    def plan(self, request: InferenceRequest) -> InferenceRequest | None:
        """None when `request`'s prompt should be tokenized in the worker first (`tokenize`): a long text
        or chat prompt with a tokenizer, or any prompt to tokenize while the worker has work. Else the
        request to route now: as it is (the scorers tokenize it on the loop, or there is nothing to
        tokenize), or marked `BUSY` when the worker's queue is full."""
        if request.tokens is not None:
            return request
        chars = self.service.tokenizing_chars(request)
        if chars == 0 or (chars < self.offload_chars and self._jobs == 0):
            return request
        if self._jobs and self._queued_chars + chars > self.max_queued_chars:
            return dataclasses.replace(request, tokens=BUSY)
        return None

    async def tokenize(self, request: InferenceRequest) -> InferenceRequest:
        """`request` with its prompt's ids (or why there are none) computed in the worker thread."""
        loop = asyncio.get_running_loop()
        chars = self.service.tokenizing_chars(request)
        job: Future[PromptTokens] = self._executor.submit(self.service.tokenize, request)
        self._jobs += 1
        self._queued_chars += chars
        # Counted down when the job ends in the worker, not when the awaiting stream goes away: until
        # then, prompts that the loop would tokenize itself queue behind it instead.
        job.add_done_callback(lambda f: _call_soon(loop, lambda: self._done(chars, not f.cancelled())))
        tokens = await asyncio.wrap_future(job)
        return dataclasses.replace(request, tokens=tokens)

    def _done(self, chars: int, ran: bool) -> None:
        self._jobs -= 1
        self._queued_chars -= chars
        self.offloaded += ran

    def close(self) -> None:
        """Queued jobs are dropped; a job running finishes in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop was closed: nothing is waiting any more
        loop.call_soon_threadsafe(fn)
