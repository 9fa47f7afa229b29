"""Routing policies for the simulator, each an EPP config file (the peers' policies built from our plugins).

`oracle` is the one exception: our TTFT estimate fed with the engines' true instantaneous state
instead of what the router observed (scrapes, delayed events); the cluster builds it from
`ttft.yaml` and swaps the inputs, to show what staleness costs.
"""

from __future__ import annotations

from importlib import resources

from epp.config import EppConfig, parse_config

ORACLE = "oracle"


def names() -> list[str]:
    """Every policy name, the config-file ones sorted, then `oracle`."""
    files = resources.files(__package__)
    found = sorted(p.name[: -len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))
    return [*found, ORACLE]


def config_text(name: str) -> str:
    """The EPP config of policy `name` (`oracle` uses the `ttft` one). KeyError lists the known names."""
    file = "ttft" if name == ORACLE else name
    path = resources.files(__package__) / f"{file}.yaml"
    if not path.is_file():
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(names())}")
    return path.read_text(encoding="utf-8")


def load(name: str) -> EppConfig:
    return parse_config(config_text(name), f"<policy {name}>")
