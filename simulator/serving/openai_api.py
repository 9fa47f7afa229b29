"""The aiohttp routes of the simulated engine: the OpenAI API as vLLM serves it, `/health`, `/metrics`.

Timing of a response (engine times are kernel seconds, see `realtime.py`):

- non-streaming: the JSON answer is sent when the engine's `on_finish` fires;
- streaming (SSE): headers at once; the first chunk (the first token; for chat also the assistant
  role) when `on_first_token` fires; then a chunk each time `stream_interval` more tokens have been
  decoded (one token per engine step, see `engine_runner.Pending.tokens_out`); at `on_finish` the
  rest with `finish_reason` "length", the usage chunk if `stream_options.include_usage`, and
  `data: [DONE]`.

A client that goes away has its request aborted, as vLLM does: a stream notices when a write fails, a
non-streaming request when the server cancels its handler (`handler_cancellation`); the engine drops
it before its next step (`Engine.abort`). Requests arriving while the server stops get 503; streams
cut by the stop end with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from functools import partial

import msgspec
import numpy as np
import numpy.typing as npt
from aiohttp import web

from epp.server.serial_worker import SerialWorker
from simulator.serving.engine_runner import EngineRunner, EngineStopped, Pending
from simulator.serving.metrics import CONTENT_TYPE, EngineMetrics
from simulator.serving.output_text import OutputText
from simulator.serving.request_body import ApiError, BodyReader, Generation, decode_body
from simulator.serving.responses import DONE, ResponseShape, error_event, usage

_JSON = "application/json"


OFFLOAD_BODY_BYTES = 16 * 1024
"""Bodies this long with a tokenizer are read in the worker thread (and any while it has work, so that
the loop never waits for the tokenizer's lock)."""


def error_response(err: ApiError) -> web.Response:
    return web.Response(status=err.status, body=msgspec.json.encode(err.body()), content_type=_JSON)


class OpenAiApi:
    def __init__(
        self,
        runner: EngineRunner,
        reader: BodyReader,
        text: OutputText,
        metrics: EngineMetrics,
        *,
        max_model_len: int,
        stream_interval: int = 1,
    ) -> None:
        self.runner = runner
        self.reader = reader
        self.text = text
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.stream_interval = stream_interval
        self.created = int(time.time())
        self.rejected = 0  # requests answered with an error
        # Long bodies to tokenize are read in a worker thread, as vLLM's API server tokenizes apart from
        # its engine: the event loop, which runs the engine's steps, does not stop for them.
        self.tokenizing = SerialWorker("sim-tokenize")
        self.disconnects = 0  # streams whose client went away

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)

    # -- inference ---------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            raw = await request.read()
            doc = decode_body(raw)
            if self.reader.tokenizer is not None and (self.tokenizing.busy or len(raw) >= OFFLOAD_BODY_BYTES):
                gen = await self.tokenizing.run(partial(self.reader.read, doc, chat=chat), weight=len(raw))
            else:
                gen = self.reader.read(doc, chat=chat)
            prefix = "chatcmpl" if chat else "cmpl"
            request_id = f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"
            out = self.text.output_ids(gen.prompt_ids, gen.cache_salt, gen.max_tokens)
            pending = self._submit(request_id, gen, out)
        except ApiError as err:
            self.rejected += 1
            return error_response(err)
        shape = ResponseShape(request_id, int(time.time()), gen.model, chat)
        if gen.stream:
            return await self._stream(request, gen, pending, shape)
        try:
            await pending.finished
        except EngineStopped as err:
            return error_response(ApiError(str(err), status=503))
        except asyncio.CancelledError:  # the client went away (the server cancels its handler)
            self._client_gone(pending)
            raise
        rec = pending.record
        use = usage(rec.prompt_tokens, rec.output_tokens, rec.reported_cached_tokens)
        return web.Response(body=shape.complete(self.text.text(pending.output_ids), use), content_type=_JSON)

    def _submit(self, request_id: str, gen: Generation, out: npt.NDArray[np.int64]) -> Pending:
        try:
            return self.runner.submit(request_id, gen.prompt_ids, gen.max_tokens, out, gen.cache_salt)
        except EngineStopped as err:
            raise ApiError(str(err), status=503) from None
        except ValueError as err:  # the engine refuses it: it can never fit the KV cache
            raise ApiError(
                f"the request can never fit this engine's KV cache (max_model_len {self.max_model_len}): "
                f"{err}",
                param="messages" if gen.chat else "prompt",
            ) from None

    async def _stream(
        self, request: web.Request, gen: Generation, pending: Pending, shape: ResponseShape
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        try:
            await resp.prepare(request)
            await self._stream_tokens(resp, gen, pending, shape)
        except EngineStopped as err:
            with contextlib.suppress(ConnectionError):
                await resp.write(error_event(ApiError(str(err), status=503).body()))
        except ConnectionError:  # the client went away (a write failed)
            self._client_gone(pending)
        except asyncio.CancelledError:  # the client went away (the server cancelled this handler)
            self._client_gone(pending)
            raise
        return resp

    def _client_gone(self, pending: Pending) -> None:
        """Abort the request, as vLLM does when its client goes away."""
        self.disconnects += 1
        self.runner.abort(pending)

    async def _stream_tokens(
        self, resp: web.StreamResponse, gen: Generation, pending: Pending, shape: ResponseShape
    ) -> None:
        await pending.first_token
        pieces: Iterator[str] = self.text.pieces(pending.output_ids)
        total = gen.max_tokens
        runner = self.runner
        sent = 0
        while True:
            finished = pending.finished.done()
            if finished:
                pending.finished.result()  # EngineStopped if the server stopped first
            due = pending.tokens_out(runner.steps_ended())
            if due > sent and (sent == 0 or finished or due - sent >= self.stream_interval):
                text = "".join(next(pieces) for _ in range(due - sent))
                chunk = shape.chunk(text, first=sent == 0, last=due == total, include_usage=gen.include_usage)
                await resp.write(chunk)
                sent = due
            if finished:
                break
            await runner.driver.tick()
        if gen.include_usage:
            rec = pending.record
            use = usage(rec.prompt_tokens, rec.output_tokens, rec.reported_cached_tokens)
            await resp.write(shape.usage_chunk(use))
        await resp.write(DONE)
        await resp.write_eof()

    # -- the rest ----------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        model = self.reader.model
        card = {
            "id": model,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's dev-mode endpoint: 200 once every cached block is forgotten (`AllBlocksCleared` is
        published); 409 while requests are queued or running (vLLM refuses a reset while blocks are in
        use)."""
        if self.runner.reset_prefix_cache():
            return web.Response(status=200)
        return web.json_response(
            {"error": {"message": "requests are in flight: the prefix cache can be reset once idle"}},
            status=409,
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.runner.driver.running else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        self.runner.advance()
        return web.Response(body=self.metrics.render(), headers={"content-type": CONTENT_TYPE})
