"""A fake Kubernetes API server for tests: the real list/watch JSON for Pods, InferencePools and
InferenceModelRewrites (their objects and the helpers that change them: `kube_objects.py`).

Serves `/api/v1/namespaces/{ns}/pods[/{name}]`,
`/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools[/{name}]` and the older
`/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferencepools[/{name}]` (a separate
resource with its own objects, as two CRDs are) over plain HTTP on loopback, as the API server does:
- a list answers `{"kind": "PodList", "metadata": {"resourceVersion": "N"}, "items": [...]}`, filtered
  by `labelSelector` (`k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`) and
  `fieldSelector` (`metadata.name`,
  `metadata.namespace`);
- `watch=true&resourceVersion=N` streams newline-delimited `{"type": ..., "object": ...}`: the changes
  after N, then live ones; an object that stops (starts) matching the selector arrives as DELETED
  (ADDED); `allowWatchBookmarks=true` lets `bookmark()` send BOOKMARKs; `timeoutSeconds` ends the
  stream; no (or "0") resourceVersion starts with ADDED events for what exists;
- after `compact()`, a watch from an older resourceVersion gets 410 Gone, as an `ERROR` event with a
  `Status` (`gone_as="event"`, what current API servers send) or as the HTTP status (`"status"`);
- a missing object is 404; `crd_installed=False` (`alpha_crd_installed=False`) makes the whole v1
  (v1alpha2) inferencepools resource 404;
  `fail_next(status)` answers the next requests with an error;
- deleting an object that has `metadata.finalizers` only marks it (`deletionTimestamp`,
  `deletionGracePeriodSeconds: 0`, a MODIFIED event); it goes (DELETED) when an update empties its
  finalizers, as the API server does.

InferenceModelRewrites are served at
`/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferencemodelrewrites[/{name}]` (and the
same schema under `llm-d.ai/v1alpha2`, llm-d's group, as another resource);
`rewrite_crd_installed=False` (`llmd_rewrite_crd_installed=False`) makes that resource 404.
`hold_lists[resource]` (an `asyncio.Event`) holds that resource's list requests until it is set.

Tests change the world with `add_pod`/`update_pod`/`delete_pod`, `add_pool`/`put_pool`/
`update_pool`/`delete_pool` (v1), `add_alpha_pool`/`update_alpha_pool`/`delete_alpha_pool`
(v1alpha2: `spec.selector` a plain label map, one `spec.targetPortNumber`) and
`add_rewrite`/`update_rewrite`/`put_rewrite`/`delete_rewrite` (InferenceModelRewrite); each bumps the
resourceVersion and notifies the watchers.
`write_kubeconfig()` writes a kubeconfig that points kubernetes-asyncio here (no TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from epp.testing.kube_objects import (
    ALPHA_POOL_GROUP,
    ALPHA_POOL_VERSION,
    ALPHA_POOLS,
    KINDS,
    LLMD_REWRITE_GROUP,
    LLMD_REWRITES,
    PODS,
    POOL_GROUP,
    POOL_VERSION,
    POOLS,
    REWRITE_GROUP,
    REWRITE_VERSION,
    REWRITES,
    KubeObjects,
    Obj,
)

__all__ = ["ALPHA_POOLS", "LLMD_REWRITES", "PODS", "POOLS", "REWRITES", "FakeKubeApi", "status_object"]

_COLLECTIONS = {  # resource -> its collection path, with {ns}
    PODS: "/api/v1/namespaces/{ns}/pods",
    POOLS: f"/apis/{POOL_GROUP}/{POOL_VERSION}/namespaces/{{ns}}/inferencepools",
    ALPHA_POOLS: f"/apis/{ALPHA_POOL_GROUP}/{ALPHA_POOL_VERSION}/namespaces/{{ns}}/inferencepools",
    REWRITES: f"/apis/{REWRITE_GROUP}/{REWRITE_VERSION}/namespaces/{{ns}}/inferencemodelrewrites",
    LLMD_REWRITES: f"/apis/{LLMD_REWRITE_GROUP}/{REWRITE_VERSION}/namespaces/{{ns}}/inferencemodelrewrites",
}

Matcher = Callable[[Mapping[str, Any]], bool]


def status_object(code: int, reason: str, message: str) -> Obj:
    """A `metav1.Status` as the API server sends it with an error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _reason(code: int) -> str:
    return {
        400: "BadRequest",
        401: "Unauthorized",
        403: "Forbidden",
        404: "NotFound",
        410: "Expired",
        500: "InternalError",
        503: "ServiceUnavailable",
    }.get(code, "Unknown")


