"""What Kubernetes discovery needs to know: the pool (API group, name, namespace) -- or, in selector
mode, a label selector and target ports instead of a pool --, where the API server is, and how
patiently to retry (pure; resolved from flags and the environment by the CLI)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epp.discovery.selector import LabelSelector

NAMESPACE_ENVS = ("NAMESPACE", "POD_NAMESPACE")
# `--pool-group` -> the InferencePool version served in it (as the reference EPP's `--pool-group`).
GROUP_V1 = "inference.networking.k8s.io"
GROUP_V1ALPHA2 = "inference.networking.x-k8s.io"
POOL_VERSIONS = {GROUP_V1: "v1", GROUP_V1ALPHA2: "v1alpha2"}
# InferenceModelRewrite: the Inference Extension's resource (apix/v1alpha2), whatever `--pool-group` is.
REWRITE_GROUP = "inference.networking.x-k8s.io"
REWRITE_VERSION = "v1alpha2"
REWRITE_PLURAL = "inferencemodelrewrites"
REWRITE_GROUPS = (REWRITE_GROUP, "llm-d.ai")  # llm-d's router serves the same schema as llm-d.ai/v1alpha2
MAX_TARGET_PORTS = 8  # as InferencePool `spec.targetPorts` and the reference's `--endpoint-target-ports`


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    pool_name: str = ""  # the InferencePool; empty in selector mode
    namespace: str = "default"
    pool_group: str = GROUP_V1  # which InferencePool API: v1, or the older v1alpha2 (x-k8s)
    kubeconfig: str | None = None  # None: the in-cluster service account
    backoff_initial: float = 0.2  # seconds before the first retry after an error
    backoff_max: float = 10.0  # retries never wait longer than this
    watch_timeout: int = 300  # server-side timeoutSeconds of one watch request; then re-watch
    request_timeout: float = 30.0  # one list request (connect and read)
    rewrite_group: str = REWRITE_GROUP  # where InferenceModelRewrite objects are read (`REWRITE_VERSION`)
    # Selector mode (the reference's `--endpoint-selector` / `--endpoint-target-ports`): the pods of
    # `namespace` this selects are the endpoints, on these ports; no InferencePool is read.
    endpoint_selector: LabelSelector | None = None
    target_ports: tuple[int, ...] = ()

    @property
    def selector_mode(self) -> bool:
        return self.endpoint_selector is not None

    def check(self) -> str | None:
        """A message about the first invalid setting, or None."""
        if self.endpoint_selector is not None:
            problem = self._check_selector_mode(self.endpoint_selector)
            if problem is not None:
                return problem
        elif not self.pool_name:
            return "--pool-name must not be empty"
        elif self.target_ports:
            return "--endpoint-target-ports needs --endpoint-selector (a pool names its own target ports)"
        if not self.namespace:
            return "--pool-namespace must not be empty"
        if self.pool_group not in POOL_VERSIONS:
            return (
                f"--pool-group {self.pool_group!r} is not an InferencePool API group: use {GROUP_V1} "
                f"(InferencePool v1, the default) or {GROUP_V1ALPHA2} (InferencePool v1alpha2)"
            )
        if self.rewrite_group not in REWRITE_GROUPS:
            groups = ", ".join(REWRITE_GROUPS)
            group = self.rewrite_group
            return f"--model-rewrite-group {group!r} is not an InferenceModelRewrite group: use {groups}"
        if not 0 < self.backoff_initial <= self.backoff_max:
            return "backoff must satisfy 0 < initial <= max"
        if self.watch_timeout < 1 or self.request_timeout <= 0:
            return "watch and request timeouts must be positive"
        return None

    def _check_selector_mode(self, selector: LabelSelector) -> str | None:
        if self.pool_name:
            return (
                "--pool-name and --endpoint-selector cannot be used together: the endpoints come from "
                "an InferencePool or from a label selector, not both"
            )
        if not selector.requirements:
            return "--endpoint-selector must not be empty (it would select every pod of the namespace)"
        return check_target_ports(self.target_ports)

    @property
    def pool_version(self) -> str:
        """The InferencePool version read in `pool_group` (call `check()` first)."""
        return POOL_VERSIONS[self.pool_group]


def resolve_namespace(flag: str | None, environ: Mapping[str, str]) -> str:
    """`--pool-namespace`, else $NAMESPACE, else $POD_NAMESPACE, else "default"."""
    if flag:
        return flag
    for name in NAMESPACE_ENVS:
        value = environ.get(name, "").strip()
        if value:
            return value
    return "default"


def resolve_kubeconfig(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """`--kubeconfig`, else $KUBECONFIG, else None (in-cluster config)."""
    if flag:
        return flag
    value = environ.get("KUBECONFIG", "").strip()
    return value or None


def check_target_ports(ports: Sequence[int]) -> str | None:
    """A message when `ports` are not 1 to `MAX_TARGET_PORTS` distinct port numbers, or None."""
    if not ports:
        return "--endpoint-selector needs --endpoint-target-ports (the pods' ports to route to)"
    if len(ports) > MAX_TARGET_PORTS:
        return f"--endpoint-target-ports has {len(ports)} ports, at most {MAX_TARGET_PORTS}"
    for port in ports:
        if not 0 < port < 65536:
            return f"--endpoint-target-ports: {port} is not a port number 1-65535"
    if len(set(ports)) != len(ports):
        return "--endpoint-target-ports: a port is listed twice"
    return None


def parse_target_ports(values: Sequence[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`--endpoint-target-ports` (each given comma-separated numbers, as the reference's int-slice flag
    appends repeated ones) -> (the ports in order without repeats, the ports listed more than once).
    ValueError names an entry that is not a number; the range is `check_target_ports`'s."""
    ports: list[int] = []
    repeated: list[int] = []
    for value in values:
        for entry in value.split(","):
            text = entry.strip()
            if not text.lstrip("+-").isdigit() or not text.isascii():
                raise ValueError(
                    f"{entry!r} is not a port number (expected comma-separated numbers, e.g. 8000,8001)"
                )
            port = int(text)
            if port in ports:
                if port not in repeated:
                    repeated.append(port)
            else:
                ports.append(port)
    return tuple(ports), tuple(repeated)
