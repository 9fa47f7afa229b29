"""How long one engine step takes: the simulated engine's latency model. Pure.

One step (one forward pass of vLLM's continuous batch) runs the prefill chunks scheduled in it
and one decode token for every running sequence past its prefill. Its time is a **sum**:

    step = prefill_fixed * starts                 (requests whose prefill starts in this step)
         + prefill_per_token * u                  (u = prefill tokens in the step, all chunks)
         + prefill_per_pair * pairs               (sum over chunks of u_i * (c_i + u_i / 2))
         + decode_fixed          if starts == 0   (the step's fixed cost when no prefill starts)
         + decode_per_sequence * b + decode_per_context_token * k
                                                  (b decoding sequences holding k KV tokens)

A CPU-tier load (`reload_seconds`) is not part of any step: as with vLLM's offloading connector, the
loading request waits for it beside the steps, and the others' steps do not slow down (`engine.py`).

where `c_i` is the context already computed (or cached) before chunk i. Why a sum and not
`max(compute-bound prefill, memory-bound decode)`: the chunks and the decode tokens run in one
forward pass whose kernels execute one after the other (attention over each sequence's KV, the
MLP over all tokens), so the decode work adds to the prefill work rather than hiding under it;
a roofline `max` would be optimistic exactly when a pod mixes long prefills with a large decode
batch, which is the case routing cares about. The sum is also what the EPP's cost model
(`epp/costmodel/estimate.py`) assumes: a request's TTFT is its queue's prefill work, its own
prefill (`fixed + per_token * u + per_pair * u * (c + u / 2)`, the same `pairs` however the
prompt is chunked) and, for every step it spans, the decode batch's per-sequence and
per-context-token cost. The fixed costs follow the cost model too: `prefill_fixed` per request
(charged in the step where its prefill starts) and `decode_fixed` for a step without one. So
with the reference profile the router's cost model is right about the simulated engine by
construction (up to its queue approximations), and any error it shows in simulation comes
from staleness, routing or queueing, not from a different engine model.

Profiles. `PROFILES["llama-3.1-8b-h100"]` is built from the EPP's reference `ModelProfile`
(`epp.costmodel.profile.REFERENCE_PROFILES`, documented there: assumptions for an 8B GQA model on
one H100), so both sides use the same coefficients. Other figures:

- `LatencyProfile(...)` with your own coefficients (seconds), or `dataclasses.replace` on a
  named profile (e.g. a slower CPU link);
- `LatencyProfile.from_model(profile)` with any `ModelProfile`, for instance the one an EPP
  config's `costModel.profiles` entry builds (`epp.costmodel.profile.build_profile`), so the
  simulated engines run exactly what the router was told.
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.costmodel.profile import REFERENCE_PROFILES, ModelProfile


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    name: str
    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_per_pair_s: float
    decode_fixed_s: float
    decode_per_sequence_s: float
    decode_per_context_token_s: float
    kv_bytes_per_token: float
    cpu_bandwidth_bytes_per_s: float | None = None  # None: no CPU reload cost known (a tier needs one)
    cpu_latency_s: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "prefill_fixed_s",
            "prefill_per_token_s",
            "prefill_per_pair_s",
            "decode_fixed_s",
            "decode_per_sequence_s",
            "decode_per_context_token_s",
            "kv_bytes_per_token",
            "cpu_latency_s",
        ):
            value = getattr(self, name)
            if not value >= 0.0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        bw = self.cpu_bandwidth_bytes_per_s
        if bw is not None and not 0.0 < bw < float("inf"):
            raise ValueError(f"cpu_bandwidth_bytes_per_s must be > 0, got {bw}")

    @classmethod
    def from_model(cls, profile: ModelProfile, name: str | None = None) -> LatencyProfile:
        """The step model of a cost-model profile: same coefficients, CPU reload from its "cpu" tier."""
        cpu = profile.tiers.get("cpu")
        return cls(
            name=name or profile.name,
            prefill_fixed_s=profile.prefill_fixed_s,
            prefill_per_token_s=profile.prefill_per_token_s,
            prefill_per_pair_s=profile.prefill_per_pair_s,
            decode_fixed_s=profile.decode_fixed_s,
            decode_per_sequence_s=profile.decode_per_sequence_s,
            decode_per_context_token_s=profile.decode_per_context_token_s,
            kv_bytes_per_token=profile.kv_bytes_per_token,
            cpu_bandwidth_bytes_per_s=None if cpu is None else cpu.bandwidth_bytes_per_s,
            cpu_latency_s=0.0 if cpu is None else cpu.latency_s,
        )

    def step_seconds(
        self,
        prefill_starts: int,
        prefill_tokens: int,
        prefill_pairs: float,
        decode_seqs: int,
        decode_context_tokens: int,
    ) -> float:
        """One step (see the module docstring); `prefill_pairs` is the sum of `chunk_pairs`."""
        fixed = self.prefill_fixed_s * prefill_starts if prefill_starts else self.decode_fixed_s
        return (
            fixed
            + self.prefill_per_token_s * prefill_tokens
            + self.prefill_per_pair_s * prefill_pairs
            + self.decode_per_sequence_s * decode_seqs
            + self.decode_per_context_token_s * decode_context_tokens
        )

    def decode_step_ends(self, start: float, steps: int, seqs: int, context: int) -> list[float]:
        """End times of `steps` decode-only steps of `seqs` sequences from `start`, the context growing by
        `seqs` tokens per step: the same floats as adding `step_seconds(0, 0, 0.0, seqs, context)` step
        by step (its prefill terms add exact zeros)."""
        base = self.decode_fixed_s + self.decode_per_sequence_s * seqs
        per_ctx = self.decode_per_context_token_s
        ends: list[float] = []
        t = start
        for k in range(steps):
            t = t + (base + per_ctx * (context + k * seqs))
            ends.append(t)
        return ends

    def reload_seconds(self, tokens: int) -> float:
        """Bringing `tokens` tokens of KV back from the CPU tier: latency + bytes / bandwidth."""
        if tokens <= 0:
            return 0.0
        if self.cpu_bandwidth_bytes_per_s is None:
            raise ValueError(f"latency profile {self.name!r} has no CPU reload bandwidth")
        return self.cpu_latency_s + tokens * self.kv_bytes_per_token / self.cpu_bandwidth_bytes_per_s


def chunk_pairs(chunk: int, context: int) -> float:
    """Attention pairs of a prefill chunk of `chunk` tokens after `context` computed ones."""
    return chunk * (context + chunk / 2.0)


PROFILES: dict[str, LatencyProfile] = {
    name: LatencyProfile.from_model(p) for name, p in REFERENCE_PROFILES.items()
}
DEFAULT_PROFILE = "llama-3.1-8b-h100"


def latency_profile(name: str) -> LatencyProfile:
    """A named profile; ValueError listing the known names otherwise."""
    p = PROFILES.get(name)
    if p is None:
        raise ValueError(f"unknown latency profile {name!r} (known: {', '.join(sorted(PROFILES))})")
    return p
