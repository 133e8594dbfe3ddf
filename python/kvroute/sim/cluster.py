"""The cluster model: simulated prefill engines (Rust LRU caches, FIFO queues, KV events) driven
request by request in virtual time, with every routing decision made by a router object.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, cast

from kvroute import KvIndex, _core
from kvroute.sim.progress import Progress
from kvroute.sim.summary import RunResult, summarize
from kvroute.sim.workload import Workload

if TYPE_CHECKING:
    from kvroute._core import Policy

__all__ = ["SEED_CLUSTER", "ClusterConfig", "make_router", "simulate"]


@dataclass(frozen=True)
class ClusterConfig:
    """The simulated cluster. Defaults are the seed's: 8 prefill instances, each with an
    LRU cache of 3000 blocks and a FIFO queue at 20000 tokens/s, a TTFT SLO of 2 s."""

    instances: int = 8
    cache_blocks: int = 3000
    speed: float = 20000.0
    slo: float = 2.0
    #: Seconds between an engine storing/evicting a block and the router's index seeing it.
    event_lag: float = 0.0
    #: The global-cache bound: one LRU of ``cache_blocks * instances`` blocks that every prefill
    #: instance reads and fills (no prefix is ever duplicated), queues still per instance.
    shared_cache: bool = False
    #: PD mode when > 0: decode instances (worker ids after the prefill ones), each holding
    #: ``decode_kv_blocks`` KV blocks, stepping in ``decode_step_s + batch / decode_tokens_per_s``
    #: seconds per output token (the Router's TPOT model); prefilled KV moves at ``link_bytes_per_s``
    #: (``kv_bytes_per_token`` per token, plus ``link_latency_s``), as the Router assumes.
    decode_instances: int = 0
    decode_kv_blocks: int = 20000
    decode_tokens_per_s: float = 2000.0
    decode_step_s: float = 0.01
    tpot_slo: float | None = None
    kv_bytes_per_token: float = 327_680.0
    link_bytes_per_s: float = 25e9
    link_latency_s: float = 0.001
    #: Bytes sent per KV byte (1: as stored; 0.5: fp8 from 16-bit KV, the seed documents'
    #: compressed transfer). The Router is told the same.
    kv_compression: float = 1.0
    #: Incremental transfer (the seed documents'): each decode instance keeps an LRU prefix cache
    #: of ``decode_kv_blocks`` blocks that publishes KV events like the prefill engines', and only the
    #: blocks it lacks cross the link (the Router's transfer estimate already counts only those).
    incremental_transfer: bool = False
    #: The seed documents' decode admission: a sequence joins a decode instance's batch only
    #: while at most 256 run and the estimated ITL with it stays under 1.2 x the target (the TPOT
    #: SLO, or the seed's 50 ms); otherwise it waits for running sequences to finish.
    decode_admission: bool = False
    #: The seed documents' prefill batching when > 0 (the seed: 8192): an idle instance waits
    #: ``prefill_batch_wait_s`` (10 ms) for a batch to form, then runs its pending requests sorted by
    #: prompt length while their prompt tokens fit this budget (a longer prompt runs alone); every
    #: request of a batch gets its first token when the batch ends. 0: FIFO, one request at a time.
    prefill_batch_tokens: int = 0
    prefill_batch_wait_s: float = 0.01

    def max_decode_batch(self) -> int | None:
        """With ``decode_admission``: the largest batch the seed's rule admits (at least 1)."""
        if not self.decode_admission:
            return None
        target = self.tpot_slo if self.tpot_slo is not None else 0.05
        # Estimated ITL with b running: decode_step_s + b / decode_tokens_per_s < 1.2 * target.
        b = math.ceil((1.2 * target - self.decode_step_s) * self.decode_tokens_per_s) - 1
        return max(1, min(256, b))

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if self.cache_blocks < 0:
            raise ValueError(f"cache_blocks must be >= 0, got {self.cache_blocks}")
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0 tokens/s, got {self.speed}")
        if not self.slo > 0:
            raise ValueError(f"slo must be > 0 seconds, got {self.slo}")
        if not self.event_lag >= 0:
            raise ValueError(f"event_lag must be >= 0 seconds, got {self.event_lag}")
        if self.decode_instances < 0 or self.decode_kv_blocks < 1:
            raise ValueError(f"need decode_instances >= 0 and decode_kv_blocks >= 1, got {self.decode_instances}, {self.decode_kv_blocks}")
        if not (self.decode_tokens_per_s > 0 and self.decode_step_s >= 0 and self.link_bytes_per_s > 0):
            raise ValueError("decode_tokens_per_s and link_bytes_per_s must be > 0 and decode_step_s >= 0")
        if self.prefill_batch_tokens < 0 or not self.prefill_batch_wait_s >= 0:
            raise ValueError("prefill_batch_tokens must be >= 0 and prefill_batch_wait_s >= 0 seconds")
        if self.prefill_batch_tokens and self.decode_instances:
            raise ValueError("prefill batching is simulated in unified mode only (decode_instances = 0)")
        if not (0 < self.kv_compression <= 1):
            raise ValueError(f"kv_compression must be in (0, 1] (bytes sent per KV byte), got {self.kv_compression}")
        if self.tpot_slo is not None and not self.tpot_slo > 0:
            raise ValueError(f"tpot_slo must be > 0 seconds or None, got {self.tpot_slo}")

    def transfer_time(self, tokens: int) -> float:
        """Seconds to move ``tokens`` tokens of KV from a prefill to a decode instance."""
        return tokens * self.kv_bytes_per_token * self.kv_compression / self.link_bytes_per_s + self.link_latency_s if tokens else 0.0


