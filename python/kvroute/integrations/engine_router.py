"""Engines known by a host's own names (a URL, a LiteLLM deployment id, a Ray replica id), mapped to
Router workers, with one KvEventSubscriber and an engine /metrics poller keeping the Router true.

``EngineRouter`` is what the integrations share: an OpenAI request body in, a leased pick among the
host's candidate engines out (``kvroute.prompt`` + ``kvroute.integrations.lease`` on one Router).

>>> from kvroute.integrations.engine_router import EngineRouter
>>> er = EngineRouter(block_size=16)
>>> a, b = er.add("a", "http://127.0.0.1:8000"), er.add("b", "http://127.0.0.1:8001")
>>> lease = er.lease({"prompt": "x" * 400}, chat=False, candidates=["a", "b"])
>>> er.engine_of(lease).key in ("a", "b"), er.leases.finish(lease.ticket)
(True, True)
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

from kvroute._core import NoWorkersError, PrefixCheck, Router, router_parameters
from kvroute.fleet import Engine, Fleet, check_prefix_cache_blocks
from kvroute.integrations.lease import Lease, LeaseTable
from kvroute.prompt import ApproxCache, Prompter, load_prompter

__all__ = ["DEFAULT_TOKEN_SHARE_BOUND", "Engine", "EngineRouter", "NoCandidates"]

#: EngineRouter's bounded token share: the Router's "host_router" preset (docs/router.md, "Configuration").
DEFAULT_TOKEN_SHARE_BOUND = cast(float, next(d for n, _, d, _, _ in router_parameters("host_router") if n == "token_share_bound"))

log = logging.getLogger(__name__)


class NoCandidates(NoWorkersError):
    """None of the host's candidate engines can take the request (unknown, or all excluded)."""


