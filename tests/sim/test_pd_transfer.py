"""The seed documents' PD options in the simulator: compressed KV transfer (fp8 halves the bytes),
incremental transfer (decode instances cache prefixes; only the blocks they lack move), and the
seed's decode score as the Router's decode choice."""

from __future__ import annotations

import dataclasses

import pytest
from kvroute import Router
from kvroute.cli import main
from kvroute.sim import ClusterConfig, records_to_workload, simulate, synthetic_trace

BASE = ClusterConfig(
    instances=2, cache_blocks=1000, slo=5.0, decode_instances=2, decode_kv_blocks=4000, decode_tokens_per_s=4000.0, link_bytes_per_s=5e9
)


def _workload():
    return records_to_workload(synthetic_trace("long", requests=200, rate=4, seed=1), name="long")


def test_compressed_transfer_halves_transfer_time():
    assert BASE.transfer_time(1000) - BASE.link_latency_s == pytest.approx(
        2 * (dataclasses.replace(BASE, kv_compression=0.5).transfer_time(1000) - BASE.link_latency_s)
    )
    w = _workload()
    plain = simulate(w, "slack", reject=True, cluster=BASE, progress=False)
    fp8 = simulate(w, "slack", reject=True, cluster=dataclasses.replace(BASE, kv_compression=0.5), progress=False)
    # Whole prompts move (no decode-side cache), at half the bytes: first tokens come sooner.
    assert plain.extra["transferred_tokens"] > 0.9 * int(w.num_tokens.sum()) * (1 - plain.rejected)
    assert fp8.ttft_p50 < plain.ttft_p50


def test_incremental_transfer_moves_only_what_the_decode_side_lacks():
    w = _workload()
    full = simulate(w, "slack", reject=True, cluster=BASE, progress=False)
    inc = simulate(w, "slack", reject=True, cluster=dataclasses.replace(BASE, incremental_transfer=True), progress=False)
    # Multi-turn sessions: later turns find their history on the decode instance.
    assert inc.extra["transferred_tokens"] < 0.6 * full.extra["transferred_tokens"]
    assert inc.ttft_p50 < full.ttft_p50
    assert inc.attainment >= full.attainment


def test_decode_choice_is_a_router_option_and_bad_values_are_errors():
    assert Router(decode_choice="score").config["decode_choice"] == "score"
    assert Router().config["decode_choice"] == "tpot" and Router().config["kv_compression"] == 1.0
    with pytest.raises(ValueError, match="decode_choice"):
        Router(decode_choice="fastest")
    with pytest.raises(ValueError, match="kv_compression"):
        Router(kv_compression=0.0)
    with pytest.raises(ValueError, match="kv_compression"):
        ClusterConfig(kv_compression=2.0)
    # On a pool of equal decode instances the seed's score and lowest TPOT both take the
    # smallest batch: the same runs.
    w = _workload()
    a = simulate(w, "slack", reject=True, cluster=BASE, progress=False)
    b = simulate(w, "slack", reject=True, cluster=BASE, progress=False, router_options={"decode_choice": "score"})
    assert (a.attainment, a.ttft_p50) == (b.attainment, b.ttft_p50)


def test_cli_pd_transfer_flags(capsys):
    args = ["simulate", "--scenario", "synthetic", "--shape", "long", "--requests", "100", "--rate", "4", "--instances", "2"]
    args += ["--slo", "5", "--decode-instances", "2", "--policy", "slack", "--reject", "--json"]
    assert main([*args, "--kv-compression", "0.5", "--incremental-transfer", "--decode-choice", "score", "--decode-admission"]) == 0
    assert '"transferred_tokens"' in capsys.readouterr().out


def test_decode_admission_caps_the_batch_and_bounds_tpot():
    cl = dataclasses.replace(BASE, decode_tokens_per_s=1000.0, tpot_slo=0.05)
    adm = dataclasses.replace(cl, decode_admission=True)
    # 0.01 + b / 1000 < 1.2 * 0.05: at most 49 sequences per batch.
    assert adm.max_decode_batch() == 49 and cl.max_decode_batch() is None
    assert dataclasses.replace(adm, decode_tokens_per_s=1e6).max_decode_batch() == 256
    w = records_to_workload(synthetic_trace("chat", requests=1500, rate=30, seed=2), name="chat")
    free = simulate(w, "slack", reject=False, cluster=cl, progress=False)
    capped = simulate(w, "slack", reject=False, cluster=adm, progress=False)
    assert capped.extra["tpot_p99"] <= 0.01 + 49 / 1000.0 + 1e-12
    assert free.extra["tpot_p99"] > capped.extra["tpot_p99"]
