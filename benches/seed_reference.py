"""The seed's routing simulation (seeds/000), kept verbatim-equivalent in pure Python.
It is the reference kvroute's simulator must reproduce, and the baseline of the speed benchmark.

Only identifiers and output labels are translated (随机 random, 最少排队 least_load, 只看缓存
cache_only, 预计 TTFT 最小 ttft); every random call, comparison and formula is the seed's.
Run it directly to print the seed's table: ``python benches/seed_reference.py``.
"""

import random
from collections import OrderedDict

BLOCK, INSTANCES, SPEED, SLO = 64, 8, 20000, 2.0


def keys(tokens):
    out, h = [], 0
    for i in range(0, len(tokens) // BLOCK * BLOCK, BLOCK):
        h = hash((h, tuple(tokens[i : i + BLOCK])))
        out.append(h)
    return out


def workload(rate, seconds, seed=0):
    rng = random.Random(seed)
    systems = [[rng.randrange(10**6) for _ in range(2048)] for _ in range(20)]
    convs = [list(rng.choice(systems)) for _ in range(400)]
    t, reqs = 0.0, []
    while t < seconds:
        t += rng.expovariate(rate)
        c = rng.randrange(len(convs))
        convs[c] = convs[c] + [rng.randrange(10**6) for _ in range(300)]
        reqs.append((t, list(convs[c])))
    return reqs


def simulate_raw(reqs, policy, reject=False):
    """The seed's ``simulate``, returning numbers instead of a formatted line."""
    rng = random.Random(1)
    cache = [OrderedDict() for _ in range(INSTANCES)]
    busy = [0.0] * INSTANCES
    ttfts, rejected, hit_tokens, total_tokens = [], 0, 0, 0
    for t, tokens in reqs:
        ks = keys(tokens)

        def hit(i):
            n = 0
            for k in ks:  # noqa: B023  (the seed's closure, verbatim)
                if k not in cache[i]:
                    break
                n += 1
            return n * BLOCK

        def ttft(i):
            return max(busy[i] - t, 0) + (len(tokens) - hit(i)) / SPEED  # noqa: B023

        if policy == "random":
            i = rng.randrange(INSTANCES)
        elif policy == "least_load":
            i = min(range(INSTANCES), key=lambda j: busy[j])
        elif policy == "cache_only":
            i = max(range(INSTANCES), key=lambda j: (hit(j), -busy[j]))
        else:
            i = min(range(INSTANCES), key=ttft)
        if reject and ttft(i) > SLO:
            rejected += 1
            continue
        h = hit(i)
        busy[i] = max(busy[i], t) + (len(tokens) - h) / SPEED
        ttfts.append(busy[i] - t)
        hit_tokens, total_tokens = hit_tokens + h, total_tokens + len(tokens)
        for k in ks:
            cache[i][k] = True
            cache[i].move_to_end(k)
        while len(cache[i]) > 3000:
            cache[i].popitem(last=False)
    ttfts.sort()
    good = sum(x <= SLO for x in ttfts)
    return {
        "requests": len(reqs),
        "hit_rate": hit_tokens / total_tokens,
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p99": ttfts[int(len(ttfts) * 0.99)],
        "attainment": good / len(reqs),
        "rejected": rejected / len(reqs),
    }


def simulate(reqs, policy, reject=False):
    r = simulate_raw(reqs, policy, reject)
    return (
        f"hit rate {r['hit_rate']:5.1%}, TTFT p50 {r['ttft_p50']:5.2f} s, "
        f"p99 {r['ttft_p99']:6.2f} s, attainment {r['attainment']:5.1%}" + (f", rejected {r['rejected']:.1%}" if reject else "")
    )


ROWS = (("random", False), ("least_load", False), ("cache_only", False), ("ttft", False), ("ttft", True))


def table(rates=(40, 70), seconds=120):
    """The seed's whole experiment: {(rate, policy, reject): numbers}."""
    out = {}
    for rate in rates:
        reqs = workload(rate, seconds)
        for policy, reject in ROWS:
            out[(rate, policy, reject)] = simulate_raw(reqs, policy, reject)
    return out


if __name__ == "__main__":
    for rate in (40, 70):
        reqs = workload(rate, 120)
        print(f"== {rate} req/s ({len(reqs)} requests)")
        for policy in ("random", "least_load", "cache_only", "ttft"):
            print(f"  {policy}: {simulate(reqs, policy)}")
        print(f"  ttft + reject: {simulate(reqs, 'ttft', reject=True)}")