SEED_CLUSTER = ClusterConfig()

#: Builds a router: (index, workload, cluster, policy, reject, tie_break, seed) -> router.
RouterFactory = Callable[..., Any]


def make_router(
    index: KvIndex, workload: Workload, cluster: ClusterConfig, policy: str, reject: bool, tie_break: str, seed: int, **options: Any
) -> Any:
    """A `kvroute.Router` over `index` (fed only by the engines' KV events) with the cluster's
    workers 0..n-1 registered as unified workers at the cluster's prefill speed. The TTFT SLO is
    always given (policies such as "slack" plan with it); ``reject`` turns on early rejection;
    ``options`` are passed on to `kvroute.Router` (e.g. ``prefill_weight=3.0``).

    The TTFT model is ``"configured"`` (the Router's default too) unless an option says
    otherwise: the simulated engines prefill at exactly the registered speed, one request after
    another, so the configured model (the virtual-time FIFO queue) is their exact TTFT and there
    is nothing to learn; ``router_options={"ttft_model": "learned"}`` runs the learned one."""
    from kvroute import Router

    options.setdefault("ttft_model", "configured")
    pd = cluster.decode_instances > 0
    if pd:
        for k in ("decode_step_s", "kv_bytes_per_token", "link_bytes_per_s", "link_latency_s", "kv_compression"):
            options.setdefault(k, getattr(cluster, k))
        options.setdefault("tpot_slo", cluster.tpot_slo)
    if tie_break not in ("rotate", "lowest"):
        raise ValueError(f"tie_break must be 'rotate' or 'lowest', got {tie_break!r}")
    router = Router(
        index=index,
        block_size=workload.block_size,
        policy=cast("Policy", policy),
        tie_break=cast(Literal["rotate", "lowest"], tie_break),
        seed=seed,
        ttft_slo=cluster.slo,
        reject=reject,
        **options,
    )
    for w in range(cluster.instances):
        router.add_worker(
            w, role="prefill" if pd else "both", prefill_tokens_per_s=float(cluster.speed), prefix_cache_blocks=cluster.cache_blocks
        )
    for w in range(cluster.instances, cluster.instances + cluster.decode_instances):
        router.add_worker(
            w, role="decode", kv_capacity_blocks=cluster.decode_kv_blocks, decode_tokens_per_s=float(cluster.decode_tokens_per_s)
        )
    return router


