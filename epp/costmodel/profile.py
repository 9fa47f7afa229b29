"""Model profiles: what serving one model costs on its hardware. Pure.

KV bytes per token are given, or computed from the architecture: `2 x layers x kv_heads x
head_dim x dtype_bytes` (keys and values, every layer). Prefill of `u` new tokens after `c`
cached ones costs

    fixed + per_token * u + per_pair * u * (c + u / 2)

(a linear term for the projections and MLP, an attention term for each new token times the
context it attends to). One decode step with `b` sequences holding `k` context tokens costs
`fixed + per_sequence * b + per_context_token * k`. Reloading `t` tokens from a slower tier
costs `latency + t * kv_bytes_per_token / bandwidth`; the GPU tier costs nothing.

The reference profile is a set of **assumptions**, not measurements: an 8B GQA model
(Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128, bf16) on one H100, with prefill at
~33k tokens/s (~50% of bf16 peak), decode reading 16 GB of weights per step at ~70% of
3.35 TB/s, CPU offload over PCIe 5 at 25 GB/s with 2 ms of setup per reload, and storage at
5 GB/s with 10 ms. Online calibration corrects the prefill and queue coefficients; give
your own figures for anything else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from epp.kvindex.events import normalize_tier
from epp.types import PrefillWork


@dataclass(frozen=True, slots=True)
class TierCost:
    """Reloading cached KV from a tier: fixed latency per reload plus bytes / bandwidth."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    kv_bytes_per_token: float
    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_per_pair_s: float
    decode_fixed_s: float
    decode_per_sequence_s: float
    decode_per_context_token_s: float
    max_batched_tokens: int = 8192
    # Slower tiers blocks can be reloaded from ("gpu" is free and never listed).
    tiers: Mapping[str, TierCost] = field(default_factory=dict)
    unknown_request_tokens: int = 1024  # prompt tokens assumed for queued requests the EPP did not route
    kv_wait_steps: int = 64  # decode steps a request waits when the pod's free KV cannot hold it
    # The engines schedule a step while the one before runs (vLLM's default): an arrival also waits for
    # the step scheduled ahead of it.
    async_scheduling: bool = True

    def work(self, uncached: int, cached: int) -> PrefillWork:
        """One request's prefill work: `uncached` new tokens after `cached` ones."""
        if uncached <= 0:
            return PrefillWork(1, 0, 0.0)
        return PrefillWork(1, uncached, uncached * (cached + uncached / 2.0))

    def work_s(self, work: PrefillWork) -> float:
        """Seconds of prefill for a sum of requests' work."""
        return (
            self.prefill_fixed_s * work.requests
            + self.prefill_per_token_s * work.tokens
            + self.prefill_per_pair_s * work.pairs
        )

    def prefill_s(self, uncached: int, cached: int = 0) -> float:
        return self.work_s(self.work(uncached, cached))

    def decode_step_s(self, sequences: int, context_tokens: int) -> float:
        return (
            self.decode_fixed_s
            + self.decode_per_sequence_s * sequences
            + self.decode_per_context_token_s * context_tokens
        )

    def reload_s(self, tier: str, tokens: int) -> float | None:
        """Seconds to bring `tokens` tokens of KV back from `tier`; None for a tier without a cost."""
        if tier == "gpu" or tokens <= 0:
            return 0.0
        cost = self.tiers.get(tier)
        if cost is None:
            return None
        return cost.latency_s + tokens * self.kv_bytes_per_token / cost.bandwidth_bytes_per_s


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """`2 x L x Hkv x D x S`: keys and values of every layer for one token."""
    return 2.0 * layers * kv_heads * head_dim * dtype_bytes


REFERENCE_PROFILES: dict[str, ModelProfile] = {
    "llama-3.1-8b-h100": ModelProfile(
        name="llama-3.1-8b-h100",
        kv_bytes_per_token=kv_bytes_per_token(32, 8, 128, 2),  # 128 KiB
        prefill_fixed_s=0.004,
        prefill_per_token_s=3.0e-5,
        prefill_per_pair_s=1.0e-9,
        decode_fixed_s=0.007,
        decode_per_sequence_s=5.0e-5,
        decode_per_context_token_s=5.6e-8,
        max_batched_tokens=8192,
        tiers={"cpu": TierCost(25e9, 0.002), "storage": TierCost(5e9, 0.010)},
    ),
}
DEFAULT_REFERENCE = "llama-3.1-8b-h100"


def validation_field(err: msgspec.ValidationError) -> tuple[str, str]:
    """(field path, message) of a msgspec error: the `$.a.b` path, or the unknown field's name."""
    text = str(err)
    message = text.split(" - at ")[0]
    if "`$." in text:
        return text.split("`$.", 1)[1].rstrip("`"), message
    unknown = re.search(r"unknown field `([^`]*)`", text)
    return (unknown.group(1) if unknown else ""), message


