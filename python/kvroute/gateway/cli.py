"""``kvroute serve``: argument parsing for the gateway and the process that runs it.
Registered on the ``kvroute`` command by ``add_serve_parser``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvroute.cli_args import OneLineErrors, file_in_existing_dir, integer, number, port
from kvroute.router_flags import add_router_flags, router_options

__all__ = ["add_epp_parser", "add_serve_parser", "build_gateway", "cmd_epp", "cmd_serve"]


def _mapping(values: Sequence[str] | None, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values or ():
        url, sep, endpoint = v.partition("=")
        if not sep or not url or not endpoint:
            raise argparse.ArgumentTypeError(f"{flag} expects WORKER_URL=tcp://HOST:PORT, got {v!r}")
        out[url.rstrip("/")] = endpoint
    return out


def add_serve_parser(sub: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible gateway in front of vLLM/SGLang workers",
        description="Cache-aware OpenAI-compatible gateway: /v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics and an admin API (see docs/gateway.md).",
    )
    _add_gateway_arguments(p, epp=False)
    p.set_defaults(func=cmd_serve)
    return p


def add_epp_parser(sub: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "epp",
        help="run the Gateway API Inference Extension endpoint picker (Envoy ext_proc) for vLLM/SGLang workers",
        description="Endpoint picker for Envoy-based gateways (Envoy Gateway, kgateway, Istio, plain Envoy): Envoy's external "
        "processor on --grpc-port picks each request's worker on the kvroute Router; /metrics, /health and the admin API on "
        "--port (see docs/epp.md).",
    )
    _add_gateway_arguments(p, epp=True)
    p.set_defaults(func=cmd_epp)
    return p


def _add_gateway_arguments(p: argparse.ArgumentParser, *, epp: bool) -> None:
    """The flags ``kvroute serve`` and ``kvroute epp`` share (the picker: unified workers only)."""
    g = p.add_argument_group("workers")
    g.add_argument("--worker", action="append", metavar="URL", default=[], help="unified engine base URL (repeatable)")
    if epp:
        g.add_argument(
            "--endpoints-file",
            type=file_in_existing_dir,
            metavar="PATH",
            help="file listing the workers (host:port or URLs, one per line or a JSON list), re-read as it changes: "
            "on Kubernetes, kept current from the InferencePool's pods by a sidecar (deploy/); until it exists, "
            "there are no workers (requests get 503)",
        )
        g.add_argument(
            "--endpoints-interval", type=number(0, above=True), default=1.0, metavar="S", help="re-read --endpoints-file every S s"
        )
        g.add_argument(
            "--kv-events-port",
            type=port,
            metavar="PORT",
            help="every worker publishes KV events on tcp://its-host:PORT (workers from --endpoints-file included)",
        )
    else:
        _add_pd_arguments(g)
    _add_common_arguments(p, g, epp=epp)


def _add_pd_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--prefill",
        action="append",
        nargs="+",
        metavar=("URL", "BOOTSTRAP_PORT"),
        default=[],
        help="PD prefill engine URL, optionally followed by its SGLang bootstrap port (default 8998); repeatable",
    )
    g.add_argument("--decode", action="append", metavar="URL", default=[], help="PD decode engine URL (repeatable)")
    g.add_argument(
        "--pd-convention", choices=("vllm", "sglang"), default="vllm", help="PD handshake: vllm (kv_transfer_params) or sglang (bootstrap)"
    )


def _add_common_arguments(p: argparse.ArgumentParser, g: argparse._ArgumentGroup, *, epp: bool) -> None:
    g.add_argument(
        "--prefill-tokens-per-s",
        type=number(0, above=True),
        default=20000.0,
        help="engines' prefill speed the router assumes (default 20000)",
    )
    g.add_argument(
        "--prefix-cache-blocks",
        type=integer(0),
        metavar="N",
        help="each unified/prefill engine's prefix-cache size in KV blocks (vLLM: num_gpu_blocks - 1), which the "
        "default policy charges evictions against (default: unknown, not charged)",
    )
    if not epp:
        add_router_flags(
            g,
            ["local_prefill_max_tokens"],
            local_prefill_max_tokens="PD, vLLM convention: prompts with at most N uncached tokens are prefilled on the decode "
            "engine (default 0: always disaggregate)",
        )
    r = p.add_argument_group(
        "routing", 'Router parameters (docs/router.md); defaults: the Router\'s "gateway" preset with --kv-events, else "gateway_approx"'
    )
    add_router_flags(
        r,
        ["policy", "ttft_slo", "tpot_slo", "reject", "pending_prefixes", "stale_overlaps", "token_share_bound", "block_size"],
        preset="gateway",
        ttft_slo="TTFT SLO in seconds; requests predicted to miss it get 429 (default: none)",
        pending_prefixes="count a routed request's prefix on its worker until its KV events can have arrived (default: on "
        "with --kv-events; off without, as routed prefixes then go into the index directly, --approx-ttl)",
        stale_overlaps="correct a queued request's predicted prefill when its worker reports evicting blocks it was "
        "routed as holding (default: on with --kv-events; off without, as there are no such reports)",
        block_size="tokens per KV block (default 16 with --kv-events, where it must equal the engines'; else 64)",
    )
    r.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json (or its directory, with tokenizer_config.json): exact token routing")
    r.add_argument(
        "--kv-events", action="append", metavar="WORKER_URL=tcp://HOST:PORT", help="subscribe to a worker's KV-event publisher (repeatable)"
    )
    r.add_argument(
        "--kv-events-replay", action="append", metavar="WORKER_URL=tcp://HOST:PORT", help="the worker's KV-event replay endpoint"
    )
    r.add_argument(
        "--approx-ttl",
        type=number(0, above=True),
        default=120.0,
        help="without KV events: seconds a routed prefix is assumed cached (default 120)",
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    if epp:
        s.add_argument("--grpc-port", type=port, default=9002, help="the picker's gRPC port: Envoy ext_proc and gRPC health (default 9002)")
        s.add_argument("--port", type=port, default=9090, help="HTTP port of /metrics, /health and /admin (default 9090; 0: any)")
    else:
        s.add_argument("--port", type=port, default=8000, help="listen port (default 8000; 0: any free port)")
    s.add_argument(
        "--admin-token",
        default=os.environ.get("KVROUTE_ADMIN_TOKEN"),
        help="bearer token for /admin (default $KVROUTE_ADMIN_TOKEN; admin API off without it)",
    )
    s.add_argument("--max-body-bytes", type=integer(1), default=32 * 1024 * 1024, help="largest request body accepted (413 above)")
    s.add_argument("--max-client-concurrency", type=integer(1), default=256, help="concurrent requests per client (429 above)")
    s.add_argument("--max-in-flight", type=integer(1), default=10000, help="concurrent requests in total (429 above)")
    s.add_argument("--client-key-header", default=None, help="header identifying the client (default: its IP address)")
    s.add_argument(
        "--max-retries",
        type=integer(0, 100),
        default=2,
        help="fallback endpoints after the pick (default 2)"
        if epp
        else "retries on another worker before any byte reached the client (default 2)",
    )
    s.add_argument("--connect-timeout", type=number(0, above=True), default=5.0, help="seconds to connect to an engine (default 5)")
    s.add_argument(
        "--read-timeout",
        type=number(0, above=True),
        default=600.0,
        help="longest silence of the gateway on a picked request before its load is released (seconds)"
        if epp
        else "longest upstream silence between chunks (seconds)",
    )
    s.add_argument(
        "--client-timeout",
        type=number(0, above=True),
        default=30.0,
        help="longest a client may take to send a request's head and body (seconds)",
    )
    s.add_argument(
        "--health-interval",
        type=number(0, above=True),
        default=2.0,
        help="health probe period (seconds): unhealthy workers until they answer, healthy ones to notice one that stopped",
    )
    s.add_argument(
        "--metrics-interval", type=number(0), default=0.0, help="poll engines' /metrics into the router every S seconds (0: off)"
    )
    s.add_argument("--model", action="append", default=[], help="model name(s) /v1/models reports when no worker answers")
    s.add_argument(
        "--models-interval",
        type=number(0),
        default=30.0,
        metavar="S",
        help="re-read each worker's /v1/models (the models and LoRA adapters it serves; requests go only to workers "
        "serving their model) every S seconds (default 30; 0: every worker serves every model)",
    )
    s.add_argument(
        "--worker-models",
        action="append",
        default=[],
        metavar="URL=MODEL[,MODEL...]",
        help="the models a worker serves, instead of reading its /v1/models; write a LoRA adapter as lora:NAME (repeatable)",
    )
    s.add_argument("--ca-file", metavar="PEM", help="extra CA certificates trusted for https:// workers (beside the system's)")
    s.add_argument(
        "--threads", type=integer(1, 256), default=1, help="runtime threads of the data plane (default 1: lowest latency on small machines)"
    )
    if epp:
        s.add_argument(
            "--drain-seconds",
            type=number(0),
            default=3.0,
            metavar="S",
            help="on SIGTERM, report not ready for S s (the gateway's health check moves traffic off), then finish the "
            "requests in flight, then stop (default 3; the bootstrap in deploy/ checks every 1 s)",
        )
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def build_gateway(a: argparse.Namespace) -> Any:
    """The Gateway ``kvroute serve`` runs, from parsed arguments."""
    from kvroute import Router
    from kvroute.gateway.app import GatewayConfig, WorkerConfig, make_gateway

    epp = getattr(a, "command", None) == "epp"
    if epp:
        a.prefill, a.decode, a.pd_convention = [], [], "vllm"
    kv_events = _mapping(a.kv_events, "--kv-events")
    kv_events_port = getattr(a, "kv_events_port", None)
    endpoints_file = getattr(a, "endpoints_file", None)
    router_kw = router_options(a)
    local = router_kw.get("local_prefill_max_tokens", 0)
    if local < 0:
        raise argparse.ArgumentTypeError(f"--local-prefill-max-tokens must be >= 0, got {local}")
    if local and a.pd_convention == "sglang":
        raise argparse.ArgumentTypeError("--local-prefill-max-tokens needs --pd-convention vllm (SGLang decode servers need a bootstrap)")
    # Without KV events the gateway stores each routed prefix in the index itself (approx_ttl): pending
    # prefixes would only duplicate that, and a removal is its own TTL dropping a guess, not an eviction.
    router = Router(preset="gateway" if kv_events or kv_events_port else "gateway_approx", **router_kw)
    tps = a.prefill_tokens_per_s
    pcb = a.prefix_cache_blocks
    if pcb is not None and pcb < 0:
        raise argparse.ArgumentTypeError(f"--prefix-cache-blocks must be >= 0, got {pcb}")
    prefill = []
    for spec in a.prefill:
        if len(spec) > 2:
            raise argparse.ArgumentTypeError(f"--prefill takes URL [BOOTSTRAP_PORT], got {spec}")
        port = integer(1, 65535)(spec[1]) if len(spec) == 2 else None
        prefill.append(WorkerConfig(spec[0], role="prefill", bootstrap_port=port, prefill_tokens_per_s=tps, prefix_cache_blocks=pcb))
    if bool(prefill) != bool(a.decode):
        raise argparse.ArgumentTypeError("PD mode needs both --prefill and --decode workers")
    if epp and not (a.worker or endpoints_file):
        raise argparse.ArgumentTypeError("give at least one --worker, or --endpoints-file")
    if not epp and not (a.worker or prefill):
        raise argparse.ArgumentTypeError("give at least one --worker, or --prefill and --decode workers")
    cfg = GatewayConfig(
        pd_convention=a.pd_convention,
        tokenizer=a.tokenizer,
        kv_events=kv_events,
        kv_events_replay=_mapping(a.kv_events_replay, "--kv-events-replay"),
        approx_ttl=a.approx_ttl,
        admin_token=a.admin_token or None,  # an empty $KVROUTE_ADMIN_TOKEN means no admin API
        max_body_bytes=a.max_body_bytes,
        max_client_concurrency=a.max_client_concurrency,
        max_in_flight=a.max_in_flight,
        client_key_header=a.client_key_header,
        max_retries=a.max_retries,
        connect_timeout=a.connect_timeout,
        read_timeout=a.read_timeout,
        client_timeout=a.client_timeout,
        health_interval=a.health_interval,
        metrics_interval=a.metrics_interval,
        models=tuple(a.model),
        models_interval=a.models_interval,
        ca_file=a.ca_file,
        threads=a.threads,
        kv_events_port=kv_events_port,
        endpoints_file=endpoints_file,
        endpoints_interval=getattr(a, "endpoints_interval", 1.0),
        drain_seconds=getattr(a, "drain_seconds", 0.0),
    )
    served = _worker_models(a.worker_models, set(a.worker) | {p.url for p in prefill} | set(a.decode))

    def models(url: str) -> dict[str, Any]:
        names = served.get(url.rstrip("/"))
        if names is None:
            return {}
        return {"models": tuple(n.removeprefix("lora:") for n in names), "adapters": tuple(n[5:] for n in names if n.startswith("lora:"))}

    prefill = [replace(p, **models(p.url)) for p in prefill]
    return make_gateway(
        router,
        [WorkerConfig(u, prefill_tokens_per_s=tps, prefix_cache_blocks=pcb, **models(u)) for u in a.worker],
        prefill=prefill,
        decode=[WorkerConfig(u, role="decode", prefill_tokens_per_s=tps, **models(u)) for u in a.decode],
        config=cfg,
        endpoint_template=WorkerConfig("http://127.0.0.1", prefill_tokens_per_s=tps, prefix_cache_blocks=pcb),
    )


def _worker_models(specs: list[str], urls: set[str]) -> dict[str, list[str]]:
    """``--worker-models URL=MODEL[,MODEL...]`` as url -> model names."""
    known = {u.rstrip("/") for u in urls}
    out: dict[str, list[str]] = {}
    for spec in specs:
        url, sep, names = spec.rpartition("=")
        url = url.rstrip("/")
        models = [n.strip() for n in names.split(",") if n.strip()]
        if not sep or not url or not models or any(n == "lora:" for n in models):
            raise argparse.ArgumentTypeError(f"--worker-models takes URL=MODEL[,MODEL...], got {spec!r}")
        if url not in known:
            raise argparse.ArgumentTypeError(f"--worker-models names {url}, which is not a configured worker")
        out[url] = models
    return out


def cmd_serve(a: argparse.Namespace) -> int:
    return _run(a, "serve", None)


def cmd_epp(a: argparse.Namespace) -> int:
    return _run(a, "epp", a.grpc_port)


def _run(a: argparse.Namespace, command: str, epp_port: int | None) -> int:
    import asyncio

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        gw = build_gateway(a)
    except (argparse.ArgumentTypeError, ValueError, TypeError, OSError) as e:
        print(f"kvroute {command}: error: {e}", file=sys.stderr, flush=True)
        return 2
    return asyncio.run(_serve(gw, a.host, a.port, command, epp_port))


async def _serve(gw: Any, host: str, port: int, command: str = "serve", epp_port: int | None = None) -> int:
    import asyncio
    import signal

    def ready(url: str) -> None:
        mode = "exact" if gw.config.tokenizer else "approximate"
        if epp_port is None:
            print(f"======== kvroute gateway on {url} (Rust data plane, {mode} prompts) ========", flush=True)
        else:
            print(f"======== kvroute endpoint picker on grpc://{gw.epp_address} ({mode} prompts; metrics on {url}) ========", flush=True)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = asyncio.ensure_future(gw.serve(host, port, ready, epp_port=epp_port))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait((server, stopper), return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if server.done():
        e = server.exception()
        # The address is taken, or another start-up failure: one line (the plane names the address).
        why = str(e) or repr(e)
        print(f"kvroute {command}: error: {why}", file=sys.stderr, flush=True)
        return 2
    server.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await server
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvroute.gateway.cli`` (same as ``kvroute serve``)."""
    parser = OneLineErrors(prog="kvroute")
    sub = parser.add_subparsers(dest="command", parser_class=OneLineErrors)
    add_serve_parser(sub)
    a = parser.parse_args(["serve", *(argv if argv is not None else sys.argv[1:])])
    return int(a.func(a))


if __name__ == "__main__":
    raise SystemExit(main())
