"""An explicit plugin registry instance: plugin type name -> how to validate params and build it.

There is no global registry; `epp.scheduling.builtin.default_registry()` returns a fresh one
holding the in-tree plugins, and users may register their own on it before loading a config.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from epp.scheduling.framework import Filter, Picker, Plugin, PluginHandle, ProfileHandler, Scorer

PluginKind = Literal["filter", "scorer", "picker", "profile-handler", "data-source", "data-extractor"]
_KIND_PROTOCOLS: dict[PluginKind, type] = {
    "filter": Filter,
    "scorer": Scorer,
    "picker": Picker,
    "profile-handler": ProfileHandler,
    # The reference EPP's data-layer plugins: declared under `plugins`, never part of a profile.
    "data-source": Plugin,
    "data-extractor": Plugin,
}
PROFILE_KINDS: frozenset[PluginKind] = frozenset({"filter", "scorer", "picker"})
"""The kinds a scheduling profile holds (the reference's default profile takes every plugin of these)."""

RENAMED_TYPES: dict[str, str] = {
    "prefix-cache": "prefix-cache-scorer",
    "max-score": "max-score-picker",
    "random": "random-picker",
    "single-profile": "single-profile-handler",
    "queue": "queue-scorer",
    "kv-cache": "kv-cache-utilization-scorer",
    "kv-cache-scorer": "kv-cache-utilization-scorer",
}
"""Plugin type names of earlier reference EPP releases and what they are called now (named in the
error: the reference itself no longer accepts them either)."""


class PluginParamsError(ValueError):
    """A plugin's parameters do not validate. `field` is the offending parameter (or '')."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class Params(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """Base for plugin parameter structs: camelCase keys, unknown keys rejected."""


class NoParams(Params):
    pass


@dataclass(frozen=True, slots=True)
class PluginSpec:
    type_name: str
    kind: PluginKind
    params_type: type[Params]
    build: Callable[[str, Any, PluginHandle], Plugin]
    doc: str = ""


_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN_RE = re.compile(r"unknown field `([^`]*)`")


def _field_of(err: msgspec.ValidationError) -> str:
    text = str(err)
    m = _UNKNOWN_RE.search(text) or _PATH_RE.search(text)
    return m.group(1) if m else ""


class PluginRegistry:
    def __init__(self) -> None:
        self._specs: dict[str, PluginSpec] = {}

    def register(self, spec: PluginSpec) -> None:
        if spec.type_name in self._specs:
            raise ValueError(f"plugin type {spec.type_name!r} is already registered")
        self._specs[spec.type_name] = spec

    def __contains__(self, type_name: object) -> bool:
        return type_name in self._specs

    def _unknown(self, type_name: str) -> str:
        renamed = RENAMED_TYPES.get(type_name)
        if renamed is not None and renamed in self._specs:
            return f"{type_name!r} (the reference EPP renamed it {renamed!r})"
        return repr(type_name)

    def unknown_type_message(self, type_name: str, also: Sequence[str] = ()) -> str:
        """Why `type_name` (and the types `also` of the same config) cannot be built: unknown, with the
        current name of an old one, and the known types."""
        message = f"unknown plugin type {self._unknown(type_name)}"
        if also:
            message += f"; also unknown here: {', '.join(self._unknown(t) for t in also)}"
        return f"{message} (known types: {', '.join(sorted(self._specs))})"

    def spec(self, type_name: str) -> PluginSpec:
        try:
            return self._specs[type_name]
        except KeyError:
            raise PluginParamsError("type", self.unknown_type_message(type_name)) from None

    def types(self) -> list[PluginSpec]:
        return [self._specs[k] for k in sorted(self._specs)]

    def create(
        self, type_name: str, name: str, params: Mapping[str, Any] | None, handle: PluginHandle
    ) -> tuple[PluginKind, Plugin]:
        """Validate `params` against the plugin's struct and build it."""
        spec = self.spec(type_name)
        raw = {} if params is None else params
        if not isinstance(raw, Mapping):
            raise PluginParamsError("parameters", "parameters must be a mapping")
        try:
            typed = msgspec.convert(dict(raw), spec.params_type, strict=True)
        except msgspec.ValidationError as err:
            raise PluginParamsError(_field_of(err), str(err)) from None
        try:
            plugin = spec.build(name, typed, handle)
        except PluginParamsError:
            raise
        except ValueError as err:
            raise PluginParamsError("parameters", str(err)) from None
        proto = _KIND_PROTOCOLS[spec.kind]
        if not isinstance(plugin, proto):
            raise TypeError(f"plugin type {type_name!r} does not implement {spec.kind}")
        return spec.kind, plugin
