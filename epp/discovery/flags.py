"""The discovery flags of `epp serve` and their resolution into `DiscoverySettings` (pure: the
environment comes in as a mapping; a bad combination is a `ConfigError` naming the flag).

Two modes, as the reference EPP's (llm-d-router `pkg/epp/server/options.go`, `Validate`: exactly one
of `--pool-name` and `--endpoint-selector`): an InferencePool (`--pool-name`, `--pool-group`,
`--model-rewrite-group`), or selector mode (`--endpoint-selector` with `--endpoint-target-ports`).
Both take `--pool-namespace` (else `$NAMESPACE`, `$POD_NAMESPACE`, `default`) and `--kubeconfig`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from typing import NoReturn

from epp.config import EppConfig
from epp.config_sections import ConfigError
from epp.discovery.selector import SelectorError, parse_selector
from epp.discovery.settings import (
    GROUP_V1,
    MAX_TARGET_PORTS,
    REWRITE_GROUP,
    DiscoverySettings,
    parse_target_ports,
    resolve_kubeconfig,
    resolve_namespace,
)

log = logging.getLogger("epp.discovery")

POOL_ONLY = ("--pool-group", "--model-rewrite-group")
# Without a mode, what each discovery flag needs.
_NEEDS = {
    **dict.fromkeys(POOL_ONLY, "--pool-name"),
    "--endpoint-target-ports": "--endpoint-selector",
    "--pool-namespace": "--pool-name or --endpoint-selector",
    "--kubeconfig": "--pool-name or --endpoint-selector",
}
CHECKED_FLAGS = (*POOL_ONLY, "--endpoint-target-ports", "--endpoint-selector", "--pool-namespace")


def add_discovery_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--pool-name",
        help="InferencePool whose pods are the endpoints (Kubernetes discovery; instead of --endpoints); "
        "also the name label of the pool metrics (default: default)",
    )
    s.add_argument(
        "--pool-group",
        help=f"API group of the InferencePool: {GROUP_V1} (v1, the default) or "
        "inference.networking.x-k8s.io (the older v1alpha2)",
    )
    s.add_argument(
        "--model-rewrite-group",
        help=f"API group of the InferenceModelRewrite objects (v1alpha2) watched: {REWRITE_GROUP} "
        "(the default) or llm-d.ai (llm-d's router)",
    )
    s.add_argument(
        "--endpoint-selector",
        help="selector mode (instead of --pool-name): the pods of the namespace this Kubernetes label "
        "selector matches are the endpoints, e.g. 'app=vllm,env in (prod,staging)'; needs "
        "--endpoint-target-ports",
    )
    s.add_argument(
        "--endpoint-target-ports",
        action="append",
        help=f"with --endpoint-selector: the pods' ports to route to, comma-separated (1 to "
        f"{MAX_TARGET_PORTS}, e.g. 8000,8001); repeating the flag adds ports",
    )
    s.add_argument(
        "--pool-namespace",
        help="namespace of the InferencePool, or of the pods --endpoint-selector selects "
        "(default: $NAMESPACE, $POD_NAMESPACE, else default)",
    )
    s.add_argument(
        "--kubeconfig",
        help="kubeconfig for discovery (default: $KUBECONFIG, else the in-cluster service account)",
    )


def discovery_settings(
    args: argparse.Namespace, cfg: EppConfig, environ: Mapping[str, str]
) -> DiscoverySettings | None:
    """Discovery settings when `--pool-name` or `--endpoint-selector` is given, else None;
    ConfigError (naming the flag) for a bad value or combination."""
    pool_name: str | None = args.pool_name
    selector_text: str | None = args.endpoint_selector
    ports_given: list[str] | None = args.endpoint_target_ports
    given = {
        "--pool-group": args.pool_group,
        "--model-rewrite-group": args.model_rewrite_group,
        "--pool-namespace": args.pool_namespace,
        "--kubeconfig": args.kubeconfig,
        "--endpoint-target-ports": ports_given,
    }
    if pool_name is not None and selector_text is not None:
        _fail(
            "--endpoint-selector",
            "--pool-name and --endpoint-selector cannot be used together: the endpoints come from an "
            "InferencePool or from a label selector, not both",
        )
    if pool_name is None and selector_text is None:
        for flag, value in given.items():
            if value is not None:
                _fail(flag, f"needs {_NEEDS[flag]} (Kubernetes discovery)")
        return None
    mode_flag = "--pool-name" if pool_name is not None else "--endpoint-selector"
    if selector_text is not None:
        for flag in POOL_ONLY:
            if given[flag] is not None:
                _fail(
                    flag,
                    "needs --pool-name (selector mode reads no InferencePool nor InferenceModelRewrite)",
                )
    elif ports_given is not None:
        _fail(
            "--endpoint-target-ports",
            "needs --endpoint-selector (a pool names its own target ports)",
        )
    if args.endpoints or cfg.endpoints:
        where = "--endpoints" if args.endpoints else f"the endpoints of {cfg.source}"
        _fail(
            mode_flag,
            f"Kubernetes discovery cannot be combined with static endpoints ({where}); use one or the other",
        )
    settings = DiscoverySettings(
        pool_name=pool_name or "",
        namespace=resolve_namespace(args.pool_namespace, environ),
        pool_group=GROUP_V1 if args.pool_group is None else args.pool_group,
        rewrite_group=REWRITE_GROUP if args.model_rewrite_group is None else args.model_rewrite_group,
        kubeconfig=resolve_kubeconfig(args.kubeconfig, environ),
    )
    if selector_text is not None:
        settings = _selector_mode(settings, selector_text, ports_given)
    problem = settings.check()
    if problem is not None:
        head = problem.split(" ", 1)[0].rstrip(":")
        _fail(head if head in CHECKED_FLAGS else mode_flag, problem)
    return settings


def _selector_mode(
    settings: DiscoverySettings, text: str, ports_given: list[str] | None
) -> DiscoverySettings:
    try:
        selector = parse_selector(text)
    except SelectorError as err:
        _fail("--endpoint-selector", f"{text!r} is not a Kubernetes label selector: {err}")
    if ports_given is None:
        _fail("--endpoint-selector", "needs --endpoint-target-ports (the pods' ports to route to)")
    try:
        ports, repeated = parse_target_ports(ports_given)
    except ValueError as err:
        _fail("--endpoint-target-ports", str(err))
    if repeated:  # the reference's options drop repeated ports (`removeDuplicatePorts`): so do we
        log.warning(
            "--endpoint-target-ports lists %s more than once; each port is used once",
            ",".join(map(str, repeated)),
        )
    return DiscoverySettings(
        namespace=settings.namespace,
        kubeconfig=settings.kubeconfig,
        endpoint_selector=selector,
        target_ports=ports,
    )


def _fail(flag: str, message: str) -> NoReturn:
    raise ConfigError("flags", "", flag, message)
