"""A fake OpenAI-compatible model server (vLLM-flavoured) for tests, benchmarks and demos.

Every knob is a plain attribute that can be changed while the server runs (also over HTTP
with ``POST /fake/knobs`` when the server lives in another process). Run several in a
separate process with ``python -m epp.testing.backend --count 16 --port-file PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, cast, get_args

from aiohttp import web

MetricsMode = Literal["ok", "error500", "hang", "garbage"]
METRICS_MODES: tuple[str, ...] = get_args(MetricsMode)
_KNOBS = (
    "waiting",
    "running",
    "kv_usage",
    "metrics_mode",
    "stream_delay",
    "num_chunks",
    "response_delay",
    "fail_status",
    "auto_running",
    "prefill_per_token",
)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the fake server received it."""

    method: str
    path: str
    headers: dict[str, str]  # keys lower-cased
    body_len: int
    body_sha256: str
    json: Any | None  # parsed body, or None when it was not JSON


def _prompt_chars(payload: Any) -> int:
    if not isinstance(payload, dict):
        return 0
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, str) else 4 for p in prompt)
    total = 0
    for msg in payload.get("messages") or []:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
    return total


class FakeModelServer:
    """An aiohttp server speaking enough of the OpenAI API (and vLLM ``/metrics``) for routing tests."""

    def __init__(
        self,
        name: str = "pod",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "fake-model",
        waiting: int = 0,
        running: int = 0,
        kv_usage: float = 0.0,
        metrics_mode: MetricsMode = "ok",
        stream_delay: float = 0.0,
        num_chunks: int = 4,
        response_delay: float = 0.0,
        fail_status: int | None = None,
        auto_running: bool = False,
        prefill_per_token: float = 0.0,
        block_size: int = 16,
        num_gpu_blocks: int = 4096,
    ) -> None:
        self.name = name
        self.host = host
        self.model = model
        # Runtime knobs.
        self.waiting = waiting
        self.running = running
        self.kv_usage = kv_usage
        self.metrics_mode: MetricsMode = metrics_mode
        self.stream_delay = stream_delay
        self.num_chunks = num_chunks
        self.response_delay = response_delay  # seconds before the response starts
        self.fail_status = fail_status  # answer inference requests with this status when set
        self.auto_running = auto_running  # report running + in-flight requests
        self.prefill_per_token = prefill_per_token  # seconds per prompt token before the response starts
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        # Observations.
        self.requests: list[RecordedRequest] = []
        self.in_flight = 0
        self.metrics_scrapes = 0
        self._requested_port = port
        self._port: int | None = None
        self._runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()

    # ---- lifecycle -------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(f"FakeModelServer {self.name!r} is not started")
        return self._port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("already started")
        self._stopping = asyncio.Event()
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._inference)
        app.router.add_post("/v1/chat/completions", self._inference)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/fake/knobs", self._get_knobs)
        app.router.add_post("/fake/knobs", self._set_knobs)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self._requested_port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._port = int(runner.addresses[0][1])
        self._runner = runner

    async def stop(self) -> None:
        self._stopping.set()  # releases "hang" handlers and streams
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> FakeModelServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def served(self, path: str | None = None) -> list[RecordedRequest]:
        """Recorded inference requests, optionally only those for ``path``."""
        return [r for r in self.requests if path is None or r.path == path]

    def knobs(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _KNOBS}

    def set_knobs(self, **values: Any) -> None:
        for key, value in values.items():
            if key not in _KNOBS:
                raise ValueError(f"unknown knob {key!r}; known: {', '.join(_KNOBS)}")
            if key == "metrics_mode" and value not in METRICS_MODES:
                raise ValueError(f"metrics_mode must be one of {METRICS_MODES}")
            setattr(self, key, value)

    # ---- handlers -------------------------------------------------------------------------------
    def _headers(self, content_type: str) -> dict[str, str]:
        return {"x-served-by": self.name, "content-type": content_type}

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        payload: Any | None
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        self.requests.append(
            RecordedRequest(
                method=request.method,
                path=request.path,
                headers={k.lower(): v for k, v in request.headers.items()},
                body_len=len(body),
                body_sha256=hashlib.sha256(body).hexdigest(),
                json=payload,
            )
        )
        self.in_flight += 1
        try:
            return await self._answer(request, payload)
        finally:
            self.in_flight -= 1

    def _error(self, status: int, message: str) -> web.Response:
        err = {
            "object": "error",
            "message": message,
            "type": "BadRequestError",
            "code": status,
            "served_by": self.name,
        }
        return web.Response(status=status, text=json.dumps(err), headers=self._headers("application/json"))

    async def _answer(self, request: web.Request, payload: Any | None) -> web.StreamResponse:
        delay = self.response_delay + self.prefill_per_token * math.ceil(_prompt_chars(payload) / 4)
        if delay > 0:
            await self._sleep(delay)
        if self.fail_status is not None:
            return self._error(self.fail_status, "injected failure")
        if not isinstance(payload, dict):
            return self._error(400, "body is not a JSON object")
        chat = request.path.endswith("/chat/completions")
        prompt_tokens = max(1, math.ceil(_prompt_chars(payload) / 4))
        n = max(1, int(self.num_chunks))
        max_tokens = payload.get("max_tokens") or payload.get("max_completion_tokens")
        if isinstance(max_tokens, int) and max_tokens > 0:
            n = min(n, max_tokens)
        pieces = [f"tok{i} " for i in range(n)]
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": payload.get("model", self.model),
            "served_by": self.name,
        }
        if not payload.get("stream"):
            text = "".join(pieces)
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            )
            doc = {
                **base,
                "object": "chat.completion" if chat else "text_completion",
                "choices": [choice],
                "usage": usage,
            }
            return web.Response(text=json.dumps(doc), headers=self._headers("application/json"))
        options = payload.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        resp = web.StreamResponse(
            status=200, headers={**self._headers("text/event-stream"), "cache-control": "no-cache"}
        )
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i, piece in enumerate(pieces):
            if i and self.stream_delay > 0:
                await self._sleep(self.stream_delay)
            last = i == n - 1
            finish = "length" if last else None
            if chat:
                delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
            chunk: dict[str, Any] = {**base, "object": obj, "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if include_usage:
            final = {**base, "object": obj, "choices": [], "usage": usage}
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    async def _models(self, request: web.Request) -> web.Response:
        doc = {
            "object": "list",
            "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "fake", "root": self.model}
            ],
        }
        return web.Response(text=json.dumps(doc), headers=self._headers("application/json"))

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200, headers={"x-served-by": self.name})

    async def _get_knobs(self, request: web.Request) -> web.Response:
        doc = {**self.knobs(), "name": self.name, "requests": len(self.requests), "in_flight": self.in_flight}
        return web.json_response(doc)

    async def _set_knobs(self, request: web.Request) -> web.Response:
        try:
            self.set_knobs(**cast(dict[str, Any], await request.json()))
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(self.knobs())

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        mode = self.metrics_mode
        if mode == "error500":
            return web.Response(status=500, text="internal error\n")
        if mode == "hang":
            await self._stopping.wait()
            return web.Response(status=503, text="stopping\n")
        if mode == "garbage":
            junk = '<html>not prometheus</html>\nvllm:num_requests_waiting{model_name="x" 1 2 3\n}}{{\n'
            return web.Response(status=200, text=junk, content_type="text/plain")
        return web.Response(
            body=self.metrics_text().encode(),
            headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    def metrics_text(self) -> str:
        """The Prometheus text page served in ``metrics_mode == "ok"``, shaped like vLLM's."""
        lbl = f'engine="0",model_name="{self.model}"'
        running = self.running + (self.in_flight if self.auto_running else 0)
        served = len(self.requests)
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lbl}}} {float(running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lbl}}} {float(self.waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lbl}}} {float(self.kv_usage)}",
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in queried tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{lbl}}} {float(served * 100)}",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{lbl}}} 0.0",
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",'
            f'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
            f'num_cpu_blocks="None",num_gpu_blocks="{self.num_gpu_blocks}",swap_space="4"}} 1.0',
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
        ]
        for bound in _TTFT_BUCKETS:
            lines.append(f'vllm:time_to_first_token_seconds_bucket{{{lbl},le="{bound}"}} {float(served)}')
        lines += [
            f'vllm:time_to_first_token_seconds_bucket{{{lbl},le="+Inf"}} {float(served)}',
            f"vllm:time_to_first_token_seconds_count{{{lbl}}} {float(served)}",
            f"vllm:time_to_first_token_seconds_sum{{{lbl}}} {served * 0.001}",
        ]
        return "\n".join(lines) + "\n"


