"""Routing policies for the simulator, each an EPP config file (the peers' policies built from our plugins).

`oracle` is the one exception: our TTFT estimate fed with the engines' true instantaneous state
instead of what the router observed (scrapes, delayed events); the cluster builds it from
`ttft.yaml` and swaps the inputs, to show what staleness costs.

A policy may also be any EPP config file: `PATH.yaml` (named after the file) or `NAME=PATH.yaml`.
"""

from __future__ import annotations

import pathlib
import re
from importlib import resources

from epp.config import EppConfig, parse_config

ORACLE = "oracle"


def names() -> list[str]:
    """Every policy name, the config-file ones sorted, then `oracle`."""
    files = resources.files(__package__)
    found = sorted(p.name[: -len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))
    return [*found, ORACLE]


_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_file(spec: str) -> bool:
    """Whether `spec` names an EPP config file (`PATH.yaml`, `NAME=PATH.yaml`), not a shipped policy."""
    return spec.endswith((".yaml", ".yml"))


def label(spec: str) -> str:
    """The name a policy's figures and records go by: a shipped policy's name, else NAME of `NAME=PATH`,
    else the file's name without its extension."""
    if not is_file(spec):
        return spec
    name, sep, _ = spec.partition("=")
    return name if sep else pathlib.Path(spec).stem


def check_file(spec: str) -> str:
    """A config-file policy, read and parsed now; its label. ValueError saying what is wrong."""
    name = label(spec)
    if not _LABEL.match(name):
        raise ValueError(f"policy {spec!r}: its name {name!r} must be letters, digits, '.', '_' or '-'")
    if name in names():
        raise ValueError(f"policy {spec!r}: the name {name!r} is a shipped policy's; name it NAME=PATH")
    load(spec)
    return name


def config_text(name: str) -> str:
    """The EPP config of policy `name` (`oracle` uses the `ttft` one), or of the config file it names.
    KeyError lists the known names; ValueError when a file cannot be read."""
    if is_file(name):
        given = pathlib.Path(name.partition("=")[2] or name)
        try:
            return given.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"policy file {str(given)!r}: {getattr(err, 'strerror', None) or err}") from None
    file = "ttft" if name == ORACLE else name
    path = resources.files(__package__) / f"{file}.yaml"
    if not path.is_file():
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(names())}")
    return path.read_text(encoding="utf-8")


def load(name: str) -> EppConfig:
    """The parsed EPP config of a shipped policy or of a config-file policy (see `config_text`)."""
    return parse_config(config_text(name), f"<policy {name}>")
