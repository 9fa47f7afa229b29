"""A model server's `usage` with a count too large for a float (400 digits), through real Envoy: the
client gets the backend's response intact, JSON and SSE; the usage is ignored and counted; the EPP
releases the request and serves the next one."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from epp.testing.backend import FakeModelServer

from .stack import CHAT, stack

HUGE = "9" * 400
JSON_BODY = (
    '{"id": "cmpl-1", "object": "chat.completion", "choices": [{"index": 0, "message": '
    '{"role": "assistant", "content": "hi"}, "finish_reason": "stop"}], '
    f'"usage": {{"prompt_tokens": {HUGE}, "completion_tokens": 1, "total_tokens": {HUGE}}}}}'
)
SSE_BODY = (
    'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": null}\n\n'
    f'data: {{"id": "c", "choices": [], "usage": {{"prompt_tokens": 3, "completion_tokens": {HUGE}}}}}\n\n'
    "data: [DONE]\n\n"
)


class HugeUsageServer(FakeModelServer):
    """Answers every inference request with a usage count of 400 digits (JSON, or SSE when streamed)."""

    async def _answer(self, request: web.Request, payload: Any | None) -> web.StreamResponse:
        if not (isinstance(payload, dict) and payload.get("stream")):
            return web.Response(text=JSON_BODY, headers=self._headers("application/json"))
        resp = web.StreamResponse(status=200, headers=self._headers("text/event-stream"))
        await resp.prepare(request)
        for line in SSE_BODY.splitlines(keepends=True):  # the huge usage in a chunk of its own
            await resp.write(line.encode())
        await resp.write_eof()
        return resp


@pytest.mark.parametrize("stream", [False, True])
async def test_a_huge_usage_count_reaches_the_client_intact(stream: bool) -> None:
    async with HugeUsageServer("huge") as backend, stack(0, endpoints=[backend.address]) as st:
        for i in range(2):
            status, by, text = await st.chat({**CHAT, "stream": stream})
            assert (status, by) == (200, "huge")
            assert text == (SSE_BODY if stream else JSON_BODY)
            await st.wait_idle()
            assert await st.metric("epp_usage_invalid_total", endpoint=backend.address) == i + 1
        assert await st.metric("epp_requests_released_total", cause="complete") == 2
        assert await st.metric("epp_requests_released_total", cause="disconnect") == 0
        assert await st.metric("epp_usage_tokens_total", endpoint=backend.address) == 0
        assert await st.metric("epp_response_accounting_errors_total") == 0
