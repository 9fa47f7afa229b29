"""A pod's metrics endpoint that accepts connections and never answers, or answers garbage: picks go on
while its scrape is pending (each endpoint is scraped by a task of its own, bounded by the scrape
timeout), the pod leaves rotation after `--unhealthy-after` failed scrapes, and returns when the
endpoint heals."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import pytest

from epp.server.app import ServerSettings
from epp.testing.wait import eventually
from tests.integration.stack import Stack, stack

UNHEALTHY_AFTER = 2
TIMEOUT = 3.0


def scrapes(st: Stack, endpoint: str, outcome: str) -> float:
    value = st.epp.metrics.registry.get_sample_value(
        "epp_metrics_scrapes_total", {"endpoint": endpoint, "outcome": outcome}
    )
    return value or 0.0


@pytest.mark.parametrize("mode", ["hang", "garbage"])
async def test_a_sick_metrics_endpoint_never_holds_up_picks(mode: str) -> None:
    settings = replace(ServerSettings(), metrics_timeout=TIMEOUT, unhealthy_after_failures=UNHEALTHY_AFTER)
    async with stack(2, settings=settings) as st:
        sick = st.backend("pod-0")
        rec = st.epp.datastore.get(sick.address)
        assert rec is not None
        sick.metrics_mode = mode  # type: ignore[assignment]
        if mode == "hang":
            # A scrape has reached the endpoint, which holds it; requests are served meanwhile.
            seen = sick.metrics_scrapes
            await eventually(lambda: sick.metrics_scrapes > seen, "a scrape reached the hung endpoint")
            pending = sick.metrics_scrapes, rec.scrape_failures, scrapes(st, sick.address, "error")
            results = await asyncio.gather(*(st.chat() for _ in range(10)))
            assert [status for status, _, _ in results] == [200] * 10
            # ...all while that one scrape was still pending: not finished, not failed, none after it.
            assert (sick.metrics_scrapes, rec.scrape_failures, scrapes(st, sick.address, "error")) == pending

        too_early: list[int] = []

        def unhealthy() -> bool:
            if not rec.healthy and rec.scrape_failures < UNHEALTHY_AFTER:
                too_early.append(rec.scrape_failures)
            return not rec.healthy

        await eventually(unhealthy, "sick endpoint out of rotation", timeout=UNHEALTHY_AFTER * TIMEOUT + 10)
        assert too_early == []
        kind = "timeout" if mode == "hang" else "parse"
        assert (
            st.epp.metrics.registry.get_sample_value(
                "epp_metrics_scrape_errors_total", {"endpoint": sick.address, "kind": kind}
            )
            or 0
        ) >= UNHEALTHY_AFTER
        assert await st.metric("epp_endpoint_healthy", endpoint=sick.address) == 0
        served = Counter([(await st.chat())[1] for _ in range(5)])
        assert served == {"pod-1": 5}

        sick.metrics_mode = "ok"
        st.backend("pod-1").waiting = 10  # so that the healed pod is the better pick
        await eventually(
            lambda: (
                rec.healthy
                and (m := st.epp.datastore.get(st.backend("pod-1").address)) is not None
                and m.metrics is not None
                and m.metrics.waiting == 10
            ),
            "healed endpoint back in rotation",
            timeout=TIMEOUT + 10,
        )
        assert await st.metric("epp_endpoint_healthy", endpoint=sick.address) == 1
        assert (await st.chat())[1] == "pod-0"
