"""Simulator speed, against the seed's pure-Python script in the same run.

- The seed's whole table (40 and 70 req/s, five rows each, workloads included) through kvroute
  (Rust workload generator, Rust LRU engines, kvroute.Router) vs ``seed_reference.table()``:
  target >= 10x.
- The whole Mooncake conversation trace (12,031 requests) replayed per policy: target < 5 s.

Run: ``python -m pytest benches/bench_sim.py -s --benchmark-enable`` (release build).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import seed_reference
from kvroute.sim import ClusterConfig, load_trace, seed_chat, simulate
from kvroute.sim.trace import MOONCAKE_TRACE, find_shared_dir

SEED_ROWS = (("random", False), ("least_load", False), ("cache_only", False), ("ttft", False), ("ttft", True))


_SHARED = find_shared_dir(os.path.dirname(os.path.abspath(__file__)))
MOONCAKE = os.path.join(_SHARED, MOONCAKE_TRACE) if _SHARED else ""


def kvroute_seed_table():
    out = {}
    for rate in (40, 70):
        w = seed_chat(rate, 120)
        for policy, reject in SEED_ROWS:
            out[(rate, policy, reject)] = simulate(w, policy, reject=reject, tie_break="lowest", seed=1, progress=False)
    return out


def _same(ours, ref):
    for k, r in ref.items():
        o = ours[k]
        assert f"{o.hit_rate:.1%} {o.ttft_p50:.2f} {o.ttft_p99:.2f} {o.attainment:.1%} {o.rejected:.1%}" == (
            f"{r['hit_rate']:.1%} {r['ttft_p50']:.2f} {r['ttft_p99']:.2f} {r['attainment']:.1%} {r['rejected']:.1%}"
        ), k


def test_seed_table_vs_seed_script():
    t0 = time.perf_counter()
    ref = seed_reference.table()
    t_ref = time.perf_counter() - t0
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        ours = kvroute_seed_table()
        times.append(time.perf_counter() - t0)
    _same(ours, ref)
    med = statistics.median(times)
    print("\nseed table (10 runs, 13,270 routed requests x 5 policies incl. workload generation):")
    print(f"  kvroute  median {med:.3f} s  (min {min(times):.3f}, max {max(times):.3f}, 5 runs)")
    print(f"  seed.py  {t_ref:.3f} s  (pure Python, 1 run)")
    print(f"  ratio    {t_ref / med:.1f}x  (target >= 10x)")
    assert t_ref / med >= 10


@pytest.mark.skipif(not (MOONCAKE and os.path.exists(MOONCAKE)), reason="../shared/traces (the Mooncake trace) is not available")
def test_mooncake_trace_per_policy():
    from kvroute import POLICIES

    t0 = time.perf_counter()
    w = load_trace(MOONCAKE)
    t_load = time.perf_counter() - t0
    cl = ClusterConfig(instances=8, cache_blocks=1000)
    print(f"\nMooncake conversation trace: {len(w)} requests, load {t_load:.2f} s")
    worst = 0.0
    for policy in POLICIES:
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            simulate(w, policy, reject=True, cluster=cl, progress=False)
            ts.append(time.perf_counter() - t0)
        med = statistics.median(ts)
        worst = max(worst, med)
        print(f"  {policy:<12} median {med:.3f} s per replay (3 runs)  target < 5 s")
    assert worst < 5.0
