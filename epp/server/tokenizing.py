"""Long prompts are tokenized in a worker thread, so that the event loop keeps serving meanwhile.

Tokenizing a text or chat prompt costs about 1 ms per KB when its prefix is not cached (a 220 KB chat:
~200 ms). On the event loop that time would stop every other stream, the KV-event subscriber and the
metrics scrapes with it. So a prompt of at least `offload_chars` characters is tokenized ahead of
scheduling in one worker thread (the tokenizer's long calls let go of the GIL: `kvindex/prompt.py`),
and its ids reach the scorers with the request (`InferenceRequest.tokens`). Shorter prompts are
tokenized by the scorers on the loop as before (a thread hop costs more than they do), except while
the worker has work: then they queue behind it, so the loop never waits for the tokenizer's lock and
requests are tokenized in the order they came.

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


class PromptTokenizing:
    def __init__(self, service: KvIndexService, offload_chars: int = OFFLOAD_CHARS) -> None:
        self.service = service
        self.offload_chars = offload_chars
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epp-tokenize")
        self._jobs = 0  # submitted and not finished (counted on the loop)
        self.offloaded = 0  # requests tokenized in the worker so far

    @property
    def busy(self) -> bool:
        return self._jobs > 0

    def wanted(self, request: InferenceRequest) -> bool:
        """Whether `request` should be tokenized in the worker: a long text or chat prompt with a
        tokenizer, or any prompt to tokenize while the worker has work."""
        if request.tokens is not None:
            return False
        chars = self.service.tokenizing_chars(request)
        return chars > 0 and (chars >= self.offload_chars or self._jobs > 0)

    async def tokenize(self, request: InferenceRequest) -> InferenceRequest:
        """`request` with its prompt's ids (or why there are none) computed in the worker thread."""
        loop = asyncio.get_running_loop()
        job: Future[PromptTokens] = self._executor.submit(self.service.tokenize, request)
        self._jobs += 1
        # Counted down when the job ends in the worker, not when the awaiting stream goes away: until
        # then, prompts that the loop would tokenize itself queue behind it instead.
        job.add_done_callback(lambda _: _call_soon(loop, self._done))
        self.offloaded += 1
        tokens = await asyncio.wrap_future(job)
        return dataclasses.replace(request, tokens=tokens)

    def _done(self) -> None:
        self._jobs -= 1

    def close(self) -> None:
        """Queued jobs are dropped; a job running finishes in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop was closed: nothing is waiting any more
        loop.call_soon_threadsafe(fn)
