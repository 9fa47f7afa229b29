"""Our own sections of the EndpointPickerConfig (`kvEvents`, `index`, `admission`, `tenancy`,
`explain`): their YAML shapes, typed values and validation. Pure. `ConfigError` lives here so
both this module and `epp.config` raise it; `validation_error` turns msgspec's errors into one
that names the profile and plugin.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from epp.durations import parse_duration
from epp.kvindex.chat_inputs import ChatTemplateError
from epp.kvindex.chat_template import ChatTemplate
from epp.kvindex.ingest import MAX_DP_RANKS
from epp.kvindex.server_chat import (
    CONTENT_FORMATS,
    TOKENIZER_MODES,
    ServerChatSettings,
    TokenizerSpec,
    default_kwargs_problem,
)
from epp.scheduling.admission import Admission
from epp.scheduling.saturation import SaturationDetector
from epp.tenancy import TenancyConfig


class ConfigError(ValueError):
    def __init__(self, source: str, where: str, field: str, message: str) -> None:
        self.source = source
        self.where = where
        self.field = field
        self.message = message
        loc = f"{source}: {where}" if where else source
        if field:
            loc += f": field {field!r}"
        super().__init__(f"{loc}: {message}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, str, str]]:
        """Pickled with its four fields (a worker process's error reaches its parent intact)."""
        return type(self), (self.source, self.where, self.field, self.message)


_MSGSPEC_AT = re.compile(r"^(.*?)(?: - at (`key` in )?`\$(.*)`)?$")
_UNKNOWN = re.compile(r"(?:unknown|missing required) field `([^`]*)`")
_PROFILE_PLUGIN_AT = re.compile(r"^(schedulingProfiles\[(\d+)\](?:\.plugins\[(\d+)\])?)(?:\.|$)")
_PLUGIN_AT = re.compile(r"^(plugins\[(\d+)\])(?:\.|$)")


def _item(raw: Any, key: str, i: int) -> dict[str, Any]:
    """raw[key][i] when it is a mapping, else {} (the document failed validation: anything goes)."""
    items = raw.get(key) if isinstance(raw, dict) else None
    item = items[i] if isinstance(items, list) and i < len(items) else None
    return item if isinstance(item, dict) else {}


def _named_where(raw: Any, path: str) -> str:
    """`where` of a validation error at `path`, naming the profile and plugin as the checks after
    parsing do ("profile 'p': plugin 'ref'") with the position, when the document gives the names."""
    m = _PROFILE_PLUGIN_AT.match(path)
    if m:
        profile = _item(raw, "schedulingProfiles", int(m.group(2)))
        name = profile.get("name")
        if not isinstance(name, str):
            return path
        if m.group(3) is None:
            return f"profile {name!r} ({m.group(1)})"
        ref = _item(profile, "plugins", int(m.group(3))).get("pluginRef")
        return (
            f"profile {name!r}: plugin {ref!r} ({m.group(1)})"
            if isinstance(ref, str)
            else f"profile {name!r} ({m.group(1)})"
        )
    m = _PLUGIN_AT.match(path)
    if m:
        entry = _item(raw, "plugins", int(m.group(2)))
        kind, name = entry.get("type"), entry.get("name") or entry.get("type")
        if isinstance(kind, str) and isinstance(name, str):
            return f"plugin {name!r} ({m.group(1)}, type {kind!r})"
    return path


def _split_msgspec(err: msgspec.ValidationError) -> tuple[str, str]:
    """(where, field) from msgspec's 'message - at `$.a[0].b`' (or '- at `key` in `$.a`': a mapping key)."""
    text = str(err)
    m = _MSGSPEC_AT.match(text)
    path = (m.group(3) or "") if m else ""
    unknown = _UNKNOWN.search(text)
    if unknown:
        field = unknown.group(1)
    elif m and m.group(2):
        field = "(a key)"
    else:
        field = path.rsplit(".", 1)[-1] if path else ""
    return path.lstrip("."), field


def validation_error(source: str, raw: Any, err: msgspec.ValidationError) -> ConfigError:
    """The ConfigError for msgspec's error on the document `raw`: where (named as the checks after
    parsing name it, with the position) and the field."""
    where, field = _split_msgspec(err)
    message = str(err).split(" - at ")[0]
    if where.startswith(_TOKENIZERS_AT):  # msgspec does not name a mapping's key: find the model
        rest = where.removeprefix(_TOKENIZERS_AT)
        model = _bad_tokenizer(raw)
        where = "tokenizers" if model is None else f"tokenizers {model!r}"
        if field == "(a key)" and rest:
            field = f"{rest.lstrip('.')} (a key)"
        elif not rest and message.startswith("Expected"):  # the entry itself
            field = "(the entry)"
            message = f"must be a tokenizer directory or an object with a `path` ({message})"
        elif not rest:
            keys = ", ".join(f.encode_name for f in msgspec.structs.fields(TokenizerEntry))
            message = f"{message} (an entry takes {keys})"
    return ConfigError(source, _named_where(raw, where), field, message)


_TOKENIZERS_AT = "tokenizers[...]"


def _bad_tokenizer(raw: Any) -> str | None:
    """The first model whose `tokenizers` entry does not validate (`raw` failed as a whole)."""
    entries = raw.get("tokenizers") if isinstance(raw, dict) else None
    for model, entry in entries.items() if isinstance(entries, dict) else ():
        try:
            msgspec.convert(entry, str | TokenizerEntry, strict=True)
        except msgspec.ValidationError:
            return str(model)
    return None


class _Struct(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    pass


class KvEventsEntry(_Struct):
    mode: str | bool = "off"  # YAML reads a bare `off` as false
    port: int = 5557
    bind: str = "tcp://*:5557"
    replay_port: int | None = None
    topic_filters: list[str] = msgspec.field(default_factory=lambda: [""])
    dp_ranks: int = 1
    replay_timeout: str | float = "2s"
    replay_retries: int = 2
    receive_high_water_mark: int = 100_000
    verify_peer: bool = False


class IndexEntry(_Struct):
    block_size: int = 16
    max_entries: int = 10_000_000
    max_keyed_prompt_chars: int = 524_288


class TokenizerEntry(_Struct):
    """A `tokenizers` value in its object form: the directory and the model's vLLM server-side chat settings
    (`--default-chat-template-kwargs`, `--chat-template`, `--chat-template-content-format`,
    `--tokenizer-mode`, `--exclude-tools-when-tool-choice-none`)."""

    path: str
    default_chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    tokenizer_mode: str = "auto"
    exclude_tools_when_tool_choice_none: bool = False


class AdmissionEntry(_Struct):
    ttft_slo: str | float | None = None
    max_retry_after: str | float = "60s"


class TenancyEntry(_Struct):
    header: str = "x-tenant-id"
    missing: str = "shared"
    secret_file: str | None = None
    secret_env: str | None = None


class ExplainEntry(_Struct):
    keep: int = 100
    response_header: bool = False


KV_EVENT_MODES = ("per-pod", "central", "off")


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """How the EPP receives engine KV events (see epp/sources/kv_events.py)."""

    mode: str = "off"
    port: int = 5557
    bind: str = "tcp://*:5557"
    replay_port: int | None = None
    topic_filters: tuple[str, ...] = ("",)
    dp_ranks: int = 1
    replay_timeout: float = 2.0
    replay_retries: int = 2
    rcvhwm: int = 100_000
    sync_interval: float = 0.5
    verify_peer: bool = False  # central: a topic must name the host the publisher connected from

    def check(self) -> tuple[str, str] | None:
        """(field, message) of the first invalid setting, or None."""
        if self.mode not in KV_EVENT_MODES:
            return "mode", f"must be one of {', '.join(KV_EVENT_MODES)}, got {self.mode!r}"
        if not 0 < self.port < 65536:
            return "port", f"must be in 1..65535, got {self.port}"
        if self.replay_port is not None and not 0 < self.replay_port < 65536:
            return "replayPort", f"must be in 1..65535, got {self.replay_port}"
        if not 1 <= self.dp_ranks <= MAX_DP_RANKS:
            return "dpRanks", f"must be in 1..{MAX_DP_RANKS}, got {self.dp_ranks}"
        # rank r listens on port + r (and replays on replayPort + r)
        if self.port + self.dp_ranks - 1 > 65535:
            return "dpRanks", f"port + dpRanks - 1 must be <= 65535, got {self.port + self.dp_ranks - 1}"
        if self.replay_port is not None and self.replay_port + self.dp_ranks - 1 > 65535:
            top = self.replay_port + self.dp_ranks - 1
            return "dpRanks", f"replayPort + dpRanks - 1 must be <= 65535, got {top}"
        if self.replay_retries < 0:
            return "replayRetries", "must be >= 0"
        if not 1 <= self.rcvhwm <= 2**31 - 1:  # a ZeroMQ int option
            return "receiveHighWaterMark", f"must be in 1..2147483647, got {self.rcvhwm}"
        if self.mode == "central" and not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            return "bind", f"must be a ZeroMQ endpoint such as tcp://*:5557, got {self.bind!r}"
        if self.mode == "central" and self.verify_peer and not self.bind.startswith("tcp://"):
            return (
                "verifyPeer",
                f"needs a tcp:// bind (ipc and inproc connections have no peer address), got {self.bind!r}",
            )
        return None


@dataclass(frozen=True, slots=True)
class IndexConfig:
    block_size: int = 16
    max_entries: int = 10_000_000
    max_keyed_prompt_chars: int = 524_288  # longer text/chat prompts are not tokenized (no cache credit)


@dataclass(frozen=True, slots=True)
class ExplainConfig:
    keep: int = 100  # decisions kept for /debug/decisions
    response_header: bool = False  # x-epp-decision on responses


def tokenizers_config(
    source: str, entries: Mapping[str, str | TokenizerEntry]
) -> dict[str, str | TokenizerSpec]:
    """`{model: directory}`, or `{model: {path, defaultChatTemplateKwargs, chatTemplate,
    chatTemplateContentFormat, tokenizerMode, excludeToolsWhenToolChoiceNone}}`: an entry without
    server-side settings is its directory, as before. The checks that need no file: the template file is
    read when the tokenizers load (`TokenizerRegistry`), beside the directory, which may exist only where
    the EPP runs (`check-config --skip-tokenizers`)."""
    out: dict[str, str | TokenizerSpec] = {}
    for model, entry in entries.items():
        where = f"tokenizers {model!r}"
        path = entry.path if isinstance(entry, TokenizerEntry) else entry
        if not model:
            raise ConfigError(source, "tokenizers", "<empty>", "needs a model name and a directory")
        if not path:
            field = "path" if isinstance(entry, TokenizerEntry) else ""
            raise ConfigError(source, where, field, "needs a model name and a directory")
        if not isinstance(entry, TokenizerEntry):
            out[model] = entry
            continue
        kwargs = entry.default_chat_template_kwargs or {}
        problem = default_kwargs_problem(kwargs)
        if problem is not None:
            raise ConfigError(source, where, "defaultChatTemplateKwargs", problem)
        if entry.chat_template_content_format not in CONTENT_FORMATS:
            raise ConfigError(
                source,
                where,
                "chatTemplateContentFormat",
                f"must be one of {', '.join(CONTENT_FORMATS)} (vLLM's --chat-template-content-format), "
                f"got {entry.chat_template_content_format!r}",
            )
        if entry.tokenizer_mode not in TOKENIZER_MODES:
            raise ConfigError(
                source,
                where,
                "tokenizerMode",
                f"must be one of {', '.join(TOKENIZER_MODES)} (vLLM's --tokenizer-mode; the EPP reproduces "
                f"only Hugging Face tokenizers), got {entry.tokenizer_mode!r}",
            )
        template = entry.chat_template
        if template is not None and not template.strip():
            raise ConfigError(source, where, "chatTemplate", "must be a template file or a template, got ''")
        if template is not None and any(
            c in template for c in "{}\n"
        ):  # the template itself (as vLLM reads it)
            try:
                ChatTemplate(template)
            except ChatTemplateError as e:
                raise ConfigError(source, where, "chatTemplate", f"not a valid chat template: {e}") from None
        chat = ServerChatSettings(
            dict(kwargs),
            template,
            entry.chat_template_content_format,
            entry.tokenizer_mode,
            entry.exclude_tools_when_tool_choice_none,
        )
        out[model] = entry.path if chat.is_default else TokenizerSpec(entry.path, chat)
    return out


def admission_config(source: str, e: AdmissionEntry) -> Admission:
    def duration(field: str, value: str | float) -> float:
        try:
            return parse_duration(value)
        except ValueError as err:
            raise ConfigError(source, "admission", field, str(err)) from None

    slo = None if e.ttft_slo is None else duration("ttftSlo", e.ttft_slo)
    retry = duration("maxRetryAfter", e.max_retry_after)
    if slo is not None and slo <= 0:
        raise ConfigError(source, "admission", "ttftSlo", "must be > 0")
    if retry < 1:
        raise ConfigError(source, "admission", "maxRetryAfter", "must be at least 1s")
    return Admission(slo, 1, int(retry))


def tenancy_config(source: str, e: TenancyEntry | None) -> TenancyConfig | None:
    if e is None:
        return None
    t = TenancyConfig(e.header.lower(), e.missing, e.secret_file, e.secret_env)
    problem = t.check()
    if problem is not None:
        raise ConfigError(source, "tenancy", problem[0], problem[1])
    return t


def explain_config(source: str, e: ExplainEntry) -> ExplainConfig:
    if not 0 <= e.keep <= 10_000:
        raise ConfigError(source, "explain", "keep", f"must be in 0..10000, got {e.keep}")
    return ExplainConfig(e.keep, e.response_header)


def kv_events_config(source: str, e: KvEventsEntry) -> KvEventsConfig:
    try:
        timeout = parse_duration(e.replay_timeout)
    except ValueError as err:
        raise ConfigError(source, "kvEvents", "replayTimeout", str(err)) from None
    if isinstance(e.mode, bool):
        if e.mode:
            modes = ", ".join(KV_EVENT_MODES)
            raise ConfigError(source, "kvEvents", "mode", f"must be one of {modes}, got true")
        e.mode = "off"
    kv = KvEventsConfig(
        e.mode,
        e.port,
        e.bind,
        e.replay_port,
        tuple(e.topic_filters),
        e.dp_ranks,
        timeout,
        e.replay_retries,
        e.receive_high_water_mark,
        verify_peer=e.verify_peer,
    )
    problem = kv.check()
    if problem is not None:
        raise ConfigError(source, "kvEvents", problem[0], problem[1])
    return kv


class SaturationEntry(_Struct):
    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8
    metrics_staleness_threshold: str | float = "200ms"


_DATA_LAYER = (
    "the reference EPP's data layer is not configurable here: this EPP scrapes every endpoint's "
    "/metrics itself. Remove the section (the plugins metrics-data-source and core-metrics-extractor "
    "are accepted and may stay)"
)
UNSUPPORTED_SECTIONS: dict[str, str] = {
    "data": _DATA_LAYER,
    "dataLayer": _DATA_LAYER,
    "flowControl": (
        "the reference EPP's flow control (queueing requests in priority bands) is not implemented: a "
        "sheddable request is refused with 429 when the pool is saturated (saturationDetector) or over "
        "its TTFT SLO (admission). Remove the section"
    ),
    "parser": (
        "request parsers are not configurable: this EPP reads OpenAI completion and chat request bodies. "
        "Remove the section"
    ),
    "requestHandler": (
        "request parsers are not configurable: this EPP reads OpenAI completion and chat request bodies. "
        "Remove the section"
    ),
    "requestControl": "the reference EPP's request control settings are not implemented. Remove the section",
    "discovery": (
        "endpoint discovery plugins are not supported: use --pool-name (InferencePool discovery) or "
        "static endpoints (--endpoints, the endpoints section). Remove the section"
    ),
}
"""Top-level sections of the reference EPP (and of llm-d's) that this EPP does not implement, and why."""


def refuse_unsupported(source: str, raw: Mapping[str, Any], kind: str) -> None:
    """The reference's sections this EPP does not implement, refused naming what to do instead (in a
    document of `kind` only: a Kubernetes ConfigMap, say, also has a `data` key)."""
    if raw.get("kind") != kind:
        return
    for key, why in UNSUPPORTED_SECTIONS.items():
        if key in raw:
            raise ConfigError(source, "", key, why)
    sat = raw.get("saturationDetector")
    if isinstance(sat, dict) and "pluginRef" in sat:
        raise ConfigError(
            source,
            "saturationDetector",
            "pluginRef",
            "saturation-detector plugins (the form of llm-d and newer reference releases) are not "
            "supported: give the thresholds queueDepthThreshold, kvCacheUtilThreshold and "
            "metricsStalenessThreshold instead",
        )


def saturation_config(source: str, sat: SaturationEntry) -> SaturationDetector:
    """The detector for `sat`. As in the reference's loader, a threshold of 0 is unset (its default);
    unlike it, other out-of-range values are errors rather than silently replaced."""
    defaults = SaturationEntry()
    where = "saturationDetector"
    try:
        staleness = parse_duration(sat.metrics_staleness_threshold)
    except ValueError as err:
        raise ConfigError(source, where, "metricsStalenessThreshold", str(err)) from None
    if staleness == 0:
        staleness = parse_duration(defaults.metrics_staleness_threshold)
    kv = sat.kv_cache_util_threshold or defaults.kv_cache_util_threshold
    if not 0.0 < kv <= 1.0:
        raise ConfigError(source, where, "kvCacheUtilThreshold", f"must be in (0, 1] (0: unset), got {kv}")
    queue = sat.queue_depth_threshold or defaults.queue_depth_threshold
    if queue < 0:
        raise ConfigError(source, where, "queueDepthThreshold", f"must be >= 1 (0: unset), got {queue}")
    return SaturationDetector(queue, kv, staleness)