async def start_backends(n: int, prefix: str = "pod", **kwargs: Any) -> list[FakeModelServer]:
    """Start ``n`` servers named ``{prefix}-0`` .. ``{prefix}-{n-1}``; ``kwargs`` go to each constructor."""
    servers: list[FakeModelServer] = []
    try:
        for i in range(n):
            server = FakeModelServer(f"{prefix}-{i}", **kwargs)
            await server.start()
            servers.append(server)
    except BaseException:
        await stop_backends(servers)
        raise
    return servers


async def stop_backends(servers: list[FakeModelServer]) -> None:
    await asyncio.gather(*(s.stop() for s in servers), return_exceptions=True)


async def _serve(args: argparse.Namespace) -> None:
    servers = await start_backends(
        args.count, args.prefix, stream_delay=args.stream_delay, num_chunks=args.num_chunks, model=args.model
    )
    try:
        tmp = Path(f"{args.port_file}.tmp{os.getpid()}")
        tmp.write_text("".join(f"{s.address}\n" for s in servers))
        tmp.replace(args.port_file)  # atomic: readers never see a partial list
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        await done.wait()
    finally:
        await stop_backends(servers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run fake OpenAI-compatible model servers.")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--port-file", required=True, help="written with one 127.0.0.1:PORT per line")
    parser.add_argument("--prefix", default="pod")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--stream-delay", type=float, default=0.0)
    parser.add_argument("--num-chunks", type=int, default=4)
    asyncio.run(_serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