def _prefill_pool(cluster: ClusterConfig, workload: Workload, index: KvIndex, n: int) -> _core.PrefillEngines:
    """The simulated prefill instances 0..n-1, publishing their KV events into ``index``."""
    return _core.PrefillEngines(
        list(range(n)),
        capacity_blocks=cluster.cache_blocks,
        tokens_per_s=float(cluster.speed),
        block_size=workload.block_size,
        index=index,
        event_lag=float(cluster.event_lag),
        shared_cache=cluster.shared_cache,
    )


def simulate(
    workload: Workload,
    policy: str,
    *,
    reject: bool = False,
    cluster: ClusterConfig = SEED_CLUSTER,
    tie_break: str = "rotate",
    seed: int = 1,
    router_factory: RouterFactory = make_router,
    progress: bool | None = None,
    scenario: str | None = None,
    python_random: bool = True,
    router_options: dict[str, Any] | None = None,
) -> RunResult:
    """Replays `workload` on `cluster`, routing every request with the router `router_factory`
    builds, and returns the seed's metrics.

    Per request, in arrival order: completions due by its arrival are reported to the router
    (``finished``), engines publish the KV events due by then, the router decides, and the chosen
    engine enqueues the prefill of the prompt's uncached part (true cache state, not the index's).
    TTFT is the prefill's finish time minus the arrival; a rejected request counts as a miss.

    "random" with ``python_random`` (the default) draws ``random.Random(seed).randrange(n)`` per
    request, as the seed does, and hands the choice to the Router (``route(worker=...)``), which
    still predicts, admits or rejects it; otherwise the Router's own generator picks.
    ``router_options`` go to the factory (for `make_router`: extra `kvroute.Router` settings).
    """
    if cluster.prefill_batch_tokens > 0:
        model: type[_EngineModel] = _BatchedPrefill
    elif cluster.decode_instances > 0:
        model = _Disaggregated
    else:
        model = _FifoPrefill
    index = KvIndex()
    router = router_factory(index, workload, cluster, policy, reject, tie_break, seed, **(router_options or {}))
    run = _Run(workload, cluster, router, _prefill_pool(cluster, workload, index, cluster.instances))
    engine = model(run, index)
    n = len(run.arrival)
    bar = Progress(n, f"{workload.name} {policy}{' +reject' if reject else ''}", enabled=progress)
    # The seed's "random" draws, handed to the Router as a pin (the batched model keeps the Router's own).
    pin = policy == "random" and python_random and engine.pins_random_draws
    draw = random.Random(seed).randrange if pin else None
    route = router.route
    for i in range(n):
        t = run.arrival[i]
        engine.run_until(t)
        hs = run.hashes_of(i)
        nt = run.num_tokens[i]
        out = run.out_tokens[i] or None
        if draw is None:
            d = route(hashes=hs, num_tokens=nt, now=t, request_id=i, output_tokens=out)
        else:
            d = route(hashes=hs, num_tokens=nt, now=t, request_id=i, output_tokens=out, worker=draw(cluster.instances))
        if not d.admitted:
            run.rejected += 1
            run.misses_by_reason[d.reason] = run.misses_by_reason.get(d.reason, 0) + 1
            continue
        engine.admit(i, d, t, hs)
        if i & 1023 == 0:
            bar.update(i)
    engine.run_until(math.inf)
    bar.close()
    result = summarize(
        run.ttfts,
        requests=n,
        rejected=run.rejected,
        hit_tokens=run.hit_tokens,
        total_tokens=run.total_tokens,
        slo=cluster.slo,
        good=engine.good(),
        **_run_labels(workload, scenario, policy, reject, tie_break),
    )
    result.extra.update(rejected_by=run.misses_by_reason, events_published=run.engines.events_published, **engine.extra())
    return result


