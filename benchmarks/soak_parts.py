"""The soak benchmark's pure parts: histogram deltas, failure classification, RSS growth, traffic.

No I/O here (`benchmarks/soak.py` and `benchmarks/soak_load.py` do it), so the parts that decide
the verdicts can be tested on their own (`tests/unit/test_soak_parts.py`).

Failure classes (see `classify`; BENCHMARKS.md "Soak" explains them too):

- `epp`: the EPP's fault. A 4xx/5xx the EPP answered itself (body `inference error: ...`), a 5xx
  that Envoy produced for a reason other than the upstream (an ext_proc stream failure: no
  upstream text in the body), or an upstream connection failure on a pod that had been down
  for longer than `know_after_s` when the request was sent (the EPP had had time to see it go).
- `engine`: the engine's side, which the EPP could not have avoided: the request was in flight
  on a pod when it was killed (reset, truncated stream), or it was sent to a pod within
  `know_after_s` of its going down (the EPP's scrapes had not yet had the chance to fail), or
  the engine itself answered 5xx.
- `unexplained`: a failure none of the above explains (an upstream failure with no outage to
  blame, a client timeout, a 4xx from the engine). Counted against the EPP target too: the soak
  only passes when `epp` and `unexplained` are both 0.
"""

from __future__ import annotations

import math
import pathlib
import random
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's packages first

from epp.demo.workload import CHARS_PER_TOKEN, Session, messages
from epp.testing.tokenizer import generated_text

EPP_BODY_MARK = "inference error:"  # epp/server/ext_proc.py error_response
UPSTREAM_MARKS = (
    "upstream connect error",
    "disconnect/reset before headers",
    "upstream_reset",
    "connection termination",
    "connection refused",
    "no healthy upstream",
)
CLASSES = ("epp", "engine", "unexplained")


# --- Prometheus histograms -------------------------------------------------------------------


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """Cumulative `le` -> count of the (unlabelled) histogram `name` in Prometheus text; {} if absent."""
    prefix = f"{name}_bucket{{"
    out: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        labels, _, value = line.rpartition(" ")
        start = labels.find('le="')
        if start < 0:
            continue
        text_le = labels[start + 4 : labels.index('"', start + 4)]
        le = math.inf if text_le == "+Inf" else float(text_le)
        out[le] = out.get(le, 0.0) + float(value)
    return out


def bucket_delta(now: Mapping[float, float], before: Mapping[float, float]) -> dict[float, float]:
    """Observations between two scrapes of a cumulative histogram (a bucket that went down counts 0)."""
    return {le: max(0.0, count - before.get(le, 0.0)) for le, count in now.items()}


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' `histogram_quantile` on cumulative buckets: linear within the bucket holding rank
    q x total; the highest finite bound when the rank falls in +Inf; None with no observations."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank and count > below:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        if not math.isinf(le):
            lower = le
        below = count
    return lower


def sample_quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile of raw samples; None when there are none."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


