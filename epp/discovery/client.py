"""The Kubernetes API as discovery uses it: kubeconfig or in-cluster credentials, and raw list and
watch requests (kubernetes-asyncio builds, authenticates and sends them; the JSON is read here).

`KubeApi.pods`, `pool` and `rewrites` name what is listed (a `Request`); `list_items` and
`watch_events` send it. Objects stay plain JSON mappings (no model classes). A list gives `(items,
resourceVersion)`; a watch yields `(type, object)` per newline-delimited event. `410 Gone` (as the
HTTP status or as an `ERROR` event carrying a `Status` of code 410) raises `Gone`; other statuses
raise `ApiError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, cast

import aiohttp
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api, CustomObjectsApi
from kubernetes_asyncio.config import load_incluster_config, load_kube_config
from kubernetes_asyncio.config.config_exception import ConfigException

from epp.discovery.pool import PLURAL
from epp.discovery.settings import REWRITE_PLURAL, REWRITE_VERSION, DiscoverySettings

EVENT_TYPES = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"})
MAX_EVENT_BYTES = 16 * 1024 * 1024  # one watch line; etcd's own limit is ~1.5 MiB per object

Event = tuple[str, Mapping[str, Any]]
Request = Callable[..., Awaitable[Any]]  # a kubernetes-asyncio list call (`list_items`, `watch_events`)


class DiscoveryConfigError(ValueError):
    """No usable credentials for the API server (bad kubeconfig, not in a cluster)."""


class ApiError(Exception):
    """The API server answered with an error status (0: the answer was not what the API sends)."""

    def __init__(self, status: int, message: str, from_event: bool = False) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.from_event = from_event  # carried by a watch `ERROR` event rather than the HTTP status


class Gone(ApiError):
    """410: the resourceVersion is too old (compacted); list again."""


async def connect(settings: DiscoverySettings) -> ApiClient:
    """An API client from `settings.kubeconfig`, else the pod's service account."""
    config = Configuration()
    path = settings.kubeconfig
    if path is not None:
        first = path.split(os.pathsep)[0]
        if not os.path.isfile(first):
            raise DiscoveryConfigError(f"kubeconfig {first!r}: no such file")
        try:
            await load_kube_config(config_file=path, client_configuration=config, persist_config=False)
        except Exception as err:  # ConfigException, YAML errors, missing keys: all mean "unusable"
            raise DiscoveryConfigError(f"kubeconfig {path!r} is not usable: {err}") from None
    else:
        try:
            load_incluster_config(client_configuration=config)  # type: ignore[no-untyped-call]
        except ConfigException as err:
            raise DiscoveryConfigError(
                f"no --kubeconfig or KUBECONFIG, and no in-cluster service account ({err})"
            ) from None
    return ApiClient(configuration=config)


class KubeApi:
    """Lists and watches of one namespace's Pods, InferencePools (of `settings.pool_group`) and
    InferenceModelRewrites (of `settings.rewrite_group`)."""

    def __init__(self, client: ApiClient, settings: DiscoverySettings) -> None:
        self.client = client
        self.namespace = settings.namespace
        self.pool_group = settings.pool_group
        self.pool_version = settings.pool_version
        self.rewrite_group = settings.rewrite_group
        self.core = CoreV1Api(client)
        self.custom = CustomObjectsApi(client)
        self._list_timeout = aiohttp.ClientTimeout(total=settings.request_timeout)
        self._watch_seconds = settings.watch_timeout
        self._watch_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.request_timeout, sock_read=settings.watch_timeout + 30.0
        )

    async def close(self) -> None:
        await self.client.close()

    # -- what is listed and watched ------------------------------------------------------
    def pods(self, label_selector: str) -> Request:
        """The namespace's Pods `label_selector` matches."""
        return lambda **kw: self.core.list_namespaced_pod(self.namespace, label_selector=label_selector, **kw)

    def pool(self, name: str) -> Request:
        """The namespace's InferencePool `name` (of the pool group), by field selector."""
        return lambda **kw: self.custom.list_namespaced_custom_object(
            self.pool_group,
            self.pool_version,
            self.namespace,
            PLURAL,
            field_selector=f"metadata.name={name}",
            **kw,
        )

    def rewrites(self) -> Request:
        """The namespace's InferenceModelRewrites (of the rewrite group)."""
        return lambda **kw: self.custom.list_namespaced_custom_object(
            self.rewrite_group, REWRITE_VERSION, self.namespace, REWRITE_PLURAL, **kw
        )

    # -- raw requests ----------------------------------------------------------------------
    async def _open(self, call: Request, **kwargs: Any) -> aiohttp.ClientResponse:
        resp = cast(aiohttp.ClientResponse, await call(_preload_content=False, **kwargs))
        if resp.status != 200:
            try:
                body = await resp.content.read(64 * 1024)
            finally:
                resp.close()
            raise status_error(resp.status, body)
        return resp

    async def list_items(self, call: Request) -> tuple[list[Any], str]:
        """`(items, resourceVersion)` of one list."""
        resp = await self._open(call, _request_timeout=self._list_timeout)
        try:
            data = json.loads(await resp.read())
        except ValueError as err:
            raise ApiError(0, f"list response is not JSON: {err}") from None
        finally:
            resp.release()
        if not isinstance(data, dict) or not isinstance(data.get("items"), list):
            raise ApiError(0, "list response has no items")
        rv = resource_version(data)
        if rv is None:
            raise ApiError(0, "list response has no metadata.resourceVersion")
        return data["items"], rv

    async def watch_events(self, call: Request, resource_version: str) -> AsyncGenerator[Event, None]:
        """`(type, object)` per event of one watch from `resource_version`, with bookmarks, until the
        server ends it."""
        resp = await self._open(
            call,
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._watch_seconds,
            _request_timeout=self._watch_timeout,
        )
        try:
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                buf += chunk
                start = 0
                while (end := buf.find(b"\n", start)) >= 0:
                    line = bytes(buf[start:end])
                    start = end + 1
                    if line.strip():
                        yield parse_event(line)
                del buf[:start]
                if len(buf) > MAX_EVENT_BYTES:
                    raise ApiError(0, f"watch event larger than {MAX_EVENT_BYTES} bytes")
            if bytes(buf).strip():
                yield parse_event(bytes(buf))
        finally:
            resp.close()


def status_error(status: int, body: bytes) -> ApiError:
    """The error for a non-200 answer, with the `Status` object's message when there is one."""
    message = body[:200].decode("utf-8", "replace").strip() or "no body"
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("message"), str):
        message = obj["message"]
    return Gone(status, message) if status == 410 else ApiError(status, message)


def parse_event(line: bytes) -> Event:
    """One watch line -> (type, object); an ERROR event raises Gone (code 410) or ApiError."""
    try:
        event = json.loads(line)
    except ValueError as err:
        raise ApiError(0, f"watch event is not JSON: {err}") from None
    if not isinstance(event, dict):
        raise ApiError(0, "watch event is not an object")
    kind, obj = event.get("type"), event.get("object")
    if kind not in EVENT_TYPES or not isinstance(obj, dict):
        raise ApiError(0, f"watch event with type {kind!r} and no object")
    if kind == "ERROR":
        code = obj.get("code")
        text = obj.get("message")
        message = text if isinstance(text, str) else "watch error"
        status = code if isinstance(code, int) and not isinstance(code, bool) else 0
        raise Gone(status, message, True) if status == 410 else ApiError(status, message, True)
    return kind, obj


def resource_version(obj: Mapping[str, Any]) -> str | None:
    meta = obj.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return rv if isinstance(rv, str) and rv else None
