"""The index benchmarks' event streams (`benches/workload.py`) are what a real engine could publish:
a store's parent is held by the storing worker, nothing is stored twice, an eviction removes only
blocks the worker holds, deepest first, and a cache never holds more than its capacity. Replayed
through `KvIndex`, every worker's block count matches the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import kvroute
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
from workload import churn_workload, interleaved_workload


@pytest.mark.parametrize("workers", [1, 4, 16])
def test_churn_stream_is_one_an_lru_engine_could_publish(workers: int) -> None:
    entries = 20_000
    stream = churn_workload(workers, entries, seed=workers, open_sessions=16)
    cap = -(-entries // workers)
    held: list[set[int]] = [set() for _ in range(workers)]
    kids: list[dict[int, int]] = [{} for _ in range(workers)]  # children each held block has
    parent_of: dict[int, int | None] = {}
    idx = kvroute.KvIndex()
    stored = removed = 0
    for st in stream.stores:
        h, k = held[st.worker], kids[st.worker]
        for x in st.evicted:
            assert x in h, "an eviction removes a block its worker holds"
            assert k.get(x, 0) == 0, "deepest block first: nothing the worker holds extends it"
            h.remove(x)
            p = parent_of[x]
            if p is not None:
                k[p] -= 1
        if st.evicted:
            idx.remove(st.worker, st.evicted)
        seq = stream.sessions[st.session].seq
        parent = int(seq[st.start - 1]) if st.start else None
        assert parent is None or parent in h, "a store's parent is held by the storing worker"
        for i in range(st.start, st.end):
            x, p = int(seq[i]), (int(seq[i - 1]) if i else None)
            assert x not in h, "nothing is stored twice"
            h.add(x)
            parent_of[x] = p
            if p is not None:
                k[p] = k.get(p, 0) + 1
        idx.store(st.worker, seq[st.start : st.end], parent=parent)
        assert len(h) <= cap
        stored += st.end - st.start
        removed += len(st.evicted)
    assert stored >= 3 * entries and removed >= stored - workers * cap
    for w in range(workers):
        assert idx.num_blocks(w) == len(held[w])
    # The most recent sessions stored are where the stream left them: on their last worker.
    for s in [s for s in stream.sessions if len(s.seq)][-4:]:
        m = dict(idx.match(s.seq))
        assert m.get(s.worker, 0) >= 1


def test_without_a_capacity_nothing_is_evicted_and_the_stream_is_unchanged() -> None:
    a = interleaved_workload(4, 5_000, seed=3, open_sessions=8)
    b = interleaved_workload(4, 5_000, seed=3, open_sessions=8, capacity=None)
    assert [(s.worker, s.session, s.start, s.end) for s in a.stores] == [(s.worker, s.session, s.start, s.end) for s in b.stores]
    assert not any(s.evicted for s in a.stores)


def test_replay_capped_oracle_keeps_its_balance_bound_and_otherwise_follows_the_cache() -> None:
    """`benches/replay_hit_rate.py`'s `best-prefix<=X`: the longest cached prefix unless that engine's
    prompt tokens would pass X times the mean; the bound holds once one request is small beside the total
    (before that neither engine may be able to keep it, and the lighter one takes the request)."""
    from types import SimpleNamespace

    from replay_hit_rate import LruCache, placements

    place = placements([], seed=0, caps=(1.3,))["best-prefix<=1.3"]
    caches = [LruCache(1000), LruCache(1000)]
    caches[0].store([1, 2, 3])  # engine 0 holds the shared prefix
    tokens = [0, 0]
    picks = []
    for i in range(40):
        p = SimpleNamespace(hashes=[1, 2, 3, 100 + i], num_tokens=128)
        e = place(0, p, caches, tokens)
        picks.append(e)
        tokens[e] += p.num_tokens
        if i >= 5:
            assert max(tokens) / (sum(tokens) / 2) <= 1.3 + 1e-9
    # The cache is followed as far as the bound allows: 1.3x the mean is 65% of the tokens on engine 0.
    assert picks[0] == 0 and 0.6 <= picks.count(0) / len(picks) <= 0.65
    # Equal prefixes: the lighter engine.
    assert place(0, SimpleNamespace(hashes=[7], num_tokens=10), [LruCache(10), LruCache(10)], [50, 20]) == 1
