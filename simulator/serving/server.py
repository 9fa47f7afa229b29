"""`SimulatedEngineServer`: the simulator's engine model behind a real OpenAI-compatible HTTP server,
publishing vLLM's KV events on ZeroMQ and vLLM's `/metrics`. A stand-in for vLLM in tests and demos.

    async with SimulatedEngineServer(EngineServerConfig(model="demo", port=0)) as srv:
        srv.url, srv.address, srv.kv_events_endpoint, srv.kv_replay_endpoint

Start order: tokenizer (a bad directory fails here, before any socket), the KV-event channel (not
yet bound), the engine and its real-time driver, the HTTP site (its port known), then the KV-event
sockets (the topic's `{address}` filled in; batches produced before they are up are queued, none
lost; each is stamped with the wall-clock time of its engine step, as vLLM stamps it). A failure
undoes whatever was started. Stop: the engine stops (requests still waiting get 503 or an error
event), the HTTP server closes, queued KV events are sent, the sockets close.
"""

from __future__ import annotations

from types import TracebackType

from aiohttp import web

from simulator.serving.config import EngineServerConfig
from simulator.serving.engine_runner import EngineRunner
from simulator.serving.kv_events import KvEventChannel, restamp
from simulator.serving.metrics import EngineMetrics
from simulator.serving.openai_api import OpenAiApi
from simulator.serving.output_text import OutputText
from simulator.serving.request_body import BodyReader

_MAX_BODY = 256 * 1024 * 1024


class SimulatedEngineServer:
    """See the module docstring. Construction checks the engine settings (ValueError); `start()` loads
    the tokenizer (`TokenizerError`, a ValueError) and opens the sockets (OSError or ValueError)."""

    def __init__(self, config: EngineServerConfig) -> None:
        self.config = config
        self.kv: KvEventChannel | None = None
        events = config.kv_events_endpoint is not None
        self.runner = EngineRunner(config, on_events=self._on_events if events else None)
        self.engine = self.runner.engine
        self.metrics = EngineMetrics(self.engine, config.model)
        self.runner.first_token_hook = self.metrics.on_first_token
        self.runner.finish_hook = self.metrics.on_finish
        self.api: OpenAiApi | None = None
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    # -- addresses ---------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("SimulatedEngineServer is not started")
        return self._port

    @property
    def address(self) -> str:
        """`host:port`, what the EPP names this endpoint."""
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """The PUB socket's endpoint: the bound one (ephemeral port resolved) or the one connected to."""
        return self.kv.endpoint if self.kv is not None else None

    @property
    def kv_replay_endpoint(self) -> str | None:
        return self.kv.replay_endpoint if self.kv is not None else None

    @property
    def kv_peers(self) -> int:
        """ZeroMQ peers of the KV-event PUB socket (subscribers connected to it, or the router it
        connected to) that completed a handshake."""
        return self.kv.peers if self.kv is not None else 0

    @property
    def kv_topic(self) -> str | None:
        return self.kv.topic if self.kv is not None else None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> SimulatedEngineServer:
        if self._runner is not None:
            raise RuntimeError("already started")
        cfg = self.config
        text = OutputText.from_dir(cfg.tokenizer, cfg.model) if cfg.tokenizer is not None else OutputText()
        reader = BodyReader(cfg.model, text.prompt_tokenizer, text.vocab_size, cfg.default_max_tokens)
        self.api = OpenAiApi(
            self.runner,
            reader,
            text,
            self.metrics,
            max_model_len=cfg.max_model_len,
            stream_interval=cfg.stream_interval,
        )
        app = web.Application(client_max_size=_MAX_BODY)
        self.api.add_routes(app)
        if cfg.kv_events_endpoint is not None:  # before the engine runs, so its batches queue here
            self.kv = KvEventChannel(
                cfg.kv_events_endpoint,
                replay_endpoint=cfg.kv_replay_endpoint,
                topic=cfg.kv_topic,
                mode=cfg.kv_events_mode,
                buffer_steps=cfg.kv_buffer_steps,
            )
        # handler_cancellation: a client that goes away cancels its handler, which aborts its request
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        try:
            await self.runner.start()
            await runner.setup()
            site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
            await site.start()
            self._port = int(runner.addresses[0][1])
            self._runner = runner
            if self.kv is not None:
                self.kv.topic = cfg.kv_topic.replace("{address}", self.address).replace("{model}", cfg.model)
                await self.kv.start()
        except BaseException:
            self._runner = None
            await runner.cleanup()
            await self.runner.stop()
            if self.kv is not None:  # its ZeroMQ context must be destroyed, or the process cannot exit
                await self.kv.stop()
            raise
        return self

    async def stop(self) -> None:
        await self.runner.stop()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        if self.kv is not None:
            await self.kv.stop()
        if self.api is not None:
            self.api.tokenizing.close()

    async def __aenter__(self) -> SimulatedEngineServer:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # -- engine callbacks --------------------------------------------------------------------------
    def _on_events(self, seq: int, payload: bytes, at: float) -> None:
        if self.kv is not None:  # always, once started: the engine runs only then
            self.kv.submit(seq, restamp(payload, self.runner.driver.epoch(at)), at)