class EngineRouter:
    """A Router over engines named by the host, a prompter, request leases, KV events and load polling.

    ``tokenizer``: the engines' ``tokenizer.json`` (or its directory) for exact mode; its hashes equal
    the engines' KV events, so engines added with ``kv_events`` keep the index true. Without one
    (approximate mode, text blocks), or for engines without KV events, the Router learns cache state
    from its own decisions (``ApproxCache``, ``approx_ttl`` seconds). ``block_size`` (default: the
    Router's "host_router" preset, 16, vLLM's default) must be the engines' KV block size when KV
    events are used; the poller reports an engine whose /metrics says otherwise. ``lease_ttl`` bounds how long a request nobody
    reports back holds load; ``metrics_interval`` (seconds, ``None`` = off) polls each engine's
    /metrics into ``Router.observe``, which is how load caused by other routers (other LiteLLM or
    Ray processes) is seen. ``failure_cooldown``: an engine a request failed on gets no new requests
    for that long, unless it is the only candidate. ``decode_tokens_per_s`` (``None`` = unknown)
    registers the engines' decode speed: the Router's TPOT model, ``decode_step_s + batch /
    decode_tokens_per_s`` (``decode_step_s`` is a Router argument), and on these unified engines the
    step a new prefill runs in beside the requests already there, which the default policy charges
    (docs/router.md, "Load model"). ``prefix_cache_blocks`` (``None``: read from each engine's
    /metrics, vLLM's ``cache_config_info``, by the poller) registers the engines' prefix-cache size in
    KV blocks (vLLM: its ``num_gpu_blocks`` minus its null block), which
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
        block_size: int | None = None,
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
        if block_size is None:
            block_size = cast(int, next(d for n, _, d, _, _ in router_parameters("host_router") if n == "block_size"))
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
        self.prefix_cache_blocks = check_prefix_cache_blocks(prefix_cache_blocks)
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_tokens_per_s = decode_tokens_per_s
        self.metrics_interval = metrics_interval
        self.failure_cooldown = failure_cooldown
        self.clock = clock
        self.prompter: Prompter = load_prompter(tokenizer, block_size, hash_seed)
        self.router = Router(
            preset="host_router", block_size=block_size, hash_seed=hash_seed, token_share_bound=token_share_bound, **router_kwargs
        )
        self.fleet = Fleet(self.router, topic=topic)
        # KV events from every engine that publishes them, as soon as it is added.
        self.fleet.start_events()
        self.leases = LeaseTable(self.router, ttl=lease_ttl, clock=clock)
        self.approx = ApproxCache(self.router.index, approx_ttl)
        self._lock = threading.RLock()
        self._failed_at: dict[str, float] = {}
        #: Per engine key, the models it serves and which are LoRA adapters (``set_models``, or read
        #: from its /v1/models by ``refresh_models``); an engine not in it may serve any model.
        self._models: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        self._configured: set[str] = set()
        #: The self-check: predicted against reported cached tokens (``check_usage``).
        self.check = PrefixCheck()
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- engines -----------------------------------------------------------------------

    def add(
        self,
        key: str,
        url: str,
        *,
        kv_events: str | None = None,
        kv_events_replay: str | None = None,
        models: Iterable[str] | None = None,
        adapters: Iterable[str] = (),
    ) -> Engine:
        """Registers (or returns, when already registered the same way) the engine the host calls ``key``.
        Its prefix-cache size (unless given as ``prefix_cache_blocks``) and block size are read from
        its /metrics by the poller (``metrics_interval``) or ``poll_metrics``; the models it serves
        (``models``, with ``adapters`` among them naming its LoRA adapters) are read from its
        /v1/models by the poller or ``refresh_models`` unless given here."""
        if kv_events and self.prompter.mode != "exact":
            raise ValueError(
                f"engine {key!r}: KV events carry token ids, so they need exact mode (a tokenizer); "
                "approximate mode learns the cache from its own decisions instead"
            )
        if models is not None:
            self.set_models(key, models, adapters)
        known = self.fleet.get(key) is not None
        e = self.fleet.add(
            key,
            url,
            kv_events=kv_events,
            kv_events_replay=kv_events_replay,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
            prefix_cache_blocks=self.prefix_cache_blocks,
        )
        if not known and models is None:
            # Its model list off the caller's thread (a host may add engines on its event loop).
            threading.Thread(target=self.refresh_models, args=(e,), name="kvroute-models", daemon=True).start()
        return e

    def set_models(self, key: str, models: Iterable[str], adapters: Iterable[str] = ()) -> None:
        """The models engine ``key`` serves (its base model and LoRA adapters, by the names the
        engine serves them under) and which of them are adapters; kept until ``remove``."""
        ms, ads = frozenset(models), frozenset(adapters)
        if not ms or not all(isinstance(m, str) and m for m in ms):
            raise ValueError(f"engine {key!r}: models must be a non-empty list of names, got {sorted(ms)!r}")
        if not ads <= ms:
            raise ValueError(f"engine {key!r}: adapters {sorted(ads - ms)} are not among its models")
        with self._lock:
            self._models[key] = (ms, ads)
            self._configured.add(key)

    def models(self, key: str) -> tuple[frozenset[str], frozenset[str]] | None:
        """(models, adapters) engine ``key`` serves, None while not known."""
        return self._models.get(key)

    def refresh_models(self, engine: Engine, timeout: float = 2.0) -> bool:
        """Reads the models an engine serves from its /v1/models (vLLM lists a LoRA adapter with its
        base model as ``parent``); False when it did not answer with a model list (the last one
        stays). Engines whose models were given (``set_models``) are not read."""
        if engine.key in self._configured:
            return True
        try:
            with urllib.request.urlopen(engine.url + "/v1/models", timeout=timeout) as r:
                data = json.loads(r.read())["data"]
            ms = frozenset(str(m["id"]) for m in data)
            ads = frozenset(str(m["id"]) for m in data if isinstance(m.get("parent"), str))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        with self._lock:
            if self.fleet.get(engine.key) is not None and ms:
                self._models[engine.key] = (ms, ads)
        return True

    def remove(self, key: str) -> None:
        """Forgets an engine: its open leases are released (as failed) and its cache state dropped."""
        with self._lock:
            e = self.fleet.remove(key)
            if e is None:
                return
            self._models.pop(key, None)
            self._configured.discard(key)
            self._failed_at.pop(key, None)
            self.leases.release_worker(e.worker)
            self.approx.drop_worker(e.worker)

    def get(self, key: str) -> Engine | None:
        return self.fleet.get(key)

    def engines(self) -> list[Engine]:
        return self.fleet.engines()

    def engine_of(self, lease: Lease) -> Engine:
        """The engine a lease was routed to."""
        e = self.fleet.of_worker(lease.worker)
        if e is None:
            raise KeyError(f"the engine of worker {lease.worker} was removed")
        return e

    def engine_of_worker(self, worker: int) -> Engine | None:
        """The engine behind a Router worker id (None once removed)."""
        return self.fleet.of_worker(worker)

    def mark_failed(self, key: str) -> None:
        """A request failed on ``key``: keep new requests off it for ``failure_cooldown`` seconds."""
        with self._lock:
            e = self.fleet.get(key)
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
        *,
        model: str | None = None,
    ) -> Lease:
        """Routes one OpenAI request body among ``candidates`` (engine keys; default all) minus
        ``exclude`` (what this request already failed on) and leases the choice.

        ``model``: the name the engines serve the request under (default: the body's ``model``; a
        host that renames models, as LiteLLM's deployments do, passes the engine's name). Only
        engines serving it are candidates (engines whose models are not known may serve any); when
        it names a LoRA adapter, the prompt is keyed by it, and by the body's ``cache_salt``, as the
        engine keys its KV. Engines cooling down after a failure are skipped while any other
        candidate remains. Raises ``kvroute.prompt.BadRequest`` for a body that is not a completions
        / chat request, ``NoCandidates`` when no candidate is registered, serves the model and is
        not excluded."""
        served = model if model is not None else body.get("model") if isinstance(body.get("model"), str) else None
        excluded = set(exclude)
        lora = None
        with self._lock:
            engines = {e.key: e for e in self.fleet.engines()}
            keys = list(engines) if candidates is None else list(candidates)
            pool = [engines[k] for k in keys if k in engines and k not in excluded]
            if not pool:
                raise NoCandidates(f"no routable engine among {sorted(set(keys))} (excluded: {sorted(excluded)})")
            if served is not None and any(e.key in self._models for e in pool):
                pool = [e for e in pool if e.key not in self._models or served in self._models[e.key][0]]
                if not pool:
                    raise NoCandidates(f"no candidate engine serves model {served!r}")
                if any(served in self._models[e.key][1] for e in pool if e.key in self._models):
                    lora = served
            warm = [e for e in pool if not self.cooling_down(e.key)]
            allowed = {e.worker for e in (warm or pool)}
            everyone = len(allowed) == len(engines)
        prompt = self.prompter.prompt(body, chat, lora=lora)
        now = self.clock()
        lease = self.leases.open(prompt.hashes, prompt.num_tokens, prompt.output_tokens, None if everyone else allowed, ticket)
        if self.prompter.mode == "exact" and prompt.exact:
            lease.routed_tokens = prompt.num_tokens
        with self._lock:  # the engine table may change under us
            self.approx.expire(now)
            e = self.fleet.of_worker(lease.worker)
            if e is not None and not e.kv_events:
                self.approx.insert(lease.worker, prompt.hashes, now)
        return lease

    def check_usage(self, lease: Lease, usage: Any) -> str | None:
        """The router checks itself: compares the overlap it predicted for ``lease`` with what the
        engine reports it reused (``usage``: the response's usage, a mapping or an object with
        ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``; vLLM reports them with
        ``--enable-prompt-tokens-details``). Returns the outcome ("match", "over", "under",
        "prompt_length"), or None when there is nothing to compare (no usage figures, or an
        approximate prompt whose tokens are not the engine's). Too many mismatches over the last
        requests log one warning naming the likely cause (``check``; docs/events.md)."""
        prompt_tokens, cached = _usage_figures(usage)
        if prompt_tokens is None or cached is None or lease.routed_tokens is None or cached > prompt_tokens:
            return None
        outcome, alarm = self.check.observe(
            lease.worker,
            lease.decision.overlap_blocks,
            self.block_size,
            prompt_tokens,
            cached,
            routed_tokens=lease.routed_tokens,
            indexed_blocks=self.router.index.num_blocks(lease.worker),
        )
        if alarm is not None:
            log.warning("%s", alarm)
        return outcome

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
        self.fleet.stop_events()

    def __enter__(self) -> EngineRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def subscriber_stats(self) -> dict[str, Any] | None:
        """The KV-event subscriber's counters (``None`` before any engine with ``kv_events``)."""
        return self.fleet.subscriber_stats()

    def synced(self) -> bool:
        """True when no KV-event subscriber runs or its start-up replay of every engine is done."""
        return self.fleet.synced()

    def wait_synced(self, timeout: float = 5.0) -> bool:
        """Blocks (at most ``timeout`` s) until the start-up replay of every engine's KV events is
        done, so the first decisions of a new router see what the engines cached before it started."""
        return self.fleet.wait_synced(timeout)

    async def wait_synced_async(self, timeout: float = 5.0) -> bool:
        """``wait_synced`` for asyncio code."""
        return await self.fleet.wait_synced_async(timeout)

    def poll_metrics(self, engine: Engine, timeout: float = 2.0) -> dict[str, float] | None:
        """Reads one engine's /metrics once and folds it into the Router (``Fleet.observe``: load
        into ``Router.observe``, the cache's size and block size learned).

        An engine that refuses the connection (nothing listens: it died) is marked failed, so new
        requests avoid it for ``failure_cooldown`` seconds, renewed by every refused poll; a slow or
        otherwise failing poll changes nothing."""
        seen, refused = self.fleet.poll(engine, timeout)
        if refused:
            self.mark_failed(engine.key)
        return seen

    def _poll_loop(self) -> None:
        assert self.metrics_interval is not None
        while not self._stop.is_set():
            for e in self.engines():
                if self._stop.is_set():
                    break
                self.poll_metrics(e)
                self.refresh_models(e)
            self._stop.wait(self.metrics_interval)


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _usage_figures(usage: Any) -> tuple[int | None, int | None]:
    """(prompt_tokens, cached_tokens) of an OpenAI usage object or mapping, None where absent."""
    if usage is None:
        return None, None
    prompt = _field(usage, "prompt_tokens")
    details = _field(usage, "prompt_tokens_details")
    cached = None if details is None else _field(details, "cached_tokens")
    ok = [v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None for v in (prompt, cached)]
    return ok[0], ok[1]
