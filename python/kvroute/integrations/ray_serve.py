"""kvroute as a Ray Serve request router: each replica fronts one engine and says which (its URL and
KV-event endpoints, ``record_replica_metadata``); the router ranks the replicas by kvroute's choice.

    @serve.deployment(num_replicas=2, request_router_config=RequestRouterConfig(
        request_router_class="kvroute.integrations.ray_serve:KvrouteRequestRouter",
        request_router_kwargs={"tokenizer": "/models/llama", "block_size": 16}))
    class Engine(EngineReplica): ...

A router lives in every process holding a handle (each Serve proxy, each ingress replica), and each
sees only its own requests: every instance subscribes to every engine's KV events and polls each
engine's /metrics (``metrics_interval``), so the load other instances cause reaches its Router too.
Serve then takes, inside the first ranked group, the replica with the shortest queue. A replica that
cannot reach its engine raises ``EngineUnavailable``; ``OpenAIIngress`` then retries the request
(before any byte reached the client) with that engine excluded, and the router keeps new requests off
it for ``failure_cooldown`` seconds. Example app: docs/integrations.md.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.integrations.engine_router import EngineRouter, NoCandidates
from kvroute.prompt import BadRequest

try:
    from ray import serve
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvroute.integrations.ray_serve needs Ray Serve: pip install 'kvroute[ray]'") from exc

__all__ = [
    "ENGINE_METADATA_KEYS",
    "EngineReplica",
    "EngineUnavailable",
    "KvrouteRequestRouter",
    "OpenAIIngress",
    "OpenAIRequest",
    "build_app",
    "routers",
]

log = logging.getLogger(__name__)

#: What a replica's ``record_replica_metadata()`` returns for the router: ``engine_url`` (required),
#: ``kv_events`` and ``kv_events_replay`` (optional ZMQ endpoints).
ENGINE_METADATA_KEYS = ("engine_url", "kv_events", "kv_events_replay")
#: How long a routing decision waits, at most, for the KV-event history of engines just registered.
SYNC_TIMEOUT = 5.0


class EngineUnavailable(RuntimeError):
    """A replica could not get an answer from its engine (connection refused, reset or dropped before
    the answer's first byte): nothing reached the client, so the request may run elsewhere."""

    def __init__(self, engine_url: str, reason: str) -> None:
        super().__init__(f"engine {engine_url} unavailable: {reason}")
        self.engine_url = engine_url
        self.reason = reason

    @classmethod
    def of(cls, engine_url: str, error: BaseException) -> EngineUnavailable:
        """The connection error ``error`` on the way to ``engine_url``."""
        return cls(engine_url, f"{type(error).__name__}: {error}")

    def __reduce__(self) -> tuple[Any, ...]:  # Ray pickles it across processes
        return (EngineUnavailable, (self.engine_url, self.reason))


def _unavailable(e: BaseException) -> EngineUnavailable | None:
    """The ``EngineUnavailable`` behind an error a handle call raised (Ray wraps a replica's exception
    in a ``RayTaskError`` that is also an instance of it, and keeps it as ``cause``)."""
    if isinstance(e, EngineUnavailable):
        return e
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, EngineUnavailable) else None


@dataclass
class OpenAIRequest:
    """An OpenAI completions / chat body as the ingress hands it to the engine deployment (the
    handle call's first argument, which is what a request router sees). ``messages`` / ``prompt``
    exist only when the body has them, as Ray's own ``PrefixCacheAffinityRouter`` expects.
    ``exclude``: engine URLs this request already failed on (the ingress's retries); the kvroute
    router routes it elsewhere and keeps new requests off them for a while."""

    body: dict[str, Any]
    chat: bool = field(default=True)
    exclude: list[str] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        if name in ("messages", "prompt") and name in self.__dict__.get("body", {}):
            return self.body[name]
        raise AttributeError(name)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def _as_openai_request(arg: Any) -> Any:
    """``arg`` when it is an ``OpenAIRequest``, else None. By its fields, not ``isinstance``: Serve may
    load the request router by value (cloudpickle), and then this module's classes in the router's
    globals are copies of the ones the ingress built the request with."""
    if isinstance(arg, OpenAIRequest):
        return arg
    fields = getattr(arg, "__dict__", None)
    if type(arg).__name__ == "OpenAIRequest" and isinstance(fields, dict) and isinstance(fields.get("body"), dict):
        return arg
    return None


