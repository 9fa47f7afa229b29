"""The demo's workloads: shared-prefix and multi-turn chat sessions as OpenAI messages. Pure.

A workload is a list of `Session`s, each with a start time (seconds from the start of the run), a
system prompt and one or more user turns. The client sends a session's turns one after another, each
resending the conversation so far (system prompt, earlier questions and the answers the server gave)
plus the next question, `think_s` after the previous answer. The same `WorkloadSpec` and seed give the
same sessions, so every policy the demo compares sees the same traffic.

- `shared-prefix`: `groups` long system prompts (e.g. one per application or few-shot template);
  every session is one question under one of them. A cache-aware router keeps each group on a pod
  that holds its prefix; a cache-blind one spreads every group over every pod, and once the pool's
  working set exceeds one pod's KV cache, the pods evict each other's prefixes.
- `multi-turn`: chat sessions of `turns` questions; each turn's prompt is the previous one plus the
  answer and a new question, so the pod that served turn N holds most of turn N+1.
- `mixed`: both, half the sessions each.

Text comes from `epp.testing.tokenizer.generated_text`, the distribution the demo's tokenizer was
trained on (about 2.4 characters per token).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from epp.testing.tokenizer import generated_text

WorkloadKind = Literal["shared-prefix", "multi-turn", "mixed"]
KINDS: tuple[WorkloadKind, ...] = ("shared-prefix", "multi-turn", "mixed")
CHARS_PER_TOKEN = 2.4  # of the demo tokenizer on generated text


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """`rate`: new sessions per second (Poisson) for `duration_s`; token sizes are approximate."""

    kind: WorkloadKind = "mixed"
    duration_s: float = 40.0
    rate: float = 6.0
    groups: int = 12
    system_tokens: int = 3000
    question_tokens: int = 60
    turns: int = 4
    chat_system_tokens: int = 400
    think_s: float = 0.5
    max_tokens: int = 32

    def check(self) -> None:
        """ValueError naming the first field out of range."""
        if self.kind not in KINDS:
            raise ValueError(f"workload must be one of {', '.join(KINDS)}, got {self.kind!r}")
        positive = {
            "duration_s": self.duration_s,
            "rate": self.rate,
            "groups": self.groups,
            "system_tokens": self.system_tokens,
            "question_tokens": self.question_tokens,
            "turns": self.turns,
            "chat_system_tokens": self.chat_system_tokens,
            "max_tokens": self.max_tokens,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.think_s < 0:
            raise ValueError(f"think_s must be >= 0, got {self.think_s}")
        if self.duration_s * self.rate > 100_000:
            raise ValueError(
                f"duration_s x rate = {self.duration_s * self.rate:.0f} sessions; at most 100000"
            )


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    kind: Literal["shared-prefix", "multi-turn"]
    start_s: float
    system: str
    questions: tuple[str, ...]
    max_tokens: int
    think_s: float


def _text(tokens: int, seed: int) -> str:
    return generated_text(max(1, round(tokens * CHARS_PER_TOKEN)), seed=seed)


def build_sessions(spec: WorkloadSpec, seed: int) -> list[Session]:
    """The sessions of one run, ordered by start time."""
    spec.check()
    rng = random.Random(seed)
    systems = [_text(spec.system_tokens, seed * 7919 + 1 + g) for g in range(spec.groups)]
    sessions: list[Session] = []
    t = rng.expovariate(spec.rate)
    i = 0
    while t < spec.duration_s:
        multi = spec.kind == "multi-turn" or (spec.kind == "mixed" and i % 2 == 1)
        q_seed = seed * 1_000_003 + 100_000 + i * 64
        if multi:
            system = _text(spec.chat_system_tokens, q_seed)
            questions = tuple(_text(spec.question_tokens, q_seed + 1 + k) for k in range(spec.turns))
            sessions.append(
                Session(f"chat-{i}", "multi-turn", t, system, questions, spec.max_tokens, spec.think_s)
            )
        else:
            g = rng.randrange(spec.groups)
            question = _text(spec.question_tokens, q_seed)
            sessions.append(
                Session(f"group-{g}-{i}", "shared-prefix", t, systems[g], (question,), spec.max_tokens, 0.0)
            )
        i += 1
        t += rng.expovariate(spec.rate)
    return sessions


def messages(session: Session, answers: list[str]) -> list[dict[str, str]]:
    """The chat messages of the session's next turn, given the answers to its earlier turns."""
    turn = len(answers)
    if turn >= len(session.questions):
        raise ValueError(
            f"session {session.session_id} has {len(session.questions)} turns, asked for {turn + 1}"
        )
    out = [{"role": "system", "content": session.system}]
    for question, answer in zip(session.questions[:turn], answers, strict=True):
        out.append({"role": "user", "content": question})
        out.append({"role": "assistant", "content": answer})
    out.append({"role": "user", "content": session.questions[turn]})
    return out
