"""The engine fleet one Router routes over: the worker table (the host's key and URL of each engine
-> its Router worker id, role and speeds), the KV-event subscriber over every engine that publishes,
and what each engine's /metrics says (its load into ``Router.observe``; its KV cache's block size and
capacity, learned from the engine instead of asked of the user). The gateway's control plane and the
integrations' ``EngineRouter`` both keep their engines here; each adds only what is its own (health
probes and the admin API; leases and cool-downs).

>>> import kvroute
>>> fleet = Fleet(kvroute.Router(block_size=16))
>>> e = fleet.add("a", "http://127.0.0.1:8000")
>>> fleet.observe(e, 'vllm:num_requests_running 3\\nvllm:cache_config_info{block_size="16",num_gpu_blocks="32"} 1')
{'running': 3.0}
>>> fleet.router.load(e.worker)["prefix_cache_blocks"], fleet.router.load(e.worker)["observed_running"]
(31, 3)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

from kvroute._core import Router, UnknownWorkerError
from kvroute.fleet.engine_metrics import CacheConfig, parse_cache_config, parse_engine_metrics

__all__ = ["Engine", "Fleet", "check_prefix_cache_blocks"]

log = logging.getLogger("kvroute.fleet")

Role = Literal["both", "prefill", "decode"]


def check_prefix_cache_blocks(blocks: object) -> int | None:
    """``blocks`` if it is a prefix-cache size (an int >= 0, in KV blocks) or None, else ValueError."""
    if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0):
        raise ValueError(f"prefix_cache_blocks must be an int >= 0 (KV blocks) or None, got {blocks!r}")
    return blocks


@dataclass(frozen=True)
class Engine:
    """One engine: the host's ``key`` for it, its OpenAI base ``url`` (``http://host:port``), the
    Router ``worker`` id it got, its role, its KV-event PUB / replay endpoints when it publishes them,
    and what the Router is told of it (``prefix_cache_blocks`` None: learned from the engine)."""

    key: str
    url: str
    worker: int
    kv_events: str | None = None
    kv_events_replay: str | None = None
    role: Role = "both"
    prefill_tokens_per_s: float = 20000.0
    decode_tokens_per_s: float | None = None
    kv_capacity_blocks: int | None = None
    prefix_cache_blocks: int | None = None


class Fleet:
    """The engines behind one ``router``: see the module docstring. Thread-safe; its methods never
    block on the network but ``poll`` (and the subscriber's own threads)."""

    def __init__(self, router: Router, *, topic: str = "") -> None:
        self.router = router
        rc = router.config
        self.block_size = cast(int, rc["block_size"])
        self.hash_seed = cast(int, rc["hash_seed"])
        self.topic = topic
        self._lock = threading.RLock()
        self._engines: dict[str, Engine] = {}
        self._by_worker: dict[int, Engine] = {}
        self._next_worker = 0
        # What each engine's /metrics said of its cache (worker -> config), and the mismatches already reported.
        self._cache: dict[int, CacheConfig] = {}
        self._warned: set[int] = set()
        self._events = False
        self._subscriber: Any = None

    # ---- the table -----------------------------------------------------------------------

    def add(self, key: str, url: str, **spec: Any) -> Engine:
        """Registers the engine the host calls ``key`` (or returns it when already registered the
        same way) and tells the Router of it; ``spec``: the other `Engine` fields."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"engine key must be a non-empty string, got {key!r}")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"engine {key!r}: url must be http(s)://host:port, got {url!r}")
        if spec.get("kv_events_replay") and not spec.get("kv_events"):
            raise ValueError(f"engine {key!r}: kv_events_replay needs kv_events")
        check_prefix_cache_blocks(spec.get("prefix_cache_blocks"))
        with self._lock:
            e = Engine(key, url.rstrip("/"), self._next_worker, **spec)
            old = self._engines.get(key)
            if old is not None:
                if replace(old, worker=e.worker) != e:
                    raise ValueError(f"engine {key!r} is already registered as {old}")
                return old
            self.register(e)
            self._next_worker += 1
            self._engines[key] = e
            self._by_worker[e.worker] = e
            if e.kv_events and self._events:
                self._resubscribe()
        return e

    def remove(self, key: str) -> Engine | None:
        """Forgets an engine: out of the Router and the KV-event subscription (its index entries are
        the caller's to drop: an event-fed index may be shared)."""
        with self._lock:
            e = self._engines.pop(key, None)
            if e is None:
                return None
            del self._by_worker[e.worker]
            self._cache.pop(e.worker, None)
            self.unregister(e)
            if e.kv_events and self._events:
                self._resubscribe()
        return e

    def register(self, e: Engine) -> None:
        """Puts ``e`` in the Router's routing (again, after a failure), with what its engine said of its cache."""
        self.router.add_worker(
            e.worker,
            role=e.role,
            prefill_tokens_per_s=e.prefill_tokens_per_s,
            kv_capacity_blocks=e.kv_capacity_blocks,
            decode_tokens_per_s=e.decode_tokens_per_s,
            prefix_cache_blocks=self._prefix_cache_blocks(e),
        )

    def unregister(self, e: Engine) -> None:
        """Takes ``e`` out of the Router's routing (it stays in the table)."""
        with contextlib.suppress(UnknownWorkerError):
            self.router.remove_worker(e.worker)

    def get(self, key: str) -> Engine | None:
        return self._engines.get(key)

    def of_worker(self, worker: int) -> Engine | None:
        """The engine behind a Router worker id (None once removed)."""
        return self._by_worker.get(worker)

    def engines(self) -> list[Engine]:
        with self._lock:
            return list(self._engines.values())

    def __len__(self) -> int:
        return len(self._engines)

    # ---- engine /metrics ------------------------------------------------------------------

    def observe(self, e: Engine, text: str) -> dict[str, float]:
        """Folds one read of ``e``'s /metrics into the Router: its waiting / running / KV usage into
        ``Router.observe``, and its cache configuration (block size checked against the Router's,
        prefix-cache size registered where none was given). Returns the load figures found."""
        seen = parse_engine_metrics(text)
        if seen:
            with contextlib.suppress(UnknownWorkerError):
                self.router.observe(
                    e.worker,
                    waiting=int(seen["waiting"]) if "waiting" in seen else None,
                    running=int(seen["running"]) if "running" in seen else None,
                    kv_usage=seen.get("kv_usage"),
                )
        cache = parse_cache_config(text)
        if cache is not None and self._cache.get(e.worker) != cache:
            self._learn(e, cache)
        return seen

    def poll(self, e: Engine, timeout: float = 2.0) -> tuple[dict[str, float] | None, bool]:
        """Reads ``e``'s /metrics once (blocking) and observes it: (the load figures or None when the
        read failed, whether the connection was refused: nothing listens, the engine died)."""
        try:
            with urllib.request.urlopen(e.url + "/metrics", timeout=timeout) as r:
                text = r.read().decode("utf-8", "replace")
        except (OSError, urllib.error.URLError, ValueError) as exc:
            log.debug("metrics of %s: %s", e.url, exc)
            refused = isinstance(exc, ConnectionRefusedError) or isinstance(getattr(exc, "reason", None), ConnectionRefusedError)
            return None, refused
        return self.observe(e, text), False

    def cache_config(self, e: Engine) -> CacheConfig | None:
        """What ``e``'s /metrics last said of its cache (None before any read that had it)."""
        return self._cache.get(e.worker)

    def _prefix_cache_blocks(self, e: Engine) -> int | None:
        if e.prefix_cache_blocks is not None:
            return e.prefix_cache_blocks
        cache = self._cache.get(e.worker)
        return cache.prefix_cache_blocks if cache is not None else None

    def _learn(self, e: Engine, cache: CacheConfig) -> None:
        with self._lock:
            self._cache[e.worker] = cache
        if cache.block_size is not None and cache.block_size != self.block_size and e.worker not in self._warned:
            self._warned.add(e.worker)
            # With KV events the engine's blocks hash to other sequence hashes than the Router's
            # requests: no event ever matches, every prefix looks cold. Without, only the cache
            # size is counted in the wrong blocks.
            log.error(
                "engine %s (%s) uses %d-token KV blocks, the router %d: %s; give the router block_size=%d",
                e.key,
                e.url,
                cache.block_size,
                self.block_size,
                "its KV events will never match a request" if e.kv_events else "its cache size is misjudged",
                cache.block_size,
            )
        if e.prefix_cache_blocks is None and cache.prefix_cache_blocks is not None:
            with contextlib.suppress(UnknownWorkerError):  # out of routing now: registered with it when back
                self.router.set_prefix_cache_blocks(e.worker, cache.prefix_cache_blocks)
            log.info("engine %s: prefix cache of %d blocks (from its /metrics)", e.key, cache.prefix_cache_blocks)

    # ---- KV events --------------------------------------------------------------------------

    def start_events(self) -> None:
        """Subscribes to every engine's KV events, now and whenever one is added or removed."""
        with self._lock:
            self._events = True
            self._resubscribe()

    def stop_events(self) -> None:
        """Stops the subscriber (bounded wait)."""
        with self._lock:
            self._events = False
            if self._subscriber is not None:
                self._subscriber.stop()
                self._subscriber = None

    def subscriber_stats(self) -> dict[str, Any] | None:
        """The KV-event subscriber's counters (``None`` while none runs)."""
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
        return sub is None or bool(sub.synced)

    def wait_synced(self, timeout: float = 5.0) -> bool:
        """Blocks (at most ``timeout`` s) until the start-up replay of every engine's KV events is
        done, so the first decisions see what the engines cached before the router started."""
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
