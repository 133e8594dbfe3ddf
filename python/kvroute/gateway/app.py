"""The gateway's control plane: configuration, health probes and the admin API, around the Rust
data plane (``kvroute._core.DataPlane``) that serves every client request. Its engines (the worker
table, KV events, what their /metrics say) are a ``kvroute.fleet.Fleet``, as the integrations' are.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kvroute._core import DataPlane, KvrouteError, Router
from kvroute.fleet import Engine, Fleet, check_prefix_cache_blocks

__all__ = ["Gateway", "GatewayConfig", "WorkerConfig", "make_gateway", "read_endpoints", "run", "serve"]

log = logging.getLogger("kvroute.gateway")

ROLES = ("both", "prefill", "decode")
PD_CONVENTIONS = ("vllm", "sglang")
_NETWORK_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True)
class WorkerConfig:
    """One engine the gateway may route to. ``bootstrap_port``: SGLang PD prefill servers only
    (their ``--disaggregation-bootstrap-port``, 8998 by default)."""

    url: str
    role: str = "both"
    bootstrap_port: int | None = None
    prefill_tokens_per_s: float = 20000.0
    decode_tokens_per_s: float | None = None
    kv_capacity_blocks: int | None = None
    #: The engine's prefix-cache size in KV blocks (vLLM: ``num_gpu_blocks`` minus its null block),
    #: what the default policy ("capacity") charges evictions against; None: read from the engine's
    #: /metrics (vLLM's ``cache_config_info``) when ``metrics_interval`` polls it, else not charged.
    prefix_cache_blocks: int | None = None
    #: The models the engine serves (its base model and LoRA adapters, as its /v1/models names them);
    #: None: read from its /v1/models every ``models_interval``. Requests naming a model go only to
    #: workers serving it.
    models: tuple[str, ...] | None = None
    #: Which of ``models`` are LoRA adapters (their blocks are keyed by the adapter).
    adapters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.models is not None:
            object.__setattr__(self, "models", tuple(self.models))
            if not self.models or not all(isinstance(m, str) and m for m in self.models):
                raise ValueError(f"worker models must be a non-empty list of model names, got {self.models!r}")
        object.__setattr__(self, "adapters", tuple(self.adapters))
        if self.adapters and not set(self.adapters) <= set(self.models or ()):
            raise ValueError(f"worker adapters must be among its models, got {self.adapters!r} (models {self.models!r})")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"worker url must be http(s)://host[:port], got {self.url!r}")
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.role!r}")
        if self.bootstrap_port is not None and not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"bootstrap_port must be a TCP port (1..65535), got {self.bootstrap_port}")
        check_prefix_cache_blocks(self.prefix_cache_blocks)
        object.__setattr__(self, "url", self.url.rstrip("/"))


@dataclass
class GatewayConfig:
    """Gateway behaviour; every field has a ``kvroute serve`` flag of the same name."""

    pd_convention: str = "vllm"
    tokenizer: str | None = None
    kv_events: Mapping[str, str] = field(default_factory=dict)  # worker url -> ZMQ publisher endpoint
    kv_events_replay: Mapping[str, str] = field(default_factory=dict)
    approx_ttl: float = 120.0  # seconds a routed prefix is assumed cached (when no KV events arrive)
    insert_decisions: bool | None = None  # store routed prefixes in the index with approx_ttl (None: when no kv_events)
    admin_token: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    max_client_concurrency: int = 256
    max_in_flight: int = 10_000
    client_key_header: str | None = None  # trust this header (e.g. X-Api-Key) as the client's identity
    max_retries: int = 2
    connect_timeout: float = 5.0
    read_timeout: float = 600.0  # longest silence between two upstream chunks
    client_timeout: float = 30.0  # longest a client may take to send a request's head and body (slow clients are closed)
    health_interval: float = 2.0  # probe period of workers (unhealthy ones until they answer, healthy ones to notice a silent one)
    health_timeout: float = 2.0
    metrics_interval: float = 0.0  # poll engines' /metrics every this many seconds (0: off)
    models: tuple[str, ...] = ()  # /v1/models fallback when no worker answers
    models_interval: float = 30.0  # re-read each worker's /v1/models (its model pool) every S seconds (0: no pools)
    ca_file: str | None = None  # extra PEM certificates trusted for https:// workers
    threads: int = 1  # the data plane's runtime threads
    #: Every worker without a ``kv_events`` entry publishes KV events on tcp://its-host:this-port
    #: (workers that come and go, as an endpoint picker's pods do); None: only ``kv_events``.
    kv_events_port: int | None = None
    #: A file listing the workers (``host:port`` or URLs, one per line or a JSON list), re-read
    #: every ``endpoints_interval`` s: workers appear and go as it changes (docs/epp.md).
    endpoints_file: str | None = None
    endpoints_interval: float = 1.0
    #: The endpoint picker's drain on stop: it reports not ready for this long (a gateway that
    #: health-checks it stops sending it requests), then until its requests in flight end (bounded
    #: by 30 s more), before it stops. 0: stop at once.
    drain_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.pd_convention not in PD_CONVENTIONS:
            raise ValueError(f"pd_convention must be one of {PD_CONVENTIONS}, got {self.pd_convention!r}")
        for name in ("max_body_bytes", "max_client_concurrency", "max_in_flight", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        for name in ("connect_timeout", "read_timeout", "client_timeout", "health_interval", "health_timeout", "approx_ttl"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.models_interval < 0:
            raise ValueError(f"models_interval must be >= 0 (0 turns model pools off), got {self.models_interval}")
        if self.metrics_interval < 0:
            raise ValueError(f"metrics_interval must be >= 0 (0 turns polling off), got {self.metrics_interval}")
        if self.kv_events_port is not None and not 0 < self.kv_events_port < 65536:
            raise ValueError(f"kv_events_port must be a TCP port (1..65535), got {self.kv_events_port}")
        if not self.drain_seconds >= 0:
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")
        if not self.endpoints_interval > 0:
            raise ValueError(f"endpoints_interval must be > 0 seconds, got {self.endpoints_interval}")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("admin_token must be at least 8 characters")


class _Worker:
    """A worker as the control plane knows it: its engine in the fleet and its configuration; its
    health and counters live in the data plane."""

    __slots__ = ("cfg", "engine", "gw", "id", "probing")

    def __init__(self, gw: Gateway, engine: Engine, cfg: WorkerConfig) -> None:
        self.gw = gw
        self.engine = engine
        self.id = engine.worker
        self.cfg = cfg
        self.probing = False

    @property
    def url(self) -> str:
        return self.cfg.url

    @property
    def healthy(self) -> bool:
        return bool(self.to_dict()["healthy"])

    def to_dict(self) -> dict[str, Any]:
        return next(r for r in self.gw.plane.workers() if r["id"] == self.id)


def _error(status: int, message: str, kind: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status, headers=headers)


class Gateway:
    """The control plane around one data plane on ``router``: see the module docstring."""

    def __init__(
        self,
        router: Router,
        workers: Iterable[WorkerConfig],
        config: GatewayConfig | None = None,
        *,
        endpoint_template: WorkerConfig | None = None,
    ) -> None:
        self.router = router
        self.config = cfg = config or GatewayConfig()
        #: What a worker read from ``endpoints_file`` is configured as (its url replaced).
        self.endpoint_template = endpoint_template or WorkerConfig("http://127.0.0.1")
        # Without KV events the router learns cache state from its own decisions (approximate mode).
        insert = cfg.insert_decisions if cfg.insert_decisions is not None else not self.has_kv_events
        self.plane = DataPlane(
            router,
            pd_convention=cfg.pd_convention,
            max_body_bytes=cfg.max_body_bytes,
            max_client_concurrency=cfg.max_client_concurrency,
            max_in_flight=cfg.max_in_flight,
            client_key_header=cfg.client_key_header,
            max_retries=cfg.max_retries,
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
            client_timeout=cfg.client_timeout,
            approx_ttl=cfg.approx_ttl if insert else None,
            threads=cfg.threads,
            on_unhealthy=self._plane_marked_unhealthy,
            tokenizer=cfg.tokenizer,
            models=list(cfg.models),
            health_timeout=cfg.health_timeout,
            ca_file=cfg.ca_file,
        )
        if self.plane.template_unsupported is not None:
            log.warning(
                "the chat template does not compile here (%s); chat requests route on approximate hashes", self.plane.template_unsupported
            )
        self.fleet = Fleet(router)
        self.workers: dict[int, _Worker] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._probes: set[asyncio.Task[None]] = set()
        self._admin: web.AppRunner | None = None
        self.session: aiohttp.ClientSession | None = None  # health probes and /metrics polling
        self.url: str | None = None
        for w in workers:
            self.add_worker(w)
        #: The workers ``endpoints_file`` brought (the file's changes add and remove only these).
        self._from_file: set[str] = set()
        if cfg.endpoints_file is not None:
            # A sidecar started beside the picker may not have written the file yet: no workers until it does.
            try:
                urls = read_endpoints(cfg.endpoints_file)
            except FileNotFoundError:
                log.warning("endpoints file %s does not exist yet: no workers until it does", cfg.endpoints_file)
                urls = []
            self.sync_endpoints(urls)
        elif not self.workers:
            raise ValueError("the gateway needs at least one worker (or prefill and decode workers)")
        unknown = set(cfg.kv_events) - {w.url for w in self.workers.values()}
        if unknown:
            raise ValueError(f"kv_events names workers that are not configured: {sorted(unknown)}")

    @property
    def has_kv_events(self) -> bool:
        """Whether the workers' KV events feed the index (else routed prefixes do, approximate mode)."""
        return bool(self.config.kv_events) or self.config.kv_events_port is not None

    # ---- workers -----------------------------------------------------------------------

    def _kv_events_of(self, url: str) -> str | None:
        if url in self.config.kv_events:
            return self.config.kv_events[url]
        port = self.config.kv_events_port
        host = urlsplit(url).hostname
        if port is None or host is None:
            return None
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def sync_endpoints(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """Makes the workers an endpoints file brought exactly ``urls`` (added as
        ``endpoint_template``; workers configured otherwise stay); returns the urls (added,
        removed). Workers that go finish their requests in flight."""
        want = list(dict.fromkeys(u.rstrip("/") for u in urls))
        have = {w.url: w for w in self.workers.values()}
        added = [u for u in want if u not in have]
        removed = sorted(self._from_file - set(want))
        for u in removed:
            self._from_file.discard(u)
            if u in have:
                self.remove_worker(have[u].id)
        for u in added:
            self.add_worker(replace(self.endpoint_template, url=u))
            self._from_file.add(u)
        return added, removed

    async def _endpoints_loop(self) -> None:
        path = cast(str, self.config.endpoints_file)
        last: list[str] | None = None
        while True:
            await asyncio.sleep(self.config.endpoints_interval)
            try:
                urls = read_endpoints(path)
            except (OSError, ValueError) as e:
                if last is not None:
                    log.warning("cannot read the endpoints file (%s); the workers stay as they are", e)
                last = None
                continue
            if urls == last:
                continue
            last = urls
            try:
                added, removed = self.sync_endpoints(urls)
            except (ValueError, KvrouteError) as e:
                log.warning("endpoints file %s: %s; the workers stay as they are", path, e)
                continue
            for u in added:
                log.warning("worker %s added (endpoints file)", u)
                w = next(w for w in self.workers.values() if w.url == u)
                await self.refresh_models(w)
            for u in removed:
                log.warning("worker %s removed (endpoints file)", u)

    def add_worker(self, wc: WorkerConfig) -> _Worker:
        if any(w.url == wc.url for w in self.workers.values()):
            raise ValueError(f"worker {wc.url} is already configured")
        if wc.role == "prefill" and self.config.pd_convention == "sglang" and wc.bootstrap_port is None:
            wc = replace(wc, bootstrap_port=8998)  # SGLang's default --disaggregation-bootstrap-port
        e = self.fleet.add(
            wc.url,
            wc.url,
            role=cast(Any, wc.role),
            kv_events=self._kv_events_of(wc.url),
            kv_events_replay=self.config.kv_events_replay.get(wc.url),
            prefill_tokens_per_s=wc.prefill_tokens_per_s,
            decode_tokens_per_s=wc.decode_tokens_per_s,
            kv_capacity_blocks=wc.kv_capacity_blocks,
            prefix_cache_blocks=wc.prefix_cache_blocks,
        )
        w = _Worker(self, e, wc)
        try:
            self.plane.add_worker(w.id, w.url, role=wc.role, bootstrap_port=wc.bootstrap_port)
        except ValueError:
            self.fleet.remove(e.key)
            raise
        self.workers[w.id] = w
        if wc.models is not None:
            entries = [
                {"id": m, "object": "model", "owned_by": "kvroute", "parent": "base" if m in wc.adapters else None} for m in wc.models
            ]
            self.plane.set_worker_models(w.id, json.dumps({"object": "list", "data": entries}).encode())
        return w

    async def refresh_models(self, w: _Worker) -> bool:
        """Reads a worker's /v1/models into its model pool (a configured list stays); False when it
        did not answer with a model list (its last known list stays)."""
        if w.cfg.models is not None or self.config.models_interval <= 0:
            return True
        body = await self._get(w, "/v1/models")
        if body is None or w.id not in self.workers:
            return False
        try:
            self.plane.set_worker_models(w.id, body)
        except ValueError as e:
            log.warning("worker %s: its /v1/models answer is not a model list (%s); its pool is unchanged", w.url, e)
            return False
        return True

    async def _models_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.models_interval)
            await asyncio.gather(*(self.refresh_models(w) for w in list(self.workers.values()) if w.healthy))

    def remove_worker(self, wid: int) -> dict[str, Any]:
        """Forgets a worker (its requests in flight complete); returns its last row."""
        w = self.workers.pop(wid)
        row = w.to_dict()
        self.plane.remove_worker(wid)
        self.fleet.remove(w.engine.key)
        if self.plane.has_approx:
            self.plane.approx_drop_worker(wid)
        else:
            self.router.index.remove_worker(wid)
        return row

    def mark_unhealthy(self, w: _Worker, reason: str) -> None:
        """Takes a worker out of routing (its streams in flight end at once) and probes it back."""
        if not self.plane.mark_unhealthy(w.id, reason):
            self._probe_soon(w.id)  # already out of routing: make sure it is probed

    def _plane_marked_unhealthy(self, wid: int, reason: str) -> None:
        # Called on the data plane's thread (or the caller's): hand over to the event loop.
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed: nothing left to probe
                self._loop.call_soon_threadsafe(self._probe_soon, wid, reason)

    def _probe_soon(self, wid: int, reason: str | None = None) -> None:
        w = self.workers.get(wid)
        if w is None or w.probing or self.session is None:
            return
        if reason is not None:
            log.warning("worker %s marked unhealthy: %s", w.url, reason)
        w.probing = True
        t = asyncio.get_running_loop().create_task(self._probe(w))
        self._probes.add(t)
        t.add_done_callback(self._probes.discard)

    async def _probe(self, w: _Worker) -> None:
        """Polls an unhealthy worker's /health until it answers 200, then routes to it again."""
        try:
            while w.id in self.workers and not w.healthy:
                if await self._healthy(w):
                    await self.refresh_models(w)
                    self.fleet.register(w.engine)
                    self.plane.set_healthy(w.id, True)
                    log.warning("worker %s is healthy again", w.url)
                    return
                await asyncio.sleep(self.config.health_interval)
        finally:
            w.probing = False

    async def _watch_loop(self) -> None:
        """Probes the healthy workers every ``health_interval``: a worker that stops answering with
        no new request to notice it (a SIGTERMed vLLM holds its open streams silent until it exits)
        is marked unhealthy, which ends its streams in flight."""
        while True:
            await asyncio.sleep(self.config.health_interval)
            workers = [w for w in self.workers.values() if w.healthy]
            results = await asyncio.gather(*(self._healthy(w) for w in workers))
            for w, ok in zip(workers, results):
                if not ok and w.id in self.workers:
                    self.mark_unhealthy(w, "health probe failed")

    async def _healthy(self, w: _Worker) -> bool:
        assert self.session is not None
        try:
            async with self.session.get(w.url + "/health", timeout=aiohttp.ClientTimeout(total=self.config.health_timeout)) as r:
                return r.status == 200
        except _NETWORK_ERRORS:
            return False

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.poll_metrics(w) for w in list(self.workers.values()) if w.healthy))
            await asyncio.sleep(self.config.metrics_interval)

    async def poll_metrics(self, w: _Worker) -> dict[str, float] | None:
        """Reads one engine's /metrics and folds it into the Router (``Fleet.observe``: waiting /
        running / KV usage into ``Router.observe``; the cache's size and block size learned)."""
        body = await self._get(w, "/metrics")
        if body is None or not w.healthy or w.id not in self.workers:
            return None
        return self.fleet.observe(w.engine, body.decode("utf-8", "replace"))

    async def _get(self, w: _Worker, path: str) -> bytes | None:
        """A worker's answer to ``GET path`` when it is a 200 within ``health_timeout``, else None."""
        assert self.session is not None
        try:
            async with self.session.get(w.url + path, timeout=aiohttp.ClientTimeout(total=self.config.health_timeout)) as r:
                return await r.read() if r.status == 200 else None
        except _NETWORK_ERRORS:
            return None

    def metrics(self) -> dict[str, Any]:
        """The data plane's counters (what ``GET /metrics`` renders)."""
        return self.plane.metrics()

    # ---- admin API (aiohttp on loopback; the data plane passes /admin requests to it) --

    @web.middleware
    async def _admin_auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        token = cast(str, self.config.admin_token)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            return _error(
                401,
                "admin API needs 'Authorization: Bearer <admin token>'",
                "unauthorized",
                {"WWW-Authenticate": 'Bearer realm="kvroute-admin"'},
            )
        return await handler(request)

    async def _admin_list(self, _request: web.Request) -> web.StreamResponse:
        return web.json_response({"workers": [w.to_dict() for w in self.workers.values()]})

    async def _admin_add(self, request: web.Request) -> web.StreamResponse:
        try:
            spec = await request.json()
            if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
                raise ValueError("body must be a JSON object with a string 'url'")
            allowed = {
                "url",
                "role",
                "bootstrap_port",
                "prefill_tokens_per_s",
                "decode_tokens_per_s",
                "kv_capacity_blocks",
                "prefix_cache_blocks",
                "models",
                "adapters",
            }
            extra = set(spec) - allowed
            if extra:
                raise ValueError(f"unknown fields {sorted(extra)}; expected some of {sorted(allowed)}")
            w = self.add_worker(WorkerConfig(**spec))
        except (ValueError, TypeError, KvrouteError) as e:
            return _error(400, f"cannot add worker: {e}", "invalid_request_error")
        await self.refresh_models(w)
        return web.json_response(w.to_dict(), status=201)

    async def _admin_remove(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["worker"]
        match = [w for w in self.workers.values() if str(w.id) == key or w.url == key.rstrip("/")]
        if not match:
            return _error(404, f"no worker with id or url {key!r}", "not_found")
        return web.json_response(self.remove_worker(match[0].id))

    async def _start_admin(self) -> int:
        app = web.Application(client_max_size=1 << 20, middlewares=[self._admin_auth])
        app.router.add_get("/admin/workers", self._admin_list)
        app.router.add_post("/admin/workers", self._admin_add)
        app.router.add_delete("/admin/workers/{worker:.+}", self._admin_remove)
        self._admin = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._admin.setup()
        site = web.TCPSite(self._admin, "127.0.0.1", 0)
        await site.start()
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, epp_port: int | None = None) -> str:
        """Starts the control plane's tasks and the data plane on host:port; returns its URL.
        ``epp_port``: also the endpoint picker (Envoy ext_proc + gRPC health) on host:epp_port, its
        bound address then in ``epp_address``. OSError when an address is taken."""
        self._loop = asyncio.get_running_loop()
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, ssl=self._ssl()), auto_decompress=False
        )
        try:
            if self.has_kv_events:
                self.fleet.start_events()
                # The engines' buffered history first (bounded by the replay timeout), so the first
                # requests are routed on what the engines already cache.
                await self.fleet.wait_synced_async(5.0)
            if self.config.models_interval > 0:
                # Each worker's models before the first request, so requests go to the right pool.
                await asyncio.gather(*(self.refresh_models(w) for w in self.workers.values()))
            admin_port = await self._start_admin() if self.config.admin_token else None
            bound_host, bound_port = self.plane.start(host, port, admin_port=admin_port, epp_port=epp_port)
        except BaseException:
            await self.stop()
            raise
        if self.config.metrics_interval > 0:
            self._tasks.append(self._loop.create_task(self._metrics_loop()))
        self._tasks.append(self._loop.create_task(self._watch_loop()))
        if self.config.models_interval > 0:
            self._tasks.append(self._loop.create_task(self._models_loop()))
        if self.config.endpoints_file is not None:
            self._tasks.append(self._loop.create_task(self._endpoints_loop()))
        self.url = f"http://{bound_host}:{bound_port}"
        return self.url

    def _ssl(self) -> Any:
        if self.config.ca_file is None:
            return True
        import ssl

        return ssl.create_default_context(cafile=self.config.ca_file)

    async def stop(self) -> None:
        """Stops the data plane first (requests in flight are dropped, their load released), then the control plane.
        An endpoint picker drains first (``drain_seconds``)."""
        if self.plane.epp_address is not None and self.plane.running and self.config.drain_seconds > 0:
            self.plane.set_draining(True)
            await asyncio.sleep(self.config.drain_seconds)
            loop = asyncio.get_running_loop()
            end = loop.time() + 30.0
            while self.plane.in_flight > 0 and loop.time() < end:
                await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, self.plane.stop)
        for t in [*self._tasks, *self._probes]:
            t.cancel()
        for t in [*self._tasks, *self._probes]:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        await asyncio.get_running_loop().run_in_executor(None, self.fleet.stop_events)
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    @property
    def epp_address(self) -> str | None:
        """The endpoint picker's "host:port" once started with ``epp_port``."""
        return self.plane.epp_address

    async def serve(
        self, host: str = "127.0.0.1", port: int = 0, ready: Callable[[str], None] | None = None, *, epp_port: int | None = None
    ) -> None:
        """Serves until cancelled; ``ready(url)`` is called once the data plane listens."""
        url = await self.start(host, port, epp_port=epp_port)
        try:
            if ready is not None:
                ready(url)
            await asyncio.Event().wait()
        finally:
            await self.stop()


