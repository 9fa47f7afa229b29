"""An `InferencePool` plus the Pods of its namespace -> the endpoint set (pure).

Objects are the API server's JSON as plain mappings (core `v1` `Pod`, and the `InferencePool` of
`inference.networking.k8s.io/v1` or of the older `inference.networking.x-k8s.io/v1alpha2`). Both
reduce to one `PoolSpec` (a label selector -- for a pool, equality on every label of its map -- and
target ports; selector mode builds one from `--endpoint-selector`), as the
reference EPP reduces them (`InferencePoolToEndPointsPool` / `AlphaInferencePoolToEndPointsPool`):
v1 gives `spec.selector.matchLabels` and `spec.targetPorts[].number`; v1alpha2 gives `spec.selector`
(a plain label map) and its one `spec.targetPortNumber`. A pool with `metadata.deletionTimestamp` is
being deleted and counts as absent. A pod is a candidate when it matches the selector, has the
`Ready` condition `"True"`, has a `status.podIP` and no `metadata.deletionTimestamp`; each candidate
gives one endpoint `<podIP>:<port>` per target port (IPv6 as `[addr]:port`), except that a pod
annotated with its active ports (`ACTIVE_PORTS_ANNOTATIONS`, as the reference EPPs read them) gives
only those of the target ports.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from epp.config import parse_endpoint_address
from epp.discovery.selector import EQ, LabelSelector
from epp.discovery.settings import GROUP_V1, GROUP_V1ALPHA2, POOL_VERSIONS

GROUP = GROUP_V1  # the default API group (`--pool-group`)
VERSION = POOL_VERSIONS[GROUP_V1]
PLURAL = "inferencepools"
MAX_TARGET_PORTS = 8
# The ports a pod serves, when not all the pool's target ports: comma-separated numbers. llm-d's key
# wins over the Inference Extension's (llm-d-router reads it first, the other as a fallback).
ACTIVE_PORTS_ANNOTATIONS = ("llm-d.ai/active-ports", "inference.networking.k8s.io/active-ports")
_LEADING_INT = re.compile(r"[+-]?[0-9]+")


class PoolError(ValueError):
    """The InferencePool object cannot be used; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    selector: LabelSelector  # the pods it matches are the pool's
    ports: tuple[int, ...]

    @property
    def labels(self) -> dict[str, str]:
        """The labels the selector requires equal (all of a pool's)."""
        return {r.key: r.values[0] for r in self.selector.requirements if r.op == EQ}

    def label_selector(self) -> str:
        """The selector as the API's `labelSelector` query parameter."""
        return str(self.selector)


def parse_pool(obj: Any, group: str = GROUP_V1) -> PoolSpec:
    """Validate an InferencePool object of `group`'s version; PoolError names the first bad field."""
    if not isinstance(obj, Mapping):
        raise PoolError(f"InferencePool: expected an object, got {type(obj).__name__}")
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    where = f"InferencePool {name!r}" if isinstance(name, str) and name else "InferencePool"
    if not isinstance(name, str) or not name:
        raise PoolError(f"{where}: metadata.name is missing")
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise PoolError(f"{where}: spec is missing")
    if group == GROUP_V1ALPHA2:
        selector, ports = _alpha_selector(spec, where), _alpha_ports(spec, where)
    elif group == GROUP_V1:
        selector, ports = _v1_selector(spec, where), _v1_ports(spec, where)
    else:
        raise PoolError(f"{where}: unknown InferencePool API group {group!r}")
    return PoolSpec(name, LabelSelector.from_labels(selector), ports)


