"""What Kubernetes discovery needs to know: the pool (API group, name, namespace), where the API
server is, and how patiently to retry (pure; resolved from flags and the environment by the CLI)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    pool_name: str
    namespace: str = "default"
    pool_group: str = GROUP_V1  # which InferencePool API: v1, or the older v1alpha2 (x-k8s)
    kubeconfig: str | None = None  # None: the in-cluster service account
    backoff_initial: float = 0.2  # seconds before the first retry after an error
    backoff_max: float = 10.0  # retries never wait longer than this
    watch_timeout: int = 300  # server-side timeoutSeconds of one watch request; then re-watch
    request_timeout: float = 30.0  # one list request (connect and read)
    rewrite_group: str = REWRITE_GROUP  # where InferenceModelRewrite objects are read (`REWRITE_VERSION`)

    def check(self) -> str | None:
        """A message about the first invalid setting, or None."""
        if not self.pool_name:
            return "--pool-name must not be empty"
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
