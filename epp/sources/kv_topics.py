"""Which pod a KV-event message is about: its topic and the pool's endpoints by host.

vLLM's topic is empty or `kv@<ip:port>@<model>` (also `kv@<ip>@<model>`). In central mode the topic
names the pod; in per-pod mode the socket does, and the topic only matters when it names another
endpoint: several endpoints on one IP (an InferencePool with several target ports) each subscribe
to the IP's publishers, so a topic naming another of them is that one's (skipped), while one naming
an endpoint or host of the pool elsewhere is a misconfigured publisher (`FOREIGN`: dropped and
counted, credited to neither). In central mode with `verifyPeer`, the topic must also name the host the
publisher connected from (`is_host_of`).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable
from typing import Final

OWN: Final = "own"
OTHER: Final = "other"  # another endpoint's on the same host: skipped
FOREIGN: Final = "foreign"  # an endpoint or host of the pool elsewhere: dropped, counted

TOPIC_CACHE = 1024  # parsed topics kept; misses remembered per host map


def split_host(pod: str) -> str:
    host = pod.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


def endpoint_url(pod: str, port: int) -> str:
    host = pod.rpartition(":")[0]
    return f"tcp://{host}:{port}"


def host_of(where: str) -> str:
    """The host of a topic's `<ip:port>` or `<ip>` (`[v6]:port`, bare IPv6 and names included)."""
    if where.startswith("["):
        return where[1:].partition("]")[0]
    if where.count(":") == 1:
        return where.partition(":")[0]
    return where


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text.partition("%")[0])  # (without an IPv6 zone)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@functools.lru_cache(maxsize=4096)  # (pure: asked for every message of a central socket)
def is_host_of(peer: str, pod: str) -> bool:
    """Whether a connection's peer address (ZeroMQ's `Peer-Address`: IPv4, IPv6, or IPv4-mapped IPv6 on a
    dual-stack socket) is the host of endpoint `pod` (`ip:port`, `[v6]:port`). A pod named by anything
    but an IP address is no peer's host."""
    a = _ip(peer)
    return a is not None and a == _ip(split_host(pod))


def parse_topic(topic: str) -> tuple[str | None, str | None]:
    """`kv@<ip:port>@<model>` or `kv@<ip>@<model>` -> (address or ip, model); else (None, None)."""
    if not topic.startswith("kv@"):
        return None, None
    where, sep, model = topic[3:].rpartition("@")
    if not sep:
        return topic[3:] or None, None
    return where or None, model or None


class PoolHosts:
    """The pool's endpoints by host, for topics: a map rebuilt at each `rebuild` (the subscriber's sync:
    discovery syncs at every change), when an endpoint it lists is gone, or on a miss when the number of
    endpoints changed; misses are remembered (bounded) until the next rebuild."""

    def __init__(self, ids: Callable[[], list[str]], known: Callable[[str], bool]) -> None:
        self._ids = ids
        self._known = known
        self._hosts: dict[str, tuple[str, ...]] = {}
        self._size = -1  # endpoints when the map was built

    def rebuild(self, ids: list[str]) -> None:
        hosts: dict[str, list[str]] = {}
        for p in ids:
            hosts.setdefault(split_host(p), []).append(p)
        self._hosts = {h: tuple(ps) for h, ps in hosts.items()}
        self._size = len(ids)

    def on(self, host: str) -> tuple[str, ...]:
        """The pool's endpoints on `host`."""
        found = self._hosts.get(host)
        if found is not None and all(self._known(p) for p in found):
            return found
        ids = self._ids()
        if found is not None or len(ids) != self._size:
            self.rebuild(ids)
            found = self._hosts.get(host)
        if found is None:
            if len(self._hosts) >= self._size + TOPIC_CACHE:
                self.rebuild(ids)  # (misses remembered: bounded)
            found = self._hosts[host] = ()  # remembered until the next rebuild
        return found

    def pod_of(self, where: str | None) -> str | None:
        """The endpoint a central-mode topic names: `ip:port`, or `ip` when one endpoint is on it."""
        if where is None:
            return None
        if self._known(where):
            return where
        matches = self.on(where)
        return matches[0] if len(matches) == 1 else None

    def owner(self, where: str, pod: str) -> str:
        """Whose a message on `pod`'s socket is when its topic names `where` (not `pod`): `OWN` (this
        host, or a name the pool does not use), `OTHER` or `FOREIGN` (see the module docstring)."""
        host = split_host(pod)
        if self._known(where):
            return OTHER if split_host(where) == host else FOREIGN
        named = host_of(where)
        return OWN if named == host or not self.on(named) else FOREIGN