def _split_requirements(text: str) -> list[str]:
    """Split on the commas outside parentheses (`a in (x,y),b` is two requirements)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(text: str) -> Matcher:
    """`k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`, comma-separated (all must
    hold), as the API server reads them. ValueError on other forms."""
    reqs: list[tuple[str, str, frozenset[str]]] = []  # (op, key, values)
    for raw in _split_requirements(text):
        words = raw.split(None, 1)
        if len(words) == 2 and words[1].split("(", 1)[0].strip() in ("in", "notin"):
            op, _, rest = words[1].partition("(")
            if not rest.endswith(")"):
                raise ValueError(f"unsupported label selector {raw!r}")
            values = frozenset(v.strip() for v in rest[:-1].split(","))
            reqs.append((op.strip(), words[0], values))
        elif "!=" in raw:
            k, v = raw.split("!=", 1)
            reqs.append(("!=", k.strip(), frozenset([v.strip()])))
        elif "=" in raw:
            k, v = raw.replace("==", "=").split("=", 1)
            reqs.append(("in", k.strip(), frozenset([v.strip()])))
        elif " " in raw or "(" in raw:
            raise ValueError(f"unsupported label selector {raw!r}")
        elif raw.startswith("!"):
            reqs.append(("!", raw[1:].strip(), frozenset()))
        else:
            reqs.append(("exists", raw, frozenset()))

    def match(labels: Mapping[str, Any]) -> bool:
        for op, k, values in reqs:
            ok = {
                "in": k in labels and labels[k] in values,
                "!=": labels.get(k) not in values,
                "notin": labels.get(k) not in values,
                "!": k not in labels,
                "exists": k in labels,
            }[op]
            if not ok:
                return False
        return True

    return match


def parse_field_selector(text: str) -> Matcher:
    """`metadata.name=x`, `metadata.namespace=x` (comma-separated); matched against `metadata`."""
    reqs: list[tuple[str, str]] = []
    for raw in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = raw.replace("==", "=").partition("=")
        if not sep or key not in ("metadata.name", "metadata.namespace"):
            raise ValueError(f"field label not supported: {key}")
        reqs.append((key.split(".", 1)[1], value))

    def match(meta: Mapping[str, Any]) -> bool:
        return all(meta.get(f) == v for f, v in reqs)

    return match


@dataclass
class _Change:
    rv: int
    resource: str
    namespace: str
    old: Obj | None
    new: Obj | None  # None: deleted (then `old` carries the final state)


@dataclass(eq=False)
class _Watch:
    resource: str
    namespace: str
    labels: Matcher
    fields: Matcher
    bookmarks: bool
    queue: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        return bool(self.labels(meta.get("labels") or {})) and bool(self.fields(meta))

    def offer(self, change: _Change) -> None:
        if change.resource != self.resource or change.namespace != self.namespace:
            return
        was, now = self.matches(change.old), self.matches(change.new)
        if change.new is None:
            if was:
                self.send("DELETED", change.old)
        elif was and now:
            self.send("MODIFIED", change.new)
        elif now:
            self.send("ADDED", change.new)
        elif was:
            self.send("DELETED", change.new)  # no longer selected

    def send(self, kind: str, obj: Obj | None) -> None:
        self.queue.put_nowait(json.dumps({"type": kind, "object": obj}).encode() + b"\n")


class FakeKubeApi(KubeObjects):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, gone_as: str = "event") -> None:
        if gone_as not in ("event", "status"):
            raise ValueError("gone_as is 'event' or 'status'")
        self.host = host
        self.port = port
        self.gone_as = gone_as
        self.crd_installed = True  # inferencepools.inference.networking.k8s.io (v1) is served
        self.alpha_crd_installed = True  # inferencepools.inference.networking.x-k8s.io (v1alpha2) is served
        self.rewrite_crd_installed = True  # inferencemodelrewrites.inference.networking.x-k8s.io is served
        self.llmd_rewrite_crd_installed = True  # inferencemodelrewrites.llm-d.ai is served
        self.rv = 100
        self.compacted = 0  # a watch from a resourceVersion below this gets 410
        self.objects: dict[str, dict[tuple[str, str], Obj]] = {r: {} for r in KINDS}
        self.history: list[_Change] = []
        self.requests: list[tuple[str, dict[str, str]]] = []  # (path, query) of every request
        self._failures: list[int] = []
        self.hold_lists: dict[str, asyncio.Event] = {}  # resource -> lists wait until it is set
        self._watches: set[_Watch] = set()
        self._uids = itertools.count(1)
        self._runner: web.AppRunner | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> FakeKubeApi:
        """Serve (again, on the same port after `stop()`)."""
        app = web.Application()
        for resource, base in _COLLECTIONS.items():
            app.router.add_get(base, self._collection(resource))
            app.router.add_get(base + "/{name}", self._single(resource))
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = int(runner.addresses[0][1])
        self._runner = runner
        return self

    async def stop(self) -> None:
        """Stop serving (connections refused) and end every open watch."""
        self.end_watches()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> FakeKubeApi:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def write_kubeconfig(self, path: str | pathlib.Path, namespace: str = "default") -> str:
        text = f"""apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster:
    server: {self.url}
