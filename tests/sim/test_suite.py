"""The policy benchmark suite: its cases, the bounds beside them, and the command that prints it."""

from __future__ import annotations

import json

import pytest
from cli_support import refusal
from kvroute.cli import main
from kvroute.sim import ClusterConfig, records_to_workload, simulate, synthetic_trace
from kvroute.sim.suite import CASES, QUICK_CASES, default_policy, format_case, format_suite, run_suite, suite_policies


def test_suite_is_split_up_front_and_covers_the_issue():
    splits = {c.split for c in CASES}
    assert splits == {"tuning", "held-out"}
    names = " ".join(c.name for c in CASES)
    for rate in ("60/s", "70/s", "80/s", "90/s"):
        assert f"seed chat {rate}" in names
    for x in ("4x", "5x", "6x", "7x", "8x"):
        assert f"mooncake {x}" in names
    # The held-out half holds shapes never used to choose constants, and other workload seeds.
    tuning_kinds = {c.kind for c in CASES if c.split == "tuning"}
    held = [c for c in CASES if c.split == "held-out"]
    assert any(c.kind not in tuning_kinds for c in held)
    tuning_seeds = {s for c in CASES if c.split == "tuning" and c.kind != "mooncake" for s in c.seeds}
    assert all(not set(c.seeds) & tuning_seeds for c in held if c.kind != "mooncake")
    assert all(len(c.seeds) == 3 for c in CASES if c.kind != "mooncake")


