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
from kvroute.sim.metrics import RunResult, summarize
from kvroute.sim.progress import Progress
from kvroute.sim.workload import Workload

if TYPE_CHECKING:
    from kvroute._core import Policy

__all__ = ["SEED_CLUSTER", "ClusterConfig", "make_router", "simulate"]


@dataclass(frozen=True)
class ClusterConfig:
    """The simulated cluster. Defaults are the seed chapter's: 8 prefill instances, each with an
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
    #: Bytes sent per KV byte (1: as stored; 0.5: fp8 from 16-bit KV, the seed 003 chapter's
    #: compressed transfer). The Router is told the same.
    kv_compression: float = 1.0
    #: Incremental transfer (the seed 003 chapter's): each decode instance keeps an LRU prefix cache
    #: of ``decode_kv_blocks`` blocks that publishes KV events like the prefill engines', and only the
    #: blocks it lacks cross the link (the Router's transfer estimate already counts only those).
    incremental_transfer: bool = False
    #: The seed 003 chapter's decode admission: a sequence joins a decode instance's batch only
    #: while at most 256 run and the estimated ITL with it stays under 1.2 x the target (the TPOT
    #: SLO, or the chapter's 50 ms); otherwise it waits for running sequences to finish.
    decode_admission: bool = False
    #: The seed 003 chapter's prefill batching when > 0 (the chapter: 8192): an idle instance waits
    #: ``prefill_batch_wait_s`` (10 ms) for a batch to form, then runs its pending requests sorted by
    #: prompt length while their prompt tokens fit this budget (a longer prompt runs alone); every
    #: request of a batch gets its first token when the batch ends. 0: FIFO, one request at a time.
    prefill_batch_tokens: int = 0
    prefill_batch_wait_s: float = 0.01

    def max_decode_batch(self) -> int | None:
        """With ``decode_admission``: the largest batch the chapter's rule admits (at least 1)."""
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
        return _simulate_batched(workload, policy, reject, cluster, tie_break, seed, router_factory, scenario, router_options or {})
    if cluster.decode_instances > 0:
        return _simulate_pd(
            workload, policy, reject, cluster, tie_break, seed, router_factory, progress, scenario, router_options or {}, python_random
        )
    index = KvIndex()
    router = router_factory(index, workload, cluster, policy, reject, tie_break, seed, **(router_options or {}))
    engines = _prefill_pool(cluster, workload, index, cluster.instances)
    arrival = workload.arrival.tolist()
    num_tokens = workload.num_tokens.tolist()
    offsets = workload.hash_offsets.tolist()
    # Only full blocks are cached and indexed (a trace's id for a partial last block is dropped).
    ends = [min(offsets[i + 1], offsets[i] + nt // workload.block_size) for i, nt in enumerate(num_tokens)]
    hashes = workload.hashes
    out_tokens = workload.output_tokens.tolist()
    n = len(arrival)
    bar = Progress(n, f"{workload.name} {policy}{' +reject' if reject else ''}", enabled=progress)
    route, prefill, finished = router.route, engines.prefill, router.finished
    draw = random.Random(seed).randrange if policy == "random" and python_random else None
    nw = cluster.instances
    lagged = cluster.event_lag > 0
    running: list[tuple[float, int]] = []
    ttfts: list[float] = []
    rejected = hit_tokens = total_tokens = 0
    misses_by_reason: dict[str, int] = {}
    for i in range(n):
        t = arrival[i]
        while running and running[0][0] <= t:
            done_at, rid = heapq.heappop(running)
            finished(rid, now=done_at)
        if lagged:
            engines.advance(t)
        hs = hashes[offsets[i] : ends[i]]
        nt = num_tokens[i]
        if draw is None:
            d = route(hashes=hs, num_tokens=nt, now=t, request_id=i, output_tokens=out_tokens[i] or None)
        else:
            d = route(hashes=hs, num_tokens=nt, now=t, request_id=i, output_tokens=out_tokens[i] or None, worker=draw(nw))
        if not d.admitted:
            rejected += 1
            misses_by_reason[d.reason] = misses_by_reason.get(d.reason, 0) + 1
            continue
        _, hit, _, finish = prefill(d.worker, hs, nt, t)
        ttfts.append(finish - t)
        hit_tokens += hit
        total_tokens += nt
        heapq.heappush(running, (finish, i))
        if i & 1023 == 0:
            bar.update(i)
    bar.close()
    result = summarize(
        ttfts,
        requests=n,
        rejected=rejected,
        hit_tokens=hit_tokens,
        total_tokens=total_tokens,
        slo=cluster.slo,
        **_run_labels(workload, scenario, policy, reject, tie_break),
    )
    result.extra.update(rejected_by=misses_by_reason, events_published=engines.events_published)
    return result


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


def _simulate_pd(
    workload: Workload,
    policy: str,
    reject: bool,
    cluster: ClusterConfig,
    tie_break: str,
    seed: int,
    router_factory: RouterFactory,
    progress: bool | None,
    scenario: str | None,
    router_options: dict[str, Any],
    python_random: bool,
) -> RunResult:
    """PD mode: prefill on the prefill pool (as `simulate`), then the KV moves to the decode worker
    the Router chose, waits for KV room there, and decodes ``output_tokens`` tokens at the TPOT of
    the batch it joins. TTFT = decode start - arrival; a request is good when TTFT <= slo and
    (with a TPOT SLO) its TPOT <= tpot_slo. Events run in time order, so decode state is causal."""
    index = KvIndex()
    router = router_factory(index, workload, cluster, policy, reject, tie_break, seed, **router_options)
    p_n = cluster.instances
    engines = _prefill_pool(cluster, workload, index, p_n)
    decoders = [_DecodeWorker() for _ in range(cluster.decode_instances)]
    # Incremental transfer: the decode instances' prefix caches (queues unused), in the same index.
    decode_caches = (
        _core.PrefillEngines(
            list(range(p_n, p_n + cluster.decode_instances)),
            capacity_blocks=cluster.decode_kv_blocks,
            tokens_per_s=float(cluster.speed),
            block_size=workload.block_size,
            index=index,
            event_lag=float(cluster.event_lag),
        )
        if cluster.incremental_transfer
        else None
    )
    transferred_tokens = 0
    max_batch = cluster.max_decode_batch()
    bs = workload.block_size
    arrival = workload.arrival.tolist()
    num_tokens = workload.num_tokens.tolist()
    out_tokens = workload.output_tokens.tolist()
    offsets = workload.hash_offsets.tolist()
    ends = [min(offsets[i + 1], offsets[i] + nt // bs) for i, nt in enumerate(num_tokens)]
    hashes = workload.hashes
    n = len(arrival)
    bar = Progress(n, f"{workload.name} {policy}{' +reject' if reject else ''}", enabled=progress)
    # (time, kind, request): kind 0 = prefill done, 1 = KV arrives at the decode worker, 2 = finished
    events: list[tuple[float, int, int]] = []
    decode_of: dict[int, int] = {}
    ttfts: list[float] = []
    good = rejected = hit_tokens = total_tokens = no_room = 0
    tpots: list[float] = []
    misses_by_reason: dict[str, int] = {}
    draw = random.Random(seed).randrange if policy == "random" and python_random else None

    def run_events(until: float) -> None:
        nonlocal good, no_room, transferred_tokens
        while events and events[0][0] <= until:
            t, kind, rid = heapq.heappop(events)
            if kind == 0:
                router.prefill_done(rid, now=t)
                moved = num_tokens[rid]
                if decode_caches is not None:
                    # The decode side already holds `hit` tokens of the prompt; it now caches all of it.
                    _, hit, _, _ = decode_caches.prefill(decode_of[rid], hashes[offsets[rid] : ends[rid]], num_tokens[rid], t)
                    moved -= hit
                transferred_tokens += moved
                heapq.heappush(events, (t + cluster.transfer_time(moved), 1, rid))
            elif kind == 1:
                need = -(-(num_tokens[rid] + out_tokens[rid]) // bs)
                if need > cluster.decode_kv_blocks:
                    # Can never fit: it fails (the Router with rejection turns these away up front).
                    no_room += 1
                    ttfts.append(math.inf)
                    heapq.heappush(events, (t, 2, rid))
                    continue
                dw = decoders[decode_of[rid]]
                start = dw.join(t, need, cluster.decode_kv_blocks, max_batch)
                tpot = cluster.decode_step_s + (len(dw.running) + 1) / cluster.decode_tokens_per_s
                finish = start + out_tokens[rid] * tpot
                heapq.heappush(dw.running, (finish, need))
                dw.used += need
                ttft = start - arrival[rid]
                ttfts.append(ttft)
                tpots.append(tpot)
                if ttft <= cluster.slo and (cluster.tpot_slo is None or tpot <= cluster.tpot_slo):
                    good += 1
                heapq.heappush(events, (finish, 2, rid))
            else:
                router.finished(rid, now=t)

    for i in range(n):
        t = arrival[i]
        run_events(t)
        engines.advance(t)
        if decode_caches is not None:
            decode_caches.advance(t)
        hs = hashes[offsets[i] : ends[i]]
        nt = num_tokens[i]
        pin = {"worker": draw(p_n)} if draw is not None else {}
        d = router.route(hashes=hs, num_tokens=nt, now=t, request_id=i, output_tokens=out_tokens[i], **pin)
        if not d.admitted:
            rejected += 1
            misses_by_reason[d.reason] = misses_by_reason.get(d.reason, 0) + 1
            continue
        if d.worker >= p_n or d.decode_worker is None:
            raise RuntimeError(
                f"the router sent request {i} to worker {d.worker} (path {d.path!r}); the PD simulator models disaggregated prefill only"
            )
        _, hit, _, finish = engines.prefill(d.worker, hs, nt, t)
        decode_of[i] = d.decode_worker - p_n
        hit_tokens += hit
        total_tokens += nt
        heapq.heappush(events, (finish, 0, i))
        if i & 1023 == 0:
            bar.update(i)
    run_events(math.inf)
    bar.close()
    result = summarize(
        ttfts,
        requests=n,
        rejected=rejected,
        hit_tokens=hit_tokens,
        total_tokens=total_tokens,
        slo=cluster.slo,
        good=good,
        **_run_labels(workload, scenario, policy, reject, tie_break),
    )
    tpots.sort()
    result.extra.update(
        rejected_by=misses_by_reason,
        events_published=engines.events_published,
        decode_instances=cluster.decode_instances,
        tpot_p50=tpots[len(tpots) // 2] if tpots else math.nan,
        tpot_p99=tpots[int(len(tpots) * 0.99)] if tpots else math.nan,
        never_fit=no_room,
        transferred_tokens=transferred_tokens,
    )
    return result


def _simulate_batched(
    workload: Workload,
    policy: str,
    reject: bool,
    cluster: ClusterConfig,
    tie_break: str,
    seed: int,
    router_factory: RouterFactory,
    scenario: str | None,
    router_options: dict[str, Any],
) -> RunResult:
    """Unified mode with the seed 003 chapter's prefill batching (`ClusterConfig.prefill_batch_tokens`).

    Events run in time order: a routed request joins its instance's pending list; an idle
    instance closes a batch ``prefill_batch_wait_s`` after the first request arrives, a busy one
    when its current batch ends. A batch takes pending requests shortest prompt first while their
    prompt tokens fit the budget (at least one), reads and fills the cache at its start (KV events
    as in `simulate`), and runs for its uncached tokens / speed; its requests' TTFT is its end
    minus their arrival. The Router is told `finished` at that end."""
    index = KvIndex()
    router = router_factory(index, workload, cluster, policy, reject, tie_break, seed, **router_options)
    n_e = cluster.instances
    engines = _prefill_pool(cluster, workload, index, n_e)
    bs = workload.block_size
    arrival = workload.arrival.tolist()
    num_tokens = workload.num_tokens.tolist()
    out_tokens = workload.output_tokens.tolist()
    offsets = workload.hash_offsets.tolist()
    ends = [min(offsets[i + 1], offsets[i] + nt // bs) for i, nt in enumerate(num_tokens)]
    hashes = workload.hashes
    budget, wait = cluster.prefill_batch_tokens, cluster.prefill_batch_wait_s
    pending: list[list[int]] = [[] for _ in range(n_e)]
    busy_until = [0.0] * n_e
    scheduled = [False] * n_e
    # (time, kind, x): kind 0 = instance x closes a batch, 1 = request x finished.
    events: list[tuple[float, int, int]] = []
    ttfts: list[float] = []
    rejected = hit_tokens = total_tokens = batches = 0
    misses_by_reason: dict[str, int] = {}

    def run_batch(e: int, t: float) -> None:
        nonlocal hit_tokens, total_tokens, batches
        queue = sorted(pending[e], key=lambda r: (num_tokens[r], r))
        batch: list[int] = []
        used = 0
        for r in queue:
            if not batch or used + num_tokens[r] <= budget:
                batch.append(r)
                used += num_tokens[r]
        taken = set(batch)
        pending[e] = [r for r in pending[e] if r not in taken]
        work = 0
        for r in batch:
            _, hit, _, _ = engines.prefill(e, hashes[offsets[r] : ends[r]], num_tokens[r], t)
            hit_tokens += hit
            total_tokens += num_tokens[r]
            work += num_tokens[r] - hit
        end = t + work / cluster.speed
        batches += 1
        busy_until[e] = end
        for r in batch:
            ttfts.append(end - arrival[r])
            heapq.heappush(events, (end, 1, r))
        if pending[e]:
            heapq.heappush(events, (end, 0, e))
        else:
            scheduled[e] = False

    def run_events(until: float) -> None:
        while events and events[0][0] <= until:
            t, kind, x = heapq.heappop(events)
            if kind == 0:
                run_batch(x, t)
            else:
                router.finished(x, now=t)

    for i in range(len(arrival)):
        t = arrival[i]
        run_events(t)
        engines.advance(t)
        hs = hashes[offsets[i] : ends[i]]
        d = router.route(hashes=hs, num_tokens=num_tokens[i], now=t, request_id=i, output_tokens=out_tokens[i] or None)
        if not d.admitted:
            rejected += 1
            misses_by_reason[d.reason] = misses_by_reason.get(d.reason, 0) + 1
            continue
        e = d.worker
        pending[e].append(i)
        if not scheduled[e]:
            scheduled[e] = True
            heapq.heappush(events, (max(t + wait, busy_until[e]), 0, e))
    run_events(math.inf)
    result = summarize(
        ttfts,
        requests=len(arrival),
        rejected=rejected,
        hit_tokens=hit_tokens,
        total_tokens=total_tokens,
        slo=cluster.slo,
        **_run_labels(workload, scenario, policy, reject, tie_break),
    )
    result.extra.update(rejected_by=misses_by_reason, events_published=engines.events_published, prefill_batches=batches)
    return result
