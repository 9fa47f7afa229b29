"""`epp` command line: flags (Go-style like the reference EPP where they exist) -> server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Sequence

from epp.clock import MonotonicClock
from epp.config import (
    EppConfig,
    StaticEndpoint,
    build_scheduler,
    default_config,
    load_config,
    parse_config,
    parse_endpoint_address,
)
from epp.config_sections import ConfigError
from epp.costmodel.service import SERVICE_KEY as COST_KEY
from epp.costmodel.service import CostModel
from epp.discovery.flags import add_discovery_flags, discovery_settings
from epp.discovery.settings import DiscoverySettings
from epp.durations import parse_duration
from epp.kvindex.freshness import FreshnessTracker
from epp.kvindex.index import BlockIndex
from epp.kvindex.prompt import TokenizerError, TokenizerRegistry
from epp.kvindex.server_chat import TokenizerSpec
from epp.kvindex.service import SERVICE_KEY, KvIndexService
from epp.log_format import configure as configure_logging
from epp.reference_flags import (
    ReferenceFlags,
    add_reference_flags,
    flag_bool,
    log_level_given,
    notes,
    resolve,
)
from epp.scheduling.builtin import default_registry
from epp.server.numba_cache import cache_dir, seed_cache
from epp.tenancy import TenantSalter


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _endpoints(text: str) -> list[StaticEndpoint]:
    out = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            out.append(StaticEndpoint(parse_endpoint_address(part)))
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    if not out:
        raise argparse.ArgumentTypeError("--endpoints needs at least one ip:port")
    return out


def _tokenizer(text: str) -> tuple[str, str]:
    model, sep, path = text.partition("=")
    if not sep or not model or not path:
        raise argparse.ArgumentTypeError(f"expected MODEL=DIR, got {text!r}")
    return model, path


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"port out of range: {port}")
    return port


def _bytes(text: str) -> int:
    units = {"k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2, "g": 1024**3, "gib": 1024**3}
    t = text.strip().lower()
    size: int | None = None
    for suffix in sorted(units, key=len, reverse=True):
        if t.endswith(suffix) and t[: -len(suffix)].strip().isdigit():
            size = int(t[: -len(suffix)]) * units[suffix]
            break
    else:
        if t.isdigit():
            size = int(t)
    if size is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 32MiB or 1048576)")
    if size <= 0:
        raise argparse.ArgumentTypeError(
            f"must be more than 0 bytes, got {text!r} (every request body would get 413)"
        )
    return size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epp", description="Cache-aware Endpoint Picker for LLM inference")
    sub = p.add_subparsers(dest="command", required=True)
    # No abbreviated flags (`--log` for `--log-level`): the reference's pflag takes none, and the
    # reference flags' precedence reads the command line by the full names.
    s = sub.add_parser("serve", help="serve the ext_proc Endpoint Picker", allow_abbrev=False)
    s.add_argument("--config", "--config-file", dest="config", help="EndpointPickerConfig YAML file")
    s.add_argument("--endpoints", type=_endpoints, default=[], help="comma-separated ip:port list")
    s.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    s.add_argument("--grpc-port", type=_port, default=9002)
    s.add_argument("--grpc-health-port", type=_port, default=9003)
    s.add_argument("--metrics-port", type=_port, default=9090)
    s.add_argument(
        "--secure-serving",
        type=flag_bool,
        nargs="?",
        const=True,
        default=True,
        help="serve ext_proc over TLS (default true; self-signed unless --cert-path)",
    )
    s.add_argument("--cert-path", help="directory with tls.crt and tls.key")
    s.add_argument(
        "--refresh-metrics-interval",
        type=_duration,
        default=0.05,
        help="how often to scrape each endpoint's /metrics (default 50ms; 0 disables)",
    )
    s.add_argument("--metrics-timeout", type=_duration, default=1.0, help="per-scrape timeout (default 1s)")
    s.add_argument(
        "--unhealthy-after",
        type=int,
        default=3,
        help="consecutive failed scrapes before an endpoint stops receiving traffic (default 3)",
    )
    s.add_argument(
        "--max-body-size",
        type=_bytes,
        default=32 * 1024 * 1024,
        help="largest request body accepted; larger gets 413 (default 32MiB). With request_body_mode "
        "BUFFERED, Envoy's own buffer limit (per_connection_buffer_limit_bytes, 1MiB by default) "
        "answers 413 first: see docs/operations.md",
    )
    s.add_argument(
        "--max-buffered-body-size",
        type=_bytes,
        default=1024**3,
        help="request bodies all streams may hold at once; a chunk past it ends its request with 503 "
        "(default 1GiB: size it below the memory limit)",
    )
    s.add_argument(
        "--request-body-timeout",
        type=_duration,
        default=60.0,
        help="a request body not complete this long after its headers is refused (408) and what it held "
        "is freed for other requests (default 60s; 0: no limit)",
    )
    s.add_argument(
        "--shutdown-grace",
        type=_duration,
        default=1.0,
        help="on SIGTERM, how long open ext_proc streams (responses still streaming) may finish "
        "before they are cut (default 1s; match it to the pod's termination grace period)",
    )
    add_discovery_flags(s)
    s.add_argument("--seed", type=int, default=None, help="seed for tie-breaking (default: random)")
    s.add_argument(
        "--enable-debug-endpoints",
        type=flag_bool,
        nargs="?",
        const=True,
        default=True,
        help="serve /debug/* on the metrics port (default true)",
    )
    s.add_argument(
        "--kv-events-mode",
        choices=["per-pod", "central", "off"],
        help="receive engine KV events: per-pod SUB sockets, one central bound SUB, or off "
        "(default: the config's kvEvents.mode, else off)",
    )
    s.add_argument("--kv-events-port", type=_port, help="per-pod: the engines' publisher port (default 5557)")
    s.add_argument("--kv-events-bind", help="central: where to bind, e.g. tcp://*:5557")
    s.add_argument(
        "--kv-events-verify-peer",
        type=flag_bool,
        nargs="?",
        const=True,
        default=None,
        help="central: drop messages whose topic names another host than the publisher connected from "
        "(default: the config's kvEvents.verifyPeer, else false)",
    )
    s.add_argument(
        "--kv-events-replay-port",
        type=_port,
        help="the engines' replay (ROUTER) port, in both modes (+ dp rank)",
    )
    s.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        type=_tokenizer,
        metavar="MODEL=DIR",
        help="local tokenizer directory (tokenizer.json) for a model; repeatable",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_reference_flags(s)
    c = sub.add_parser("check-config", help="validate an EndpointPickerConfig file and exit")
    c.add_argument("file")
    c.add_argument(
        "--skip-tokenizers",
        action="store_true",
        help="do not load the `tokenizers` directories (check a deployment's config off the machine "
        "that has them); their entries are still checked for shape",
    )
    c.add_argument(
        "--skip-secrets",
        action="store_true",
        help="do not read the `tenancy` secret (its file or environment variable exists only in the pod); "
        "the section is still checked for shape",
    )
    sub.add_parser("plugins", help="list the plugin types this build knows")
    sub.add_parser(
        "warm-up",
        help="compile the index's loops into numba's cache (NUMBA_CACHE_DIR) and exit: an image runs it at "
        "build time, so that its pods load the code instead of compiling it (docs/deployment.md)",
    )
    from epp.demo.runner import add_arguments as add_demo_arguments

    d = sub.add_parser("demo", help="simulated vLLM pods, the EPP and Envoy: default profile vs round-robin")
    add_demo_arguments(d)
    return p


def _load(args: argparse.Namespace) -> EppConfig:
    """The config file (or the built-in default), with the KV-event and tokenizer flags applied over it."""
    if args.config_text is not None:
        cfg = parse_config(args.config_text, "--config-text")
    else:
        cfg = load_config(args.config) if args.config else default_config()
    kv = cfg.kv_events
    overrides: dict[str, object] = {}
    for flag, field in (
        ("kv_events_mode", "mode"),
        ("kv_events_port", "port"),
        ("kv_events_bind", "bind"),
        ("kv_events_replay_port", "replay_port"),
        ("kv_events_verify_peer", "verify_peer"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides[field] = value
    kv = dataclasses.replace(kv, **overrides)  # type: ignore[arg-type]
    problem = kv.check()
    if problem is not None:
        raise ConfigError("flags", "kv events", problem[0], problem[1])
    tokenizers = dict(cfg.tokenizers)
    for model, path in args.tokenizer:  # a directory given for a model with server chat settings keeps them
        entry = tokenizers.get(model)
        if isinstance(entry, TokenizerSpec):
            tokenizers[model] = dataclasses.replace(entry, path=path)
        else:
            tokenizers[model] = path
    return dataclasses.replace(cfg, kv_events=kv, tokenizers=tokenizers)


def _check(cfg: EppConfig, *, tokenizers: bool = True, secrets: bool = True) -> None:
    """Build the scheduler as `epp serve` does (with the KV index and cost model services); `tokenizers`:
    load the tokenizer directories too; `secrets`: read the tenancy secret as `epp serve` does (a
    missing or short secret raises ValueError, as there)."""
    if secrets and cfg.tenancy is not None:
        from epp.server.app import read_secret

        t = cfg.tenancy
        TenantSalter(t.header, read_secret(t, os.environ), t.missing)
    kv = KvIndexService(
        BlockIndex(block_size=cfg.index.block_size, max_entries=cfg.index.max_entries),
        FreshnessTracker(),
        TokenizerRegistry(cfg.tokenizers if tokenizers else {}),
        cfg.index.block_size,
    )
    services = {SERVICE_KEY: kv, COST_KEY: CostModel(cfg.cost_model)}
    build_scheduler(cfg, default_registry(), MonotonicClock(), random.Random(0), services=services)


async def _serve(
    args: argparse.Namespace, cfg: EppConfig, ref: ReferenceFlags, discovery: DiscoverySettings | None = None
) -> None:
    from epp.server.app import EppServer, ServerSettings

    settings = ServerSettings(
        host=args.host,
        grpc_port=args.grpc_port,
        grpc_health_port=args.grpc_health_port,
        metrics_port=args.metrics_port,
        secure_serving=args.secure_serving,
        cert_path=args.cert_path,
        refresh_metrics_interval=args.refresh_metrics_interval,
        metrics_timeout=args.metrics_timeout,
        unhealthy_after_failures=args.unhealthy_after,
        max_body_bytes=args.max_body_size,
        max_buffered_body_bytes=args.max_buffered_body_size,
        request_body_timeout=args.request_body_timeout,
        pool_name=args.pool_name or "default",
        seed=args.seed,
        debug_endpoints=args.enable_debug_endpoints,
        discovery=discovery,
        engine_metrics_scheme=ref.metrics_scheme,
        engine_metrics_path=ref.metrics_path,
        engine_metrics_port=ref.metrics_port,
        engine_metrics_verify_tls=ref.metrics_verify_tls,
        cert_reload=ref.cert_reload,
    )
    server = EppServer(settings, cfg, args.endpoints)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await server.start()
    try:
        await stop.wait()
    finally:
        await server.stop(grace=args.shutdown_grace)


def _warm_up() -> int:
    from numba.core.dispatcher import Dispatcher

    from epp.kvindex import compiled

    t0 = time.perf_counter()
    compiled.warm_up()
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("epp.") and m is not None]
    loops = {v for m in modules for v in vars(m).values() if isinstance(v, Dispatcher)}
    signatures = sum(len(d.signatures) for d in loops)
    print(
        f"epp warm-up: {len(loops)} compiled loops, {signatures} signatures, ready in {cache_dir()} "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from epp.demo.runner import main as demo_main

        return demo_main(args)
    if args.command == "warm-up":
        return _warm_up()
    if args.command == "plugins":
        for spec in default_registry().types():
            print(f"{spec.type_name:32} {spec.kind:16} {spec.doc}")
        return 0
    try:
        if args.command == "check-config":
            _check(load_config(args.file), tokenizers=not args.skip_tokenizers, secrets=not args.skip_secrets)
            flags = (("tokenizers", args.skip_tokenizers), ("secrets", args.skip_secrets))
            skipped = [what for what, skip in flags if skip]
            print(f"{args.file}: ok" + (f" ({' and '.join(skipped)} not loaded)" if skipped else ""))
            return 0
        ref = resolve(args, log_level_given(argv))
        cfg = _load(args)
        if args.unhealthy_after < 1:
            raise ConfigError("flags", "", "--unhealthy-after", "must be >= 1")
        discovery = discovery_settings(args, cfg, os.environ)
        if not cfg.endpoints and not args.endpoints and discovery is None:
            raise ConfigError(
                cfg.source,
                "",
                "endpoints",
                "no endpoints: pass --endpoints, list them in the config, "
                "or --pool-name / --endpoint-selector for Kubernetes discovery",
            )
        configure_logging(ref.log_level, ref.log_json)
        for note in notes(args):
            logging.getLogger("epp").info("%s", note)
        seed_cache(os.environ)  # before the warm-up: the image's compiled code, when it carries some
        asyncio.run(_serve(args, cfg, ref, discovery))
    except ConfigError as err:
        print(f"epp: config error: {err}", file=sys.stderr)
        return 2
    except TokenizerError as err:
        print(f"epp: tokenizer error: {err}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:
        print(f"epp: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
