"""An upper bound on SLO attainment that no router can beat: prefill work against prefill capacity.
It answers "how far is the best policy from the limit" with a figure that is a proof, not a run.

The simulator's bounds (an infinite cache, one global cache) are runs of a policy on a better
cache, so queueing and admission still cost them requests a clairvoyant scheduler would keep; this
one is a counting argument:

* every request needs at least its *least work*: its prompt tokens minus the leading blocks that
  some earlier request had (one infinite cache that everyone shares, holding every block ever
  prefilled, and prefilled for free: no policy can need less);
* a request that keeps the TTFT SLO was prefilled inside ``[arrival, arrival + slo]``;
* so the requests arriving in ``[t1, t2)`` that keep the SLO were all prefilled inside
  ``[t1, t2 + slo)``, on a pool of ``instances * speed`` tokens per second: at most the ``k``
  cheapest of them fit, and the others miss whatever the router does;
* windows whose prefill intervals do not overlap add up; a dynamic programme over a grid of window
  edges takes the best set of such windows.

Least work is rounded down to a log-spaced grid of values (``buckets``) and the pool's capacity is
one shared pool (a request may not really be split across instances), both of which only loosen
the bound. It holds for the unified simulator with any policy, rejection or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvroute.sim.cluster import ClusterConfig
from kvroute.sim.workload import Workload


@dataclass(frozen=True)
class AttainmentLimit:
    """``attainment`` is at least every policy's; ``forced_misses`` requests miss under any router."""

    attainment: float
    forced_misses: int
    requests: int
    least_work_tokens: int
    prompt_tokens: int

    @property
    def hit_rate_limit(self) -> float:
        """The prompt tokens one infinite shared cache could serve from cache (an upper bound)."""
        return 1.0 - self.least_work_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def least_work(workload: Workload) -> np.ndarray:
    """Per request, its prompt tokens minus the leading full blocks some earlier request had."""
    bs = workload.block_size
    seen: set[int] = set()
    offsets = workload.hash_offsets.tolist()
    hashes = workload.hashes.tolist()
    out = np.empty(len(offsets) - 1, dtype=np.int64)
    for i, n in enumerate(workload.num_tokens.tolist()):
        blocks = hashes[offsets[i] : min(offsets[i + 1], offsets[i] + n // bs)]
        hit = 0
        for h in blocks:
            if h not in seen:
                break
            hit += 1
        seen.update(blocks)
        out[i] = n - hit * bs
    return out


def attainment_limit(workload: Workload, cluster: ClusterConfig, *, step: float | None = None, buckets: int = 256) -> AttainmentLimit:
    """The upper bound on attainment for ``workload`` on ``cluster`` (unified: ``instances`` at
    ``speed`` tokens/s, TTFT SLO ``slo``). ``step``: the grid of window edges (default slo / 4;
    finer is tighter and slower, any grid gives a valid bound)."""
    if cluster.decode_instances:
        raise ValueError("the limit is for unified clusters (decode_instances = 0): PD adds transfer and decode limits")
    if buckets < 2:
        raise ValueError(f"buckets must be >= 2, got {buckets}")
    n = len(workload.arrival)
    work = least_work(workload)
    prompt = int(workload.num_tokens.sum())
    if n == 0:
        return AttainmentLimit(1.0, 0, 0, 0, 0)
    step = cluster.slo / 4 if step is None else step
    if not step > 0:
        raise ValueError(f"step must be > 0 seconds, got {step}")
    arrival = workload.arrival.astype(np.float64)
    t0 = float(arrival[0])
    edges = t0 + step * np.arange(int(np.ceil((float(arrival[-1]) - t0) / step)) + 2)
    g = len(edges)
    # Values rounded down: 0, then log-spaced from the least positive work to the most.
    pos = work[work > 0]
    values = np.concatenate(([0.0], np.geomspace(float(pos.min()), float(pos.max()), buckets - 1))) if len(pos) else np.zeros(1)
    b = np.searchsorted(values, work, side="right") - 1
    cell = np.searchsorted(edges, arrival, side="right") - 1  # arrival in [edges[cell], edges[cell + 1])
    counts = np.zeros((g, len(values)), dtype=np.int64)
    np.add.at(counts, (cell + 1, b), 1)
    cum = np.cumsum(counts, axis=0)  # cum[q] = arrivals before edges[q], per value bucket
    pool = cluster.instances * float(cluster.speed)
    # next_start[q]: the first edge at or after edges[q] + slo (where a disjoint window may start).
    next_start = np.searchsorted(edges, edges + cluster.slo - 1e-12, side="left")
    best = np.zeros(g + 1, dtype=np.int64)  # best[p]: most forced misses from windows starting at edge >= p
    for p in range(g - 2, -1, -1):
        c = cum[p + 1 :] - cum[p]  # arrivals in [edges[p], edges[q]) for q = p+1 .. g-1
        cap = pool * (edges[p + 1 :] - edges[p] + cluster.slo)
        total = c.sum(axis=1)
        spent = np.cumsum(c * values, axis=1)  # work of all items up to each bucket, cheapest first
        before = spent - c * values
        fit_full = (spent <= cap[:, None]).sum(axis=1)  # buckets that fit whole (spent is nondecreasing)
        served = np.where(fit_full > 0, np.take_along_axis(np.cumsum(c, axis=1), np.maximum(fit_full - 1, 0)[:, None], 1)[:, 0], 0)
        # The first bucket that does not fit whole still takes what its rounded-down value allows.
        partial = np.minimum(fit_full, len(values) - 1)
        has_partial = fit_full < len(values)
        v = values[partial]
        room = cap - np.take_along_axis(before, partial[:, None], 1)[:, 0]
        extra = np.where(v > 0, np.floor(np.maximum(room, 0) / np.where(v > 0, v, 1)), np.inf)
        extra = np.minimum(extra, np.take_along_axis(c, partial[:, None], 1)[:, 0])
        served = served + np.where(has_partial, extra, 0).astype(np.int64)
        misses = total - served
        nxt = np.minimum(next_start[p + 1 :], g)
        best[p] = max(int(best[p + 1]), int((misses + best[nxt]).max()))
    forced = int(best[0])
    return AttainmentLimit(1.0 - forced / n, forced, n, int(work.sum()), prompt)


def clairvoyant_hit_rate(workload: Workload, capacity_blocks: int) -> float:
    """The most prompt tokens any placement and eviction could serve from cache with one cache of
    ``capacity_blocks`` blocks (the cluster's total: N caches of C hold at most what one of N * C
    holds, and a request reads one cache), every request served: Belady's MIN (evict the block
    whose next use is farthest, or skip storing a block used later than all cached ones) over the
    requests' full blocks in arrival order, counting each hit block as ``block_size`` tokens. An
    upper bound on the hit rate without rejection (it ignores that hits must be leading blocks)."""
    import heapq

    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    bs = workload.block_size
    offsets = workload.hash_offsets.tolist()
    hashes = workload.hashes.tolist()
    seq: list[int] = []
    for i, n in enumerate(workload.num_tokens.tolist()):
        seq.extend(hashes[offsets[i] : min(offsets[i + 1], offsets[i] + n // bs)])
    nxt = [0] * len(seq)
    last: dict[int, int] = {}
    never = len(seq) + 1
    for k in range(len(seq) - 1, -1, -1):
        nxt[k] = last.get(seq[k], never)
        last[seq[k]] = k
    cached: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), lazily invalidated
    hits = 0
    for k, h in enumerate(seq):
        if h in cached:
            hits += 1
        elif capacity_blocks == 0:
            continue
        elif len(cached) >= capacity_blocks:
            while heap and cached.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if heap and -heap[0][0] > nxt[k]:
                _, victim = heapq.heappop(heap)
                del cached[victim]
            else:
                continue  # every cached block is needed sooner: do not store this one
        cached[h] = nxt[k]
        heapq.heappush(heap, (-nxt[k], h))
    prompt = int(workload.num_tokens.sum())
    return hits * bs / prompt if prompt else 0.0