# --- failures ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outage:
    """A pod down from `down_at` until `up_at` (ready again; None while it is still down)."""

    endpoint: str
    down_at: float
    up_at: float | None


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed request: `status` 0 when no HTTP response came (a transport error), `endpoint`
    from the `x-epp-decision` header when the response carried it."""

    start: float
    end: float
    status: int
    detail: str
    endpoint: str | None = None


def _overlapping(f: Failure, outages: Iterable[Outage]) -> list[Outage]:
    hits = []
    for o in outages:
        if f.endpoint is not None and o.endpoint != f.endpoint:
            continue
        if o.down_at <= f.end and (o.up_at is None or f.start < o.up_at):
            hits.append(o)
    return hits


def classify(f: Failure, outages: Sequence[Outage], know_after_s: float) -> str:
    """`epp`, `engine` or `unexplained` (module docstring)."""
    detail = f.detail.lower()
    if EPP_BODY_MARK in detail:
        return "epp"
    upstream = f.status == 0 or any(mark in detail for mark in UPSTREAM_MARKS)
    if not upstream:
        if f.status >= 500 and detail.lstrip().startswith('{"error"'):
            return "engine"  # the engine's own OpenAI-style error
        if f.status >= 500:
            return "epp"  # Envoy's own 5xx without an upstream cause: the ext_proc stream failed
        return "unexplained"
    hits = _overlapping(f, outages)
    if not hits:
        return "unexplained"
    if any(o.down_at >= f.start or f.start < o.down_at + know_after_s for o in hits):
        return "engine"  # in flight when it went down, or sent before the EPP could know
    return "epp"


def count_classes(
    failures: Iterable[Failure], outages: Sequence[Outage], know_after_s: float
) -> dict[str, int]:
    counts = dict.fromkeys(CLASSES, 0)
    for f in failures:
        counts[classify(f, outages, know_after_s)] += 1
    return counts


def rss_growth(samples: Sequence[tuple[float, int]], warmup_end: float) -> tuple[int, int, float] | None:
    """(baseline, peak, growth) of RSS after warm-up: baseline is the first sample at or after
    `warmup_end`, peak the largest after it, growth = peak / baseline - 1. None without samples."""
    after = [rss for t, rss in samples if t >= warmup_end]
    if not after or after[0] <= 0:
        return None
    base, peak = after[0], max(after)
    return base, peak, peak / base - 1.0


# --- traffic -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrafficSpec:
    """Mixed shared-prefix traffic. `shared`: one of `groups` long system prompts + a question;
    `chat`: the next turn of one of `conversations` running chats (system + earlier turns with
    fixed answers), restarted after `turns`; `unique`: a prompt shared with nothing."""

    groups: int = 16
    system_tokens: int = 1000
    question_tokens: int = 40
    conversations: int = 64
    chat_system_tokens: int = 300
    turns: int = 4
    answer_tokens: int = 8
    shared_weight: float = 0.5
    chat_weight: float = 0.35
    unique_weight: float = 0.15
    max_tokens: int = 8

    def check(self) -> None:
        for name in ("groups", "system_tokens", "question_tokens", "conversations", "turns", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if min(self.shared_weight, self.chat_weight, self.unique_weight) < 0 or not (
            self.shared_weight + self.chat_weight + self.unique_weight > 0
        ):
            raise ValueError("traffic weights must be >= 0 and not all 0")


def _text(tokens: int, seed: int) -> str:
    return generated_text(max(1, round(tokens * CHARS_PER_TOKEN)), seed=seed)


class Traffic:
    """An endless, seeded stream of (kind, chat messages). Prompts shared between load processes
    (group system prompts) depend only on `spec`; the rest on `seed`."""

    QUESTIONS = 512

    def __init__(self, spec: TrafficSpec, seed: int) -> None:
        spec.check()
        self.spec = spec
        self.rng = random.Random(seed)
        self.seed = seed
        self.systems = [_text(spec.system_tokens, 7919 + g) for g in range(spec.groups)]
        self.questions = [_text(spec.question_tokens, seed * 100_003 + 11 + q) for q in range(self.QUESTIONS)]
        self.answer = _text(spec.answer_tokens, 3)
        self.unique_body = _text(spec.system_tokens, seed * 100_003 + 7)
        self.count = 0
        self.chats: list[tuple[Session, int]] = [self._new_chat() for _ in range(spec.conversations)]

    def _new_chat(self) -> tuple[Session, int]:
        self.count += 1
        system = f"chat {self.seed}-{self.count}. " + self.questions[self.rng.randrange(self.QUESTIONS)]
        questions = tuple(self.questions[self.rng.randrange(self.QUESTIONS)] for _ in range(self.spec.turns))
        return Session(
            f"chat-{self.count}", "multi-turn", 0.0, system, questions, self.spec.max_tokens, 0.0
        ), 0

    def next(self) -> tuple[str, list[dict[str, str]]]:
        s = self.spec
        self.count += 1
        pick = self.rng.random() * (s.shared_weight + s.chat_weight + s.unique_weight)
        question = f"q{self.seed}-{self.count}: " + self.questions[self.rng.randrange(self.QUESTIONS)]
        if pick < s.shared_weight:
            system = self.systems[self.rng.randrange(s.groups)]
            return "shared", [{"role": "system", "content": system}, {"role": "user", "content": question}]
        if pick < s.shared_weight + s.chat_weight:
            i = self.rng.randrange(len(self.chats))
            session, turn = self.chats[i]
            out = messages(session, [self.answer] * turn)
            self.chats[i] = self._new_chat() if turn + 1 >= s.turns else (session, turn + 1)
            return "chat", out
        return "unique", [
            {"role": "system", "content": f"u{self.seed}-{self.count} " + self.unique_body},
            {"role": "user", "content": question},
        ]
