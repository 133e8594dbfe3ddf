"""Mooncake-format traces: parsing, validation, synthetic shapes, and replay through the simulator."""

import json
import os

import numpy as np
import pytest
from kvroute.sim import ClusterConfig, load_trace, records_to_workload, simulate, synthetic_trace, write_trace
from kvroute.sim.trace import MOONCAKE_TRACE, SHAPES, TraceFormatError, find_shared_dir

_SHARED = find_shared_dir(os.path.dirname(os.path.abspath(__file__)))
MOONCAKE = os.path.join(_SHARED, MOONCAKE_TRACE) if _SHARED else ""


def test_round_trip_and_prefix_chaining(tmp_path):
    recs = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1024, "output_length": 7, "hash_ids": [1, 2]},
        {"timestamp": 900, "input_length": 600, "output_length": 1, "hash_ids": [9, 2]},
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(recs, path) == 3
    w = load_trace(path, speedup=2.0)
    assert w.block_size == 512
    assert w.arrival.tolist() == [0.0, 0.25, 0.45]
    assert w.num_tokens.tolist() == [1100, 1024, 600]
    assert w.output_tokens.tolist() == [5, 7, 1]
    a, b, c = (w.request_hashes(i) for i in range(3))
    assert np.array_equal(a[:2], b)  # same ids at the same positions: same sequence hashes
    assert c[1] != a[1]  # id 2 after a different first block is a different prefix
    assert len(set(np.concatenate([a, c]).tolist())) == 5


@pytest.mark.parametrize(
    "line,msg",
    [
        ('{"timestamp": 0, "input_length": 10}', "missing field"),
        ('{"timestamp": -1, "input_length": 10, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "hash_ids": []}', "empty prompt"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [1, 2]}', "at most"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": ["x"]}', "hash_ids"),
        ("[1, 2]", "JSON object"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_lines_are_reported(tmp_path, line, msg):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceFormatError, match=msg):
        load_trace(path)


def test_empty_trace_and_bad_speedup(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(path)
    with pytest.raises(ValueError, match="speedup"):
        records_to_workload([], speedup=0)


def test_unsorted_records_are_ordered_by_arrival():
    recs = [
        {"timestamp": 2000, "input_length": 512, "output_length": 1, "hash_ids": [5]},
        {"timestamp": 1000, "input_length": 1024, "output_length": 2, "hash_ids": [6, 7]},
    ]
    w = records_to_workload(recs)
    assert w.arrival.tolist() == [1.0, 2.0]
    assert w.num_tokens.tolist() == [1024, 512]
    assert len(w.request_hashes(0)) == 2 and len(w.request_hashes(1)) == 1


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_synthetic_shapes_are_valid_mooncake_records(shape, tmp_path):
    recs = synthetic_trace(shape, requests=300, rate=20, seed=3)
    assert recs == synthetic_trace(shape, requests=300, rate=20, seed=3)  # deterministic
    for r in recs:
        assert len(r["hash_ids"]) == -(-r["input_length"] // 512)
    path = tmp_path / f"{shape}.jsonl"
    write_trace(recs, path)
    w = load_trace(path)
    assert len(w) == 300
    assert 0.0 < w.ideal_hit_rate() < 1.0
    json.loads(path.read_text().splitlines()[0])


def test_synthetic_shapes_differ():
    lens = {s: np.mean([r["input_length"] for r in synthetic_trace(s, requests=400, rate=5, seed=0)]) for s in SHAPES}
    assert lens["docs"] > 3 * lens["chat"] and lens["agent"] > 2 * lens["chat"]


def test_bad_synthetic_arguments():
    with pytest.raises(ValueError, match="unknown trace shape"):
        synthetic_trace("nope")
    with pytest.raises(ValueError, match="requests"):
        synthetic_trace("chat", requests=0)


def _replay(w, policies):
    cl = ClusterConfig(instances=4, cache_blocks=400, speed=20000.0, slo=2.0)
    return {p: simulate(w, p, cluster=cl, progress=False) for p in policies}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_replay_synthetic_trace(shape):
    w = records_to_workload(synthetic_trace(shape, requests=600, rate=4, seed=1), name=shape)
    res = _replay(w, ["least_load", "ttft"])
    for r in res.values():
        assert r.requests == 600 and 0.0 <= r.hit_rate <= 1.0 and 0.0 <= r.attainment <= 1.0
        assert r.ttft_p50 <= r.ttft_p99
    # Reading the cache helps on every shape that has reuse.
    assert res["ttft"].hit_rate >= res["least_load"].hit_rate


@pytest.mark.skipif(not (MOONCAKE and os.path.exists(MOONCAKE)), reason="../shared/traces (the Mooncake trace) is not available")
def test_mooncake_trace_loads_and_replays():
    w = load_trace(MOONCAKE)
    assert len(w) == 12031
    assert abs(w.duration - 3537) < 1
    assert abs(w.ideal_hit_rate() - 0.366) < 0.001  # the README's infinite-cache reuse
    part = load_trace(MOONCAKE, limit=2000, speedup=3)
    res = _replay(part, ["least_load", "ttft"])
    assert res["ttft"].hit_rate > res["least_load"].hit_rate
