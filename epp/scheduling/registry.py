"""An explicit plugin registry instance: plugin type name -> how to validate params and build it.

There is no global registry; `epp.scheduling.builtin.default_registry()` returns a fresh one
holding the in-tree plugins, and users may register their own on it before loading a config.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from epp.scheduling.framework import Filter, Picker, Plugin, PluginHandle, ProfileHandler, Scorer

PluginKind = Literal["filter", "scorer", "picker", "profile-handler"]
_KIND_PROTOCOLS: dict[PluginKind, type] = {
    "filter": Filter,
    "scorer": Scorer,
    "picker": Picker,
    "profile-handler": ProfileHandler,
}


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

    def spec(self, type_name: str) -> PluginSpec:
        try:
            return self._specs[type_name]
        except KeyError:
            known = ", ".join(sorted(self._specs))
            raise PluginParamsError(
                "type", f"unknown plugin type {type_name!r} (known types: {known})"
            ) from None

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
