"""The compiled estimate (`estimate_all`) against the vectorised numpy code it replaced, value for value."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.costmodel.estimate import estimate_all, tier_order
from epp.costmodel.profile import DEFAULT_REFERENCE, REFERENCE_PROFILES
from epp.testing.fakes import endpoint
from epp.types import PrefillWork
from tests.support.estimate_reference import reference_estimate_all

P = REFERENCE_PROFILES[DEFAULT_REFERENCE]
TIERS = ["gpu", *tier_order(P)]
COLUMNS = (
    "queue",
    "prefill",
    "reload",
    "decode",
    "cached",
    "reloaded",
    "queue_nominal",
    "prefill_nominal",
    "ttft",
)

endpoints = st.builds(
    lambda i, scraped, w, r, usage, blocks, bs, req, tok, dec, dtok: endpoint(
        f"10.0.0.{i}:80",
        observed_at=1.0 if scraped else None,
        waiting=w,
        running=r,
        kv_usage=usage,
        num_gpu_blocks=blocks,
        block_size=bs,
        backlog=PrefillWork(req, tok, tok * 1000.0),
        decoding=dec,
        decoding_tokens=dtok,
    ),
    st.integers(0, 250),
    st.booleans(),
    st.integers(0, 40),
    st.integers(0, 300),
    st.floats(0.0, 1.0),
    st.one_of(st.none(), st.integers(1, 100_000)),
    st.one_of(st.none(), st.sampled_from([1, 16, 32, 64])),
    st.integers(0, 8),
    st.integers(0, 200_000),
    st.integers(0, 64),
    st.integers(0, 500_000),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(endpoints, min_size=1, max_size=70),
    st.integers(0, 70_000),
    st.lists(st.sampled_from(TIERS), unique=True, max_size=len(TIERS)),
    st.floats(0.0, 4.0),
    st.floats(0.0, 4.0),
    st.sampled_from([1, 16, 64]),
    st.randoms(use_true_random=False),
    st.booleans(),
)
def test_the_compiled_estimate_gives_the_numpy_values(
    eps: list,
    prompt: int,
    tiers: list[str],
    kp: float,
    kq: float,
    block: int,
    rnd: object,
    asynchronous: bool,
) -> None:
    p = dataclasses.replace(P, async_scheduling=asynchronous)
    rng = np.random.default_rng(rnd.randrange(2**32))  # type: ignore[attr-defined]
    held = {
        t: rng.integers(0, 4, size=len(eps)) * rng.integers(0, prompt + 2, size=len(eps)) * 1.0 for t in tiers
    }
    got = estimate_all(p, eps, prompt, held, kp, kq, None, block)
    want = reference_estimate_all(p, eps, prompt, held, kp, kq, None, block)
    for name in COLUMNS:
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert got.ids == want.ids and got.prompt_tokens == want.prompt_tokens
