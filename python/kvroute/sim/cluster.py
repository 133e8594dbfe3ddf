"""The cluster model: simulated prefill engines (Rust LRU caches, FIFO queues, KV events) driven
request by request in virtual time, with every routing decision made by a router object.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvroute import KvIndex, _core
from kvroute.sim.metrics import RunResult, summarize
from kvroute.sim.progress import Progress
from kvroute.sim.workload import Workload

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


SEED_CLUSTER = ClusterConfig()

#: Builds a router: (index, workload, cluster, policy, reject, tie_break, seed) -> router.
RouterFactory = Callable[..., Any]


def make_router(
    index: KvIndex, workload: Workload, cluster: ClusterConfig, policy: str, reject: bool, tie_break: str, seed: int, **options: Any
) -> Any:
    """A `kvroute.Router` over `index` (fed only by the engines' KV events) with the cluster's
    workers 0..n-1 registered as unified workers at the cluster's prefill speed. The TTFT SLO is
    always given (policies such as "slack" plan with it); ``reject`` turns on early rejection;
    ``options`` are passed on to `kvroute.Router` (e.g. ``prefill_weight=3.0``)."""
    from kvroute import Router

    router = Router(
        index=index,
        block_size=workload.block_size,
        policy=policy,
        tie_break=tie_break,
        seed=seed,
        ttft_slo=cluster.slo,
        reject=reject,
        **options,
    )
    for w in range(cluster.instances):
        router.add_worker(w, prefill_tokens_per_s=float(cluster.speed))
    return router


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
    index = KvIndex()
    router = router_factory(index, workload, cluster, policy, reject, tie_break, seed, **(router_options or {}))
    engines = _core.PrefillEngines(
        list(range(cluster.instances)),
        capacity_blocks=cluster.cache_blocks,
        tokens_per_s=float(cluster.speed),
        block_size=workload.block_size,
        index=index,
        event_lag=float(cluster.event_lag),
    )
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
        scenario=scenario or workload.meta.get("scenario", workload.name),
        rate=workload.meta.get("rate"),
        seed=workload.meta.get("seed"),
        policy=policy,
        reject=reject,
        tie_break=tie_break,
    )
    result.extra.update(rejected_by=misses_by_reason, events_published=engines.events_published)
    return result


def with_cluster(cluster: ClusterConfig, **changes: Any) -> ClusterConfig:
    """`cluster` with some fields changed (None values keep the original)."""
    return replace(cluster, **{k: v for k, v in changes.items() if v is not None})
