"""The demo's figures per policy and the side-by-side table it prints. Pure.

TTFT is what the client saw (first content chunk through Envoy and the EPP); the token hit rate is
the engines' own account (`usage.prompt_tokens_details.cached_tokens` over `prompt_tokens`, summed);
requests per pod come from the EPP's `epp_picks_total`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TurnResult:
    session_id: str
    kind: str
    turn: int
    status: int  # HTTP status; 0 when the request failed before a response (or was cancelled)
    ttft_s: float | None
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass(frozen=True, slots=True)
class PolicyFigures:
    policy: str
    requests: int
    errors: int
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    e2e_p50_s: float
    token_hit_rate: float
    per_pod: Mapping[str, int]

    def as_json(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "ttft_mean_s": self.ttft_mean_s,
            "e2e_p50_s": self.e2e_p50_s,
            "token_hit_rate": self.token_hit_rate,
            "requests_per_pod": dict(self.per_pod),
        }


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def figures(policy: str, results: Sequence[TurnResult], per_pod: Mapping[str, int]) -> PolicyFigures:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return PolicyFigures(
        policy,
        len(results),
        len(results) - len(ok),
        quantile(ttfts, 0.5),
        quantile(ttfts, 0.99),
        sum(ttfts) / len(ttfts) if ttfts else math.nan,
        quantile([r.e2e_s for r in ok], 0.5),
        cached / prompt if prompt else 0.0,
        dict(sorted(per_pod.items())),
    )


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f} ms"


def table(rows: Sequence[PolicyFigures]) -> str:
    """The side-by-side report, one column per policy."""
    head = ["", *(r.policy for r in rows)]
    lines = [
        ["requests", *(str(r.requests) for r in rows)],
        ["errors", *(str(r.errors) for r in rows)],
        ["TTFT p50", *(_ms(r.ttft_p50_s) for r in rows)],
        ["TTFT p99", *(_ms(r.ttft_p99_s) for r in rows)],
        ["TTFT mean", *(_ms(r.ttft_mean_s) for r in rows)],
        ["end-to-end p50", *(_ms(r.e2e_p50_s) for r in rows)],
        ["token hit rate", *(f"{r.token_hit_rate:.1%}" for r in rows)],
        ["requests per pod", *(" ".join(str(n) for n in r.per_pod.values()) or "-" for r in rows)],
    ]
    widths = [max(len(row[i]) for row in [head, *lines]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*row) for row in [head, *lines])


def comparison(ours: PolicyFigures, base: PolicyFigures) -> str:
    """One line: how `ours` did against `base` on TTFT and hit rate."""
    parts = []
    for label, a, b in (
        ("TTFT p50", ours.ttft_p50_s, base.ttft_p50_s),
        ("TTFT p99", ours.ttft_p99_s, base.ttft_p99_s),
    ):
        if a > 0 and b > 0 and not (math.isnan(a) or math.isnan(b)):
            parts.append(f"{label} {b / a:.2f}x {'lower' if a <= b else 'HIGHER'}")
    parts.append(f"token hit rate {100 * (ours.token_hit_rate - base.token_hit_rate):+.1f} points")
    return f"{ours.policy} vs {base.policy}: " + ", ".join(parts)
