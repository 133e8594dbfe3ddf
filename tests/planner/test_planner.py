"""xPyD sizing: the seed's static table to the printed digit, and the dynamic planner's rules."""

import json

import pytest
from cli_support import refusal
from kvroute import planner as pl


def test_seed_static_table_exact():
    assert pl.seed_static_table().splitlines() == [
        "Fixed 12P12D vs sizing per phase (24 instances in total):",
        "  day: chat: needs 4P17D (fits); with the fixed split prefill load 33%; decode load 139% (overloaded)",
        "  evening: long-document summaries: needs 20P3D (fits); with the fixed split prefill load 160% (overloaded); decode load 25%",
        "  night: coding agents: needs 2P17D (fits); with the fixed split prefill load 12%; decode load 139% (overloaded)",
    ]


def test_need_is_the_seeds_formula():
    assert pl.need(100, 2000, 500, 0.6) == (4, 17)
    assert pl.need(30, 16000, 300, 0.2) == (20, 3)
    assert pl.need(25, 6000, 2000, 0.8) == (2, 17)
    with pytest.raises(ValueError, match="capacities"):
        pl.need(1, 1, 1, 0, p_cap=0)


def test_dynamic_plan_follows_phases_and_beats_fixed_split():
    cfg = pl.PlannerConfig(window=600)
    steps = pl.plan_dynamic(pl.expand_phases(pl.SEED_PHASES, 600), cfg)
    assert all(s.p + s.d == 24 for s in steps)
    # Reactive: each phase change costs one overloaded window, then the split fits the phase.
    assert sum(s.overloaded for s in steps) <= 4
    assert sum(s.static_overloaded for s in steps) == len(steps)
    last_of_phase = {s.phase: s for s in steps}
    for ph in pl.SEED_PHASES:
        s = last_of_phase[ph.name]
        assert s.p >= s.need_p and s.d >= s.need_d and not s.overloaded


def test_hysteresis_keeps_a_good_enough_split():
    # A small wobble around a load the current split handles does not cause a move.
    phases = [pl.Phase("a", 100, 2000, 500, 0.6, 600), pl.Phase("b", 104, 2000, 500, 0.6, 600)] * 5
    steps = pl.plan_dynamic(phases, pl.PlannerConfig(window=600, initial=(5, 19)))
    assert all(s.switched == 0 for s in steps)


def test_switch_cost_shows_in_the_switching_window():
    phases = [pl.Phase("x", 100, 2000, 500, 0.6, 300)] * 3
    steps = pl.plan_dynamic(phases, pl.PlannerConfig(window=300, warmup=300, drain=0))
    moved = [s for s in steps if s.switched]
    assert len(moved) == 1
    s = moved[0]
    # The instances moving P->D are unavailable for the whole (300 s) window: D load as with 12 D.
    assert s.d_load == pytest.approx(100 * 500 / (12 * 3000))


def test_phases_files(tmp_path):
    j = tmp_path / "p.json"
    j.write_text(json.dumps([{"name": "a", "rate": 10, "isl": 1000, "osl": 100, "hit": 0.5, "duration": 60}]))
    assert pl.load_phases(j) == [pl.Phase("a", 10, 1000, 100, 0.5, 60)]
    c = tmp_path / "p.csv"
    c.write_text("name,rate,isl,osl,hit\nb,1,2,3,0.1\n")
    assert pl.load_phases(c)[0].name == "b"
    bad = tmp_path / "bad.csv"
    bad.write_text("name,rate\nb,1\n")
    with pytest.raises(ValueError, match="lacks field"):
        pl.load_phases(bad)
    with pytest.raises(ValueError, match="hit"):
        pl.Phase("z", 1, 1, 1, 1.5)


def test_windows_from_a_workload():
    from kvroute.sim import records_to_workload, synthetic_trace

    w = records_to_workload(synthetic_trace("chat", requests=500, rate=5, seed=2))
    ws = pl.phases_from_workload(w, 20.0)
    assert sum(round(p.rate * p.duration) for p in ws) == 500
    assert all(0 <= p.hit <= 1 for p in ws)
    assert ws[-1].hit > ws[0].hit  # reuse grows as conversations continue


def test_need_for_slo_sizes_to_the_slo_not_to_full_utilisation() -> None:
    from kvroute.planner import EngineCaps, Phase, erlang_c, need, need_for_slo

    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(4, 0.0) == 0.0 and erlang_c(4, 4.0) == 1.0
    caps = EngineCaps(p_cap=20000, p_pass_s=0.0, d_slots=100, d_step_s=0.02)
    ph = Phase("p", 10, 2000, 500, 0.5)
    p, d = need_for_slo(ph, caps, ttft_slo=2.0)
    # Full utilisation would need ceil(10 * 1000 / 20000) = 1 P and ceil(10 * 500 / (100 / 0.02)) = 1 D.
    assert need(10, 2000, 500, 0.5, p_cap=20000, d_cap=100 / 0.02) == (1, 1)
    assert p >= 1 and d >= 2
    with pytest.raises(ValueError, match="exceeds the TTFT SLO"):
        need_for_slo(Phase("long", 1, 100000, 1, 0.0), caps, ttft_slo=2.0)
    with pytest.raises(ValueError, match="target"):
        need_for_slo(ph, caps, ttft_slo=2.0, target=1.0)


def test_plan_engine_aisim_sizes_the_seed_phases_to_their_slos(capsys):
    from kvroute.cli import main

    assert main(["plan", "--engine", "aisim", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["phase"] for r in rows] == [p.name for p in pl.SEED_PHASES]
    for r, ph in zip(rows, pl.SEED_PHASES):
        # Sized to the SLOs, never below what full utilisation of the same capacities needs.
        caps = r["caps"]
        full = pl.need(ph.rate, ph.isl, ph.osl, ph.hit, p_cap=caps["p_cap"], d_cap=caps["d_slots"] / caps["d_step_s"])
        assert r["p"] >= full[0] and r["d"] >= full[1] and "goodput" not in r
    assert "--check goes with --engine aisim" in refusal(["plan", "--check"], capsys)
    assert "--dynamic and --trace use the seed model" in refusal(["plan", "--engine", "aisim", "--dynamic"], capsys)