class ProfileError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class _Struct(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    pass


class ArchitectureSpec(_Struct):
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: float = 2.0


class PrefillSpec(_Struct):
    fixed_seconds: float | None = None
    per_token_seconds: float | None = None
    per_pair_seconds: float | None = None


class DecodeSpec(_Struct):
    fixed_seconds: float | None = None
    per_sequence_seconds: float | None = None
    per_context_token_seconds: float | None = None


class TierSpec(_Struct):
    bandwidth_bytes_per_second: float
    latency_seconds: float = 0.0


class ProfileSpec(_Struct):
    """One entry of `costModel.profiles` in the config; unset fields come from `reference`."""

    model: str = "*"
    reference: str = DEFAULT_REFERENCE
    kv_bytes_per_token: float | None = None
    architecture: ArchitectureSpec | None = None
    prefill: PrefillSpec | None = None
    decode: DecodeSpec | None = None
    max_batched_tokens: int | None = None
    tiers: dict[str, TierSpec] | None = None
    unknown_request_tokens: int | None = None
    kv_wait_steps: int | None = None
    async_scheduling: bool | None = None


def _positive(field: str, value: float, allow_zero: bool = True) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ProfileError(field, f"must be a finite number {'>=' if allow_zero else '>'} 0, got {value}")
    return float(value)


def build_profile(raw: Mapping[str, Any] | ProfileSpec) -> tuple[str, ModelProfile]:
    """(model pattern, profile) from one config entry. Raises ProfileError naming the field."""
    if isinstance(raw, ProfileSpec):
        spec = raw
    else:
        try:
            # not strict: PyYAML reads `1e-4` (no dot) as a string; "1e-4" and "true" convert as meant
            spec = msgspec.convert(raw, ProfileSpec, strict=False)
        except msgspec.ValidationError as err:
            raise ProfileError(*validation_field(err)) from None
    base = REFERENCE_PROFILES.get(spec.reference)
    if base is None:
        raise ProfileError(
            "reference",
            f"unknown reference profile {spec.reference!r} (known: {', '.join(REFERENCE_PROFILES)})",
        )
    if spec.kv_bytes_per_token is not None and spec.architecture is not None:
        raise ProfileError("kvBytesPerToken", "give kvBytesPerToken or architecture, not both")
    p = replace(base, name=spec.model if spec.model != "*" else base.name)
    if spec.kv_bytes_per_token is not None:
        p = replace(p, kv_bytes_per_token=_positive("kvBytesPerToken", spec.kv_bytes_per_token, False))
    if spec.architecture is not None:
        a = spec.architecture
        for fname, v in (("layers", a.layers), ("kvHeads", a.kv_heads), ("headDim", a.head_dim)):
            if v < 1:
                raise ProfileError(f"architecture.{fname}", f"must be >= 1, got {v}")
        dtype = _positive("architecture.dtypeBytes", a.dtype_bytes, False)
        p = replace(p, kv_bytes_per_token=kv_bytes_per_token(a.layers, a.kv_heads, a.head_dim, dtype))
    if spec.prefill is not None:
        f = spec.prefill
        p = replace(
            p,
            prefill_fixed_s=_opt("prefill.fixedSeconds", f.fixed_seconds, p.prefill_fixed_s),
            prefill_per_token_s=_opt("prefill.perTokenSeconds", f.per_token_seconds, p.prefill_per_token_s),
            prefill_per_pair_s=_opt("prefill.perPairSeconds", f.per_pair_seconds, p.prefill_per_pair_s),
        )
    if spec.decode is not None:
        d = spec.decode
        p = replace(
            p,
            decode_fixed_s=_opt("decode.fixedSeconds", d.fixed_seconds, p.decode_fixed_s),
            decode_per_sequence_s=_opt(
                "decode.perSequenceSeconds", d.per_sequence_seconds, p.decode_per_sequence_s
            ),
            decode_per_context_token_s=_opt(
                "decode.perContextTokenSeconds", d.per_context_token_seconds, p.decode_per_context_token_s
            ),
        )
    if spec.max_batched_tokens is not None:
        if spec.max_batched_tokens < 1:
            raise ProfileError("maxBatchedTokens", "must be >= 1")
        p = replace(p, max_batched_tokens=spec.max_batched_tokens)
    if spec.tiers is not None:
        tiers = dict(p.tiers)
        for tier, t in spec.tiers.items():
            name = tier.lower()
            if normalize_tier(tier) == "gpu":
                raise ProfileError(f"tiers.{tier}", "the gpu tier is free to use; it takes no cost")
            if normalize_tier(tier) != name:  # an engine's medium name: the index files it under another
                raise ProfileError(
                    f"tiers.{tier}",
                    f"the index files the engines' {tier!r} blocks under the tier "
                    f"{normalize_tier(tier)!r}: name that tier here "
                    f"(a cost under {tier!r} would never apply)",
                )
            bw = _positive(f"tiers.{tier}.bandwidthBytesPerSecond", t.bandwidth_bytes_per_second, False)
            tiers[name] = TierCost(bw, _positive(f"tiers.{tier}.latencySeconds", t.latency_seconds))
        p = replace(p, tiers=tiers)
    if spec.unknown_request_tokens is not None:
        if spec.unknown_request_tokens < 0:
            raise ProfileError("unknownRequestTokens", "must be >= 0")
        p = replace(p, unknown_request_tokens=spec.unknown_request_tokens)
    if spec.kv_wait_steps is not None:
        if spec.kv_wait_steps < 0:
            raise ProfileError("kvWaitSteps", "must be >= 0")
        p = replace(p, kv_wait_steps=spec.kv_wait_steps)
    if spec.async_scheduling is not None:
        p = replace(p, async_scheduling=spec.async_scheduling)
    if not spec.model:
        raise ProfileError("model", "must be a model name or '*'")
    return spec.model, p


def _opt(field: str, value: float | None, default: float) -> float:
    return default if value is None else _positive(field, value)