users:
- name: fake
  user:
    token: fake-token
contexts:
- name: fake
  context:
    cluster: fake
    user: fake
    namespace: {namespace}
current-context: fake
"""
        pathlib.Path(path).write_text(text)
        return str(path)

    # -- knobs -------------------------------------------------------------------------------
    def compact(self) -> int:
        """Forget history up to now: a watch from an older resourceVersion gets 410 Gone."""
        self.compacted = self.rv
        self.history.clear()
        return self.rv

    def bookmark(self) -> int:
        """A BOOKMARK with the current resourceVersion to every watch that asked for bookmarks."""
        for w in self._watches:
            if w.bookmarks:
                kind, api_version = KINDS[w.resource]
                w.send(
                    "BOOKMARK",
                    {"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": str(self.rv)}},
                )
        return self.rv

    def end_watches(self) -> None:
        """End every open watch stream cleanly, as the server does at its timeout."""
        for w in self._watches:
            w.queue.put_nowait(None)

    def fail_next(self, status: int, count: int = 1) -> None:
        """Answer the next `count` requests with `status` and a Status body."""
        self._failures.extend([status] * count)

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def watch_requests(self, resource: str) -> list[dict[str, str]]:
        """Queries of the watch requests made for a resource (PODS, POOLS, REWRITES, ...), in order."""
        return [q for p, q in self.requests if _is_collection(resource, p) and _true(q.get("watch"))]

    def list_requests(self, resource: str) -> list[dict[str, str]]:
        """Queries of the list (not watch) requests made for a resource (PODS, POOLS, ...), in order."""
        return [q for p, q in self.requests if _is_collection(resource, p) and not _true(q.get("watch"))]

    # -- the store ---------------------------------------------------------------------------
    def get(self, resource: str, namespace: str, name: str) -> Obj:
        """A copy of the stored object (KeyError if there is none)."""
        return copy.deepcopy(self.objects[resource][(namespace, name)])

    def put(self, resource: str, obj: Obj) -> Obj:
        """Create or replace an object; bumps the resourceVersion and notifies the watchers. An update
        that empties the finalizers of an object marked for deletion deletes it (a DELETED event, as
        the API server sends; the object's final state is returned)."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        key = (meta.get("namespace", "default"), meta["name"])
        meta["namespace"] = key[0]
        old = self.objects[resource].get(key)
        if (
            old is not None
            and old["metadata"].get("finalizers")
            and not meta.get("finalizers")
            and meta.get("deletionTimestamp") is not None
        ):
            self.objects[resource][key] = obj
            self.delete(resource, key[0], key[1])
            return copy.deepcopy(obj)
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        self.objects[resource][key] = obj
        self._record(_Change(self.rv, resource, key[0], old, copy.deepcopy(obj)))
        return copy.deepcopy(obj)

    def delete(self, resource: str, namespace: str, name: str) -> None:
        """Remove an object (DELETED); one with finalizers is only marked for deletion (MODIFIED)."""
        current = self.objects[resource][(namespace, name)]
        meta = current["metadata"]
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp") is None:
                marked = copy.deepcopy(current)
                marked["metadata"]["deletionTimestamp"] = "2025-01-01T00:20:00Z"
                marked["metadata"]["deletionGracePeriodSeconds"] = 0
                if "generation" in marked["metadata"]:
                    marked["metadata"]["generation"] = int(marked["metadata"]["generation"]) + 1
                self.put(resource, marked)
            return
        old = self.objects[resource].pop((namespace, name))
        self.rv += 1
        old["metadata"]["resourceVersion"] = str(self.rv)
        self._record(_Change(self.rv, resource, namespace, old, None))

    def _record(self, change: _Change) -> None:
        self.history.append(change)
        for w in self._watches:
            w.offer(change)

    # -- HTTP --------------------------------------------------------------------------------
    def _collection(self, resource: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._serve_collection(resource, request)

        return handler

    def _single(self, resource: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.StreamResponse:
            early = self._early_answer(resource, request)
            if early is not None:
                return early
            ns, name = request.match_info["ns"], request.match_info["name"]
            obj = self.objects[resource].get((ns, name))
            if obj is None:
                return _error(404, f'{resource} "{name}" not found')
            return web.json_response(obj)

        return handler

    def _early_answer(self, resource: str, request: web.Request) -> web.Response | None:
        self.requests.append((request.path, dict(request.query)))
        if self._failures:
            return _error(self._failures.pop(0), "injected failure")
        if (
            (resource == POOLS and not self.crd_installed)
            or (resource == ALPHA_POOLS and not self.alpha_crd_installed)
            or (resource == REWRITES and not self.rewrite_crd_installed)
            or (resource == LLMD_REWRITES and not self.llmd_rewrite_crd_installed)
        ):
            return _error(404, "the server could not find the requested resource")
        return None

    async def _serve_collection(self, resource: str, request: web.Request) -> web.StreamResponse:
        early = self._early_answer(resource, request)
        if early is not None:
            return early
        q = request.query
        try:
            labels = parse_label_selector(q.get("labelSelector", ""))
            fields = parse_field_selector(q.get("fieldSelector", ""))
        except ValueError as err:
            return _error(400, str(err))
        watch = _Watch(
            resource, request.match_info["ns"], labels, fields, _true(q.get("allowWatchBookmarks"))
        )
        if not _true(q.get("watch")):
            hold = self.hold_lists.get(resource)
            if hold is not None:
                await hold.wait()
            kind, api_version = KINDS[resource]
            items = [
                o
                for (ns, _), o in sorted(self.objects[resource].items())
                if ns == watch.namespace and watch.matches(o)
            ]
            return web.json_response(
                {
                    "kind": f"{kind}List",
                    "apiVersion": api_version,
                    "metadata": {"resourceVersion": str(self.rv)},
                    "items": items,
                }
            )
        rv_text = q.get("resourceVersion", "")
        try:
            since = int(rv_text) if rv_text else 0
        except ValueError:
            return _error(400, f"invalid resourceVersion {rv_text!r}")
        gone = since and since < self.compacted
        if gone and self.gone_as == "status":
            return _error(410, f"too old resource version: {since} ({self.compacted})")
        timeout = float(q.get("timeoutSeconds", "1800"))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if gone:
            msg = f"too old resource version: {since} ({self.compacted})"
            await resp.write(
                json.dumps({"type": "ERROR", "object": status_object(410, "Expired", msg)}).encode()
            )
            await resp.write(b"\n")
            return resp
        if since == 0:
            for (ns, _), o in sorted(self.objects[resource].items()):
                if ns == watch.namespace and watch.matches(o):
                    watch.send("ADDED", o)
        else:
            for change in self.history:
                if change.rv > since:
                    watch.offer(change)
        self._watches.add(watch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    line = await asyncio.wait_for(watch.queue.get(), remaining)
                except TimeoutError:
                    break
                if line is None:
                    break
                await resp.write(line)
        except ConnectionResetError:
            pass
        finally:
            self._watches.discard(watch)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp


def _is_collection(resource: str, path: str) -> bool:
    """`path` is the collection of `resource` in some namespace."""
    head, _, tail = _COLLECTIONS[resource].partition("{ns}")
    return path.startswith(head) and path.endswith(tail) and "/" not in path[len(head) : -len(tail)]


def _true(value: str | None) -> bool:
    return value in ("true", "1", "True")


def _error(code: int, message: str) -> web.Response:
    return web.json_response(status_object(code, _reason(code), message), status=code)
