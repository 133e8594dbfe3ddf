"""Benchmark: decode-and-apply of KV-event batches, in blocks/s, against Dynamo's RadixTree.apply_event.
Same engine events for both, block size 16; ours from vLLM-format msgpack bytes, Dynamo's from its JSON.

Ours decodes each batch payload, recomputes the sequence hashes from the token ids and updates the
index and the engine-hash map. Dynamo (ai-dynamo-runtime 1.6.1) is handed one JSON KvCacheEvent per
engine event with the block and token hashes already computed, which is its router's input format:
``{"event_id", "data": {"stored": {"parent_hash", "blocks": [{"block_hash", "tokens_hash"}]}}}`` and
``{"event_id", "data": {"removed": {"block_hashes": [...]}}}``.

Run: ``python benches/bench_events.py`` (prints ours, Dynamo's and the ratio; ``--results FILE`` also
writes a results file, benches/results/bench_events.json), or via pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import kvroute
import msgspec

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/tests/support")
from fake_engine import VllmBlockRemoved, VllmBlockStored, VllmEventBatch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_file

BLOCK_SIZE = 16


def make_workload(workers=4, batches=100, events_per_batch=16, seed=0):
    """Per worker, a stream of vLLM batches: stores continuing earlier chains or starting new ones
    (1..32 blocks each), and removals of earlier blocks (~20% of events)."""
    rng = random.Random(seed)
    ours: list[tuple[int, bytes]] = []
    theirs: list[tuple[int, bytes]] = []
    blocks = 0
    for w in range(workers):
        chains: list[list[int]] = []  # each a root-to-leaf chain of engine hashes
        eid = 0
        for _ in range(batches):
            events = []
            for _ in range(events_per_batch):
                eid += 1
                if chains and rng.random() < 0.2:
                    # Evict leaf-first, as an LRU prefix cache does.
                    c = rng.randrange(len(chains))
                    gone = [chains[c].pop() for _ in range(min(4, len(chains[c])))]
                    if not chains[c]:
                        chains.pop(c)
                    events.append(VllmBlockRemoved(gone, "GPU"))
                    theirs.append((w, json.dumps({"event_id": eid, "data": {"removed": {"block_hashes": gone}}}).encode()))
                    blocks += len(gone)
                    continue
                n = rng.randrange(1, 33)
                chain = rng.choice(chains) if chains and rng.random() < 0.5 else None
                parent = chain[-1] if chain else None
                hashes = [rng.getrandbits(64) for _ in range(n)]
                tokens = [rng.randrange(32000) for _ in range(n * BLOCK_SIZE)]
                locals_ = kvroute.local_block_hashes(tokens, BLOCK_SIZE).tolist()
                events.append(VllmBlockStored(hashes, parent, tokens, BLOCK_SIZE, None, "GPU", None))
                blk = [{"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, locals_)]
                theirs.append((w, json.dumps({"event_id": eid, "data": {"stored": {"parent_hash": parent, "blocks": blk}}}).encode()))
                if chain is None:
                    chains.append(list(hashes))
                else:
                    chain.extend(hashes)
                blocks += n
            ours.append((w, msgspec.msgpack.encode(VllmEventBatch(time.time(), events, 0))))
    return ours, theirs, blocks


def time_ours(ours, reps):
    times = []
    for _ in range(reps):
        idx = kvroute.KvIndex()
        t0 = time.perf_counter()
        for w, payload in ours:
            idx.apply_event_batch(w, payload, block_size=BLOCK_SIZE)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), idx


def time_dynamo(theirs, reps):
    from dynamo._core import RadixTree

    times = []
    for _ in range(reps):
        tree = RadixTree()
        t0 = time.perf_counter()
        for w, ev in theirs:
            tree.apply_event(w, ev)
        tree.find_matches([0])  # its writes are queued to a background thread: wait for them
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(reps=5, **kw):
    ours, theirs, blocks = make_workload(**kw)
    t_ours, idx = time_ours(ours, reps)
    result = {"blocks": blocks, "ours_blocks_per_s": blocks / t_ours, "index_nodes": len(idx)}
    try:
        t_dyn = time_dynamo(theirs, reps)
    except ImportError:
        result["dynamo_blocks_per_s"] = None
        return result
    result["dynamo_blocks_per_s"] = blocks / t_dyn
    result["ratio"] = t_dyn / t_ours
    return result


def test_bench_events_vs_dynamo(benchmark):
    r = benchmark.pedantic(run, kwargs={"reps": 1, "batches": 20}, rounds=1, iterations=1)
    assert r["ours_blocks_per_s"] > 0 and r["index_nodes"] > 0
    print(r)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="runs per side; the median is reported (default 5)")
    ap.add_argument("--results", metavar="FILE", help="also write a results file (benches/results/bench_events.json)")
    a = ap.parse_args()
    if a.reps < 1:
        ap.error("--reps must be >= 1")
    r = run(reps=a.reps)
    print(f"blocks per run: {r['blocks']}  (block size {BLOCK_SIZE}, median of {a.reps} runs)")
    print(f"kvroute apply_event_batch: {r['ours_blocks_per_s'] / 1e6:.2f} M blocks/s")
    if r["dynamo_blocks_per_s"] is None:
        print("Dynamo RadixTree.apply_event: not installed (pip install ai-dynamo-runtime==1.6.1)")
    else:
        print(f"Dynamo RadixTree.apply_event: {r['dynamo_blocks_per_s'] / 1e6:.2f} M blocks/s")
        print(f"ratio (ours / Dynamo): {r['ratio']:.2f}x")
    if a.results:
        doc = results_file.header("bench_events", results_file.command("bench_events.py"))
        doc["setup"] = f"4 workers, 100 batches of 16 events (stores and removals), block size {BLOCK_SIZE}, median of {a.reps} runs"
        doc.update(r)
        results_file.write(a.results, doc)
        print(f"wrote {a.results}")