class _Run:
    """One replay's shared state: the workload as lists, the router, the prefill pool, and the tally
    every engine model keeps alike (TTFTs of admitted requests, rejections, hit tokens)."""

    def __init__(self, workload: Workload, cluster: ClusterConfig, router: Any, engines: _core.PrefillEngines) -> None:
        self.cluster, self.router, self.engines = cluster, router, engines
        self.bs = workload.block_size
        self.arrival: list[float] = workload.arrival.tolist()
        self.num_tokens: list[int] = workload.num_tokens.tolist()
        self.out_tokens: list[int] = workload.output_tokens.tolist()
        self.offsets: list[int] = workload.hash_offsets.tolist()
        # Only full blocks are cached and indexed (a trace's id for a partial last block is dropped).
        self.ends = [min(self.offsets[i + 1], self.offsets[i] + nt // self.bs) for i, nt in enumerate(self.num_tokens)]
        self.hashes = workload.hashes
        self.ttfts: list[float] = []
        self.rejected = self.hit_tokens = self.total_tokens = 0
        self.misses_by_reason: dict[str, int] = {}

    def hashes_of(self, i: int) -> Any:
        return self.hashes[self.offsets[i] : self.ends[i]]

    def prefill(self, worker: int, i: int, t: float) -> tuple[int, float]:
        """Request ``i``'s prefill on ``worker`` from ``t`` (true cache state): (hit tokens, finish), tallied."""
        _, hit, _, finish = self.engines.prefill(worker, self.hashes_of(i), self.num_tokens[i], t)
        self.hit_tokens += hit
        self.total_tokens += self.num_tokens[i]
        return hit, finish


class _EngineModel:
    """What happens to a routed request: ``admit`` it, ``run_until`` a time (its completions reported
    to the router, the engines' KV events published), then the model's own figures."""

    #: Whether the seed's "random" draws are handed to the Router as pins in this model.
    pins_random_draws = True

    def __init__(self, run: _Run, index: KvIndex) -> None:
        self.run = run

    def run_until(self, t: float) -> None:
        raise NotImplementedError

    def admit(self, i: int, d: Any, t: float, hs: Any) -> None:
        raise NotImplementedError

    def good(self) -> int | None:
        """Requests that met every SLO, when the model judges more than TTFT (else None)."""
        return None

    def extra(self) -> dict[str, Any]:
        return {}


class _FifoPrefill(_EngineModel):
    """The seed's model: each routed request's uncached part queues FIFO on its prefill instance;
    TTFT is the prefill's finish time minus the arrival."""

    def __init__(self, run: _Run, index: KvIndex) -> None:
        super().__init__(run, index)
        self.running: list[tuple[float, int]] = []

    def run_until(self, t: float) -> None:
        run = self.run
        while self.running and self.running[0][0] <= t:
            done_at, rid = heapq.heappop(self.running)
            run.router.finished(rid, now=done_at)
        if run.cluster.event_lag > 0 and t != math.inf:
            run.engines.advance(t)

    def admit(self, i: int, d: Any, t: float, hs: Any) -> None:
        _, finish = self.run.prefill(d.worker, i, t)
        self.run.ttfts.append(finish - t)
        heapq.heappush(self.running, (finish, i))


def _run_labels(workload: Workload, scenario: str | None, policy: str, reject: bool, tie_break: str) -> dict[str, Any]:
    """What a result says about the run that produced it (scenario, rate, seed, routing settings)."""
    return {
        "scenario": scenario or workload.meta.get("scenario", workload.name),
        "rate": workload.meta.get("rate"),
        "seed": workload.meta.get("seed"),
        "policy": policy,
        "reject": reject,
        "tie_break": tie_break,
    }


def with_cluster(cluster: ClusterConfig, **changes: Any) -> ClusterConfig:
    """`cluster` with some fields changed (None values keep the original)."""
    return replace(cluster, **{k: v for k, v in changes.items() if v is not None})


class _DecodeWorker:
    """A decode instance's truth: running sequences as (finish, kv_blocks), KV blocks in use."""

    __slots__ = ("running", "used")

    def __init__(self) -> None:
        self.running: list[tuple[float, int]] = []
        self.used = 0

    def join(self, now: float, need: int, capacity: int, max_batch: int | None = None) -> float:
        """Start time of a sequence needing ``need`` blocks that arrives at ``now``: when enough
        running sequences have finished (KV is reserved from the moment it is granted), and with
        ``max_batch`` when fewer than that many run."""
        start = now
        cap_b = max_batch if max_batch is not None else math.inf
        while self.running and (self.running[0][0] <= now or self.used + need > capacity or len(self.running) + 1 > cap_b):
            f, b = heapq.heappop(self.running)
            start = max(start, f)
            self.used -= b
        return start


class _Disaggregated(_EngineModel):
    """PD mode: prefill on the prefill pool (as the FIFO model), then the KV moves to the decode worker
    the Router chose, waits for KV room there, and decodes ``output_tokens`` tokens at the TPOT of
    the batch it joins. TTFT = decode start - arrival; a request is good when TTFT <= slo and
    (with a TPOT SLO) its TPOT <= tpot_slo. Events run in time order, so decode state is causal."""

    def __init__(self, run: _Run, index: KvIndex) -> None:
        super().__init__(run, index)
        cluster = run.cluster
        p_n = cluster.instances
        self.decoders = [_DecodeWorker() for _ in range(cluster.decode_instances)]
        # Incremental transfer: the decode instances' prefix caches (queues unused), in the same index.
        self.decode_caches = (
            _core.PrefillEngines(
                list(range(p_n, p_n + cluster.decode_instances)),
                capacity_blocks=cluster.decode_kv_blocks,
                tokens_per_s=float(cluster.speed),
                block_size=run.bs,
                index=index,
                event_lag=float(cluster.event_lag),
            )
            if cluster.incremental_transfer
            else None
        )
        self.max_batch = cluster.max_decode_batch()
        # (time, kind, request): kind 0 = prefill done, 1 = KV arrives at the decode worker, 2 = finished
        self.events: list[tuple[float, int, int]] = []
        self.decode_of: dict[int, int] = {}
        self.tpots: list[float] = []
        self.good_count = self.no_room = self.transferred_tokens = 0

    def run_until(self, t: float) -> None:
        run, cluster, events = self.run, self.run.cluster, self.events
        while events and events[0][0] <= t:
            at, kind, rid = heapq.heappop(events)
            if kind == 0:
                run.router.prefill_done(rid, now=at)
                moved = run.num_tokens[rid]
                if self.decode_caches is not None:
                    # The decode side already holds `hit` tokens of the prompt; it now caches all of it.
                    _, hit, _, _ = self.decode_caches.prefill(self.decode_of[rid], run.hashes_of(rid), run.num_tokens[rid], at)
                    moved -= hit
                self.transferred_tokens += moved
                heapq.heappush(events, (at + cluster.transfer_time(moved), 1, rid))
            elif kind == 1:
                need = -(-(run.num_tokens[rid] + run.out_tokens[rid]) // run.bs)
                if need > cluster.decode_kv_blocks:
                    # Can never fit: it fails (the Router with rejection turns these away up front).
                    self.no_room += 1
                    run.ttfts.append(math.inf)
                    heapq.heappush(events, (at, 2, rid))
                    continue
                dw = self.decoders[self.decode_of[rid]]
                start = dw.join(at, need, cluster.decode_kv_blocks, self.max_batch)
                tpot = cluster.decode_step_s + (len(dw.running) + 1) / cluster.decode_tokens_per_s
                finish = start + run.out_tokens[rid] * tpot
                heapq.heappush(dw.running, (finish, need))
                dw.used += need
                ttft = start - run.arrival[rid]
                run.ttfts.append(ttft)
                self.tpots.append(tpot)
                if ttft <= cluster.slo and (cluster.tpot_slo is None or tpot <= cluster.tpot_slo):
                    self.good_count += 1
                heapq.heappush(events, (finish, 2, rid))
            else:
                run.router.finished(rid, now=at)
        if t != math.inf:
            run.engines.advance(t)
            if self.decode_caches is not None:
                self.decode_caches.advance(t)

    def admit(self, i: int, d: Any, t: float, hs: Any) -> None:
        p_n = self.run.cluster.instances
        if d.worker >= p_n or d.decode_worker is None:
            raise RuntimeError(
                f"the router sent request {i} to worker {d.worker} (path {d.path!r}); the PD simulator models disaggregated prefill only"
            )
        _, finish = self.run.prefill(d.worker, i, t)
        self.decode_of[i] = d.decode_worker - p_n
        heapq.heappush(self.events, (finish, 0, i))

    def good(self) -> int | None:
        return self.good_count

    def extra(self) -> dict[str, Any]:
        tpots = sorted(self.tpots)
        return {
            "decode_instances": self.run.cluster.decode_instances,
            "tpot_p50": tpots[len(tpots) // 2] if tpots else math.nan,
            "tpot_p99": tpots[int(len(tpots) * 0.99)] if tpots else math.nan,
            "never_fit": self.no_room,
            "transferred_tokens": self.transferred_tokens,
        }


class _BatchedPrefill(_EngineModel):
    """Unified mode with the seed documents' prefill batching (`ClusterConfig.prefill_batch_tokens`).

    Events run in time order: a routed request joins its instance's pending list; an idle
    instance closes a batch ``prefill_batch_wait_s`` after the first request arrives, a busy one
    when its current batch ends. A batch takes pending requests shortest prompt first while their
    prompt tokens fit the budget (at least one), reads and fills the cache at its start (KV events
    as in the FIFO model), and runs for its uncached tokens / speed; its requests' TTFT is its end
    minus their arrival. The Router is told `finished` at that end."""

    pins_random_draws = False

    def __init__(self, run: _Run, index: KvIndex) -> None:
        super().__init__(run, index)
        n_e = run.cluster.instances
        self.pending: list[list[int]] = [[] for _ in range(n_e)]
        self.busy_until = [0.0] * n_e
        self.scheduled = [False] * n_e
        # (time, kind, x): kind 0 = instance x closes a batch, 1 = request x finished.
        self.events: list[tuple[float, int, int]] = []
        self.batches = 0

    def _run_batch(self, e: int, t: float) -> None:
        run = self.run
        queue = sorted(self.pending[e], key=lambda r: (run.num_tokens[r], r))
        batch: list[int] = []
        used = 0
        for r in queue:
            if not batch or used + run.num_tokens[r] <= run.cluster.prefill_batch_tokens:
                batch.append(r)
                used += run.num_tokens[r]
        taken = set(batch)
        self.pending[e] = [r for r in self.pending[e] if r not in taken]
        work = 0
        for r in batch:
            hit, _ = run.prefill(e, r, t)
            work += run.num_tokens[r] - hit
        end = t + work / run.cluster.speed
        self.batches += 1
        self.busy_until[e] = end
        for r in batch:
            run.ttfts.append(end - run.arrival[r])
            heapq.heappush(self.events, (end, 1, r))
        if self.pending[e]:
            heapq.heappush(self.events, (end, 0, e))
        else:
            self.scheduled[e] = False

    def run_until(self, t: float) -> None:
        events = self.events
        while events and events[0][0] <= t:
            at, kind, x = heapq.heappop(events)
            if kind == 0:
                self._run_batch(x, at)
            else:
                self.run.router.finished(x, now=at)
        if t != math.inf:
            self.run.engines.advance(t)

    def admit(self, i: int, d: Any, t: float, hs: Any) -> None:
        e = d.worker
        self.pending[e].append(i)
        if not self.scheduled[e]:
            self.scheduled[e] = True
            heapq.heappush(self.events, (max(t + self.run.cluster.prefill_batch_wait_s, self.busy_until[e]), 0, e))

    def extra(self) -> dict[str, Any]:
        return {"prefill_batches": self.batches}
