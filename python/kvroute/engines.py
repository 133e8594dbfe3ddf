"""Engines known by a host's own names (a URL, a LiteLLM deployment id, a Ray replica id), mapped to
Router workers, with one KvEventSubscriber and an engine /metrics poller keeping the Router true.

``EngineRouter`` is what the integrations share: an OpenAI request body in, a leased pick among the
host's candidate engines out (``kvroute.prompt`` + ``kvroute.lease`` on one Router).

>>> from kvroute.engines import EngineRouter
>>> er = EngineRouter(block_size=16)
>>> a, b = er.add("a", "http://127.0.0.1:8000"), er.add("b", "http://127.0.0.1:8001")
>>> lease = er.lease({"prompt": "x" * 400}, chat=False, candidates=["a", "b"])
>>> er.engine_of(lease).key in ("a", "b"), er.leases.finish(lease.ticket)
(True, True)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvroute._core import NoWorkersError, Router, UnknownWorkerError
from kvroute.gateway.engine_metrics import parse_engine_metrics
from kvroute.lease import Lease, LeaseTable
from kvroute.prompt import ApproxCache, Prompter, load_prompter

__all__ = ["DEFAULT_TOKEN_SHARE_BOUND", "Engine", "EngineRouter", "NoCandidates"]

#: EngineRouter's bounded token share (``kvroute.Router``'s ``token_share_bound``): see EngineRouter.
DEFAULT_TOKEN_SHARE_BOUND = 1.25

log = logging.getLogger(__name__)


class NoCandidates(NoWorkersError):
    """None of the host's candidate engines can take the request (unknown, or all excluded)."""


@dataclass(frozen=True)
class Engine:
    """One engine: the host's ``key`` for it, its OpenAI base ``url`` (``http://host:port``), the
    Router ``worker`` id it got, and its KV-event PUB / replay endpoints when it publishes them."""

    key: str
    url: str
    worker: int
    kv_events: str | None = None
    kv_events_replay: str | None = None