def _labels(match: Any, field: str, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(match, Mapping) or not match:
        raise PoolError(f"{where}: {field} is missing or empty")
    pairs: list[tuple[str, str]] = []
    for key, value in match.items():
        if not isinstance(key, str) or not key or not isinstance(value, str):
            raise PoolError(f"{where}: {field}[{key!r}] must map a label to a string")
        pairs.append((key, value))
    return tuple(sorted(pairs))


def _port(number: object) -> TypeGuard[int]:
    return not isinstance(number, bool) and isinstance(number, int) and 0 < number < 65536


def _v1_selector(spec: Mapping[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    selector = spec.get("selector")
    match = selector.get("matchLabels") if isinstance(selector, Mapping) else None
    return _labels(match, "spec.selector.matchLabels", where)


def _v1_ports(spec: Mapping[str, Any], where: str) -> tuple[int, ...]:
    ports_raw = spec.get("targetPorts")
    if not isinstance(ports_raw, list) or not ports_raw:
        raise PoolError(f"{where}: spec.targetPorts is missing or empty (1 to {MAX_TARGET_PORTS} ports)")
    if len(ports_raw) > MAX_TARGET_PORTS:
        raise PoolError(f"{where}: spec.targetPorts has {len(ports_raw)} ports, at most {MAX_TARGET_PORTS}")
    ports: list[int] = []
    for i, port in enumerate(ports_raw):
        number = port.get("number") if isinstance(port, Mapping) else None
        if not _port(number):
            raise PoolError(f"{where}: spec.targetPorts[{i}].number must be a port number 1-65535")
        if number not in ports:
            ports.append(number)
    return tuple(ports)


def _alpha_selector(spec: Mapping[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    """v1alpha2: `spec.selector` is the label map itself (no `matchLabels`)."""
    return _labels(spec.get("selector"), "spec.selector", where)


def _alpha_ports(spec: Mapping[str, Any], where: str) -> tuple[int, ...]:
    """v1alpha2: one port, `spec.targetPortNumber`."""
    number = spec.get("targetPortNumber")
    if not _port(number):
        raise PoolError(f"{where}: spec.targetPortNumber must be a port number 1-65535")
    return (number,)


def being_deleted(obj: Any) -> bool:
    """The object has `metadata.deletionTimestamp`: deleted, held only by finalizers or a grace period."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    return isinstance(meta, Mapping) and meta.get("deletionTimestamp") is not None


def object_name(obj: Any) -> str | None:
    """`metadata.name` of an object, or None when it is not a usable object."""
    if not isinstance(obj, Mapping):
        return None
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) and name else None


def exclusion(pod: Mapping[str, Any], pool: PoolSpec) -> str | None:
    """Why the pod is not a candidate ("selector", "deleting", "not_ready", "no_ip", "bad_ip"), or None."""
    meta = pod.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    labels = meta.get("labels")
    labels = labels if isinstance(labels, Mapping) else {}
    if not pool.selector.matches(labels):
        return "selector"
    if being_deleted(pod):
        return "deleting"
    status = pod.get("status")
    status = status if isinstance(status, Mapping) else {}
    if not _ready(status.get("conditions")):
        return "not_ready"
    ip = status.get("podIP")
    if not isinstance(ip, str) or not ip:
        return "no_ip"
    try:
        parse_endpoint_address(f"{ip}:1")
    except ValueError:
        return "bad_ip"
    return None


def _ready(conditions: Any) -> bool:
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def active_ports(pod: Mapping[str, Any], ports: tuple[int, ...]) -> tuple[int, ...]:
    """The target ports the pod serves: all of them, unless an active-ports annotation names some.

    As the reference reads it: each comma-separated entry, trimmed, is read as a decimal number
    (leading digits, like Go's `Sscanf("%d")`) and kept when it is positive and a target port;
    an annotation with no such entry leaves none. The pool's port order is kept."""
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    if not isinstance(annotations, Mapping):
        return ports
    value = next((annotations[k] for k in ACTIVE_PORTS_ANNOTATIONS if k in annotations), None)
    if not isinstance(value, str):
        return ports
    named: set[int] = set()
    for entry in value.split(","):
        m = _LEADING_INT.match(entry.strip())
        if m is not None:
            named.add(int(m.group()))
    return tuple(p for p in ports if p in named)


def pod_endpoints(pod: Mapping[str, Any], pool: PoolSpec) -> list[str]:
    """The pod's endpoints (one per active target port), or [] when it is not a candidate."""
    if exclusion(pod, pool) is not None:
        return []
    ip = pod["status"]["podIP"]
    return [parse_endpoint_address(f"{ip}:{port}") for port in active_ports(pod, pool.ports)]


def pool_endpoints(pool: PoolSpec, pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every candidate pod's endpoints, sorted and without duplicates."""
    return sorted(pool_endpoint_names(pool, pods))


def pool_endpoint_names(pool: PoolSpec, pods: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Every candidate pod's endpoints, each with the name the reference gives it: `<pod>-rank-<i>`, where i
    is the port's place among the pool's target ports (its datastore's endpoint names, which its
    `inference_pool_per_pod_queue_size` puts in `model_server_pod`). Two pods claiming one address (a
    stale IP) keep the name of the one listed last."""
    out: dict[str, str] = {}
    for pod in pods:
        if exclusion(pod, pool) is not None:
            continue
        ip, name = pod["status"]["podIP"], object_name(pod)
        for port in active_ports(pod, pool.ports):
            out[parse_endpoint_address(f"{ip}:{port}")] = f"{name}-rank-{pool.ports.index(port)}"
    return out