def _request_body(pending: PendingRequest | None) -> tuple[dict[str, Any], bool] | None:
    """The OpenAI body in a handle call's arguments: an ``OpenAIRequest``, a dict, or any object
    with ``messages`` / ``prompt`` (such as ``ray.serve.llm``'s request models)."""
    if pending is None:
        return None
    for arg in [*pending.args, *pending.kwargs.values()]:
        req = _as_openai_request(arg)
        if req is not None:
            return dict(req.body), bool(req.chat)
        if isinstance(arg, Mapping) and ("messages" in arg or "prompt" in arg):
            return dict(arg), "messages" in arg
        msgs = getattr(arg, "messages", None)
        if msgs is not None:
            return {"messages": [m if isinstance(m, Mapping) else _as_dict(m) for m in msgs]}, True
        prompt = getattr(arg, "prompt", None)
        if prompt is not None:
            return {"prompt": prompt}, False
    return None


def _excluded_urls(pending: PendingRequest | None) -> set[str]:
    """The engine URLs an ``OpenAIRequest`` in the handle call's arguments already failed on."""
    if pending is None:
        return set()
    for arg in [*pending.args, *pending.kwargs.values()]:
        req = _as_openai_request(arg)
        if req is not None:
            return {u.rstrip("/") for u in getattr(req, "exclude", None) or () if isinstance(u, str)}
    return set()


def _as_dict(m: Any) -> dict[str, Any]:
    dump = getattr(m, "model_dump", None)
    return dict(dump()) if callable(dump) else dict(vars(m))


_routers: weakref.WeakSet[KvrouteRequestRouter] = weakref.WeakSet()


def routers() -> list[KvrouteRequestRouter]:
    """This process's kvroute request routers (one per handle), e.g. to report their lease counts."""
    return list(_routers)


