"""The last N scheduling decisions, explained: `/debug/decisions` and the `x-epp-decision` header.

Recording a decision costs one deque append (the `Decision` already holds every candidate's
estimate; the cost model's coefficients its estimates used are kept with it, so an old decision
is shown with the calibration of its time); the JSON is built only when someone asks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from epp.types import Decision, InferenceRequest

DECISION_HEADER = "x-epp-decision"


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    at: float  # Clock seconds
    request_id: str
    model: str
    priority: int
    decision: Decision
    calibration: Mapping[str, float] = field(default_factory=dict)  # coefficients its estimates used


class DecisionLog:
    def __init__(self, keep: int = 100) -> None:
        self.keep = keep
        self._records: deque[DecisionRecord] = deque(maxlen=keep) if keep > 0 else deque(maxlen=0)

    def add(
        self,
        at: float,
        request: InferenceRequest,
        decision: Decision,
        calibration: Mapping[str, float] | None = None,
    ) -> None:
        """`calibration`: the cost model's coefficients the decision's estimates were computed with."""
        if self.keep:
            self._records.append(
                DecisionRecord(
                    at, request.request_id, request.model, request.priority, decision, dict(calibration or {})
                )
            )

    def __len__(self) -> int:
        return len(self._records)

    def render(self, limit: int, now: float) -> dict[str, Any]:
        """The newest `limit` decisions (newest first), each with every candidate's terms and the
        calibration it was made with."""
        records = list(self._records)[-limit:] if limit > 0 else []
        out = []
        for r in reversed(records):
            d = r.decision
            candidates = []
            ranking = d.ranking.by_endpoint() if d.ranking is not None else {}
            for ep, score in d.scores.items():
                entry: dict[str, Any] = {"endpoint": ep, "score": round(score, 6)}
                est = d.estimates.get(ep)
                if est is not None:
                    entry.update({k: round(v, 6) for k, v in est.terms().items()})
                ranked = ranking.get(ep)
                if ranked is not None:  # why a candidate with a larger ttft_s can rank first
                    entry["copy_charge_s"] = round(ranked[0], 6)
                    entry["near_tie"] = ranked[1]
                candidates.append(entry)
            candidates.sort(key=lambda c: (c.get("ttft_s", 0.0), -c["score"]))
            out.append(
                {
                    "age_s": round(now - r.at, 3),
                    "request_id": r.request_id,
                    "model": r.model,
                    "priority": r.priority,
                    "profile": d.profile,
                    "mode": d.mode,
                    "winner": d.primary,
                    "endpoints": list(d.endpoints),
                    "candidates": candidates,
                    "calibration": dict(r.calibration),
                }
            )
        return {"kept": len(self._records), "capacity": self.keep, "decisions": out}


def header_value(decision: Decision) -> str:
    """The winner's terms for the `x-epp-decision` response header."""
    parts = [f"endpoint={decision.primary}", f"profile={decision.profile}"]
    if decision.mode:
        parts.append(f"mode={decision.mode}")
    est = decision.estimates.get(decision.primary)
    if est is not None:
        parts += [
            f"ttft={est.ttft_s:.4f}",
            f"queue={est.queue_s:.4f}",
            f"prefill={est.prefill_s:.4f}",
            f"reload={est.reload_s:.4f}",
            f"decode={est.decode_s:.4f}",
            f"cached_tokens={est.cached_tokens}",
            f"prompt_tokens={est.prompt_tokens}",
        ]
    rank = decision.ranking
    if rank is not None and rank.of(decision.primary) is not None:
        ties = int(sum(bool(t) for t in rank.near_tie))
        if ties > 1:
            parts.append(f"near_ties={ties}")  # ranked by cached tokens, then KV usage
        charged = rank.copy_charge_s
        if charged is not None and max(charged) > 0:
            parts.append(f"copy_charged={sum(1 for c in charged if c > 0)}")  # others charged for a copy
    return "; ".join(parts)
