"""The Router reproduces the seed's routing exactly (tie_break="lowest").

Runs the seed's own `workload()` and `simulate()` (taken from ../shared/seeds/000_*.txt) and
drives kvroute.Router with a minimal event-emitting cluster: each simulated instance keeps the
seed's 3000-block LRU and pushes store/remove events into the router's KvIndex. The printed rows
must come out identical. Skips when ../shared is absent (a fresh clone has none).
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict
from pathlib import Path

import kvroute
import numpy as np
import pytest


def _find_seed() -> Path | None:
    for parent in Path(__file__).resolve().parents:
        hits = sorted((parent / "shared" / "seeds").glob("000_*.txt"))
        if hits:
            return hits[0]
    return None


SEED = _find_seed()
pytestmark = pytest.mark.skipif(SEED is None, reason="../shared/seeds (the seed) is not present")


@pytest.fixture(scope="module")
def seed_ns() -> dict:
    text = SEED.read_text(encoding="utf-8")
    start = text.index("import random")
    end = text.index("for rate in (40, 70):")
    ns: dict = {}
    exec(compile(text[start:end], str(SEED), "exec"), ns)  # the seed's own code, unmodified
    return ns


POLICIES = {"随机": "random", "最少排队": "least_load", "只看缓存": "cache_only", "预计 TTFT 最小": "ttft"}


def kvroute_simulate(ns: dict, reqs, policy: str, reject: bool = False) -> str:
    """The seed's experiment with every routing decision made by kvroute.Router."""
    n, block, speed, slo = ns["INSTANCES"], ns["BLOCK"], ns["SPEED"], ns["SLO"]
    name = POLICIES[policy]
    router = kvroute.Router(
        policy="ttft" if name == "random" else name,
        block_size=block,
        tie_break="lowest",
        ttft_slo=slo if reject else None,
        reject=reject,
    )
    for w in range(n):
        router.add_worker(w, prefill_tokens_per_s=float(speed))
    index = router.index
    rng = random.Random(1)
    lru = [OrderedDict() for _ in range(n)]
    ttfts, rejected, hit_tokens, total_tokens = [], 0, 0, 0
    for t, tokens in reqs:
        arr = np.asarray(tokens, dtype=np.uint32)
        hashes = kvroute.block_hashes(arr, block)
        pin = rng.randrange(n) if name == "random" else None
        d = router.route(hashes=hashes, num_tokens=len(tokens), now=t, worker=pin)
        if not d.admitted:
            rejected += 1
            continue
        i = d.worker
        ttfts.append(d.busy_until - t)
        hit_tokens += d.overlap_blocks * block
        total_tokens += len(tokens)
        cache = lru[i]
        for h in hashes.tolist():
            cache[h] = True
            cache.move_to_end(h)
        evicted = []
        while len(cache) > 3000:
            evicted.append(cache.popitem(last=False)[0])
        index.store(i, hashes)  # what the engine's KV events would say
        if evicted:
            index.remove(i, evicted)
    ttfts.sort()
    good = sum(x <= slo for x in ttfts)
    return (
        f"命中率 {hit_tokens / total_tokens:5.1%}，TTFT 中位数 {ttfts[len(ttfts) // 2]:5.2f} s、"
        f"P99 {ttfts[int(len(ttfts) * 0.99)]:6.2f} s，达标 {good / len(reqs):5.1%}"
        + (f"，拒绝 {rejected / len(reqs):.1%}" if reject else "")
    )


@pytest.mark.parametrize("rate,seconds", [(40, 15), (70, 25)])
def test_seed_rows_reproduced(seed_ns, rate, seconds):
    reqs = seed_ns["workload"](rate, seconds)
    for policy in POLICIES:
        assert kvroute_simulate(seed_ns, reqs, policy) == seed_ns["simulate"](reqs, policy), policy
    ours = kvroute_simulate(seed_ns, reqs, "预计 TTFT 最小", reject=True)
    assert ours == seed_ns["simulate"](reqs, "预计 TTFT 最小", reject=True)
    assert re.search(r"拒绝 \d", ours)
