"""pytest-benchmark suite for the Python-visible hot paths, with Dynamo's equivalents in the same
run when ai-dynamo-runtime is installed (compare with `--benchmark-group-by=group`).

Two indexes: the in-order workload (every session stored whole in 64-block batches, which suits
the index's slab: the `match-*` and `store-*` groups) and, beside it, an engine-like stream whose
caches overflow (`churn_workload`: interleaved small turns, sessions moving between workers,
per-worker LRU caches evicting as they store; the `*-churn` groups).

Run: python -m pytest benches --benchmark-enable --benchmark-group-by=group
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import kvroute
from compare_index import build_dynamo, build_kvroute, match_sessions
from peers import dynamo_available, dynamo_core, dynamo_stored_event, dynamo_tree
from workload import chat_workload, churn_workload, long_sessions

needs_dynamo = pytest.mark.skipif(not dynamo_available(), reason="ai-dynamo-runtime is not installed")
ENTRIES = 300_000


@pytest.fixture(scope="module")
def sessions():
    return chat_workload(64, ENTRIES)


@pytest.fixture(scope="module")
def index(sessions):
    idx = kvroute.KvIndex()
    for s in sessions:
        for i in range(0, len(s.seq), 64):
            idx.store(s.worker, s.seq[i : i + 64], parent=int(s.seq[i - 1]) if i else None)
    return idx


@pytest.fixture(scope="module")
def tree(sessions):
    t = dynamo_tree()
    for k, s in enumerate(sessions):
        seq, loc = s.seq.tolist(), s.local.tolist()
        for i in range(0, len(seq), 64):
            t.apply_event(s.worker, dynamo_stored_event(k, seq[i : i + 64], loc[i : i + 64], seq[i - 1] if i else None))
    return t


@pytest.fixture(scope="module")
def churn():
    return churn_workload(64, ENTRIES, open_sessions=32)


@pytest.fixture(scope="module")
def churn_index(churn):
    return build_kvroute(churn)[0]


@pytest.fixture(scope="module")
def churn_tree(churn):
    return build_dynamo(churn)[0]


TOKENS = np.random.default_rng(1).integers(0, 2**17, size=8192, dtype=np.uint32)


def bench_queries(benchmark, fn, qs: list):
    """Benchmarks `fn` on the queries in turn (one query per call); returns the last answer."""
    it = iter(range(10**9))
    return benchmark(lambda: fn(qs[next(it) % len(qs)]))


@pytest.mark.benchmark(group="hash-8192")
def test_kvroute_block_hashes(benchmark) -> None:
    out = benchmark(kvroute.block_hashes, TOKENS, 64)
    assert len(out) == 128


@needs_dynamo
@pytest.mark.benchmark(group="hash-8192")
def test_dynamo_block_hashes(benchmark) -> None:
    toks = TOKENS.tolist()
    out = benchmark(dynamo_core.compute_block_hash_for_seq, toks, 64)
    assert out == kvroute.local_block_hashes(TOKENS, 64).tolist()


@pytest.mark.parametrize("blocks", [128, 1024])
def test_kvroute_match(benchmark, index, sessions, blocks: int) -> None:
    benchmark.group = f"match-{blocks}"
    qs = [s.seq[:blocks] for s in long_sessions(sessions, blocks)[:64]]
    m = bench_queries(benchmark, index.match, qs)
    assert len(m) >= 1


@needs_dynamo
@pytest.mark.parametrize("blocks", [128, 1024])
def test_dynamo_match(benchmark, tree, sessions, blocks: int) -> None:
    benchmark.group = f"match-{blocks}"
    qs = [s.local[:blocks].tolist() for s in long_sessions(sessions, blocks)[:64]]
    m = bench_queries(benchmark, tree.find_matches, qs)
    assert len(m.scores) >= 1


def test_kvroute_store_64(benchmark, sessions) -> None:
    benchmark.group = "store-64-block-events"
    work = [(s.worker, s.seq[i : i + 64], int(s.seq[i - 1]) if i else None) for s in sessions[:100] for i in range(0, len(s.seq), 64)]

    def build() -> kvroute.KvIndex:
        idx = kvroute.KvIndex()
        for w, hs, p in work:
            idx.store(w, hs, parent=p)
        return idx

    idx = benchmark.pedantic(build, rounds=5)
    assert idx.stats()["entries"] > 0


@needs_dynamo
def test_dynamo_store_64(benchmark, sessions) -> None:
    benchmark.group = "store-64-block-events"
    events = []
    for k, s in enumerate(sessions[:100]):
        seq, loc = s.seq.tolist(), s.local.tolist()
        for i in range(0, len(seq), 64):
            events.append((s.worker, dynamo_stored_event(k, seq[i : i + 64], loc[i : i + 64], seq[i - 1] if i else None)))

    def build():
        t = dynamo_tree()
        for w, e in events:
            t.apply_event(w, e)
        return t

    benchmark.pedantic(build, rounds=5)


@pytest.mark.parametrize("blocks", [128, 1024])
def test_kvroute_match_churn(benchmark, churn_index, churn, blocks: int) -> None:
    benchmark.group = f"match-{blocks}-churn"
    qs = [s.seq[:blocks] for s in match_sessions("churn", churn.sessions, blocks)[:64]]
    m = bench_queries(benchmark, churn_index.match, qs)
    assert len(m) >= 1


@needs_dynamo
@pytest.mark.parametrize("blocks", [128, 1024])
def test_dynamo_match_churn(benchmark, churn_tree, churn, blocks: int) -> None:
    benchmark.group = f"match-{blocks}-churn"
    qs = [s.local[:blocks].tolist() for s in match_sessions("churn", churn.sessions, blocks)[:64]]
    m = bench_queries(benchmark, churn_tree.find_matches, qs)
    assert len(m.scores) >= 1


def test_kvroute_store_remove_churn(benchmark, churn) -> None:
    benchmark.group = "store-remove-churn"
    idx = benchmark.pedantic(lambda: build_kvroute(churn)[0], rounds=3)
    assert idx.stats()["entries"] <= 64 * -(-ENTRIES // 64)  # each of 64 caches at most full


@needs_dynamo
def test_dynamo_store_remove_churn(benchmark, churn) -> None:
    benchmark.group = "store-remove-churn"
    benchmark.pedantic(lambda: build_dynamo(churn)[0], rounds=3)