class EngineRouter:
    """A Router over engines named by the host, a prompter, request leases, KV events and load polling.

    ``tokenizer``: the engines' ``tokenizer.json`` (or its directory) for exact mode; its hashes equal
    the engines' KV events, so engines added with ``kv_events`` keep the index true. Without one
    (approximate mode, text blocks), or for engines without KV events, the Router learns cache state
    from its own decisions (``ApproxCache``, ``approx_ttl`` seconds). ``block_size`` must be the
    engines' KV block size when KV events are used. ``lease_ttl`` bounds how long a request nobody
    reports back holds load; ``metrics_interval`` (seconds, ``None`` = off) polls each engine's
    /metrics into ``Router.observe``, which is how load caused by other routers (other LiteLLM or
    Ray processes) is seen. ``failure_cooldown``: an engine a request failed on gets no new requests
    for that long, unless it is the only candidate. ``decode_tokens_per_s`` (``None`` = unknown)
    registers the engines' decode speed: the Router's TPOT model, ``decode_step_s + batch /
    decode_tokens_per_s`` (``decode_step_s`` is a Router argument), and on these unified engines the
    step a new prefill runs in beside the requests already there, which the default policy charges
    (docs/router.md, "Load model"). ``prefix_cache_blocks`` (``None`` = unknown) registers the
    engines' prefix-cache size in KV blocks (vLLM: its ``num_gpu_blocks`` minus its null block), which
    the ``capacity`` policy (and ``eviction_weight``) needs to charge what a placement evicts; the
    occupancy is the index's count for the engine, raised by the engine's reported KV usage when
    that is higher. 0 (prefix caching off) is charged nothing, as ``None`` is: no cached block to
    evict. ``token_share_bound`` (default 1.25; ``None`` = off) keeps every engine within that many
    times the mean of the prompt tokens this router sent over its load window (``kvroute.Router``'s
    bounded token share, docs/router.md): behind a host router the engines are unified, so a prompt's
    tokens stay on its engine as KV for its whole decode, and a cache-affine policy would otherwise let
    one popular prefix family hold most of the pool's running KV where prefill is too cheap for the
    queue to move it. ``router_kwargs`` go to ``kvroute.Router``.
    """

    def __init__(
        self,
        *,
        block_size: int = 16,
        tokenizer: str | None = None,
        hash_seed: int = 1337,
        topic: str = "",
        prefill_tokens_per_s: float = 20000.0,
        decode_tokens_per_s: float | None = None,
        prefix_cache_blocks: int | None = None,
        lease_ttl: float = 600.0,
        approx_ttl: float = 120.0,
        metrics_interval: float | None = None,
        failure_cooldown: float = 10.0,
        token_share_bound: float | None = DEFAULT_TOKEN_SHARE_BOUND,
        clock: Callable[[], float] = time.monotonic,
        **router_kwargs: Any,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if metrics_interval is not None and not metrics_interval > 0:
            raise ValueError(f"metrics_interval must be > 0 seconds or None, got {metrics_interval}")
        if failure_cooldown < 0:
            raise ValueError(f"failure_cooldown must be >= 0 seconds, got {failure_cooldown}")
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.topic = topic
        if decode_tokens_per_s is not None and not decode_tokens_per_s > 0:
            raise ValueError(f"decode_tokens_per_s must be > 0 or None, got {decode_tokens_per_s}")
        if prefix_cache_blocks is not None and (
            isinstance(prefix_cache_blocks, bool) or not isinstance(prefix_cache_blocks, int) or prefix_cache_blocks < 0
        ):
            raise ValueError(f"prefix_cache_blocks must be an int >= 0 (KV blocks) or None, got {prefix_cache_blocks!r}")
        self.prefix_cache_blocks = prefix_cache_blocks
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_tokens_per_s = decode_tokens_per_s
        self.metrics_interval = metrics_interval
        self.failure_cooldown = failure_cooldown
        self.clock = clock
        self.prompter: Prompter = load_prompter(tokenizer, block_size, hash_seed)
        self.router = Router(block_size=block_size, hash_seed=hash_seed, token_share_bound=token_share_bound, **router_kwargs)
        self.leases = LeaseTable(self.router, ttl=lease_ttl, clock=clock)
        self.approx = ApproxCache(self.router.index, approx_ttl)
        self._lock = threading.RLock()
        self._engines: dict[str, Engine] = {}
        self._by_worker: dict[int, Engine] = {}
        self._failed_at: dict[str, float] = {}
        self._next_worker = 0
        self._subscriber: Any = None
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- engines -----------------------------------------------------------------------

    def add(self, key: str, url: str, *, kv_events: str | None = None, kv_events_replay: str | None = None) -> Engine:
        """Registers (or returns, when already registered the same way) the engine the host calls ``key``."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"engine key must be a non-empty string, got {key!r}")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"engine {key!r}: url must be http(s)://host:port, got {url!r}")
        if kv_events_replay and not kv_events:
            raise ValueError(f"engine {key!r}: kv_events_replay needs kv_events")
        if kv_events and self.prompter.mode != "exact":
            raise ValueError(
                f"engine {key!r}: KV events carry token ids, so they need exact mode (a tokenizer); "
                "approximate mode learns the cache from its own decisions instead"
            )
        url = url.rstrip("/")
        with self._lock:
            old = self._engines.get(key)
            if old is not None:
                if (old.url, old.kv_events, old.kv_events_replay) != (url, kv_events, kv_events_replay):
                    raise ValueError(f"engine {key!r} is already registered as {old}")
                return old
            e = Engine(key, url, self._next_worker, kv_events, kv_events_replay)
            self._next_worker += 1
            self.router.add_worker(
                e.worker,
                prefill_tokens_per_s=self.prefill_tokens_per_s,
                decode_tokens_per_s=self.decode_tokens_per_s,
                prefix_cache_blocks=self.prefix_cache_blocks,
            )
            self._engines[key] = e
            self._by_worker[e.worker] = e
            if kv_events:
                self._resubscribe()
        return e

    def remove(self, key: str) -> None:
        """Forgets an engine: its open leases are released (as failed) and its cache state dropped."""
        with self._lock:
            e = self._engines.pop(key, None)
            if e is None:
                return
            del self._by_worker[e.worker]
            self._failed_at.pop(key, None)
            self.leases.release_worker(e.worker)
            with contextlib.suppress(UnknownWorkerError):
                self.router.remove_worker(e.worker)
            self.approx.drop_worker(e.worker)
            if e.kv_events:
                self._resubscribe()

    def get(self, key: str) -> Engine | None:
        return self._engines.get(key)

    def engines(self) -> list[Engine]:
        with self._lock:
            return list(self._engines.values())

    def engine_of(self, lease: Lease) -> Engine:
        """The engine a lease was routed to."""
        return self._by_worker[lease.worker]

    def engine_of_worker(self, worker: int) -> Engine | None:
        """The engine behind a Router worker id (None once removed)."""
        return self._by_worker.get(worker)

    def mark_failed(self, key: str) -> None:
        """A request failed on ``key``: keep new requests off it for ``failure_cooldown`` seconds."""
        with self._lock:
            e = self._engines.get(key)
            if e is not None:
                self._failed_at[key] = self.clock()
                self.approx.drop_worker(e.worker)

    def cooling_down(self, key: str) -> bool:
        t = self._failed_at.get(key)
        return t is not None and self.clock() - t < self.failure_cooldown

    # ---- routing -----------------------------------------------------------------------

    def lease(
        self,
        body: dict[str, Any],
        chat: bool,
        candidates: Iterable[str] | None = None,
        exclude: Iterable[str] = (),
        ticket: str | None = None,
    ) -> Lease:
        """Routes one OpenAI request body among ``candidates`` (engine keys; default all) minus
        ``exclude`` (what this request already failed on) and leases the choice.

        Engines cooling down after a failure are skipped while any other candidate remains. Raises
        ``kvroute.prompt.BadRequest`` for a body that is not a completions / chat request,
        ``NoCandidates`` when no candidate is registered and not excluded."""
        prompt = self.prompter.prompt(body, chat)
        excluded = set(exclude)
        with self._lock:
            keys = list(self._engines) if candidates is None else list(candidates)
            pool = [self._engines[k] for k in keys if k in self._engines and k not in excluded]
            if not pool:
                raise NoCandidates(f"no routable engine among {sorted(set(keys))} (excluded: {sorted(excluded)})")
            warm = [e for e in pool if not self.cooling_down(e.key)]
            allowed = {e.worker for e in (warm or pool)}
            everyone = len(allowed) == len(self._engines)
        now = self.clock()
        lease = self.leases.open(prompt.hashes, prompt.num_tokens, prompt.output_tokens, None if everyone else allowed, ticket)
        with self._lock:  # the engine table may change under us
            self.approx.expire(now)
            e = self._by_worker.get(lease.worker)
            if e is not None and not e.kv_events:
                self.approx.insert(lease.worker, prompt.hashes, now)
        return lease

    # ---- background: KV events and engine load ----------------------------------------

    def start(self) -> EngineRouter:
        """Starts the engine /metrics poller (when ``metrics_interval`` is set); KV-event subscription
        starts as soon as an engine with ``kv_events`` is added."""
        if self.metrics_interval is not None and self._poller is None:
            self._stop.clear()
            self._poller = threading.Thread(target=self._poll_loop, name="kvroute-engine-metrics", daemon=True)
            self._poller.start()
        return self

    def close(self) -> None:
        """Stops the poller and the KV-event subscriber (bounded waits)."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5.0)
            self._poller = None
        with self._lock:
            if self._subscriber is not None:
                self._subscriber.stop()
                self._subscriber = None

    def __enter__(self) -> EngineRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def subscriber_stats(self) -> dict[str, Any] | None:
        """The KV-event subscriber's counters (``None`` before any engine with ``kv_events``)."""
        sub = self._subscriber
        return None if sub is None else dict(sub.stats())

    def _resubscribe(self) -> None:
        """One subscriber for every engine's stream; rebuilt when the set changes. The new one
        resumes each engine it already followed from the last batch applied (its replay endpoint
        fills what was published meanwhile) and replays a new engine's buffered history."""
        from kvroute.events import KvEventSubscriber

        resume: dict[int, int] = {}
        old, self._subscriber = self._subscriber, None
        if old is not None:
            try:
                old.stop()
            except (RuntimeError, TimeoutError) as exc:  # its thread failed: re-read every stream
                log.warning("KV-event subscriber: %s; the new one replays every engine's history", exc)
            else:
                for w, st in old.stats()["workers"].items():
                    if st["last_seq"] is not None:
                        resume[w] = st["last_seq"]
        pubs = {e.worker: e.kv_events for e in self._engines.values() if e.kv_events}
        if not pubs:
            return
        replay = {e.worker: e.kv_events_replay for e in self._engines.values() if e.kv_events and e.kv_events_replay}
        self._subscriber = KvEventSubscriber(
            self.router.index,
            pubs,
            replay_endpoints=replay or None,
            topic=self.topic,
            block_size=self.block_size,
            seed=self.hash_seed,
            # Only streams that can be replayed resume: without replay, a gap would clear the worker.
            resume_from={w: seq for w, seq in resume.items() if w in replay},
        ).start()

    def synced(self) -> bool:
        """True when no KV-event subscriber runs or its start-up replay of every engine is done."""
        sub = self._subscriber
        return sub is None or sub.synced

    def wait_synced(self, timeout: float = 5.0) -> bool:
        """Blocks (at most ``timeout`` s) until the start-up replay of every engine's KV events is
        done, so the first decisions of a new router see what the engines cached before it started."""
        sub = self._subscriber
        if sub is None or sub.synced:
            return True
        return bool(sub.wait_for(lambda s: bool(s["synced"]), timeout))

    async def wait_synced_async(self, timeout: float = 5.0) -> bool:
        """``wait_synced`` for asyncio code."""
        sub = self._subscriber
        if sub is None or sub.synced:
            return True
        return bool(await sub.wait_for_async(lambda s: bool(s["synced"]), timeout))

    def poll_metrics(self, engine: Engine, timeout: float = 2.0) -> dict[str, float] | None:
        """Reads one engine's /metrics once and folds waiting / running / KV usage into ``Router.observe``.

        An engine that refuses the connection (nothing listens: it died) is marked failed, so new
        requests avoid it for ``failure_cooldown`` seconds, renewed by every refused poll; a slow or
        otherwise failing poll changes nothing."""
        try:
            with urllib.request.urlopen(engine.url + "/metrics", timeout=timeout) as r:
                text = r.read().decode("utf-8", "replace")
        except (OSError, urllib.error.URLError, ValueError) as e:
            log.debug("metrics of %s: %s", engine.url, e)
            if isinstance(e, ConnectionRefusedError) or isinstance(getattr(e, "reason", None), ConnectionRefusedError):
                self.mark_failed(engine.key)
            return None
        seen = parse_engine_metrics(text)
        if seen:
            with contextlib.suppress(UnknownWorkerError):
                self.router.observe(
                    engine.worker,
                    waiting=int(seen["waiting"]) if "waiting" in seen else None,
                    running=int(seen["running"]) if "running" in seen else None,
                    kv_usage=seen.get("kv_usage"),
                )
        return seen

    def _poll_loop(self) -> None:
        assert self.metrics_interval is not None
        while not self._stop.is_set():
            for e in self.engines():
                if self._stop.is_set():
                    break
                self.poll_metrics(e)
            self._stop.wait(self.metrics_interval)