def read_endpoints(path: str) -> list[str]:
    """The worker URLs an endpoints file lists: a JSON list, or one per line (``#`` comments);
    each ``host:port`` (http) or a URL. ValueError names a bad entry."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            entries = json.loads(stripped)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not a JSON list of endpoints ({err})") from None
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ValueError(f"{path}: a JSON endpoints file is a list of strings")
    else:
        entries = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    urls = []
    for e in (e.strip() for e in entries):
        if not e:
            continue
        url = e if "://" in e else f"http://{e}"
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or (port is None and "://" not in e):
            raise ValueError(f"{path}: endpoint {e!r} is not host:port or http(s)://host[:port]")
        urls.append(url.rstrip("/"))
    return list(dict.fromkeys(urls))


def make_gateway(
    router: Router,
    workers: Iterable[str | WorkerConfig] = (),
    *,
    prefill: Iterable[str | WorkerConfig] = (),
    decode: Iterable[str | WorkerConfig] = (),
    config: GatewayConfig | None = None,
    endpoint_template: WorkerConfig | None = None,
    **options: Any,
) -> Gateway:
    """The gateway around ``router`` (which must not have these workers yet), not yet serving.

    ``workers`` are unified engines; ``prefill``/``decode`` make a PD deployment. ``options`` are
    GatewayConfig fields.
    """
    if config is not None and options:
        raise TypeError("give config or keyword options, not both")
    cfg = config or GatewayConfig(**options)

    def spec(w: str | WorkerConfig, role: str) -> WorkerConfig:
        if isinstance(w, WorkerConfig):
            return w if w.role == role else replace(w, role=role)
        return WorkerConfig(url=w, role=role)

    all_workers = [spec(w, "both") for w in workers] + [spec(w, "prefill") for w in prefill] + [spec(w, "decode") for w in decode]
    return Gateway(router, all_workers, cfg, endpoint_template=endpoint_template)


async def serve(
    router: Router,
    workers: Iterable[str | WorkerConfig] = (),
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    ready: Callable[[str], None] | None = None,
    **kw: Any,
) -> None:
    """Serves the gateway on ``router`` until cancelled (``make_gateway``'s arguments in ``kw``)."""
    await make_gateway(router, workers, **kw).serve(host, port, ready)


def run(router: Router, workers: Iterable[str | WorkerConfig] = (), *, host: str = "127.0.0.1", port: int = 8000, **kw: Any) -> None:
    """Serves the gateway on ``router`` at host:port until Ctrl-C (``make_gateway``'s arguments in ``kw``)."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(router, workers, host=host, port=port, ready=lambda url: print(f"kvroute gateway on {url}", flush=True), **kw))
