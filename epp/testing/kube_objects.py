"""The objects of the fake Kubernetes API server (`kube_api.FakeKubeApi`): Pods, InferencePools (v1 and
v1alpha2) and InferenceModelRewrites as the API server returns them, and the helpers tests change them
with (`KubeObjects`, mixed into the server: each change goes through its store, which bumps the
resourceVersion and notifies the watchers)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from typing import Any

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
ALPHA_POOL_GROUP = "inference.networking.x-k8s.io"
ALPHA_POOL_VERSION = "v1alpha2"
REWRITE_GROUP = "inference.networking.x-k8s.io"
LLMD_REWRITE_GROUP = "llm-d.ai"
REWRITE_VERSION = "v1alpha2"
PODS, POOLS = "pods", "inferencepools"
ALPHA_POOLS = f"inferencepools.{ALPHA_POOL_GROUP}"  # the v1alpha2 resource (kubectl's resource.group)
REWRITES = f"inferencemodelrewrites.{REWRITE_GROUP}"
LLMD_REWRITES = f"inferencemodelrewrites.{LLMD_REWRITE_GROUP}"
KINDS = {
    PODS: ("Pod", "v1"),
    POOLS: ("InferencePool", f"{POOL_GROUP}/{POOL_VERSION}"),
    ALPHA_POOLS: ("InferencePool", f"{ALPHA_POOL_GROUP}/{ALPHA_POOL_VERSION}"),
    REWRITES: ("InferenceModelRewrite", f"{REWRITE_GROUP}/{REWRITE_VERSION}"),
    LLMD_REWRITES: ("InferenceModelRewrite", f"{LLMD_REWRITE_GROUP}/{REWRITE_VERSION}"),
}

Obj = dict[str, Any]


class KubeObjects:
    """add / update / put / delete helpers per kind; the store (`get`, `put`, `delete`) is the server's."""

    _uids: itertools.count[int]

    def get(self, resource: str, namespace: str, name: str) -> Obj:
        raise NotImplementedError

    def put(self, resource: str, obj: Obj) -> Obj:
        raise NotImplementedError

    def delete(self, resource: str, namespace: str, name: str) -> None:
        raise NotImplementedError

    def _meta(
        self,
        kind: str,
        name: str,
        namespace: str,
        finalizers: list[str] | None = None,
        created: str = "2025-01-01T00:00:00Z",
    ) -> Obj:
        """An object's metadata as the API server fills it in (a fresh uid, generation 1)."""
        meta: Obj = {
            "name": name,
            "namespace": namespace,
            "uid": f"{kind}-uid-{next(self._uids)}",
            "generation": 1,
            "creationTimestamp": created,
        }
        if finalizers:
            meta["finalizers"] = list(finalizers)
        return meta

    # -- pods --------------------------------------------------------------------------------
    def add_pod(
        self,
        name: str,
        ip: str | None,
        labels: Mapping[str, str],
        *,
        ready: bool = True,
        namespace: str = "default",
        annotations: Mapping[str, str] | None = None,
    ) -> Obj:
        status: Obj = {
            "phase": "Running" if ip else "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        }
        if ip:
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
        obj: Obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": f"pod-uid-{next(self._uids)}",
                "labels": dict(labels),
                "creationTimestamp": "2025-01-01T00:00:00Z",
            },
            "spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai"}]},
            "status": status,
        }
        if annotations:
            obj["metadata"]["annotations"] = dict(annotations)
        return self.put(PODS, obj)

    def update_pod(
        self,
        name: str,
        *,
        namespace: str = "default",
        ready: bool | None = None,
        ip: str | None = None,
        labels: Mapping[str, str] | None = None,
        deleting: bool | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> Obj:
        """Change a pod; `annotations` replaces them all (`{}` removes them)."""
        obj = self.get(PODS, namespace, name)
        if ready is not None:
            for c in obj["status"]["conditions"]:
                if c["type"] == "Ready":
                    c["status"] = "True" if ready else "False"
        if ip is not None:
            obj["status"]["podIP"] = ip
            obj["status"]["podIPs"] = [{"ip": ip}]
        if labels is not None:
            obj["metadata"]["labels"] = dict(labels)
        if annotations is not None:
            if annotations:
                obj["metadata"]["annotations"] = dict(annotations)
            else:
                obj["metadata"].pop("annotations", None)
        if deleting is not None:
            if deleting:
                obj["metadata"]["deletionTimestamp"] = "2025-01-01T00:10:00Z"
            else:
                obj["metadata"].pop("deletionTimestamp", None)
        return self.put(PODS, obj)

    def delete_pod(self, name: str, namespace: str = "default") -> None:
        self.delete(PODS, namespace, name)

    # -- pools -------------------------------------------------------------------------------
    def add_pool(
        self,
        name: str,
        selector: Mapping[str, str],
        ports: list[int],
        *,
        namespace: str = "default",
        finalizers: list[str] | None = None,
    ) -> Obj:
        """A v1 InferencePool as the API server returns it (the CRD's defaults filled in)."""
        meta = self._meta("pool", name, namespace, finalizers)
        obj: Obj = {
            "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}",
            "kind": "InferencePool",
            "metadata": meta,
            "spec": {
                "selector": {"matchLabels": dict(selector)},
                "targetPorts": [{"number": p} for p in ports],
                "endpointPickerRef": {
                    "group": "",
                    "kind": "Service",
                    "name": f"{name}-epp",
                    "port": {"number": 9002},
                    "failureMode": "FailClose",
                },
            },
        }
        return self.put(POOLS, obj)

    def update_pool(
        self,
        name: str,
        *,
        namespace: str = "default",
        selector: Mapping[str, str] | None = None,
        ports: list[int] | None = None,
        finalizers: list[str] | None = None,
    ) -> Obj:
        """Change a pool; `finalizers=[]` removes them (which completes a pending deletion)."""
        obj = self.get(POOLS, namespace, name)
        if selector is not None:
            obj["spec"]["selector"] = {"matchLabels": dict(selector)}
        if ports is not None:
            obj["spec"]["targetPorts"] = [{"number": p} for p in ports]
        _changed(obj, finalizers, spec=selector is not None or ports is not None)
        return self.put(POOLS, obj)

    def put_pool(self, obj: Obj) -> Obj:
        """Store a pool object as given (e.g. a malformed one the CRD schema would have refused)."""
        return self.put(POOLS, obj)

    def delete_pool(self, name: str, namespace: str = "default") -> None:
        """Delete a pool (with finalizers: only mark it, as the API server does)."""
        self.delete(POOLS, namespace, name)

    # -- v1alpha2 pools (inference.networking.x-k8s.io) ---------------------------------------
    def add_alpha_pool(
        self,
        name: str,
        selector: Mapping[str, str],
        port: int,
        *,
        namespace: str = "default",
        finalizers: list[str] | None = None,
    ) -> Obj:
        """A v1alpha2 InferencePool as the API server returns it (the CRD's defaults filled in):
        `spec.selector` is the label map itself, `spec.targetPortNumber` the one port."""
        meta = self._meta("pool", name, namespace, finalizers)
        obj: Obj = {
            "apiVersion": f"{ALPHA_POOL_GROUP}/{ALPHA_POOL_VERSION}",
            "kind": "InferencePool",
            "metadata": meta,
            "spec": {
                "selector": dict(selector),
                "targetPortNumber": port,
                "extensionRef": {
                    "group": "",
                    "kind": "Service",
                    "name": f"{name}-epp",
                    "failureMode": "FailClose",
                },
            },
        }
        return self.put(ALPHA_POOLS, obj)

    def update_alpha_pool(
        self,
        name: str,
        *,
        namespace: str = "default",
        selector: Mapping[str, str] | None = None,
        port: int | None = None,
        finalizers: list[str] | None = None,
    ) -> Obj:
        """Change a v1alpha2 pool; `finalizers=[]` removes them (which completes a pending deletion)."""
        obj = self.get(ALPHA_POOLS, namespace, name)
        if selector is not None:
            obj["spec"]["selector"] = dict(selector)
        if port is not None:
            obj["spec"]["targetPortNumber"] = port
        _changed(obj, finalizers, spec=selector is not None or port is not None)
        return self.put(ALPHA_POOLS, obj)

    def delete_alpha_pool(self, name: str, namespace: str = "default") -> None:
        """Delete a v1alpha2 pool (with finalizers: only mark it, as the API server does)."""
        self.delete(ALPHA_POOLS, namespace, name)

    # -- InferenceModelRewrites -----------------------------------------------------------------
    def add_rewrite(
        self,
        name: str,
        pool: str,
        rules: list[Obj],
        *,
        namespace: str = "default",
        created: str = "2025-01-01T00:00:00Z",
        pool_group: str | None = POOL_GROUP,
        resource: str = REWRITES,
    ) -> Obj:
        """An InferenceModelRewrite as the API server returns it: `rules` as given (`spec.rules`), the
        pool referenced by name (`pool_group=None` leaves `spec.poolRef.group` out), `created` its
        `metadata.creationTimestamp` (which orders precedence). `resource`: REWRITES or LLMD_REWRITES."""
        ref: Obj = {"kind": "InferencePool", "name": pool}
        if pool_group is not None:
            ref["group"] = pool_group
        obj: Obj = {
            "apiVersion": KINDS[resource][1],
            "kind": "InferenceModelRewrite",
            "metadata": self._meta("rewrite", name, namespace, created=created),
            "spec": {"poolRef": ref, "rules": copy.deepcopy(rules)},
            "status": {
                "conditions": [
                    {
                        "type": "Accepted",
                        "status": "Unknown",
                        "reason": "Pending",
                        "message": "Waiting for controller",
                        "lastTransitionTime": "1970-01-01T00:00:00Z",
                    }
                ]
            },
        }
        return self.put(resource, obj)

    def update_rewrite(
        self,
        name: str,
        *,
        namespace: str = "default",
        rules: list[Obj] | None = None,
        pool: str | None = None,
        finalizers: list[str] | None = None,
        resource: str = REWRITES,
    ) -> Obj:
        """Change a rewrite's rules or pool; `finalizers=[]` removes them (completing a pending deletion)."""
        obj = self.get(resource, namespace, name)
        if rules is not None:
            obj["spec"]["rules"] = copy.deepcopy(rules)
        if pool is not None:
            obj["spec"]["poolRef"]["name"] = pool
        _changed(obj, finalizers, spec=rules is not None or pool is not None)
        return self.put(resource, obj)

    def put_rewrite(self, obj: Obj, resource: str = REWRITES) -> Obj:
        """Store a rewrite object as given (e.g. a malformed one the CRD schema would have refused)."""
        return self.put(resource, obj)

    def delete_rewrite(self, name: str, namespace: str = "default", resource: str = REWRITES) -> None:
        """Delete a rewrite (with finalizers: only mark it, as the API server does)."""
        self.delete(resource, namespace, name)


def _set_finalizers(obj: Obj, finalizers: list[str] | None) -> None:
    if finalizers is not None:
        if finalizers:
            obj["metadata"]["finalizers"] = list(finalizers)
        else:
            obj["metadata"].pop("finalizers", None)


def _changed(obj: Obj, finalizers: list[str] | None, *, spec: bool) -> None:
    """An update: its finalizers (`[]` removes them), and the next generation when the spec changed."""
    _set_finalizers(obj, finalizers)
    if spec:
        obj["metadata"]["generation"] = int(obj["metadata"].get("generation", 1)) + 1