def test_long_context_shapes_have_long_prompts_in_turn_order():
    for shape, prefix_blocks in (("long", 8), ("long_rag", 4)):
        recs = synthetic_trace(shape, requests=300, rate=1.0, seed=0)
        assert min(r["input_length"] for r in recs) >= 10_000
        # A session is keyed by its document's first block; its next turn extends its previous
        # prompt (full-block ids are a prefix of the next), unless the context filled and it restarted.
        seen: dict[int, list[int]] = {}
        grew = revisits = 0
        for r in recs:
            ids = r["hash_ids"][: r["input_length"] // 512]
            key = ids[prefix_blocks]
            if key in seen:
                revisits += 1
                grew += ids[: len(seen[key])] == seen[key]
            seen[key] = ids
        assert revisits > 20 and grew >= 0.9 * revisits


def test_bounds_order_split_global_infinite_cache():
    w = records_to_workload(synthetic_trace("agent", requests=600, rate=24, seed=0), name="agent")
    cl = ClusterConfig(instances=4, cache_blocks=400, slo=2.0)
    split = simulate(w, "ttft", reject=True, cluster=cl, progress=False)
    glob = simulate(
        w, "ttft", reject=True, cluster=ClusterConfig(instances=4, cache_blocks=400, slo=2.0, shared_cache=True), progress=False
    )
    inf_cl = ClusterConfig(instances=4, cache_blocks=10**5, slo=2.0, shared_cache=True)
    inf = simulate(w, "ttft", reject=True, cluster=inf_cl, progress=False)
    assert glob.hit_rate > split.hit_rate
    assert inf.hit_rate >= glob.hit_rate


def test_quick_suite_runs_every_policy_with_bounds():
    res = run_suite(QUICK_CASES[:2], event_lags=(0.0,))
    assert len(res) == 2
    pols = suite_policies()
    assert pols[-1] == default_policy() and "node_score" in pols
    for r in res:
        assert set(r.attainment) == set(pols) == set(r.rejected)
        assert set(r.bounds) == {"limit", "global cache"}
        assert all(0.0 <= a <= 1.0 for a in r.attainment.values())
        # The limit is a bound: no policy beats it.
        assert max(r.attainment.values()) <= r.bounds["limit"] + 1e-12
        # Each run is every policy on one workload seed.
        assert len(r.runs) == len(pols) * len(r.case.seeds)
        assert r.default_is_best == (r.attainment[r.default] >= max(v for p, v in r.attainment.items() if p != r.default) - 0.0005)
    table = format_suite(res)
    assert "tuning: default best" in table and "| limit (bound) |" in table
    # Deterministic: the same suite gives the same figures.
    again = run_suite(QUICK_CASES[:1], event_lags=(0.0,))
    assert again[0].attainment == res[0].attainment


def test_suite_command_json(capsys):
    assert main(["simulate", "--suite", "--quick", "--case", "docs", "--policy", "cache_only", "--policy", "slack", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["event_lag"] for x in lines] == [0.0, 0.05]
    assert all(x["split"] == "held-out" and set(x["attainment"]) == {"cache_only", "slack"} for x in lines)


def test_suite_command_errors(capsys):
    for argv, msg in (
        (["simulate", "--suite", "--case", "nothing-like-this"], "no case matches"),
        (["simulate", "--quick"], "go with --suite"),
        (["simulate", "--suite", "--quick", "--policy", "nope"], "unknown policy"),
        (["simulate", "--seeds", "5"], "go with --suite"),
        (["simulate", "--suite", "--quick", "--seeds", "0"], "integer >= 1"),
    ):
        assert msg in refusal(argv, capsys), argv


def test_suite_with_the_default_alone_reports_no_verdict(capsys):
    # One policy: its attainment per case, and no "best" verdict (there is nothing to compare).
    res = run_suite(QUICK_CASES[:1], policies=["slack"], event_lags=(0.0,), bounds=False)
    assert res[0].best_other[0] is None and res[0].default_is_best is None
    assert "no other policy ran" in format_case(res[0])
    assert "default best (within" not in format_suite(res)
    assert main(["simulate", "--suite", "--quick", "--case", "docs", "--policy", "slack", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines and all(x["default_is_best"] is None for x in lines)


def test_more_seeds_extend_each_half_and_keep_the_halves_apart():
    from kvroute.sim.suite import half_seeds

    # The default suite's seeds are the first three of each half.
    assert half_seeds("tuning", 3) == (0, 1, 2)
    assert half_seeds("held-out", 3) == (3, 4, 5)
    assert half_seeds("tuning", 7) == (0, 1, 2, 6, 7, 8, 12)
    assert not set(half_seeds("tuning", 30)) & set(half_seeds("held-out", 30))
    for c in CASES:
        more = c.with_seeds(6)
        if c.kind == "mooncake":
            assert more.seeds == c.seeds  # one fixed trace: nothing to vary
        else:
            assert more.seeds[:3] == c.seeds and len(more.seeds) == 6
    with pytest.raises(ValueError, match="seeds must be >= 1"):
        half_seeds("tuning", 0)
    with pytest.raises(ValueError, match="split"):
        half_seeds("both", 3)


def test_gap_is_paired_over_seeds_and_flags_only_losses_beyond_the_noise():
    from kvroute.sim.suite import CaseResult

    case = CASES[0]

    def result(default: list[float], other: list[float]) -> CaseResult:
        by_seed = {"cache_only": other, "slack": default}
        att = {p: sum(v) / len(v) for p, v in by_seed.items()}
        return CaseResult(case, 0.0, att, {p: 0.0 for p in att}, {}, "slack", by_seed=by_seed)

    # Behind by 0.2 points on every seed: no noise, a real loss.
    r = result([0.90, 0.80, 0.70], [0.902, 0.802, 0.702])
    g, se = r.gap
    assert g == pytest.approx(-0.2) and se == pytest.approx(0.0, abs=1e-9)
    assert r.default_is_best is False and r.significantly_behind
    # Behind by 0.2 on the mean, but the seeds disagree (+0.4, -0.4, -0.6): not beyond two SE.
    r = result([0.904, 0.796, 0.694], [0.900, 0.800, 0.700])
    g, se = r.gap
    assert g == pytest.approx(-0.2) and se == pytest.approx(0.3055, abs=1e-3)
    assert r.default_is_best is False and not r.significantly_behind
    assert "no (-0.20 ± 0.31)" in format_suite([r])
    assert "behind by more than two standard errors (paired over seeds) in 0" in format_suite([r])
    # One seed: no error, so nothing counts as significant.
    r = result([0.90], [0.91])
    assert r.gap[1] != r.gap[1] and not r.significantly_behind
    assert json.loads(json.dumps(r.to_json()))["gap_se_points"] is None


def test_suite_runs_more_seeds_per_case():
    res = run_suite(QUICK_CASES[2:3], policies=["cache_only", "slack"], event_lags=(0.0,), bounds=False, seeds=2)
    (r,) = res
    assert r.case.seeds == (3, 4)
    assert [len(v) for v in r.by_seed.values()] == [2, 2]
    assert r.attainment["slack"] == pytest.approx(sum(r.by_seed["slack"]) / 2)
    assert r.gap[1] == r.gap[1]  # two seeds: a standard error


def test_quick_suite_cases_separate_the_policies():
    """Each quick case shows more than one attainment among the cache-aware policies (a case where
    all of them score the same shows nothing), and no policy beats the limit."""
    res = run_suite(QUICK_CASES, event_lags=(0.0,))
    for r in res:
        aware = {round(r.attainment[p], 6) for p in ("cache_only", "cache_aware", "ttft", "slack", "capacity")}
        assert len(aware) > 1, (r.case.name, r.attainment)
        assert max(r.attainment.values()) <= r.bounds["limit"] + 1e-12
