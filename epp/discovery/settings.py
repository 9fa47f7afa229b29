"""What Kubernetes discovery needs to know: the pool, its namespace, where the API server is, and
how patiently to retry (pure; resolved from flags and the environment by the CLI)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

NAMESPACE_ENVS = ("NAMESPACE", "POD_NAMESPACE")


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    pool_name: str
    namespace: str = "default"
    kubeconfig: str | None = None  # None: the in-cluster service account
    backoff_initial: float = 0.2  # seconds before the first retry after an error
    backoff_max: float = 10.0  # retries never wait longer than this
    watch_timeout: int = 300  # server-side timeoutSeconds of one watch request; then re-watch
    request_timeout: float = 30.0  # one list request (connect and read)

    def check(self) -> str | None:
        """A message about the first invalid setting, or None."""
        if not self.pool_name:
            return "--pool-name must not be empty"
        if not self.namespace:
            return "--pool-namespace must not be empty"
        if not 0 < self.backoff_initial <= self.backoff_max:
            return "backoff must satisfy 0 < initial <= max"
        if self.watch_timeout < 1 or self.request_timeout <= 0:
            return "watch and request timeouts must be positive"
        return None


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
