"""The attainment limit (kvroute.sim.limit): a counting bound no router can beat. It is exact on
workloads where the count is obvious, and above every policy's simulated attainment."""

from __future__ import annotations

import pytest
from kvroute.sim import ClusterConfig, records_to_workload, seed_chat, simulate, synthetic_trace
from kvroute.sim.limit import attainment_limit, least_work


def unique_prompts(n: int, tokens: int, gap_ms: float):  # type: ignore[no-untyped-def]
    """n prompts of `tokens` tokens sharing nothing, one every `gap_ms` ms (512-token blocks)."""
    blocks = -(-tokens // 512)
    recs = [
        {"timestamp": i * gap_ms, "input_length": tokens, "output_length": 1, "hash_ids": list(range(i * blocks, (i + 1) * blocks))}
        for i in range(n)
    ]
    return records_to_workload(recs, name="unique")


def test_underloaded_pool_can_serve_everything() -> None:
    # 2048 tokens every 200 ms = 10240 tokens/s on 2 x 20000: half the capacity.
    w = unique_prompts(200, 2048, 200.0)
    lim = attainment_limit(w, ClusterConfig(instances=2, speed=20000, slo=2.0))
    assert lim.forced_misses == 0 and lim.attainment == 1.0
    assert lim.least_work_tokens == lim.prompt_tokens == 200 * 2048


def test_overloaded_pool_misses_the_excess() -> None:
    # 4000 tokens every 100 ms = 40000 tokens/s on one 20000-token/s instance for 100 s: at most
    # (99.9 s + slo) * 20000 / 4000 = 509.5 requests can be prefilled in time, of 1000. The
    # bound's windows end on a grid of slo / 4 = 0.5 s, which may add up to 0.5 s of capacity
    # (2.5 requests): it never claims more misses than exist.
    w = unique_prompts(1000, 4000, 100.0)
    lim = attainment_limit(w, ClusterConfig(instances=1, speed=20000, slo=2.0))
    assert 1000 - 513 <= lim.forced_misses <= 1000 - 509, lim
    best = max(
        simulate(w, p, reject=True, cluster=ClusterConfig(instances=1, speed=20000, slo=2.0), progress=False).attainment
        for p in ("ttft", "slack")
    )
    assert best <= lim.attainment


def test_least_work_counts_each_block_once() -> None:
    recs = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 2, "input_length": 1000, "output_length": 1, "hash_ids": [4, 5]},  # new prefix
        {"timestamp": 3, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 9]},  # partial last block
    ]
    assert least_work(records_to_workload(recs)).tolist() == [1024, 512, 1000, 1100 - 1024]


@pytest.mark.parametrize(
    ("workload", "cluster"),
    [
        (seed_chat(80, 30, seed=1), ClusterConfig()),
        (
            records_to_workload(synthetic_trace("agent", requests=600, rate=32, seed=1)),
            ClusterConfig(instances=4, cache_blocks=400, slo=5.0),
        ),
    ],
    ids=["seed-chat-80", "agent-32"],
)
def test_limit_is_above_every_policy(workload, cluster) -> None:  # type: ignore[no-untyped-def]
    lim = attainment_limit(workload, cluster)
    runs = {p: simulate(workload, p, reject=True, cluster=cluster, progress=False) for p in ("cache_only", "ttft", "slack")}
    for p, r in runs.items():
        assert r.attainment <= lim.attainment, (p, r.attainment, lim)
        assert r.hit_rate <= lim.hit_rate_limit + 1e-12, (p, r.hit_rate, lim)


def test_pd_clusters_are_refused() -> None:
    with pytest.raises(ValueError, match="unified"):
        attainment_limit(seed_chat(10, 2), ClusterConfig(decode_instances=1))
