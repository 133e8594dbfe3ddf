"""kvroute's index and hashing side by side with NVIDIA Dynamo's `RadixTree`, same workload, same run.

Usage: python benches/compare_index.py [--workload interleaved|churn|in-order|vllm-replay] [--quick] [--results FILE]
Prints one table (ours, Dynamo's, ratio); Dynamo columns are skipped if ai-dynamo-runtime is absent.
`--workload vllm-replay` replays a KV-event stream recorded from a real vLLM engine
(`benches/record_vllm_events.py`; `--events PATH`) through both indexes, then matches its prompts.
Concurrent reads are measured on the core (`cargo bench -p kvroute-core --bench concurrency`):
Python threads cannot show them for ~1 us calls, since the GIL hand-off costs more than the call.
"""

from __future__ import annotations

import argparse
import base64
import gc
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import kvroute
import results_file
from peers import dynamo_available, dynamo_core, dynamo_scores, dynamo_stored_event, dynamo_tree
from workload import Stream, chat_workload, churn_workload, in_order_stream, interleaved_workload, long_sessions


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def time_calls(fn, args_list, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        for a in args_list:
            t = time.perf_counter_ns()
            fn(a)
            out.append((time.perf_counter_ns() - t) / 1000)
    return out


def store_args(stream: Stream) -> list[tuple[int, np.ndarray, int | None, list[int]]]:
    """The stream's stores as `KvIndex.store` arguments (worker, hashes, parent), each with the
    blocks the worker evicted just before it (empty unless the workload has a cache capacity)."""
    out = []
    for st in stream.stores:
        seq = stream.sessions[st.session].seq
        out.append((st.worker, seq[st.start : st.end], int(seq[st.start - 1]) if st.start else None, st.evicted))
    return out


def dynamo_events(stream: Stream) -> list[tuple[int, bytes]]:
    """Dynamo's router events for the stream: before a store, one `removed` event with the blocks
    its worker evicted (where there are any), as kvroute gets them in one `remove` call."""
    lists = [(s.seq.tolist(), s.local.tolist()) for s in stream.sessions]
    out = []
    eid = 0
    for st in stream.stores:
        if st.evicted:
            out.append((st.worker, json.dumps({"event_id": eid, "data": {"removed": {"block_hashes": st.evicted}}}).encode()))
            eid += 1
        seq, loc = lists[st.session]
        parent = seq[st.start - 1] if st.start else None
        out.append((st.worker, dynamo_stored_event(eid, seq[st.start : st.end], loc[st.start : st.end], parent)))
        eid += 1
    return out


def stream_blocks(stream: Stream) -> int:
    """Blocks the stream stores plus blocks it removes."""
    return sum(st.end - st.start + len(st.evicted) for st in stream.stores)


def apply_kvroute(idx: kvroute.KvIndex, work: list[tuple[int, np.ndarray, int | None, list[int]]]) -> None:
    """Applies `store_args` to `idx`: each store's evictions (one `remove` call), then the store."""
    for w, hs, p, gone in work:
        if gone:
            idx.remove(w, gone)
        idx.store(w, hs, parent=p)


def build_kvroute(stream: Stream) -> tuple[kvroute.KvIndex, float, int]:
    idx = kvroute.KvIndex()
    work = store_args(stream)
    t = time.perf_counter()
    apply_kvroute(idx, work)
    dt = time.perf_counter() - t
    return idx, dt, stream_blocks(stream)


def build_dynamo(stream: Stream):
    tree = dynamo_tree()
    events = dynamo_events(stream)
    blocks = stream_blocks(stream)
    t = time.perf_counter()
    for w, e in events:
        tree.apply_event(w, e)
    return tree, time.perf_counter() - t, blocks


DEFAULT_EVENTS = Path(__file__).parent / "data" / "vllm_events.json.gz"
STORE_BUILDS = 3


class Recording:
    """A recorded vLLM event stream (`record_vllm_events.py`) in the forms both indexes take: our
    msgpack batch payloads as the engine sent them, Dynamo's JSON router events with the same blocks
    (engine block hashes mapped to ids, token hashes computed as its vLLM integration does), and
    the prompt of every stored chain as a match query (our sequence hashes, Dynamo's local hashes)."""

    def __init__(self, path: Path) -> None:
        import msgspec

        with gzip.open(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
        self.meta = {k: v for k, v in doc.items() if k != "batches"}
        self.block_size = int(doc["block_size"])
        self.payloads = [base64.b64decode(b) for b in doc["batches"]]
        ids: dict[object, int] = {}
        tokens_of: dict[int, list[int]] = {}  # engine block id -> the token ids of its whole prefix
        chain_of: dict[int, list[int]] = {}  # engine block id -> the ids of its prefix's blocks
        self.dynamo: list[bytes] = []
        self.stored = self.removed = 0
        leaves: dict[int, None] = {}
        eid = 0
        for payload in self.payloads:
            batch = msgspec.msgpack.decode(payload)
            for ev in batch[1]:
                kind, fields = (ev.get("type"), ev) if isinstance(ev, dict) else (ev[0], None)
                eid += 1
                if kind == "BlockStored":
                    hashes, parent, toks = (
                        (fields["block_hashes"], fields["parent_block_hash"], fields["token_ids"]) if fields else (ev[1], ev[2], ev[3])
                    )
                    bs = self.block_size
                    if len(toks) != len(hashes) * bs:
                        raise ValueError(f"event {eid}: {len(toks)} token ids for {len(hashes)} blocks of {bs}")
                    pid = None if parent is None else ids.setdefault(parent, len(ids) + 1)
                    prefix = tokens_of.get(pid, []) if pid is not None else []
                    chain = chain_of.get(pid, []) if pid is not None else []
                    local = kvroute.local_block_hashes(np.asarray(toks, dtype=np.uint32), bs).tolist()
                    blocks = []
                    for k, h in enumerate(hashes):
                        bid = ids.setdefault(h, len(ids) + 1)
                        prefix = prefix + toks[k * bs : (k + 1) * bs]
                        tokens_of[bid] = prefix
                        chain = [*chain, bid]
                        chain_of[bid] = chain
                        blocks.append({"block_hash": bid, "tokens_hash": local[k]})
                    if pid is not None:
                        leaves.pop(pid, None)
                    leaves[blocks[-1]["block_hash"]] = None
                    self.stored += len(hashes)
                    self.dynamo.append(json.dumps({"event_id": eid, "data": {"stored": {"parent_hash": pid, "blocks": blocks}}}).encode())
                elif kind == "BlockRemoved":
                    hashes = fields["block_hashes"] if fields else ev[1]
                    gone = [ids.setdefault(h, len(ids) + 1) for h in hashes]
                    self.removed += len(gone)
                    self.dynamo.append(json.dumps({"event_id": eid, "data": {"removed": {"block_hashes": gone}}}).encode())
                elif kind == "AllBlocksCleared":
                    self.dynamo.append(json.dumps({"event_id": eid, "data": "cleared"}).encode())
                else:
                    raise ValueError(f"event {eid}: unknown vLLM KV event {kind!r}")
        # Queries: every stored chain's prompt, from block 0 to the end of each store's last block.
        self.query_blocks = [chain_of[b] for b in leaves]  # engine block ids of each query, from block 0
        prompts = [np.asarray(tokens_of[b], dtype=np.uint32) for b in leaves]
        self.q_seq = [kvroute.block_hashes(t, self.block_size) for t in prompts]
        self.q_loc = [kvroute.local_block_hashes(t, self.block_size).tolist() for t in prompts]


def replay_kvroute(rec: Recording) -> tuple[kvroute.KvIndex, float]:
    idx = kvroute.KvIndex()
    t = time.perf_counter()
    for p in rec.payloads:
        idx.apply_event_batch(0, p, block_size=rec.block_size)
    return idx, time.perf_counter() - t


def replay_dynamo(rec: Recording):
    tree = dynamo_tree()
    t = time.perf_counter()
    for e in rec.dynamo:
        tree.apply_event(0, e)
    return tree, time.perf_counter() - t


def vllm_replay(path: Path, dyn: bool, row) -> dict:
    """Replays the recording through both indexes (best of 20 fresh replays each), then times a
    match of every stored chain's prompt against the final state; answers compared first."""
    rec = Recording(path)
    blocks = rec.stored + rec.removed
    ours = [replay_kvroute(rec) for _ in range(20)]
    idx = ours[-1][0]
    theirs = [replay_dynamo(rec) for _ in range(20)] if dyn else None
    row(
        "replay vLLM events, stored + removed blocks/s (best of 20)",
        blocks / min(t for _, t in ours),
        blocks / min(t for _, t in theirs) if theirs else None,
        "blocks/s",
    )
    if theirs:
        tree = theirs[-1][0]
        for q, ql in zip(rec.q_seq, rec.q_loc):
            assert dict(idx.match(q)) == dynamo_scores(tree, ql), "kvroute and Dynamo disagree on a replayed prompt"
    depths = [dict(idx.match(q)).get(0, 0) for q in rec.q_seq]
    ours_t = time_calls(idx.match, rec.q_seq, 50)
    theirs_t = time_calls(tree.find_matches, rec.q_loc, 50) if theirs else None
    row("replayed prompts: match p50 (us)", statistics.median(ours_t), statistics.median(theirs_t) if theirs_t else None, "us")
    row("replayed prompts: match p99 (us)", percentile(ours_t, 0.99), percentile(theirs_t, 0.99) if theirs_t else None, "us")
    return {
        **rec.meta,
        "batches": len(rec.payloads),
        "events": len(rec.dynamo),
        "blocks_stored": rec.stored,
        "blocks_removed": rec.removed,
        "queries": len(rec.q_seq),
        "query_blocks_mean": statistics.mean(len(q) for q in rec.q_seq),
        "matched_blocks_mean": statistics.mean(depths),
    }


def make_streams(workload: str, workers: int, entries: int) -> list[tuple[str, Stream]]:
    """(label, stream) pairs to build; the last one is the index that is matched against."""
    if workload == "in-order":
        sessions = chat_workload(workers, entries)
        return [(f"{b}-block events", in_order_stream(sessions, b)) for b in (16, 64)]
    # A smaller stream (--quick) keeps fewer sessions open, so that some still reach 1024 blocks.
    open_sessions = 128 if entries >= 1_000_000 else 32
    if workload == "churn":
        return [("churn: stores + removals", churn_workload(workers, entries, open_sessions=open_sessions))]
    return [("interleaved turns", interleaved_workload(workers, entries, open_sessions=open_sessions))]


def match_sessions(workload: str, sessions: list, blocks: int) -> list:
    """The sessions whose first `blocks` blocks are the match queries. Under churn, the most
    recently opened ones (what a router is asked about: conversations still in the caches, though
    some of their blocks may have been evicted since); otherwise the first ones."""
    if workload == "churn":
        return long_sessions(sessions[::-1], blocks)[:300]
    return long_sessions(sessions, blocks)[:300]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(which: str, workload: str, workers: int, entries: int) -> None:
    """Runs in a subprocess: RSS growth from building the index, per (block, worker) entry."""
    stream = make_streams(workload, workers, entries)[-1][1]
    if which == "dynamo":  # events are built before measuring, then dropped as they are applied
        tree = dynamo_tree()
        evs = dynamo_events(stream)
        del stream
        gc.collect()
        before = rss_bytes() - sum(len(e) for _, e in evs)
        for k in range(len(evs)):
            tree.apply_event(*evs[k])
            evs[k] = None  # type: ignore[call-overload]
        gc.collect()
        print(json.dumps({"used": rss_bytes() - before}))
        return
    work = store_args(stream)
    gc.collect()
    before = rss_bytes()
    idx = kvroute.KvIndex()
    apply_kvroute(idx, work)
    used = rss_bytes() - before
    st = idx.stats()
    print(json.dumps({"used": used, "entries": st["entries"], "estimated": st["estimated_bytes"]}))


def measure_memory(which: str, workload: str, workers: int, entries: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", which, workload, str(workers), str(entries)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller workload (~200k entries) for a fast check")
    ap.add_argument("--results", type=Path, metavar="FILE", help="also write a results file (benches/results/compare_index.json)")
    ap.add_argument(
        "--workload",
        choices=["interleaved", "churn", "in-order", "vllm-replay"],
        default="interleaved",
        help="interleaved: small turns of many open sessions, as engines publish them (default); "
        "churn: the same with each worker's cache an LRU of 1/W of the entries, evicting (removal "
        "events) as it stores, for three times the entries; "
        "in-order: each session stored whole in 16- or 64-block batches; "
        "vllm-replay: a KV-event stream recorded from a real vLLM engine (--events)",
    )
    ap.add_argument("--events", type=Path, default=DEFAULT_EVENTS, help=f"the recorded stream for vllm-replay (default {DEFAULT_EVENTS})")
    ap.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.memory_child:
        memory_child(a.memory_child[0], a.memory_child[1], int(a.memory_child[2]), int(a.memory_child[3]))
        return
    entries = 200_000 if a.quick else 1_000_000
    dyn = dynamo_available()
    rows: list[tuple[str, float, float | None, str]] = []  # (metric, ours, theirs, unit)

    def row(name: str, ours: float, theirs: float | None, unit: str) -> None:
        rows.append((name, ours, theirs, unit))

    # Hashing: an 8192-token prompt, block 64.
    toks = np.random.default_rng(1).integers(0, 2**17, size=8192, dtype=np.uint32)
    tl = toks.tolist()
    ours = statistics.median(time_calls(lambda t: kvroute.block_hashes(t, 64), [toks], 2000))
    ours_list = statistics.median(time_calls(lambda t: kvroute.block_hashes(t, 64), [tl], 500))
    theirs = statistics.median(time_calls(lambda t: dynamo_core.compute_block_hash_for_seq(t, 64), [tl], 500)) if dyn else None
    row("block_hashes 8192 tok, uint32 array (us p50)", ours, theirs, "us")
    row("block_hashes 8192 tok, list (us p50)", ours_list, theirs, "us")

    if a.workload == "vllm-replay":
        if not a.events.exists():
            sys.exit(f"compare_index: no recorded stream at {a.events}; record one with benches/record_vllm_events.py")
        print(json.dumps(vllm_replay(a.events, dyn, row)))
    for workers in (8, 64) if a.workload != "vllm-replay" else ():
        streams = make_streams(a.workload, workers, entries)
        sessions = streams[-1][1].sessions
        tree = None
        for label, stream in streams:
            # Best of STORE_BUILDS fresh builds each, alternating: one build takes ~0.1 s, which
            # a loaded host's scheduling can halve for either index at random.
            ours = theirs = 0.0
            for _ in range(STORE_BUILDS):
                idx = None
                idx, dt, n = build_kvroute(stream)
                ours = max(ours, n / dt)
                if dyn:
                    tree = None
                    tree, dt2, n2 = build_dynamo(stream)
                    theirs = max(theirs, n2 / dt2)
            row(f"W={workers} store, {label} (blocks/s, best of {STORE_BUILDS})", ours, theirs if dyn else None, "blocks/s")
        for blocks in (128, 1024):
            qs = match_sessions(a.workload, sessions, blocks)
            q_seq = [s.seq[:blocks] for s in qs]
            q_loc = [s.local[:blocks].tolist() for s in qs]
            assert all(len(idx.match(q)) >= 1 for q in q_seq)
            if tree is not None:  # same answers before timing
                for s, ql in zip(qs[:20], q_loc[:20]):
                    assert dict(idx.match(s.seq[:blocks])) == dynamo_scores(tree, ql)
            if a.workload == "churn":  # some queries' blocks were evicted since: how deep they match
                depth = statistics.mean(max(dict(idx.match(q)).values(), default=0) for q in q_seq)
                row(f"W={workers} match {blocks} blocks: mean depth matched", depth, None, "blocks")
            ours_t = time_calls(idx.match, q_seq, 5)
            theirs_t = time_calls(tree.find_matches, q_loc, 5) if tree is not None else None
            row(
                f"W={workers} match {blocks} blocks p50 (us)",
                statistics.median(ours_t),
                statistics.median(theirs_t) if theirs_t else None,
                "us",
            )
            row(
                f"W={workers} match {blocks} blocks p99 (us)",
                percentile(ours_t, 0.99),
                percentile(theirs_t, 0.99) if theirs_t else None,
                "us",
            )
        del tree
        if workers == 64:
            mo = measure_memory("kvroute", a.workload, workers, entries)
            md = measure_memory("dynamo", a.workload, workers, entries) if dyn else None
            row(
                "W=64 memory, RSS bytes per (block, worker) entry",
                mo["used"] / mo["entries"],
                md["used"] / mo["entries"] if md else None,
                "B",
            )
            row("W=64 memory, kvroute's own estimate per entry", mo["estimated"] / mo["entries"], None, "B")
        del idx

    size = f", ~{entries:,} (block, worker) entries" if a.workload != "vllm-replay" else ""
    print(
        f"\nkvroute {kvroute.__version__} vs Dynamo {'1.6.1 RadixTree' if dyn else '(not installed)'}; {a.workload} workload{size}; {os.cpu_count()} cores\n"
    )
    w = max(len(r[0]) for r in rows)
    print(f"{'metric':<{w}}  {'kvroute':>12}  {'dynamo':>12}  {'ratio':>8}")
    for name, ours, theirs, unit in rows:
        if theirs is None:
            ratio = ""
        elif unit == "blocks/s":
            ratio = f"{ours / theirs:.1f}x"
        else:
            ratio = f"{theirs / ours:.1f}x"
        fmt = (lambda v: f"{v / 1e6:.2f}M") if unit == "blocks/s" else (lambda v: f"{v:.2f}")
        print(f"{name:<{w}}  {fmt(ours):>12}  {fmt(theirs) if theirs is not None else '-':>12}  {ratio:>8}")
    print("\nratio: how many times better kvroute is (lower latency/memory, higher throughput)")
    if a.results:
        doc = results_file.header("compare_index", results_file.command("compare_index.py"))
        doc["workload"], doc["entries"] = a.workload, (entries if a.workload != "vllm-replay" else None)
        doc["dynamo"] = "ai-dynamo-runtime 1.6.1 RadixTree" if dyn else None
        doc["rows"] = [{"metric": n, "kvroute": o, "dynamo": t, "unit": u} for n, o, t, u in rows]
        results_file.write(str(a.results), doc)
        print(f"wrote {a.results}")


if __name__ == "__main__":
    main()