class KvrouteRequestRouter(RequestRouter):  # type: ignore[misc,unused-ignore]
    """A Serve ``RequestRouter``: ``choose_replicas`` ranks ``[[kvroute's pick], [the others]]``.

    ``request_router_kwargs`` go to ``kvroute.integrations.engine_router.EngineRouter`` (``tokenizer``, ``block_size``,
    ``metrics_interval`` (default 1 s here), ``lease_ttl``, Router settings such as ``policy``). Every
    routed request holds a lease until ``on_request_completed`` (success, error or cancel). A
    request that comes back with engines to exclude (``OpenAIRequest.exclude``, the ingress's retry
    after ``EngineUnavailable``) releases its earlier attempt's lease as failed, cools those engines
    down (``failure_cooldown``) and is routed among the others; the engine /metrics poller cools
    down an engine that refuses connections too. Requests whose arguments carry no prompt are ranked
    by load alone."""

    def initialize_state(self, **kwargs: Any) -> None:
        kwargs.setdefault("metrics_interval", 1.0)
        self.engines = EngineRouter(**kwargs).start()
        self._leased: dict[str, str] = {}  # internal request id -> ticket
        self._attempt: dict[str, int] = {}  # internal request id -> engines it had failed on when last routed
        self.counts = {"routed": 0, "rerouted": 0, "no_prompt": 0, "retried": 0, "first_tokens": 0}
        # Serve may load this class by value (cloudpickle), with its own copy of this module's
        # globals: register with the module as imported in this process.
        import kvroute.integrations.ray_serve as this

        this._routers.add(self)

    # ---- replicas --------------------------------------------------------------------------

    def _register(self, replica: RunningReplica) -> str | None:
        key = str(replica.replica_id.to_full_id_str())
        if self.engines.get(key) is not None:
            return key
        md = replica.replica_metadata or {}
        url = md.get("engine_url")
        if not isinstance(url, str):
            log.warning("replica %s records no engine_url in record_replica_metadata(); kvroute cannot route to it", key)
            return None
        self.engines.add(key, url, kv_events=md.get("kv_events"), kv_events_replay=md.get("kv_events_replay"))
        return key

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.to_full_id_str() for r in replicas}
        for r in replicas:
            self._register(r)
        for e in self.engines.engines():
            if e.key not in live:
                self.engines.remove(e.key)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.engines.remove(replica_id.to_full_id_str())

    # ---- routing ---------------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_key = {k: r for r in candidate_replicas if (k := self._register(r)) is not None}
        found = _request_body(pending_request)
        if pending_request is None or not by_key:
            return [candidate_replicas]
        # A router made by a handle's first call, or one that just met a new engine, replays the
        # engines' KV-event history first (bounded), so it does not route blind to what they cache.
        await self.engines.wait_synced_async(SYNC_TIMEOUT)
        rid = pending_request.metadata.internal_request_id
        excluded = _excluded_urls(pending_request)
        failed = self._failed_keys(by_key, excluded)
        retry = len(excluded) > self._attempt.get(rid, 0)  # a new attempt after a failure, not Serve asking again
        if excluded:
            self._attempt[rid] = len(excluded)
        old = self._leased.pop(rid, None)
        if old is not None:
            # Routed again. After a failure (the ingress retries with the engine excluded; a handle call
            # made inside a request shares that request's id) the earlier attempt failed; otherwise
            # the replica was full or turned it away: take the first pick back.
            self.engines.leases.release(old, "failed" if retry else "cancelled")
        if retry:
            self.counts["retried"] += 1
            for key in failed:
                self.engines.mark_failed(key)
        try:
            if found is None:
                raise BadRequest("no prompt in the handle call's arguments")
            lease = self._lease(found[0], found[1], by_key, failed, rid)
        except BadRequest:
            self.counts["no_prompt"] += 1
            lease = self._lease({"prompt": [0]}, False, by_key, failed, rid)
        except NoCandidates:
            self._attempt.pop(rid, None)
            return [candidate_replicas]
        self._leased[rid] = lease.ticket
        self.counts["routed"] += 1
        best = by_key[self.engines.engine_of(lease).key]
        rest = [r for k, r in by_key.items() if r is not best and k not in failed]
        return [[best], rest] if rest else [[best]]

    def _failed_keys(self, by_key: Mapping[str, RunningReplica], urls: set[str]) -> set[str]:
        if not urls:
            return set()
        out = set()
        for key in by_key:
            e = self.engines.get(key)
            if e is not None and e.url in urls:
                out.add(key)
        return out

    def _lease(self, body: dict[str, Any], chat: bool, by_key: Mapping[str, RunningReplica], failed: Iterable[str], rid: str) -> Any:
        try:
            return self.engines.lease(body, chat, candidates=by_key, exclude=failed, ticket=rid)
        except NoCandidates:
            if not failed:
                raise
            # Every replica's engine failed this request: try again anyway (cooled-down ones last).
            return self.engines.lease(body, chat, candidates=by_key, ticket=rid)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = pending_request.metadata.internal_request_id
        ticket = self._leased.get(rid)
        key = replica_id.to_full_id_str()
        lease = self.engines.leases.get(ticket) if ticket is not None else None
        if lease is None or self.engines.engine_of(lease).key == key or self.engines.get(key) is None:
            return
        # Serve sent it to another replica of the ranking (the first was full): move the lease there.
        found = _request_body(pending_request)
        self.engines.leases.cancel(lease.ticket)
        body, chat = found if found is not None else ({"prompt": [0]}, False)
        try:
            moved = self.engines.lease(body, chat, candidates=[key], ticket=rid)
        except (BadRequest, NoCandidates):
            self._leased.pop(rid, None)
            return
        self._leased[rid] = moved.ticket
        self.counts["rerouted"] += 1

    def prefill_done(self, internal_request_id: str) -> bool:
        """The request's first token reached the ingress (its prefill is over): tells the Router's
        load model, as the gateway does at each first streamed chunk. Serve has no hook for it, so
        ``OpenAIIngress`` calls this on the routers of its own process; False when this router holds
        no lease for that request: another handle's router routed it, or a short answer completed
        (``on_request_completed``) before the ingress saw its first chunk, and the lease was released
        with its prefill bounded instead (counted in ``leases.counts["no_first_token"]``)."""
        ticket = self._leased.get(internal_request_id)
        if ticket is None or not self.engines.leases.prefill_done(ticket):
            return False
        self.counts["first_tokens"] += 1
        return True

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        ticket = self._leased.get(internal_request_id)
        if ticket is None:
            return
        lease = self.engines.leases.get(ticket)
        if lease is not None:
            e = self.engines.engine_of_worker(lease.worker)
            if e is not None and e.key != replica_id.to_full_id_str():
                # An earlier attempt of a request already routed again (its lease was released then).
                return
        self._leased.pop(internal_request_id, None)
        self._attempt.pop(internal_request_id, None)
        self.engines.leases.finish(ticket)


