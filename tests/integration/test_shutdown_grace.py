"""`--shutdown-grace`: on stop, responses still streaming through Envoy may finish within the grace."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.integration.stack import stack

pytestmark = pytest.mark.envoy

CHUNKS = 8
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def _stream_while_stopping(grace: float) -> tuple[int, list[bytes], str | None]:
    """Start a streamed response (8 chunks, 0.25 s apart), stop the EPP after its first chunk."""
    async with stack(1, backend_kwargs={"stream_delay": 0.25, "num_chunks": CHUNKS}) as st:
        lines: list[bytes] = []
        error = None
        async with st.session.post(f"{st.url}/v1/chat/completions", json=BODY) as r:
            status = r.status
            first = await r.content.readline()
            lines.append(first)
            stopping = asyncio.create_task(st.epp.stop(grace=grace))
            try:
                async for line in r.content:
                    lines.append(line)
            except aiohttp.ClientError as err:
                error = type(err).__name__
            await stopping
        return status, [x for x in lines if x.startswith(b"data:")], error


async def test_a_stream_open_at_stop_finishes_within_the_grace() -> None:
    status, data, error = await _stream_while_stopping(grace=10.0)
    assert status == 200 and error is None
    assert data[-1].strip() == b"data: [DONE]" and len(data) == CHUNKS + 1


async def test_without_grace_the_open_stream_is_cut() -> None:
    status, data, error = await _stream_while_stopping(grace=0.0)
    assert status == 200
    assert error is not None or data[-1].strip() != b"data: [DONE]"
