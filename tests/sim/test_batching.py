"""The seed documents' prefill batching in the simulator (ClusterConfig.prefill_batch_tokens)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from kvroute.sim import SEED_CLUSTER, ClusterConfig, seed_chat, simulate
from kvroute.sim.workload import Workload


def _by_hand(arrivals, lengths):
    """Requests with no shared blocks, one instance (each hash distinct)."""
    offs = np.concatenate([[0], np.cumsum([n // 64 for n in lengths])]).astype(np.int64)
    return Workload(
        name="hand",
        block_size=64,
        arrival=np.asarray(arrivals, dtype=np.float64),
        num_tokens=np.asarray(lengths, dtype=np.int64),
        output_tokens=np.zeros(len(lengths), dtype=np.int64),
        hash_offsets=offs,
        hashes=np.arange(1, int(offs[-1]) + 1, dtype=np.uint64),
    )


def test_a_batch_waits_then_runs_shortest_first_within_the_budget():
    cl = ClusterConfig(instances=1, cache_blocks=1000, speed=1000.0, slo=100.0, prefill_batch_tokens=1024, prefill_batch_wait_s=0.01)
    # 768 and 512 tokens arrive within the 10 ms wait; 256 more right after. The first batch (at
    # 10 ms) sorts [512, 768]: 512 fits the 1024-token budget, 768 does not (1280 > 1024).
    w = _by_hand([0.0, 0.005, 0.02], [768, 512, 256])
    r = simulate(w, "round_robin", reject=False, cluster=cl, progress=False)
    assert r.extra["prefill_batches"] == 2
    # Batch 1 at 0.01 s: [512] ends 0.522. Batch 2 at 0.522: [256, 768] ends 0.522 + 1.024.
    expected = sorted([0.522 - 0.005, 1.546 - 0.0, 1.546 - 0.02])
    assert r.ttft_p50 == pytest.approx(expected[1])
    assert r.ttft_p99 == pytest.approx(expected[2])


def test_batching_is_deterministic_and_off_by_default():
    assert SEED_CLUSTER.prefill_batch_tokens == 0
    w = seed_chat(40, 20.0, 0)
    cl = dataclasses.replace(SEED_CLUSTER, prefill_batch_tokens=8192)
    a = simulate(w, "slack", reject=True, cluster=cl, progress=False)
    b = simulate(w, "slack", reject=True, cluster=cl, progress=False)
    assert (a.attainment, a.ttft_p50, a.hit_rate) == (b.attainment, b.ttft_p50, b.hit_rate)
    fifo = simulate(w, "slack", reject=True, cluster=SEED_CLUSTER, progress=False)
    # The 10 ms wait shows in the median; at 40 req/s everything still meets the 2 s SLO.
    assert a.ttft_p50 > fifo.ttft_p50 and a.attainment == fifo.attainment == 1.0


def test_bad_batching_settings():
    with pytest.raises(ValueError, match="prefill_batch_tokens"):
        ClusterConfig(prefill_batch_tokens=-1)
    with pytest.raises(ValueError, match="unified mode"):
        ClusterConfig(prefill_batch_tokens=8192, decode_instances=2)


def test_cli_prefill_batching_flag(capsys):
    from kvroute.cli import main

    assert (
        main(["simulate", "--rate", "40", "--duration", "10", "--policy", "slack", "--reject", "--prefill-batch-tokens", "8192", "--json"])
        == 0
    )
    assert '"prefill_batches"' in capsys.readouterr().out
