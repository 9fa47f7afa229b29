"""Composition root: builds the datastore, scheduler, servers and sources, and runs them."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2_grpc

from epp.clock import MonotonicClock
from epp.config import ConfigError, EppConfig, StaticEndpoint, build_scheduler
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.datastore import Datastore
from epp.discovery.rewrite_watcher import ModelRewriteWatcher
from epp.discovery.rewrites import RewriteTable
from epp.discovery.selector_watcher import watcher_for
from epp.discovery.settings import DiscoverySettings
from epp.discovery.tracker import PodTracker
from epp.kvindex import compiled
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.ingest import KvIngest
from epp.kvindex.prompt import TokenizerRegistry
from epp.kvindex.report import index_report
from epp.kvindex.service import SERVICE_KEY, KvIndexService
from epp.scheduling.builtin import default_registry
from epp.scheduling.registry import PluginRegistry
from epp.server.admin import AdminServer
from epp.server.body_budget import BodyBudget
from epp.server.decisions import DecisionLog
from epp.server.director import Director
from epp.server.ext_proc import ExtProcService
from epp.server.kv_metrics import KvIndexCollector
from epp.server.metrics import EppMetrics
from epp.server.readiness import Readiness
from epp.server.startup import ScrapeRound, check_scrape_settings
from epp.server.tls import CertReloader, load_cert_dir, self_signed
from epp.server.tokenizing import PromptTokenizing
from epp.sources.kv_events import KvEventSubscriber
from epp.sources.metrics_scrape import MetricsScraper
from epp.tenancy import TenancyConfig, TenantSalter

log = logging.getLogger("epp.server")

_GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "0.0.0.0"
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    secure_serving: bool = True
    cert_path: str | None = None
    refresh_metrics_interval: float = 0.05
    metrics_timeout: float = 1.0
    unhealthy_after_failures: int = 3
    max_body_bytes: int = 32 * 1024 * 1024
    max_buffered_body_bytes: int = 1024 * 1024 * 1024  # all streams' request bodies at once
    request_body_timeout: float = 60.0  # seconds from a request's headers for its body to complete; 0: none
    pool_name: str = "default"
    seed: int | None = None
    debug_endpoints: bool = True
    discovery: DiscoverySettings | None = None  # endpoints from an InferencePool or a selector (not static)
    engine_metrics_scheme: str = (
        "http"  # the engines' /metrics (the reference's --model-server-metrics-* flags)
    )
    engine_metrics_path: str = "/metrics"
    engine_metrics_port: int | None = None  # scrape this port of every endpoint instead of its serving port
    engine_metrics_verify_tls: bool = (
        False  # https scrapes: verify the engines' certificates (the reference: no)
    )
    cert_reload: bool = (
        False  # --enable-cert-reload: new TLS handshakes use --cert-path's files as they are now
    )

    @classmethod
    def loopback(cls, **overrides: Any) -> ServerSettings:
        """Plaintext on 127.0.0.1 with every port picked by the OS (tests, benchmarks, the demo)."""
        base: dict[str, Any] = {"host": "127.0.0.1", "grpc_port": 0, "grpc_health_port": 0, "metrics_port": 0}
        return cls(**{**base, "secure_serving": False, **overrides})


class EppServer:
    def __init__(
        self,
        settings: ServerSettings,
        config: EppConfig,
        endpoints: Sequence[StaticEndpoint] = (),
        registry: PluginRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.config = config
        self.clock = MonotonicClock()
        self.rng = random.Random(settings.seed)
        self.datastore = Datastore(self.clock, settings.unhealthy_after_failures)
        for ep in (*config.endpoints, *endpoints):
            self.datastore.add_endpoint(ep.address, ep.model)
        self.metrics = EppMetrics(commit=os.environ.get("EPP_BUILD_COMMIT", "unknown"))
        self.metrics.attach_pool(self.datastore, self.clock, settings.pool_name)
        # The KV index and what feeds it (events off: the index stays empty, scorers give 0).
        kv = config.kv_events
        self.kv_index = BlockIndex(block_size=config.index.block_size, max_entries=config.index.max_entries)
        self.freshness = FreshnessTracker()
        self.kv = KvIndexService(
            self.kv_index,
            self.freshness,
            # Templates' `strftime_now` (Llama 3.x's "Today Date") reads this process's local time, as
            # transformers does in the engine: the same date wherever both run in one time zone (UTC in
            # containers by default), so the rendered prompt and its keys match vLLM's.
            TokenizerRegistry(config.tokenizers, now=datetime.now),
            config.index.block_size,
            max_keyed_prompt_chars=config.index.max_keyed_prompt_chars,
        )
        for model, why in self.kv.tokenizers.mistral_models().items():
            # said once, here: each request only counts in epp_kv_unkeyed_requests_total
            log.warning(
                "model %r: vLLM runs Mistral's tokenizer (%s), which the EPP does not reproduce: its text "
                "and chat prompts are routed by load (reason mistral_tokenizer)",
                model,
                why,
            )
        self.ingest = KvIngest(
            self.kv_index, self.freshness, self._model_of, replay_available=kv.replay_port is not None
        )
        self.subscriber = (
            KvEventSubscriber(self.datastore, self.ingest, self.clock, kv) if kv.mode != "off" else None
        )
        self.metrics.attach_live(
            KvIndexCollector(
                self.kv,
                self.ingest,
                self.clock,
                self._served_models,
                self.subscriber.socket_errors if self.subscriber is not None else None,
            )
        )
        # Plugins are built (and their parameters validated) here, before anything listens.
        self.cost = CostModel(config.cost_model)
        self.metrics.attach_cost_model(self.cost)
        self.scheduler = build_scheduler(
            config,
            registry or default_registry(),
            self.clock,
            self.rng,
            timer=self.clock,
            services={SERVICE_KEY: self.kv, COST_KEY: self.cost},
        )
        self.decisions = DecisionLog(config.explain.keep)
        # Long prompts are tokenized off the event loop when there is a tokenizer and a plugin that a
        # profile uses reads prompts' tokens (plugins register when built, used or not).
        used = {ref.plugin_ref for p in config.doc.scheduling_profiles for ref in p.plugins}
        self.kv.prompt_readers &= used
        self.tokenizing = PromptTokenizing(self.kv) if config.tokenizers and self.kv.prompt_readers else None
        self.metrics.attach_tokenizing(self.tokenizing)
        tenancy = None
        if config.tenancy is not None:
            t = config.tenancy
            tenancy = TenantSalter(t.header, read_secret(t, os.environ), t.missing)
        self.director = Director(
            self.datastore,
            self.scheduler,
            self.metrics,
            self.clock,
            config.objectives,
            cost=self.cost,
            tenancy=tenancy,
            decisions=self.decisions,
            decision_header=config.explain.response_header,
            tokenizing=self.tokenizing,
            # its own stream (from --seed when given), so rewrite picks never shift the scheduler's
            rewrite_rng=random.Random(None if settings.seed is None else f"model-rewrites:{settings.seed}"),
        )
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.admin = AdminServer(
            self.metrics,
            self.datastore,
            self.clock,
            self.is_ready,
            settings.debug_endpoints,
            lambda: index_report(self.kv, self.ingest, kv.mode, self.clock.now(), self._served_models()),
            lambda limit: self.decisions.render(limit, self.clock.now()),
        )
        self.scraper: MetricsScraper | None = None
        self.scrape_round: ScrapeRound | None = None  # readiness waits for the first scrape of each endpoint
        if settings.refresh_metrics_interval > 0:
            self.scrape_round = ScrapeRound(self.metrics)
            self.scraper = MetricsScraper(
                self.datastore,
                self.clock,
                interval=settings.refresh_metrics_interval,
                timeout=settings.metrics_timeout,
                path=settings.engine_metrics_path,
                scheme=settings.engine_metrics_scheme,
                port=settings.engine_metrics_port,
                verify_tls=settings.engine_metrics_verify_tls,
                observer=self.scrape_round,
            )
        self.discovery: PodTracker | None = None
        # InferenceModelRewrites: with a pool only (they name it in `poolRef`; the reference's selector
        # mode starts no InferenceModelRewrite reconciler either).
        self.model_rewrites: ModelRewriteWatcher | None = None
        if settings.discovery is not None:
            if config.endpoints or endpoints:
                raise ValueError(
                    "static endpoints (--endpoints or the config's endpoints) and Kubernetes discovery "
                    "(--pool-name or --endpoint-selector) cannot be used together"
                )
            self.discovery = watcher_for(
                self.datastore, settings.discovery, observer=self.metrics, on_change=self._follow_endpoints
            )
            if not settings.discovery.selector_mode:
                self.model_rewrites = ModelRewriteWatcher(
                    settings.discovery, self._follow_rewrites, observer=self.metrics
                )
        self._sources_started = False
        self.body_budget = BodyBudget(settings.max_buffered_body_bytes)  # request bodies of all streams
        self.readiness = Readiness(
            self.health,
            self.datastore,
            settings.metrics_timeout,
            discovery=self.discovery,
            rewrites=self.model_rewrites,
            scrape_round=self.scrape_round,
        )
        self._grpc: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.grpc_port = 0
        self.grpc_health_port = 0
        self.metrics_port = 0
        self.certificate_pem: bytes | None = None

    def _model_of(self, pod: str) -> str | None:
        rec = self.datastore.get(pod)
        if rec is None:
            return None
        if rec.model:
            return rec.model
        if rec.metrics is not None and rec.metrics.models:
            return min(rec.metrics.models)
        return None

    def _served_models(self) -> set[str]:
        return {m for m in map(self._model_of, self.datastore.ids()) if m}

    def is_ready(self) -> bool:
        """What the readiness services answer (`epp.server.readiness`)."""
        return self.readiness.is_ready()

    def _follow_endpoints(self, removed: set[str]) -> None:
        """Discovery changed the endpoint set: the metrics of those that left go, and scraping and
        subscribing follow now, not at the next tick. (Static endpoints never leave.)"""
        for endpoint_id in removed:
            self.metrics.forget_endpoint(endpoint_id)
        if not self._sources_started:
            return
        if self.scraper is not None:
            self.scraper.sync()
        if self.subscriber is not None:
            self.subscriber.sync()

    def _follow_rewrites(self, table: RewriteTable) -> None:
        """The InferenceModelRewrite rules changed: the director applies them from the next request."""
        self.director.model_rewrites = table

    def _credentials(self) -> grpc.ServerCredentials | None:
        s = self.settings
        if not s.secure_serving:
            return None
        if s.cert_path and s.cert_reload:
            reloader = CertReloader(s.cert_path)
            self.certificate_pem = reloader.certificate_pem
            return reloader.credentials()
        crt, key = load_cert_dir(s.cert_path) if s.cert_path else self_signed()
        self.certificate_pem = crt
        return grpc.ssl_server_credentials([(key, crt)])

    async def start(self) -> None:
        """Start everything; if any part fails (a port in use, bad credentials), stop what started."""
        try:
            await self._start()
        except BaseException:
            await self.stop(grace=0)
            raise

    async def _start(self) -> None:
        s = self.settings
        check_scrape_settings(self.config.source, self.scheduler, s.refresh_metrics_interval)
        if s.max_body_bytes > s.max_buffered_body_bytes:  # such a body would get 503 forever, never 413
            raise ConfigError(
                "flags",
                "",
                "--max-body-size",
                f"{s.max_body_bytes} bytes is more than --max-buffered-body-size ({s.max_buffered_body_bytes}"
                " bytes, what all request bodies may hold at once)",
            )
        if self.scraper is None:
            log.warning(
                "metrics scraping is disabled (--refresh-metrics-interval 0): the saturation detector "
                "counts every endpoint as saturated, so sheddable requests get 429"
            )
        compiled.warm_up()  # compile (or load) the compiled loops before anything listens
        if self.discovery is not None:
            await self.discovery.start()  # bad credentials fail here, before anything listens
        if self.model_rewrites is not None:
            await self.model_rewrites.start()
        creds = self._credentials()
        self._grpc = grpc.aio.server(options=_GRPC_OPTIONS)
        pb_grpc.add_ExternalProcessorServicer_to_server(
            ExtProcService(self.director, s.max_body_bytes, self.body_budget, s.request_body_timeout),
            self._grpc,
        )
        addr = f"{s.host}:{s.grpc_port}"
        self.grpc_port = _add_port(self._grpc, addr, creds, "ext_proc gRPC", "--grpc-port")
        self._health_server = grpc.aio.server(options=_GRPC_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        haddr = f"{s.host}:{s.grpc_health_port}"
        self.grpc_health_port = _add_port(
            self._health_server, haddr, None, "gRPC health", "--grpc-health-port"
        )
        await self.readiness.starting()
        await self._grpc.start()
        await self._health_server.start()
        try:
            self.metrics_port = await self.admin.start(s.host, s.metrics_port)
        except OSError as err:
            reason = err.strerror or str(err)
            raise OSError(
                f"cannot listen for metrics on {s.host}:{s.metrics_port} (--metrics-port): {reason}"
            ) from None
        if self.scraper is not None:
            await self.scraper.start()
        if self.subscriber is not None:
            await self.subscriber.start()
        self._sources_started = True
        await self.readiness.alive()  # alive now; ready once its conditions hold (`epp.server.readiness`)
        log.info(
            "EPP serving ext_proc on %s:%d (%s), health on %d, metrics on %d, %d endpoints",
            s.host,
            self.grpc_port,
            "TLS" if creds else "plaintext",
            self.grpc_health_port,
            self.metrics_port,
            len(self.datastore.ids()),
        )

    async def stop(self, grace: float = 1.0) -> None:
        self.readiness.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.model_rewrites is not None:
            await self.model_rewrites.stop()
        await self.health.enter_graceful_shutdown()
        if self.scraper is not None:
            await self.scraper.stop()
        if self.subscriber is not None:
            await self.subscriber.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self.tokenizing is not None:
            self.tokenizing.close()
        if self._health_server is not None:
            await self._health_server.stop(None)
        await self.admin.stop()

    async def wait(self) -> None:
        if self._grpc is not None:
            await self._grpc.wait_for_termination()


def _add_port(
    server: grpc.aio.Server, addr: str, creds: grpc.ServerCredentials | None, what: str, flag: str
) -> int:
    """Listen on `addr`; OSError naming the address and the flag when that fails (grpcio raises a bare
    RuntimeError, or returns 0)."""
    try:
        port = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(
            f"cannot listen for {what} on {addr} ({flag}): the port is in use or the address is not local"
        )
    return int(port)


def read_secret(config: TenancyConfig, environ: Mapping[str, str]) -> bytes:
    """The HMAC secret from the configured file or environment variable. Raises ValueError."""
    if config.secret_env is not None:
        value = environ.get(config.secret_env)
        if not value:
            raise ValueError(f"tenancy: environment variable {config.secret_env!r} is not set or empty")
        return value.encode("utf-8")
    assert config.secret_file is not None
    try:
        with open(config.secret_file, "rb") as f:
            data = f.read().strip()
    except OSError as err:
        raise ValueError(f"tenancy: cannot read secretFile {config.secret_file!r}: {err.strerror}") from None
    if not data:
        raise ValueError(f"tenancy: secretFile {config.secret_file!r} is empty")
    return data
