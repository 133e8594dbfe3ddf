"""The default policy's acceptance figure on the seed's workload: with early rejection at
70 req/s (seed 0, 120 s, the seed's cluster), at least 99.0% SLO attainment with at most 1% rejected."""

from __future__ import annotations

import pytest
from kvroute.sim import simulate
from kvroute.sim.workload import seed_chat


def test_slack_with_rejection_keeps_99_percent_at_70_rps():
    res = simulate(seed_chat(70, 120.0, 0), "slack", reject=True)
    assert res.requests == 8456
    assert res.attainment >= 0.990, res
    assert res.rejected <= 0.010, res
    # Admitted requests keep the SLO (misses are rejections): the router's prediction is exact here.
    assert res.attainment + res.rejected == pytest.approx(1.0)
