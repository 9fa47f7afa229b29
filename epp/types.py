"""Frozen value types shared by the core and the edges."""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from epp.frozen import twin

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

EndpointId = str
"""An endpoint is named by its `ip:port`, exactly as Envoy receives it."""


class ApiKind(enum.Enum):
    """OpenAI-style API, from the `:path` suffix."""

    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat_completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """What one scrape of a model server's `/metrics` said, and when (`observed_at`, Clock seconds)."""

    observed_at: float
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    models: frozenset[str] = frozenset()
    running_lora_adapters: frozenset[str] = frozenset()
    waiting_lora_adapters: frozenset[str] = frozenset()
    max_lora: int | None = None


@dataclass(frozen=True, slots=True)
class PrefillWork:
    """Prefill work the cost model counts, as sums over requests (so a queue of them adds up):
    requests, uncached prompt tokens, and attention pairs (each new token x the context it attends to)."""

    requests: int = 0
    tokens: int = 0
    pairs: float = 0.0

    def __add__(self, other: PrefillWork) -> PrefillWork:
        return PrefillWork(
            self.requests + other.requests, self.tokens + other.tokens, self.pairs + other.pairs
        )

    def __sub__(self, other: PrefillWork) -> PrefillWork:
        return PrefillWork(
            self.requests - other.requests, self.tokens - other.tokens, self.pairs - other.pairs
        )


NO_WORK = PrefillWork()


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A candidate as the scheduler sees it: an immutable view taken per scheduling cycle."""

    id: EndpointId
    metrics: MetricsSnapshot | None = None
    healthy: bool = True
    in_flight_requests: int = 0
    in_flight_prompt_tokens: int = 0
    model: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    # Requests this EPP routed here: still before their first token (prefill backlog) / decoding.
    prefill_backlog: PrefillWork = NO_WORK
    decoding_requests: int = 0
    decoding_tokens: int = 0
    # The numbers the cost model reads, packed once per view (`LOAD_COLUMNS`; see `_load_row`).
    load_row: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "load_row", _load_row(self))

    def metrics_age(self, now: float) -> float:
        """Seconds since the last scrape; infinity if there never was one."""
        if self.metrics is None:
            return float("inf")
        return max(0.0, now - self.metrics.observed_at)


LOAD_COLUMNS = (
    "backlog_requests",
    "backlog_tokens",
    "backlog_pairs",
    "waiting",
    "running",
    "decoding_requests",
    "decoding_tokens",
    "free_kv_tokens",
    "engine_block_size",
)
_LOAD = struct.Struct(f"<{len(LOAD_COLUMNS)}d")


def _load_row(e: Endpoint) -> bytes:
    """`LOAD_COLUMNS` of an endpoint as float64 bytes: its prefill backlog, the scraped queues (0 without
    metrics), what it is decoding, the free KV tokens the metrics imply (infinity when they do not say)
    and the engine's block size (0: unknown). Views are built once per change and read by every
    scheduling cycle, so the cost model joins these rows into one array instead of reading 64 objects."""
    b, m = e.prefill_backlog, e.metrics
    if m is None:
        return _LOAD.pack(
            b.requests, b.tokens, b.pairs, 0, 0, e.decoding_requests, e.decoding_tokens, float("inf"), 0
        )
    free = float("inf")
    if m.num_gpu_blocks and m.block_size:
        free = (1.0 - m.kv_usage) * m.num_gpu_blocks * m.block_size
    return _LOAD.pack(
        b.requests,
        b.tokens,
        b.pairs,
        m.waiting,
        m.running,
        e.decoding_requests,
        e.decoding_tokens,
        free,
        m.block_size or 0,
    )


_EndpointTwin = twin(Endpoint)
_SnapshotTwin = twin(MetricsSnapshot)


def endpoint_view(
    id: EndpointId,
    metrics: MetricsSnapshot | None,
    healthy: bool,
    in_flight_requests: int,
    in_flight_prompt_tokens: int,
    model: str | None,
    labels: Mapping[str, str],
    prefill_backlog: PrefillWork,
    decoding_requests: int,
    decoding_tokens: int,
) -> Endpoint:
    """`Endpoint(...)` with every field given, built 3x faster (`epp/frozen.py`): the datastore builds
    one per change of an endpoint's state, which is several times per request."""
    e = _EndpointTwin(
        id, metrics, healthy, in_flight_requests, in_flight_prompt_tokens, model, labels, prefill_backlog,
        decoding_requests, decoding_tokens, b"",
    )  # fmt: skip
    e.load_row = _load_row(e)
    e.__class__ = Endpoint
    return e  # type: ignore[no-any-return]