class EngineReplica:
    """A Serve deployment body fronting one OpenAI-compatible engine (vLLM, SGLang): it forwards
    ``OpenAIRequest`` bodies to the engine and streams its answer back, and records which engine it
    is for the router. ``engines``: one dict per replica rank, ``{"engine_url", "kv_events",
    "kv_events_replay"}`` (replica ``rank`` takes ``engines[rank % len(engines)]``)."""

    def __init__(self, engines: list[dict[str, str]]) -> None:
        if not engines or not all(isinstance(e, Mapping) and isinstance(e.get("engine_url"), str) for e in engines):
            raise ValueError("engines must be a non-empty list of {'engine_url': ..., 'kv_events': ..., 'kv_events_replay': ...}")
        ctx = serve.get_replica_context()
        rank: Any = getattr(ctx.rank, "rank", ctx.rank)  # a ReplicaRank in 2.60, an int before
        self.engine = {k: v for k, v in engines[int(rank) % len(engines)].items() if k in ENGINE_METADATA_KEYS}
        self.url = self.engine["engine_url"].rstrip("/")
        self._session: Any = None

    def record_replica_metadata(self) -> dict[str, str]:
        return dict(self.engine)

    async def check_health(self) -> None:
        """Serve's health check: the engine's /health must answer 200, else Serve replaces this
        replica and the routers drop it (``update_replicas``)."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        async with self._session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                raise RuntimeError(f"engine {self.url} /health answered {r.status}")

    async def _post(self, req: OpenAIRequest) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        try:
            return await self._session.post(self.url + req.path, json=req.body)
        except aiohttp.ClientConnectionError as e:  # refused, reset, or closed before the answer's head
            raise EngineUnavailable.of(self.url, e) from None

    async def complete(self, req: OpenAIRequest) -> dict[str, Any]:
        """A non-streamed request: the engine's JSON answer (an engine error raises, so Serve reports
        it; ``EngineUnavailable`` when the engine could not be reached or dropped the connection)."""
        import aiohttp

        async with await self._post(req) as r:
            try:
                text = await r.text()
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:  # the engine died before answering in full
                raise EngineUnavailable.of(self.url, e) from None
            if r.status != 200:
                raise RuntimeError(f"engine {self.url} answered {r.status}: {text[:300]}")
            return dict(json.loads(text))

    async def stream(self, req: OpenAIRequest) -> AsyncIterator[bytes]:
        """A streamed request: the engine's SSE bytes as they arrive (``EngineUnavailable`` when the
        connection fails before the first of them)."""
        import aiohttp

        async with await self._post(req) as r:
            if r.status != 200:
                raise RuntimeError(f"engine {self.url} answered {r.status}: {(await r.text())[:300]}")
            started = False
            try:
                async for chunk in r.content.iter_any():
                    started = True
                    yield chunk
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                if started:
                    raise
                raise EngineUnavailable.of(self.url, e) from None


class OpenAIIngress:
    """The HTTP ingress: parses ``/v1/chat/completions`` and ``/v1/completions`` bodies and calls the
    engine deployment through its handle (so the handle's request router sees the prompt), streamed
    or not. A call that fails with ``EngineUnavailable`` before any byte reached the client is made
    again with that engine excluded, up to ``max_attempts`` calls in all. ``GET /kvroute/routers``
    reports this replica's kvroute routers (leases, counts), its retries and the streams whose first
    chunk reached it (``first_chunks``)."""

    def __init__(self, engine: Any, max_attempts: int = 3) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.engine = engine
        self.max_attempts = max_attempts
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.to_full_id_str()
        self.retries = 0
        #: Streams whose first chunk reached this ingress (each reported to the routers, ``_first_token``).
        self.first_chunks = 0

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response, StreamingResponse

        headers = {"x-kvroute-ingress": self.replica}
        if request.method == "GET" and request.url.path.endswith("/kvroute/routers"):
            stats = [{"counts": r.counts, "leases": dict(r.engines.leases.counts), "open": len(r.engines.leases)} for r in routers()]
            out = {"replica": self.replica, "routers": stats, "retries": self.retries, "first_chunks": self.first_chunks}
            return JSONResponse(out, headers=headers)
        path = request.url.path
        if path.endswith("/v1/chat/completions"):
            chat = True
        elif path.endswith("/v1/completions"):
            chat = False
        else:
            return JSONResponse({"error": {"message": f"no route {path}"}}, status_code=404, headers=headers)
        try:
            body = await request.json()
        except ValueError as e:
            return JSONResponse({"error": {"message": f"request body is not valid JSON: {e}"}}, status_code=400, headers=headers)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "request body must be a JSON object"}}, status_code=400, headers=headers)
        req = OpenAIRequest(body, chat)
        for attempt in range(1, self.max_attempts + 1):
            try:
                if body.get("stream"):
                    gen = self.engine.options(stream=True).stream.remote(req)
                    try:
                        first = await gen.__anext__()
                    except StopAsyncIteration:
                        first = None
                    if first is not None:
                        self.first_chunks += 1
                    _first_token()
                    return StreamingResponse(_chain(first, gen), media_type="text/event-stream", headers=headers)
                out = await self.engine.complete.remote(req)
                return Response(json.dumps(out), media_type="application/json", headers=headers)
            except Exception as e:
                down = _unavailable(e)
                if down is None or attempt == self.max_attempts:
                    raise
                log.warning("%s (attempt %d of %d); retrying without it", down, attempt, self.max_attempts)
                self.retries += 1
                req = OpenAIRequest(body, chat, [*req.exclude, down.engine_url])
        raise AssertionError("unreachable")  # pragma: no cover


def _first_token() -> None:
    """Reports a stream's first chunk to this process's routers. A handle call made while serving a
    request carries that request's internal id (Serve's request context), which is the id the
    router leased it under."""
    try:
        rid = serve.context._get_serve_request_context()._internal_request_id
    except AttributeError:  # pragma: no cover - a Serve without the request context
        return
    if rid:
        for r in routers():
            r.prefill_done(rid)


async def _chain(first: bytes | None, rest: Any) -> AsyncIterator[bytes]:
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk


def build_app(
    engines: list[dict[str, str]],
    *,
    request_router_class: str | None = "kvroute.integrations.ray_serve:KvrouteRequestRouter",
    request_router_kwargs: dict[str, Any] | None = None,
    ingress_replicas: int = 1,
    max_ongoing_requests: int = 16,
    max_attempts: int = 3,
    num_cpus: float = 1.0,
) -> Any:
    """A Serve application: ``OpenAIIngress`` (``ingress_replicas``, each holding a handle and so a
    router; ``max_attempts`` calls per request when engines are unavailable) in front of one
    ``EngineReplica`` per engine, routed by ``request_router_class`` (``None``: Serve's default
    power-of-two-choices). Each replica reserves ``num_cpus`` of the cluster (Serve's default, 1):
    ``len(engines) + ingress_replicas`` replicas in all. They only relay HTTP, so a fraction (0.5)
    lets them share a small machine."""
    from ray.serve.config import RequestRouterConfig

    # Typed loosely: Ray's stubs declare request_router_class a dict, and deployment()'s overloads vary by version.
    config: Any = RequestRouterConfig
    deployment: Any = serve.deployment
    if not num_cpus > 0:
        raise ValueError(f"num_cpus must be > 0, got {num_cpus!r}")
    actor = {"num_cpus": num_cpus}
    options: dict[str, Any] = {"num_replicas": len(engines), "max_ongoing_requests": max_ongoing_requests, "ray_actor_options": actor}
    if request_router_class is not None:
        options["request_router_config"] = config(
            request_router_class=request_router_class, request_router_kwargs=dict(request_router_kwargs or {})
        )
    engine = deployment(EngineReplica, name="Engine").options(**options).bind(engines)
    return (
        deployment(OpenAIIngress, name="Ingress")
        .options(num_replicas=ingress_replicas, max_ongoing_requests=256, ray_actor_options=actor)
        .bind(engine, max_attempts)
    )
