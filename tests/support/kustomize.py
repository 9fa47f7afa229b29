"""A small Python stand-in for `kubectl kustomize`, for machines without kubectl.

It implements only what deploy/ uses, the way kustomize v5 does it, and refuses anything else
(so a new feature in deploy/ fails here loudly instead of being skipped):
- `resources`: YAML files (several documents each) and directories with their own kustomization;
- `configMapGenerator` (`files`, `literals`) with kustomize's content-hash name suffix, and the
  references to the generated name in pod specs (volumes, env, envFrom) rewritten;
- `namespace`: every object but the cluster-scoped built-in kinds, Namespace objects renamed, and
  RoleBinding subjects that name one of the build's ServiceAccounts moved along with it;
- `images` (`newName`, `newTag`, `digest`), `replicas`;
- `patches` with a `target` and a JSON 6902 patch (add, replace, remove).
When kubectl is present, tests/unit/test_deploy.py checks that both give the same objects.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = frozenset(
    {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "images", "replicas", "patches"}
)
# The cluster-scoped kinds kustomize knows without CRD schemas (it namespaces everything else).
CLUSTER_SCOPED = frozenset(
    {
        "APIService",
        "CertificateSigningRequest",
        "ClusterRole",
        "ClusterRoleBinding",
        "ComponentStatus",
        "CSIDriver",
        "CSINode",
        "CustomResourceDefinition",
        "IngressClass",
        "MutatingWebhookConfiguration",
        "Namespace",
        "Node",
        "PersistentVolume",
        "PodSecurityPolicy",
        "PriorityClass",
        "RuntimeClass",
        "StorageClass",
        "TokenReview",
        "SelfSubjectAccessReview",
        "SelfSubjectRulesReview",
        "SubjectAccessReview",
        "ValidatingWebhookConfiguration",
        "VolumeAttachment",
    }
)
SCALABLE = frozenset({"Deployment", "ReplicaSet", "StatefulSet", "ReplicationController"})
POD_TEMPLATE_KINDS = frozenset({"Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job"})


class KustomizeError(Exception):
    """The kustomization uses something this stand-in does not implement, or is malformed."""


def build(directory: str | Path) -> list[Obj]:
    """The objects `kubectl kustomize DIRECTORY` would print (order aside)."""
    root = Path(directory)
    kfile = next((root / n for n in KUSTOMIZATION_FILES if (root / n).is_file()), None)
    if kfile is None:
        raise KustomizeError(f"{root}: no kustomization.yaml")
    spec = yaml.safe_load(kfile.read_text()) or {}
    if not isinstance(spec, dict):
        raise KustomizeError(f"{kfile}: expected a mapping")
    unsupported = sorted(set(spec) - SUPPORTED_KEYS)
    if unsupported:
        raise KustomizeError(f"{kfile}: unsupported kustomization field(s) {unsupported}")
    objects: list[Obj] = []
    for entry in spec.get("resources") or []:
        path = root / entry
        if path.is_dir():
            objects += build(path)
        elif path.is_file():
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        else:
            raise KustomizeError(f"{kfile}: resource {entry!r} does not exist")
    renamed: dict[str, str] = {}
    for gen in spec.get("configMapGenerator") or []:
        cm = _config_map(root, kfile, gen)
        renamed[gen["name"]] = cm["metadata"]["name"]
        objects.append(cm)
    for patch in spec.get("patches") or []:
        _patch(root, kfile, patch, objects)
    if spec.get("namespace"):
        _set_namespace(objects, spec["namespace"])
    for entry in spec.get("replicas") or []:
        _replicas(kfile, entry, objects)
    for entry in spec.get("images") or []:
        _images(entry, objects)
    for obj in objects:
        _rename_config_map_refs(obj, renamed)
    return objects


def config_map_hash(data: dict[str, str]) -> str:
    """kustomize's name suffix for a generated ConfigMap.

    sha256 of Go's JSON of {"data", "kind", "name"}, first 10 hex digits with 0 1 3 a e mapped to
    g h k m t. kustomize v5 looks the name up as a single path element ("metadata/name"), finds
    nothing and hashes an empty name; matched against kubectl kustomize (tests/unit/test_deploy.py).
    """
    doc = {"data": dict(sorted(data.items())), "kind": "ConfigMap", "name": ""}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for raw in ("<", ">", "&", "\u2028", "\u2029"):  # Go's json.Marshal escapes these
        text = text.replace(raw, f"\\u{ord(raw):04x}")
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _config_map(root: Path, kfile: Path, gen: Obj) -> Obj:
    unknown = sorted(set(gen) - {"name", "files", "literals"})
    if unknown or "name" not in gen:
        raise KustomizeError(f"{kfile}: configMapGenerator entry needs `name`; unsupported {unknown}")
    data: dict[str, str] = {}
    for entry in gen.get("files") or []:
        key, sep, rel = str(entry).partition("=")
        key, rel = (key, rel) if sep else (Path(key).name, key)
        path = root / rel
        if not path.is_file():
            raise KustomizeError(f"{kfile}: configMapGenerator {gen['name']}: no file {rel!r}")
        data[key] = path.read_text()
    for entry in gen.get("literals") or []:
        key, sep, value = str(entry).partition("=")
        if not sep:
            raise KustomizeError(f"{kfile}: literal {entry!r} is not KEY=VALUE")
        data[key] = value
    name = f"{gen['name']}-{config_map_hash(data)}"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


def _matches(obj: Obj, target: Obj) -> bool:
    unknown = sorted(set(target) - {"kind", "name", "namespace", "group", "version"})
    if unknown:
        raise KustomizeError(f"patch target fields {unknown} are not supported")
    group, _, version = obj.get("apiVersion", "").rpartition("/")
    meta = obj.get("metadata", {})
    return all(
        (want is None or want == have)
        for want, have in (
            (target.get("kind"), obj.get("kind")),
            (target.get("name"), meta.get("name")),
            (target.get("namespace"), meta.get("namespace")),
            (target.get("group"), group),
            (target.get("version"), version),
        )
    )


def _patch(root: Path, kfile: Path, entry: Obj, objects: list[Obj]) -> None:
    if set(entry) - {"target", "patch", "path"} or "target" not in entry:
        raise KustomizeError(f"{kfile}: patches need a `target` and a `patch` or `path`; got {sorted(entry)}")
    text = entry["patch"] if "patch" in entry else (root / entry["path"]).read_text()
    ops = yaml.safe_load(text)
    if not isinstance(ops, list):
        raise KustomizeError(f"{kfile}: only JSON 6902 patches (a list of operations) are supported")
    hits = [o for o in objects if _matches(o, entry["target"])]
    if not hits:
        raise KustomizeError(f"{kfile}: patch target {entry['target']} matches no object")
    for obj in hits:
        for op in ops:
            _apply_op(kfile, obj, op)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _apply_op(kfile: Path, obj: Obj, op: Obj) -> None:
    kind = op.get("op")
    if kind not in ("add", "replace", "remove"):
        raise KustomizeError(f"{kfile}: JSON patch op {kind!r} is not supported")
    *parents, last = _pointer(op["path"])
    node: Any = obj
    for part in parents:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError):
            raise KustomizeError(f"{kfile}: JSON patch path {op['path']!r} does not exist") from None
    value = copy.deepcopy(op.get("value"))
    if isinstance(node, list):
        if last == "-" and kind == "add":
            node.append(value)
            return
        index = int(last)
        if kind == "add":
            node.insert(index, value)
        elif index >= len(node):
            raise KustomizeError(f"{kfile}: JSON patch path {op['path']!r} does not exist")
        elif kind == "replace":
            node[index] = value
        else:
            del node[index]
        return
    if kind != "add" and last not in node:
        raise KustomizeError(f"{kfile}: JSON patch path {op['path']!r} does not exist")
    if kind == "remove":
        del node[last]
    else:
        node[last] = value


def _set_namespace(objects: list[Obj], namespace: str) -> None:
    accounts = {
        (o["metadata"]["name"], o["metadata"].get("namespace", ""))
        for o in objects
        if o.get("kind") == "ServiceAccount"
    }
    for obj in objects:
        meta = obj.setdefault("metadata", {})
        if obj.get("kind") == "Namespace":
            meta["name"] = namespace
        if obj.get("kind") not in CLUSTER_SCOPED:
            meta["namespace"] = namespace
        if obj.get("kind") in ("RoleBinding", "ClusterRoleBinding"):
            for subject in obj.get("subjects") or []:
                key = (subject.get("name"), subject.get("namespace", ""))
                if subject.get("kind") == "ServiceAccount" and key in accounts:
                    subject["namespace"] = namespace


def _replicas(kfile: Path, entry: Obj, objects: list[Obj]) -> None:
    name = entry.get("name")
    hits = [o for o in objects if o.get("kind") in SCALABLE and o["metadata"].get("name") == name]
    if not hits:
        raise KustomizeError(f"{kfile}: replicas: no workload named {entry.get('name')!r}")
    for obj in hits:
        obj.setdefault("spec", {})["replicas"] = entry["count"]


def _pod_spec(obj: Obj) -> Obj | None:
    if obj.get("kind") in POD_TEMPLATE_KINDS:
        spec: Obj | None = obj.get("spec", {}).get("template", {}).get("spec")
        return spec
    if obj.get("kind") == "Pod":
        pod: Obj | None = obj.get("spec")
        return pod
    return None


def _containers(spec: Obj) -> list[Obj]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def _split_image(image: str) -> tuple[str, str, str]:
    """(name, ":tag" or "", "@digest" or "")."""
    rest, at, digest = image.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        return rest[:colon], rest[colon:], at + digest
    return rest, "", at + digest


def _images(entry: Obj, objects: list[Obj]) -> None:
    unknown = sorted(set(entry) - {"name", "newName", "newTag", "digest"})
    if unknown:
        raise KustomizeError(f"images: unsupported field(s) {unknown}")
    for obj in objects:
        spec = _pod_spec(obj)
        for container in _containers(spec) if spec else []:
            name, tag, digest = _split_image(container.get("image", ""))
            if name != entry["name"]:
                continue
            if "digest" in entry:
                tag, digest = "", "@" + entry["digest"]
            elif "newTag" in entry:
                tag, digest = ":" + str(entry["newTag"]), ""
            container["image"] = entry.get("newName", name) + tag + digest


def _rename_config_map_refs(obj: Obj, renamed: dict[str, str]) -> None:
    spec = _pod_spec(obj)
    if not spec or not renamed:
        return

    def fix(holder: Obj | None) -> None:
        if holder and holder.get("name") in renamed:
            holder["name"] = renamed[holder["name"]]

    for volume in spec.get("volumes") or []:
        fix(volume.get("configMap"))
        for source in (volume.get("projected") or {}).get("sources") or []:
            fix(source.get("configMap"))
    for container in _containers(spec):
        for env in container.get("env") or []:
            fix((env.get("valueFrom") or {}).get("configMapKeyRef"))
        for env_from in container.get("envFrom") or []:
            fix(env_from.get("configMapRef"))
