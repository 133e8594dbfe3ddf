"""Simulator speed, against the seed's pure-Python script in the same run.

- The seed's whole table (40 and 70 req/s, five rows each, workloads included) through kvroute
  (Rust workload generator, Rust LRU engines, kvroute.Router) vs ``seed_reference.table()``:
  target >= 10x.
- The whole Mooncake conversation trace (12,031 requests) replayed per policy: target < 5 s.

Run: ``python -m pytest benches/bench_sim.py -s`` (release build; asserts the targets), or
``python benches/bench_sim.py --results benches/results/bench_sim.json`` (writes a results file).
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


def seed_speed() -> dict:
    """The seed's table through kvroute (median of 5 runs) and through the seed's script (1 run)."""
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
    return {"kvroute_s": med, "kvroute_runs": times, "seed_script_s": t_ref, "ratio": t_ref / med}


def mooncake_speed() -> dict | None:
    """The Mooncake conversation trace replayed per policy (median of 3 runs each); None without ../shared."""
    if not (MOONCAKE and os.path.exists(MOONCAKE)):
        return None
    from kvroute import POLICIES

    t0 = time.perf_counter()
    w = load_trace(MOONCAKE)
    t_load = time.perf_counter() - t0
    cl = ClusterConfig(instances=8, cache_blocks=1000)
    print(f"\nMooncake conversation trace: {len(w)} requests, load {t_load:.2f} s")
    per_policy = {}
    for policy in POLICIES:
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            simulate(w, policy, reject=True, cluster=cl, progress=False)
            ts.append(time.perf_counter() - t0)
        per_policy[policy] = statistics.median(ts)
        print(f"  {policy:<12} median {per_policy[policy]:.3f} s per replay (3 runs)  target < 5 s")
    return {"requests": len(w), "load_s": t_load, "replay_s": per_policy}


def test_seed_table_vs_seed_script():
    assert seed_speed()["ratio"] >= 10


@pytest.mark.skipif(not (MOONCAKE and os.path.exists(MOONCAKE)), reason="../shared/traces (the Mooncake trace) is not available")
def test_mooncake_trace_per_policy():
    r = mooncake_speed()
    assert r is not None and max(r["replay_s"].values()) < 5.0


if __name__ == "__main__":
    import argparse

    import results_file

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", metavar="FILE", help="write a results file (benches/results/bench_sim.json)")
    a = ap.parse_args()
    doc = {"seed_table": seed_speed(), "mooncake": mooncake_speed()}
    if a.results:
        results_file.write(a.results, {**results_file.header("bench_sim", results_file.command("bench_sim.py")), **doc})
        print(f"wrote {a.results}")
