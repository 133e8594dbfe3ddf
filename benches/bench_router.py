"""One `Router.route()` from Python: an 8192-token uint32 prompt, 64 workers, a ~1M-entry index.

Compares kvroute with the same decision ("ttft": minimum predicted TTFT over the prefix overlap
and a virtual-time queue per worker) assembled from NVIDIA Dynamo's Python pieces in the same run:
`compute_block_hash_for_seq` + `RadixTree.find_matches` + the scoring loop in Python. Both indexes
hold the same blocks; the two routers are checked to pick the same workers.

    python benches/bench_router.py            # table: p50 / p99 per call, and the ratio
    python benches/bench_router.py --results benches/results/bench_router.json   # also the results file
    pytest benches/bench_router.py --benchmark-enable
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import kvroute
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_file

BLOCK = 64
WORKERS = 64
FAMILIES = 2000  # distinct 8192-token prefixes ...
HOLDERS = 4  # ... each cached on 4 workers -> 2000 * 128 * 4 = 1.02M (block, worker) entries
PROMPT = 8192
SPEED = 20000.0

try:
    import dynamo._core as dyn  # ai-dynamo-runtime (optional: pip install kvroute[bench])
except ImportError:  # pragma: no cover - reported in the table
    dyn = None


def build(seed: int = 0):
    rng = np.random.default_rng(seed)
    families = rng.integers(0, 2**31, size=(FAMILIES, PROMPT), dtype=np.uint32)
    holders = [rng.choice(WORKERS, size=HOLDERS, replace=False).tolist() for _ in range(FAMILIES)]
    # Queries: a family's first 6000 tokens, then new ones (a real conversation's next turn).
    queries = []
    for _ in range(64):
        f = int(rng.integers(FAMILIES))
        tail = rng.integers(0, 2**31, size=PROMPT - 6000, dtype=np.uint32)
        queries.append(np.concatenate([families[f, :6000], tail]))
    return families, holders, queries


def kvroute_router(families, holders):
    router = kvroute.Router(policy="ttft", block_size=BLOCK, tie_break="lowest")
    for w in range(WORKERS):
        router.add_worker(w, prefill_tokens_per_s=SPEED)
    idx = router.index
    for fam, hs in zip(families, holders):
        seq = kvroute.block_hashes(fam, BLOCK)
        for w in hs:
            idx.store(w, seq)
    return router


class DynamoRouter:
    """The same "ttft" decision from Dynamo's Python pieces."""

    def __init__(self, families, holders):
        self.tree = dyn.RadixTree()
        self.busy = [0.0] * WORKERS
        for fam, hs in zip(families, holders):
            toks = fam.tolist()
            local = dyn.compute_block_hash_for_seq(toks, BLOCK)
            seq = kvroute.block_hashes(fam, BLOCK).tolist()  # identical scheme; Dynamo keys on local hashes
            blocks = [{"block_hash": s, "tokens_hash": h} for s, h in zip(seq, local)]
            ev = json.dumps({"event_id": 0, "data": {"stored": {"parent_hash": None, "blocks": blocks}}}).encode()
            for w in hs:
                self.tree.apply_event(w, ev)

    def route(self, tokens: list[int], now: float) -> int:
        local = dyn.compute_block_hash_for_seq(tokens, BLOCK)
        scores = self.tree.find_matches(local).scores
        n = len(tokens)
        overlap = [0] * WORKERS
        for (w, _dp), s in scores.items():
            overlap[w] = s
        busy = self.busy
        best, best_t = 0, float("inf")
        for w in range(WORKERS):
            t = max(busy[w] - now, 0) + (n - overlap[w] * BLOCK) / SPEED
            if t < best_t:
                best, best_t = w, t
        busy[best] = max(busy[best], now) + (n - overlap[best] * BLOCK) / SPEED
        return best


def timeit(fn, args_list, repeat: int) -> np.ndarray:
    out = np.empty(repeat)
    for i in range(repeat):
        a = args_list[i % len(args_list)]
        t0 = time.perf_counter_ns()
        fn(*a)
        out[i] = time.perf_counter_ns() - t0
    return out / 1000.0  # microseconds


