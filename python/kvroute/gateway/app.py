"""The OpenAI-compatible gateway: routes each request with a kvroute Router, proxies it to the chosen
vLLM/SGLang worker (or prefill + decode pair), accounts its load and survives worker failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import itertools
import json
import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kvroute._core import KvrouteError, NoWorkersError, Router, UnknownWorkerError
from kvroute.gateway.metrics import GatewayMetrics, parse_engine_metrics
from kvroute.gateway.upstream import UpstreamPool, UpstreamResponse
from kvroute.prompt import ApproxCache, BadRequest, ExactPrompter, Prompter, load_prompter

__all__ = ["GATEWAY_KEY", "Gateway", "GatewayConfig", "WorkerConfig", "create_app", "gateway_app", "make_gateway"]

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

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"worker url must be http(s)://host[:port], got {self.url!r}")
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.role!r}")
        if self.bootstrap_port is not None and not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"bootstrap_port must be a TCP port (1..65535), got {self.bootstrap_port}")
        object.__setattr__(self, "url", self.url.rstrip("/"))


# What vLLM's P/D proxy asks of the prefill engine: compute the prompt's KV and keep it for a remote decode.
VLLM_PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


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
    health_interval: float = 2.0  # probe period of unhealthy workers
    health_timeout: float = 2.0
    metrics_interval: float = 0.0  # poll engines' /metrics every this many seconds (0: off)
    models: tuple[str, ...] = ()  # /v1/models fallback when no worker answers

    def __post_init__(self) -> None:
        if self.pd_convention not in PD_CONVENTIONS:
            raise ValueError(f"pd_convention must be one of {PD_CONVENTIONS}, got {self.pd_convention!r}")
        for name in ("max_body_bytes", "max_client_concurrency", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        for name in ("connect_timeout", "read_timeout", "client_timeout", "health_interval", "health_timeout", "approx_ttl"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.metrics_interval < 0:
            raise ValueError(f"metrics_interval must be >= 0 (0 turns polling off), got {self.metrics_interval}")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("admin_token must be at least 8 characters")


class _Worker:
    __slots__ = ("cfg", "healthy", "host", "id", "in_flight", "probing", "served", "streams")

    def __init__(self, wid: int, cfg: WorkerConfig) -> None:
        self.id = wid
        self.cfg = cfg
        self.host = urlsplit(cfg.url).hostname or ""
        self.healthy = True
        self.in_flight = 0
        self.served = 0
        self.probing = False
        # Streams being relayed from this worker: closed when it is marked unhealthy (a SIGTERMed
        # vLLM aborts its engine but holds its open streams silent until it exits).
        self.streams: set[UpstreamResponse] = set()

    @property
    def url(self) -> str:
        return self.cfg.url

    @contextlib.contextmanager
    def dispatched(self) -> Iterator[None]:
        """Counts one request sent to this worker, in flight until the block exits."""
        self.in_flight += 1
        self.served += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "role": self.cfg.role,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "requests": self.served,
            "bootstrap_port": self.cfg.bootstrap_port,
        }


class _UpstreamFailed(Exception):
    """A dispatch failed before any byte reached the client, so it may be retried elsewhere."""

    def __init__(self, worker: _Worker, reason: str, *, mark_unhealthy: bool = True) -> None:
        super().__init__(f"{worker.url}: {reason}")
        self.worker = worker
        self.reason = reason
        self.mark_unhealthy = mark_unhealthy


class _Lease:
    """One routed request's load on the router, released exactly once: ``finished`` once the first
    byte (prefill done) was seen, ``cancel`` otherwise (the queued prefill is taken back)."""

    __slots__ = ("closed", "prefilled", "rid", "router")

    def __init__(self, router: Router, rid: int) -> None:
        self.router = router
        self.rid = rid
        self.prefilled = False
        self.closed = False

    def prefill_done(self) -> None:
        if not self.prefilled and not self.closed:
            self.prefilled = True
            try:
                self.router.prefill_done(self.rid)
            except KvrouteError as e:  # pragma: no cover - would be a gateway bug
                log.error("prefill_done(%s): %s", self.rid, e)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.prefilled:
                self.router.finished(self.rid)
            else:
                self.router.cancel(self.rid)
        except KvrouteError as e:  # pragma: no cover - would be a gateway bug
            log.error("releasing request %s: %s", self.rid, e)


def _error(status: int, message: str, kind: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status, headers=headers)


_FORWARD = ("Authorization", "X-Request-Id", "traceparent")


def _forwarded(request: web.Request) -> dict[str, str] | None:
    """Client headers the engines may need (API key, request id, trace context)."""
    h = request.headers
    out = {k: h[k] for k in _FORWARD if k in h}
    return out or None


def _sse_error(message: str) -> bytes:
    return b"data: " + json.dumps({"error": {"message": message, "type": "upstream_error", "code": 502}}).encode() + b"\n\n"


def _sse_done(chunk: bytes) -> bool:
    """Whether an SSE chunk ends with the OpenAI stream's final event, ``data: [DONE]``."""
    return chunk.rstrip().endswith(b"data: [DONE]")


