"""`InferenceModelRewrite` objects -> a rule table, and the weighted pick among a rule's targets (pure).

The objects are the API server's JSON as plain mappings (`inference.networking.x-k8s.io/v1alpha2`,
the Inference Extension's `apix/v1alpha2/inferencemodelrewrite_types.go`; llm-d's router serves the
same schema as `llm-d.ai/v1alpha2`):

    spec:
      poolRef: {group: inference.networking.k8s.io, kind: InferencePool, name: <pool>}
      rules:
      - matches: [{model: {type: Exact, value: food-review}}]   # empty or absent: every model
        targets: [{modelRewrite: food-review-v1, weight: 90}, {modelRewrite: food-review-v2, weight: 10}]

An object applies to this EPP's pool when `spec.poolRef.name` is the pool's name and
`spec.poolRef.group` (the CRD's default `inference.networking.k8s.io` when absent) is the pool's API
group, as the reference's reconciler filters them (`pkg/epp/controller/inferencemodelrewrite_reconciler.go`).
Of the rules of every applicable object, a model is rewritten by the rule whose `matches` name it
exactly, else by a generic rule (no `matches`); among several, the rule of the oldest object
(`metadata.creationTimestamp`) wins, then (ours: the reference sorts unstably) the object's name, then
the first rule in list order (the reference's `pkg/epp/datastore` model-rewrite store).

The pick: with weights, a target with probability weight / sum of weights; without weights, uniformly
(the reference's `selectWeightedModel` in `pkg/epp/requestcontrol/director.go`). When only some targets
have a weight, the unweighted ones are never picked, as in the reference (a warning names them).

An object the CRD schema would refuse is refused here (`RewriteError` names the object and field); the
table is built from the others. No I/O, no clock: the pick takes the caller's `random.Random`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from random import Random
from typing import Any

from epp.discovery.settings import GROUP_V1

KIND = "InferenceModelRewrite"
DEFAULT_POOL_REF_GROUP = GROUP_V1  # the CRD's default for `spec.poolRef.group`
MATCH_EXACT = "Exact"  # the only `matches[].model.type` the CRD allows (and its default)
MIN_WEIGHT, MAX_WEIGHT = 1, 1_000_000  # the CRD's bounds of `targets[].weight`


class RewriteError(ValueError):
    """The object cannot be used; the message names it and the first bad field."""


@dataclass(frozen=True, slots=True)
class Target:
    model: str
    weight: int | None  # None: no weight given


@dataclass(frozen=True, slots=True)
class Rule:
    source: str  # the InferenceModelRewrite's name (the metrics' `model_rewrite_name`)
    index: int  # its position in `spec.rules`
    models: tuple[str, ...]  # the exact model names it matches; () matches every model
    targets: tuple[Target, ...]

    @property
    def generic(self) -> bool:
        return not self.models

    def pick(self, rng: Random) -> str:
        """One target's model: weighted when any target has a weight (the unweighted ones are then never
        picked, as in the reference), else uniform."""
        weighted = [t for t in self.targets if t.weight is not None]
        if not weighted:
            return self.targets[rng.randrange(len(self.targets))].model
        point = rng.randrange(sum(t.weight for t in weighted if t.weight is not None))
        for t in weighted:
            assert t.weight is not None
            if point < t.weight:
                return t.model
            point -= t.weight
        return weighted[-1].model  # not reached: point < the sum


@dataclass(frozen=True, slots=True)
class ModelRewrite:
    """One applicable, valid InferenceModelRewrite."""

    name: str
    created: datetime  # metadata.creationTimestamp (timezone-aware)
    rules: tuple[Rule, ...]
    warnings: tuple[str, ...] = ()  # usable but doubtful (mixed weights)


@dataclass(frozen=True, slots=True)
class RewriteTable:
    """The rules in force: exact model -> the rule that wins it, and the winning generic rule."""

    exact: Mapping[str, Rule] = field(default_factory=dict)
    generic: Rule | None = None
    sources: tuple[str, ...] = ()  # the objects it was built from, oldest first

    @classmethod
    def build(cls, rewrites: Iterable[ModelRewrite]) -> RewriteTable:
        exact: dict[str, Rule] = {}
        generic: Rule | None = None
        ordered = sorted(rewrites, key=lambda r: (r.created, r.name))
        for rw in ordered:
            for rule in rw.rules:  # list order within an object
                if rule.generic:
                    generic = generic or rule
                for model in rule.models:
                    exact.setdefault(model, rule)
        return cls(exact, generic, tuple(r.name for r in ordered))

    def __bool__(self) -> bool:
        return bool(self.exact) or self.generic is not None

    def lookup(self, model: str) -> Rule | None:
        """The rule that rewrites `model`: an exact match first, else the generic rule, else None."""
        return self.exact.get(model) or self.generic

    def rewrite(self, model: str, rng: Random) -> tuple[Rule, str] | None:
        """(the rule, the model picked among its targets), or None when no rule applies."""
        rule = self.lookup(model)
        return None if rule is None else (rule, rule.pick(rng))


EMPTY = RewriteTable()


def parse_rewrite(obj: Any, pool_name: str, pool_group: str) -> ModelRewrite | None:
    """An InferenceModelRewrite for the pool (`pool_name` in `pool_group`), or None when it names another
    pool. Raises RewriteError naming the object and the first field the CRD schema would refuse."""
    if not isinstance(obj, Mapping):
        raise RewriteError(f"{KIND}: expected an object, got {type(obj).__name__}")
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise RewriteError(f"{KIND}: metadata.name is missing")
    where = f"{KIND} {name!r}"
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise RewriteError(f"{where}: spec is missing")
    ref = spec.get("poolRef")
    if not isinstance(ref, Mapping):
        raise RewriteError(f"{where}: spec.poolRef is missing (it names the InferencePool)")
    ref_name = ref.get("name")
    if not isinstance(ref_name, str) or not ref_name:
        raise RewriteError(f"{where}: spec.poolRef.name is missing or empty")
    ref_group = ref.get("group", DEFAULT_POOL_REF_GROUP)
    if not isinstance(ref_group, str):
        raise RewriteError(f"{where}: spec.poolRef.group must be a string, got {type(ref_group).__name__}")
    if ref_name != pool_name or ref_group != pool_group:
        return None
    created = _timestamp(meta.get("creationTimestamp"), where)
    raw_rules = spec.get("rules")
    if not isinstance(raw_rules, list):
        raise RewriteError(f"{where}: spec.rules is missing or not a list")
    rules: list[Rule] = []
    warnings: list[str] = []
    for i, raw in enumerate(raw_rules):
        at = f"spec.rules[{i}]"
        if not isinstance(raw, Mapping):
            raise RewriteError(f"{where}: {at} must be an object")
        models = _matches(raw.get("matches"), f"{where}: {at}.matches")
        targets = _targets(raw.get("targets"), f"{where}: {at}.targets")
        unweighted = [j for j, t in enumerate(targets) if t.weight is None]
        if unweighted and len(unweighted) < len(targets):
            warnings.append(
                f"{where}: {at}.targets: weights are set on some targets only; "
                f"targets {', '.join(map(str, unweighted))} (no weight) are never picked"
            )
        rules.append(Rule(name, i, models, targets))
    return ModelRewrite(name, created, tuple(rules), tuple(warnings))


def _timestamp(value: Any, where: str) -> datetime:
    if isinstance(value, str):
        try:
            ts = datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            if ts.tzinfo is not None:
                return ts
    raise RewriteError(f"{where}: metadata.creationTimestamp is missing or not an RFC 3339 time ({value!r})")


def _matches(raw: Any, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RewriteError(f"{where} must be a list")
    models: list[str] = []
    for j, match in enumerate(raw):
        model = match.get("model") if isinstance(match, Mapping) else None
        if not isinstance(model, Mapping):
            raise RewriteError(f"{where}[{j}].model is missing (it says which model the rule matches)")
        kind = model.get("type", MATCH_EXACT)
        if kind != MATCH_EXACT:
            raise RewriteError(f"{where}[{j}].model.type must be {MATCH_EXACT!r}, got {kind!r}")
        value = model.get("value")
        if not isinstance(value, str) or not value:
            raise RewriteError(f"{where}[{j}].model.value is missing or empty")
        if value not in models:
            models.append(value)
    return tuple(models)


def _targets(raw: Any, where: str) -> tuple[Target, ...]:
    if not isinstance(raw, list) or not raw:
        raise RewriteError(f"{where} must list at least one target")
    targets: list[Target] = []
    for j, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise RewriteError(f"{where}[{j}] must be an object")
        model = item.get("modelRewrite")
        if not isinstance(model, str) or not model:
            raise RewriteError(f"{where}[{j}].modelRewrite is missing or empty")
        weight = item.get("weight")
        if weight is not None and (
            isinstance(weight, bool) or not isinstance(weight, int) or not MIN_WEIGHT <= weight <= MAX_WEIGHT
        ):
            raise RewriteError(
                f"{where}[{j}].weight must be an integer from {MIN_WEIGHT} to {MAX_WEIGHT}, got {weight!r}"
            )
        targets.append(Target(model, weight))
    return tuple(targets)
