"""The reference EPP's flags that `epp serve` takes besides its own, so that the reference's Helm chart and
its users' `flags:` lists start this EPP too (command-line edge; no I/O).

The reference (gateway-api-inference-extension `cmd/epp/runner/options.go`, plus controller-runtime's
`--zap-*` logging flags, which its chart passes: `--zap-encoder json`) has flags for things this EPP does
differently. Each one is either honoured, accepted as a no-op where the reference's meaning holds here
anyway, or refused with a `ConfigError` that says what to do instead; never silently ignored when the
value asks for something this EPP would not do:

- honoured: `--config-text`, `--v`, `--zap-log-level`, `--zap-encoder`, `--zap-devel`, the scrape's
  `--model-server-metrics-scheme`, `-path`, `-port` and `-https-insecure-skip-verify`,
  `--enable-cert-reload`;
- accepted, nothing to do: `--ha-enable-leader-election` (every replica serves: each keeps its own index
  from the KV events and its own load view, so there is no leader to elect), `--health-checking`,
  `--enable-pprof` (a Go profiler; profile this process with py-spy), `--refresh-prometheus-metrics-interval`
  (the EPP's gauges are computed when scraped), `--zap-stacktrace-level`, `--zap-time-encoding`, `--tracing`
  false; the engine-metric flags when they name vLLM's defaults;
- refused: `--tracing=true` (no OpenTelemetry export), `--metrics-endpoint-auth=true` (the admin port has no
  authentication: keep it inside the cluster's network policy), `--metrics-staleness-threshold` (set the
  config's `saturationDetector.metricsStalenessThreshold` and `metrics-staleness-filter` `maxAge`), and
  engine-metric flags naming other series (this EPP reads vLLM's and SGLang's own names).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from epp.config_sections import ConfigError

VLLM_METRIC_DEFAULTS = {
    "total_queued_requests_metric": ("--total-queued-requests-metric", "vllm:num_requests_waiting"),
    "total_running_requests_metric": ("--total-running-requests-metric", "vllm:num_requests_running"),
    "kv_cache_usage_percentage_metric": ("--kv-cache-usage-percentage-metric", "vllm:kv_cache_usage_perc"),
    "lora_info_metric": ("--lora-info-metric", "vllm:lora_requests_info"),
    "cache_info_metric": ("--cache-info-metric", "vllm:cache_config_info"),
}
"""The reference's engine-metric flags and their defaults (vLLM's names, which this EPP reads)."""

_ZAP_LEVELS = {"debug": "debug", "info": "info", "error": "error", "panic": "error"}
_DEBUG_VERBOSITY = 4  # the reference's logutil.DEBUG: `--v=4` and above log at debug


@dataclass(frozen=True, slots=True)
class ReferenceFlags:
    """What the reference flags asked for, resolved."""

    log_level: str  # debug, info, warning or error
    log_json: bool  # --zap-encoder json (zap's field names), else the plain text format
    metrics_scheme: str = "http"
    metrics_path: str = "/metrics"
    metrics_port: int | None = None  # scrape this port of every endpoint instead of its serving port
    metrics_verify_tls: bool = False  # https: verify the engines' certificates (the reference skips it)
    cert_reload: bool = False


def flag_bool(text: str) -> bool:
    """A boolean flag's value: Go's `strconv.ParseBool` forms (`true`, `t`, `1`, `False`...), and
    `yes`/`on`/`no`/`off`."""
    v = text.strip().lower()
    if v in ("true", "1", "yes", "on", "t"):
        return True
    if v in ("false", "0", "no", "off", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _flag_bool(s: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, help_text: str) -> None:
    s.add_argument(name, type=flag_bool, nargs="?", const=True, default=None, help=help_text)


def add_reference_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "reference EPP flags",
        "taken so that the reference's chart and flags start this EPP (docs/configuration.md)",
    )
    g.add_argument("--config-text", help="the EndpointPickerConfig as text, instead of --config")
    g.add_argument("--v", type=int, default=None, help="log verbosity as the reference's: 4 or more is debug")
    g.add_argument("--zap-log-level", help="debug, info, error, panic, or a verbosity number")
    g.add_argument("--zap-encoder", choices=["json", "console"], help="log format: json lines or text")
    _flag_bool(g, "--zap-devel", "development logging: text format and debug level unless set otherwise")
    g.add_argument("--zap-stacktrace-level", choices=["info", "error", "panic"], help="accepted, no effect")
    g.add_argument(
        "--zap-time-encoding",
        choices=["epoch", "millis", "nano", "iso8601", "rfc3339", "rfc3339nano"],
        help="accepted, no effect (json logs carry epoch seconds)",
    )
    g.add_argument("--model-server-metrics-scheme", choices=["http", "https"], default="http")
    g.add_argument("--model-server-metrics-path", default="/metrics")
    g.add_argument(
        "--model-server-metrics-port", type=int, default=None, help="scrape this port, not the endpoint's"
    )
    _flag_bool(
        g, "--model-server-metrics-https-insecure-skip-verify", "https scrapes skip verification (default)"
    )
    _flag_bool(g, "--enable-cert-reload", "reload --cert-path's files when they change")
    _flag_bool(g, "--ha-enable-leader-election", "accepted: every replica serves (no leader)")
    _flag_bool(g, "--health-checking", "accepted, no effect")
    _flag_bool(g, "--enable-pprof", "accepted, no effect (a Go profiler)")
    _flag_bool(g, "--tracing", "only false: no traces are exported")
    _flag_bool(g, "--metrics-endpoint-auth", "only false: the admin port has no authentication")
    g.add_argument("--refresh-prometheus-metrics-interval", help="accepted, no effect")
    g.add_argument("--metrics-staleness-threshold", help="refused: set it in the config file")
    for dest, (flag, _) in VLLM_METRIC_DEFAULTS.items():
        g.add_argument(flag, dest=dest, default=None, help="only vLLM's default name")


def _refuse(flag: str, message: str) -> ConfigError:
    return ConfigError("flags", "", flag, message)


def resolve(args: argparse.Namespace, log_level_given: bool) -> ReferenceFlags:
    """The reference flags of `args`, checked. `log_level_given`: `--log-level` was on the command line
    (it then wins over `--v` and `--zap-log-level`). Raises ConfigError."""
    if args.config_text == "":  # the reference's default: unset
        args.config_text = None
    if args.config_text is not None and args.config is not None:
        raise _refuse("--config-text", "give --config or --config-text, not both")
    if args.tracing:
        raise _refuse(
            "--tracing", "this EPP exports no OpenTelemetry traces: pass --tracing=false or drop it"
        )
    if args.metrics_endpoint_auth:
        raise _refuse(
            "--metrics-endpoint-auth",
            "the admin port (/metrics, /debug) has no authentication here: pass "
            "--metrics-endpoint-auth=false and keep the port inside the cluster (a NetworkPolicy), see "
            "docs/deployment.md",
        )
    if args.metrics_staleness_threshold is not None:
        raise _refuse(
            "--metrics-staleness-threshold",
            "set saturationDetector.metricsStalenessThreshold and the metrics-staleness-filter's maxAge in "
            "the config file instead",
        )
    for dest, (flag, default) in VLLM_METRIC_DEFAULTS.items():
        value = getattr(args, dest)
        if value is not None and value != default:
            raise _refuse(
                flag,
                f"only {default!r} (vLLM's name) is taken: this EPP reads vLLM's and SGLang's own metric "
                f"names (docs/metrics.md), got {value!r}",
            )
    if args.refresh_prometheus_metrics_interval is not None:
        from epp.durations import parse_duration

        try:
            parse_duration(args.refresh_prometheus_metrics_interval)
        except ValueError as err:
            raise _refuse("--refresh-prometheus-metrics-interval", str(err)) from None
    port = args.model_server_metrics_port
    if port == 0:  # the reference's default: the endpoint's own port
        port = None
    if port is not None and not 0 < port < 65536:
        raise _refuse("--model-server-metrics-port", f"must be 1-65535 (0: the endpoint's port), got {port}")
    path = args.model_server_metrics_path
    if not path.startswith("/") or any(c.isspace() for c in path) or "?" in path or "#" in path:
        raise _refuse("--model-server-metrics-path", f"must be a URL path starting with '/', got {path!r}")
    return ReferenceFlags(
        log_level=_log_level(args, log_level_given),
        log_json=args.zap_encoder == "json",
        metrics_scheme=args.model_server_metrics_scheme,
        metrics_path=path,
        metrics_port=port,
        metrics_verify_tls=args.model_server_metrics_https_insecure_skip_verify is False,
        cert_reload=bool(args.enable_cert_reload) and bool(args.cert_path),  # (self-signed: never changes)
    )


def _log_level(args: argparse.Namespace, log_level_given: bool) -> str:
    if log_level_given:
        return str(args.log_level)
    if args.zap_log_level is not None:
        z = args.zap_log_level.strip().lower()
        if z in _ZAP_LEVELS:
            return _ZAP_LEVELS[z]
        try:
            verbosity = int(z)
        except ValueError:
            verbosity = -1
        if verbosity < 0:
            raise _refuse(
                "--zap-log-level",
                f"expected debug, info, error, panic or a number >= 0, got {args.zap_log_level!r}",
            )
        return "debug" if verbosity >= _DEBUG_VERBOSITY else "info"
    if args.v is not None:
        return "debug" if args.v >= _DEBUG_VERBOSITY else "info"
    if args.zap_devel:
        return "debug"
    return str(args.log_level)


def log_level_given(argv: list[str]) -> bool:
    """Whether `--log-level` is on the command line (as `--log-level X` or `--log-level=X`)."""
    return any(a == "--log-level" or a.startswith("--log-level=") for a in argv)


def notes(args: argparse.Namespace) -> list[str]:
    """Log lines (info) for reference flags taken that change nothing here."""
    out = []
    if args.ha_enable_leader_election:
        out.append(
            "--ha-enable-leader-election: every replica serves (each keeps its own KV index and load view); "
            "no leader is elected"
        )
    if args.enable_pprof:
        out.append("--enable-pprof: no Go profiler here; profile the process with py-spy")
    return out


__all__ = ["ReferenceFlags", "add_reference_flags", "log_level_given", "notes", "resolve"]
