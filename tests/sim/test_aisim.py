"""The realistic engine model (kvroute.sim.aisim, NVIDIA AISimulate's engines) from Python and the CLI.

These run on a wheel built with the aisim feature; on a default build they check that asking for
it says how to get it. CI builds both (KVROUTE_REQUIRE_AISIM=1 makes a missing feature a failure).
"""

from __future__ import annotations

import json
import os

import pytest
from cli_support import refusal
from kvroute import KvrouteError
from kvroute.cli import main
from kvroute.sim import synthetic_trace
from kvroute.sim.aisim import HAS_AISIM, EngineModel, PolyFit, replay, router_for
from kvroute.sim.suite import mooncake_path
from kvroute.sim.trace import find_shared_dir

needs_aisim = pytest.mark.skipif(
    not HAS_AISIM and not os.environ.get("KVROUTE_REQUIRE_AISIM"), reason="kvroute built without the aisim feature"
)


def small_trace(rate: float = 4.0, requests: int = 300) -> list[dict[str, object]]:
    return synthetic_trace("agent", requests=requests, rate=rate, seed=3)


@pytest.mark.skipif(HAS_AISIM, reason="this build has the aisim feature")
def test_without_the_feature_replay_and_cli_say_how_to_get_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match="--features aisim"):
        replay(small_trace(), router=None)
    assert "--features aisim" in refusal(["simulate", "--engine", "aisim", "--scenario", "synthetic"], capsys)


@needs_aisim
def test_kvroute_routes_agent_sessions_onto_their_caches_better_than_round_robin() -> None:
    trace = small_trace()
    kv = replay(trace, router=router_for(EngineModel(), policy="capacity"), workers=4)
    rr = replay(trace, router=None, workers=4)
    for r in (kv, rr):
        assert r.summary["requests"] == len(trace)
        assert r.summary["completed"] == len(trace)
        assert len(r.records) == len(trace)
    assert kv.placement == "capacity" and rr.placement == "round_robin"
    # Agent sessions reuse long tool prefixes and their own context: kvroute keeps them where they are cached.
    assert kv.summary["prefix_hit_rate"] > rr.summary["prefix_hit_rate"] + 0.1
    # Every placement's expected overlap is what the engine found cached, or less (evicted since).
    for rec in kv.records:
        assert rec["routed_overlap_tokens"] is not None and rec["predicted_ttft_ms"] is not None


@needs_aisim
def test_disaggregated_and_custom_timing_runs() -> None:
    fit = PolyFit(0.0, 0.02, 10.0, 0.0, 20.0, 5.0)
    eng = EngineModel(num_gpu_blocks=4096, timing=fit)
    r = replay(small_trace(requests=120), router=router_for(eng), prefill=2, decode=2, engine=eng)
    assert r.summary["completed"] + r.summary["rejected"] == 120
    assert {rec["decode_worker"] for rec in r.records if not rec["rejected"]} <= {0, 1}
    fixed = EngineModel(timing=("fixed", 30.0, 10.0))
    r = replay(small_trace(requests=60), router=None, workers=2, engine=fixed)
    assert r.summary["completed"] == 60


@needs_aisim
def test_bad_input_is_refused_with_what_was_wrong(tmp_path: os.PathLike[str]) -> None:
    trace = small_trace(requests=10)
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        replay(trace, router=None, engine=EngineModel(num_gpu_blocks=0))
    with pytest.raises(ValueError, match="workers"):
        replay(trace, router=None, workers=0)
    with pytest.raises(ValueError, match="prefill >= 1"):
        replay(trace, router=None, prefill=2, decode=0)
    with pytest.raises(ValueError, match="trace line 1"):
        replay([{"timestamp": "soon"}], router=None)
    with pytest.raises(ValueError, match="no-such"):
        replay(os.path.join(str(tmp_path), "no-such.jsonl"), router=None)
    with pytest.raises(ValueError, match="timing"):
        EngineModel(timing="fast").to_json()  # type: ignore[arg-type]
    used = router_for(EngineModel())
    used.add_worker(0)
    with pytest.raises(KvrouteError, match="fresh Router"):
        replay(trace, router=used)
    # A Router that believes in another KV link than the cluster's would mispredict every PD transfer.
    from kvroute import Router

    with pytest.raises(KvrouteError, match="KV transfer model"):
        replay(trace, router=Router(block_size=64), prefill=1, decode=1)


@needs_aisim
def test_cli_engine_aisim_prints_each_policy_against_round_robin(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--engine", "aisim", "--scenario", "synthetic", "--shape", "agent", "--requests", "150"]
    assert main([*argv, "--rate", "3", "--instances", "2", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["placement"] for r in rows] == ["capacity", "round_robin"]
    assert all(r["requests"] == 150 for r in rows)
    assert main([*argv, "--rate", "3", "--instances", "2", "--decode-instances", "2", "--policy", "cache_aware"]) == 0
    out = capsys.readouterr().out
    assert "2P2D" in out and "cache_aware" in out and "round_robin" in out
    assert "seed engine" in refusal(["simulate", "--engine", "aisim", "--scenario", "synthetic", "--cache-blocks", "10"], capsys)
    assert "seed-chat" in refusal(["simulate", "--engine", "aisim", "--scenario", "seed-chat"], capsys)
    assert "go with --engine aisim" in refusal(["simulate", "--kv-blocks", "10"], capsys)


@needs_aisim
def test_the_mooncake_conversation_trace_replays_whole() -> None:
    path = mooncake_path(find_shared_dir(os.path.dirname(__file__)))
    if path is None:
        pytest.skip("no ../shared/traces (a user's clone has none)")
    r = replay(path, router=router_for(EngineModel()), workers=16, speedup=4.0)
    assert r.summary["requests"] == 12031
    assert r.summary["completed"] + r.summary["rejected"] == 12031
    assert r.summary["prefix_hit_rate"] > 0.2


@needs_aisim
def test_the_planner_sizes_each_seed_phase_to_its_slos_on_the_realistic_engines() -> None:
    """`kvroute plan --engine aisim`: each seed phase's xPyD, simulated as a disaggregated cluster,
    keeps the SLOs for 99% of requests, and one instance fewer on its bottleneck side does not
    (one fewer prefill instance than one leaves none, which serves nothing)."""
    from kvroute.planner import SEED_PHASES
    from kvroute.sim.aisim import plan_check

    for ph in SEED_PHASES:
        r = plan_check(ph, seconds=120.0)
        planned = r["goodput"][f"{r['p']}P{r['d']}D"]
        fewer = [v for k, v in r["goodput"].items() if k != f"{r['p']}P{r['d']}D"]
        if r["p"] == 1:
            fewer.append(0.0)
        assert planned >= 0.99, (ph.name, r)
        assert min(fewer) < 0.99, (ph.name, r)


@needs_aisim
def test_the_committed_aiconfigurator_fit_drives_the_engines() -> None:
    """benches/aic_fit.py's output for Qwen3-32B on two H100s (vLLM) loads as a PolyFit and times
    the engines: slower prefill than AISimulate's built-in fit, so the same trace waits longer."""
    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "benches",
        "data",
        "aic_qwen3-32b_h100-sxm_tp2_vllm.json",
    )
    with open(path) as f:
        fit = PolyFit(**json.load(f))
    trace = small_trace(rate=2.0, requests=120)
    aic = replay(trace, router=None, workers=2, engine=EngineModel(timing=fit))
    builtin = replay(trace, router=None, workers=2)
    assert aic.summary["completed"] == builtin.summary["completed"] == 120
    assert aic.summary["ttft_mean_ms"] > builtin.summary["ttft_mean_ms"]
