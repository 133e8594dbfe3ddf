"""KvIndex API: the contract's edge cases, argument errors, the match mapping, dump/load."""

from __future__ import annotations

from collections.abc import Mapping

import kvroute
import numpy as np
import pytest

H = kvroute.block_hashes(list(range(64 * 8)), 64)  # 8 chained sequence hashes


def test_store_match_and_contiguity() -> None:
    idx = kvroute.KvIndex()
    assert idx.store(1, H) == 8
    assert idx.store(2, H[:3]) == 3
    assert idx.store(2, H[:3]) == 0  # duplicate: nothing new, counted
    assert idx.stats()["duplicate_stores"] == 3
    m = idx.match(H)
    assert dict(m) == {1: 8, 2: 3}
    idx.remove(1, H[4:5])  # a lost middle block cuts the match there
    assert idx.match(H)[1] == 4
    assert len(idx) == 8 and idx.num_blocks(1) == 7 and idx.num_blocks(2) == 3
    assert idx.match([]) == {}
    assert idx.match(H[1:]) == {}, "a query must start at block 0"


def test_match_result_is_a_compact_mapping() -> None:
    idx = kvroute.KvIndex()
    idx.store(10, H[:5])
    idx.store(2**64 - 1, H[:2])
    m = idx.match(H)
    assert isinstance(m, Mapping)
    assert len(m) == 2 and 10 in m and 3 not in m and "x" not in m
    assert m[2**64 - 1] == 2 and m.get(3) is None and m.get(3, -1) == -1
    with pytest.raises(KeyError):
        m[3]
    assert sorted(m.items()) == [(10, 5), (2**64 - 1, 2)]
    assert m == {10: 5, 2**64 - 1: 2}
    assert m.best() == (10, 5)
    ws, ds = m.workers, m.depths
    assert ws.dtype == np.uint64 and ds.dtype == np.uint32
    assert dict(zip(ws.tolist(), ds.tolist())) == m.to_dict()
    with pytest.raises(ValueError):
        ws[0] = 1  # read-only view


def test_parent_continuation_and_orphans() -> None:
    idx = kvroute.KvIndex()
    idx.store(1, H[:2])
    idx.store(1, H[4:], parent=int(H[3]))  # blocks 2..3 not seen yet: kept, not matchable
    assert idx.stats()["orphan_stores"] == 1
    assert idx.match(H)[1] == 2
    assert idx.num_blocks(1) == 6
    idx.store(1, H[2:4], parent=int(H[1]))  # the gap fills: the whole chain matches
    assert idx.match(H)[1] == 8


def test_tiers() -> None:
    idx = kvroute.KvIndex()
    idx.store(1, H, tier="device")
    idx.store(1, H[:3], tier="host")
    idx.store(2, H[:5], tier="disk")
    t = idx.match_tiers(H)
    assert set(t) == {"device", "host", "disk"}
    assert t["device"] == {1: 8} and t["host"] == {1: 3} and t["disk"] == {2: 5}
    assert idx.match(H, tier="host") == {1: 3}
    idx.remove(1, H[:1], tier="device")
    assert idx.match(H, tier="device") == {}
    assert idx.match(H) == {1: 8, 2: 5}


def test_unknown_workers_and_blocks_are_noops() -> None:
    idx = kvroute.KvIndex()
    assert idx.remove(9, H) == 0
    assert idx.clear(9) == 0 and idx.remove_worker(9) == 0 and idx.num_blocks(9) == 0
    idx.store(1, H[:2])
    assert idx.remove(1, kvroute.block_hashes(list(range(1000, 1064)), 64)) == 0
    assert idx.stats()["unknown_removals"] == 8 + 1


