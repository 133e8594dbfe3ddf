"""Simulated prefill engines: the seed's LRU and queue arithmetic, and their KV events."""

import random
from collections import OrderedDict

import kvroute
import numpy as np
import pytest
from kvroute import _core


def test_engines_match_seed_ordered_dict_and_index_mirrors_them():
    rng = random.Random(7)
    index = kvroute.KvIndex()
    eng = _core.PrefillEngines([0, 1, 2], capacity_blocks=50, tokens_per_s=1000.0, block_size=4, index=index)
    caches = [OrderedDict() for _ in range(3)]
    busy = [0.0] * 3
    prefixes = [rng.sample(range(10**6), 200) for _ in range(4)]
    t = 0.0
    for _ in range(600):
        t += rng.expovariate(5)
        toks = prefixes[rng.randrange(4)][: rng.randrange(4, 200)] + [rng.randrange(10**6) for _ in range(rng.randrange(0, 9))]
        hs = kvroute.block_hashes(np.asarray(toks, dtype=np.uint32), 4)
        i = rng.randrange(3)
        ks = hs.tolist()
        n = 0
        for k in ks:
            if k not in caches[i]:
                break
            n += 1
        assert eng.hit_blocks(i, hs) == n
        # The index (fed only by the engines' events) agrees with the true caches for every engine.
        m = index.match(hs)
        for j in range(3):
            nj = 0
            for k in ks:
                if k not in caches[j]:
                    break
                nj += 1
            assert m.get(j, 0) == nj
        hit, hit_tokens, start, finish = eng.prefill(i, hs, len(toks), t)
        expect_busy = max(busy[i], t) + (len(toks) - n * 4) / 1000
        assert (hit, hit_tokens, start, finish) == (n, n * 4, max(busy[i], t), expect_busy)
        busy[i] = expect_busy
        for k in ks:
            caches[i][k] = True
            caches[i].move_to_end(k)
        while len(caches[i]) > 50:
            caches[i].popitem(last=False)
        assert eng.cached_blocks(i).tolist() == list(caches[i])
    assert eng.busy_until == busy
    assert eng.events_published > 0


def test_event_lag_delays_the_index():
    index = kvroute.KvIndex()
    eng = _core.PrefillEngines([7], capacity_blocks=10, tokens_per_s=100.0, block_size=2, index=index, event_lag=1.0)
    hs = kvroute.block_hashes([1, 2, 3, 4], 2)
    eng.prefill(0, hs, 4, 0.0)
    assert dict(index.match(hs)) == {}
    assert eng.pending_events == 1
    eng.advance(0.99)
    assert dict(index.match(hs)) == {}
    eng.advance(1.0)
    assert dict(index.match(hs)) == {7: 2}
    eng.clear(0, 1.5)
    eng.flush()
    assert dict(index.match(hs)) == {}


def test_errors():
    with pytest.raises(ValueError, match="distinct"):
        _core.PrefillEngines([1, 1], capacity_blocks=1, tokens_per_s=1.0)
    with pytest.raises(ValueError, match="speed"):
        _core.PrefillEngines([1], capacity_blocks=1, tokens_per_s=0.0)
    with pytest.raises(ValueError, match="event_lag"):
        _core.PrefillEngines([1], capacity_blocks=1, tokens_per_s=1.0, event_lag=-1.0)
    eng = _core.PrefillEngines([1], capacity_blocks=1, tokens_per_s=1.0)
    with pytest.raises(IndexError, match="out of range"):
        eng.prefill(1, [1], 64, 0.0)
    eng.prefill(0, [1], 64, 5.0)
    with pytest.raises(ValueError, match="backwards"):
        eng.prefill(0, [1], 64, 4.0)
    with pytest.raises(ValueError, match="num_tokens"):
        eng.prefill(0, [1], 0, 6.0)