# Set by ``_relay`` (same task as ``_handle``) once a stream's ``data: [DONE]`` reached the client: the
# ``openai`` client closes as soon as it reads it, often before the engine's end of stream arrives, and
# such a request is complete (a 2xx), not a disconnect.
_ANSWERED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("kvroute_answered", default=None)


class Gateway:
    """State behind one gateway app: workers, router, prompter, upstream session, background tasks."""

    def __init__(self, router: Router, workers: Iterable[WorkerConfig], config: GatewayConfig | None = None) -> None:
        self.router = router
        self.config = config or GatewayConfig()
        cfg = router.config
        self.block_size = cast(int, cfg["block_size"])
        self.hash_seed = cast(int, cfg["hash_seed"])
        self.prompter: Prompter = load_prompter(self.config.tokenizer, self.block_size, self.hash_seed)
        self.metrics = GatewayMetrics()
        self.workers: dict[int, _Worker] = {}
        self._ids = itertools.count()
        self._rids = itertools.count(1)
        self._client_active: defaultdict[str, int] = defaultdict(int)
        self._in_flight = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._probes: set[asyncio.Task[None]] = set()
        self.session: aiohttp.ClientSession | None = None  # health probes, /metrics, /v1/models
        self.upstream: UpstreamPool | None = None  # the request path
        self.subscriber: Any = None
        self.data_plane: Any = None  # kvroute._core.DataPlane in front of this gateway, when attached
        # Without KV events the router learns cache state from its own decisions (approximate mode).
        insert = self.config.insert_decisions if self.config.insert_decisions is not None else not self.config.kv_events
        self.approx: ApproxCache | None = ApproxCache(router.index, self.config.approx_ttl) if insert else None
        for w in workers:
            self.add_worker(w)
        if not self.workers:
            raise ValueError("the gateway needs at least one worker (or prefill and decode workers)")
        unknown = set(self.config.kv_events) - {w.url for w in self.workers.values()}
        if unknown:
            raise ValueError(f"kv_events names workers that are not configured: {sorted(unknown)}")

    # ---- workers -----------------------------------------------------------------------

    def add_worker(self, wc: WorkerConfig) -> _Worker:
        if any(w.url == wc.url for w in self.workers.values()):
            raise ValueError(f"worker {wc.url} is already configured")
        if wc.role == "prefill" and self.config.pd_convention == "sglang" and wc.bootstrap_port is None:
            wc = replace(wc, bootstrap_port=8998)  # SGLang's default --disaggregation-bootstrap-port
        w = _Worker(next(self._ids), wc)
        self._register(w)
        if self.data_plane is not None:
            try:
                self.data_plane.add_worker(w.id, w.url, role=wc.role, bootstrap_port=wc.bootstrap_port)
            except ValueError:
                self.router.remove_worker(w.id)
                raise
        self.workers[w.id] = w
        return w

    def _register(self, w: _Worker) -> None:
        c = w.cfg
        self.router.add_worker(
            w.id,
            role=cast(Any, c.role),
            prefill_tokens_per_s=c.prefill_tokens_per_s,
            kv_capacity_blocks=c.kv_capacity_blocks,
            decode_tokens_per_s=c.decode_tokens_per_s,
        )

    def remove_worker(self, wid: int) -> _Worker:
        w = self.workers.pop(wid)
        if self.data_plane is not None:
            self.data_plane.remove_worker(wid)
        if w.healthy:
            with contextlib.suppress(UnknownWorkerError):
                self.router.remove_worker(wid)
        if self.approx is not None:
            self.approx.drop_worker(wid)
        else:
            self.router.index.remove_worker(wid)
        return w

    def mark_unhealthy(self, w: _Worker, reason: str) -> None:
        self.metrics.upstream_errors[w.url] += 1
        if w.healthy and w.id in self.workers:
            log.warning("worker %s marked unhealthy: %s", w.url, reason)
            w.healthy = False
            if self.data_plane is not None:
                self.data_plane.set_healthy(w.id, False)
            with contextlib.suppress(UnknownWorkerError):
                self.router.remove_worker(w.id)
            if self.approx is not None:
                self.approx.drop_worker(w.id)
            for up in list(w.streams):
                up.close()  # its relay reads a broken stream: the in-band error, at once
        self._probe_soon(w)

    def plane_marked_unhealthy(self, wid: int, reason: str) -> None:
        """The data plane took a worker out of routing (it already removed it from the Router and
        dropped its approximate blocks): mirror that here and probe it back."""
        w = self.workers.get(wid)
        if w is None:
            return
        if w.healthy:
            log.warning("worker %s marked unhealthy by the data plane: %s", w.url, reason)
            w.healthy = False
        self._probe_soon(w)

    def attach_data_plane(self, plane: Any) -> None:
        """Puts a ``kvroute._core.DataPlane`` in front of this gateway (before it starts): the plane
        learns the workers, and both planes share one approximate cache, expired by the plane."""
        from kvroute.gateway.dataplane import CLIENT_HEADER, PlaneApprox

        if self.data_plane is not None:
            raise ValueError("a data plane is already attached to this gateway")
        for w in self.workers.values():
            plane.add_worker(w.id, w.url, role=w.cfg.role, bootstrap_port=w.cfg.bootstrap_port)
        self.data_plane = plane
        if self.approx is not None and plane.has_approx:
            self.approx = cast(ApproxCache, PlaneApprox(plane))
        # Requests arrive from the plane's loopback address; it names the real client in a header.
        self.config = replace(self.config, client_key_header=CLIENT_HEADER)

    def metrics_view(self) -> GatewayMetrics:
        """This gateway's counters, with the data plane's folded in when one is attached."""
        if self.data_plane is None:
            return self.metrics
        return self.metrics.merged(self.data_plane.metrics())

    def _worker_dicts(self) -> list[dict[str, Any]]:
        rows = [w.to_dict() for w in self.workers.values()]
        for row in rows:
            # What the engine last reported (--metrics-interval polling into Router.observe); None before any report.
            with contextlib.suppress(UnknownWorkerError):
                load = self.router.load(row["id"])
                row.update({k: load[k] for k in ("observed_waiting", "observed_running", "observed_kv_usage")})
        if self.data_plane is not None:
            plane = {r["id"]: r for r in self.data_plane.workers()}
            for row in rows:
                p = plane.get(row["id"])
                if p is not None:
                    row["in_flight"] += p["in_flight"]
                    row["requests"] += p["requests"]
        return rows

    def _probe_soon(self, w: _Worker) -> None:
        if not w.probing and self.session is not None:
            w.probing = True
            t = asyncio.get_running_loop().create_task(self._probe(w))
            self._probes.add(t)
            t.add_done_callback(self._probes.discard)

    async def _probe(self, w: _Worker) -> None:
        """Polls an unhealthy worker's /health until it answers 200, then routes to it again."""
        try:
            while not w.healthy and w.id in self.workers:
                if await self._healthy(w):
                    w.healthy = True
                    if self.data_plane is not None:
                        self.data_plane.set_healthy(w.id, True)
                    self._register(w)
                    log.warning("worker %s is healthy again", w.url)
                    return
                await asyncio.sleep(self.config.health_interval)
        finally:
            w.probing = False

    async def _watch_loop(self) -> None:
        """Probes the healthy workers every ``health_interval``: a worker that stops answering with
        no new request to notice it (a SIGTERMed vLLM holds its open streams silent until it exits)
        is marked unhealthy, which ends its streams in flight on both planes."""
        while True:
            await asyncio.sleep(self.config.health_interval)
            workers = [w for w in self.workers.values() if w.healthy]
            results = await asyncio.gather(*(self._healthy(w) for w in workers))
            for w, ok in zip(workers, results):
                if not ok and w.healthy:
                    self.mark_unhealthy(w, "health probe failed")

    async def _healthy(self, w: _Worker) -> bool:
        assert self.session is not None
        try:
            async with self.session.get(w.url + "/health", timeout=aiohttp.ClientTimeout(total=self.config.health_timeout)) as r:
                return r.status == 200
        except _NETWORK_ERRORS:
            return False

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self, _app: web.Application | None = None) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout, sock_read=self.config.read_timeout)
        self.upstream = UpstreamPool(self.config.connect_timeout, self.config.read_timeout)
        self.session = aiohttp.ClientSession(
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        loop = asyncio.get_running_loop()
        if self.approx is not None and self.data_plane is None:  # with a data plane, it expires the cache
            self._tasks.append(loop.create_task(self._expire_loop()))
        if self.config.metrics_interval > 0:
            self._tasks.append(loop.create_task(self._metrics_loop()))
        self._tasks.append(loop.create_task(self._watch_loop()))
        if self.config.kv_events:
            from kvroute.events import KvEventSubscriber

            by_url = {w.url: w.id for w in self.workers.values()}
            self.subscriber = KvEventSubscriber(
                self.router.index,
                {by_url[u]: ep for u, ep in self.config.kv_events.items()},
                replay_endpoints={by_url[u]: ep for u, ep in self.config.kv_events_replay.items()} or None,
                block_size=self.block_size,
                seed=self.hash_seed,
            ).start()

    async def stop(self, _app: web.Application | None = None) -> None:
        for t in [*self._tasks, *self._probes]:
            t.cancel()
        for t in [*self._tasks, *self._probes]:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        if self.subscriber is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.subscriber.stop)
            self.subscriber = None
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None

    async def _expire_loop(self) -> None:
        assert self.approx is not None
        period = min(5.0, self.config.approx_ttl / 4)
        while True:
            await asyncio.sleep(period)
            self.approx.expire(time.monotonic())

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.poll_metrics(w) for w in list(self.workers.values()) if w.healthy))
            await asyncio.sleep(self.config.metrics_interval)

    async def poll_metrics(self, w: _Worker) -> dict[str, float] | None:
        """Reads one engine's /metrics and folds waiting/running/KV usage into ``Router.observe``."""
        assert self.session is not None
        try:
            async with self.session.get(w.url + "/metrics", timeout=aiohttp.ClientTimeout(total=self.config.health_timeout)) as r:
                if r.status != 200:
                    return None
                text = await r.text()
        except _NETWORK_ERRORS:
            return None
        seen = parse_engine_metrics(text)
        if seen and w.healthy:
            with contextlib.suppress(UnknownWorkerError):
                self.router.observe(
                    w.id,
                    waiting=int(seen["waiting"]) if "waiting" in seen else None,
                    running=int(seen["running"]) if "running" in seen else None,
                    kv_usage=seen.get("kv_usage"),
                )
        return seen

    # ---- request path ------------------------------------------------------------------

    def _client_key(self, request: web.Request) -> str:
        h = self.config.client_key_header
        if h:
            v = request.headers.get(h)
            if v:
                return "h:" + v
        return "ip:" + (request.remote or "")

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions", chat=False)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions", chat=True)

    async def _handle(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        client = self._client_key(request)
        m = self.metrics
        if self._client_active[client] >= self.config.max_client_concurrency:
            m.rejections["client_concurrency"] += 1
            return self._count(
                path,
                _error(
                    429,
                    f"too many concurrent requests from this client (limit {self.config.max_client_concurrency})",
                    "rate_limit_exceeded",
                    {"Retry-After": "1"},
                ),
            )
        if self._in_flight >= self.config.max_in_flight:
            m.rejections["gateway_full"] += 1
            return self._count(
                path,
                _error(429, f"gateway at its in-flight limit ({self.config.max_in_flight})", "rate_limit_exceeded", {"Retry-After": "1"}),
            )
        self._client_active[client] += 1
        self._in_flight += 1
        answered = [False]
        token = _ANSWERED.set(answered)
        try:
            return self._count(path, await self._serve(request, path, chat))
        except (asyncio.CancelledError, ConnectionResetError):
            if answered[0]:
                m.requests[(path, "2xx")] += 1
            else:
                m.client_disconnects += 1
                m.requests[(path, "disconnected")] += 1
            raise
        finally:
            _ANSWERED.reset(token)
            self._in_flight -= 1
            self._client_active[client] -= 1
            if not self._client_active[client]:
                del self._client_active[client]

    def _count(self, path: str, resp: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests[(path, f"{resp.status // 100}xx")] += 1
        return resp

    async def _serve(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body larger than {self.config.max_body_bytes} bytes", "invalid_request_error")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return _error(400, f"request body is not valid JSON: {e}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        t0 = time.perf_counter()
        try:
            if isinstance(self.prompter, ExactPrompter):
                prompt = await asyncio.get_running_loop().run_in_executor(None, self.prompter.prompt, body, chat)
            else:
                prompt = self.prompter.prompt(body, chat)
        except (BadRequest, ValueError, TypeError, OverflowError) as e:
            return _error(400, str(e), "invalid_request_error")
        stream = bool(body.get("stream"))
        last_failure = "no attempt made"
        for attempt in range(self.config.max_retries + 1):
            rid = next(self._rids)
            try:
                d = self.router.route(
                    hashes=prompt.hashes, num_tokens=prompt.num_tokens, request_id=rid, output_tokens=prompt.output_tokens
                )
            except NoWorkersError as e:
                return _error(
                    503, f"no healthy worker to route to ({e}); last failure: {last_failure}", "service_unavailable", {"Retry-After": "1"}
                )
            except (ValueError, TypeError) as e:
                return _error(400, f"cannot route this prompt: {e}", "invalid_request_error")
            if attempt == 0:
                self.metrics.routing.observe(time.perf_counter() - t0)
            if not d.admitted:
                self.metrics.rejections[d.reason] += 1
                retry_after = str(max(1, math.ceil(d.queue_delay)))
                return _error(
                    429,
                    f"request rejected: {d.reason} (predicted TTFT {d.predicted_ttft:.3f} s); retry later",
                    "rate_limit_exceeded",
                    {"Retry-After": retry_after},
                )
            self.metrics.prompt_tokens += prompt.num_tokens
            self.metrics.cached_tokens += prompt.num_tokens - d.uncached_tokens
            if self.approx is not None:
                now = time.monotonic()
                self.approx.insert(d.worker, prompt.hashes, now)
                if d.decode_worker is not None and d.decode_worker != d.worker:
                    self.approx.insert(d.decode_worker, prompt.hashes, now)
            lease = _Lease(self.router, rid)
            try:
                if d.path == "disaggregated":
                    assert d.decode_worker is not None
                    pw, dw = self.workers[d.worker], self.workers[d.decode_worker]
                    if self.config.pd_convention == "vllm":
                        return await self._pd_vllm(request, path, body, stream, pw, dw, lease)
                    return await self._pd_sglang(request, path, body, stream, pw, dw, lease)
                w = self.workers[d.worker]
                return await self._unified(request, path, raw, stream, w, lease)
            except _UpstreamFailed as f:
                last_failure = str(f)
                if f.mark_unhealthy:
                    self.mark_unhealthy(f.worker, f.reason)
                if attempt < self.config.max_retries:
                    self.metrics.retries += 1
                    log.info("retrying request after %s", f)
            finally:
                lease.close()
        return _error(502, f"all {self.config.max_retries + 1} attempts failed; last: {last_failure}", "upstream_error")

    async def _open(
        self, w: _Worker, path: str, data: bytes, buffered: bool, headers: dict[str, str] | None
    ) -> tuple[UpstreamResponse, bytes]:
        """Sends one request upstream; returns the response and its first chunk (whole body when
        ``buffered``). Raises _UpstreamFailed on refusal, 5xx or a break before the first byte."""
        assert self.upstream is not None
        try:
            up = await self.upstream.post(w.url + path, data, headers)
        except _NETWORK_ERRORS as e:
            raise _UpstreamFailed(w, f"connection failed: {e!r}") from e
        try:
            if up.status >= 500:
                detail = (await up.read(300)).decode("utf-8", "replace")
                raise _UpstreamFailed(w, f"HTTP {up.status}: {detail}")
            first = await up.read() if buffered else await up.readany()
            return up, first
        except _NETWORK_ERRORS as e:
            up.close()
            raise _UpstreamFailed(w, f"response broke before the first byte: {e!r}") from e
        except BaseException:
            up.close()
            raise

    async def _relay(self, request: web.Request, w: _Worker, up: UpstreamResponse, first: bytes, buffered: bool) -> web.StreamResponse:
        """Passes an upstream response to the client byte for byte (the first chunk already read)."""
        headers = {"Content-Type": up.headers.get("Content-Type") or "application/json", "X-Kvroute-Worker": w.url}
        try:
            if buffered:
                return web.Response(body=first, status=up.status, headers=headers)
            lean = getattr(request, "kvroute_stream", None)  # kvroute.gateway.server's requests
            resp = lean(up.status, headers) if lean is not None else web.StreamResponse(status=up.status, headers=headers)
            await resp.prepare(request)
            sse = headers["Content-Type"].startswith("text/event-stream")
            answered = _ANSWERED.get() if sse else None
            w.streams.add(up)
            if first:
                await resp.write(first)
                if answered is not None and _sse_done(first):
                    answered[0] = True
            while True:
                try:
                    chunk = await up.readany()
                except _NETWORK_ERRORS as e:
                    # Bytes already reached the client: no retry; say so in-band and end the stream.
                    self.mark_unhealthy(w, f"stream broke: {e!r}")
                    if sse:
                        await resp.write(_sse_error(f"upstream worker failed mid-stream: {e!r}"))
                    break
                if not chunk:
                    break
                await resp.write(chunk)
                if answered is not None and _sse_done(chunk):
                    answered[0] = True
            await resp.write_eof()
            return resp
        finally:
            w.streams.discard(up)
            up.close()

    async def _unified(self, request: web.Request, path: str, raw: bytes, stream: bool, w: _Worker, lease: _Lease) -> web.StreamResponse:
        with w.dispatched():
            up, first = await self._open(w, path, raw, not stream, _forwarded(request))
            lease.prefill_done()
            return await self._relay(request, w, up, first, buffered=not stream)

    async def _pd_vllm(
        self, request: web.Request, path: str, body: dict[str, Any], stream: bool, pw: _Worker, dw: _Worker, lease: _Lease
    ) -> web.StreamResponse:
        """vLLM's convention: a max_tokens=1 prefill asking for remote decode, then the decode request
        carrying the kv_transfer_params the prefill returned."""
        pbody = dict(body)
        pbody["kv_transfer_params"] = dict(VLLM_PREFILL_KV_TRANSFER_PARAMS)
        pbody["stream"] = False
        pbody.pop("stream_options", None)
        pbody["max_tokens"] = 1
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        with pw.dispatched():
            up, pdata = await self._open(pw, path, json.dumps(pbody).encode(), True, _forwarded(request))
            up.close()
        if up.status != 200:  # a 4xx from the prefill is the client's error: pass it through
            return web.Response(
                body=pdata, status=up.status, headers={"Content-Type": up.headers.get("Content-Type") or "application/json"}
            )
        try:
            presp = json.loads(pdata)
        except ValueError as e:
            raise _UpstreamFailed(pw, f"prefill answered non-JSON: {e}") from e
        lease.prefill_done()
        dbody = dict(body)
        dbody["kv_transfer_params"] = presp.get("kv_transfer_params") if isinstance(presp, dict) else None
        with dw.dispatched():
            up, first = await self._open(dw, path, json.dumps(dbody).encode(), not stream, _forwarded(request))
            return await self._relay(request, dw, up, first, buffered=not stream)

    async def _pd_sglang(
        self, request: web.Request, path: str, body: dict[str, Any], stream: bool, pw: _Worker, dw: _Worker, lease: _Lease
    ) -> web.StreamResponse:
        """SGLang's convention: the same request, tagged with the prefill server's bootstrap address
        and a random room, goes to both at once; the client gets the decode server's response."""
        tagged = dict(body, bootstrap_host=pw.host, bootstrap_port=pw.cfg.bootstrap_port, bootstrap_room=random.getrandbits(63))
        data = json.dumps(tagged).encode()
        fwd = _forwarded(request)

        async def prefill() -> None:
            up, _ = await self._open(pw, path, data, True, fwd)
            up.close()
            lease.prefill_done()

        with pw.dispatched(), dw.dispatched():
            ptask = asyncio.ensure_future(prefill())
            dtask = asyncio.ensure_future(self._open(dw, path, data, not stream, fwd))
            try:
                await asyncio.wait((ptask, dtask), return_when=asyncio.FIRST_COMPLETED)
                if ptask.done() and ptask.exception() is not None:
                    raise ptask.exception()  # type: ignore[misc]
                up, first = await dtask
                lease.prefill_done()  # the decode server produced output: its prefill side is done
                return await self._relay(request, dw, up, first, buffered=not stream)
            finally:
                for t in (ptask, dtask):
                    if not t.done():
                        t.cancel()
                for t in (ptask, dtask):
                    with contextlib.suppress(BaseException):
                        r = await t
                        if isinstance(r, tuple):
                            r[0].close()

    # ---- other endpoints ---------------------------------------------------------------

    async def handle_models(self, _request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        for w in self.workers.values():
            if not w.healthy or w.cfg.role == "prefill":
                continue
            try:
                async with self.session.get(w.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=self.config.health_timeout)) as r:
                    if r.status == 200:
                        return web.Response(body=await r.read(), content_type="application/json")
            except _NETWORK_ERRORS:
                continue
        if self.config.models:
            now = int(time.time())
            data = [{"id": m, "object": "model", "created": now, "owned_by": "kvroute"} for m in self.config.models]
            return web.json_response({"object": "list", "data": data})
        return _error(503, "no worker answered /v1/models", "service_unavailable")

    def healthy_roles(self) -> set[str]:
        return {w.cfg.role for w in self.workers.values() if w.healthy}

    async def handle_health(self, _request: web.Request) -> web.StreamResponse:
        roles = self.healthy_roles()
        pd = any(w.cfg.role != "both" for w in self.workers.values())
        ok = ({"prefill", "decode"} <= roles or "both" in roles) if pd else "both" in roles
        body = {"status": "ok" if ok else "unavailable", "workers": self._worker_dicts()}
        return web.json_response(body, status=200 if ok else 503)

    async def handle_metrics(self, _request: web.Request) -> web.StreamResponse:
        rows = [(d["url"], d["role"], d["healthy"], d["in_flight"], d["requests"]) for d in self._worker_dicts()]
        return web.Response(
            body=self.metrics_view().render(rows).encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    # ---- admin API ---------------------------------------------------------------------

    @web.middleware
    async def admin_auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path.startswith("/admin"):
            token = self.config.admin_token
            if token is None:
                return _error(403, "the admin API is disabled: start the gateway with --admin-token", "permission_denied")
            auth = request.headers.get("Authorization", "")
            scheme, _, given = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
                return _error(
                    401,
                    "admin API needs 'Authorization: Bearer <admin token>'",
                    "unauthorized",
                    {"WWW-Authenticate": 'Bearer realm="kvroute-admin"'},
                )
        return await handler(request)

    async def admin_list(self, _request: web.Request) -> web.StreamResponse:
        return web.json_response({"workers": self._worker_dicts()})

    async def admin_add(self, request: web.Request) -> web.StreamResponse:
        try:
            spec = await request.json()
            if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
                raise ValueError("body must be a JSON object with a string 'url'")
            allowed = {"url", "role", "bootstrap_port", "prefill_tokens_per_s", "decode_tokens_per_s", "kv_capacity_blocks"}
            extra = set(spec) - allowed
            if extra:
                raise ValueError(f"unknown fields {sorted(extra)}; expected some of {sorted(allowed)}")
            w = self.add_worker(WorkerConfig(**spec))
        except (ValueError, TypeError, KvrouteError) as e:
            return _error(400, f"cannot add worker: {e}", "invalid_request_error")
        return web.json_response(w.to_dict(), status=201)

    async def admin_remove(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["worker"]
        match = [w for w in self.workers.values() if str(w.id) == key or w.url == key.rstrip("/")]
        if not match:
            return _error(404, f"no worker with id or url {key!r}", "not_found")
        w = self.remove_worker(match[0].id)
        return web.json_response(w.to_dict())


GATEWAY_KEY = web.AppKey("kvroute_gateway", Gateway)


def make_gateway(
    router: Router,
    workers: Iterable[str | WorkerConfig] = (),
    *,
    prefill: Iterable[str | WorkerConfig] = (),
    decode: Iterable[str | WorkerConfig] = (),
    config: GatewayConfig | None = None,
    **options: Any,
) -> Gateway:
    """The gateway's state around ``router`` (which must not have these workers yet), to serve with
    ``gateway_app`` (aiohttp) or ``kvroute.gateway.server.serve_lean``.

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
    return Gateway(router, all_workers, cfg)


def gateway_app(gw: Gateway) -> web.Application:
    """An aiohttp application serving ``gw``."""
    app = web.Application(client_max_size=gw.config.max_body_bytes, middlewares=[gw.admin_auth])
    app[GATEWAY_KEY] = gw
    app.router.add_post("/v1/completions", gw.handle_completions)
    app.router.add_post("/v1/chat/completions", gw.handle_chat)
    app.router.add_get("/v1/models", gw.handle_models)
    app.router.add_get("/health", gw.handle_health)
    app.router.add_get("/metrics", gw.handle_metrics)
    app.router.add_get("/admin/workers", gw.admin_list)
    app.router.add_post("/admin/workers", gw.admin_add)
    app.router.add_delete("/admin/workers/{worker:.+}", gw.admin_remove)
    app.on_startup.append(gw.start)
    app.on_cleanup.append(gw.stop)
    return app


def create_app(
    router: Router,
    workers: Iterable[str | WorkerConfig] = (),
    *,
    prefill: Iterable[str | WorkerConfig] = (),
    decode: Iterable[str | WorkerConfig] = (),
    config: GatewayConfig | None = None,
    **options: Any,
) -> web.Application:
    """The gateway as an aiohttp application around ``router`` (which must not have these workers yet).

    ``workers`` are unified engines; ``prefill``/``decode`` make a PD deployment. ``options`` are
    GatewayConfig fields. Run it with ``web.run_app(app, handler_cancellation=True)`` so a client
    that disconnects cancels its upstream request at once (``kvroute serve`` does).
    """
    return gateway_app(make_gateway(router, workers, prefill=prefill, decode=decode, config=config, **options))
