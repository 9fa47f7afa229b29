"""Bounded metric labels for the model names clients choose (`model_name`, `target_model_name`).

Clients pick the body's `model` and (unless the gateway strips it) the rewrite header independently, so
unbounded names, and above all unbounded (model, target) pairs, would each grow a counter, three
histograms and error series: 256 x 256 pairs rendered a 39 MB exposition. So:

- a name the operator put there (a model the pool serves, a configured objective, a name an
  InferenceModelRewrite rule matches or targets: `known`) always has its own label and costs nothing;
- other names take one of `max_names` slots, first come; past that (or past `max_chars`) they count as
  OTHER_MODEL. Junk names therefore can never push a served model into OTHER_MODEL;
- a pair of two different labels, neither OTHER_MODEL, takes one of `max_pairs` pair slots unless a rule
  names it (its exact model and one of its targets); past that it counts as (OTHER_MODEL, target): the
  model server's side of the request is kept. The pairs are then bounded by `max_pairs`, the rule pairs
  and three times the labels ((m, m), (OTHER_MODEL, t), (m, OTHER_MODEL)).

Slots are never given back: a series that came and went would otherwise reappear under another label.
Pure (no Prometheus here): the director asks for labels and records with them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

MAX_MODEL_LABELS = 256
"""Distinct names outside the `known` ones that get their own label."""
MAX_MODEL_PAIRS = 256
"""Distinct (model_name, target_model_name) pairs of two different names that no rule names."""
MAX_MODEL_LABEL_CHARS = 256
"""A longer name (not a `known` one) counts as OTHER_MODEL."""
OTHER_MODEL = "other"


class ModelLabels:
    def __init__(
        self,
        known: Callable[[str], bool],
        max_names: int = MAX_MODEL_LABELS,
        max_pairs: int = MAX_MODEL_PAIRS,
        max_chars: int = MAX_MODEL_LABEL_CHARS,
    ) -> None:
        """`known(name)`: the operator put the name there (see the module's docstring); asked on every
        call, so the set may change (pods come and go, rules change)."""
        self._known = known
        self.max_names = max_names
        self.max_pairs = max_pairs
        self.max_chars = max_chars
        self._names: set[str] = set()
        self._pairs: set[tuple[str, str]] = set()
        self._rule_pairs: frozenset[tuple[str, str]] = frozenset()

    def set_rule_pairs(self, pairs: Collection[tuple[str, str]]) -> None:
        """The (model, target) pairs the rewrite rules in force name: labelled without a pair slot."""
        self._rule_pairs = frozenset(pairs)

    def name(self, model: str) -> str:
        """The label of one name: itself, or OTHER_MODEL once the slots are taken (or it is too long)."""
        if model in self._names or self._known(model):
            return model
        if len(model) > self.max_chars or len(self._names) >= self.max_names:
            return OTHER_MODEL
        self._names.add(model)
        return model

    def pair(self, model: str, target: str) -> tuple[str, str]:
        """The (model_name, target_model_name) labels of a request the client sent as `model` and that
        went to the model server as `target`."""
        t = self.name(target)
        m = t if model == target else self.name(model)
        if m == t or OTHER_MODEL in (m, t):
            return m, t
        key = (m, t)
        if key in self._pairs or key in self._rule_pairs:
            return key
        if len(self._pairs) >= self.max_pairs:
            return OTHER_MODEL, t
        self._pairs.add(key)
        return key


__all__ = ["MAX_MODEL_LABELS", "MAX_MODEL_LABEL_CHARS", "MAX_MODEL_PAIRS", "OTHER_MODEL", "ModelLabels"]