def test_clear_and_remove_worker() -> None:
    idx = kvroute.KvIndex()
    idx.store(1, H)
    idx.store(2, H[:4])
    assert idx.clear(1) == 8
    assert len(idx) == 4 and idx.workers() == [1, 2]
    assert idx.remove_worker(2) == 4
    assert len(idx) == 0 and idx.workers() == [1]
    assert idx.stats()["entries"] == 0


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda i: i.store(-1, H), ValueError),
        (lambda i: i.store(2**64, H), ValueError),
        (lambda i: i.store("w", H), TypeError),
        (lambda i: i.store(1.0, H), TypeError),
        (lambda i: i.store(1, [1, -2]), ValueError),
        (lambda i: i.store(1, ["a"]), TypeError),
        (lambda i: i.store(1, np.zeros((2, 2), dtype=np.uint64)), ValueError),
        (lambda i: i.store(1, np.zeros(2, dtype=np.float64)), TypeError),
        (lambda i: i.store(1, H, tier="gpu"), ValueError),
        (lambda i: i.store(1, H, parent=-1), ValueError),
        (lambda i: i.match(None), TypeError),
        (lambda i: i.remove(1, H, tier="ram"), ValueError),
    ],
)
def test_argument_errors(call: object, exc: type) -> None:
    idx = kvroute.KvIndex()
    with pytest.raises(exc):
        call(idx)  # type: ignore[operator]
    assert len(idx) == 0


def test_bad_max_nodes() -> None:
    with pytest.raises(ValueError, match="max_nodes"):
        kvroute.KvIndex(max_nodes=0)


def test_memory_cap_evicts_lru_leaves() -> None:
    idx = kvroute.KvIndex(max_nodes=40)
    chains = [kvroute.block_hashes([k] * 64 * 8, 64) for k in range(20)]
    for k, c in enumerate(chains):
        idx.store(k % 3, c)
        assert len(idx) <= 40
    st = idx.stats()
    assert st["evictions"] > 0 and st["max_nodes"] == 40
    # The most recently stored chain is intact; evicted blocks are never reported.
    assert idx.match(chains[-1]) == {19 % 3: 8}
    for k, c in enumerate(chains):
        assert set(idx.match(c)) <= {k % 3}


def test_matched_chain_survives_eviction() -> None:
    idx = kvroute.KvIndex(max_nodes=30)
    hot = kvroute.block_hashes([999] * 64 * 5, 64)
    idx.store(0, hot)
    for k in range(30):
        idx.store(1, kvroute.block_hashes([k] * 64 * 3, 64))
        assert idx.match(hot) == {0: 5}  # matching keeps it recent


def test_dump_load_round_trip() -> None:
    idx = kvroute.KvIndex()
    for k in range(50):
        idx.store(k % 7, kvroute.block_hashes([k % 5] * 64 + [k] * 64 * 3, 64), tier=kvroute.TIERS[k % 3])
    data = idx.dump()
    back = kvroute.KvIndex.load(data)
    assert back.dump() == data  # byte-identical before anything touches recency
    assert back.stats()["entries"] == idx.stats()["entries"] and len(back) == len(idx)
    for k in range(50):
        q = kvroute.block_hashes([k % 5] * 64 + [k] * 64 * 3, 64)
        assert back.match(q) == idx.match(q)
        assert back.match_tiers(q) == idx.match_tiers(q)


@pytest.mark.parametrize("mutate", [lambda d: d[:-1], lambda d: b"XXXXXXXX" + d[8:], lambda d: d + b"\0", lambda d: b"", lambda d: d[:40]])
def test_load_rejects_corrupt_data(mutate: object) -> None:
    idx = kvroute.KvIndex()
    idx.store(1, H)
    with pytest.raises(ValueError, match="corrupt"):
        kvroute.KvIndex.load(mutate(idx.dump()))  # type: ignore[operator]


def test_repr_and_len() -> None:
    idx = kvroute.KvIndex()
    idx.store(3, H[:2])
    assert repr(idx) == "KvIndex(nodes=2, entries=2, workers=1)"
    assert "3: 2" in repr(idx.match(H))
