"""Time the default policy's `Router.route()` on bench_router's case, with whatever kvroute is installed.

bench_router.py's case (an 8192-token uint32 prompt, 64 workers, a 1.02M-entry index) through only
the API every kvroute release has had, so one script times an old build and the current one:
`benches/ab_commit.sh` runs it in two venvs, alternating, and prints the ratio.

    python benches/route_timing.py --repeat 3000     # one JSON line: {"policy", "p50_us", "p99_us", ...}
"""

from __future__ import annotations

import argparse
import json
import time

import kvroute
import numpy as np

BLOCK = 64
WORKERS = 64
FAMILIES = 2000
HOLDERS = 4
PROMPT = 8192
SPEED = 20000.0


def build(seed: int = 0) -> tuple[kvroute.Router, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    families = rng.integers(0, 2**31, size=(FAMILIES, PROMPT), dtype=np.uint32)
    holders = [rng.choice(WORKERS, size=HOLDERS, replace=False).tolist() for _ in range(FAMILIES)]
    queries = []
    for _ in range(64):
        f = int(rng.integers(FAMILIES))
        tail = rng.integers(0, 2**31, size=PROMPT - 6000, dtype=np.uint32)
        queries.append(np.concatenate([families[f, :6000], tail]))
    router = kvroute.Router(block_size=BLOCK)  # the build's default policy
    per_worker = FAMILIES * PROMPT // BLOCK * HOLDERS // WORKERS
    for w in range(WORKERS):
        try:  # builds with capacity-aware placement take the cache size; older ones do not know it
            router.add_worker(w, prefill_tokens_per_s=SPEED, prefix_cache_blocks=per_worker)
        except TypeError:
            router.add_worker(w, prefill_tokens_per_s=SPEED)
    for fam, hs in zip(families, holders):
        seq = kvroute.block_hashes(fam, BLOCK)
        for w in hs:
            router.index.store(w, seq)
    return router, queries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3000, help="timed routes (default 3000)")
    args = ap.parse_args()
    if args.repeat < 100:
        ap.error("--repeat must be at least 100")
    router, queries = build()
    clock = iter(range(10**9))
    route = router.route
    for q in queries:  # warm up
        route(q, now=float(next(clock)) * 100.0)
    out = np.empty(args.repeat)
    for i in range(args.repeat):
        q = queries[i % len(queries)]
        now = float(next(clock)) * 100.0  # far apart: queues stay empty, every call sees the same state
        t0 = time.perf_counter_ns()
        d = route(q, now=now)
        out[i] = time.perf_counter_ns() - t0
        if not d.admitted:
            raise SystemExit("route() rejected a request on an idle cluster")
    us = out / 1000.0
    print(
        json.dumps(
            {
                "policy": router.policy,
                "p50_us": round(float(np.percentile(us, 50)), 3),
                "p99_us": round(float(np.percentile(us, 99)), 3),
                "repeat": args.repeat,
                "version": getattr(kvroute, "__version__", "?"),
            }
        )
    )


if __name__ == "__main__":
    main()