def metrics_snapshot(
    observed_at: float,
    waiting: int,
    running: int,
    kv_usage: float,
    block_size: int | None,
    num_gpu_blocks: int | None,
    prefix_cache_queries: float | None,
    prefix_cache_hits: float | None,
    models: frozenset[str],
    running_lora_adapters: frozenset[str],
    waiting_lora_adapters: frozenset[str],
    max_lora: int | None = None,
) -> MetricsSnapshot:
    """`MetricsSnapshot(...)`, built 3x faster (`epp/frozen.py`), for the simulator's scrapes (every
    engine every 50 ms)."""
    m = _SnapshotTwin(
        observed_at, waiting, running, kv_usage, block_size, num_gpu_blocks, prefix_cache_queries,
        prefix_cache_hits, models, running_lora_adapters, waiting_lora_adapters, max_lora,
    )  # fmt: skip
    m.__class__ = MetricsSnapshot
    return m  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """The chat-completions fields that change the prompt an engine renders from `messages` (vLLM's names
    and defaults): the EPP renders the same text, so the prompt's block keys are the engine's."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Sequence[Mapping[str, Any]] | None = None
    documents: Sequence[Mapping[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    # the request's tool_choice is "none" (vLLM's default when a chat completion has no tools): a server run
    # with --exclude-tools-when-tool-choice-none renders it without its tools (`ServerChatSettings`)
    tool_choice_none: bool = False


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A prompt's token ids computed ahead of scheduling (the server tokenizes long text and chat prompts in a
    worker thread, `epp/server/tokenizing.py`), or why they cannot be known (`unkeyed`: "no_tokenizer",
    "too_long", "tokenizer_error", "multimodal", "harmony", "prompt_truncation", ...:
    `epp_kv_unkeyed_requests_total`'s
    reasons)."""

    ids: npt.NDArray[np.int32] | Sequence[int] | None
    unkeyed: str | None = None


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One OpenAI-style request, parsed once at the edge."""

    request_id: str
    api_kind: ApiKind
    model: str
    prompt: str | Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    stream: bool = False
    max_tokens: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    objective: str | None = None
    priority: int = 0
    body_bytes: int = 0
    prompt_tokens_estimate: int = 0
    # a completion's batch of prompts (a list of strings or token-id lists): the estimated tokens of its items
    # after the first (in `prompt_tokens_estimate` too), which the engine prefills on the same pod with no
    # cache credit (only the first item, `prompt`, is keyed)
    batch_tokens: int = 0
    cache_salt: str | None = None
    chat: ChatOptions | None = None  # None: the defaults
    tokens: PromptTokens | None = None  # None: tokenized when a scorer needs them
    # the request's `add_special_tokens` (vLLM's field; a Responses request's is always True, see
    # `epp/responses_api.py`); None: the API's default, True for a text prompt and False for chat messages
    add_special_tokens: bool | None = None
    # vLLM's `truncate_prompt_tokens` (completions, chat completions, embeddings): keep this many of the
    # prompt's tokens (-1: the model's length less the output tokens, unknown here); None: no truncation
    truncate_prompt_tokens: int | None = None
    # vLLM's `truncation_side`: "left" keeps the last tokens, "right" the first; None: the engine's default,
    # "left" for a generating model (completions, chat) and "right" for a pooling one (embeddings)
    truncation_side: str | None = None

    @property
    def kept_side(self) -> str:
        """Which end of the prompt `truncate_prompt_tokens` keeps from: "left" keeps the end."""
        if self.truncation_side is not None:
            return self.truncation_side
        return "right" if self.api_kind is ApiKind.EMBEDDINGS else "left"

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """The cost model's estimate of time to first token on one endpoint, term by term (seconds)."""

    queue_s: float
    prefill_s: float
    reload_s: float
    decode_s: float
    prompt_tokens: int
    cached_tokens: int  # the part not recomputed: held on GPU, or reloaded from a slower tier
    reloaded_tokens: int
    work: PrefillWork  # this request's own prefill work (what it adds to the endpoint's backlog)
    queue_nominal_s: float = 0.0  # before calibration (what the calibrator fits against)
    prefill_nominal_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s + self.reload_s + self.decode_s

    def terms(self) -> dict[str, float]:
        return {
            "ttft_s": self.ttft_s,
            "queue_s": self.queue_s,
            "prefill_s": self.prefill_s,
            "reload_s": self.reload_s,
            "decode_s": self.decode_s,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "reloaded_tokens": self.reloaded_tokens,
        }


PICK_MODES = ("cache-aware", "degraded", "load-only")
"""How much a decision could trust the cache index: every candidate fresh / some without cache
credit / none (index off, prompt not keyable, or every candidate stale)."""


@dataclass(frozen=True, slots=True)
class RankTerms:
    """How the ttft-scorer ranked the candidates beyond their estimates, aligned with `ids`: the seconds
    it charged a candidate for copying into its KV a prefix another candidate holds (`copyWeight`; 0
    when none), and which candidates were near-ties (ranked by cached tokens, then KV usage). Arrays as
    the scorer computed them: nothing is built per candidate unless an explanation is rendered."""

    ids: Sequence[EndpointId]
    copy_charge_s: Sequence[float] | npt.NDArray[np.float64] | None  # None: no candidate was charged
    near_tie: Sequence[bool] | npt.NDArray[np.bool_]

    def of(self, endpoint: EndpointId) -> tuple[float, bool] | None:
        """(copy charge in seconds, near-tie) of one candidate, None if it was not ranked."""
        try:
            i = list(self.ids).index(endpoint)
        except ValueError:
            return None
        return self._terms(i)

    def by_endpoint(self) -> dict[EndpointId, tuple[float, bool]]:
        """`of` for every ranked candidate at once (an explanation lists them all)."""
        return {ep: self._terms(i) for i, ep in enumerate(self.ids)}

    def _terms(self, i: int) -> tuple[float, bool]:
        charge = 0.0 if self.copy_charge_s is None else float(self.copy_charge_s[i])
        return charge, bool(self.near_tie[i])


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of a scheduling cycle: endpoints in order (first is primary)."""

    endpoints: tuple[EndpointId, ...]
    profile: str
    reason: str
    scores: Mapping[EndpointId, float] = field(default_factory=dict)
    mode: str = ""  # one of PICK_MODES when a cache-aware plugin ran, else ""
    estimates: Mapping[EndpointId, TtftEstimate] = field(default_factory=dict)
    ranking: RankTerms | None = None  # the ttft-scorer's ranking terms, when it ran

    @property
    def primary(self) -> EndpointId:
        return self.endpoints[0]