def main(repeat: int = 3000, results: str | None = None) -> None:
    t0 = time.perf_counter()
    families, holders, queries = build()
    router = kvroute_router(families, holders)
    print(
        f"index: {router.index.stats()['entries']:,} entries, {len(router.index):,} blocks, {WORKERS} workers "
        f"(built in {time.perf_counter() - t0:.1f} s)"
    )
    # Far-apart times keep queues empty, so both routers see the same state every call.
    clock = iter(range(10**9))
    rows = []
    ours = timeit(lambda q: router.route(q, now=float(next(clock)) * 100.0), [(q,) for q in queries], repeat)
    rows.append(("kvroute Router.route (numpy uint32)", ours))
    lists = [q.tolist() for q in queries]
    ours_list = timeit(lambda q: router.route(q, now=float(next(clock)) * 100.0), [(q,) for q in lists], repeat)
    rows.append(("kvroute Router.route (list of int)", ours_list))
    slack = kvroute.Router(index=router.index, policy="slack")
    for w in range(WORKERS):
        slack.add_worker(w, prefill_tokens_per_s=SPEED)
    ours_slack = timeit(lambda q: slack.route(q, now=float(next(clock)) * 100.0), [(q,) for q in queries], repeat)
    rows.append(('kvroute Router.route, policy "slack"', ours_slack))
    # Capacity-aware placement (the default policy): the occupancy is the index's per-worker count
    # (every shard is read), raised by the engines' reported usage where that is higher.
    cap = kvroute.Router(index=router.index)
    assert cap.policy == "capacity"
    for w in range(WORKERS):
        cap.add_worker(w, prefill_tokens_per_s=SPEED, prefix_cache_blocks=FAMILIES * PROMPT // BLOCK * HOLDERS // WORKERS)
        cap.observe(w, kv_usage=1.0, now=0.0)
    ours_cap = timeit(lambda q: cap.route(q, now=float(next(clock)) * 100.0), [(q,) for q in queries], repeat)
    rows.append(('kvroute Router.route, policy "capacity" (default)', ours_cap))
    peer = None
    if dyn is not None:
        t0 = time.perf_counter()
        d = DynamoRouter(families, holders)
        print(f"dynamo RadixTree built in {time.perf_counter() - t0:.1f} s")
        for q, ql in zip(queries[:16], lists[:16]):  # same decisions on the same state
            now = float(next(clock)) * 100.0
            assert router.route(q, now=now).worker == d.route(ql, now), "routers disagree"
        peer = timeit(lambda q: d.route(q, float(next(clock)) * 100.0), [(q,) for q in lists], max(repeat // 3, 300))
        rows.append(("dynamo 1.6.1 hash + RadixTree + Python scoring (list)", peer))
        n = max(repeat // 3, 300)
        rows.append(
            ("  of which compute_block_hash_for_seq", timeit(lambda q: dyn.compute_block_hash_for_seq(q, BLOCK), [(q,) for q in lists], n))
        )
        locals_ = [dyn.compute_block_hash_for_seq(q, BLOCK) for q in lists]
        rows.append(("  of which RadixTree.find_matches", timeit(d.tree.find_matches, [(h,) for h in locals_], n)))
    print(f"{'what':58s} {'p50 us':>9s} {'p99 us':>9s}")
    for name, xs in rows:
        print(f"{name:58s} {np.percentile(xs, 50):9.1f} {np.percentile(xs, 99):9.1f}")
    if peer is not None:
        print(
            f"ratio dynamo/kvroute p50: {np.percentile(peer, 50) / np.percentile(ours, 50):.1f}x, "
            f"p99: {np.percentile(peer, 99) / np.percentile(ours, 99):.1f}x"
        )
    else:
        print("dynamo peer not installed (pip install ai-dynamo-runtime==1.6.1): no ratio")
    if results:
        doc = results_file.header("bench_router", results_file.command("bench_router.py"))
        doc["setup"] = (
            f"an {PROMPT}-token prompt (6000 tokens cached on {HOLDERS} of {WORKERS} workers), "
            f"{router.index.stats()['entries']:,} (block, worker) entries, block {BLOCK}"
        )
        doc["dynamo"] = "ai-dynamo-runtime 1.6.1" if peer is not None else None
        doc["rows"] = [
            {"what": name, "calls": len(xs), "p50_us": float(np.percentile(xs, 50)), "p99_us": float(np.percentile(xs, 99))}
            for name, xs in rows
        ]
        results_file.write(results, doc)
        print(f"wrote {results}")


# ---- pytest-benchmark ---------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="module")
    def setup():
        families, holders, queries = build()
        return kvroute_router(families, holders), families, holders, queries

    def test_route_8192_tokens_64_workers_1m_entries(benchmark, setup):
        router, _, _, queries = setup
        clock = iter(range(10**9))
        i = iter(range(10**9))
        d = benchmark(lambda: router.route(queries[next(i) % len(queries)], now=float(next(clock)) * 100.0))
        assert d.admitted and d.overlap_blocks >= 90

    @pytest.mark.skipif(dyn is None, reason="ai-dynamo-runtime is not installed")
    def test_dynamo_python_pieces_same_decision(benchmark, setup):
        _, families, holders, queries = setup
        d = DynamoRouter(families, holders)
        lists = [q.tolist() for q in queries]
        clock = iter(range(10**9))
        i = iter(range(10**9))
        w = benchmark(lambda: d.route(lists[next(i) % len(lists)], float(next(clock)) * 100.0))
        assert 0 <= w < WORKERS


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3000, help="passes over the 64 queries per kvroute row (default 3000)")
    ap.add_argument("--results", metavar="FILE", help="also write a results file (benches/results/bench_router.json)")
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error("--repeat must be >= 1")
    main(a.repeat, a.results)
