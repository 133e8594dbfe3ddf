"""The cluster model beyond the seed's table: PD mode (decode pool, TPOT, KV room), stale indexes
(event lag), the seed reference router, and input errors."""

from __future__ import annotations

import math

import pytest
from kvroute.sim import ClusterConfig, records_to_workload, seed_chat, simulate, synthetic_trace
from seed_router import SeedRouter


def seed_factory(index, wl, cl, policy, reject, tie_break, seed, **_):  # type: ignore[no-untyped-def]
    return SeedRouter(
        index, workers=cl.instances, speed=cl.speed, block_size=wl.block_size, policy=policy, ttft_slo=cl.slo if reject else None, seed=seed
    )


@pytest.fixture(scope="module")
def chat70():
    return seed_chat(70, 30)


@pytest.mark.parametrize("policy", ["random", "least_load", "cache_only", "ttft"])
@pytest.mark.parametrize("reject", [False, True])
def test_router_matches_the_seed_reference_router(chat70, policy, reject) -> None:
    ours = simulate(chat70, policy, reject=reject, tie_break="lowest", progress=False)
    ref = simulate(chat70, policy, reject=reject, tie_break="lowest", router_factory=seed_factory, progress=False)
    assert ours.extra["_ttfts"] == ref.extra["_ttfts"]
    assert (ours.hit_rate, ours.attainment, ours.rejected) == (ref.hit_rate, ref.attainment, ref.rejected)


def test_stale_index_costs_hits(chat70) -> None:
    fresh = simulate(chat70, "ttft", progress=False)
    stale = simulate(chat70, "ttft", cluster=ClusterConfig(event_lag=2.0), progress=False)
    assert stale.extra["events_published"] > 0
    assert stale.hit_rate < fresh.hit_rate


def test_pd_mode_decode_pool() -> None:
    w = records_to_workload(synthetic_trace("chat", requests=800, rate=40, seed=4), name="chat")
    roomy = ClusterConfig(instances=2, cache_blocks=400, slo=3.0, decode_instances=2, decode_kv_blocks=5000, decode_tokens_per_s=500.0)
    r = simulate(w, "ttft", cluster=roomy, progress=False)
    assert r.requests == 800 and r.rejected == 0
    assert r.extra["decode_instances"] == 2 and r.extra["never_fit"] == 0
    # TPOT grows with the batch: 0.01 s step + batch / 500 tokens/s.
    assert 0.01 + 1 / 500 <= r.extra["tpot_p50"] <= r.extra["tpot_p99"]
    assert r.ttft_p50 > 0.001  # includes the KV transfer to the decode worker
    tight = ClusterConfig(**{**roomy.__dict__, "decode_kv_blocks": 60, "tpot_slo": 0.05})
    no_reject = simulate(w, "ttft", cluster=tight, progress=False)
    with_reject = simulate(w, "ttft", cluster=tight, reject=True, progress=False)
    # Without rejection, sequences that cannot fit fail and the others queue for KV room;
    # with it, the Router turns away what the decode side cannot take before any prefill is spent.
    assert no_reject.ttft_p99 == math.inf or no_reject.ttft_p99 > with_reject.ttft_p99
    assert with_reject.rejected > 0 and set(with_reject.extra["rejected_by"]) <= {"rejected_decode", "rejected_tpot", "rejected_ttft"}
    assert with_reject.ttft_p99 < math.inf


def test_bad_cluster_settings() -> None:
    with pytest.raises(ValueError, match="instances"):
        ClusterConfig(instances=0)
    with pytest.raises(ValueError, match="speed"):
        ClusterConfig(speed=0)
    with pytest.raises(ValueError, match="event_lag"):
        ClusterConfig(event_lag=-1)
    with pytest.raises(ValueError, match="tpot_slo"):
        ClusterConfig(tpot_slo=0)
    with pytest.raises(ValueError, match="decode"):
        ClusterConfig(decode_instances=-1)


def test_unknown_policy_is_a_clear_error(chat70) -> None:
    with pytest.raises(Exception, match="policy"):
        simulate(chat70, "nope", progress=False)
